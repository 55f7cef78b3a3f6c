-- bucket_slice: hot-key slices of a token bucket or GCRA key (see src/store/redis/hot.rs). An
-- instance that sees a key hot takes tokens here, atomically, and admits from them in
-- memory until the slice ends; what it did not spend it gives back before then. While a
-- slice is live the bucket's capacity is lowered by its units (helpers.lua): the tokens
-- in Redis and the units instances hold never pass the burst together, so the sum every
-- instance admits stays inside the bucket's envelope, as if each unit had been taken
-- when it was spent.
--
-- KEYS[1]  the key: token_bucket.lua's hash (slices in field sl) or gcra.lua's string
--          (slices after the TAT)
-- take     ARGV = {'take', 'tb' | 'gc', limit, window_us, burst, need, demand, prefetch,
--          life_us, ends_id, ends_units, frame, since}
--          First ends the taker's previous slice `ends_id` (0: none), giving back at most
--          `ends_units` of it as a return does, so an instance has one live slice a key.
--          Takes `demand` units (the checks waiting for this key on the instance), plus up
--          to `prefetch` while at least half the burst is left (never more than an eighth
--          of what is left, so slices shrink as the key nears its limit), never more than
--          is left; nothing unless `need` units (the taker's own check) are left. The
--          units beyond `need` become a slice that lives `life_us`. Slices are taken only
--          from a state in the taker's own numbers: a key written under other numbers (the
--          transition rule, helpers.lua) gets the taker's check alone, by its algorithm's
--          own code, and no slice.
--          Returns {granted, left after, reset_after_us (until full), retry_after_us (of
--          `need`, when nothing was granted), slice id (0: no slice), ends_after_us,
--          units of slice `ends_id` given back}.
-- return   ARGV = {'return', 'tb' | 'gc', limit, window_us, burst, id, units, frame, since}
--          Ends slice `id` and gives back at most `units` of it, if it is still live and
--          the key is still in the numbers it was taken under (after a reset, its end or a
--          change of numbers: a no-op). Returns the units given back.
-- refund   ARGV = {'refund', 'tb' | 'gc', limit, window_us, burst, id, units, frame, since}
--          Gives back `units` an instance spent from its slice `id` (a denied batch's
--          other checks) once the slice has left its table: while the slice is live here
--          it holds those units no more (its record drops by them), so they go to the
--          bucket, not past the capacity the record still lowers; else a refund as the
--          algorithm's own. Returns the refund's verdict.
-- Every write keeps the key's TTL past the last live slice. O(slices).
-- Prefixed at build time with helpers.lua and token_bucket.lua, gcra.lua as functions.
if #KEYS ~= 1 or #ARGV < 9 then
  return redis.error_reply('ERR quotad bucket slice: expected 1 key and 9 or 13 arguments')
end
local key = KEYS[1]
local op, kind = ARGV[1], ARGV[2]
local limit, window, burst = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local F, V = ARGV[#ARGV - 1], ARGV[#ARGV]
local now = clock_us()
local interval = window / limit

-- The key's state as tokens (a GCRA's TAT read as the tokens it leaves), its slices, its
-- frame and hold, and until when it is not at rest (nil: at rest or no key).
local tokens, slices, present, sf, sv, sk
if kind == 'tb' then
  local st = redis.call('HMGET', key, 't', 'ts', 'sl', 'f', 'v', 'k')
  local ts = tonumber(st[2])
  tokens = tonumber(st[1])
  present = tokens ~= nil and ts ~= nil
  if not present then
    tokens, ts = burst, now
  end
  slices = slices_of(st[3])
  sf, sv, sk = st[4], st[5], st[6]
  tokens = bucket_refill(tokens, ts, now, limit, window, burst, slices)
elseif kind == 'gc' then
  local tat, ts
  tat, slices, ts, sf, sv, sk = gcra_parse(redis.call('GET', key))
  present = tat ~= nil
  tat = gcra_floor(tat or now, now, interval, slices)
  tokens = burst - math.max(0, tat - now) / interval
else
  return redis.error_reply('ERR quotad bucket slice: expected tb or gc')
end
local own = not present or not sf or sf == F
local hold = hold_parse(sk)
local rest = nil
if present and own then
  rest = rest_after(hold, math.ceil((burst - tokens) * interval), now)
  if not rest then
    -- At rest: as a new key.
    present, hold, tokens = false, nil, burst
  end
end
local r = reading(nil, nil, limit, window, burst, F, V, true)

local function full_in(x)
  return math.ceil((burst - x) * interval)
end
-- Writes the tokens after `spent` (negative: given back).
local function store(spent)
  local h = hold_next(r, hold, rest or 0, spent, now, limit, window, burst, true)
  local sl, last = slices_text(slices, now)
  local ttl = ttl_ms(held_ttl(h, full_in(tokens) + (last - now), now))
  if kind == 'tb' then
    local args = {'t', string.format('%.17g', tokens), 'ts', now, 'f', F, 'v', V}
    -- A field written when it has a value, removed when it has none.
    for _, fv in ipairs({{'sl', sl}, {'k', hold_text(h)}}) do
      if fv[2] then
        args[#args + 1] = fv[1]
        args[#args + 1] = fv[2]
      else
        redis.call('HDEL', key, fv[1])
      end
    end
    redis.call('HSET', key, unpack(args))
    redis.call('PEXPIRE', key, ttl)
  else
    local tat = now + (burst - tokens) * interval
    redis.call('SET', key, gcra_value(tat, sl, now, F, V, hold_text(h)), 'PX', ttl)
  end
end

-- Ends live slice `id`, giving back at most `units` of it: the units given back, or nil
-- when there is no such slice (it ended, the key was reset, or it is in other numbers).
local function finish(id, units)
  local found
  for i, s in ipairs(slices) do
    if s[1] == id and s[3] > now then found = i end
  end
  if not present or not found or not own then
    return nil
  end
  local back = math.min(units, slices[found][2])
  table.remove(slices, found)
  tokens = math.min(burst - slices_held(slices, now), tokens + back)
  return back
end

if op == 'return' then
  local back = finish(tonumber(ARGV[6]), tonumber(ARGV[7]))
  if not back then
    return 0
  end
  store(-back)
  return back
end

local algorithm = token_bucket
if kind == 'gc' then algorithm = gcra end

if op == 'refund' then
  local id, units = tonumber(ARGV[6]), tonumber(ARGV[7])
  local live = nil
  for _, s in ipairs(slices) do
    if s[1] == id and s[3] > now then live = s end
  end
  if not present or not own or not live then
    return algorithm(key, true, limit, window, burst, units, '', now, true, units, false, F, V)
  end
  live[2] = math.max(0, live[2] - units)
  tokens = math.min(burst - slices_held(slices, now), tokens + units)
  store(-units)
  return {1, floor_u(tokens), full_in(tokens), 0}
end

if op ~= 'take' or #ARGV ~= 13 then
  return redis.error_reply('ERR quotad bucket slice: expected take or return')
end
local need, demand, prefetch = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local life = tonumber(ARGV[9])
if not own then
  -- Written under other numbers: the check alone, by the transition rule, no slice.
  local v = algorithm(key, false, limit, window, burst, need, '', now, need > 0,
    math.max(need, 1), nil, F, V)
  local granted = 0
  if v[1] == 1 then granted = need end
  return {granted, v[2], v[3], v[4], 0, 0, 0}
end
local ended = tonumber(ARGV[10]) > 0 and finish(tonumber(ARGV[10]), tonumber(ARGV[11]))
-- GCRA counts as gcra.lua does (a TAT a rounding below a whole unit still conforms).
local eps = 0
if kind == 'gc' then eps = 1e-9 end
local left = floor_u(tokens + eps)
if left < need then
  if ended then store(-ended) end
  return {0, left, full_in(tokens), math.max(1, math.ceil((need - tokens) * interval)), 0, 0,
    ended or 0}
end
local granted = slice_grant(left, burst, demand, prefetch)
tokens = tokens - granted
local id = 0
if granted > need then
  id = now
  for _, s in ipairs(slices) do
    if s[1] >= id then id = s[1] + 1 end
  end
  slices[#slices + 1] = {id, granted - need, now + life}
end
store(granted - (ended or 0))
local ends = 0
if id > 0 then ends = life end
return {granted, floor_u(tokens + eps), full_in(tokens), 0, id, ends, ended or 0}
