-- sliding_window: the two-counter estimate previous * (1 - elapsed fraction) + current.
--
-- KEYS[1]  hash {w = current slot, c = units in slot w, p = units in slot w - 1}
-- ARGV     see prelude.lua (member unused)
-- Returns  {allowed, remaining = floor(limit - estimate),
--           reset_after_us = until both counted windows have passed,
--           retry_after_us = until the estimate leaves room for this cost}
-- Smooth at window boundaries, two numbers per key; approximate (assumes the previous
-- window's admissions were spread evenly). Denied requests are not counted. O(1).
if charge then
  return redis.error_reply('ERR quotad sliding_window: a window cannot hold a debt (charge)')
end
local slot = math.floor(now / window)
local st = redis.call('HMGET', key, 'w', 'c', 'p')
local stored = tonumber(st[1])
local current = tonumber(st[2]) or 0
local previous = tonumber(st[3]) or 0
local elapsed = now - slot * window
if stored == slot + 1 then
  -- the clock stepped back (less than a window): stay at the start of the newer window;
  -- a slot further ahead was written under another window length and is discarded below
  slot = stored
  elapsed = 0
elseif stored == slot then
  -- same window
elseif stored == slot - 1 then
  previous = current
  current = 0
else
  previous = 0
  current = 0
end
local weight = (window - elapsed) / window
local function remaining_of(c)
  return floor_u(limit - (previous * weight + c))
end
local function reset_of(c, p)
  if c > 0 then return (slot + 2) * window - now end
  if p > 0 then return (slot + 1) * window - now end
  return 0
end
local function store()
  redis.call('HSET', key, 'w', slot, 'c', current, 'p', previous)
  redis.call('PEXPIRE', key, ttl_ms((slot + 2) * window - now))
end

if refund then
  if stored == slot then
    current = math.max(0, current - cost)
  elseif stored == slot - 1 then
    previous = math.max(0, previous - cost)
  else
    return verdict(true, remaining_of(current), reset_of(current, previous), 0)
  end
  store()
  return verdict(true, remaining_of(current), reset_of(current, previous), 0)
end

if previous * weight + current + eval_cost <= limit then
  if write then
    current = current + cost
    store()
  end
  return verdict(true, remaining_of(current), reset_of(current, previous), 0)
end
local need = math.max(0, limit - eval_cost)
local retry
if current <= need then
  -- wait inside this window for the previous window's weight to decay enough
  retry = math.ceil(window - (need - current) * window / previous - elapsed)
else
  -- wait for the next window, where this window's count becomes the decaying one
  retry = (window - elapsed) + math.max(0, math.ceil(window - need * window / current))
end
return verdict(false, remaining_of(current), reset_of(current, previous), retry)
