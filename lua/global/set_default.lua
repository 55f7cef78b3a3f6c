-- set_default: the escrow of every key of the policy without a book (bucket.rs
-- DefaultEscrow::change): keys settle lazily, a stretch before the change at the smallest
-- default ever in force before it.
--
-- KEYS[1]  meta hash   KEYS[2]  the coordinator's fencing key
-- ARGV     fencing token, escrow, keep_ms, [now_us: TESTS ONLY]
-- Returns  1 if the default changed, else 0.
if #KEYS ~= 2 or (#ARGV ~= 3 and #ARGV ~= 4) then
  return redis.error_reply('ERR quotad set_default: expected 2 keys and 3 or 4 arguments')
end
if fenced(KEYS[2], ARGV[1]) then return redis.error_reply(FENCED) end
local escrow = tonumber(ARGV[2])
-- Re-asserted every round, so the meta hash outlives every key of the policy.
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
local m = redis.call('HMGET', KEYS[1], 'd', 'dp')
local d = tonumber(m[1])
if d == nil then
  redis.call('HSET', KEYS[1], 'd', fmt(escrow), 'dp', fmt(escrow))
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
  return 1
end
if d == escrow then return 0 end
local before = math.min(num(m[2], d), d)
local now = redis_now(ARGV[4])
redis.call('HSET', KEYS[1], 'd', fmt(escrow), 'dp', fmt(before), 'dt', string.format('%d', now))
return 1
