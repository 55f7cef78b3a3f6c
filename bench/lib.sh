# Shared by the bench scripts (source it): free loopback ports, a throwaway redis-server,
# and stopping what the script started when it exits.

# Exits naming the package when a tool is missing: need redis-server wrk ...
need() {
  local t
  for t in "$@"; do
    command -v "$t" >/dev/null || { echo "missing $t: apt-get install -y redis-server wrk curl openssl" >&2; exit 1; }
  done
}

# One line naming the machine, for a run's meta.txt.
machine() { echo "nproc=$(nproc) $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs) $(uname -sr)"; }

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# The quotad the script starts, if any: stopped (SIGTERM) on exit.
QPID=""

# Starts a redis-server without persistence on a free port ($RP), its files in $1, and
# waits for it to answer; stopped on exit.
start_redis() {
  RP=$(free_port)
  redis-server --port "$RP" --bind 127.0.0.1 --save '' --appendonly no --daemonize yes \
    --dir "$1" --pidfile "$1/redis.pid" >/dev/null
  for _ in $(seq 50); do redis-cli -p "$RP" ping >/dev/null 2>&1 && break; sleep 0.1; done
}

# The benchmarks' policy "bench" (token_bucket, 100 per 60 s, fail open), as TOML.
bench_policy() {
  cat <<'TOML'
[[policy]]
name = "bench"
algorithm = "token_bucket"
limit = 100
window = "60s"
on_store_error = "open"
TOML
}

# Starts quotad ($Q) on 127.0.0.1:$QP against the redis-server of start_redis, with the
# benchmarks' policy "bench" (token_bucket, 100 per 60 s, fail open), the gRPC listener at
# $GRPC_LISTEN when set, and any further config lines on stdin; its files in $1. Sets QPID and waits until it is ready.
start_quotad() {
  local grpc=""
  [ -n "${GRPC_LISTEN:-}" ] && grpc="grpc_listen = \"$GRPC_LISTEN\""
  { cat <<TOML
[server]
listen = "127.0.0.1:$QP"
$grpc
[store]
redis = "redis://127.0.0.1:$RP"
$(bench_policy)
TOML
    cat; } >"$1/quotad.toml"
  RUST_LOG=warn "$Q" serve --config "$1/quotad.toml" 2>"$1/quotad.log" &
  QPID=$!
  for _ in $(seq 100); do curl -sf "127.0.0.1:$QP/readyz" >/dev/null && break; sleep 0.1; done
}

# Loads quotad's token-bucket script into the redis-server at $RP (files in $1) and sets
# SHA and EVAL_ARGS: the EVALSHA quotad sends for policy "bench" on keys
# rl:bench:tb:{k<random>} (redis-benchmark fills __rand_int__), with the frame and since
# of its numbers at policy.version 1 from now (`scripts::frame_args`: the version and the
# instant in ms, each after a letter counting its digits).
load_token_bucket() {
  "$Q" script token_bucket >"$1/token_bucket.lua"
  SHA=$(redis-cli -p "$RP" -x script load <"$1/token_bucket.lua" | tr -d '\r')
  EVAL_ARGS=(evalsha "$SHA" 1 "rl:bench:tb:{k__rand_int__}" check 100 60000000 100 1 - 100:60000000:100 "b1n$(date +%s%3N)")
}

# CPU time of process $1 so far, in clock ticks (user + system, /proc/PID/stat), and the
# ticks per second: CPU per decision is the difference over a run divided by decisions.
ticks() { sed 's/^.*) //' "/proc/$1/stat" | awk '{print $12+$13}'; }
CLK=$(getconf CLK_TCK)

bench_cleanup() {
  [ -n "$QPID" ] && kill -TERM "$QPID" 2>/dev/null || true
  [ -n "${RP:-}" ] && redis-cli -p "$RP" shutdown nosave >/dev/null 2>&1 || true
}
trap bench_cleanup EXIT

# A redis-benchmark EVALSHA ceiling row (round, label, rate, p50 and p99 ms, 0 errors, -
# quotad, Redis CPU per op) appended to $TSV: `ceiling ROUND [LABEL N OPTIONS...]`
# (default: evalsha-c50, 400,000 requests), $CONNS connections on $NKEYS keys, against the
# redis-server of start_redis (pid $REDIS_PID) with load_token_bucket's script.
ceiling() {
  redis-cli -p "$RP" flushall >/dev/null
  local round=$1 label=${2:-evalsha-c50} n=${3:-400000}
  shift; shift || true; shift || true
  local r0 r1 line
  r0=$(ticks "$REDIS_PID")
  line=$(timeout 120 redis-benchmark -p "$RP" -c "$CONNS" -n "$n" -r "$NKEYS" "$@" --csv "${EVAL_ARGS[@]}" 2>/dev/null | grep -i '^"evalsha' | tail -1)
  r1=$(ticks "$REDIS_PID")
  local rps p50 p99 rus
  rps=$(echo "$line" | awk -F'","' '{print $2}')
  p50=$(echo "$line" | awk -F'","' '{print $5}')
  p99=$(echo "$line" | awk -F'","' '{print $7}')
  rus=$(awk -v t=$((r1 - r0)) -v c="$CLK" -v n="$n" 'BEGIN{printf "%.1f", t / c * 1e6 / n}')
  printf '%s\t%s\t%s\t%s\t%s\t0\t-\t%s\n' "$round" "$label" "$rps" "$p50" "$p99" "$rus" >>"$TSV"
  printf '  r%s %-16s %10.0f /s  p50 %s ms  p99 %s ms  redis %s us/op\n' "$round" "$label" "$rps" "$p50" "$p99" "$rus"
}
