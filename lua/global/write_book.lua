-- write_book: the coordinator replaces the lease books of one or more keys of a policy
-- (bucket.rs KeySlot::write_book, once per key, in order): each key's bucket settles at the
-- old rate first, the high-water mark only rises, loans from before a step this store saw
-- stay out (epoch), the bucket is clamped to the new share.
--
-- Many books per call: the fence, the policy's default and the time are read once, and
-- each key's hash is written with one HSET. A round rewrites every engaged key's book, so
-- this is most of what a coordinator costs its Redis (docs/global-budgets.md, At scale).
--
-- KEYS[1]  meta hash   KEYS[2]  the coordinator's fencing key
-- KEYS[3]  the policy's set of keys with a book   KEYS[3 + i]  the i-th key's hash
-- ARGV     fencing token, rho, burst, tol, fallback escrow, keep_ms, then per key:
--          user key, escrow, reservations, loans, high water ('' = none), epoch;
--          [now_us: TESTS ONLY]
-- Returns  each key's epoch after the write; error FENCED if another instance holds the lock.
local n = #KEYS - 3
local extra = #ARGV - 6 - 6 * n
if n < 1 or (extra ~= 0 and extra ~= 1) then
  return redis.error_reply('ERR quotad write_book: expected 3 + n keys and 6 + 6n (+1) arguments')
end
if fenced(KEYS[2], ARGV[1]) then return redis.error_reply(FENCED) end
local rho, burst, tol, fallback, keep_ms = shape_args(2)
local now = redis_now(ARGV[7 + 6 * n])
local d = load_default(KEYS[1], fallback)

local epochs, members = {}, {}
for i = 1, n do
  local key = KEYS[3 + i]
  local a = 7 + 6 * (i - 1)
  local s = load_slot(key)
  touch(s, d, rho, burst, tol, now)
  settle(s, d, rho, burst, now)

  local incoming = {
    escrow = tonumber(ARGV[a + 1]),
    res = parse_list(ARGV[a + 2], 4),
    loans = parse_list(ARGV[a + 3], 5),
    hw = num(ARGV[a + 4], -math.huge),
    ep = tonumber(ARGV[a + 5]),
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

  -- What save_book and save_bucket write, in one command.
  local fields = {'e', fmt(incoming.escrow), 'r', ARGV[a + 2],
    'l', loans_string(incoming.loans), 'ep', string.format('%d', incoming.ep)}
  if incoming.hw > -math.huge then
    fields[#fields + 1] = 'hw'
    fields[#fields + 1] = string.format('%d', incoming.hw)
  end
  if s.tokens ~= nil then
    fields[#fields + 1] = 't'
    fields[#fields + 1] = fmt(s.tokens)
    fields[#fields + 1] = 'ts'
    fields[#fields + 1] = string.format('%d', s.ts)
  end
  redis.call('HSET', key, unpack(fields))
  expire(key, s, d, rho, burst, tol, now, keep_ms)
  members[i] = ARGV[a]
  epochs[i] = incoming.ep
end
redis.call('SADD', KEYS[3], unpack(members))
redis.call('PEXPIRE', KEYS[3], keep_ms)
return epochs
