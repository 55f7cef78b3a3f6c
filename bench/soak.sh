#!/usr/bin/env bash
# Soak: one quotad (release) held at 70% of its measured capacity for 30 minutes, with a
# Redis fault every few minutes, recording once a second what would show a leak or a
# failure that outlives its cause. Not in CI (it takes the machine for half an hour).
#
#   bench/soak.sh                                  # 30 min, a fault every 3 min
#   DURATION=5m FAULT_EVERY=60 bench/soak.sh       # quick
#
# Load: examples/fixed_rate.rs (open loop, 50 connections, POST /v1/check on 100,000 keys,
# the benchmarks' policy: token bucket, fail open) at SHARE (0.7) of the capacity wrk
# measured just before. Faults, in turn: Redis stopped (SIGSTOP) for FAULT_SECONDS, then
# Redis shut down and started again on its port after FAULT_SECONDS (empty, scripts gone).
# Every second soak.tsv gets: seconds, quotad's RSS (KiB), open fds, open HTTP
# connections, and the running totals of decisions, fail_open decisions, store errors,
# shed requests, breaker openings, and whether the store is up; faults.tsv the faults.
# bench/soak_plot.py draws soak.svg from them; summary.txt compares the first and last
# minutes. Needs: redis-server, redis-cli, wrk, curl, python3.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
DURATION=${DURATION:-30m}
FAULT_EVERY=${FAULT_EVERY:-180}
FAULT_SECONDS=${FAULT_SECONDS:-5}
SHARE=${SHARE:-0.7}
CONNS=50
NKEYS=100000
OUT=${OUT:-/tmp/quotad-soak-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
# shellcheck source=bench/lib.sh
. "$HERE/lib.sh"
need redis-server redis-cli wrk curl python3

(cd "$ROOT" && cargo build --release --locked -q && cargo build --release --locked -q --example fixed_rate)
Q="$ROOT/target/release/quotad"
LOAD="$ROOT/target/release/examples/fixed_rate"
SECONDS_TOTAL=$(python3 -c "import sys; from datetime import timedelta; \
u={'s':1,'m':60,'h':3600}; d=sys.argv[1]; print(int(float(d[:-1])*u[d[-1]]))" "$DURATION")

start_redis "$OUT"
QP=$(free_port)
start_quotad "$OUT" </dev/null

CAP=$(env WRK_KEYS="$NKEYS" wrk -t1 -c"$CONNS" -d10s -s "$HERE/check.lua" "http://127.0.0.1:$QP/v1/check" \
  | awk -F'rps=' '/^WRK_RESULT/ {split($2, a, " "); print int(a[1])}')
RATE=$(awk -v c="$CAP" -v s="$SHARE" 'BEGIN{print int(c * s)}')
redis-cli -p "$RP" flushall >/dev/null
{
  echo "# quotad soak $(date -u +%FT%TZ)"
  machine
  redis-server --version | head -1
  echo "capacity (wrk -t1 -c$CONNS, 10 s): $CAP/s; held: $RATE/s ($SHARE) for $DURATION"
  echo "faults every ${FAULT_EVERY}s, ${FAULT_SECONDS}s each: SIGSTOP, then shutdown + restart, in turn"
} | tee "$OUT/meta.txt"

"$LOAD" --http "127.0.0.1:$QP" --rate "$RATE" --connections "$CONNS" --duration "$DURATION" \
  --keys "$NKEYS" >"$OUT/load.txt" 2>&1 &
LOAD_PID=$!

# One metric's value (summed over its series) from a /metrics text on stdin.
metric() { awk -v m="$1" 'index($0, m) == 1 && substr($0, length(m) + 1, 1) ~ /[{ ]/ {s += $NF} END {printf "%d", s}'; }

printf 't\trss_kib\tfds\tconnections\tdecisions\tfail_open\tstore_errors\tshed\tbreaker_opens\tstore_up\n' >"$OUT/soak.tsv"
printf 't\tfault\n' >"$OUT/faults.tsv"
START=$(date +%s)
next_fault=$FAULT_EVERY
kind=stall
while kill -0 "$LOAD_PID" 2>/dev/null; do
  now=$(( $(date +%s) - START ))
  m=$(curl -sf --max-time 2 "127.0.0.1:$QP/metrics" || true)
  rss=$(awk '/^VmRSS/ {print $2}' "/proc/$QPID/status")
  fds=$(find "/proc/$QPID/fd" -mindepth 1 -maxdepth 1 2>/dev/null | wc -l)
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$now" "$rss" "$fds" \
    "$(echo "$m" | grep '^quotad_connections_open{listener="http"}' | awk '{printf "%d", $2}')" \
    "$(echo "$m" | metric quotad_decisions_total)" \
    "$(echo "$m" | grep '^quotad_decisions_total{outcome="fail_open"' | awk '{s += $2} END {printf "%d", s}')" \
    "$(echo "$m" | metric quotad_store_errors_total)" \
    "$(echo "$m" | metric quotad_shed_total)" \
    "$(echo "$m" | metric quotad_store_breaker_opens_total)" \
    "$(echo "$m" | metric quotad_store_up)" >>"$OUT/soak.tsv"
  if [ "$now" -ge "$next_fault" ] && [ "$now" -lt $((SECONDS_TOTAL - FAULT_EVERY / 2)) ]; then
    printf '%s\t%s\n' "$now" "$kind" >>"$OUT/faults.tsv"
    if [ "$kind" = stall ]; then
      kill -STOP "$(cat "$OUT/redis.pid")"
      ( sleep "$FAULT_SECONDS"; kill -CONT "$(cat "$OUT/redis.pid")" ) &
      kind=restart
    else
      redis-cli -p "$RP" shutdown nosave >/dev/null 2>&1 || true
      ( sleep "$FAULT_SECONDS"
        redis-server --port "$RP" --bind 127.0.0.1 --save '' --appendonly no --daemonize yes \
          --dir "$OUT" --pidfile "$OUT/redis.pid" >/dev/null ) &
      kind=stall
    fi
    next_fault=$((next_fault + FAULT_EVERY))
  fi
  sleep 1
done
wait "$LOAD_PID" || true

python3 "$HERE/soak_plot.py" "$OUT" | tee "$OUT/summary.txt"
cat "$OUT/load.txt" | tee -a "$OUT/summary.txt"
echo "results: $OUT"
