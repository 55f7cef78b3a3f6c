#!/usr/bin/env bash
# A traffic spike right after a deploy: a fresh redis-server and a fresh quotad (release),
# hit at once by CONNS keep-alive connections (wrk, 10 s, 200,000 keys, healthy Redis),
# RUNS times. Prints per run the decisions, how many took the policy's fail mode (a
# timeout with a healthy Redis is quotad's own doing), the requests shed, and the replies
# taken after their timer fired (quotad_store_late_replies_total).
#
#   bench/spike.sh                 # 4 runs of 500 connections
#   RUNS=10 CONNS=1000 bench/spike.sh
# QUOTAD_BIN runs another build (an older one, for a before/after).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
RUNS=${RUNS:-4}
CONNS=${CONNS:-500}
# shellcheck source=bench/lib.sh
. "$HERE/lib.sh"
need redis-server redis-cli wrk curl
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
(cd "$ROOT" && cargo build --release --locked -q)
Q="${QUOTAD_BIN:-$ROOT/target/release/quotad}"
metric() { awk -v m="$1" 'index($0, m) == 1 {s += $NF} END {print s + 0}' "$2"; }
for r in $(seq "$RUNS"); do
  OUT=$(mktemp -d)
  QP=$(free_port)
  start_redis "$OUT"
  start_quotad "$OUT" </dev/null
  WRK_KEYS=200000 timeout 60 wrk -t2 -c"$CONNS" -d10s -s "$HERE/check.lua" "http://127.0.0.1:$QP/v1/check" >"$OUT/wrk.txt" 2>&1
  curl -s "127.0.0.1:$QP/metrics" >"$OUT/metrics.txt"
  printf 'run %s: %s decisions, fail_open %s, timeouts %s, shed %s, late replies %s\n' "$r" \
    "$(metric quotad_decisions_total "$OUT/metrics.txt")" \
    "$(metric 'quotad_decisions_total{outcome="fail_open"' "$OUT/metrics.txt")" \
    "$(metric 'quotad_store_errors_total{kind="timeout"}' "$OUT/metrics.txt")" \
    "$(metric quotad_shed_total "$OUT/metrics.txt")" \
    "$(metric quotad_store_late_replies_total "$OUT/metrics.txt")"
  bench_cleanup
  QPID=""; RP=""
done
