-- fixed_window: a counter per window slot; the slot comes from the clock (Redis TIME).
--
-- KEYS[1]  hash {w = window slot (floor(now / window)), n = units admitted in that slot,
--                o = units charged beyond the limit, owed to the slots after w (absent: 0),
--                ts = time of the last write; f, v, k = its frame, since and hold (the
--                transition rule, helpers.lua); hs, h, hl = hot-key slices (slice.lua)}
-- ARGV     see prelude.lua (member unused)
-- Returns  {allowed, remaining = limit - n, reset_after_us = until the slot's end and the
--           slots a debt fills, retry_after_us = until a slot with room, when denied}
-- The model is quotad_core::algorithm (fixed_window.rs, frame.rs). The count and its
-- PEXPIRE are written by the same script, so no counter can exist without a TTL. Denied
-- requests are not counted. A charge (see prelude.lua) counts what fits and owes the rest:
-- each later slot starts with up to `limit` units of the debt counted (helpers.lua,
-- fixed_roll), and the TTL lasts until it is paid. O(1).
local st = redis.call('HMGET', key, 'w', 'n', 'o', 'ts', 'f', 'v', 'k', 'h')
local stored = tonumber(st[1])
local count0, owed0 = tonumber(st[2]) or 0, tonumber(st[3]) or 0
local hold = hold_parse(st[7])
-- A state at rest (nothing counted or owed in its frame, its hold passed) reads as none.
local rest = nil
if stored then
  local fl, fw = limit, window
  if st[5] then fl, fw = frame_numbers(st[5]) end
  local fs, c, o = fixed_roll(stored, count0, owed0, math.floor(now / fw), fl)
  rest = rest_after(hold, fixed_frame_rest(fs, c, o, now, fl, fw), now)
end
if not rest then stored, hold = nil, nil end
-- (No state, or one at rest: the reader's own.)
local r = reading(stored and st[5], stored and st[6], limit, window, burst, F, V, false)
local nl, nw = r.n[1], r.n[2]
-- Taken over: the count and debt move to the reader's window that holds the last instant
-- they can have been counted at.
if stored and r.take then
  stored = carry_slot(stored, r.take[2], window, tonumber(st[4]) or now)
end
local slot, count, owed = fixed_roll(stored, count0, owed0, math.floor(now / nw), nl)
if not stored then count, owed = 0, 0 end
local cap = r.cap
usage_is(count, owed)
local function clear_after(o) return fixed_clear_after((slot + 1) * nw - now, o, nl, nw) end
local function or_rest(x)
  if rest then return math.min(x, rest) end
  return x
end
-- After a lowered limit the count may exceed it: never report negative remaining.
local function left(c) return math.max(0, cap - c) end
-- The slot's count and debt (the debt's field only while there is one), with the TTL,
-- after spending `spent` (negative: given back).
local function store(c, o, spent)
  local h = hold_next(r, hold, rest or 0, spent, now, limit, window, burst, false)
  local args = {'w', slot, 'n', c, 'ts', now}
  stamp_args(key, args, r, h, st[5], st[6], st[7])
  redis.call('HSET', key, unpack(args))
  fixed_owed_field(key, o, st[3])
  redis.call('PEXPIRE', key, ttl_ms(held_ttl(h, clear_after(o), now)))
end

if charge then
  local total = count + cost
  local c = math.max(count, math.min(total, cap))
  owed = owed + (total - c)
  store(c, owed, cost)
  return verdict(true, left(c), clear_after(owed), 0)
end

if refund then
  if stored ~= slot then
    return verdict(true, left(count), or_rest(clear_after(owed)), 0)
  end
  -- What is given back comes off the debt first: it was charged beyond the window.
  local off_debt = math.min(cost, owed)
  owed = owed - off_debt
  count = math.max(0, count - (cost - off_debt))
  store(count, owed, -cost)
  -- Units given back here that a slice had spent leave its ledger too: the slices never
  -- hold more than the count (slice.lua).
  local held = tonumber(st[8])
  if held and held > count then
    redis.call('HSET', key, 'h', count)
  end
  return verdict(true, left(count), clear_after(owed), 0)
end

if count + eval_cost <= cap then
  if write then
    count = count + cost
    store(count, owed, cost)
    return verdict(true, left(count), clear_after(owed), 0)
  end
  return verdict(true, left(count), or_rest(clear_after(owed)), 0)
end
-- The first slot with room: the next, or the first past those the debt fills; a reader
-- held to a smaller limit than its own: the state at rest.
local retry
if eval_cost > cap then
  retry = rest
else
  local full = math.ceil(math.max(0, owed + eval_cost - cap) / nl)
  retry = or_rest((slot + 1) * nw - now + full * nw)
end
return verdict(false, left(count), or_rest(clear_after(owed)), retry)
