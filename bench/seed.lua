-- Seeds math.random once per wrk thread, for the wrk scripts that draw keys with it
-- (check.lua and authz.lua load this file). Unseeded, LuaJIT starts every thread of
-- every run from the same state: each run sent the same key sequence, and so did each
-- thread of a run. The seed is the clock (os.time) and the thread's number, which setup
-- hands each thread before it starts.
local threads = 0

function setup(thread)
  threads = threads + 1
  thread:set("thread_number", threads)
end

function init(args)
  math.randomseed(os.time() * 1000 + thread_number)
end
