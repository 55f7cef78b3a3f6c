-- wrk script: POST /v1/check for policy "bench" on keys k1..kN (N = WRK_KEYS, default
-- 100,000), or on one key when WRK_HOT=1 (the hot-deny path). Prints one WRK_RESULT line.
-- Keys are drawn with math.random, seeded per thread: wrk_common.lua (beside this file)
-- seeds it and prints the WRK_RESULT line.
dofile(debug.getinfo(1, "S").source:match("^@(.-)[^/]*$") .. "wrk_common.lua")
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
