-- slice: hot-key slices of a fixed window (see src/store/redis/hot.rs). An instance that sees a
-- key hot takes units of the key's current window here, atomically, and admits from them
-- in memory; what it did not spend it gives back to the same window.
--
-- KEYS[1]  the fixed window's hash {w = slot, n = units admitted in it, o = debt, ts, f, v,
--          k} (fixed_window.lua), with fields of its own, the slices' ledger: hs = the
--          slot the slices were taken in, h = units taken as slices in slot hs and not
--          given back, hl = the ledger's id (Redis's time when it was opened: a reset
--          deletes the hash, and a ledger opened after it has another id).
-- take     ARGV = {'take', limit, window_us, need, demand, prefetch, frame, since}
--          Takes `demand` units (the checks waiting for this key on the instance), plus up
--          to `prefetch` while at least half the window's limit is left (never more than an
--          eighth of what is left, so slices shrink as the key nears its limit), never more
--          than is left; nothing unless `need` units (the taker's own check) are left.
--          Slices are taken only from a state in the taker's own numbers: a key written
--          under other numbers (the transition rule, helpers.lua) gets the taker's check
--          alone, by fixed_window's own code, and no slice.
--          Returns {granted, left after, reset_after_us, slot, ledger, retry_after_us}.
-- return   ARGV = {'return', slot, ledger, units, frame, since}
--          Gives back at most `units`, only to the ledger they were taken from, in the
--          window length they were taken under, and only what its slices still hold
--          (after a reset, in a new window or under another window length: a no-op).
--          Returns the units given back.
-- Every write keeps the key's TTL (the window's end plus grace, set by a take). O(1).
-- Prefixed at build time with helpers.lua and fixed_window.lua as a function.
local key = KEYS[1]
local now = clock_us()
local st = redis.call('HMGET', key, 'w', 'n', 'hs', 'h', 'hl', 'o', 'ts', 'f', 'v', 'k')
local stored = tonumber(st[1])
local count = tonumber(st[2]) or 0
local held_slot = tonumber(st[3])
local held = tonumber(st[4]) or 0
local ledger = tonumber(st[5])

-- The window length of a frame string (nil: none).
local function window_of(f)
  if not f then return nil end
  local _, w = frame_numbers(f)
  return w
end

if ARGV[1] == 'return' then
  local slot = tonumber(ARGV[2])
  local units = tonumber(ARGV[4])
  if stored ~= slot or held_slot ~= slot or ledger ~= tonumber(ARGV[3]) then
    return 0
  end
  -- Counts mean the same under any limit; under another window length the slot is not
  -- the same window.
  local w = window_of(st[8])
  if w and w ~= window_of(ARGV[5]) then
    return 0
  end
  local back = math.min(units, held, count)
  if back <= 0 then
    return 0
  end
  redis.call('HSET', key, 'n', count - back, 'h', held - back)
  return back
end

if ARGV[1] ~= 'take' or #ARGV ~= 8 then
  return redis.error_reply('ERR quotad slice: expected take or return')
end
local limit = tonumber(ARGV[2])
local window = tonumber(ARGV[3])
local need = tonumber(ARGV[4])
local demand = tonumber(ARGV[5])
local prefetch = tonumber(ARGV[6])
local F, V = ARGV[7], ARGV[8]
if stored and st[8] and st[8] ~= F then
  -- Written under other numbers: the check alone, by the transition rule, no slice.
  local v = fixed_window(key, false, limit, window, limit, need, '', now, need > 0,
    math.max(need, 1), nil, F, V)
  local granted = 0
  if v[1] == 1 then granted = need end
  return {granted, v[2], v[3], math.floor(now / window), 0, v[4]}
end
local hold = hold_parse(st[10])
-- A debt carried into this slot counts in it (helpers.lua, fixed_roll).
local slot, owed
slot, count, owed = fixed_roll(stored, count, tonumber(st[6]) or 0, math.floor(now / window), limit)
local rest = nil
if stored then
  rest = rest_after(hold, fixed_frame_rest(slot, count, owed, now, limit, window), now)
end
if not rest then
  -- At rest (or no state): as a new key.
  slot, count, owed, hold = math.floor(now / window), 0, 0, nil
  stored = nil
end
if held_slot ~= slot or stored ~= slot or ledger == nil then
  held = 0
  ledger = now
end
-- The slices never hold more than the count (a refund may have lowered it).
held = math.min(held, count)
local reset_after = (slot + 1) * window - now
local left = math.max(0, limit - count)
if left < need then
  return {0, left, reset_after, slot, ledger, reset_after}
end
local granted = slice_grant(left, limit, demand, prefetch)
local r = reading(nil, nil, limit, window, limit, F, V, false)
local h = hold_next(r, hold, rest or 0, granted, now, limit, window, limit, false)
local args = {'w', slot, 'n', count + granted, 'hs', slot, 'h', held + granted, 'hl', ledger,
  'ts', now}
stamp_args(key, args, r, h, st[8], st[9], st[10])
redis.call('HSET', key, unpack(args))
fixed_owed_field(key, owed, st[6])
local ttl = held_ttl(h, fixed_clear_after(reset_after, owed, limit, window), now)
redis.call('PEXPIRE', key, ttl_ms(ttl))
return {granted, left - granted, reset_after, slot, ledger, 0}
