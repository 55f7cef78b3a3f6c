-- wrk script: forward-auth, GET /v1/authz/bench with an x-api-key from k1..kN (N =
-- WRK_KEYS, default 100,000), as a proxy would ask. Prints one WRK_RESULT line (as
-- check.lua does). Keys are drawn with math.random, seeded per thread from os.time and
-- the thread's number (seed.lua, beside this file), as in check.lua.
dofile(debug.getinfo(1, "S").source:match("^@(.-)[^/]*$") .. "seed.lua")
local nkeys = tonumber(os.getenv("WRK_KEYS") or "100000")

request = function()
  return wrk.format("GET", nil, {["x-api-key"] = "k" .. math.random(1, nkeys)}, nil)
end

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRK_RESULT rps=%.1f p50_us=%d p99_us=%d p999_us=%d non2xx=%d socket_errors=%d\n",
    summary.requests / (summary.duration / 1e6), latency:percentile(50), latency:percentile(99),
    latency:percentile(99.9), e.status, e.connect + e.read + e.write + e.timeout))
end
