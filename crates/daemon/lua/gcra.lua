-- gcra: generic cell rate algorithm, one theoretical arrival time (TAT) per key.
--
-- KEYS[1]  string: TAT in microseconds (a double, %.17g), SET with PX in the same call
-- ARGV     see prelude.lua (member unused)
-- Returns  {allowed, remaining = units that would still pass now,
--           reset_after_us = TAT - now, retry_after_us = until this cost would conform}
-- Emission interval T = window / limit and tolerance tau = T * burst are doubles in
-- microseconds, so rates of 10,000/s and more (T = 100 us and below) stay exact where
-- millisecond arithmetic breaks (brandur/redis-cell#50, #80). Denials and peeks write
-- nothing. O(1).
local interval = window / limit
local tau = interval * burst
local tat = tonumber(redis.call('GET', key))
local base = now
if tat and tat > now then base = tat end

local function remaining_of(t)
  return floor_u((tau - (t - now)) / interval + 1e-9)
end

if refund then
  if not tat then
    return verdict(true, remaining_of(base), 0, 0)
  end
  local new_tat = tat - cost * interval
  local t = now
  if new_tat > now then
    t = new_tat
    redis.call('SET', key, string.format('%.17g', new_tat), 'PX', ttl_ms(math.ceil(new_tat - now)))
  else
    redis.call('DEL', key)
  end
  return verdict(true, remaining_of(t), math.ceil(t - now), 0)
end

local new_tat = base + eval_cost * interval
local allow_at = new_tat - tau
if now >= allow_at then
  if write then
    redis.call('SET', key, string.format('%.17g', new_tat), 'PX', ttl_ms(math.ceil(new_tat - now)))
    return verdict(true, remaining_of(new_tat), math.ceil(new_tat - now), 0)
  end
  return verdict(true, remaining_of(base), math.ceil(base - now), 0)
end
return verdict(false, remaining_of(base), math.ceil(base - now), math.ceil(allow_at - now))
