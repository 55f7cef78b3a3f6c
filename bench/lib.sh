# Shared by the bench scripts (source it): free loopback ports, a throwaway redis-server,
# and stopping what the script started when it exits.

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

# CPU time of process $1 so far, in clock ticks (user + system, /proc/PID/stat), and the
# ticks per second: CPU per decision is the difference over a run divided by decisions.
ticks() { sed 's/^.*) //' "/proc/$1/stat" | awk '{print $12+$13}'; }
CLK=$(getconf CLK_TCK)

bench_cleanup() {
  [ -n "$QPID" ] && kill -TERM "$QPID" 2>/dev/null || true
  [ -n "${RP:-}" ] && redis-cli -p "$RP" shutdown nosave >/dev/null 2>&1 || true
}
trap bench_cleanup EXIT
