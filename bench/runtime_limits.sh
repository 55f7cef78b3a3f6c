#!/usr/bin/env bash
# Runtime limits at scale (docs/benchmarks.md, "Runtime limits"): three quotad instances on
# one redis-server; 100,000 keys given their own limit through one of them (PUT
# /v1/limits/plan/k<i>, 8 connections); then
#   - propagation: quotad_runtime_limit_propagation_seconds of the two other instances
#     (every change, from its write to its application there), p50/p99 by bucket;
#   - memory: each instance's RSS and Redis's used_memory before and after, per entry;
#   - the check path: wrk -t1 -c50 on POST /v1/check of keys k1..k100000 of "plan" (every
#     key has a runtime limit) against "bench" (the same numbers, no runtime limits), on
#     one instance, alternating, ROUNDS rounds of DURATION each, with quotad's CPU per
#     decision.
#
#   bench/runtime_limits.sh              # 3 rounds of 10 s
#   ROUNDS=1 DURATION=5s bench/runtime_limits.sh
# Needs: redis-server, redis-cli, wrk, curl, python3. Everything on 127.0.0.1, bounded.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-10s}
N=${N:-100000}
OUT=${OUT:-/tmp/quotad-runtime-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
# shellcheck source=bench/lib.sh
. "$HERE/lib.sh"
need redis-server redis-cli wrk curl python3
(cd "$ROOT" && cargo build --release --locked -q)
Q="$ROOT/target/release/quotad"
TOKEN=bench-admin-token-0123456789

start_redis "$OUT"
PIDS=()
PORTS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  bench_cleanup
}
trap cleanup EXIT
for i in 1 2 3; do
  port=$(free_port)
  mkdir -p "$OUT/q$i"
  cat >"$OUT/q$i/quotad.toml" <<TOML
[server]
listen = "127.0.0.1:$port"
[store]
redis = "redis://127.0.0.1:$RP"
[[admin.token]]
name = "bench"
token = "$TOKEN"
$(bench_policy)

[[policy]]
name = "plan"
algorithm = "token_bucket"
limit = 100
window = "60s"
on_store_error = "open"
[policy.runtime_limits]
max_keys = 1000000
TOML
  RUST_LOG=warn "$Q" serve --config "$OUT/q$i/quotad.toml" 2>"$OUT/q$i/quotad.log" &
  PIDS+=($!)
  PORTS+=("$port")
done
for port in "${PORTS[@]}"; do
  for _ in $(seq 100); do curl -sf "127.0.0.1:$port/readyz" >/dev/null && break; sleep 0.1; done
done
rss() { awk '/VmRSS/ {print $2 * 1024}' "/proc/$1/status"; }
redis_mem() { redis-cli -p "$RP" info memory | awk -F: '/^used_memory:/ {print $2}' | tr -d '\r'; }
echo "machine: $(machine); $(redis-server --version | head -1)" | tee "$OUT/meta.txt"
before=()
for p in "${PIDS[@]}"; do before+=("$(rss "$p")"); done
redis_before=$(redis_mem)

# 100,000 PUTs through the first instance, 8 keep-alive connections.
python3 - "${PORTS[0]}" "$N" "$TOKEN" <<'PY' | tee -a "$OUT/meta.txt"
import http.client, json, sys, threading, time
port, n, token = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
errors = []
def put(lo, hi):
    c = http.client.HTTPConnection("127.0.0.1", port)
    h = {"authorization": "Bearer " + token, "content-type": "application/json"}
    for i in range(lo, hi):
        c.request("PUT", f"/v1/limits/plan/k{i}", json.dumps({"limit": 200 + i % 100}), h)
        r = c.getresponse(); r.read()
        if r.status != 200: errors.append(r.status)
t0 = time.time()
step = n // 8
ts = [threading.Thread(target=put, args=(1 + k * step, 1 + (k + 1) * step if k < 7 else n + 1)) for k in range(8)]
[t.start() for t in ts]; [t.join() for t in ts]
print(f"set {n} runtime limits in {time.time() - t0:.1f} s ({n / (time.time() - t0):.0f}/s), {len(errors)} errors")
PY
# Every instance has them all (its gauge), then the figures.
for port in "${PORTS[@]}"; do
  for _ in $(seq 100); do
    got=$(curl -s "127.0.0.1:$port/metrics" | awk '/^quotad_runtime_limits\{policy="plan"\}/ {print $2}')
    [ "${got:-0}" = "$N" ] && break; sleep 0.1
  done
  echo "instance :$port holds ${got:-0} runtime limits"
done
i=0
for p in "${PIDS[@]}"; do
  after=$(rss "$p")
  awk -v b="${before[$i]}" -v a="$after" -v n="$N" -v i=$((i + 1)) \
    'BEGIN {printf "instance %d: RSS %.1f -> %.1f MiB, %.0f bytes per runtime limit\n", i, b/1048576, a/1048576, (a-b)/n}' | tee -a "$OUT/meta.txt"
  i=$((i + 1))
done
awk -v b="$redis_before" -v a="$(redis_mem)" -v n="$N" \
  'BEGIN {printf "redis: used_memory %.1f -> %.1f MiB, %.0f bytes per runtime limit\n", b/1048576, a/1048576, (a-b)/n}' | tee -a "$OUT/meta.txt"
for port in "${PORTS[@]:1}"; do
  curl -s "127.0.0.1:$port/metrics" | python3 -c '
import sys
b = {}
for l in sys.stdin:
    if l.startswith("quotad_runtime_limit_propagation_seconds_bucket"):
        le = l.split("le=\"")[1].split("\"")[0]
        b[le] = float(l.split()[-1])
total = b.get("+Inf", 0)
def q(p):
    for le, c in sorted(((float(k), v) for k, v in b.items())):
        if c >= p * total: return le
print(f"propagation on :'"$port"': {total:.0f} changes applied from the channel; p50 <= {q(0.5)*1000:g} ms, p99 <= {q(0.99)*1000:g} ms, all <= {q(1.0)*1000:g} ms")
' | tee -a "$OUT/meta.txt"
done

# Steady changes, as a billing system makes them: 1,000 at about 200 a second on top of
# the 100,000; the propagation of these alone (the buckets' difference).
python3 - "${PORTS[@]}" "$TOKEN" <<'PY' | tee -a "$OUT/meta.txt"
import http.client, json, sys, time, urllib.request
ports, token = sys.argv[1:4], sys.argv[4]
def buckets(port):
    b = {}
    for l in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode().splitlines():
        if l.startswith("quotad_runtime_limit_propagation_seconds_bucket"):
            b[float(l.split('le="')[1].split('"')[0])] = float(l.split()[-1])
    return b
before = {p: buckets(p) for p in ports[1:]}
c = http.client.HTTPConnection("127.0.0.1", int(ports[0]))
h = {"authorization": "Bearer " + token, "content-type": "application/json"}
for i in range(1000):
    c.request("PUT", f"/v1/limits/plan/k{i + 1}", json.dumps({"limit": 500 + i}), h)
    r = c.getresponse(); r.read()
    time.sleep(0.005)
time.sleep(1.5)
for p in ports[1:]:
    after = buckets(p)
    d = sorted((le, after[le] - before[p].get(le, 0)) for le in after)
    total = d[-1][1]
    q = lambda f: next(le for le, c in d if c >= f * total)
    print(f"steady changes on :{p}: {total:.0f} applied from the channel; p50 <= {q(0.5)*1000:g} ms, p99 <= {q(0.99)*1000:g} ms, all <= {q(1.0)*1000:g} ms")
PY

# The check path: "plan" (every key with its own limit) against "bench", alternating.
QP=${PORTS[1]}
QPID_CHECK=${PIDS[1]}
printf 'round\tpolicy\trps\tp50_ms\tp99_ms\tquotad_us_per_decision\tnon2xx\n' >"$OUT/checks.tsv"
for round in $(seq "$ROUNDS"); do
  order="plan bench"
  [ $((round % 2)) -eq 0 ] && order="bench plan"
  for policy in $order; do
    redis-cli -p "$RP" --scan --pattern 'rl:*:tb:*' | xargs -r -n 1000 redis-cli -p "$RP" del >/dev/null
    t0=$(ticks "$QPID_CHECK")
    line=$(WRK_POLICY=$policy WRK_KEYS=$N wrk -t1 -c50 -d"$DURATION" --latency -s "$HERE/check.lua" "http://127.0.0.1:$QP/v1/check" | grep '^WRK_RESULT')
    t1=$(ticks "$QPID_CHECK")
    echo "$line" | python3 -c '
import sys
f = dict(kv.split("=") for kv in sys.stdin.read().split()[1:])
rps = float(f["rps"])
n = rps * float("'"${DURATION%s}"'")
us = ('"$t1"' - '"$t0"') / '"$CLK"' * 1e6 / max(n, 1)
p50, p99, bad = int(f["p50_us"]) / 1000, int(f["p99_us"]) / 1000, f["non2xx"]
print(f"'"$round"'\t'"$policy"'\t{rps:.0f}\t{p50:.2f}\t{p99:.2f}\t{us:.1f}\t{bad}")
' | tee -a "$OUT/checks.tsv"
  done
done
python3 - "$OUT/checks.tsv" <<'PY' | tee -a "$OUT/meta.txt"
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
for p in ("plan", "bench"):
    r = [float(x["rps"]) for x in rows if x["policy"] == p]
    u = [float(x["quotad_us_per_decision"]) for x in rows if x["policy"] == p]
    print(f"{p}: median {statistics.median(r):.0f}/s [{min(r):.0f}-{max(r):.0f}], quotad {statistics.median(u):.1f} us/decision")
plan = statistics.median(float(x["rps"]) for x in rows if x["policy"] == "plan")
bench = statistics.median(float(x["rps"]) for x in rows if x["policy"] == "bench")
print(f"plan / bench: {plan / bench:.3f}")
PY
echo "results in $OUT"
