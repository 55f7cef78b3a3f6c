-- reset: forget what a key's user spent, and tell every instance, in one step.
--
-- KEYS[1]  the key's state
-- ARGV     the invalidation channel, what to forget ('all' | 'spent')
-- Returns  1 if there was something to forget, else 0.
--
-- 'all' deletes the key (every local algorithm). 'spent' is a global policy's key: only
-- its bucket (t, ts) goes, so it starts full as a new key does; the lease book (e, r, l,
-- hw, ep) and the offered-load counters (a, x) are the coordinator's and stay, or the
-- region would lend again what it already lent (lua/global/common.lua).
--
-- PUBLISH comes first: if it is refused (an ACL without it) the script stops before
-- anything changed, and the reset is reported not done. Nothing another instance
-- remembers can then outlive a reset that was reported done (store/deny_cache.rs).
if #KEYS ~= 1 or #ARGV ~= 2 then
  return redis.error_reply('ERR quotad reset: expected 1 key and 2 arguments')
end
redis.call('PUBLISH', ARGV[1], KEYS[1])
if ARGV[2] == 'spent' then
  return math.min(redis.call('HDEL', KEYS[1], 't', 'ts'), 1)
end
return redis.call('DEL', KEYS[1])
