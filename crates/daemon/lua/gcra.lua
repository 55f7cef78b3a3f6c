-- gcra: generic cell rate algorithm, one theoretical arrival time (TAT) per key.
--
-- KEYS[1]  string: TAT in microseconds (a double, %.17g), SET with PX in the same call
-- ARGV     see prelude.lua (member unused)
-- Returns  {allowed, remaining = units that would still pass now,
--           reset_after_us = TAT - now, retry_after_us = until this cost would conform}
-- Emission interval T = window / limit and tolerance tau = T * burst are doubles in
-- microseconds, so rates of 10,000/s and more (T = 100 us and below) stay exact where
-- millisecond arithmetic breaks (brandur/redis-cell#50, #80). Denials and peeks write
-- nothing. A hot key's slices (see helpers.lua) follow the TAT in the value, after a ';':
-- while live they hold the TAT at least their units ahead of now, and the TTL covers the
-- last of them. O(1) in the number of slices (a few per instance).
local interval = window / limit
local tau = interval * burst
local tat, slices = gcra_parse(redis.call('GET', key))
if tat and #slices > 0 then tat = gcra_floor(tat, now, interval, slices) end
local base = now
if tat and tat > now then base = tat end

-- Writes the TAT t with the live slices.
local function store(t)
  local sl, last = slices_text(slices, now)
  redis.call('SET', key, gcra_value(t, sl), 'PX', ttl_ms(math.ceil(math.max(t, last) - now)))
end

local function remaining_of(t)
  return floor_u((tau - (t - now)) / interval + 1e-9)
end

if charge then
  -- Spent whether or not it conforms: a TAT beyond now + tau is debt, waited out before
  -- any check passes again.
  local t = base + cost * interval
  store(t)
  return verdict(true, remaining_of(t), math.ceil(t - now), 0)
end

if refund then
  if not tat then
    return verdict(true, remaining_of(base), 0, 0)
  end
  local new_tat = math.max(tat - cost * interval, now + slices_held(slices, now) * interval)
  local t = now
  if new_tat > now or slices_text(slices, now) then
    t = math.max(new_tat, now)
    store(new_tat)
  else
    redis.call('DEL', key)
  end
  return verdict(true, remaining_of(t), math.ceil(t - now), 0)
end

local new_tat = base + eval_cost * interval
local allow_at = new_tat - tau
if now >= allow_at then
  if write then
    store(new_tat)
    return verdict(true, remaining_of(new_tat), math.ceil(new_tat - now), 0)
  end
  return verdict(true, remaining_of(base), math.ceil(base - now), 0)
end
return verdict(false, remaining_of(base), math.ceil(base - now), math.ceil(allow_at - now))
