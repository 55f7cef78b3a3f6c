-- fixed_window: a counter per window slot; the slot comes from the clock (Redis TIME).
--
-- KEYS[1]  hash {w = window slot (floor(now / window)), n = units admitted in that slot}
-- ARGV     see prelude.lua (member unused)
-- Returns  {allowed, remaining = limit - n, reset_after_us = time to the slot's end,
--           retry_after_us = the same when denied}
-- The count and its PEXPIRE are written by the same script, so no counter can exist
-- without a TTL. Denied requests are not counted. O(1).
local slot = math.floor(now / window)
local st = redis.call('HMGET', key, 'w', 'n')
local stored = tonumber(st[1])
local count = tonumber(st[2]) or 0
if stored and stored > slot then
  slot = stored -- the clock stepped back: stay in the newer window
elseif stored ~= slot then
  count = 0
end
local reset_after = (slot + 1) * window - now

if refund then
  if stored ~= slot then
    return verdict(true, limit - count, reset_after, 0)
  end
  count = math.max(0, count - cost)
  redis.call('HSET', key, 'w', slot, 'n', count)
  redis.call('PEXPIRE', key, ttl_ms(reset_after))
  return verdict(true, limit - count, reset_after, 0)
end

if count + eval_cost <= limit then
  if write then
    if stored == slot then
      count = redis.call('HINCRBY', key, 'n', cost)
    else
      count = cost
      redis.call('HSET', key, 'w', slot, 'n', count)
    end
    redis.call('PEXPIRE', key, ttl_ms(reset_after))
  end
  return verdict(true, limit - count, reset_after, 0)
end
return verdict(false, limit - count, reset_after, reset_after)
