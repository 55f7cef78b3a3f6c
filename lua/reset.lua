-- reset: forget what a key's user spent, and tell every instance, in one step.
--
-- KEYS[1]  the key's state
-- KEYS[2]  optional: the key's reset mark, set to Redis's time (us) for `keep_ms`: the
--          reservations opened before it are ended (settle.lua)
-- ARGV     the invalidation channel, what to forget ('all' | 'spent'), [keep_ms]
-- Returns  1 if there was something to forget, else 0.
--
-- 'all' deletes the key (every local algorithm). 'spent' is a global policy's key: only
-- its bucket (t, ts) goes, so it starts full as a new key does; the lease book (e, r, l,
-- hw, ep) and the offered-load counters (a, x) are the coordinator's and stay, or the
-- region would lend again what it already lent (lua/global/common.lua).
--
-- PUBLISH comes first: if it is refused (an ACL without it) the script stops before
-- anything changed, and the reset is reported not done. Nothing another instance
-- remembers can then outlive a reset that was reported done (store/redis/deny_cache.rs).
if not ((#KEYS == 1 and #ARGV == 2) or (#KEYS == 2 and #ARGV == 3)) then
  return redis.error_reply('ERR quotad reset: expected 1 key and 2 arguments, or 2 and 3')
end
redis.call('PUBLISH', ARGV[1], KEYS[1])
if #KEYS == 2 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  redis.call('SET', KEYS[2], string.format('%d', now), 'PX', tonumber(ARGV[3]))
end
if ARGV[2] == 'spent' then
  return math.min(redis.call('HDEL', KEYS[1], 't', 'ts'), 1)
end
return redis.call('DEL', KEYS[1])
