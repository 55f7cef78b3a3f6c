-- concurrency: units held at once under one key, each lease ending at its expiry by the
-- store's clock (the reference model is quotad_core::concurrency; keep them in step).
--
-- KEYS[1]  sorted set: one member per unit held, `id:1 ..= id:units`, scored by the
--          lease's expiry (us, Redis time)
-- KEYS[2]  sorted set: the leases a clear gave back before their end, `id` scored by
--          that end, in the key's slot: until then a release or an extend of one is
--          answered "ended by a reset" (ok = 2)
-- ARGV[1]  'acquire' | 'release' | 'extend' | 'peek' | 'clear' (every lease given back)
-- ARGV[2]  limit     units that may be held at once
-- ARGV[3]  id        the lease (acquire: a new, unique id)
-- ARGV[4]  units     the lease's units (acquire: 1 ..= limit; release, extend: those it
--                    was issued with, or it is not the key's)
-- ARGV[5]  hold_us   acquire, extend: the lease ends this long from now
-- ARGV[6]  now_us    TESTS ONLY: the differential test injects time here. quotad never
--                    passes it: production decisions always use redis.call('TIME').
-- Returns  {ok (0|1|2: a release or extend of a lease a clear ended), held,
--           reset_after_us (until the earliest lease ends), retry_after_us (a denied
--           acquire: until enough leases have ended), expired (units dropped), released
--           (units a release or a clear gave back)}
--
-- Every operation first drops the units whose leases have ended, so an expired lease
-- holds nothing whether or not anyone touched the key since; the key's TTL is its latest
-- expiry, so a key that expires held nothing either. O(units · log N), N <= limit.
if #KEYS ~= 2 or (#ARGV ~= 5 and #ARGV ~= 6) then
  return redis.error_reply('ERR quotad concurrency: expected 2 keys and 5 or 6 arguments')
end
local key, ended_key = KEYS[1], KEYS[2]
local mode = ARGV[1]
local limit = tonumber(ARGV[2])
local id = ARGV[3]
local units = tonumber(ARGV[4])
local hold = tonumber(ARGV[5])
local now = clock_us(ARGV[6])

local expired = redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
-- Whether lease `id` is live with exactly `units` units: a lease is only ever held whole,
-- so a name with another unit count than it was issued with is no lease of the key's.
local function holds()
  return units >= 1 and redis.call('ZSCORE', key, id .. ':' .. units) ~= false
    and redis.call('ZSCORE', key, id .. ':' .. (units + 1)) == false
end
-- A release's or extend's answer for a lease the key does not hold: 2 if a clear gave
-- it back before its end (and that end is ahead), else 0.
local function not_held()
  local e = redis.call('ZSCORE', ended_key, id)
  if e and tonumber(e) > now then return 2 end
  return 0
end
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
  if holds() then
    for i = 1, units do
      released = released + redis.call('ZREM', key, id .. ':' .. i)
    end
    changed = true
  else
    ok = not_held()
  end
elseif mode == 'extend' then
  if holds() then
    local ends = now + hold
    for i = 1, units do
      redis.call('ZADD', key, 'XX', ends, id .. ':' .. i)
    end
    changed = true
  else
    ok = not_held()
  end
elseif mode == 'clear' then
  local all = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
  released = #all / 2
  if released > 0 then
    -- Each lease given back before its end is remembered until then.
    redis.call('ZREMRANGEBYSCORE', ended_key, '-inf', now)
    for i = 1, #all, 2 do
      local lease = string.match(all[i], '^(.*):%d+$')
      redis.call('ZADD', ended_key, all[i + 1], lease)
    end
    local last = redis.call('ZRANGE', ended_key, -1, -1, 'WITHSCORES')
    redis.call('PEXPIRE', ended_key, ttl_ms(tonumber(last[2]) - now))
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
