#!/usr/bin/env bash
# Hot-key slices (docs/architecture.md#hot-key-slices), in one alternating run:
#
#   hot-check          POST /v1/check of one key, wrk -t1 -c50, on a quotad whose policy
#                      (fixed_window, 1,000,000,000 per hour) turns the key hot at 1,000/s
#   breaker-open       the same load on a second quotad with the same policy whose Redis is
#                      unreachable (breaker open, fail open): the HTTP path alone
#   cold-check         the same load with hot_key_rate unset: every check a Redis call
#   hot-batch32        batches of 32 checks of the hot key (decisions/s = 32 x requests/s)
#   evalsha-P32        the EVALSHA -P 32 ceiling (bench/protocols.sh)
#
# then under-admission: four quotads on one Redis, a hot key at 5,000 per 1 s window,
# offered several times that by four wrk (one per quotad, 10 s) of which two stop after
# 5 s: the units slices took that lapsed with their window, neither admitted nor given
# back, over the admissions.
#
#   bench/hot.sh              # 3 rounds, 10 s per run
#   ROUNDS=1 bench/hot.sh     # quick
#   ALGORITHM=token_bucket bench/hot.sh   # or gcra: the same runs on a bucket (burst = limit)
# Needs: redis-server, redis-benchmark, redis-cli, wrk, curl.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-10s}
ALGORITHM=${ALGORITHM:-fixed_window}
CONNS=50
OUT=${OUT:-/tmp/quotad-hot-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
# shellcheck source=bench/lib.sh
. "$HERE/lib.sh"
need redis-server redis-benchmark redis-cli wrk curl
(cd "$ROOT" && cargo build --release --locked -q)
Q="$ROOT/target/release/quotad"

start_redis "$OUT"
REDIS_PID=$(cat "$OUT/redis.pid")
NKEYS=100000
load_token_bucket "$OUT"

PIDS=()
stop_all() { for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; bench_cleanup; }
trap stop_all EXIT

# quotad NAME PORT REDIS_PORT LIMIT WINDOW [hot_key_rate]: started, ready, PID in QPIDS[NAME].
declare -A QPIDS QPORTS
quotad() {
  local name=$1 port=$2 rp=$3 limit=$4 window=$5 rate=${6:-}
  local dir="$OUT/$name"; mkdir -p "$dir"
  cat >"$dir/quotad.toml" <<TOML
[server]
listen = "127.0.0.1:$port"
[store]
redis = "redis://127.0.0.1:$rp"
[[policy]]
name = "bench"
algorithm = "$ALGORITHM"
limit = $limit
window = "$window"
on_store_error = "open"
${rate:+hot_key_rate = $rate}
TOML
  RUST_LOG=warn "$Q" serve --config "$dir/quotad.toml" 2>"$dir/quotad.log" &
  QPIDS[$name]=$!; QPORTS[$name]=$port; PIDS+=($!)
  for _ in $(seq 100); do curl -sf "127.0.0.1:$port/healthz" >/dev/null && break; sleep 0.1; done
}
DEAD=$(free_port) # nothing listens here: the breaker-open quotad's Redis
quotad hot "$(free_port)" "$RP" 1000000000 1h 1000
quotad cold "$(free_port)" "$RP" 1000000000 1h
quotad open "$(free_port)" "$DEAD" 1000000000 1h

TSV="$OUT/results.tsv"
printf 'round\trun\trps\tp50_ms\tp99_ms\terrors\tquotad_us_per_op\tredis_us_per_op\n' >"$TSV"
metric() { curl -s "127.0.0.1:$1/metrics" | awk -v m="$2" 'index($0, m) == 1 {s += $NF} END {print s + 0}'; }

run() { # round label quotad-name [checks per request]
  redis-cli -p "$RP" flushall >/dev/null
  local name=$3 per=${4:-1} port=${QPORTS[$3]} pid=${QPIDS[$3]}
  local q0 r0 res
  q0=$(ticks "$pid"); r0=$(ticks "$REDIS_PID")
  res=$(env WRK_HOT=1 WRK_BATCH="$((per > 1 ? per : 0))" timeout 120 wrk -t1 -c"$CONNS" -d"$DURATION" -s "$HERE/check.lua" "http://127.0.0.1:$port/v1/check" | grep '^WRK_RESULT')
  local q1 r1; q1=$(ticks "$pid"); r1=$(ticks "$REDIS_PID")
  kv() { echo "$res" | tr ' ' '\n' | awk -F= -v k="$1" '$1==k{print $2}'; }
  local n; n=$(awk -v r="$(kv rps)" -v p="$per" -v d="${DURATION%s}" 'BEGIN{printf "%d", r * p * d}')
  local decisions; decisions=$(awk -v r="$(kv rps)" -v p="$per" 'BEGIN{printf "%.2f", r * p}')
  local qus rus
  qus=$(awk -v t=$((q1 - q0)) -v c="$CLK" -v n="$n" 'BEGIN{printf "%.2f", t / c * 1e6 / n}')
  rus=$(awk -v t=$((r1 - r0)) -v c="$CLK" -v n="$n" 'BEGIN{printf "%.2f", t / c * 1e6 / n}')
  local errs=$(( $(kv non2xx) + $(kv socket_errors) ))
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$decisions" \
    "$(awk -v u="$(kv p50_us)" 'BEGIN{printf "%.3f", u/1000}')" \
    "$(awk -v u="$(kv p99_us)" 'BEGIN{printf "%.3f", u/1000}')" "$errs" "$qus" "$rus" >>"$TSV"
  printf '  r%s %-14s %12.0f decisions/s  errors %s  quotad %s us/op  redis %s us/op\n' "$1" "$2" "$decisions" "$errs" "$qus" "$rus"
}

{
  echo "# quotad hot-key bench $(date -u +%FT%TZ)"
  machine
  redis-server --version | head -1
  echo "quotad $("$Q" --version) (release), $ALGORITHM, rounds=$ROUNDS duration=$DURATION conns=$CONNS"
} | tee "$OUT/meta.txt"

for r in $(seq "$ROUNDS"); do
  ceiling "$r" evalsha-P32 1000000 -P 32
  run "$r" hot-check hot
  run "$r" breaker-open open
  run "$r" cold-check cold
  run "$r" hot-batch32 hot 32
  ceiling "$r" evalsha-P32 1000000 -P 32
done
python3 "$HERE/summarize.py" "$TSV" | tee "$OUT/summary.md"
python3 - "$TSV" <<'PY' | tee -a "$OUT/summary.md"
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
def per_round(a, b):
    out = []
    for rd in sorted({r["round"] for r in rows}, key=int):
        x = [float(r["rps"]) for r in rows if r["round"] == rd and r["run"] == a]
        y = [float(r["rps"]) for r in rows if r["round"] == rd and r["run"] == b]
        if x and y:
            out.append(statistics.mean(x) / statistics.mean(y))
    return out
for a, b in [("hot-check", "breaker-open"), ("hot-check", "cold-check"), ("hot-batch32", "evalsha-P32")]:
    v = per_round(a, b)
    print(f"{a} / {b}: median {statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}] over {len(v)} rounds")
PY

# Under-admission: four quotads, a hot key at 5,000 per second, demand that shifts. Units
# the slices took and neither admitted nor gave back lapsed with their window unspent:
# capacity some instance held while another may have been denied.
under() { # round
  redis_us() { redis-cli -p "$RP" time | awk 'NR==1{s=$1} NR==2{printf "%.0f", s * 1000000 + $1}'; }
  local ports=() w=() i p
  for i in 1 2 3 4; do
    p=$(free_port); ports+=("$p")
    quotad "under$1-$i" "$p" "$RP" 5000 1s 1000
  done
  redis-cli -p "$RP" flushall >/dev/null
  local t0 t1; t0=$(redis_us)
  for i in 0 1 2 3; do
    local d=10s; [ "$i" -ge 2 ] && d=5s
    WRK_HOT=1 timeout 60 wrk -t1 -c8 -d"$d" -s "$HERE/check.lua" "http://127.0.0.1:${ports[$i]}/v1/check" >/dev/null &
    w+=($!)
  done
  wait "${w[@]}"
  t1=$(redis_us)
  for p in "${ports[@]}"; do # every key cooled, its slice back
    for _ in $(seq 50); do [ "$(metric "$p" quotad_hot_key_entries)" = 0 ] && break; sleep 0.1; done
  done
  local sum; sum() { local t=0 p; for p in "${ports[@]}"; do t=$(( t + $(metric "$p" "$1") )); done; echo "$t"; }
  local allowed taken admitted returned
  allowed=$(sum 'quotad_decisions_total{outcome="allowed"')
  taken=$(sum 'quotad_hot_key_units_total{event="taken"}')
  admitted=$(sum 'quotad_hot_key_units_total{event="admitted"}')
  returned=$(sum 'quotad_hot_key_units_total{event="returned"}')
  for i in 1 2 3 4; do kill -TERM "${QPIDS[under$1-$i]}" 2>/dev/null || true; done
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$allowed" "$taken" "$admitted" "$returned" $(( t1 - t0 )) >>"$OUT/under.tsv"
  printf '  r%s allowed %s in %s us  slice units taken %s admitted %s returned %s lapsed %s\n' "$1" "$allowed" $(( t1 - t0 )) "$taken" "$admitted" "$returned" $(( taken - admitted - returned ))
}
echo "under-admission: 4 quotads, hot key at 5,000 per 1 s window, 4 x wrk -c8 (two stop at 5 s)"
for r in $(seq "$ROUNDS"); do under "$r"; done
python3 - "$OUT/under.tsv" "$ALGORITHM" <<'PY' | tee -a "$OUT/summary.md"
import sys, statistics
rows = [[int(x) for x in l.split("\t")] for l in open(sys.argv[1]).read().split("\n") if l]
lapsed = [(t - a - r) / allowed for _, allowed, t, a, r, _ in rows]
if sys.argv[2] != "fixed_window":
    # A bucket of burst 5,000 refilled at 5,000/s: at most 5,000 + 5,000 x the span.
    used = [allowed / (5000 + 5000 * span / 1e6) for _, allowed, _, _, _, span in rows]
    print(f"admissions over the bucket's envelope for the span: median {statistics.median(used):.4f} "
          f"[{min(used):.4f}-{max(used):.4f}]")
print(f"slice units lapsed unspent, over admissions: median {statistics.median(lapsed):.5f} "
      f"[{min(lapsed):.5f}-{max(lapsed):.5f}] over {len(rows)} rounds "
      f"(admissions per round: median {statistics.median(r[1] for r in rows):,})")
PY
