//! Graceful shutdown on SIGTERM: /readyz turns 503 first, an in-flight request completes,
//! the process exits within drain_timeout. And the zero-setup mode (no config: embedded
//! store, policy "default") answers checks.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Quotad, wait_for};

const POLICY: &str = "[store]\nredis = \"memory\"\n[[policy]]\nname = \"api\"\nalgorithm = \"gcra\"\nlimit = 10\nwindow = \"1s\"\n";

fn sigterm(pid: u32) {
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .unwrap()
            .success()
    );
}

fn wait_exit(q: &mut Quotad, timeout: Duration) -> (Duration, Option<i32>) {
    let start = Instant::now();
    let status = wait_for("quotad to exit", timeout, || q.child().try_wait().unwrap());
    (start.elapsed(), status.code())
}

#[test]
fn sigterm_fails_readiness_first_then_drains_in_flight_requests() {
    let mut q = Quotad::start_with(POLICY, "shutdown_delay = \"700ms\"\ndrain_timeout = \"5s\"");
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
    let mut q = Quotad::start_with(POLICY, "drain_timeout = \"1s\"");
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
        let settings = quotad::config::Settings::builtin();
        assert_eq!(settings.server.listen.to_string(), "127.0.0.1:8686");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = tokio_util::sync::CancellationToken::new();
        let server = tokio::spawn(quotad::app::serve(settings, listener, shutdown.clone()));
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
