-- sliding_log: an exact sliding window, one sorted-set entry per admitted unit. The model
-- is quotad_core::algorithm (sliding_log.rs).
--
-- KEYS[1]  sorted set: score = admission time (us), member = '<request id>:<i>' for
--          i = 1..cost, unique per admission so same-microsecond requests never collapse
-- ARGV     see prelude.lua (member = the request id; a refund removes exactly its entries)
-- Returns  {allowed, remaining = limit - entries in the window,
--           reset_after_us = until the newest entry leaves,
--           retry_after_us = until enough of the oldest entries leave for this cost}
-- An entry at time t counts while now - t < window. Denied requests are not recorded.
-- O(log N + M) for M expired entries trimmed (each entry is trimmed once) plus O(cost log N).
if charge then
  return redis.error_reply('ERR quotad sliding_log: a window cannot hold a debt (charge)')
end
-- Entries that left the window are trimmed, except by the usage op, which writes nothing
-- and counts past them (`skip` of them come first by rank).
local count, skip = 0, 0
if USAGE then
  count = redis.call('ZCOUNT', key, string.format('(%d', now - window), '+inf')
  skip = redis.call('ZCARD', key) - count
else
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
  count = redis.call('ZCARD', key)
end

local function reset_after()
  local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  -- (Past the window only for the usage op, which trims nothing: then it has left.)
  if newest[2] then return math.max(0, tonumber(newest[2]) + window - now) end
  return 0
end

if refund then
  for i = 1, cost do
    redis.call('ZREM', key, member .. ':' .. i)
  end
  count = redis.call('ZCARD', key)
  return verdict(true, math.max(0, limit - count), reset_after(), 0)
end

if count + eval_cost <= limit then
  if write then
    -- Variadic ZADD in chunks: one call per 500 entries, not one per unit.
    local i = 1
    while i <= cost do
      local args = {}
      local last = math.min(cost, i + 499)
      for j = i, last do
        args[#args + 1] = now
        args[#args + 1] = member .. ':' .. j
      end
      redis.call('ZADD', key, unpack(args))
      i = last + 1
    end
    count = count + cost
  end
  local reset = reset_after()
  if write then
    -- Until the newest entry leaves (after a clock step-back that is more than a window).
    redis.call('PEXPIRE', key, ttl_ms(reset))
  end
  return verdict(true, limit - count, reset, 0)
end
-- The request fits once the oldest (count + cost - limit) entries have left the window.
local k = count + eval_cost - limit
local kth = redis.call('ZRANGE', key, skip + k - 1, skip + k - 1, 'WITHSCORES')
return verdict(false, math.max(0, limit - count), reset_after(), tonumber(kth[2]) + window - now)
