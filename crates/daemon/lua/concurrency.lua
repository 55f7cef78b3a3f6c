-- concurrency: units held at once under one key, each lease ending at its expiry by the
-- store's clock (the reference model is quotad_core::concurrency; keep them in step).
--
-- KEYS[1]  sorted set: one member per unit held, `id:1 ..= id:units`, scored by the
--          lease's expiry (us, Redis time)
-- ARGV[1]  'acquire' | 'release' | 'extend' | 'peek' | 'clear' (every lease given back)
-- ARGV[2]  limit     units that may be held at once
-- ARGV[3]  id        the lease (acquire: a new, unique id)
-- ARGV[4]  units     the lease's units (1 ..= limit)
-- ARGV[5]  hold_us   acquire, extend: the lease ends this long from now
-- ARGV[6]  now_us    TESTS ONLY: the differential test injects time here. quotad never
--                    passes it: production decisions always use redis.call('TIME').
-- Returns  {ok (0|1), held, reset_after_us (until the earliest lease ends), retry_after_us
--           (a denied acquire: until enough leases have ended), expired (units dropped),
--           released (units a release or a clear gave back)}
--
-- Every operation first drops the units whose leases have ended, so an expired lease
-- holds nothing whether or not anyone touched the key since; the key's TTL is its latest
-- expiry, so a key that expires held nothing either. O(units · log N), N <= limit.
if #KEYS ~= 1 or (#ARGV ~= 5 and #ARGV ~= 6) then
  return redis.error_reply('ERR quotad concurrency: expected 1 key and 5 or 6 arguments')
end
local key = KEYS[1]
local mode = ARGV[1]
local limit = tonumber(ARGV[2])
local id = ARGV[3]
local units = tonumber(ARGV[4])
local hold = tonumber(ARGV[5])
local now = clock_us(ARGV[6])

local expired = redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
local ok, retry, changed, released = 1, 0, false, 0
if mode == 'acquire' then
  local held = redis.call('ZCARD', key)
  if held + units <= limit then
    local ends = now + hold
    for i = 1, units do
      redis.call('ZADD', key, ends, id .. ':' .. i)
    end
    changed = true
  else
    -- Fits once the earliest (held + units - limit) units have ended.
    ok = 0
    local k = held + units - limit
    local e = redis.call('ZRANGE', key, k - 1, k - 1, 'WITHSCORES')
    if e[2] then retry = math.max(0, tonumber(e[2]) - now) end
  end
elseif mode == 'release' then
  local n = 0
  for i = 1, units do
    n = n + redis.call('ZREM', key, id .. ':' .. i)
  end
  released = n
  if n == 0 then ok = 0 else changed = true end
elseif mode == 'extend' then
  if redis.call('ZSCORE', key, id .. ':1') then
    local ends = now + hold
    for i = 1, units do
      redis.call('ZADD', key, 'XX', ends, id .. ':' .. i)
    end
    changed = true
  else
    ok = 0
  end
elseif mode == 'clear' then
  released = redis.call('ZCARD', key)
  if released > 0 then
    redis.call('DEL', key)
  end
elseif mode ~= 'peek' then
  return redis.error_reply('ERR quotad concurrency: unknown operation')
end

local held = redis.call('ZCARD', key)
local reset = 0
if held > 0 then
  local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  reset = tonumber(first[2]) - now
  if changed or expired > 0 then
    local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    redis.call('PEXPIRE', key, ttl_ms(tonumber(last[2]) - now))
  end
end
return {ok, held, reset, retry, expired, released}
