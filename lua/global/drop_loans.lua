-- drop_loans: after a failover (a new replication ID) every loan goes: the promoted copy may
-- hold loans the old primary had dropped, and dropping a loan is always safe
-- (bucket.rs KeySlot::drop_loans).
--
-- KEYS[1]  the key's hash   KEYS[2]  meta hash   KEYS[3]  the coordinator's fencing key
-- ARGV     fencing token, rho, burst, tol, fallback escrow, keep_ms, [now_us: TESTS ONLY]
-- Returns  1 if loans were dropped, else 0.
if #KEYS ~= 3 or (#ARGV ~= 6 and #ARGV ~= 7) then
  return redis.error_reply('ERR quotad drop_loans: expected 3 keys and 6 or 7 arguments')
end
if fenced(KEYS[3], ARGV[1]) then return redis.error_reply(FENCED) end
local key = KEYS[1]
local rho, burst, tol, fallback, keep_ms = shape_args(2)
local now = redis_now(ARGV[7])
local d = load_default(KEYS[2], fallback)
local s = load_slot(key)
settle(s, d, rho, burst, now)
if not s.book or #s.book.loans == 0 then
  save_bucket(key, s)
  return 0
end
s.book.loans = {}
s.book.ep = s.book.ep + 1
clamp(s, d, rho, burst, tol, now)
save_book(key, s.book)
save_bucket(key, s)
expire(key, s, d, rho, burst, tol, now, keep_ms)
return 1
