-- token_bucket: capacity `burst`, refilled continuously at limit / window.
--
-- KEYS[1]  hash {t = tokens (a double, stored with %.17g so fractions survive exactly),
--                ts = time of the last write, us; f, v, k = its frame, since and hold
--                (the transition rule, helpers.lua); sl = hot-key slices}
-- ARGV     see prelude.lua (member unused)
-- Returns  {allowed, remaining = floor(tokens), reset_after_us = until the bucket is full,
--           retry_after_us = until enough tokens for this cost}
-- The model is quotad_core::algorithm (token_bucket.rs, frame.rs). Fractional tokens are
-- kept in the hash (never truncated by Lua-to-Redis integer conversion); a missing key is a
-- full bucket, and the TTL is the time to refill, so expiry never changes a decision.
-- Denials and peeks write nothing. A hot key's slices (field sl, see helpers.lua) lower the
-- capacity while they are live, and the TTL then covers the last of them too. O(1) in the
-- number of slices (a few per instance).
local st = redis.call('HMGET', key, 't', 'ts', 'sl', 'f', 'v', 'k')
local slices = slices_of(st[3])
local hold = hold_parse(st[6])
local stored, stored_ts = tonumber(st[1]), tonumber(st[2])
local exists = stored ~= nil and stored_ts ~= nil
-- A state at rest (full in its frame, its hold passed) reads as no state.
local rest, x = nil, nil
if exists then
  local fl, fw, fb = limit, window, burst
  if st[4] and st[4] ~= F then fl, fw, fb = frame_numbers(st[4]) end
  x = bucket_refill(stored, stored_ts, now, fl, fw, fb, slices)
  rest = rest_after(hold, math.ceil((fb - x) * fw / fl), now)
end
if not rest then exists, hold = false, nil end
-- (No state, or one at rest: the reader's own.)
local r = reading(exists and st[4], exists and st[5], limit, window, burst, F, V, true)
local nl, nw, nb = r.n[1], r.n[2], r.n[3]
local tokens
if exists and not r.take then
  -- Read under its own frame's numbers, as refilled above.
  tokens = x
else
  local ts = now
  tokens = nb
  if exists then tokens, ts = stored, stored_ts end
  -- Taken over: what was used carries into the reader's burst as of the last write.
  if r.take then tokens = carry_tokens(tokens, r.take[3], burst) end
  tokens = bucket_refill(tokens, ts, now, nl, nw, nb, slices)
end
local own = own_tokens(r, hold, limit, window, burst, now)
-- Below zero the bucket owes: whole units, as the model counts them.
if tokens < 0 then usage_is(nil, math.ceil(-tokens - 1e-9)) end

local function full_in(t)
  return math.ceil((nb - t) * nw / nl)
end
-- What the reader may spend of t after `spent` more.
local function view(t, spent)
  local v = carry_tokens(t, nb, r.cap)
  if own then v = math.min(v, own - spent) end
  return v
end
local function full_after()
  local full = full_in(tokens)
  if rest then return math.min(full, rest) end
  return full
end
-- Writes t at now after spending `spent` (negative: given back).
local function store(t, spent)
  local h = hold_next(r, hold, rest or 0, spent, now, limit, window, burst, true)
  local sl, last = slices_text(slices, now)
  local args = {'t', string.format('%.17g', t), 'ts', now}
  if sl then
    args[#args + 1] = 'sl'
    args[#args + 1] = sl
  elseif st[3] then
    redis.call('HDEL', key, 'sl')
  end
  stamp_args(key, args, r, h, st[4], st[5], st[6])
  redis.call('HSET', key, unpack(args))
  redis.call('PEXPIRE', key, ttl_ms(held_ttl(h, full_in(t) + (last - now), now)))
end

if charge then
  -- Spent whether or not the bucket has it: below zero is debt, refilled before any check
  -- passes again.
  tokens = tokens - cost
  store(tokens, cost)
  return verdict(true, floor_u(view(tokens, cost)), full_in(tokens), 0)
end

if refund then
  if not exists then
    return verdict(true, floor_u(view(tokens, 0)), 0, 0)
  end
  tokens = math.min(nb - slices_held(slices, now), tokens + cost)
  store(tokens, -cost)
  return verdict(true, floor_u(view(tokens, -cost)), full_in(tokens), 0)
end

if view(tokens, 0) >= eval_cost then
  if write then
    tokens = tokens - cost
    store(tokens, cost)
    return verdict(true, floor_u(view(tokens, cost)), full_in(tokens), 0)
  end
  return verdict(true, floor_u(view(tokens, 0)), full_after(), 0)
end
-- Until the bucket holds the cost (a reader held to a smaller burst than the frame's needs
-- the difference on top) and its own bucket too; or the state at rest.
local retry
if eval_cost > r.cap then
  retry = rest
else
  local need = eval_cost + nb - r.cap
  retry = math.ceil((need - tokens) * nw / nl)
  if own and own < eval_cost then
    retry = math.max(retry, math.ceil((eval_cost - own) * (window / limit)))
  end
  if rest then retry = math.min(retry, rest) end
end
return verdict(false, floor_u(view(tokens, 0)), full_after(), retry)
