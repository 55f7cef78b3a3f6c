-- settle: a check that reserves an estimated cost, and its settlement at the real cost
-- (the model is quotad_core::settlement). The algorithm functions above are the
-- algorithm scripts' bodies, wrapped at build time (src/store/redis/scripts.rs), so the
-- arithmetic is theirs; only those that can hold a debt settle.
--
-- KEYS[1]  the limiter key
-- KEYS[2]  the reservation: "o:<estimate>:<opened_us>" while open, "s:<cost>" once
--          settled, "e:" once a settlement found it ended by a reset; in the key's slot
-- KEYS[3]  the key's reset mark (reset.lua): when it was last reset, us
-- ARGV     'reserve' | 'settle', algorithm tag (fw tb gc), limit, window (prelude.lua), burst,
--          cost (reserve: the estimate, at least 1; settle: the real cost), member,
--          keep_ms (how long the reservation is kept, open or settled), the invalidation
--          channel, frame, since (prelude.lua), [now_us: TESTS ONLY]
-- reserve  a check of the estimate; admitted, the reservation is opened.
--          Returns {allowed, remaining, reset_after_us, retry_after_us}
-- settle   what the real cost is above the estimate is charged (as debt where the key
--          lacks it), what it is below is given back; the reservation is marked settled,
--          and settling it again charges nothing. A reservation opened before the key's
--          last reset was ended by it: nothing is charged or given back (the reset gave
--          the key a fresh start, the estimate included). A settlement that gives units back
--          PUBLISHes the key on the channel first, as a reset does: refused (an ACL
--          without PUBLISH), the script stops before anything changed, so no denial
--          another instance remembers outlives a settlement reported done.
--          Returns {1 settled now | 2 settled before | 0 no such reservation | 3 ended by
--          a reset, remaining, reset_after_us, charged, refunded}
local ALGORITHMS = {fw = fixed_window, tb = token_bucket, gc = gcra}
if #KEYS ~= 3 or (#ARGV ~= 11 and #ARGV ~= 12) then
  return redis.error_reply('ERR quotad settle: expected 3 keys and 11 or 12 arguments')
end
local mode = ARGV[1]
local algorithm = ALGORITHMS[ARGV[2]]
if not algorithm then
  return redis.error_reply('ERR quotad settle: ' .. tostring(ARGV[2]) .. ' cannot hold a debt')
end
local key, reservation = KEYS[1], KEYS[2]
local limit, burst = tonumber(ARGV[3]), tonumber(ARGV[5])
local cost, member, keep_ms = tonumber(ARGV[6]), ARGV[7], tonumber(ARGV[8])
local channel = ARGV[9]
local F, V = ARGV[10], ARGV[11]
local now = clock_us(ARGV[12])

-- The algorithm's operation: (refund, units, write, charge).
local function run(refund, units, write, charge)
  local eval_cost = units
  if units == 0 then eval_cost = 1 end
  -- (The reservation's times stay real: a reset mark is compared with them.)
  local window, t = window_enter(ARGV[4], now)
  return algorithm(key, refund, limit, window, burst, units, member, t, write, eval_cost, charge,
    F, V)
end

if mode == 'reserve' then
  local v = run(false, cost, true, nil)
  if v[1] == 1 then
    redis.call('SET', reservation, string.format('o:%d:%d', cost, now), 'PX', keep_ms)
  end
  return v
end
if mode ~= 'settle' then
  return redis.error_reply('ERR quotad settle: expected reserve or settle')
end

local r = redis.call('GET', reservation)
local estimate, opened
if r then estimate, opened = string.match(r, '^o:(%d+):?(%d*)$') end
if estimate then
  -- Opened before the key's last reset: ended by it (one from before the open instant
  -- was kept: by any reset).
  local mark = tonumber(redis.call('GET', KEYS[3]))
  if mark and (opened == '' or mark >= tonumber(opened)) then
    redis.call('SET', reservation, 'e:', 'PX', keep_ms)
    r, estimate = 'e:', nil
  end
end
if not estimate then
  local v = run(false, 0, false, nil)
  local code = 0
  if r == 'e:' then code = 3 elseif r then code = 2 end
  return {code, v[2], v[3], 0, 0}
end
estimate = tonumber(estimate)
local v, charged, refunded
if cost > estimate then
  charged, refunded = cost - estimate, 0
  v = run(false, charged, true, true)
elseif cost < estimate then
  charged, refunded = 0, estimate - cost
  redis.call('PUBLISH', channel, key)
  v = run(true, refunded, true, nil)
else
  charged, refunded = 0, 0
  v = run(false, 0, false, nil)
end
redis.call('SET', reservation, 's:' .. cost, 'PX', keep_ms)
return {1, v[2], v[3], charged, refunded}
