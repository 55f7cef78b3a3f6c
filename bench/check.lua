-- wrk script: POST /v1/check for policy "bench" (or WRK_POLICY) on keys k1..kN (N = WRK_KEYS, default
-- 100,000), or on one key when WRK_HOT=1 (the hot-deny path); with WRK_BATCH=n, each
-- request is a batch of n checks on n keys drawn the same way. Prints one WRK_RESULT line
-- (its rates are requests: a batch's decisions are n times them).
-- Keys are drawn with math.random, seeded per thread: wrk_common.lua (beside this file)
-- seeds it and prints the WRK_RESULT line.
dofile(debug.getinfo(1, "S").source:match("^@(.-)[^/]*$") .. "wrk_common.lua")
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local nkeys = tonumber(os.getenv("WRK_KEYS") or "100000")
local hot = os.getenv("WRK_HOT") == "1"
local policy = os.getenv("WRK_POLICY") or "bench"

local batch = tonumber(os.getenv("WRK_BATCH") or "0")

local function check()
  local key = hot and "hot" or ("k" .. math.random(1, nkeys))
  return '{"policy":"' .. policy .. '","key":"' .. key .. '","cost":1}'
end

request = function()
  if batch > 0 then
    local checks = {}
    for i = 1, batch do checks[i] = check() end
    return wrk.format(nil, nil, nil, '{"checks":[' .. table.concat(checks, ",") .. "]}")
  end
  return wrk.format(nil, nil, nil, check())
end

local denied, allowed = 0, 0
response = function(status, headers, body)
  if body:find('"allowed":false', 1, true) then denied = denied + 1 else allowed = allowed + 1 end
end
