#!/usr/bin/env bash
# Latency at a fixed offered rate below saturation: quotad's POST /v1/check beside a client
# calling Redis itself (EVALSHA of quotad's token-bucket script, one connection per worker),
# at 50% and 80% of the capacity each showed in a closed-loop run just before. Open loop
# (examples/fixed_rate.rs): each request's latency counts from when it was scheduled.
#
#   bench/latency.sh                 # 10 s per run
#   DURATION=5s bench/latency.sh     # quick
#
# One quotad (release), one redis-server, the policy of bench/run.sh (token_bucket 100 per
# 60 s, fail open), keys from 100,000, 50 connections. Reported, never asserted.
# Needs: redis-server, redis-benchmark, redis-cli, wrk, curl.
# shellcheck source=bench/lib.sh
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
source "$HERE/lib.sh"
DURATION=${DURATION:-10s}
CONNS=50
NKEYS=100000
OUT=$(mktemp -d /tmp/quotad-latency-XXXXXX)

(cd "$ROOT" && cargo build --release --locked -q && cargo build --release --locked -q --example fixed_rate)
Q="$ROOT/target/release/quotad"
LOAD="$ROOT/target/release/examples/fixed_rate"

start_redis "$OUT"
REDIS_PID=$(cat "$OUT/redis.pid")
QP=$(free_port)
start_quotad "$OUT" </dev/null
load_token_bucket "$OUT"

# Capacity, closed loop: wrk for quotad, redis-benchmark -c 50 for EVALSHA.
CAP_Q=$(env WRK_KEYS="$NKEYS" wrk -t1 -c"$CONNS" -d5s -s "$HERE/check.lua" "http://127.0.0.1:$QP/v1/check" | awk -F'rps=' '/^WRK_RESULT/ {split($2, a, " "); print int(a[1])}')
CAP_R=$(redis-benchmark -p "$RP" -c "$CONNS" -n 300000 -r "$NKEYS" --csv "${EVAL_ARGS[@]}" 2>/dev/null | grep -i '^"evalsha' | tail -1 | awk -F'","' '{print int($2)}')
{
  echo "# quotad latency bench $(date -u +%FT%TZ)"
  machine
  redis-server --version | head -1
  echo "capacity (closed loop, $CONNS connections): quotad $CAP_Q/s, EVALSHA $CAP_R/s"
} | tee "$OUT/meta.txt"

printf 'target\tload\trate\tp50_ms\tp99_ms\tp999_ms\terrors\n' >"$OUT/results.tsv"
run() { # label load-fraction rate args...
  local label=$1 frac=$2 rate=$3; shift 3
  redis-cli -p "$RP" flushall >/dev/null
  local res; res=$("$LOAD" "$@" --rate "$rate" --connections "$CONNS" --duration "$DURATION" --keys "$NKEYS")
  kv() { echo "$res" | tr ' ' '\n' | awk -F= -v k="$1" '$1==k{print $2}'; }
  local p50 p99 p999
  p50=$(awk -v u="$(kv p50_us)" 'BEGIN{printf "%.3f", u/1000}')
  p99=$(awk -v u="$(kv p99_us)" 'BEGIN{printf "%.3f", u/1000}')
  p999=$(awk -v u="$(kv p999_us)" 'BEGIN{printf "%.3f", u/1000}')
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$label" "$frac" "$rate" "$p50" "$p99" "$p999" "$(kv errors)" >>"$OUT/results.tsv"
  printf '  %-8s %3s%% of capacity %8s /s  p50 %s ms  p99 %s ms  p99.9 %s ms  errors %s\n' "$label" "$frac" "$rate" "$p50" "$p99" "$p999" "$(kv errors)"
}
for frac in 50 80; do
  run quotad "$frac" $((CAP_Q * frac / 100)) --http "127.0.0.1:$QP"
  run evalsha "$frac" $((CAP_R * frac / 100)) --redis "127.0.0.1:$RP" --sha "$SHA"
  # The same absolute rate for both: quotad's.
  run evalsha "$frac-q" $((CAP_Q * frac / 100)) --redis "127.0.0.1:$RP" --sha "$SHA"
done
echo "results: $OUT/results.tsv"
