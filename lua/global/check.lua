-- check: one decision for a key of a global policy (bucket.rs KeySlot::decide).
--
-- KEYS[1]  the key's hash   KEYS[2]  the policy's meta hash   KEYS[3]  the policy's active zset
-- ARGV     mode ('check' | 'refund' | 'usage': a peek that writes nothing and also
--          replies {.., now_us, rate, escrow, lent, borrowed, capacity}, the last five in
--          thousandths, bucket.rs KeySlot::usage), cost, rho, burst, step tolerance us,
--          fallback escrow (when the coordinator never set a default), keep_ms,
--          user key (the active zset's member), the key's own rate and burst as the
--          caller has them (0 0: the policy's; bucket.rs KeySlot::set_limit),
--          [now_us: TESTS ONLY]
-- Returns  {allowed, remaining, reset_after_us, retry_after_us} like every limiter script.
if #KEYS ~= 3 or (#ARGV ~= 10 and #ARGV ~= 11) then
  return redis.error_reply('ERR quotad global check: expected 3 keys and 10 or 11 arguments')
end
local key = KEYS[1]
local refund = ARGV[1] == 'refund'
local cost = tonumber(ARGV[2])
local rho, burst, tol, fallback, keep_ms = shape_args(3)
local kr, kb = tonumber(ARGV[9]), tonumber(ARGV[10])
if kr <= 0 then
  kr = nil
  kb = nil
end
local now = redis_now(ARGV[11])
local d = load_default(KEYS[2], fallback)
local s = load_slot(key)

touch(s, d, rho, burst, tol, now)
settle(s, d, rho, burst, now)
-- The bucket is at `now` under the numbers it ran under; from here on, the caller's, and
-- what it holds is clamped to their capacity at once (KeySlot::set_limit).
local limit_changed = s.kr ~= kr or s.kb ~= kb
if limit_changed then
  s.kr, s.kb = kr, kb
  clamp(s, d, rho, burst, tol, now)
end

-- algorithm::token_bucket_at at the rate in force, capacity B·R/ρ (B_K·R/ρ).
local rate, cap = bucket_of(s, rate_now(s, d, tol, now), rho, burst)
local existed = s.tokens ~= nil
local tokens, ts = s.tokens, s.ts
if not existed then
  tokens = cap
  ts = now
end
local elapsed = now - ts
if elapsed < 0 then elapsed = 0 end
tokens = math.min(cap, tokens + elapsed * rate / 1000000)
local function full_in(t)
  return ceil_i((cap - t) * 1000000 / rate)
end

if ARGV[1] == 'usage' then
  local lent, borrowed, escrow = 0, 0, d.escrow
  if s.book then
    escrow = s.book.escrow
    lent = reserved_total(s.book, now)
    borrowed = borrowed_total(s.book, now, tol)
  end
  local function milli(x) return math.floor(x * 1000 + 0.5) end
  local allowed, retry = 1, 0
  if tokens < 1 then
    allowed = 0
    retry = ceil_i((1 - tokens) * 1000000 / rate)
    if retry < 1 then retry = 1 end
  end
  return {allowed, floor_u(tokens), full_in(tokens), retry, now,
    milli(rate_now(s, d, tol, now)), milli(escrow), milli(lent), milli(borrowed), milli(cap)}
end

local reply
if refund then
  if existed then
    tokens = math.min(cap, tokens + cost)
    s.tokens, s.ts = tokens, now
    reply = {1, floor_u(tokens), full_in(tokens), 0}
  else
    reply = {1, floor_u(tokens), 0, 0}
  end
else
  local eval_cost = cost
  if cost == 0 then eval_cost = 1 end
  if tokens >= eval_cost then
    if cost > 0 then
      tokens = tokens - cost
      s.tokens, s.ts = tokens, now
      redis.call('HINCRBY', key, 'a', cost)
    end
    reply = {1, floor_u(tokens), full_in(tokens), 0}
  else
    if cost > 0 then redis.call('HINCRBY', key, 'x', cost) end
    local retry = ceil_i((eval_cost - tokens) * 1000000 / rate)
    if retry < 1 then retry = 1 end
    reply = {0, floor_u(tokens), full_in(tokens), retry}
  end
  if cost > 0 then
    redis.call('ZADD', KEYS[3], now, ARGV[8])
    redis.call('PEXPIRE', KEYS[3], keep_ms)
  end
end

save_bucket(key, s)
if s.book then save_book(key, s.book) end
if limit_changed then
  if kr then
    redis.call('HSET', key, 'kr', fmt(kr), 'kb', fmt(kb))
  else
    redis.call('HDEL', key, 'kr', 'kb')
  end
end
if s.tokens ~= nil or s.book or cost > 0 or limit_changed then
  expire(key, s, d, rho, burst, tol, now, keep_ms)
end
return reply
