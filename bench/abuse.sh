#!/usr/bin/env bash
# Abuse: idle sockets, slowloris and half-sent peer bodies, each in turn, against a release
# quotad on a healthy redis-server, while a probe checks every 10 ms on a keep-alive
# connection (examples/abuse.rs prints what each did to quotad).
#
#   bench/abuse.sh                      # 30,000 idle, 1,000 slowloris, 1,500 half-sent peer bodies
#   IDLE=5000 SLOW=200 PEER=300 bench/abuse.sh
#
# Run as root (or with a hard open-files limit of 65536+): 30,000 client sockets need the
# file descriptors. quotad runs with its defaults (header_timeout 10 s, body_timeout 10 s,
# max_connections 10,000 under the raised limit); a global policy with one peer region
# enables the peer endpoint. Everything on 127.0.0.1; each attack is bounded in time.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
IDLE=${IDLE:-30000}
SLOW=${SLOW:-1000}
PEER=${PEER:-1500}
HOLD=${HOLD:-25s}
OUT=${OUT:-/tmp/quotad-abuse-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
command -v redis-server >/dev/null || { echo "missing redis-server: apt-get install -y redis-server" >&2; exit 1; }
ulimit -Hn 100000 2>/dev/null || true
ulimit -n "$(ulimit -Hn)"

# shellcheck source=bench/lib.sh
. "$HERE/lib.sh"
QP=$(free_port)

(cd "$ROOT" && cargo build --release --locked -q && cargo build --release --locked -q --example abuse)
Q="$ROOT/target/release/quotad"
ABUSE="$ROOT/target/release/examples/abuse"

start_redis "$OUT"

cat >"$OUT/quotad.toml" <<TOML
region = "eu"
[server]
listen = "127.0.0.1:$QP"
[store]
redis = "redis://127.0.0.1:$RP"
[[peer]]
region = "us"
url = "http://127.0.0.1:9"
secret = "abuse-bench-secret-0123456789abcdef"
[[policy]]
name = "api"
algorithm = "token_bucket"
limit = 1000000
window = "1s"
[[policy]]
name = "g"
algorithm = "token_bucket"
limit = 1000
window = "1s"
[policy.global]
escrow = { eu = 1, us = 1 }
TOML
RUST_LOG=warn "$Q" serve --config "$OUT/quotad.toml" 2>"$OUT/quotad.log" &
QPID=$!
for _ in $(seq 100); do curl -sf "127.0.0.1:$QP/readyz" >/dev/null && break; sleep 0.1; done

{
  echo "# quotad abuse $(date -u +%FT%TZ)"
  machine
  echo "quotad $("$Q" --version) (release) @ $(cd "$ROOT" && git rev-parse --short HEAD 2>/dev/null || echo '?'); open files $(ulimit -n)"
} | tee "$OUT/meta.txt"
PROBE='{"policy":"api","key":"probe","cost":1}'
for run in "idle $IDLE" "slowloris $SLOW" "peer-half $PEER"; do
  set -- $run
  echo "== $1 x $2"
  "$ABUSE" --url "127.0.0.1:$QP" --pid "$QPID" --mode "$1" --count "$2" --hold "$HOLD" --probe-body "$PROBE" | tee -a "$OUT/results.txt"
  curl -s "127.0.0.1:$QP/metrics" | grep -E '^quotad_(connections_closed_total|exchange_rejected_total\{reason="(busy|bad_signature)"|accept_errors_total|connections_open)' | grep -v ' 0$' | tee -a "$OUT/results.txt"
  sleep 3
done
echo "results: $OUT/results.txt"
