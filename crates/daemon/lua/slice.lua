-- slice: hot-key slices of a fixed window (see src/store/hot.rs). An instance that sees a
-- key hot takes units of the key's current window here, atomically, and admits from them
-- in memory; what it did not spend it gives back to the same window.
--
-- KEYS[1]  the fixed window's hash {w = slot, n = units admitted in it, o = debt}
--          (fixed_window.lua),
--          with fields of its own, the slices' ledger: hs = the slot the slices were taken
--          in, h = units taken as slices in slot hs and not given back, hl = the ledger's
--          id (Redis's time when it was opened: a reset deletes the hash, and a ledger
--          opened after it has another id).
-- take     ARGV = {'take', limit, window_us, need, demand, prefetch}
--          Takes `demand` units (the checks waiting for this key on the instance), plus up
--          to `prefetch` while at least half the window's limit is left (never more than an
--          eighth of what is left, so slices shrink as the key nears its limit), never more
--          than is left; nothing unless `need` units (the taker's own check) are left.
--          Returns {granted, left after, reset_after_us, slot, ledger}.
-- return   ARGV = {'return', slot, ledger, units}
--          Gives back at most `units`, only to the ledger they were taken from and only
--          what its slices still hold (after a reset or in a new window: a no-op).
--          Returns the units given back.
-- Every write keeps the key's TTL (the window's end plus grace, set by a take). O(1).
-- Prefixed at build time with helpers.lua (ttl_ms, slice_grant, the fixed window helpers).
local key = KEYS[1]
local now = clock_us()
local st = redis.call('HMGET', key, 'w', 'n', 'hs', 'h', 'hl', 'o')
local stored = tonumber(st[1])
local count = tonumber(st[2]) or 0
local held_slot = tonumber(st[3])
local held = tonumber(st[4]) or 0
local ledger = tonumber(st[5])

if ARGV[1] == 'return' then
  local slot = tonumber(ARGV[2])
  local units = tonumber(ARGV[4])
  if stored ~= slot or held_slot ~= slot or ledger ~= tonumber(ARGV[3]) then
    return 0
  end
  local back = math.min(units, held, count)
  if back <= 0 then
    return 0
  end
  redis.call('HSET', key, 'n', count - back, 'h', held - back)
  return back
end

if ARGV[1] ~= 'take' or #ARGV ~= 6 then
  return redis.error_reply('ERR quotad slice: expected take or return')
end
local limit = tonumber(ARGV[2])
local window = tonumber(ARGV[3])
local need = tonumber(ARGV[4])
local demand = tonumber(ARGV[5])
local prefetch = tonumber(ARGV[6])
-- A debt carried into this slot counts in it (helpers.lua, fixed_roll).
local slot, owed
slot, count, owed = fixed_roll(stored, count, tonumber(st[6]) or 0, math.floor(now / window), limit)
if held_slot ~= slot or stored ~= slot or ledger == nil then
  held = 0
  ledger = now
end
local reset_after = (slot + 1) * window - now
local left = math.max(0, limit - count)
if left < need then
  return {0, left, reset_after, slot, ledger}
end
local granted = slice_grant(left, limit, demand, prefetch)
redis.call('HSET', key, 'w', slot, 'n', count + granted, 'hs', slot, 'h', held + granted, 'hl', ledger)
fixed_owed_field(key, owed, st[6])
redis.call('PEXPIRE', key, ttl_ms(fixed_clear_after(reset_after, owed, limit, window)))
return {granted, left - granted, reset_after, slot, ledger}
