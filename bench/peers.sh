#!/usr/bin/env bash
# quotad beside the peer HTTP limiters (the peer services in PEER_DIR: Node rate-limiter-flexible,
# Python limits) and the Redis EVALSHA ceiling, in ONE alternating run of the peers'
# own harness (PEER_DIR/bench.sh), so every target is measured against the same
# ceiling runs. Results: bench/PEERS.md; method: docs/benchmarks.md.
#
#   bench/peers.sh                                  # 3 rounds x 10 s, quotad + all six peers
#   PEERS="rlf-1 limits-moving-2" bench/peers.sh    # fewer peers
#
# Steps: cargo build --release --locked; PEER_DIR/setup.sh (Node and Python peers
# under /tmp/peerhttp); one redis-server (port 6392 if free, else a free port); quotad on a
# free port with one policy "bench" = fixed_window, 100 per 60 s, on that Redis (the peers
# run fixed/moving windows; token_bucket would be a different algorithm); the peers as
# PEER_DIR/run-local.sh starts them; then
#   bench.sh REDISPORT quotad=URL rlf-1=URL ...
# bench.sh FLUSHALLs that Redis before every run (quotad reloads its scripts on NOSCRIPT).
# Everything listens on 127.0.0.1; every load is bounded in time (wrk -d, redis-benchmark
# -n). On exit (success, failure or signal) every process started here is stopped by PID
# and the Redis started here is shut down (nosave).
#
# Environment (defaults): PEERS ("rlf-1 rlf-2 limits-moving-1 limits-moving-2
#   limits-fixed-1 limits-fixed-2"; any of these names, or limitador-async and
#   limitador-cached once `WITH_LIMITADOR=1 PEER_DIR/setup.sh` built limitador), MAX_MINUTES (12: if the estimated
#   run is longer, PEERS is cut to "rlf-1 limits-moving-2"; the rounds are never reduced),
#   OUT (/tmp/quotad-peers-<timestamp>), PEER_DIR (the peer services, not part of this
#   repository; the default is set below), PEER_PREFIX
#   (/tmp/peerhttp), QUOTAD_LOG (RUST_LOG for quotad, "info"), and bench.sh's own:
#   ROUNDS (3), DURATION (10s), CONNS, THREADS, WARMUP, CEIL_*, NKEYS.
# Output in OUT: everything bench.sh writes (results.tsv, summary.md, raw/, meta.txt),
#   plus bench.log (its stdout), quotad.log (quotad's stderr), quotad.toml, quotad (the
#   binary that ran), build.txt, setup.log, commands.txt, processes.txt, <peer>.log,
#   quotad-commandstats.txt (Redis commands per quotad check, measured before the bench),
#   quotad-deny.txt (101 checks on one key), metrics-before/after.txt (quotad /metrics).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
PEER_DIR=${PEER_DIR:-$(cd "$ROOT/../shared/peers" && pwd)}
PREFIX=${PEER_PREFIX:-/tmp/peerhttp}
export PEER_PREFIX=$PREFIX
ALL_PEERS="rlf-1 rlf-2 limits-moving-1 limits-moving-2 limits-fixed-1 limits-fixed-2 limitador-async limitador-cached"
PEERS=${PEERS:-rlf-1 rlf-2 limits-moving-1 limits-moving-2 limits-fixed-1 limits-fixed-2}
MAX_MINUTES=${MAX_MINUTES:-12}
export ROUNDS=${ROUNDS:-3}
export DURATION=${DURATION:-10s}
export OUT=${OUT:-/tmp/quotad-peers-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"

for t in cargo redis-server redis-cli redis-benchmark wrk curl ss python3 node npm python3.11; do
  command -v "$t" >/dev/null || { echo "missing: $t" >&2; exit 1; }
done
for p in $PEERS; do
  case " $ALL_PEERS " in *" $p "*) ;; *) echo "unknown peer '$p' (one of: $ALL_PEERS)" >&2; exit 2 ;; esac
done

# --- time budget: cut the peer list (never the rounds) if the run would be too long ---
estimate_s() { # number of targets -> rough seconds for bench.sh
  # per round: 2 ceiling phases (c50 + P32: ~13 s at ~80k/~130k per s on a 2-core VM,
  # ~22 s when that VM ran at half speed; 45 s allowed), each target DURATION + ~0.5 s;
  # warm-up WARMUP per target.
  local n=$1 d=${DURATION%s} w=${WARMUP:-2s}
  w=${w%s}
  awk -v n="$n" -v d="$d" -v w="$w" -v r="$ROUNDS" 'BEGIN{printf "%d", r * (45 + n * (d + 0.5)) + n * (w + 0.5) + 5}'
}
n_targets=$(( $(echo "$PEERS" | wc -w) + 1 ))
est=$(estimate_s "$n_targets")
if [ "$est" -gt $((MAX_MINUTES * 60)) ]; then
  echo "estimated ${est}s for $n_targets targets exceeds ${MAX_MINUTES} min; peers cut to: rlf-1 limits-moving-2" >&2
  PEERS="rlf-1 limits-moving-2"
  n_targets=3
  est=$(estimate_s "$n_targets")
fi
echo "targets: quotad $PEERS; rounds=$ROUNDS duration=$DURATION; bench.sh estimate ~${est}s; output $OUT"

# --- cleanup ----------------------------------------------------------------------------
PIDS=()          # services started here (quotad, peers)
RP=
REDIS_PID=
descendants() { # the given pid's descendants (not itself)
  ps -e -o pid=,ppid= | awk -v root="$1" '
    { pp[$1] = $2 }
    END { keep[root] = 1; ch = 1
          while (ch) { ch = 0; for (p in pp) if (!(p in keep) && (pp[p] in keep)) { keep[p] = 1; ch = 1 } }
          for (p in keep) if (p != root) print p }'
}
cleanup() {
  local rc=$? p i alive kids=()
  trap - EXIT INT TERM
  set +e
  for p in "${PIDS[@]}"; do
    kids+=($(descendants "$p"))
    kill -TERM "$p" 2>/dev/null || true
  done
  for i in $(seq 1 50); do
    alive=0
    for p in "${PIDS[@]}" "${kids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
  for p in "${PIDS[@]}" "${kids[@]}"; do
    if kill -0 "$p" 2>/dev/null; then
      echo "cleanup: pid $p still alive after 5 s, SIGKILL" >&2
      kill -KILL "$p" 2>/dev/null || true
    fi
  done
  if [ -n "$REDIS_PID" ]; then
    redis-cli -p "$RP" shutdown nosave >/dev/null 2>&1 || true
    for i in $(seq 1 30); do kill -0 "$REDIS_PID" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$REDIS_PID" 2>/dev/null && kill -KILL "$REDIS_PID" 2>/dev/null || true
  fi
  echo "stopped: services ${PIDS[*]:-none} (+ children ${kids[*]:-none}), redis ${REDIS_PID:-none}; output in $OUT" >&2
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
port_busy() { redis-cli -p "$1" ping >/dev/null 2>&1 || ss -Hltn "sport = :$1" | grep -q .; }

# --- 1. build quotad -------------------------------------------------------------------
(cd "$ROOT" && cargo build --release --locked) 2>&1 | tail -3
cp "$ROOT/target/release/quotad" "$OUT/quotad"   # the exact binary that runs (the tree may change)
Q=$OUT/quotad
{
  echo "quotad: $("$Q" --version), built from $ROOT at $(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo '?')"
  echo "worktree changes at build time (git status --short):"
  git -C "$ROOT" status --short 2>/dev/null || true
  echo "sha256: $(sha256sum "$Q" | cut -d' ' -f1)"
  echo "$(cargo --version); $(rustc --version)"
} | tee "$OUT/build.txt"

# --- 2. peer dependencies ---------------------------------------------------------------
"$PEER_DIR/setup.sh" >"$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log" >&2; exit 1; }
grep -E '^(node deps|python deps)|rate-limiter-flexible|ioredis' "$OUT/setup.log" || true

# --- 3. redis ---------------------------------------------------------------------------
RP=6392
if port_busy "$RP"; then RP=$(free_port); fi
redis-server --port "$RP" --bind 127.0.0.1 --save '' --appendonly no --daemonize yes \
  --dir "$OUT" --pidfile "$OUT/redis.pid" --logfile "$OUT/redis.log"
for _ in $(seq 1 50); do [ -s "$OUT/redis.pid" ] && redis-cli -p "$RP" ping >/dev/null 2>&1 && break; sleep 0.1; done
REDIS_PID=$(cat "$OUT/redis.pid")
echo "redis: pid $REDIS_PID port $RP ($(redis-server --version | head -1))" | tee -a "$OUT/commands.txt"

# --- 4. quotad --------------------------------------------------------------------------
QP=$(free_port)
cat >"$OUT/quotad.toml" <<TOML
# peers.sh: one policy, the same limit as the peers (100 per 60 s), fixed window like
# rate-limiter-flexible and limits' FixedWindowRateLimiter.
[server]
listen = "127.0.0.1:$QP"

[store]
redis = "redis://127.0.0.1:$RP"

[[policy]]
name = "bench"
algorithm = "fixed_window"
limit = 100
window = "60s"
TOML
"$Q" validate "$OUT/quotad.toml"
RUST_LOG=${QUOTAD_LOG:-info} "$Q" serve --config "$OUT/quotad.toml" >"$OUT/quotad.stdout" 2>"$OUT/quotad.log" </dev/null &
QPID=$!
PIDS+=("$QPID")
echo "quotad: pid $QPID port $QP: $Q serve --config $OUT/quotad.toml" | tee -a "$OUT/commands.txt"
check() { # port key -> response body
  curl -s -m 2 -X POST -H 'content-type: application/json' \
    -d "{\"policy\":\"bench\",\"key\":\"$2\",\"cost\":1}" "http://127.0.0.1:$1/v1/check"
}
up=
for _ in $(seq 1 100); do
  if curl -sf -m 1 "http://127.0.0.1:$QP/readyz" >/dev/null && check "$QP" up | grep -q allowed; then up=1; break; fi
  kill -0 "$QPID" 2>/dev/null || break
  sleep 0.1
done
[ -n "$up" ] || { echo "quotad did not come up:" >&2; cat "$OUT/quotad.log" >&2; exit 1; }
"$Q" script fixed_window >"$OUT/quotad-fixed_window.lua"

# Redis work per quotad check (as RESULTS.md lists for the peers): 200 checks on fresh keys.
redis-cli -p "$RP" flushall >/dev/null
redis-cli -p "$RP" config resetstat >/dev/null
for i in $(seq 1 200); do check "$QP" "cs$i" >/dev/null; done
{
  echo "200 quotad checks on 200 fresh keys; INFO commandstats afterwards:"
  redis-cli -p "$RP" info commandstats | tr -d '\r' | grep '^cmdstat'
} >"$OUT/quotad-commandstats.txt"
# Deny path: 101 checks on one key; the 101st must be denied.
{
  for i in $(seq 1 100); do check "$QP" denyprobe >/dev/null; done
  echo "101st check on one key: $(check "$QP" denyprobe)"
} >"$OUT/quotad-deny.txt"
cat "$OUT/quotad-commandstats.txt" "$OUT/quotad-deny.txt"

# --- 5. peers, as run-local.sh starts them ------------------------------------------------
TARGETS=("quotad=http://127.0.0.1:$QP")
wait_up() { # port
  local i
  for i in $(seq 1 150); do
    check "$1" up | grep -q allowed && return 0
    sleep 0.1
  done
  echo "service on port $1 did not come up" >&2
  return 1
}
start() { # name port command...
  local name=$1 port=$2
  shift 2
  "$@" >"$OUT/$name.log" 2>&1 </dev/null &
  PIDS+=("$!")
  echo "$name: pid $! port $port: $*" | tee -a "$OUT/commands.txt"
  wait_up "$port"
  TARGETS+=("$name=http://127.0.0.1:$port")
}
for name in $PEERS; do
  p=$(free_port)
  case "$name" in
    rlf-*) start "$name" "$p" env NODE_PATH="$PREFIX/node/node_modules" node "$PEER_DIR/rlf-server.js" "$p" "$RP" "${name##*-}" ;;
    limits-*) s=${name#limits-}; s=${s%-*}
              start "$name" "$p" "$PREFIX/venv/bin/python" "$PEER_DIR/limits-server.py" "$p" "$RP" "${name##*-}" --strategy "$s" ;;
    limitador-*) bin=$PREFIX/limitador-target/release/limitador-server
              if [ -x "$bin" ]; then start "$name" "$p" "$bin" "$p" "$RP" "${name#limitador-}"
              else echo "note: $bin not built (WITH_LIMITADOR=1 $PEER_DIR/setup.sh, ~11 min): skipping $name" >&2; fi ;;
  esac
done
for p in "${PIDS[@]}"; do ps -o pid=,ppid=,args= -p "$p" $(descendants "$p" | sed 's/^/-p /'); done >"$OUT/processes.txt" 2>/dev/null || true

# --- 6. the alternating run ------------------------------------------------------------------
curl -s -m 2 "http://127.0.0.1:$QP/metrics" >"$OUT/metrics-before.txt" || true
echo "bench.sh $RP ${TARGETS[*]}" | tee -a "$OUT/commands.txt"
set +e
"$PEER_DIR/bench.sh" "$RP" "${TARGETS[@]}" 2>&1 | tee "$OUT/bench.log"
rc=${PIPESTATUS[0]}
set -e
curl -s -m 2 "http://127.0.0.1:$QP/metrics" >"$OUT/metrics-after.txt" || true
echo "quotad decisions and store errors (from /metrics, whole process lifetime):"
grep -E '^quotad_(decisions_total|store_errors_total|store_up|script_loads_total)' "$OUT/metrics-after.txt" | grep -v ' 0$' || true
echo "quotad.log warnings/errors: $(grep -ciE 'warn|error' "$OUT/quotad.log" || true)"
exit "$rc"
