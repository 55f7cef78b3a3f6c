#!/usr/bin/env bash
# Overload: does quotad keep enforcing when offered more than it can answer?
#
#   bench/overload.sh                       # 50 ... 4000 connections, 10 s each
#   CONNS="500 1000" DURATION=20s bench/overload.sh
#
# Starts a redis-server and a release quotad on free loopback ports, with two policies on
# distinct keys (token bucket 100 per 60 s over 100,000 keys): `open` fails open and `closed`
# fails closed when the store does not answer. For each connection count, the closed-loop
# load generator (examples/overload.rs) keeps every connection busy for DURATION and prints
# one row: answered decisions per second, the share of them not enforced by the store
# (fail_open + fail_closed), requests shed (503 overloaded), latency of answered requests,
# circuit-breaker openings, and /readyz answers other than 200 (polled every 50 ms).
# Redis stays healthy throughout: every unenforced decision is quotad's own doing.
# Needs redis-server (apt-get install -y redis-server). Extra quotad [store] lines: STORE_EXTRA.
# QUOTAD_BIN runs another quotad binary (an older build, for a before/after table); the
# config then uses only keys every version knows.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
CONNS=${CONNS:-"50 200 500 1000 2000 4000"}
DURATION=${DURATION:-10s}
OUT=${OUT:-/tmp/quotad-overload-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
command -v redis-server >/dev/null || { echo "missing redis-server: apt-get install -y redis-server" >&2; exit 1; }
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

# shellcheck source=bench/lib.sh
. "$HERE/lib.sh"
QP=$(free_port)

(cd "$ROOT" && cargo build --release --locked -q && cargo build --release --locked -q --example overload)
Q="${QUOTAD_BIN:-$ROOT/target/release/quotad}"
LOAD="$ROOT/target/release/examples/overload"

start_redis "$OUT"

cat >"$OUT/quotad.toml" <<TOML
[server]
listen = "127.0.0.1:$QP"
[store]
redis = "redis://127.0.0.1:$RP"
${STORE_EXTRA:-}
[[policy]]
name = "open"
algorithm = "token_bucket"
limit = 100
window = "60s"
on_store_error = "open"
[[policy]]
name = "closed"
algorithm = "token_bucket"
limit = 100
window = "60s"
on_store_error = "closed"
TOML
RUST_LOG=warn "$Q" serve --config "$OUT/quotad.toml" 2>"$OUT/quotad.log" &
QPID=$!
for _ in $(seq 100); do curl -sf "127.0.0.1:$QP/readyz" >/dev/null && break; sleep 0.1; done

{
  echo "# quotad overload $(date -u +%FT%TZ)"
  machine
  echo "$(redis-server --version | head -1)"
  echo "quotad $("$Q" --version) (release) @ $(cd "$ROOT" && git rev-parse --short HEAD 2>/dev/null || echo '?'); duration=$DURATION"
} | tee "$OUT/meta.txt"
echo "connections,answered/s,answered,not_enforced_pct,shed_503,quotad_shed_total,other_non200,socket_errors,p50_ms,p99_ms,p999_ms,breaker_opened,circuit_open_calls,readyz_non200,readyz_flaps" | tee "$OUT/results.csv"
for c in $CONNS; do
  redis-cli -p "$RP" flushall >/dev/null
  "$LOAD" --url "127.0.0.1:$QP" --connections "$c" --duration "$DURATION" --policies open,closed --csv | tee -a "$OUT/results.csv"
  sleep 2
done
echo "results: $OUT/results.csv"
