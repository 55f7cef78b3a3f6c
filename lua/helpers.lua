-- quotad limiter helpers: prepended to every algorithm script and to the composite script
-- (see src/store/redis/scripts.rs), so TTLs and replies are built in one place.

-- A fixed window of calendar periods (quotad_core::calendar::Periods). quotad passes the
-- periods around its clock as the window argument, "c<first>:<nominal>:<b0>:...:<b4>"
-- (period first+k is [b_k, b_k+1), real us); the algorithm runs in period time, where
-- every period lasts `nominal` us and period i is [i*nominal, (i+1)*nominal), so a fixed
-- window of `nominal` counts per period and Redis's clock picks the period. Its reset,
-- retry and TTL come back to real time here (real_after: verdict, ttl_ms). Outside the
-- table, a us for a us. The arithmetic is the model's, operation for operation.
-- CAL: the table of the operation being run, with its now in both times; nil for any
-- other window.
local CAL = nil
local function cal_to_period_time(c, t)
  local b, n = c.b, c.n
  if t < b[1] then return c.first * n + (t - b[1]) end
  for k = 1, 4 do
    if t < b[k + 1] then
      return (c.first + k - 1) * n + math.floor((t - b[k]) / (b[k + 1] - b[k]) * n)
    end
  end
  return (c.first + 4) * n + (t - b[5])
end
local function cal_to_real(c, v)
  local b, n = c.b, c.n
  local q = math.floor(v / n)
  if q * n > v then q = q - 1 elseif (q + 1) * n <= v then q = q + 1 end
  local k = q - c.first
  if k < 0 then return b[1] + (v - c.first * n) end
  if k >= 4 then return b[5] + (v - (c.first + 4) * n) end
  return b[k + 1] + math.floor((v - q * n) / n * (b[k + 2] - b[k + 1]))
end
-- Real us from now until `us` of the operation's time has passed, never negative.
local function real_after(us)
  if not CAL then return us end
  return math.max(0, cal_to_real(CAL, CAL.pnow + us) - CAL.now)
end
-- The window length and now an algorithm runs with, for window argument `arg` at `now`
-- (a number: a fixed window, in real time).
local function window_enter(arg, now)
  if string.sub(arg, 1, 1) ~= 'c' then
    CAL = nil
    return tonumber(arg), now
  end
  local f = {}
  for x in string.gmatch(string.sub(arg, 2), '[^:]+') do f[#f + 1] = tonumber(x) end
  local c = {first = f[1], n = f[2], b = {f[3], f[4], f[5], f[6], f[7]}, now = now}
  c.pnow = cal_to_period_time(c, now)
  CAL = c
  return c.n, c.pnow
end

-- Key TTL in ms for a state that becomes equivalent to "absent" after us microseconds:
-- rounded up, plus a 1 s grace. The grace is measured, not decorative: under load, Redis
-- 7.0 was seen to apply a PEXPIRE from inside a script against a time base tens of ms
-- old, and a key that expires early turns a partly spent state into a full one.
local function ttl_ms(us)
  return math.ceil(real_after(us) / 1000) + 1000
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
-- Until a fixed window brought to slot `fs` with `c` counted and `o` owed (numbers fl, fw)
-- is at rest: 0 when nothing is counted or owed (unless the slot is ahead of now, after
-- the clock stepped back: it keeps its window).
local function fixed_frame_rest(fs, c, o, now, fl, fw)
  if c + o > 0 or fs > math.floor(now / fw) then
    return fixed_clear_after((fs + 1) * fw - now, o, fl, fw)
  end
  return 0
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
-- The usage op (prelude.lua): a peek that also answers what the key used and owes, and
-- the store's clock. USAGE is set by the prelude for that op only; an algorithm states
-- what its state holds on its way to the verdict (usage_is: used nil means the capacity
-- less what remains), and verdict appends {used, debt, now_us} to its reply. The model is
-- quotad_core::algorithm::usage.
local USAGE = nil
local function usage_is(used, debt)
  if USAGE then USAGE.used, USAGE.debt = used, debt end
end
local function verdict(allowed, remaining, reset_after, retry_after)
  reset_after = real_after(reset_after)
  local v
  if allowed then
    v = {1, remaining, reset_after, 0}
  else
    if retry_after < 1 then retry_after = 1 end
    retry_after = real_after(retry_after)
    if retry_after < 1 then retry_after = 1 end
    v = {0, remaining, reset_after, retry_after}
  end
  if USAGE then
    v[5] = USAGE.used or math.max(0, USAGE.burst - remaining)
    v[6] = USAGE.debt or 0
    v[7] = USAGE.now
  end
  return v
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

-- Hot-key slices of a token bucket or GCRA key (lua/bucket_slice.lua, src/store/redis/hot.rs):
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
  if #list == 0 then return nil, now end
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
-- A GCRA key's stored value: the TAT, then (the transition rule) '@' the time it was
-- written, '@' its frame, '@' since, '@' its hold (may be empty), then ';' and its live
-- slices if any.
local function gcra_value(tat, slices, ts, f, v, k)
  local out = string.format('%.17g@%d@%s@%s@%s', tat, ts, f, v, k or '')
  if slices then out = out .. ';' .. slices end
  return out
end
-- A GCRA key's TAT, slices, write time, frame, since and hold text from its stored value
-- (nil: no key; a value from before frames has only the TAT and slices).
local function gcra_parse(raw)
  if not raw then return nil, {} end
  local head, rest = raw, nil
  local cut = string.find(raw, ';', 1, true)
  if cut then head, rest = string.sub(raw, 1, cut - 1), string.sub(raw, cut + 1) end
  local tat, ts, f, v, k = string.match(head, '^([^@]+)@([^@]*)@([^@]*)@([^@]*)@([^@]*)$')
  if not tat then return tonumber(head), slices_of(rest) end
  return tonumber(tat), slices_of(rest), tonumber(ts), f, v, k
end

-- The transition rule (quotad_core::algorithm::frame, the reference model; keep them in
-- step): what a key's state means when read under other numbers than it was written with.
-- A state carries its frame (field f: "limit:window_us:burst"), when those came into force
-- (v: the writer's "since", written so that newer compares greater, scripts.rs frame_args) and a hold (k:
-- "until_us:unit_us:full_us", while two configs meet on the key). The reader passes its own
-- frame string and since (prelude.lua: F and V).

-- The numbers of a frame string.
local function frame_numbers(f)
  local l, w, b = string.match(f, '^(%d+):(%d+):(%d+)$')
  return tonumber(l), tonumber(w), tonumber(b)
end
-- A hold's until, unit and full (nil: none).
local function hold_parse(k)
  if not k or k == '' then return nil end
  local u, unit, full = string.match(k, '^(%-?%d+):([^:]+):([^:]+)$')
  return {tonumber(u), tonumber(unit), tonumber(full)}
end
local function hold_text(h)
  if not h then return nil end
  return string.format('%d:%.17g:%.17g', h[1], h[2], h[3])
end
-- A hold until `until_us` at the pace of numbers (l, w, b): a bucket's refill per unit and
-- of its whole burst, or a window's length.
local function hold_of(bucket, l, w, b, until_us)
  if bucket then
    local unit = w / l
    return {until_us, unit, unit * b}
  end
  return {until_us, w, w}
end
-- Until when (us from now) a stored state is not at rest: its frame's rest and its hold
-- (nil: at rest, it reads as no state).
local function rest_after(hold, frame_rest, now)
  local held = 0
  if hold then held = hold[1] - now end
  local rest = math.max(frame_rest, held)
  if rest > 0 then return rest end
  return nil
end
-- The hold after `spent` units at now (negative: given back); nil once it has passed.
local function hold_after(h, bucket, spent, now)
  local u
  if bucket then
    local from = math.max(h[1], now)
    local most = math.max(from, now + h[3])
    u = math.max(math.ceil(math.min(from + spent * h[2], most)), now)
  elseif spent > 0 then
    local w = h[2]
    u = math.max(h[1], (math.floor(now / w) + 1) * w)
  else
    u = h[1]
  end
  if u > now then return {u, h[2], h[3]} end
  return nil
end
-- A bucket's tokens under capacity `from` read under `to`: usage carries, a debt whole.
local function carry_tokens(t, from, to)
  if t < 0 or from == to then return t end
  local x = t + (to - from)
  if x > 0 then return x end
  return 0
end
-- Where a count of window `slot` (length from_w), last written at ts, carries to.
local function carry_slot(slot, from_w, to_w, ts)
  if from_w == to_w then return slot end
  return math.floor(math.min((slot + 1) * from_w - 1, ts) / to_w)
end

-- How the reader (limit, window, burst, frame string F, since V) reads a state stamped
-- (sf, sv, hold) that is not at rest: returns a reading table
--   n = {limit, window, burst} the numbers the state evolves under and is written with,
--   f, v = the stamp a write puts, cap = the capacity the reader admits against,
--   take = the frame taken over ({l, w, b}) or nil, held = the reader is held to both.
-- `cap_of(l, b)`: the capacity of numbers (the burst for buckets, the limit for windows).
local function reading(sf, sv, limit, window, burst, F, V, bucket)
  local own = {n = {limit, window, burst}, f = F, v = V, take = nil, held = false}
  if bucket then own.cap = burst else own.cap = limit end
  if not sf or sf == F then return own end
  local fl, fw, fb = frame_numbers(sf)
  if fl == limit and fw == window and fb == burst then return own end
  if V > (sv or '') then
    own.take = {fl, fw, fb}
    return own
  end
  local cap = fl
  if bucket then cap = math.min(fb, burst) else cap = math.min(fl, limit) end
  return {n = {fl, fw, fb}, f = sf, v = sv, cap = cap, take = nil, held = true}
end
-- The hold a write at now puts, spending `spent` (negative: giving back), over the stored
-- hold of a state not at rest for `rest` more (0 without a state).
local function hold_next(r, hold, rest, spent, now, limit, window, burst, bucket)
  local h = nil
  if hold and hold[1] > now then h = hold end
  if r.take then
    local u = now + rest
    if h then u = math.max(h[1], u) end
    h = hold_of(bucket, r.take[1], r.take[2], r.take[3], u)
  elseif r.held and spent > 0 then
    local u = now
    if h then u = h[1] end
    h = hold_of(bucket, limit, window, burst, u)
  end
  if h then return hold_after(h, bucket, spent, now) end
  return nil
end
-- A bucket reader held to both: its own bucket of everything spent on the key (nil: none).
local function own_tokens(r, hold, limit, window, burst, now)
  if not r.held or not hold then return nil end
  local mine = hold_of(true, limit, window, burst, 0)
  if hold[2] ~= mine[2] or hold[3] ~= mine[3] then return nil end
  return burst - math.max(0, hold[1] - now) / hold[2]
end
-- The TTL (us) of a state written with hold h: its own, never before the hold ends.
local function held_ttl(h, ttl, now)
  if h then return math.max(ttl, h[1] - now) end
  return ttl
end
-- Appends to a hash write's `args` the stamp a write puts (helpers above): the frame and
-- since where they differ from the stored ones (sf, sv), and the hold h (or, without one,
-- removes a stored hold sk).
local function stamp_args(key, args, r, h, sf, sv, sk)
  if sf ~= r.f then
    args[#args + 1] = 'f'
    args[#args + 1] = r.f
  end
  if sv ~= r.v then
    args[#args + 1] = 'v'
    args[#args + 1] = r.v
  end
  local k = hold_text(h)
  if k then
    args[#args + 1] = 'k'
    args[#args + 1] = k
  elseif sk then
    redis.call('HDEL', key, 'k')
  end
end
