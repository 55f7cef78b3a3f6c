-- runtime_limit: a key's own limit in a policy, set at runtime by an admin (a billing
-- system), kept in the region's Redis and copied by every instance
-- (src/runtime_limits/). Every change bumps the policy's version and is announced on the
-- invalidation channel, so instances apply it at once; one that missed a message sees the
-- version ahead of its own and reads the whole set again.
--
-- KEYS[1]  H: hash, field = the user key, value "limit:burst:expires_ms:since_ms:origin"
--          (burst 0: the limit, for the window algorithms; expires_ms 0: never; since_ms:
--          the writing region's Redis clock at the write, when these numbers came into
--          force; origin: the region it was written in, for a global policy's spreading;
--          values written before it have four fields)
-- KEYS[2]  V: the policy's version, raised by one by every change
-- KEYS[3]  X: sorted set of the entries that expire, score = expires_ms
-- KEYS[4]  D: sorted set of the keys whose entry went (deleted or expired), score = when
--          (ms): their config numbers came back into force then (the transition rule)
-- KEYS[5]  C: sorted set of the keys by the version of their last change: what a peer
--          region that has seen version v has not (`changes`); kept only with a region
--          (ARGV[11]: a global policy, whose changes spread)
-- All five share a hash tag (one slot in a cluster), and none has a TTL: they are the
-- operator's data, not a limiter's state (the janitor leaves them alone).
-- ARGV[1]  'set' | 'delete' | 'purge' | 'merge' | 'changes'; ARGV[11] this region's name
--          ('' for a policy whose changes do not spread: a local one)
-- set      ARGV: user key, limit, burst, expires_ms, max_keys, channel, policy, storage
--          key, keep_ms. Returns {version, old value or '', version before, now_ms}; {-1, ...}: expires_ms is not
--          after now; {-2, ''}: the policy holds max_keys entries and this key has none.
-- delete   ARGV: user key, -, -, -, -, channel, policy, storage key, keep_ms.
--          Returns {version, old value, version before, now_ms}; {0, ...}: the key had none.
-- purge    ARGV: -, -, -, -, -, channel, policy, -, keep_ms: the entries whose expiry has
--          passed go (at most 100 a call), and the marks of D older than keep_ms.
--          Returns {version, how many went, 0, now_ms}. Every reply has these four
--          elements; now_ms is Redis's clock at the change, when its numbers came into force.
-- merge    ARGV: user key, a peer region's value ('' : the entry went), when it went (ms),
--          -, -, channel, policy, storage key, keep_ms: taken if it is newer than what
--          this region has for the key, by (ms, went before set, origin): the last write
--          wins, the same in every region whatever order changes arrive in. Returns
--          {version, old value or '', version before, now_ms}; {0, ...}: not newer.
-- changes  ARGV: -, after (a version), count: the keys whose last change is after that
--          version, oldest first, at most count. Returns {version, key, its version, its
--          value or '', when it went or 0, ...}. Writes nothing.
-- A change PUBLISHes "#L\t<policy>\t<version before>\t<version>\t<value, or -<now_ms> when
-- it went>\t<user key>" (a copy at the version before applies it) and then the
-- key's storage key (what the deny cache and hot slices of the key drop) first, as a reset
-- does: refused (an ACL without PUBLISH), the script stops before anything changed.
-- O(log N) per entry.
if #KEYS ~= 5 or #ARGV ~= 11 then
  return redis.error_reply('ERR quotad runtime_limit: expected 5 keys and 11 arguments')
end
local H, V, X, D, C = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local op, key = ARGV[1], ARGV[2]
local channel, policy, storage, keep = ARGV[7], ARGV[8], ARGV[9], tonumber(ARGV[10])
local region = ARGV[11]
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
local function put_version(v, k)
  redis.call('SET', V, string.format('%d', v))
  if region ~= '' then redis.call('ZADD', C, v, k) end
  return v
end
local function announce(version, value, k, stored)
  local head = string.format('#L\t%s\t%d\t%d\t', policy, current_version(), version)
  redis.call('PUBLISH', channel, head .. value .. '\t' .. k)
  if stored then redis.call('PUBLISH', channel, stored) end
end
-- The entry of `k` goes: its config numbers are back in force from `at` (ms).
local function gone(k, stored, at)
  local v = next_version()
  announce(v, string.format('-%d', at), k, stored)
  redis.call('HDEL', H, k)
  redis.call('ZREM', X, k)
  redis.call('ZADD', D, at, k)
  return put_version(v, k)
end
-- Entries past their expiry go, up to `most`; marks older than keep_ms are dropped, and
-- with them the key's place among the changes.
local function purge(most)
  local due = redis.call('ZRANGEBYSCORE', X, '-inf', now, 'LIMIT', 0, most)
  for _, k in ipairs(due) do gone(k, nil, now) end
  local old = redis.call('ZRANGEBYSCORE', D, '-inf', now - keep, 'LIMIT', 0, 100)
  for _, k in ipairs(old) do
    redis.call('ZREM', D, k)
    redis.call('ZREM', C, k)
  end
  return #due
end
-- `k` gets `value` (expiring at `expires`, 0: never), announced first: the new version.
local function put_entry(k, value, expires, stored)
  local v = next_version()
  announce(v, value, k, stored)
  redis.call('HSET', H, k, value)
  if expires > 0 then
    redis.call('ZADD', X, expires, k)
  else
    redis.call('ZREM', X, k)
  end
  redis.call('ZREM', D, k)
  return put_version(v, k)
end
-- An entry's (since_ms, 0, origin), a mark's (ms, 1, ''): the order of writes across
-- regions (a delete after a set at the same ms; origins by name).
local function stamp_of(value)
  local f = {}
  for w in string.gmatch(value, '[^:]+') do f[#f + 1] = w end
  return {tonumber(f[4]) or 0, 0, f[5] or ''}
end
local function newer(a, b)
  if a[1] ~= b[1] then return a[1] > b[1] end
  if a[2] ~= b[2] then return a[2] > b[2] end
  return a[3] > b[3]
end
local function current_stamp(k)
  local v = redis.call('HGET', H, k)
  if v then return stamp_of(v), v end
  local at = tonumber(redis.call('ZSCORE', D, k))
  if at then return {at, 1, ''}, nil end
  return nil, nil
end

if op == 'purge' then
  local n = purge(100)
  return {current_version(), n, 0, now}
end
if op == 'changes' then
  local after, count = tonumber(ARGV[3]), tonumber(ARGV[4])
  local out = {current_version()}
  local page = redis.call('ZRANGEBYSCORE', C, '(' .. string.format('%d', after), '+inf',
    'WITHSCORES', 'LIMIT', 0, count)
  for i = 1, #page, 2 do
    local k = page[i]
    local v = redis.call('HGET', H, k)
    local at = 0
    if not v then
      v = ''
      at = tonumber(redis.call('ZSCORE', D, k)) or 0
    end
    out[#out + 1] = k
    out[#out + 1] = page[i + 1]
    out[#out + 1] = v
    out[#out + 1] = string.format('%d', at)
  end
  return out
end
if op == 'merge' then
  local value, at = ARGV[3], tonumber(ARGV[4])
  local incoming
  if value == '' then incoming = {at, 1, ''} else incoming = stamp_of(value) end
  local cur, old = current_stamp(key)
  if cur and not newer(incoming, cur) then return {0, '', 0, now} end
  local before = current_version()
  if value == '' then
    if not old then
      -- Nothing here to end: the mark alone, so that an older set is not taken after it.
      redis.call('ZADD', D, at, key)
      return {0, '', before, now}
    end
    return {gone(key, storage, at), old, before, now}
  end
  local expires = tonumber(string.match(value, '^[^:]+:[^:]+:([^:]+):')) or 0
  return {put_entry(key, value, expires, storage), old or '', before, now}
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
  if region ~= '' then value = value .. ':' .. region end
  local before = current_version()
  return {put_entry(key, value, expires, storage), old or '', before, now}
end
if op == 'delete' then
  local old = redis.call('HGET', H, key)
  if not old then return {0, '', 0, now} end
  local before = current_version()
  return {gone(key, storage, now), old, before, now}
end
return redis.error_reply('ERR quotad runtime_limit: expected set, delete, purge, merge or changes')
