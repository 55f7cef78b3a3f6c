#!/usr/bin/env bash
# quotad's three ways in, beside the Redis EVALSHA ceiling, in one alternating run
# (docs/benchmarks.md: the ratio measured in the same run is the figure):
#
#   POST /v1/check                  wrk -t1 -c50 (bench/check.lua)
#   POST /v1/check, batches of 32   the same with WRK_BATCH=32: decisions/s is 32 x the
#                                   requests/s (beside the EVALSHA -P 32 ceiling)
#   GET /v1/authz/bench             wrk -t1 -c50, forward-auth with an x-api-key (bench/authz.lua)
#   gRPC ShouldRateLimit            examples/grpc_load.rs, twice: 2 HTTP/2 connections
#                                   with 25 calls in flight on each (as Envoy multiplexes
#                                   a worker's calls), and 50 connections with one each
#
#   bench/protocols.sh            # 3 rounds, 10 s per run
#   ROUNDS=1 bench/protocols.sh   # quick
#
# One quotad (release), one redis-server, the policy of bench/run.sh (token_bucket 100 per
# 60 s, fail open), keys from 100,000. No Go toolchain here: no ghz and no envoyproxy/
# ratelimit to compare with; the gRPC client is built from the same envoy-types.
# Needs: redis-server, redis-benchmark, redis-cli, wrk, curl.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-10s}
CONNS=${CONNS:-50}
NKEYS=${NKEYS:-100000}
OUT=${OUT:-/tmp/quotad-protocols-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
# shellcheck source=bench/lib.sh
. "$HERE/lib.sh"
need redis-server redis-benchmark redis-cli wrk curl

(cd "$ROOT" && cargo build --release --locked -q && cargo build --release --locked -q --example grpc_load)
Q="$ROOT/target/release/quotad"
LOAD="$ROOT/target/release/examples/grpc_load"

start_redis "$OUT"
REDIS_PID=$(cat "$OUT/redis.pid")
QP=$(free_port)
GP=$(free_port)
GRPC_LISTEN="127.0.0.1:$GP" start_quotad "$OUT" <<TOML
[policy.forward_auth]
key = ["header:x-api-key"]
[[descriptor]]
domain = "bench"
key = "k"
policy = "bench"
TOML
load_token_bucket "$OUT"
TSV="$OUT/results.tsv"
printf 'round\trun\trps\tp50_ms\tp99_ms\terrors\tquotad_us_per_op\tredis_us_per_op\n' >"$TSV"
fail_open() { curl -s "127.0.0.1:$QP/metrics" | awk '/^quotad_decisions_total\{outcome="fail_open"/ {s += $NF} END {print s + 0}'; }

record() { # round label rps p50_us p99_us errors q0 q1 r0 r1
  local n; n=$(awk -v r="$3" -v d="${DURATION%s}" 'BEGIN{printf "%d", r*d}')
  local qus rus
  qus=$(awk -v t=$(($8 - $7)) -v c="$CLK" -v n="$n" 'BEGIN{printf "%.1f", t / c * 1e6 / n}')
  rus=$(awk -v t=$((${10} - $9)) -v c="$CLK" -v n="$n" 'BEGIN{printf "%.1f", t / c * 1e6 / n}')
  local p50 p99
  p50=$(awk -v u="$4" 'BEGIN{printf "%.3f", u/1000}')
  p99=$(awk -v u="$5" 'BEGIN{printf "%.3f", u/1000}')
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$p50" "$p99" "$6" "$qus" "$rus" >>"$TSV"
  printf '  r%s %-16s %10.0f /s  p50 %s ms  p99 %s ms  errors %s  quotad %s us/op  redis %s us/op\n' \
    "$1" "$2" "$3" "$p50" "$p99" "$6" "$qus" "$rus"
}

http_run() { # round label script path [checks per request]
  redis-cli -p "$RP" flushall >/dev/null
  local q0 r0 f0 res per=${5:-1}
  q0=$(ticks "$QPID"); r0=$(ticks "$REDIS_PID"); f0=$(fail_open)
  res=$(env WRK_KEYS="$NKEYS" WRK_BATCH="$((per > 1 ? per : 0))" timeout 120 wrk -t1 -c"$CONNS" -d"$DURATION" -s "$HERE/$3" "http://127.0.0.1:$QP$4" | grep '^WRK_RESULT')
  kv() { echo "$res" | tr ' ' '\n' | awk -F= -v k="$1" '$1==k{print $2}'; }
  local errs=$(( $(kv non2xx) + $(kv socket_errors) + $(fail_open) - f0 ))
  local decisions; decisions=$(awk -v r="$(kv rps)" -v p="$per" 'BEGIN{printf "%.2f", r * p}')
  record "$1" "$2" "$decisions" "$(kv p50_us)" "$(kv p99_us)" "$errs" "$q0" "$(ticks "$QPID")" "$r0" "$(ticks "$REDIS_PID")"
}

grpc_run() { # round connections streams (connections x streams = $CONNS calls in flight)
  redis-cli -p "$RP" flushall >/dev/null
  local q0 r0 f0 res
  q0=$(ticks "$QPID"); r0=$(ticks "$REDIS_PID"); f0=$(fail_open)
  res=$(timeout 120 "$LOAD" --addr "127.0.0.1:$GP" --domain bench --connections "$2" --streams "$3" --duration "$DURATION" --keys "$NKEYS" | grep '^GRPC_RESULT')
  kv() { echo "$res" | tr ' ' '\n' | awk -F= -v k="$1" '$1==k{print $2}'; }
  local errs=$(( $(kv errors) + $(fail_open) - f0 ))
  record "$1" "grpc-$2x$3" "$(kv rps)" "$(kv p50_us)" "$(kv p99_us)" "$errs" "$q0" "$(ticks "$QPID")" "$r0" "$(ticks "$REDIS_PID")"
}

{
  echo "# quotad protocols bench $(date -u +%FT%TZ)"
  machine
  redis-server --version | head -1
  echo "quotad $("$Q" --version) (release), rounds=$ROUNDS duration=$DURATION conns=$CONNS keys=$NKEYS"
} | tee "$OUT/meta.txt"

for r in $(seq "$ROUNDS"); do
  ceiling "$r"
  ceiling "$r" evalsha-P32 1000000 -P 32
  http_run "$r" check check.lua /v1/check
  http_run "$r" check-batch32 check.lua /v1/check 32
  http_run "$r" forward-auth authz.lua /v1/authz/bench
  grpc_run "$r" 2 $((CONNS / 2))
  grpc_run "$r" "$CONNS" 1
  ceiling "$r"
  ceiling "$r" evalsha-P32 1000000 -P 32
done
echo "results: $TSV"
# Medians over rounds, and each way in over the ceiling measured around it in its round.
python3 "$HERE/summarize.py" "$TSV" | tee "$OUT/summary.md"
