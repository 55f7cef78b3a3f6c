//! A Unix domain socket listener (`listen = "unix:/path"`, `grpc_listen = "unix:/path"`)
//! for a sidecar on the same host: the same API, limits and connection bounds as over
//! TCP, through the server's one socket layer. The daemon is a process (`quotad serve`);
//! the test talks HTTP/1.1 and gRPC over the sockets it creates, and the files go when it
//! stops.

use quotad_testkit as common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::grpc::RateLimitServiceClient;
use common::{Config, Descriptor, Policy, RedisServer, quotad_binary, runtime, wait_for};
use quotad_daemon::envoy::{Code, Entry, RateLimitDescriptor, RateLimitRequest};
use serde_json::Value;

struct Daemon {
    child: Child,
    dir: tempfile::TempDir,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Daemon {
    fn http(&self) -> PathBuf {
        self.dir.path().join("http.sock")
    }

    fn grpc(&self) -> PathBuf {
        self.dir.path().join("grpc.sock")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("quotad.log")).unwrap_or_default()
    }
}

/// `quotad serve` with both listeners on Unix sockets in a directory of its own.
fn start(redis: &RedisServer) -> Daemon {
    let dir = tempfile::tempdir().unwrap();
    let http = dir.path().join("http.sock");
    let grpc = dir.path().join("grpc.sock");
    let config = Config::redis(&redis.url())
        .policy(Policy::new("api", "fixed_window", 3, "1h"))
        .descriptor("edge", Descriptor::new("user").policy("api"))
        .to_toml();
    let text = format!(
        "[server]\nlisten = \"unix:{}\"\ngrpc_listen = \"unix:{}\"\nheader_timeout = \"300ms\"\nshutdown_delay = \"100ms\"\n{config}",
        http.display(),
        grpc.display()
    );
    let path = dir.path().join("quotad.toml");
    std::fs::write(&path, text).unwrap();
    let log = std::fs::File::create(dir.path().join("quotad.log")).unwrap();
    let child = Command::new(quotad_binary())
        .args(["serve", "--config"])
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let d = Daemon { child, dir };
    wait_for("the HTTP socket", Duration::from_secs(15), || {
        request(&d.http(), "GET", "/readyz", "").ok().map(|_| ())
    });
    d
}

/// One HTTP/1.1 request over the socket at `path`; (status, body).
fn request(path: &Path, method: &str, target: &str, body: &str) -> std::io::Result<(u16, String)> {
    let mut s = UnixStream::connect(path)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "{method} {target} HTTP/1.1\r\nHost: quotad\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad response: {out:?}")))?;
    let body = out.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
    Ok((status, body))
}

fn metric(d: &Daemon, series: &str) -> f64 {
    let (_, text) = request(&d.http(), "GET", "/metrics", "").unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

#[test]
fn the_api_answers_over_a_unix_socket_with_the_same_limits_and_bounds() {
    let redis = RedisServer::start();
    let d = start(&redis);
    let check = r#"{"policy":"api","key":"sidecar"}"#;
    let allowed: Vec<bool> = (0..4)
        .map(|_| {
            let (status, body) = request(&d.http(), "POST", "/v1/check", check).unwrap();
            assert_eq!(status, 200, "{body}");
            let v: Value = serde_json::from_str(&body).unwrap();
            v["allowed"].as_bool().unwrap()
        })
        .collect();
    assert_eq!(allowed, [true, true, true, false]);

    // A connection that sends nothing is closed at the header timeout, and counted, as
    // over TCP.
    let before = metric(
        &d,
        "quotad_connections_closed_total{listener=\"http\",reason=\"header_timeout\"}",
    );
    let mut silent = UnixStream::connect(d.http()).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let since = Instant::now();
    let n = silent.read(&mut [0u8; 64]).unwrap_or(0);
    assert_eq!(n, 0, "closed without an answer");
    let took = since.elapsed();
    assert!(took < Duration::from_secs(3), "closed after {took:?}");
    wait_for("the closing counted", Duration::from_secs(5), || {
        (metric(
            &d,
            "quotad_connections_closed_total{listener=\"http\",reason=\"header_timeout\"}",
        ) > before)
            .then_some(())
    });

    // gRPC over its own socket: the same policy, the same key's count.
    runtime().block_on(async {
        let mut c = unix_grpc_client(d.grpc()).await;
        let r = c
            .should_rate_limit(RateLimitRequest {
                domain: "edge".into(),
                descriptors: vec![RateLimitDescriptor {
                    entries: vec![Entry {
                        key: "user".into(),
                        value: "sidecar".into(),
                    }],
                    ..Default::default()
                }],
                hits_addend: 0,
            })
            .await
            .expect("ShouldRateLimit over the socket")
            .into_inner();
        assert_eq!(r.overall_code, Code::OverLimit as i32, "{r:?}");
    });

    // The socket files go with the daemon (SIGTERM: the drain, then exit).
    let (http, grpc) = (d.http(), d.grpc());
    let pid = d.child.id().to_string();
    Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    wait_for("the socket files removed", Duration::from_secs(20), || {
        (!http.exists() && !grpc.exists()).then_some(())
    });
    let log = d.log();
    assert!(log.contains("unix:"), "the log names the socket: {log}");
}

/// A tonic client whose connections are to the Unix socket at `path`.
async fn unix_grpc_client(path: PathBuf) -> RateLimitServiceClient {
    let channel = tonic::transport::Endpoint::from_static("http://quotad.sock")
        .connect_with_connector(Connector(path))
        .await
        .expect("connect over the socket");
    RateLimitServiceClient::new(channel)
}

/// A connector: every URI is the Unix socket at its path.
#[derive(Clone)]
struct Connector(PathBuf);

impl tower_service::Service<tonic::codegen::http::Uri> for Connector {
    type Response = hyper_util::rt::TokioIo<tokio::net::UnixStream>;
    type Error = std::io::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: tonic::codegen::http::Uri) -> Self::Future {
        let path = self.0.clone();
        Box::pin(async move {
            let s = tokio::net::UnixStream::connect(path).await?;
            Ok(hyper_util::rt::TokioIo::new(s))
        })
    }
}
