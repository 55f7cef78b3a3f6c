-- wrk script: forward-auth, GET /v1/authz/bench with an x-api-key from k1..kN (N =
-- WRK_KEYS, default 100,000), as a proxy would ask. Keys are drawn with math.random,
-- seeded per thread; wrk_common.lua (beside this file) seeds it and prints the one
-- WRK_RESULT line, as for check.lua.
dofile(debug.getinfo(1, "S").source:match("^@(.-)[^/]*$") .. "wrk_common.lua")
local nkeys = tonumber(os.getenv("WRK_KEYS") or "100000")

request = function()
  return wrk.format("GET", nil, {["x-api-key"] = "k" .. math.random(1, nkeys)}, nil)
end
