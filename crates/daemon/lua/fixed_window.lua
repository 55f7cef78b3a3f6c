-- fixed_window: a counter per window slot; the slot comes from the clock (Redis TIME).
--
-- KEYS[1]  hash {w = window slot (floor(now / window)), n = units admitted in that slot}
-- ARGV     see prelude.lua (member unused)
-- Returns  {allowed, remaining = limit - n, reset_after_us = time to the slot's end,
--           retry_after_us = the same when denied}
-- The count and its PEXPIRE are written by the same script, so no counter can exist
-- without a TTL. Denied requests are not counted. O(1).
if charge then
  return redis.error_reply('ERR quotad fixed_window: a window cannot hold a debt (charge)')
end
local slot = math.floor(now / window)
local st = redis.call('HMGET', key, 'w', 'n')
local stored = tonumber(st[1])
local count = tonumber(st[2]) or 0
if stored == slot + 1 then
  slot = stored -- the clock stepped back (less than a window): stay in the newer window
elseif stored ~= slot then
  count = 0 -- older, or written under another window length (a config change)
end
local reset_after = (slot + 1) * window - now
-- After a lowered limit the count may exceed it: never report negative remaining.
local function left(c) return math.max(0, limit - c) end

if refund then
  if stored ~= slot then
    return verdict(true, left(count), reset_after, 0)
  end
  count = math.max(0, count - cost)
  redis.call('HSET', key, 'w', slot, 'n', count)
  redis.call('PEXPIRE', key, ttl_ms(reset_after))
  return verdict(true, left(count), reset_after, 0)
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
  return verdict(true, left(count), reset_after, 0)
end
return verdict(false, left(count), reset_after, reset_after)
