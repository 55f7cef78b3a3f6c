-- quotad limiter prelude: the arguments of a one-key script, prepended to every algorithm
-- (after helpers.lua; see src/store/redis/scripts.rs), so argument parsing and the clock live in
-- one place. composite.lua passes the same names to each algorithm as a function's
-- parameters instead.
--
-- KEYS[1]  the key's storage key (built by quotad in one function; hash tag around the user key)
-- ARGV[1]  'check' | 'refund' | 'charge' (token_bucket, gcra and fixed_window: spend
--          cost whether or not the key has it, the rest becoming debt; never denied) |
--          'usage' (a peek with cost 0 that also replies what the key used and owes and
--          the store's clock, helpers.lua: {allowed, remaining, reset_after_us,
--          retry_after_us, used, debt, now_us}; writes nothing)
-- ARGV[2]  limit        admissions per window (token_bucket / gcra: refill of limit per window)
-- ARGV[3]  window_us    window length in microseconds, or a fixed window's calendar
--                       periods (helpers.lua, window_enter): then `now` is period time
-- ARGV[4]  burst        token_bucket / gcra capacity (= limit for the window algorithms)
-- ARGV[5]  cost         units to take (check, charge) or give back (refund); check with 0
--                       = peek
-- ARGV[6]  member       unique id of this request (sliding_log entries; others ignore it)
-- ARGV[7]  frame        the reader's numbers, "limit:window_us:burst" (the transition rule,
--                       helpers.lua; sliding_log ignores it)
-- ARGV[8]  since        when they came into force ("newer" compares greater as a string:
--                       src/store/redis/scripts.rs, frame_args)
-- ARGV[9]  now_us       TESTS ONLY: the differential test injects time here. quotad never
--                       passes it: production decisions always use redis.call('TIME').
-- Returns  {allowed (0|1), remaining, reset_after_us, retry_after_us}
--
-- Rules every script keeps: every key it touches is KEYS[1]; every write sets a TTL in the
-- same call or the next one of the same script; decisions come from stored timestamps, never
-- from whether a key has expired (TTL is garbage collection); O(1) or O(log N).
if #KEYS ~= 1 or (#ARGV ~= 8 and #ARGV ~= 9) then
  return redis.error_reply('ERR quotad script: expected 1 key and 8 or 9 arguments')
end
local key = KEYS[1]
local refund = ARGV[1] == 'refund'
local charge = ARGV[1] == 'charge'
local limit = tonumber(ARGV[2])
local real_now = clock_us(ARGV[9])
local window, now = window_enter(ARGV[3], real_now)
local burst = tonumber(ARGV[4])
local cost = tonumber(ARGV[5])
if ARGV[1] == 'usage' then
  if cost ~= 0 then return redis.error_reply('ERR quotad script: usage takes cost 0') end
  USAGE = {now = real_now, burst = burst}
end
local member = ARGV[6]
local F, V = ARGV[7], ARGV[8]
-- A peek (check with cost 0) evaluates a cost-1 request and writes nothing.
local write = refund or charge or cost > 0
local eval_cost = cost
if not refund and not charge and cost == 0 then eval_cost = 1 end
