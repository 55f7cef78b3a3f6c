-- composite: an all-or-nothing batch of checks whose keys share one hash slot (a
-- co-location group: the group is the hash tag of every key). Every check is decided
-- against the state before any is charged; only if no enforced check is denied is each
-- charged, by its algorithm's own code (the functions above are the algorithm scripts'
-- bodies, wrapped at build time; see src/store/redis/scripts.rs). The model is
-- quotad_core::algorithm::apply_all.
--
-- KEYS[i]  check i's storage key (distinct; all in one slot)
-- ARGV     per check, 9 values: algorithm tag (fw sl sw tb gc), limit, window (prelude.lua), burst,
--          cost (0 = peek), member, enforced (1, or 0 in shadow mode: its denial does not
--          stop the batch), frame, since (prelude.lua); then [now_us: TESTS ONLY]
-- Returns  {allowed, remaining, reset_after_us, retry_after_us} per check, flattened: what
--          each got if the batch passed; otherwise each denial, and for a check that alone
--          would have passed the state as it is (as a peek reports it: nothing was spent).
local ALGORITHMS = {fw = fixed_window, sl = sliding_log, sw = sliding_window,
  tb = token_bucket, gc = gcra}
local WIDTH = 9
local n = #KEYS
if n < 1 or (#ARGV ~= WIDTH * n and #ARGV ~= WIDTH * n + 1) then
  return redis.error_reply('ERR quotad composite: expected n keys and 9n or 9n+1 arguments')
end
local now = clock_us(ARGV[WIDTH * n + 1])

-- Check i, charged or only evaluated (a write-less evaluation of its full cost).
local function run(i, charge)
  local b = (i - 1) * WIDTH
  local algorithm = ALGORITHMS[ARGV[b + 1]]
  if not algorithm then
    return redis.error_reply('ERR quotad composite: unknown algorithm ' .. tostring(ARGV[b + 1]))
  end
  local cost = tonumber(ARGV[b + 5])
  local eval_cost = cost
  if cost == 0 then eval_cost = 1 end
  local window, t = window_enter(ARGV[b + 3], now)
  return algorithm(KEYS[i], false, tonumber(ARGV[b + 2]), window,
    tonumber(ARGV[b + 4]), cost, ARGV[b + 6], t, charge and cost > 0, eval_cost, nil,
    ARGV[b + 8], ARGV[b + 9])
end

local verdicts, pass = {}, true
for i = 1, n do
  local v = run(i, false)
  if v.err then return v end
  if v[1] == 0 and ARGV[(i - 1) * WIDTH + 7] == '1' then pass = false end
  verdicts[i] = v
end
if pass then
  for i = 1, n do verdicts[i] = run(i, true) end
end
local out = {}
for i = 1, n do
  for j = 1, 4 do out[#out + 1] = verdicts[i][j] end
end
return out
