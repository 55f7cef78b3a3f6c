-- sliding_window: the two-counter estimate previous * (1 - elapsed fraction) + current.
--
-- KEYS[1]  hash {w = current slot, c = units in slot w, p = units in slot w - 1, ts = time
--                of the last write; f, v, k = its frame, since and hold (the transition
--                rule, helpers.lua)}
-- ARGV     see prelude.lua (member unused)
-- Returns  {allowed, remaining = floor(limit - estimate),
--           reset_after_us = until both counted windows have passed,
--           retry_after_us = until the estimate leaves room for this cost}
-- The model is quotad_core::algorithm (sliding_window.rs, frame.rs). Smooth at window
-- boundaries, two numbers per key; approximate (assumes the previous window's admissions
-- were spread evenly). Denied requests are not counted. O(1).
if charge then
  return redis.error_reply('ERR quotad sliding_window: a window cannot hold a debt (charge)')
end
local st = redis.call('HMGET', key, 'w', 'c', 'p', 'ts', 'f', 'v', 'k')
local stored = tonumber(st[1])
local current, previous = tonumber(st[2]) or 0, tonumber(st[3]) or 0
local hold = hold_parse(st[7])

-- A state stored in slot s (nil: none) with counts c, p, brought to now in windows of w:
-- the slot, the time into it and the two counts.
local function at_now(w, s, c, p)
  local slot = math.floor(now / w)
  if s == slot + 1 then
    -- the clock stepped back (less than a window): stay at the start of the newer window;
    -- a slot further ahead is not the frame's (a state from before frames) and is dropped
    return s, 0, c, p
  elseif s == slot then
    return slot, now - slot * w, c, p
  elseif s == slot - 1 then
    return slot, now - slot * w, 0, c
  end
  return slot, now - slot * w, 0, 0
end
local function reset_of(w, slot, c, p)
  if c > 0 then return (slot + 2) * w - now end
  if p > 0 then return (slot + 1) * w - now end
  return 0
end

-- A state at rest (both counts gone in its frame, its hold passed) reads as none.
local rest = nil
if stored then
  local fw = window
  if st[5] then
    local _
    _, fw = frame_numbers(st[5])
  end
  local fs, _, fc, fp = at_now(fw, stored, current, previous)
  local frame_rest
  if fc + fp == 0 and fs > math.floor(now / fw) then
    frame_rest = (fs + 1) * fw - now
  else
    frame_rest = reset_of(fw, fs, fc, fp)
  end
  rest = rest_after(hold, frame_rest, now)
end
if not rest then stored, hold = nil, nil end
-- (No state, or one at rest: the reader's own.)
local r = reading(stored and st[5], stored and st[6], limit, window, burst, F, V, false)
-- Taken over: each count moves to the reader's window that holds the last instant it can
-- have been counted at (two in one: summed; not adjacent: the older drops out).
if stored and r.take then
  local ts = tonumber(st[4]) or now
  local now_slot = carry_slot(stored, r.take[2], window, ts)
  local before = carry_slot(stored - 1, r.take[2], window, ts)
  if before == now_slot then
    current, previous = current + previous, 0
  elseif before + 1 < now_slot then
    previous = 0
  end
  stored = now_slot
end
local w = r.n[2]
local cap = r.cap
local slot, elapsed
if stored then
  slot, elapsed, current, previous = at_now(w, stored, current, previous)
else
  slot, elapsed, current, previous = at_now(w, nil, 0, 0)
end
local weight = (w - elapsed) / w
local function remaining_of(c, p)
  return floor_u(cap - (p * weight + c))
end
local function reset_now(c, p)
  local x = reset_of(w, slot, c, p)
  if rest then return math.min(x, rest) end
  return x
end
-- The counts written after spending `spent` (negative: given back); the verdict on them.
local function store(c, p, spent)
  local h = hold_next(r, hold, rest or 0, spent, now, limit, window, burst, false)
  local args = {'w', slot, 'c', c, 'p', p, 'ts', now}
  stamp_args(key, args, r, h, st[5], st[6], st[7])
  redis.call('HSET', key, unpack(args))
  redis.call('PEXPIRE', key, ttl_ms(held_ttl(h, (slot + 2) * w - now, now)))
  return verdict(true, remaining_of(c, p), reset_of(w, slot, c, p), 0)
end

if refund then
  if stored == slot then
    return store(math.max(0, current - cost), previous, -cost)
  elseif stored == slot - 1 then
    return store(current, math.max(0, previous - cost), -cost)
  end
  return verdict(true, remaining_of(current, previous), reset_now(current, previous), 0)
end

if previous * weight + current + eval_cost <= cap then
  if write then
    return store(current + cost, previous, cost)
  end
  return verdict(true, remaining_of(current, previous), reset_now(current, previous), 0)
end
local retry
if eval_cost > cap then
  -- A reader held to a smaller limit than its own: only once the state is at rest.
  retry = rest
else
  local need = math.max(0, cap - eval_cost)
  if current <= need then
    -- wait inside this window for the previous window's weight to decay enough
    retry = math.ceil(w - (need - current) * w / previous - elapsed)
  else
    -- wait for the next window, where this window's count becomes the decaying one
    retry = (w - elapsed) + math.max(0, math.ceil(w - need * w / current))
  end
  if rest then retry = math.min(retry, rest) end
end
return verdict(false, remaining_of(current, previous), reset_now(current, previous), retry)
