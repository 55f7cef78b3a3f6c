-- quotad global policies: the regional bucket of one key. Prepended to every script in
-- lua/global/ (see src/store/redis/scripts.rs). The reference model is
-- crates/core/src/coordinator/bucket.rs (with lease.rs and algorithm::token_bucket_at): the
-- same steps in the same order with the same floating-point operations, and
-- tests/global_lua.rs runs both on the same inputs.
--
-- The key's hash (KEYS[1], the user key inside a hash tag):
--   t, ts   token bucket: tokens (a double, %.17g) and the time of the last write, us
--   e       the book's escrow, units/s (absent: no book, the policy default applies)
--   r       reservations, "borrower seq amount until" repeated (space separated)
--   l       loans, "lender incarnation seq amount until" repeated
--   hw, ep  the book's high-water time and step epoch
--   a, x    cumulative admitted and locally rejected units (offered load), the key's units
--   kr, kb  the key's own rate and burst (a runtime limit) the bucket runs under; absent:
--           the policy's (bucket.rs KeyLimit: the book stays in policy units)
-- The policy's meta hash: d (default escrow), dp (the smallest default in force before
-- dt), dt (when d last changed). Times are Redis TIME in microseconds: the coordinator
-- reads the same clock, never its host's.

local function num(x, default)
  local v = tonumber(x)
  if v == nil then return default end
  return v
end

local function fmt(x)
  return string.format('%.17g', x)
end

local function parse_list(s, width)
  local out, cur = {}, {}
  if not s or s == '' then return out end
  for w in string.gmatch(s, '%S+') do
    cur[#cur + 1] = tonumber(w)
    if #cur == width then
      out[#out + 1] = cur
      cur = {}
    end
  end
  return out
end

-- Integers for the reply: NaN (0/0 at a zero rate) is 0, anything past 2^53 means "never"
-- (Rust decodes it as i64::MAX).
local NEVER = 9007199254740992
local function ceil_i(x)
  if x ~= x then return 0 end
  local c = math.ceil(x)
  if c > NEVER then return NEVER end
  if c < -NEVER then return -NEVER end
  return c
end
local function floor_u(x)
  if x <= 0 then return 0 end
  return math.floor(x)
end

-- ---------------------------------------------------------------- state

local function load_default(meta, fallback)
  local m = redis.call('HMGET', meta, 'd', 'dp', 'dt')
  local d = tonumber(m[1])
  if d == nil then
    return {escrow = fallback, before = fallback, since = -math.huge}
  end
  return {escrow = d, before = num(m[2], d), since = num(m[3], -math.huge)}
end

local function load_slot(key)
  local h = redis.call('HMGET', key, 't', 'ts', 'e', 'r', 'l', 'hw', 'ep', 'kr', 'kb')
  local s = {tokens = tonumber(h[1]), ts = tonumber(h[2]), kr = tonumber(h[8]),
    kb = tonumber(h[9])}
  if s.kr == nil or s.kb == nil then
    s.kr = nil
    s.kb = nil
  end
  if s.tokens == nil or s.ts == nil then
    s.tokens = nil
    s.ts = nil
  end
  if h[3] then
    s.book = {
      escrow = tonumber(h[3]),
      res = parse_list(h[4], 4),
      loans = parse_list(h[5], 5),
      hw = num(h[6], -math.huge),
      ep = num(h[7], 0),
    }
  end
  return s
end

local function loans_string(loans)
  local parts = {}
  for _, l in ipairs(loans) do
    parts[#parts + 1] = string.format('%d %d %d %s %d', l[1], l[2], l[3], fmt(l[4]), l[5])
  end
  return table.concat(parts, ' ')
end

local function save_book(key, book)
  redis.call('HSET', key, 'l', loans_string(book.loans), 'ep', string.format('%d', book.ep))
  if book.hw > -math.huge then
    redis.call('HSET', key, 'hw', string.format('%d', book.hw))
  end
end

-- ---------------------------------------------------------------- the book (lease.rs)

local function stepped_back(book, now, tol)
  return now + tol < book.hw
end

local function reserved_total(book, now)
  local seen, total = {}, 0
  for _, r in ipairs(book.res) do
    local b = r[1]
    if not seen[b] then
      seen[b] = true
      local m = 0
      for _, q in ipairs(book.res) do
        if q[1] == b and now < q[4] and q[3] > m then m = q[3] end
      end
      total = total + m
    end
  end
  return total
end

local function borrowed_total(book, now, tol)
  if tol and stepped_back(book, now, tol) then return 0 end
  local total = 0
  for _, l in ipairs(book.loans) do
    if now < l[5] then total = total + l[4] end
  end
  return total
end

-- The rate in force now (loans ignored after an unseen backward step).
local function rate_now(s, d, tol, now)
  if s.book then
    local r = s.book.escrow - reserved_total(s.book, now) + borrowed_total(s.book, now, tol)
    if r < 0 then return 0 end
    return r
  end
  return d.escrow
end

-- The rate in force at t, a past time being settled across (no step check there).
local function rate_during(s, d, t)
  if s.book then
    local r = s.book.escrow - reserved_total(s.book, t) + borrowed_total(s.book, t, nil)
    if r < 0 then return 0 end
    return r
  end
  if t < d.since then return math.min(d.before, d.escrow) end
  return d.escrow
end

local function expiries_between(book, from, to)
  local pts, seen = {}, {}
  local function add(t)
    if t > from and t <= to and not seen[t] then
      seen[t] = true
      pts[#pts + 1] = t
    end
  end
  for _, r in ipairs(book.res) do add(r[4]) end
  for _, l in ipairs(book.loans) do add(l[5]) end
  table.sort(pts)
  return pts
end

-- ---------------------------------------------------------------- the bucket (bucket.rs)

local function capacity(rate, rho, burst)
  if rho > 0 then return burst * rate / rho end
  return 0
end

-- The regional bucket at enforced rate `rate` (policy units): its refill rate and capacity,
-- the policy's, or under the key's own numbers rate·ρ_K/ρ and B_K·rate/ρ
-- (bucket.rs KeySlot::bucket_rate).
local function bucket_of(s, rate, rho, burst)
  if s.kr == nil then return rate, capacity(rate, rho, burst) end
  if rho <= 0 then return 0, 0 end
  return rate * s.kr / rho, s.kb * rate / rho
end

-- algorithm::token_bucket_at with Refund { cost = 0 }: refill to `at` at `rate`, clamp to
-- the capacity that goes with it. A missing bucket stays missing.
local function settle_to(s, rate, rho, burst, at)
  if s.tokens == nil then return end
  local brate, cap = bucket_of(s, rate, rho, burst)
  local elapsed = at - s.ts
  if elapsed < 0 then elapsed = 0 end
  s.tokens = math.min(cap, s.tokens + elapsed * brate / 1000000)
  s.ts = at
end

local function clamp(s, d, rho, burst, tol, now)
  if s.tokens ~= nil then settle_to(s, rate_now(s, d, tol, now), rho, burst, now) end
end

-- A backward step beyond tol drops the key's loans for good (epoch + 1) and clamps.
local function touch(s, d, rho, burst, tol, now)
  if not s.book then return false end
  local book = s.book
  local stepped = stepped_back(book, now, tol) and #book.loans > 0
  if stepped then
    book.loans = {}
    book.ep = book.ep + 1
  end
  if now > book.hw then book.hw = now end
  if stepped then clamp(s, d, rho, burst, tol, now) end
  return stepped
end

local function settle(s, d, rho, burst, now)
  if s.tokens == nil then return end
  local pts
  if s.book then
    pts = expiries_between(s.book, s.ts, now)
  elseif d.since > s.ts and d.since <= now then
    pts = {d.since}
  else
    pts = {}
  end
  pts[#pts + 1] = now
  local from = s.ts
  for _, at in ipairs(pts) do
    if at > from then
      settle_to(s, rate_during(s, d, from), rho, burst, at)
      from = at
    end
  end
end

local function save_bucket(key, s)
  if s.tokens ~= nil then
    redis.call('HSET', key, 't', fmt(s.tokens), 'ts', string.format('%d', s.ts))
  end
end

-- Every key of a global policy lives as long as the longest of: keep_ms (passed by quotad,
-- longer than any lease), the time to refill at the current rate.
local function expire(key, s, d, rho, burst, tol, now, keep_ms)
  local ttl = keep_ms
  if s.tokens ~= nil then
    local rate, cap = bucket_of(s, rate_now(s, d, tol, now), rho, burst)
    if rate > 0 then
      local full = (cap - s.tokens) * 1000000 / rate
      local ms = math.ceil(full / 1000) + 1000
      if ms > ttl then ttl = ms end
    end
  end
  redis.call('PEXPIRE', key, ttl)
end

-- The five numbers every key script takes, from ARGV[i]: rho, burst, step tolerance (us),
-- fallback escrow (used while the coordinator never set a default), keep_ms.
local function shape_args(i)
  return tonumber(ARGV[i]), tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]),
    tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4])
end

-- Coordinator writes carry the fencing token they were issued with the lock: a writer
-- whose token is no longer current (it lost the lock, and another instance took over)
-- changes nothing.
local function fenced(fence_key, token)
  return redis.call('GET', fence_key) ~= token
end
local FENCED = 'FENCED another quotad instance coordinates this region'

local function redis_now(injected)
  if injected then return tonumber(injected) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
