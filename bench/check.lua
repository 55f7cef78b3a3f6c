-- wrk script: POST /v1/check for policy "bench" on keys k1..kN (N = WRK_KEYS, default
-- 100,000), or on one key when WRK_HOT=1 (the hot-deny path). Prints one WRK_RESULT line.
-- Keys are drawn with math.random, seeded per thread from os.time and the thread's
-- number (seed.lua, beside this file): every run and every thread draws its own sequence.
dofile(debug.getinfo(1, "S").source:match("^@(.-)[^/]*$") .. "seed.lua")
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local nkeys = tonumber(os.getenv("WRK_KEYS") or "100000")
local hot = os.getenv("WRK_HOT") == "1"

request = function()
  local key = hot and "hot" or ("k" .. math.random(1, nkeys))
  return wrk.format(nil, nil, nil, '{"policy":"bench","key":"' .. key .. '","cost":1}')
end

local denied, allowed = 0, 0
response = function(status, headers, body)
  if body:find('"allowed":false', 1, true) then denied = denied + 1 else allowed = allowed + 1 end
end

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRK_RESULT rps=%.1f p50_us=%d p99_us=%d p999_us=%d non2xx=%d socket_errors=%d\n",
    summary.requests / (summary.duration / 1e6), latency:percentile(50), latency:percentile(99),
    latency:percentile(99.9), e.status, e.connect + e.read + e.write + e.timeout))
end
