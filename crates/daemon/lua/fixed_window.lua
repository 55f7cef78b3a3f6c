-- fixed_window: a counter per window slot; the slot comes from the clock (Redis TIME).
--
-- KEYS[1]  hash {w = window slot (floor(now / window)), n = units admitted in that slot,
--                o = units charged beyond the limit, owed to the slots after w (absent: 0)}
-- ARGV     see prelude.lua (member unused)
-- Returns  {allowed, remaining = limit - n, reset_after_us = until the slot's end and the
--           slots a debt fills, retry_after_us = until a slot with room, when denied}
-- The count and its PEXPIRE are written by the same script, so no counter can exist
-- without a TTL. Denied requests are not counted. A charge (see prelude.lua) counts what
-- fits and owes the rest: each later slot starts with up to `limit` units of the debt
-- counted (helpers.lua, fixed_roll), and the TTL lasts until it is paid. O(1).
local st = redis.call('HMGET', key, 'w', 'n', 'o')
local stored = tonumber(st[1])
local slot, count, owed = fixed_roll(stored, tonumber(st[2]) or 0, tonumber(st[3]) or 0,
  math.floor(now / window), limit)
local reset_after = (slot + 1) * window - now
-- Until the key is as if absent: the slot's end, then a slot per `limit` units owed.
local function clear_after(o) return fixed_clear_after(reset_after, o, limit, window) end
-- After a lowered limit the count may exceed it: never report negative remaining.
local function left(c) return math.max(0, limit - c) end
-- The slot's count and debt (the debt's field only while there is one), with the TTL.
local function store(c, o)
  redis.call('HSET', key, 'w', slot, 'n', c)
  fixed_owed_field(key, o, st[3])
  redis.call('PEXPIRE', key, ttl_ms(clear_after(o)))
end

if charge then
  local total = count + cost
  local c = math.max(count, math.min(total, limit))
  owed = owed + (total - c)
  store(c, owed)
  return verdict(true, left(c), clear_after(owed), 0)
end

if refund then
  if stored ~= slot then
    return verdict(true, left(count), clear_after(owed), 0)
  end
  -- What is given back comes off the debt first: it was charged beyond the window.
  local off_debt = math.min(cost, owed)
  owed = owed - off_debt
  count = math.max(0, count - (cost - off_debt))
  store(count, owed)
  return verdict(true, left(count), clear_after(owed), 0)
end

if count + eval_cost <= limit then
  if write then
    if stored == slot then
      count = redis.call('HINCRBY', key, 'n', cost)
      redis.call('PEXPIRE', key, ttl_ms(clear_after(owed)))
    else
      count = count + cost
      store(count, owed)
    end
  end
  return verdict(true, left(count), clear_after(owed), 0)
end
-- The first slot with room: the next, or the first past those the debt fills.
local full = math.ceil(math.max(0, owed + eval_cost - limit) / limit)
return verdict(false, left(count), clear_after(owed), reset_after + full * window)
