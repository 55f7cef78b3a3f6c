#!/usr/bin/env bash
# Memory per key for each algorithm: MEMORY USAGE on real keys written by quotad's own
# scripts, after 100 admissions at limit 100 and after 1,000 at limit 1,000.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
(cd "$ROOT" && cargo build --release --locked -q)
Q="$ROOT/target/release/quotad"
RP=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
DIR=$(mktemp -d)
redis-server --port "$RP" --bind 127.0.0.1 --save '' --appendonly no --daemonize yes --dir "$DIR" >/dev/null
trap 'redis-cli -p $RP shutdown nosave >/dev/null 2>&1 || true; rm -rf $DIR' EXIT
for _ in $(seq 50); do redis-cli -p "$RP" ping >/dev/null 2>&1 && break; sleep 0.1; done
echo "$(redis-server --version | head -1)"
printf '| algorithm | bytes after 100 hits (limit 100) | bytes after 1,000 hits (limit 1,000) |\n|---|---|---|\n'
# Since policy.version 1 came into force (scripts::frame_args: the version and the instant
# in ms, each after a letter counting its digits), as quotad sends it.
SINCE="b1n$(date +%s%3N)"
for alg in fixed_window sliding_log sliding_window token_bucket gcra; do
  SHA=$("$Q" script $alg | redis-cli -p "$RP" -x script load | tr -d '\r')
  row="| $alg |"
  for n in 100 1000; do
    key="rl:m:$alg:{user-$n}"
    # As quotad sends it, with the frame and since.
    for i in $(seq "$n"); do echo "EVALSHA $SHA 1 $key check $n 3600000000 $n 1 req$i $n:3600000000:$n $SINCE"; done | redis-cli -p "$RP" >/dev/null
    row="$row $(redis-cli -p "$RP" memory usage "$key" samples 0) |"
  done
  echo "$row"
done
