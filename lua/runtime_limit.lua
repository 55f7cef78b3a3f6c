-- runtime_limit: a key's own limit in a policy, set at runtime by an admin (a billing
-- system), kept in the region's Redis and copied by every instance
-- (src/runtime_limits/). Every change bumps the policy's version and is announced on the
-- invalidation channel, so instances apply it at once; one that missed a message sees the
-- version ahead of its own and reads the whole set again.
--
-- KEYS[1]  H: hash, field = the user key, value "limit:burst:expires_ms:since_ms" (burst 0:
--          the limit, for the window algorithms; expires_ms 0: never; since_ms: Redis's
--          clock at the write, when these numbers came into force)
-- KEYS[2]  V: the policy's version, raised by one by every change
-- KEYS[3]  X: sorted set of the entries that expire, score = expires_ms
-- KEYS[4]  D: sorted set of the keys whose entry went (deleted or expired), score = when
--          (ms): their config numbers came back into force then (the transition rule)
-- All four share a hash tag (one slot in a cluster), and none has a TTL: they are the
-- operator's data, not a limiter's state (the janitor leaves them alone).
-- ARGV[1]  'set' | 'delete' | 'purge'
-- set      ARGV: user key, limit, burst, expires_ms, max_keys, channel, policy, storage
--          key, keep_ms. Returns {version, old value or '', version before, now_ms}; {-1, ...}: expires_ms is not
--          after now; {-2, ''}: the policy holds max_keys entries and this key has none.
-- delete   ARGV: user key, -, -, -, -, channel, policy, storage key, keep_ms.
--          Returns {version, old value, version before, now_ms}; {0, ...}: the key had none.
-- purge    ARGV: -, -, -, -, -, channel, policy, -, keep_ms: the entries whose expiry has
--          passed go (at most 100 a call), and the marks of D older than keep_ms.
--          Returns {version, how many went, 0, now_ms}. Every reply has these four
--          elements; now_ms is Redis's clock at the change, when its numbers came into force.
-- A change PUBLISHes "#L\t<policy>\t<version before>\t<version>\t<value, or -<now_ms> when
-- it went>\t<user key>" (a copy at the version before applies it) and then the
-- key's storage key (what the deny cache and hot slices of the key drop) first, as a reset
-- does: refused (an ACL without PUBLISH), the script stops before anything changed.
-- O(log N) per entry.
if #KEYS ~= 4 or #ARGV ~= 10 then
  return redis.error_reply('ERR quotad runtime_limit: expected 4 keys and 10 arguments')
end
local H, V, X, D = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local op, key = ARGV[1], ARGV[2]
local channel, policy, storage, keep = ARGV[7], ARGV[8], ARGV[9], tonumber(ARGV[10])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- The next version. A set that lost its version (a Redis restarted without persistence,
-- a failover to a replica without the last writes) starts again from Redis's clock in
-- ms x 1000: far above any version before, so no copy takes the new versions for ones it
-- has already applied.
local function current_version()
  return tonumber(redis.call('GET', V)) or 0
end
local function next_version()
  local v = current_version()
  if v > 0 then return v + 1 end
  return now * 1000
end
local function put_version(v)
  redis.call('SET', V, string.format('%d', v))
  return v
end
local function announce(version, value, k, stored)
  local head = string.format('#L\t%s\t%d\t%d\t', policy, current_version(), version)
  redis.call('PUBLISH', channel, head .. value .. '\t' .. k)
  if stored then redis.call('PUBLISH', channel, stored) end
end
-- The entry of `k` goes: its config numbers are back in force from now.
local function gone(k, stored)
  local v = next_version()
  announce(v, string.format('-%d', now), k, stored)
  redis.call('HDEL', H, k)
  redis.call('ZREM', X, k)
  redis.call('ZADD', D, now, k)
  return put_version(v)
end
-- Entries past their expiry go, up to `most`; marks older than keep_ms are dropped.
local function purge(most)
  local due = redis.call('ZRANGEBYSCORE', X, '-inf', now, 'LIMIT', 0, most)
  for _, k in ipairs(due) do gone(k) end
  redis.call('ZREMRANGEBYSCORE', D, '-inf', now - keep)
  return #due
end

if op == 'purge' then
  local n = purge(100)
  return {current_version(), n, 0, now}
end
if op == 'set' then
  local limit, burst, expires = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
  local most = tonumber(ARGV[6])
  if expires > 0 and expires <= now then return {-1, '', 0, now} end
  local old = redis.call('HGET', H, key)
  if not old then
    -- What has expired makes room first.
    purge(10)
    if redis.call('HLEN', H) >= most then return {-2, '', 0, now} end
  end
  local value = string.format('%d:%d:%d:%d', limit, burst, expires, now)
  local before = current_version()
  local v = next_version()
  announce(v, value, key, storage)
  redis.call('HSET', H, key, value)
  if expires > 0 then
    redis.call('ZADD', X, expires, key)
  else
    redis.call('ZREM', X, key)
  end
  redis.call('ZREM', D, key)
  return {put_version(v), old or '', before, now}
end
if op == 'delete' then
  local old = redis.call('HGET', H, key)
  if not old then return {0, '', 0, now} end
  local before = current_version()
  return {gone(key, storage), old, before, now}
end
return redis.error_reply('ERR quotad runtime_limit: expected set, delete or purge')
