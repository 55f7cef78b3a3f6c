//! The test kit: real `redis-server` processes and quotad daemons on free loopback ports,
//! stopped when their handles drop, a fault proxy for peer links, an open-loop load
//! generator, and a typed builder for config files. No mocks: every test talks to the real
//! thing. `quotad demo` runs on the same parts.
//!
//! Daemons come in two tiers. [`Quotad::serve`] runs `app::serve` inside the test process
//! (a port-0 listener, a runtime thread, a shutdown token): it starts in milliseconds and
//! is what API, header, config and bad-input tests use. [`Quotad::start`] spawns the built
//! binary: for what needs an OS process (signals, SIGKILL and restart, several processes
//! racing on one key, regions that fail independently).

pub mod cluster;
pub mod config;
pub mod edge;
pub mod federation;
pub mod grpc;
mod inproc;
pub mod load;
pub mod metered;
pub mod prometheus;
pub mod proxy;
pub mod race;
pub mod sentinel;
pub mod tls;

pub use config::{ADMIN_TOKEN, Config, Descriptor, Global, Peer, Policy};
/// The TOML crate the configs are built with, for tests that edit a written config.
pub use toml;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A two-worker runtime for the kit's background threads (in-process daemons, load), and
/// for tests that drive async clients.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// SIGKILL and reap.
fn kill(child: &mut Option<Child>) {
    if let Some(mut c) = child.take() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// A port that was free a moment ago (bind :0, read, close).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind 127.0.0.1:0")
}

/// Polls `f` every 10 ms until it returns Some, or panics after `timeout` naming `what`.
pub fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        if start.elapsed() > timeout {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `$REDIS_SERVER`, or `redis-server` from PATH.
pub(crate) fn redis_server_path() -> PathBuf {
    std::env::var_os("REDIS_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| "redis-server".into())
}

/// Whether a redis-server can be started here.
pub fn redis_available() -> bool {
    Command::new(redis_server_path())
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

fn redis_server_binary() -> PathBuf {
    let path = redis_server_path();
    if !redis_available() {
        panic!(
            "redis-server not found: the tests need a real Redis. Install it with \
             `apt-get install -y redis-server` (or run `bash .ci/run`, which does), \
             or set REDIS_SERVER=/path/to/redis-server"
        );
    }
    path
}

/// A redis-server process on a free port, with no persistence, killed on drop.
pub struct RedisServer {
    pub port: u16,
    child: Option<Child>,
    dir: tempfile::TempDir,
    /// AOF with fsync on every write: a restart comes back with the data (a new
    /// replication ID, as after a failover).
    persistent: bool,
    /// More redis-server arguments (cluster mode, for one).
    extra: Vec<String>,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        Self::start_with(false)
    }

    /// With an append-only file, fsynced on every write.
    pub fn start_persistent() -> RedisServer {
        Self::start_with(true)
    }

    fn start_with(persistent: bool) -> RedisServer {
        Self::start_with_args(persistent, &[])
    }

    /// With more redis-server arguments, e.g. `["--cluster-enabled", "yes"]`.
    pub fn start_with_args(persistent: bool, extra: &[&str]) -> RedisServer {
        let _ = redis_server_binary(); // a clear message when there is none
        Self::try_start_with(persistent, extra)
            .unwrap_or_else(|e| panic!("could not start redis-server: {e}"))
    }

    /// Starts one without persistence, or says why it could not.
    pub fn try_start() -> Result<RedisServer, String> {
        Self::try_start_with(false, &[])
    }

    fn try_start_with(persistent: bool, extra: &[&str]) -> Result<RedisServer, String> {
        let mut last = String::new();
        for _ in 0..5 {
            let mut s = RedisServer {
                port: free_port(),
                child: None,
                dir: tempfile::tempdir().map_err(|e| e.to_string())?,
                persistent,
                extra: extra.iter().map(|a| a.to_string()).collect(),
            };
            match s.spawn() {
                Ok(()) => return Ok(s),
                Err(e) => last = e, // port taken meanwhile: try another
            }
        }
        Err(last)
    }

    fn spawn(&mut self) -> Result<(), String> {
        let child = Command::new(redis_server_path())
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                // A replica's first sync starts at once: Redis waits 5 s by default for
                // more replicas to share a diskless transfer, which every cluster, Sentinel
                // and replica test would wait through.
                "--repl-diskless-sync-delay",
                "0",
            ])
            .args(if self.persistent {
                ["--appendonly", "yes", "--appendfsync", "always"]
            } else {
                ["--appendonly", "no", "--appendfsync", "everysec"]
            })
            .args(&self.extra)
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| e.to_string())?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    return Err(format!("redis-server exited: {status}"));
                }
            }
            if let Ok(mut conn) = self.try_conn() {
                if redis::cmd("PING").query::<String>(&mut conn).is_ok() {
                    return Ok(());
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Err("redis-server did not answer PING in 10 s".into())
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub(crate) fn try_conn(&self) -> redis::RedisResult<redis::Connection> {
        redis::Client::open(self.url())?.get_connection_with_timeout(Duration::from_secs(1))
    }

    pub fn conn(&self) -> redis::Connection {
        self.try_conn().expect("connect to test redis")
    }

    /// CPU the server has used (user + system, INFO cpu), or `None` if it does not answer.
    pub fn cpu_seconds(&self) -> Option<f64> {
        let info: String = redis::cmd("INFO")
            .arg("cpu")
            .query(&mut self.try_conn().ok()?)
            .ok()?;
        let field = |name: &str| -> Option<f64> {
            info.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))?
                .trim()
                .parse()
                .ok()
        };
        Some(field("used_cpu_sys")? + field("used_cpu_user")?)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        kill(&mut self.child);
    }

    /// Starts a fresh process on the same port (empty data, empty script cache).
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.spawn() {
                Ok(()) => return,
                Err(e) if Instant::now() > deadline => {
                    panic!("restart redis on {}: {e}", self.port)
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    pub fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args([sig, &self.pid().to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill {sig} failed");
    }

    pub fn dbsize(&self) -> i64 {
        redis::cmd("DBSIZE")
            .query(&mut self.conn())
            .expect("DBSIZE")
    }

    /// Every key in the database, by SCAN (never KEYS).
    pub fn keys(&self) -> Vec<String> {
        let mut conn = self.conn();
        let mut cursor: u64 = 0;
        let mut out = Vec::new();
        loop {
            let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("COUNT")
                .arg(1000)
                .query(&mut conn)
                .expect("SCAN");
            out.extend(batch);
            if next == 0 {
                return out;
            }
            cursor = next;
        }
    }

    /// The test-suite invariant: no key written by a script is left without a TTL.
    pub fn assert_every_key_has_ttl(&self) {
        let mut conn = self.conn();
        for k in self.keys() {
            let pttl: i64 = redis::cmd("PTTL").arg(&k).query(&mut conn).expect("PTTL");
            // -2: expired between SCAN and PTTL, fine. -1: no TTL, a bug, except for the
            // fencing tokens and the region's incarnation: the coordinator's counter, each
            // global policy's fence and the last incarnation must only grow (small keys,
            // one per region and per global policy; user keys end in a brace, so none is
            // taken for one).
            assert!(
                pttl != -1 || k.ends_with(":fence") || k.ends_with(":coordinator:incarnation"),
                "key {k} has no TTL"
            );
        }
    }

    /// Empties SLOWLOG and logs every command from now on that takes longer than
    /// [`SLOWLOG_MICROS`]: the threshold for tests that assert nothing stalls Redis.
    pub fn watch_slowlog(&self) {
        let mut conn = self.conn();
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("slowlog-log-slower-than")
            .arg(SLOWLOG_MICROS)
            .query(&mut conn)
            .expect("CONFIG SET slowlog-log-slower-than");
        let _: () = redis::cmd("SLOWLOG")
            .arg("RESET")
            .query(&mut conn)
            .expect("SLOWLOG RESET");
    }

    /// How often `command` (lower case, as INFO names it) has run since start.
    pub fn command_calls(&self, command: &str) -> u64 {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut self.conn())
            .expect("INFO commandstats");
        let prefix = format!("cmdstat_{command}:calls=");
        info.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|rest| rest.split(',').next())
            .map_or(0, |n| n.parse().expect("calls"))
    }

    /// Entries in SLOWLOG from connections named `client` (`CLIENT SETNAME`; the entry's
    /// last field).
    pub fn slowlog_of(&self, client: &str) -> Vec<String> {
        self.slowlog()
            .iter()
            .filter(
                |e| matches!(e.last(), Some(redis::Value::BulkString(n)) if n == client.as_bytes()),
            )
            .map(|e| format!("{e:?}"))
            .collect()
    }

    /// SLOWLOG's entries, newest first: id, time, µs, arguments, client address, name.
    fn slowlog(&self) -> Vec<Vec<redis::Value>> {
        redis::cmd("SLOWLOG")
            .arg("GET")
            .arg(1000)
            .query(&mut self.conn())
            .expect("SLOWLOG")
    }

    /// Entries in SLOWLOG that ran a script.
    pub fn slow_scripts(&self) -> Vec<String> {
        self.slowlog()
            .iter()
            .map(|e| format!("{e:?}"))
            .filter(|e| e.to_ascii_lowercase().contains("eval"))
            .collect()
    }
}

/// SLOWLOG threshold (µs) for [`RedisServer::watch_slowlog`]. A limiter script or a
/// janitor step takes tens of microseconds, so anything near 25 ms is a stall worth
/// finding; SLOWLOG counts wall time, and lower thresholds caught a preempted Redis on a
/// loaded 2-core CI run (an O(1) script at 17 ms, a 100-key SCAN at 1.6 ms).
pub const SLOWLOG_MICROS: u64 = 25_000;

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A quotad daemon: a process started from the built binary (killed on drop), or one
/// served inside this process (shut down on drop).
pub struct Quotad {
    pub port: u16,
    child: Option<Child>,
    inproc: Option<inproc::InProcess>,
    pub dir: tempfile::TempDir,
}

/// The config text a daemon runs: `config` with `[server] listen` on `port` and the extra
/// `[server]` lines in `server_extra` (top-level keys such as `region` must come before
/// the first table, so the server table goes after them).
fn with_listen(config: &str, server_extra: &str, port: u16) -> String {
    let split = config
        .lines()
        .position(|l| l.trim_start().starts_with('['))
        .unwrap_or(config.lines().count());
    let top: Vec<&str> = config.lines().take(split).collect();
    let rest: Vec<&str> = config.lines().skip(split).collect();
    format!(
        "{}\n[server]\nlisten = \"127.0.0.1:{port}\"\n{server_extra}\n{}",
        top.join("\n"),
        rest.join("\n")
    )
}

/// The `quotad` binary under test: `$QUOTAD_BIN`, or the one cargo built next to the
/// running test (`target/<profile>/quotad`; integration tests of the `quotad` package
/// get it built before they run).
pub fn quotad_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("QUOTAD_BIN") {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test>-<hash> → target/<profile>/quotad
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("the test runs from target/<profile>/deps");
    let bin = profile_dir.join("quotad");
    assert!(
        bin.exists(),
        "{} not found: build it with `cargo build` (or set QUOTAD_BIN)",
        bin.display()
    );
    bin
}

impl Quotad {
    /// Serves `config` inside this process (TOML without a `[server] listen`): the same
    /// `app::serve` as `quotad serve`, on a listener bound to a free port first, so no
    /// other process can take the port in between. `log()` reports panics only.
    pub fn serve(config: &str) -> Quotad {
        Self::serve_with(config, "")
    }

    /// [`Quotad::serve`] with extra `[server]` lines.
    pub fn serve_with(config: &str, server_extra: &str) -> Quotad {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        let port = listener.local_addr().expect("local addr").port();
        let text = with_listen(config, server_extra, port);
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("quotad.toml"), &text).expect("write config");
        let daemon = inproc::InProcess::start(&text, listener);
        let mut q = Quotad {
            port,
            child: None,
            inproc: Some(daemon),
            dir,
        };
        assert!(
            q.wait_healthy(Duration::from_secs(15)),
            "the in-process daemon did not become healthy"
        );
        q
    }

    /// Starts quotad as a process with `config` (TOML without a `[server] listen`; the
    /// harness adds it with a free port).
    pub fn start(config: &str) -> Quotad {
        Self::start_with(config, "")
    }

    /// [`Quotad::start`] with extra `[server]` lines.
    pub fn start_with(config: &str, server_extra: &str) -> Quotad {
        for _ in 0..5 {
            let dir = tempfile::tempdir().expect("tempdir");
            let port = free_port();
            let text = with_listen(config, server_extra, port);
            let path = dir.path().join("quotad.toml");
            std::fs::write(&path, text).expect("write config");
            let log = std::fs::File::create(dir.path().join("quotad.log")).expect("log file");
            let child = Command::new(quotad_binary())
                .args(["serve", "--config"])
                .arg(&path)
                .env("RUST_LOG", "info")
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("spawn quotad");
            let mut q = Quotad {
                port,
                child: Some(child),
                inproc: None,
                dir,
            };
            if q.wait_healthy(Duration::from_secs(15)) {
                return q;
            }
            let log = q.log();
            if !log.contains("Address already in use") {
                panic!("quotad did not become healthy; log:\n{log}");
            }
        }
        panic!("could not start quotad on a free port");
    }

    fn wait_healthy(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(_)) = c.try_wait() {
                    return false;
                }
            }
            if let Ok((200, _, _)) = http(self.port, "GET", "/healthz", None, "") {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The daemon's log; for an in-process daemon, the panics this process has seen.
    pub fn log(&self) -> String {
        if self.inproc.is_some() {
            return inproc::panics();
        }
        std::fs::read_to_string(self.dir.path().join("quotad.log")).unwrap_or_default()
    }

    /// The config file this daemon would run `config` from (TOML without a `[server]
    /// listen`, as given to [`Quotad::start`]): the harness's listen address added, so a
    /// reload keeps it.
    pub fn config_file_text(&self, config: &str) -> String {
        with_listen(config, "", self.port)
    }

    /// Writes `text` as the daemon's config file, sends SIGHUP and waits until the reload
    /// is counted; its result: `ok`, `partial`, `invalid` or `refused` (a process daemon
    /// only).
    pub fn reload(&self, text: &str) -> &'static str {
        const RESULTS: [&str; 4] = ["ok", "partial", "invalid", "refused"];
        let count =
            |r: &str| self.metric(&format!("quotad_config_reloads_total{{result=\"{r}\"}}"));
        let before = RESULTS.map(count);
        std::fs::write(self.dir.path().join("quotad.toml"), text).expect("write config");
        self.hup();
        wait_for("the reload counted", Duration::from_secs(10), || {
            RESULTS
                .into_iter()
                .zip(before)
                .find(|(r, b)| count(r) > *b)
                .map(|(r, _)| r)
        })
    }

    /// Sends SIGHUP: the daemon reloads its config file (a process daemon only).
    pub fn hup(&self) {
        let status = Command::new("kill")
            .args(["-HUP", &self.pid().to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill -HUP failed");
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    pub fn child(&mut self) -> &mut Child {
        self.child.as_mut().expect("running")
    }

    /// POST /v1/check with a JSON body; returns (status, body).
    pub fn check(&self, body: &Value) -> (u16, Value) {
        let (status, _, body) = self.post("/v1/check", body);
        (status, body)
    }

    /// `{"policy": p, "key": k}` through /v1/check; panics unless 200.
    pub fn check1(&self, policy: &str, key: &str) -> Value {
        let (status, body) = self.check(&serde_json::json!({"policy": policy, "key": key}));
        assert_eq!(status, 200, "{body}");
        body
    }

    /// POSTs JSON; to an admin endpoint ([`ADMIN_PATHS`]) with the kit's configs' token.
    pub fn post(&self, path: &str, body: &Value) -> (u16, Vec<(String, String)>, Value) {
        let bearer = format!("Bearer {ADMIN_TOKEN}");
        let mut headers = vec![("content-type", "application/json")];
        if ADMIN_PATHS.contains(&path) {
            headers.push(("authorization", bearer.as_str()));
        }
        let (status, headers, text) =
            request(self.port, "POST", path, &headers, &body.to_string()).expect("http");
        let json = serde_json::from_str(&text).unwrap_or(Value::Null);
        (status, headers, json)
    }

    /// An admin request (`method` on `path`, with a JSON body or none) with the kit's
    /// configs' token: the runtime-limit endpoints.
    pub fn admin(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        let bearer = format!("Bearer {ADMIN_TOKEN}");
        let mut headers = vec![("authorization", bearer.as_str())];
        let text = body.map(|b| b.to_string()).unwrap_or_default();
        if body.is_some() {
            headers.push(("content-type", "application/json"));
        }
        let (status, _, text) = request(self.port, method, path, &headers, &text).expect("http");
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    pub fn get(&self, path: &str) -> (u16, String) {
        let (status, _, text) = http(self.port, "GET", path, None, "").expect("http");
        (status, text)
    }

    /// GET, or None when the daemon does not answer (stopped, or being killed).
    pub fn try_get(&self, path: &str) -> Option<(u16, String)> {
        http(self.port, "GET", path, None, "")
            .ok()
            .map(|(s, _, t)| (s, t))
    }

    /// SIGKILL: no shutdown path runs (the lock is not released, nothing is flushed).
    pub fn kill(&mut self) {
        kill(&mut self.child);
    }

    /// Starts the daemon again on the same port with the same config.
    pub fn restart(&mut self) {
        self.kill();
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(self.dir.path().join("quotad.log"))
            .expect("log file");
        let child = Command::new(quotad_binary())
            .args(["serve", "--config"])
            .arg(self.dir.path().join("quotad.toml"))
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn quotad");
        self.child = Some(child);
        assert!(
            self.wait_healthy(Duration::from_secs(15)),
            "quotad did not come back; log:\n{}",
            self.log()
        );
    }

    /// GET a JSON document.
    pub fn json(&self, path: &str) -> Value {
        let (status, text) = self.get(path);
        assert_eq!(status, 200, "GET {path}: {text}");
        serde_json::from_str(&text).expect("JSON")
    }

    /// The value of a metric series in /metrics (`name{labels}` exactly as exposed), or 0.
    pub fn metric(&self, series: &str) -> f64 {
        let (_, text) = self.get("/metrics");
        text.lines()
            .find_map(|l| {
                l.strip_prefix(series)
                    .and_then(|rest| rest.strip_prefix(' '))
            })
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    }
}

impl Drop for Quotad {
    fn drop(&mut self) {
        kill(&mut self.child);
        if let Some(d) = self.inproc.take() {
            d.stop();
        }
    }
}

/// The endpoints that change limits, which take a bearer token of `[admin]`.
pub const ADMIN_PATHS: [&str; 1] = ["/v1/reset"];

/// A minimal blocking HTTP/1.1 exchange (one request per connection): enough for the tests,
/// and it lets a test send exactly the bytes it wants (bad content types, huge bodies).
pub fn http(
    port: u16,
    method: &str,
    path: &str,
    content_type: Option<&str>,
    body: &str,
) -> std::io::Result<Response> {
    let ct: Vec<(&str, &str)> = content_type
        .map(|c| ("content-type", c))
        .into_iter()
        .collect();
    request(port, method, path, &ct, body)
}

/// `POST /v1/check` with `body` on `port`: (status, outcome); status 0 and the error as
/// the outcome when the exchange failed. What the load loops of the kit and the fault
/// tests record per request.
pub fn check_outcome(port: u16, body: &str) -> (u16, String) {
    match http(port, "POST", "/v1/check", Some("application/json"), body) {
        Ok((s, _, text)) => {
            let v: Value = serde_json::from_str(&text).unwrap_or_default();
            (s, v["outcome"].as_str().unwrap_or("?").to_owned())
        }
        Err(e) => (0, format!("transport error: {e}")),
    }
}

/// [`http`] with any request headers (a proxy's, a client's API key).
pub fn request(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> std::io::Result<Response> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes())?;
    // A body over the server's cap may be refused before it is all sent: ignore write errors.
    let _ = s.write_all(body.as_bytes());
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    parse_response(&raw).ok_or_else(|| {
        std::io::Error::other(format!("bad response: {:?}", String::from_utf8_lossy(&raw)))
    })
}

/// (status, lower-cased headers, body)
pub type Response = (u16, Vec<(String, String)>, String);

fn parse_response(raw: &[u8]) -> Option<Response> {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n")?;
    let mut lines = head.lines();
    let status: u16 = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect::<Vec<_>>();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_owned()
    };
    Some((status, headers, body))
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

pub fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

/// A file of the repository, by its path from the workspace root.
pub fn fixture(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}
