-- gcra: generic cell rate algorithm, one theoretical arrival time (TAT) per key.
--
-- KEYS[1]  string: TAT in microseconds (a double, %.17g), with when it was written, its
--          frame, since and hold (the transition rule; helpers.lua, gcra_value), SET with
--          PX in the same call
-- ARGV     see prelude.lua (member unused)
-- Returns  {allowed, remaining = units that would still pass now,
--           reset_after_us = TAT - now, retry_after_us = until this cost would conform}
-- The model is quotad_core::algorithm (gcra.rs, frame.rs). Emission interval T = window /
-- limit and tolerance tau = T * burst are doubles in microseconds, so rates of 10,000/s
-- and more (T = 100 us and below) stay exact where millisecond arithmetic breaks
-- (brandur/redis-cell#50, #80). Denials and peeks write nothing. A hot key's slices (see
-- helpers.lua) follow in the value, after a ';': while live they hold the TAT at least
-- their units ahead of now, and the TTL covers the last of them. O(1) in the number of
-- slices (a few per instance).
local stored, slices, sts, sf, sv, sk = gcra_parse(redis.call('GET', key))
local hold = hold_parse(sk)
-- A state at rest (its TAT passed in its frame, its hold too) reads as no state.
local rest = nil
if stored then
  local fl, fw = limit, window
  if sf then fl, fw = frame_numbers(sf) end
  if #slices > 0 then stored = gcra_floor(stored, now, fw / fl, slices) end
  rest = rest_after(hold, math.ceil(stored - now), now)
end
if not rest then stored, hold = nil, nil end
-- (No state, or one at rest: the reader's own.)
local r = reading(stored and sf, stored and sv, limit, window, burst, F, V, true)
local interval = r.n[2] / r.n[1]
local tat = stored
-- Taken over: the units the TAT was ahead when written carry into the reader's burst.
if tat and r.take then
  local at = sts or now
  local used = 0
  if tat > at then used = (tat - at) / (r.take[2] / r.take[1]) end
  local left = carry_tokens(r.take[3] - used, r.take[3], burst)
  tat = at + (burst - left) * interval
end
local tau = interval * r.cap
local own = own_tokens(r, hold, limit, window, burst, now)
local base = now
if tat and tat > now then base = tat end
-- A TAT beyond now + tau owes: whole units, as the model counts them.
if base - now > tau then usage_is(nil, math.ceil((base - now - tau) / interval - 1e-9)) end

-- Units that would still conform now with the TAT at t, after `spent` more.
local function remaining_of(t, spent)
  local left = floor_u((tau - (t - now)) / interval + 1e-9)
  if own then left = math.min(left, floor_u(own - spent)) end
  return left
end
-- Writes the TAT t with the live slices, after spending `spent` (negative: given back).
local function store(t, spent)
  local h = hold_next(r, hold, rest or 0, spent, now, limit, window, burst, true)
  local sl, last = slices_text(slices, now)
  local ttl = held_ttl(h, math.ceil(math.max(t, last) - now), now)
  redis.call('SET', key, gcra_value(t, sl, now, r.f, r.v, hold_text(h)), 'PX', ttl_ms(ttl))
end

if refund then
  if not tat then
    return verdict(true, remaining_of(base, 0), 0, 0)
  end
  local new_tat = math.max(tat - cost * interval, now + slices_held(slices, now) * interval)
  local h = hold_next(r, hold, rest or 0, -cost, now, limit, window, burst, true)
  if new_tat > now or slices_text(slices, now) or h then
    store(new_tat, -cost)
  else
    redis.call('DEL', key)
  end
  local t = math.max(now, new_tat)
  return verdict(true, remaining_of(t, -cost), math.ceil(t - now), 0)
end

-- Until the key is empty as it stands: in the reader's view, or at rest.
local empty_after = math.ceil(base - now)
if rest then empty_after = math.min(empty_after, rest) end

if charge then
  -- Spent whether or not it conforms: a TAT beyond now + tau is debt, waited out before
  -- any check passes again.
  local t = base + cost * interval
  store(t, cost)
  return verdict(true, remaining_of(t, cost), math.ceil(t - now), 0)
end

local new_tat = base + eval_cost * interval
local allow_at = new_tat - tau
if now >= allow_at and (not own or own >= eval_cost) then
  if write then
    store(new_tat, cost)
    return verdict(true, remaining_of(new_tat, cost), math.ceil(new_tat - now), 0)
  end
  return verdict(true, remaining_of(base, 0), empty_after, 0)
end
-- Until the cost conforms (and the reader's own bucket holds it); or the state at rest.
local retry
if eval_cost > r.cap then
  retry = rest
else
  retry = math.ceil(allow_at - now)
  if own and own < eval_cost then
    retry = math.max(retry, math.ceil((eval_cost - own) * (window / limit)))
  end
  if rest then retry = math.min(retry, rest) end
end
return verdict(false, remaining_of(base, 0), empty_after, retry)
