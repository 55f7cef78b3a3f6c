//! Graceful shutdown on SIGTERM: /readyz turns 503 first, responses carry
//! `Connection: close`, an in-flight request completes, a client sending continuously over
//! keep-alive connections loses no request, the process exits within drain_timeout.
//! SIGHUP (and SIGUSR1/2) never stop the daemon. And the zero-setup mode (no config:
//! embedded store, policy "default") answers checks.
//!
//! Process daemons (`Quotad::start`): the tests signal the process, wait for its exit code
//! and read its log lines; an in-process daemon has none of those.

use quotad_testkit as common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{Config, Policy, Quotad, wait_for};

/// The embedded store and one policy, `api`, of `limit` per second.
fn api(algorithm: &str, limit: u64) -> String {
    Config::redis("memory")
        .policy(Policy::new("api", algorithm, limit, "1s"))
        .to_toml()
}

fn signal(pid: u32, sig: &str) {
    assert!(
        Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .unwrap()
            .success()
    );
}

fn sigterm(pid: u32) {
    signal(pid, "-TERM");
}

fn wait_exit(q: &mut Quotad, timeout: Duration) -> (Duration, Option<i32>) {
    let start = Instant::now();
    let status = wait_for("quotad to exit", timeout, || q.child().try_wait().unwrap());
    (start.elapsed(), status.code())
}

#[test]
fn sigterm_fails_readiness_first_then_drains_in_flight_requests() {
    let mut q = Quotad::start_with(
        &api("gcra", 10),
        "shutdown_delay = \"700ms\"\ndrain_timeout = \"5s\"",
    );
    assert_eq!(q.get("/readyz").0, 200);
    // An in-flight request: headers and half the body sent.
    let body = r#"{"policy":"api","key":"in-flight"}"#;
    let mut s = TcpStream::connect(("127.0.0.1", q.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "POST /v1/check HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n", body.len()).unwrap();
    s.write_all(&body.as_bytes()[..10]).unwrap();
    std::thread::sleep(Duration::from_millis(100));

    let signalled = Instant::now();
    sigterm(q.pid());
    // Readiness fails while the listener still accepts (shutdown_delay).
    wait_for("readyz 503", Duration::from_secs(5), || {
        (q.get("/readyz").0 == 503).then_some(())
    });
    assert!(
        signalled.elapsed() < Duration::from_millis(700),
        "readyz turned 503 too late"
    );
    // Checks are still answered during the delay.
    assert_eq!(q.check1("api", "during-delay")["outcome"], "allowed");

    // The in-flight request completes after the listener has closed.
    std::thread::sleep(Duration::from_millis(900));
    assert!(
        TcpStream::connect(("127.0.0.1", q.port)).is_err(),
        "listener still open after the delay"
    );
    s.write_all(&body.as_bytes()[10..]).unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.contains("\"outcome\":\"allowed\""), "{resp}");
    assert!(
        resp.to_ascii_lowercase().contains("connection: close"),
        "{resp}"
    );

    let (_, code) = wait_exit(&mut q, Duration::from_secs(5));
    assert_eq!(code, Some(0));
    assert!(
        signalled.elapsed() < Duration::from_secs(5),
        "exit took {:?}",
        signalled.elapsed()
    );
}

#[test]
fn a_stuck_client_cannot_hold_shutdown_past_drain_timeout() {
    let mut q = Quotad::start_with(&api("gcra", 10), "drain_timeout = \"1s\"");
    let mut s = TcpStream::connect(("127.0.0.1", q.port)).unwrap();
    write!(s, "POST /v1/check HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{{").unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let signalled = Instant::now();
    sigterm(q.pid());
    let (_, code) = wait_exit(&mut q, Duration::from_secs(10));
    let took = signalled.elapsed();
    assert_eq!(code, Some(0));
    assert!(
        took >= Duration::from_millis(900),
        "exited after {took:?}, before the drain timeout"
    );
    assert!(
        took < Duration::from_secs(3),
        "exited after {took:?}: the drain timeout did not bound it"
    );
}

#[test]
fn zero_setup_mode_answers_with_the_builtin_policy() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let settings = quotad_daemon::Settings::builtin();
        assert_eq!(settings.listen().to_string(), "127.0.0.1:8686");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = tokio_util::sync::CancellationToken::new();
        let settings = settings.without_shutdown_delay();
        let server = tokio::spawn(quotad_daemon::serve(settings, listener, shutdown.clone()));
        let client = reqwest::Client::new();
        let url = format!("http://{addr}/v1/check");
        let mut remaining = Vec::new();
        for _ in 0..3 {
            let v: serde_json::Value = client
                .post(&url)
                .json(&serde_json::json!({"policy": "default", "key": "me"}))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            assert_eq!(v["outcome"], "allowed");
            remaining.push(v["remaining"].as_u64().unwrap());
        }
        assert_eq!(remaining, vec![99, 98, 97]);
        let ready = client
            .get(format!("http://{addr}/readyz"))
            .send()
            .await
            .unwrap();
        assert_eq!(ready.status(), 200);
        shutdown.cancel();
        server.await.unwrap().unwrap();
    });
}

#[test]
fn sighup_and_user_signals_are_logged_and_the_daemon_keeps_serving() {
    let mut q = Quotad::start(&api("gcra", 10));
    for sig in ["-HUP", "-USR1", "-USR2", "-HUP"] {
        signal(q.pid(), sig);
        std::thread::sleep(Duration::from_millis(50));
    }
    // SIGHUP reloads the (unchanged) file; the user signals are ignored.
    wait_for("the log lines", Duration::from_secs(5), || {
        let log = q.log();
        (log.matches("signal received and ignored").count() == 2
            && log
                .matches("config reload: the file and its secrets are unchanged")
                .count()
                == 2)
            .then_some(())
    });
    assert!(q.log().contains("SIGUSR2"));
    assert!(q.child().try_wait().unwrap().is_none(), "the daemon exited");
    assert_eq!(q.check1("api", "after-hup")["outcome"], "allowed");
    assert_eq!(q.get("/readyz").0, 200);
}

/// A keep-alive client: send a check, read its answer, again, on one connection. An answer
/// with `Connection: close` ends it, as it would move a client behind a load balancer to
/// another instance (a client that reconnects to this very instance at the instant its
/// listener closes can always be reset, whatever the server). Counts requests written and
/// answers read.
fn continuous_client(
    port: u16,
    sent: &AtomicU64,
    answered: &AtomicU64,
    closes: &AtomicU64,
    stop: &AtomicBool,
) {
    let body = r#"{"policy":"api","key":"k"}"#;
    let req = format!(
        "POST /v1/check HTTP/1.1\r\nhost: q\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    {
        while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
            if s.write_all(req.as_bytes()).is_err() {
                break; // not sent
            }
            sent.fetch_add(1, Ordering::Relaxed);
            let mut buf = Vec::new();
            let mut chunk = [0u8; 2048];
            let answer = loop {
                match s.read(&mut chunk) {
                    Ok(0) | Err(_) => break None,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
                let text = String::from_utf8_lossy(&buf).to_ascii_lowercase();
                if let Some((head, rest)) = text.split_once("\r\n\r\n") {
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    if rest.len() >= len {
                        break Some(head.to_owned());
                    }
                }
            };
            let Some(head) = answer else {
                break; // the request was sent and never answered: counted as lost
            };
            answered.fetch_add(1, Ordering::Relaxed);
            if head.contains("connection: close") {
                closes.fetch_add(1, Ordering::Relaxed);
                break;
            }
        }
    }
}

#[test]
fn sigterm_under_continuous_keep_alive_load_answers_every_request_sent() {
    let mut q = Quotad::start_with(
        &api("token_bucket", 1_000_000),
        "shutdown_delay = \"1s\"\ndrain_timeout = \"5s\"",
    );
    let counters: Arc<[AtomicU64; 3]> = Arc::new(Default::default());
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..20)
        .map(|_| {
            let (c, stop, port) = (counters.clone(), stop.clone(), q.port);
            std::thread::spawn(move || continuous_client(port, &c[0], &c[1], &c[2], &stop))
        })
        .collect();
    wait_for("load under way", Duration::from_secs(5), || {
        (counters[1].load(Ordering::Relaxed) > 200).then_some(())
    });
    let signalled = Instant::now();
    sigterm(q.pid());
    let (_, code) = wait_exit(&mut q, Duration::from_secs(10));
    let exited = signalled.elapsed();
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().unwrap();
    }
    let [sent, answered, closes] = [0, 1, 2].map(|i| counters[i].load(Ordering::Relaxed));
    eprintln!(
        "sent {sent}, answered {answered}, Connection: close answers {closes}, exit after {exited:?}"
    );
    assert_eq!(code, Some(0));
    assert_eq!(sent, answered, "requests sent but never answered");
    assert_eq!(closes, 20, "every client was told to close its connection");
    assert!(exited < Duration::from_secs(5), "exit took {exited:?}");
}
