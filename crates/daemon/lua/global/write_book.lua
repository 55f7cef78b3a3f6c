-- write_book: the coordinator replaces a key's lease book (bucket.rs KeySlot::write_book):
-- the bucket settles at the old rate first, the high-water mark only rises, loans from
-- before a step this store saw stay out (epoch), the bucket is clamped to the new share.
--
-- KEYS[1]  the key's hash   KEYS[2]  meta hash   KEYS[3]  the coordinator's fencing key
-- KEYS[4]  the policy's set of keys with a book
-- ARGV     fencing token, rho, burst, tol, fallback escrow, keep_ms, user key,
--          escrow, reservations, loans, high water ('' = none), epoch, [now_us: TESTS ONLY]
-- Returns  the key's epoch after the write; error FENCED if another instance holds the lock.
if #KEYS ~= 4 or (#ARGV ~= 12 and #ARGV ~= 13) then
  return redis.error_reply('ERR quotad write_book: expected 4 keys and 12 or 13 arguments')
end
if fenced(KEYS[3], ARGV[1]) then return redis.error_reply(FENCED) end
local key = KEYS[1]
local rho, burst, tol, fallback, keep_ms = shape_args(2)
local now = redis_now(ARGV[13])
local d = load_default(KEYS[2], fallback)
local s = load_slot(key)
touch(s, d, rho, burst, tol, now)
settle(s, d, rho, burst, now)

local incoming = {
  escrow = tonumber(ARGV[8]),
  res = parse_list(ARGV[9], 4),
  loans = parse_list(ARGV[10], 5),
  hw = num(ARGV[11], -math.huge),
  ep = tonumber(ARGV[12]),
}
if s.book then
  if s.book.hw > incoming.hw then incoming.hw = s.book.hw end
  if incoming.ep < s.book.ep then
    incoming.loans = {}
    incoming.ep = s.book.ep
  end
end
s.book = incoming
clamp(s, d, rho, burst, tol, now)

redis.call('HSET', key, 'e', fmt(incoming.escrow), 'r', ARGV[9])
save_book(key, s.book)
save_bucket(key, s)
expire(key, s, d, rho, burst, tol, now, keep_ms)
redis.call('SADD', KEYS[4], ARGV[7])
redis.call('PEXPIRE', KEYS[4], keep_ms)
return incoming.ep
