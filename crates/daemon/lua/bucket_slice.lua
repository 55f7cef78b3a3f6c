-- bucket_slice: hot-key slices of a token bucket or GCRA key (see src/store/hot.rs). An
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
--          life_us, ends_id, ends_units}
--          First ends the taker's previous slice `ends_id` (0: none), giving back at most
--          `ends_units` of it as a return does, so an instance has one live slice a key.
--          Takes `demand` units (the checks waiting for this key on the instance), plus up
--          to `prefetch` while at least half the burst is left (never more than an eighth
--          of what is left, so slices shrink as the key nears its limit), never more than
--          is left; nothing unless `need` units (the taker's own check) are left. The
--          units beyond `need` become a slice that lives `life_us`.
--          Returns {granted, left after, reset_after_us (until full), retry_after_us (of
--          `need`, when nothing was granted), slice id (0: no slice), ends_after_us,
--          units of slice `ends_id` given back}.
-- return   ARGV = {'return', 'tb' | 'gc', limit, window_us, burst, id, units}
--          Ends slice `id` and gives back at most `units` of it, if it is still live (after
--          a reset or its end: a no-op). Returns the units given back.
-- Every write keeps the key's TTL past the last live slice. O(slices).
if #KEYS ~= 1 or #ARGV < 7 then
  return redis.error_reply('ERR quotad bucket slice: expected 1 key and 7 or 11 arguments')
end
local key = KEYS[1]
local op, kind = ARGV[1], ARGV[2]
local limit, window, burst = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local now = clock_us()
local interval = window / limit

-- The key's state as tokens (a GCRA's TAT read as the tokens it leaves) and its slices.
local tokens, slices, present
if kind == 'tb' then
  local st = redis.call('HMGET', key, 't', 'ts', 'sl')
  local ts = tonumber(st[2])
  tokens = tonumber(st[1])
  present = tokens ~= nil and ts ~= nil
  if not present then
    tokens, ts = burst, now
  end
  slices = slices_of(st[3])
  tokens = bucket_refill(tokens, ts, now, limit, window, burst, slices)
elseif kind == 'gc' then
  local tat
  tat, slices = gcra_parse(redis.call('GET', key))
  present = tat ~= nil
  tat = gcra_floor(tat or now, now, interval, slices)
  tokens = burst - math.max(0, tat - now) / interval
else
  return redis.error_reply('ERR quotad bucket slice: expected tb or gc')
end

local function full_in(x)
  return math.ceil((burst - x) * interval)
end
local function store()
  local sl, last = slices_text(slices, now)
  local ttl = ttl_ms(full_in(tokens) + (last - now))
  if kind == 'tb' then
    local t = string.format('%.17g', tokens)
    if sl then
      redis.call('HSET', key, 't', t, 'ts', now, 'sl', sl)
    else
      redis.call('HSET', key, 't', t, 'ts', now)
      redis.call('HDEL', key, 'sl')
    end
    redis.call('PEXPIRE', key, ttl)
  else
    redis.call('SET', key, gcra_value(now + (burst - tokens) * interval, sl), 'PX', ttl)
  end
end

-- Ends live slice `id`, giving back at most `units` of it: the units given back, or nil
-- when there is no such slice (it ended, or the key was reset).
local function finish(id, units)
  local found
  for i, s in ipairs(slices) do
    if s[1] == id and s[3] > now then found = i end
  end
  if not present or not found then
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
  store()
  return back
end

if op ~= 'take' or #ARGV ~= 11 then
  return redis.error_reply('ERR quotad bucket slice: expected take or return')
end
local need, demand, prefetch = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local life = tonumber(ARGV[9])
local ended = tonumber(ARGV[10]) > 0 and finish(tonumber(ARGV[10]), tonumber(ARGV[11]))
-- GCRA counts as gcra.lua does (a TAT a rounding below a whole unit still conforms).
local eps = 0
if kind == 'gc' then eps = 1e-9 end
local left = floor_u(tokens + eps)
if left < need then
  if ended then store() end
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
store()
local ends = 0
if id > 0 then ends = life end
return {granted, floor_u(tokens + eps), full_in(tokens), 0, id, ends, ended or 0}
