-- What check.lua and authz.lua share (each loads this file): math.random seeded once per
-- wrk thread, and the one WRK_RESULT line the bench scripts read.
--
-- Seeding: the wrk scripts draw keys with math.random. Unseeded, LuaJIT starts every
-- thread of every run from the same state: each run sent the same key sequence, and so
-- did each thread of a run. The seed is the clock (os.time) and the thread's number, which setup
-- hands each thread before it starts.
local threads = 0

function setup(thread)
  threads = threads + 1
  thread:set("thread_number", threads)
end

function init(args)
  math.randomseed(os.time() * 1000 + thread_number)
end

-- One line for the bench scripts: rate, latency percentiles (us), non-2xx answers and
-- socket errors.
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRK_RESULT rps=%.1f p50_us=%d p99_us=%d p999_us=%d non2xx=%d socket_errors=%d\n",
    summary.requests / (summary.duration / 1e6), latency:percentile(50), latency:percentile(99),
    latency:percentile(99.9), e.status, e.connect + e.read + e.write + e.timeout))
end
