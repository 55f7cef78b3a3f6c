#!/usr/bin/env bash
# quotad load benchmark beside the Redis EVALSHA ceiling, in one alternating run
# (docs/benchmarks.md: the ratio measured in the same run is the figure).
#
#   bench/run.sh            # 3 rounds, 10 s per quotad run
#   ROUNDS=1 bench/run.sh   # quick
#
# Per round: redis-benchmark EVALSHA of quotad's own token-bucket script (the exact source
# quotad loads, from `quotad script token_bucket`), -c 50 then -c 50 -P 32, on keys drawn
# from 100,000; then wrk -t1 -c50 -d10s on POST /v1/check (same key space, same policy:
# 100 per 60 s); then the ceiling again. After the rounds: the hot-deny path (one key, every
# check over the limit) and the breaker-open path (Redis stopped, policy fails open).
# Needs: redis-server, redis-benchmark, redis-cli, wrk (apt-get install redis-server wrk).
# Everything listens on 127.0.0.1; every run is bounded by its duration.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-10s}
CONNS=${CONNS:-50}
NKEYS=${NKEYS:-100000}
OUT=${OUT:-/tmp/quotad-bench-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
# shellcheck source=bench/lib.sh
. "$HERE/lib.sh"
need redis-server redis-benchmark redis-cli wrk

(cd "$ROOT" && cargo build --release --locked -q)
Q="$ROOT/target/release/quotad"

start_redis "$OUT"
REDIS_PID=$(cat "$OUT/redis.pid")
QP=$(free_port)
start_quotad "$OUT" </dev/null
# The same EVALSHA quotad sends: key, mode, limit, window_us, burst, cost, member, frame,
# since.
load_token_bucket "$OUT"

TSV="$OUT/results.tsv"
printf 'round\trun\trps\tp50_ms\tp99_ms\tp999_ms\terrors\tquotad_us_per_op\tredis_us_per_op\n' >"$TSV"

ceiling() { # round label requests extra-args...
  local round=$1 label=$2 n=$3; shift 3
  redis-cli -p "$RP" flushall >/dev/null
  local r0 r1 line
  r0=$(ticks "$REDIS_PID")
  line=$(redis-benchmark -p "$RP" -c "$CONNS" -n "$n" "$@" -r "$NKEYS" --csv "${EVAL_ARGS[@]}" 2>/dev/null | grep -i '^"evalsha' | tail -1)
  r1=$(ticks "$REDIS_PID")
  local rps p50 p99
  rps=$(echo "$line" | awk -F'","' '{print $2}')
  p50=$(echo "$line" | awk -F'","' '{print $5}')
  p99=$(echo "$line" | awk -F'","' '{print $7}')
  local rus; rus=$(awk -v t=$((r1 - r0)) -v c="$CLK" -v n="$n" 'BEGIN{printf "%.1f", t / c * 1e6 / n}')
  printf '%s\t%s\t%s\t%s\t%s\t-\t0\t-\t%s\n' "$round" "$label" "$rps" "$p50" "$p99" "$rus" >>"$TSV"
  printf '  r%s %-22s %10.0f /s  p50 %s ms  p99 %s ms  redis %s us/op\n' "$round" "$label" "$rps" "$p50" "$p99" "$rus"
}

target() { # round label [env...]
  local round=$1 label=$2; shift 2
  # (never against a stopped Redis: redis-cli would wait for it forever)
  [ "$round" = open ] || redis-cli -p "$RP" flushall >/dev/null
  local q0 q1 r0 r1 res
  q0=$(ticks "$QPID"); r0=$(ticks "$REDIS_PID" 2>/dev/null || echo 0)
  res=$(env WRK_KEYS="$NKEYS" "$@" wrk -t1 -c"$CONNS" -d"$DURATION" -s "$HERE/check.lua" "http://127.0.0.1:$QP/v1/check" | grep '^WRK_RESULT')
  q1=$(ticks "$QPID"); r1=$(ticks "$REDIS_PID" 2>/dev/null || echo 0)
  kv() { echo "$res" | tr ' ' '\n' | awk -F= -v k="$1" '$1==k{print $2}'; }
  local rps; rps=$(kv rps)
  local secs; secs=${DURATION%s}
  local n; n=$(awk -v r="$rps" -v s="$secs" 'BEGIN{printf "%d", r*s}')
  local qus rus
  qus=$(awk -v t=$((q1 - q0)) -v c="$CLK" -v n="$n" 'BEGIN{printf "%.1f", t / c * 1e6 / n}')
  rus=$(awk -v t=$((r1 - r0)) -v c="$CLK" -v n="$n" 'BEGIN{printf "%.1f", t / c * 1e6 / n}')
  local p50 p99 p999 errs
  p50=$(awk -v u="$(kv p50_us)" 'BEGIN{printf "%.3f", u/1000}')
  p99=$(awk -v u="$(kv p99_us)" 'BEGIN{printf "%.3f", u/1000}')
  p999=$(awk -v u="$(kv p999_us)" 'BEGIN{printf "%.3f", u/1000}')
  errs=$(( $(kv non2xx) + $(kv socket_errors) ))
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$round" "$label" "$rps" "$p50" "$p99" "$p999" "$errs" "$qus" "$rus" >>"$TSV"
  printf '  r%s %-22s %10.0f /s  p50 %s ms  p99 %s ms  p99.9 %s ms  errors %s  quotad %s us/op  redis %s us/op\n' \
    "$round" "$label" "$rps" "$p50" "$p99" "$p999" "$errs" "$qus" "$rus"
}

{
  echo "# quotad bench $(date -u +%FT%TZ)"
  machine
  echo "$(redis-server --version | head -1)"
  echo "$(wrk -v 2>&1 | head -1)"
  echo "quotad $("$Q" --version) (release), sha $SHA, rounds=$ROUNDS duration=$DURATION conns=$CONNS keys=$NKEYS"
} | tee "$OUT/meta.txt"

echo "warm-up"
env WRK_KEYS="$NKEYS" wrk -t1 -c"$CONNS" -d2s -s "$HERE/check.lua" "http://127.0.0.1:$QP/v1/check" >/dev/null
for r in $(seq "$ROUNDS"); do
  ceiling "$r" evalsha-c50 400000
  ceiling "$r" evalsha-P32 1000000 -P 32
  target "$r" quotad
  ceiling "$r" evalsha-c50 400000
  ceiling "$r" evalsha-P32 1000000 -P 32
done
echo "hot key (every check denied after the first 100):"
target hot quotad-hot-deny WRK_HOT=1
echo "breaker open (Redis stopped with SIGSTOP; policy fails open):"
# Server-side decision time from quotad's own histogram, over this run only: series $1
# summed over its entry points, only those carrying label $2 when given.
hist() {
  curl -s "127.0.0.1:$QP/metrics" |
    awk -v s="$1" -v l="${2:-}" 'index($0, s) == 1 && (l == "" || index($0, l)) {t += $NF} END {printf "%d", t}'
}
kill -STOP "$REDIS_PID"
sleep 0.5
b0=$(hist quotad_check_duration_seconds_bucket 'le="0.001"'); c0=$(hist quotad_check_duration_seconds_count)
target open quotad-fail-open
b1=$(hist quotad_check_duration_seconds_bucket 'le="0.001"'); c1=$(hist quotad_check_duration_seconds_count)
kill -CONT "$REDIS_PID"
awk -v b=$((b1 - b0)) -v c=$((c1 - c0)) 'BEGIN{printf "  breaker open: %d of %d decisions (%.3f%%) took under 1 ms in quotad (quotad_check_duration_seconds)\n", b, c, 100*b/c}' \
  | tee "$OUT/fail-open-latency.txt"
echo "results: $TSV"
python3 "$HERE/summarize.py" "$TSV" | tee "$OUT/summary.md"
