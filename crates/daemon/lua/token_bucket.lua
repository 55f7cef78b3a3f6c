-- token_bucket: capacity `burst`, refilled continuously at limit / window.
--
-- KEYS[1]  hash {t = tokens (a double, stored with %.17g so fractions survive exactly),
--                ts = time of the last write, us}
-- ARGV     see prelude.lua (member unused)
-- Returns  {allowed, remaining = floor(tokens), reset_after_us = until the bucket is full,
--           retry_after_us = until enough tokens for this cost}
-- Fractional tokens are kept in the hash (never truncated by Lua-to-Redis integer
-- conversion); a missing key is a full bucket, and the TTL is the time to refill, so
-- expiry never changes a decision. Denials and peeks write nothing. A hot key's slices
-- (field sl, see helpers.lua) lower the capacity while they are live, and the TTL then
-- covers the last of them too. O(1) in the number of slices (a few per instance).
local st = redis.call('HMGET', key, 't', 'ts', 'sl')
local tokens = tonumber(st[1])
local ts = tonumber(st[2])
local exists = tokens ~= nil and ts ~= nil
if not exists then
  tokens = burst
  ts = now
end
local slices = slices_of(st[3])
tokens = bucket_refill(tokens, ts, now, limit, window, burst, slices)

local function full_in(t)
  return math.ceil((burst - t) * window / limit)
end
local function store()
  local sl, last = slices_text(slices, now)
  if sl then
    redis.call('HSET', key, 't', string.format('%.17g', tokens), 'ts', now, 'sl', sl)
  else
    redis.call('HSET', key, 't', string.format('%.17g', tokens), 'ts', now)
    if st[3] then redis.call('HDEL', key, 'sl') end
  end
  redis.call('PEXPIRE', key, ttl_ms(full_in(tokens) + (last - now)))
end

if charge then
  -- Spent whether or not the bucket has it: below zero is debt, refilled before any check
  -- passes again.
  tokens = tokens - cost
  store()
  return verdict(true, floor_u(tokens), full_in(tokens), 0)
end

if refund then
  if not exists then
    return verdict(true, floor_u(tokens), 0, 0)
  end
  tokens = math.min(burst - slices_held(slices, now), tokens + cost)
  store()
  return verdict(true, floor_u(tokens), full_in(tokens), 0)
end

if tokens >= eval_cost then
  if write then
    tokens = tokens - cost
    store()
  end
  return verdict(true, floor_u(tokens), full_in(tokens), 0)
end
return verdict(false, floor_u(tokens), full_in(tokens), math.ceil((eval_cost - tokens) * window / limit))
