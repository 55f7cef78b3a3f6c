-- quotad limiter helpers: prepended to every algorithm script and to the composite script
-- (see src/store/scripts.rs), so TTLs and replies are built in one place.

-- Key TTL in ms for a state that becomes equivalent to "absent" after us microseconds:
-- rounded up, plus a 1 s grace. The grace is measured, not decorative: under load, Redis
-- 7.0 was seen to apply a PEXPIRE from inside a script against a time base tens of ms
-- old, and a key that expires early turns a partly spent state into a full one.
local function ttl_ms(us)
  return math.ceil(us / 1000) + 1000
end
local function floor_u(x)
  if x <= 0 then return 0 end
  return math.floor(x)
end
local function verdict(allowed, remaining, reset_after, retry_after)
  if allowed then return {1, remaining, reset_after, 0} end
  if retry_after < 1 then retry_after = 1 end
  return {0, remaining, reset_after, retry_after}
end
