#!/usr/bin/env bash
# The two transports of the HTTP API, TCP on loopback and a Unix domain socket (a sidecar
# on the same host), beside the Redis EVALSHA ceiling, in one alternating run:
#
#   check-tcp / check-unix   POST /v1/check, examples/http_load.rs, 50 keep-alive
#                            connections (wrk cannot reach a Unix socket, so one client
#                            serves both; it also costs less CPU per request than wrk)
#   open-tcp / open-unix     the same on a quotad whose Redis is unreachable (breaker
#                            open, fail open): the HTTP path alone
#   wrk-tcp                  POST /v1/check with wrk -t1 -c50 (bench/check.lua), for the
#                            comparison with the other scripts
#
#   bench/unix.sh            # 3 rounds, 10 s per run
#   ROUNDS=1 bench/unix.sh   # quick
#
# Four quotads (release): TCP and Unix, each with Redis and with a dead port; the policy of
# bench/run.sh, keys from 100,000. The client's CPU per request is reported too: on the
# 2-core machine it shares the cores with quotad and Redis.
# Needs: redis-server, redis-benchmark, redis-cli, wrk, curl.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-10s}
CONNS=50
NKEYS=100000
OUT=${OUT:-/tmp/quotad-unix-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
# shellcheck source=bench/lib.sh
. "$HERE/lib.sh"
need redis-server redis-benchmark redis-cli wrk curl

(cd "$ROOT" && cargo build --release --locked -q && cargo build --release --locked -q --example http_load)
Q="$ROOT/target/release/quotad"
LOAD="$ROOT/target/release/examples/http_load"
PIDS=()
stop_all() { for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; bench_cleanup; }
trap stop_all EXIT

start_redis "$OUT"
REDIS_PID=$(cat "$OUT/redis.pid")
load_token_bucket "$OUT"
DEAD=$(free_port) # nothing listens here: the breaker-open quotads' Redis

# serve NAME LISTEN REDIS_PORT: a quotad, ready; its PID in QPIDS[NAME].
declare -A QPIDS
serve() {
  mkdir -p "$OUT/$1"
  { printf '[server]\nlisten = "%s"\n[store]\nredis = "redis://127.0.0.1:%s"\n' "$2" "$3"; bench_policy; } >"$OUT/$1/quotad.toml"
  RUST_LOG=warn "$Q" serve --config "$OUT/$1/quotad.toml" 2>"$OUT/$1/quotad.log" &
  QPIDS[$1]=$!; PIDS+=($!)
  local probe=(curl -sf "http://127.0.0.1:${2#127.0.0.1:}/healthz")
  [[ $2 == unix:* ]] && probe=(curl -sf --unix-socket "${2#unix:}" http://quotad/healthz)
  for _ in $(seq 100); do "${probe[@]}" >/dev/null && break; sleep 0.1; done
}
TP=$(free_port); OP=$(free_port)
serve check-tcp "127.0.0.1:$TP" "$RP"
serve check-unix "unix:$OUT/check.sock" "$RP"
serve open-tcp "127.0.0.1:$OP" "$DEAD"
serve open-unix "unix:$OUT/open.sock" "$DEAD"

TSV="$OUT/results.tsv"
printf 'round\trun\trps\tp50_ms\tp99_ms\terrors\tquotad_us_per_op\tredis_us_per_op\tclient_us_per_op\n' >"$TSV"

run() { # round label quotad-name command...
  local round=$1 label=$2 pid=${QPIDS[$3]}; shift 3
  redis-cli -p "$RP" flushall >/dev/null
  local q0 r0 c0=0 res
  rm -f "$OUT/client.ticks"
  q0=$(ticks "$pid"); r0=$(ticks "$REDIS_PID")
  "$@" >"$OUT/client.out" 2>&1
  # The client's CPU over its whole life (it starts at none), as last read by client().
  local c1; c1=$(cat "$OUT/client.ticks" 2>/dev/null || echo 0)
  local q1 r1; q1=$(ticks "$pid"); r1=$(ticks "$REDIS_PID")
  res=$(grep -E '^(WRK|HTTP)_RESULT' "$OUT/client.out")
  kv() { echo "$res" | tr ' ' '\n' | awk -F= -v k="$1" '$1==k{print $2}'; }
  local n errs; n=$(awk -v r="$(kv rps)" -v d="${DURATION%s}" 'BEGIN{printf "%d", r * d}')
  errs=$(( $(kv errors || echo 0) + 0 ))
  [ -n "$(kv non2xx)" ] && errs=$(( $(kv non2xx) + $(kv socket_errors) ))
  local per; per() { awk -v t="$1" -v c="$CLK" -v n="$n" 'BEGIN{printf "%.2f", t / c * 1e6 / n}'; }
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$round" "$label" "$(kv rps)" \
    "$(awk -v u="$(kv p50_us)" 'BEGIN{printf "%.3f", u/1000}')" \
    "$(awk -v u="$(kv p99_us)" 'BEGIN{printf "%.3f", u/1000}')" "$errs" \
    "$(per $((q1 - q0)))" "$(per $((r1 - r0)))" "$(per $((c1 - c0)))" >>"$TSV"
  printf '  r%s %-11s %9.0f /s  errors %s  quotad %s us/op  redis %s us/op  client %s us/op\n' \
    "$round" "$label" "$(kv rps)" "$errs" "$(per $((q1 - q0)))" "$(per $((r1 - r0)))" "$(per $((c1 - c0)))"
}
# Runs a load client, writing its CPU ticks to $OUT/client.ticks every 0.2 s while it
# runs (the last reading is at most 0.2 s short of its end).
client() { # command...
  "$@" &
  local p=$!
  while kill -0 "$p" 2>/dev/null; do ticks "$p" >"$OUT/client.ticks" 2>/dev/null || true; sleep 0.2; done
  wait "$p"
}

{
  echo "# quotad transports bench $(date -u +%FT%TZ)"
  machine
  redis-server --version | head -1
  echo "quotad $("$Q" --version) (release), rounds=$ROUNDS duration=$DURATION conns=$CONNS keys=$NKEYS"
} | tee "$OUT/meta.txt"

for r in $(seq "$ROUNDS"); do
  ceiling "$r"
  run "$r" wrk-tcp check-tcp client env WRK_KEYS="$NKEYS" wrk -t1 -c"$CONNS" -d"$DURATION" -s "$HERE/check.lua" "http://127.0.0.1:$TP/v1/check"
  run "$r" check-tcp check-tcp client "$LOAD" --addr "127.0.0.1:$TP" --connections "$CONNS" --duration "$DURATION" --keys "$NKEYS"
  run "$r" check-unix check-unix client "$LOAD" --addr "unix:$OUT/check.sock" --connections "$CONNS" --duration "$DURATION" --keys "$NKEYS"
  run "$r" open-tcp open-tcp client "$LOAD" --addr "127.0.0.1:$OP" --connections "$CONNS" --duration "$DURATION" --keys "$NKEYS"
  run "$r" open-unix open-unix client "$LOAD" --addr "unix:$OUT/open.sock" --connections "$CONNS" --duration "$DURATION" --keys "$NKEYS"
  ceiling "$r"
done
python3 "$HERE/summarize.py" "$TSV" | tee "$OUT/summary.md"
