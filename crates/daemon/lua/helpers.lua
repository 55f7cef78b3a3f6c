-- quotad limiter helpers: prepended to every algorithm script and to the composite script
-- (see src/store/scripts.rs), so TTLs and replies are built in one place.

-- Key TTL in ms for a state that becomes equivalent to "absent" after us microseconds:
-- rounded up, plus a 1 s grace. The grace is measured, not decorative: under load, Redis
-- 7.0 was seen to apply a PEXPIRE from inside a script against a time base tens of ms
-- old, and a key that expires early turns a partly spent state into a full one.
local function ttl_ms(us)
  return math.ceil(us / 1000) + 1000
end
-- The store's clock in microseconds (Redis TIME), or `injected` when given: the
-- differential tests pass virtual time that way; quotad never does.
local function clock_us(injected)
  if injected then return tonumber(injected) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
-- A fixed window brought to `slot` from the state stored in window `stored` (nil: none),
-- `count` units in it and `owed` charged beyond its limit (quotad_core's fixed_at): a
-- clock that stepped back by less than a window stays in the newer window; the windows
-- after `stored` start with the debt, up to `limit` units each, until it is paid; a slot
-- further ahead (another window length) is discarded. Returns slot, count, owed.
local function fixed_roll(stored, count, owed, slot, limit)
  if stored == slot + 1 then return stored, count, owed end
  if stored == slot then return slot, count, owed end
  if stored ~= nil and stored < slot then
    local left = math.max(0, owed - limit * (slot - stored - 1))
    local n = math.min(left, limit)
    return slot, n, left - n
  end
  return slot, 0, 0
end
-- Until a fixed window's key is as if absent: the slot's end (`reset_after` from now),
-- then a slot per `limit` units owed.
local function fixed_clear_after(reset_after, owed, limit, window)
  return reset_after + math.ceil(owed / limit) * window
end
-- A fixed window's debt field: written while there is a debt, removed once it is paid
-- (`had`: the field was there).
local function fixed_owed_field(key, owed, had)
  if owed > 0 then
    redis.call('HSET', key, 'o', owed)
  elseif had then
    redis.call('HDEL', key, 'o')
  end
end
local function floor_u(x)
  if x <= 0 then return 0 end
  return math.floor(x)
end
local function verdict(allowed, remaining, reset_after, retry_after)
  if allowed then return {1, remaining, reset_after, 0} end
  if retry_after < 1 then retry_after = 1 end
  return {0, remaining, reset_after, retry_after}
end

-- What a hot-key slice's take grants of `left` units (`cap`: the limit or burst): the
-- demand, and up to `prefetch` more while half the cap is left, never more than an eighth
-- of what is left (slices shrink as the key nears its limit), never more than is left.
local function slice_grant(left, cap, demand, prefetch)
  local extra = 0
  if left * 2 >= cap then
    extra = math.min(prefetch, math.floor(left / 8))
  end
  return math.min(demand + extra, left)
end

-- Hot-key slices of a token bucket or GCRA key (lua/bucket_slice.lua, src/store/hot.rs):
-- units an instance took out of the bucket to spend from memory until the slice's end,
-- stored with the key as "id:units:end" entries (end in Redis time, us) joined by ','.
-- While a slice is live the bucket holds at most burst less the units of live slices:
-- tokens in Redis and units held by instances together never pass the burst, so what
-- every instance admits stays inside the bucket's envelope (docs/architecture.md).
local function slices_of(text)
  local list = {}
  if text then
    for id, units, till in string.gmatch(text, '(%d+):(%d+):(%d+)') do
      list[#list + 1] = {tonumber(id), tonumber(units), tonumber(till)}
    end
  end
  return list
end
-- Units of the slices live at t.
local function slices_held(list, t)
  local held = 0
  for _, s in ipairs(list) do
    if s[3] > t then held = held + s[2] end
  end
  return held
end
-- The slices live at now, as stored (nil: none), and the latest end among them (or now).
local function slices_text(list, now)
  local out, last = {}, now
  for _, s in ipairs(list) do
    if s[3] > now then
      out[#out + 1] = string.format('%d:%d:%d', s[1], s[2], s[3])
      if s[3] > last then last = s[3] end
    end
  end
  if #out == 0 then return nil, now end
  return table.concat(out, ','), last
end
-- A token bucket's tokens at now from `tokens` at ts, refilled at limit per window, stretch
-- by stretch as slices ended: never above the burst less what slices held meanwhile.
local function bucket_refill(tokens, ts, now, limit, window, burst, list)
  local from = ts
  if #list > 0 then
    local points = {}
    for _, s in ipairs(list) do
      if s[3] > ts and s[3] < now then points[#points + 1] = s[3] end
    end
    table.sort(points)
    for _, at in ipairs(points) do
      tokens = math.min(burst - slices_held(list, from), tokens + (at - from) * limit / window)
      from = at
    end
  end
  return math.min(burst - slices_held(list, from), tokens + math.max(0, now - from) * limit / window)
end
-- A GCRA key's TAT given its slices: the bucket was never fuller than the burst less what
-- slices held, so the TAT is at least each ended slice's end plus the units held up to
-- then, and now plus the units held now, in emission intervals.
local function gcra_floor(tat, now, interval, list)
  for _, s in ipairs(list) do
    if s[3] <= now then
      local held = 0
      for _, o in ipairs(list) do
        if o[3] >= s[3] then held = held + o[2] end
      end
      tat = math.max(tat, s[3] + held * interval)
    end
  end
  local held = slices_held(list, now)
  if held > 0 then tat = math.max(tat, now + held * interval) end
  return tat
end
-- A GCRA key's stored value: the TAT, then ';' and its live slices if any.
local function gcra_value(tat, slices)
  local v = string.format('%.17g', tat)
  if slices then v = v .. ';' .. slices end
  return v
end
-- A GCRA key's TAT and slices from its stored value (nil: no key).
local function gcra_parse(raw)
  if not raw then return nil, {} end
  local cut = string.find(raw, ';', 1, true)
  if not cut then return tonumber(raw), {} end
  return tonumber(string.sub(raw, 1, cut - 1)), slices_of(string.sub(raw, cut + 1))
end
