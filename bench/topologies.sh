#!/usr/bin/env bash
# quotad against three Redis topologies beside the EVALSHA ceiling, in one alternating run
# (docs/benchmarks.md: the ratio measured in the same run is the figure).
#
#   bench/topologies.sh            # 3 rounds, 10 s per quotad run
#   ROUNDS=1 bench/topologies.sh   # quick
#
# Topologies, each with its own quotad (same policy as bench/run.sh: token_bucket 100 per
# 60 s, on_store_error open):
#   standalone  one redis-server, plain TCP (store.redis = "redis://...")
#   cluster     a Redis Cluster of 3 masters, no replicas (store.redis_cluster)
#   tls         one TLS-only redis-server (store.redis = "rediss://...", store.tls_ca_file),
#               its CA and server certificate (127.0.0.1, localhost) made with openssl in $OUT
# Per round: redis-benchmark -c 50 EVALSHA of quotad's own token-bucket script on the
# standalone server (keys drawn from 100,000); then wrk -t1 -c50 on POST /v1/check against
# each quotad in turn (same key space); then the ceiling again. Per quotad run: decisions/s,
# p50/p99, errors (non-2xx + socket errors), fail_open decisions (quotad's /metrics), CPU
# per decision of quotad and of all the topology's redis-server processes (/proc/PID/stat),
# and for the cluster each master's share of the EVALSHA calls (INFO commandstats).
# Needs: redis-server (built with TLS, as Debian's is), redis-benchmark, redis-cli, wrk,
# openssl, curl, python3. Everything listens on 127.0.0.1; every run is bounded.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-10s}
CONNS=${CONNS:-50}
NKEYS=${NKEYS:-100000}
CEILING_N=${CEILING_N:-400000}
OUT=${OUT:-/tmp/quotad-topologies-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
for t in redis-server redis-benchmark redis-cli wrk openssl curl python3 timeout; do
  command -v "$t" >/dev/null || { echo "missing $t: apt-get install -y redis-server wrk openssl curl" >&2; exit 1; }
done
START=$SECONDS

# shellcheck source=bench/lib.sh
. "$HERE/lib.sh"

# Everything started here: the quotads (PIDs) and the redis-servers (their pidfiles).
QPIDS=()
REDIS_PIDFILES=()
cleanup() {
  trap - EXIT INT TERM
  local p f
  # quotads first, so that none logs its Redis going away
  for p in "${QPIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${QPIDS[@]}"; do timeout 10 tail --pid="$p" -f /dev/null 2>/dev/null || true; done
  local -a rpids=()
  for f in "${REDIS_PIDFILES[@]}"; do
    if [ -s "$f" ]; then rpids+=("$(cat "$f")"); fi
  done
  for p in "${rpids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${rpids[@]}"; do timeout 10 tail --pid="$p" -f /dev/null 2>/dev/null || true; done
  bench_cleanup
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# redis-cli that cannot hang (every call is bounded).
rcli() { timeout 10 redis-cli "$@"; }
sum_ticks() { local s=0 p; for p in "$@"; do s=$((s + $(ticks "$p"))); done; echo "$s"; }

(cd "$ROOT" && cargo build --release --locked -q)
Q="$ROOT/target/release/quotad"

# --- standalone -------------------------------------------------------------------------
mkdir -p "$OUT/standalone"
start_redis "$OUT/standalone" # sets RP; stopped by bench_cleanup
REDIS_PIDFILES+=("$OUT/standalone/redis.pid")
SA_PID=$(cat "$OUT/standalone/redis.pid")
SA_CLI=(-p "$RP")

# --- cluster: 3 masters, no replicas ----------------------------------------------------
CL_PORTS=()
CL_PIDS=()
for i in 1 2 3; do
  d="$OUT/cluster-$i"
  mkdir -p "$d"
  rm -f "$d/nodes.conf" # a node that remembers an earlier cluster (same OUT) cannot join
  p=$(free_port)
  bus=$(free_port) # explicit bus port: port+10000 may be taken or out of range
  redis-server --port "$p" --cluster-port "$bus" --bind 127.0.0.1 --save '' --appendonly no \
    --cluster-enabled yes --cluster-config-file nodes.conf --daemonize yes \
    --dir "$d" --pidfile "$d/redis.pid" --logfile "$d/redis.log" >/dev/null
  REDIS_PIDFILES+=("$d/redis.pid")
  CL_PORTS+=("$p")
done
for p in "${CL_PORTS[@]}"; do
  for _ in $(seq 50); do rcli -p "$p" ping >/dev/null 2>&1 && break; sleep 0.1; done
done
for i in 1 2 3; do
  for _ in $(seq 50); do [ -s "$OUT/cluster-$i/redis.pid" ] && break; sleep 0.1; done
  CL_PIDS+=("$(cat "$OUT/cluster-$i/redis.pid")")
done
timeout 60 redis-cli --cluster create "${CL_PORTS[@]/#/127.0.0.1:}" --cluster-replicas 0 \
  --cluster-yes >"$OUT/cluster-create.log" 2>&1 \
  || { echo "cluster create failed: $OUT/cluster-create.log" >&2; exit 1; }
for p in "${CL_PORTS[@]}"; do
  ok=""
  for _ in $(seq 300); do
    if rcli -p "$p" cluster info 2>/dev/null | grep -q '^cluster_state:ok'; then ok=1; break; fi
    sleep 0.1
  done
  [ -n "$ok" ] || { echo "cluster node $p never reached cluster_state:ok" >&2; exit 1; }
done

# --- TLS-only server: CA + server certificate, the openssl commands of testkit/src/tls.rs -
T="$OUT/tls"
mkdir -p "$T"
(
  cd "$T"
  openssl genrsa -out ca.key 2048
  openssl req -x509 -new -key ca.key -days 2 -subj "/CN=quotad bench ca" -out ca.crt
  echo "subjectAltName=IP:127.0.0.1,DNS:localhost" >san.cnf
  openssl genrsa -out server.key 2048
  openssl req -new -key server.key -subj /CN=localhost -out server.csr
  openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 \
    -extfile san.cnf -out server.crt
) >"$T/openssl.log" 2>&1 || { echo "openssl failed: $T/openssl.log" >&2; exit 1; }
TP=$(free_port)
redis-server --port 0 --tls-port "$TP" --bind 127.0.0.1 --save '' --appendonly no \
  --tls-cert-file "$T/server.crt" --tls-key-file "$T/server.key" --tls-ca-cert-file "$T/ca.crt" \
  --tls-auth-clients no --daemonize yes --dir "$T" --pidfile "$T/redis.pid" \
  --logfile "$T/redis.log" >/dev/null
REDIS_PIDFILES+=("$T/redis.pid")
TLS_CLI=(--tls --cacert "$T/ca.crt" -h 127.0.0.1 -p "$TP")
for _ in $(seq 50); do [ "$(rcli "${TLS_CLI[@]}" ping 2>/dev/null)" = PONG ] && break; sleep 0.1; done
[ "$(rcli "${TLS_CLI[@]}" ping 2>/dev/null)" = PONG ] \
  || { echo "TLS redis-server does not answer over TLS: $T/redis.log" >&2; exit 1; }
TLS_PID=$(cat "$T/redis.pid")

# --- one quotad per topology ------------------------------------------------------------
declare -A QPORT QPID_OF
start_quotad() { # name store-lines
  local name=$1 store=$2 qp
  qp=$(free_port)
  cat >"$OUT/quotad-$name.toml" <<TOML
[server]
listen = "127.0.0.1:$qp"
[store]
$store
$(bench_policy)
TOML
  RUST_LOG=warn "$Q" serve --config "$OUT/quotad-$name.toml" 2>"$OUT/quotad-$name.log" &
  QPIDS+=("$!")
  QPID_OF[$name]=$!
  QPORT[$name]=$qp
}
start_quotad standalone "redis = \"redis://127.0.0.1:$RP\""
start_quotad cluster "redis_cluster = [$(printf '"redis://127.0.0.1:%s", ' "${CL_PORTS[@]}" | sed 's/, $//')]"
start_quotad tls "redis = \"rediss://127.0.0.1:$TP\"
tls_ca_file = \"$T/ca.crt\""
for name in standalone cluster tls; do
  ok=""
  for _ in $(seq 100); do
    if curl -sf "127.0.0.1:${QPORT[$name]}/readyz" >/dev/null; then ok=1; break; fi
    sleep 0.1
  done
  [ -n "$ok" ] || { echo "quotad ($name) not ready: $OUT/quotad-$name.log" >&2; cat "$OUT/quotad-$name.log" >&2; exit 1; }
done

"$Q" script token_bucket >"$OUT/token_bucket.lua"
SHA=$(rcli "${SA_CLI[@]}" -x script load <"$OUT/token_bucket.lua" | tr -d '\r')
# The same arguments quotad sends: key, mode, limit, window_us, burst, cost, member.
EVAL_ARGS=(evalsha "$SHA" 1 "rl:bench:tb:{k__rand_int__}" check 100 60000000 100 1 - 100:60000000:100 "b1n$(date +%s%3N)")

# Empties every server of a topology (keys only: scripts and commandstats stay).
flush() {
  case $1 in
    standalone) rcli "${SA_CLI[@]}" flushall >/dev/null ;;
    cluster) for p in "${CL_PORTS[@]}"; do rcli -p "$p" flushall >/dev/null; done ;;
    tls) rcli "${TLS_CLI[@]}" flushall >/dev/null ;;
  esac
}
redis_pids() {
  case $1 in
    standalone) echo "$SA_PID" ;;
    cluster) echo "${CL_PIDS[@]}" ;;
    tls) echo "$TLS_PID" ;;
  esac
}
evalsha_calls() { # port -> cmdstat_evalsha calls so far
  rcli -p "$1" info commandstats | tr -d '\r' \
    | awk -F'[:=,]' '$1=="cmdstat_evalsha"{print $3; f=1} END{if(!f) print 0}'
}
# quotad_store_errors_total of one quotad, as "kind=n ..." (one line per kind).
store_errors() {
  curl -sf "127.0.0.1:${QPORT[$1]}/metrics" \
    | awk 'index($0, "quotad_store_errors_total{") == 1 {match($0, /kind="[^"]*"/); print substr($0, RSTART + 6, RLENGTH - 7), $NF}'
}
# Sum of quotad_decisions_total series of one quotad, all outcomes or one ($2).
decisions() {
  curl -sf "127.0.0.1:${QPORT[$1]}/metrics" \
    | awk -v o="${2:-}" 'index($0, "quotad_decisions_total{") == 1 && (o == "" || index($0, "outcome=\"" o "\"")) {s += $NF} END {printf "%d", s}'
}

TSV="$OUT/results.tsv"
printf 'round\trun\trps\tp50_ms\tp99_ms\terrors\tfail_open\tdecisions\tquotad_us_per_op\tredis_us_per_op\tmaster_share_pct\tstore_errors\n' >"$TSV"

ceiling() { # round
  local round=$1 r0 r1 line rps p50 p99 rus
  flush standalone
  r0=$(ticks "$SA_PID")
  line=$(timeout 300 redis-benchmark -p "$RP" -c "$CONNS" -n "$CEILING_N" -r "$NKEYS" --csv "${EVAL_ARGS[@]}" 2>/dev/null | grep -i '^"evalsha' | tail -1)
  r1=$(ticks "$SA_PID")
  rps=$(echo "$line" | awk -F'","' '{print $2}')
  p50=$(echo "$line" | awk -F'","' '{print $5}')
  p99=$(echo "$line" | awk -F'","' '{print $7}')
  rus=$(awk -v t=$((r1 - r0)) -v c="$CLK" -v n="$CEILING_N" 'BEGIN{printf "%.1f", t / c * 1e6 / n}')
  printf '%s\t%s\t%s\t%s\t%s\t0\t-\t%s\t-\t%s\t-\t-\n' "$round" evalsha-c50 "$rps" "$p50" "$p99" "$CEILING_N" "$rus" >>"$TSV"
  printf '  r%s %-18s %10.0f /s  p50 %s ms  p99 %s ms  redis %s us/op\n' "$round" evalsha-c50 "$rps" "$p50" "$p99" "$rus"
}

target() { # round topology
  local round=$1 name=$2 qp=${QPORT[$2]} qpid=${QPID_OF[$2]}
  local -a rp e0=() e1=()
  read -ra rp <<<"$(redis_pids "$name")"
  flush "$name"
  local q0 q1 r0 r1 d0 d1 f0 f1 s0 s1 res p
  if [ "$name" = cluster ]; then for p in "${CL_PORTS[@]}"; do e0+=("$(evalsha_calls "$p")"); done; fi
  d0=$(decisions "$name"); f0=$(decisions "$name" fail_open); s0=$(store_errors "$name")
  q0=$(ticks "$qpid"); r0=$(sum_ticks "${rp[@]}")
  res=$(env WRK_KEYS="$NKEYS" timeout 120 wrk -t1 -c"$CONNS" -d"$DURATION" -s "$HERE/check.lua" "http://127.0.0.1:$qp/v1/check" | grep '^WRK_RESULT')
  q1=$(ticks "$qpid"); r1=$(sum_ticks "${rp[@]}")
  d1=$(decisions "$name"); f1=$(decisions "$name" fail_open); s1=$(store_errors "$name")
  # store errors over the run, by kind ("-" when none)
  local serr
  serr=$(printf '%s\n' "$s0" "=" "$s1" | awk '$0 == "=" {after = 1; next} NF == 2 {if (after) d[$1] += $2; else d[$1] -= $2}
    END {for (k in d) if (d[k]) {printf "%s%s:%d", (n++ ? "," : ""), k, d[k]}; if (!n) printf "-"}')
  local share=-
  if [ "$name" = cluster ]; then
    for p in "${CL_PORTS[@]}"; do e1+=("$(evalsha_calls "$p")"); done
    share=$(awk -v a="${e0[*]}" -v b="${e1[*]}" 'BEGIN{
      n = split(a, x, " "); split(b, y, " "); t = 0
      for (i = 1; i <= n; i++) { d[i] = y[i] - x[i]; t += d[i] }
      for (i = 1; i <= n; i++) printf "%s%.1f", (i > 1 ? "/" : ""), (t ? 100 * d[i] / t : 0) }')
  fi
  kv() { echo "$res" | tr ' ' '\n' | awk -F= -v k="$1" '$1==k{print $2}'; }
  local rps n fo qus rus p50 p99 errs
  rps=$(kv rps)
  n=$((d1 - d0)); fo=$((f1 - f0))
  qus=$(awk -v t=$((q1 - q0)) -v c="$CLK" -v n="$n" 'BEGIN{printf "%.1f", n ? t / c * 1e6 / n : 0}')
  rus=$(awk -v t=$((r1 - r0)) -v c="$CLK" -v n="$n" 'BEGIN{printf "%.1f", n ? t / c * 1e6 / n : 0}')
  p50=$(awk -v u="$(kv p50_us)" 'BEGIN{printf "%.3f", u/1000}')
  p99=$(awk -v u="$(kv p99_us)" 'BEGIN{printf "%.3f", u/1000}')
  errs=$(($(kv non2xx) + $(kv socket_errors)))
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$round" "quotad-$name" "$rps" "$p50" "$p99" "$errs" "$fo" "$n" "$qus" "$rus" "$share" "$serr" >>"$TSV"
  printf '  r%s %-18s %10.0f /s  p50 %s ms  p99 %s ms  errors %s  fail_open %s  quotad %s us/op  redis %s us/op%s%s\n' \
    "$round" "quotad-$name" "$rps" "$p50" "$p99" "$errs" "$fo" "$qus" "$rus" \
    "$([ "$share" = - ] || echo "  masters $share %")" "$([ "$serr" = - ] || echo "  store errors $serr")"
}

{
  echo "# quotad topologies bench $(date -u +%FT%TZ)"
  machine
  redis-server --version | head -1
  wrk -v 2>&1 | head -1 || true # (wrk -v exits 1)
  openssl version
  echo "quotad $("$Q" --version) (release), sha $SHA, rounds=$ROUNDS duration=$DURATION conns=$CONNS keys=$NKEYS ceiling_n=$CEILING_N"
  echo "standalone 127.0.0.1:$RP; cluster 127.0.0.1:{${CL_PORTS[*]}} (3 masters, 0 replicas); tls 127.0.0.1:$TP (TLS only)"
} | tee "$OUT/meta.txt"

echo "warm-up"
for name in standalone cluster tls; do
  env WRK_KEYS="$NKEYS" timeout 30 wrk -t1 -c"$CONNS" -d2s -s "$HERE/check.lua" "http://127.0.0.1:${QPORT[$name]}/v1/check" >/dev/null
done
for r in $(seq "$ROUNDS"); do
  ceiling "$r"
  for name in standalone cluster tls; do target "$r" "$name"; done
  ceiling "$r"
done

echo "results: $TSV"
python3 "$HERE/summarize.py" "$TSV" | tee "$OUT/summary.md"
# What only this bench measures: how the cluster spread the calls, and store errors.
python3 - "$TSV" <<'PY' | tee -a "$OUT/summary.md"
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
cl = [r["master_share_pct"] for r in rows if r["run"] == "quotad-cluster"]
if cl:
    print(f"cluster, share of EVALSHA calls per master (%, per round): {', '.join(cl)}")
se = [f"r{r['round']} {r['run']} {r['store_errors']}" for r in rows if r["store_errors"] not in ("-", "")]
print("store errors during quotad runs (quotad_store_errors_total by kind): " + ("; ".join(se) if se else "none"))
PY
echo "runtime: $((SECONDS - START)) s; output: $OUT"
