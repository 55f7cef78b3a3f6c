//! Every connection is bounded: a connection that sends nothing, sends its headers slowly
//! (slowloris) or stops mid-body is closed within its timeout; an idle keep-alive
//! connection after `idle_timeout`; oversized headers get 431, broken chunked framing 400;
//! at `max_connections` a new connection evicts the one that waited longest without a
//! request in progress, or is turned away when every connection is busy. Each closing is
//! counted in `quotad_connections_closed_total{listener="http",reason}`.
//!
//! In-process daemons (`Quotad::serve_with`). The bounds under test are the server's own
//! (`max_connections` is set wherever it matters, so the open-files limit the in-process
//! daemon raises for this whole process decides nothing here), and the timeouts run on the
//! daemon's runtime, not on the test's threads.

use quotad_testkit as common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{Config, Policy, Quotad};

/// An in-process daemon on the embedded store with the extra `[server]` lines in `extra`.
fn start(extra: &str) -> Quotad {
    let config = Config::redis("memory")
        .policy(Policy::new("api", "token_bucket", 1000, "1s"))
        .to_toml();
    Quotad::serve_with(&config, extra)
}

/// Waits until the server on `port` has accepted `n` connections and read everything
/// sent on them: the kernel's table of loopback sockets (`/proc/net/tcp`) lists the
/// server's end of each established connection (local port `port`, state 01) with its
/// receive queue, which is empty once the server has read it. A connection still in the
/// accept queue has its bytes there too.
fn until_read(port: u16, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
        let queues: Vec<u64> = table
            .lines()
            .skip(1)
            .filter_map(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                let local = u16::from_str_radix(f.get(1)?.rsplit(':').next()?, 16).ok()?;
                let unread = u64::from_str_radix(f.get(4)?.split(':').nth(1)?, 16).ok()?;
                (local == port && *f.get(3)? == "01").then_some(unread)
            })
            .collect();
        if queues.len() >= n && queues.iter().all(|q| *q == 0) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the server did not read its {n} connections: receive queues {queues:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn connect(q: &Quotad) -> TcpStream {
    let s = TcpStream::connect(("127.0.0.1", q.port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

/// Reads until the server closes the connection; returns what it sent and how long the
/// close took from `since`.
fn until_closed(s: &mut TcpStream, since: Instant) -> (String, Duration) {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
    (String::from_utf8_lossy(&out).into_owned(), since.elapsed())
}

fn check_request(key: &str) -> String {
    let body = format!(r#"{{"policy":"api","key":"{key}"}}"#);
    format!(
        "POST /v1/check HTTP/1.1\r\nhost: q\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Sends one check on a keep-alive connection and reads exactly its response.
fn keep_alive_check(s: &mut TcpStream, key: &str) -> String {
    s.write_all(check_request(key).as_bytes()).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf).expect("response");
        assert!(n > 0, "closed before a response");
        out.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&out);
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len: usize = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse().unwrap())
                })
                .unwrap_or(0);
            if body.len() >= len {
                return text.into_owned();
            }
        }
    }
}

fn closed(q: &Quotad, reason: &str) -> f64 {
    q.metric(&format!(
        "quotad_connections_closed_total{{listener=\"http\",reason=\"{reason}\"}}"
    ))
}

#[test]
fn silent_slow_and_half_sent_requests_are_closed_within_their_timeouts() {
    let q = start("header_timeout = \"400ms\"\nbody_timeout = \"400ms\"");
    // Sends nothing at all.
    let mut silent = connect(&q);
    let t = Instant::now();
    // Slowloris: a header byte every 100 ms, never finishing.
    let mut slow = connect(&q);
    let slowloris = std::thread::spawn(move || {
        let t = Instant::now();
        for b in b"POST /v1/check HTTP/1.1\r\nhost: q\r\nx-slow: "
            .iter()
            .cycle()
        {
            if slow.write_all(&[*b]).is_err() || t.elapsed() > Duration::from_secs(10) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        t.elapsed()
    });
    // Headers complete, then half the body.
    let mut half = connect(&q);
    half.write_all(b"POST /v1/check HTTP/1.1\r\nhost: q\r\ncontent-type: application/json\r\ncontent-length: 40\r\n\r\n{\"policy\":")
        .unwrap();

    let (sent, took) = until_closed(&mut silent, t);
    assert!(sent.is_empty(), "{sent}");
    assert!(
        took >= Duration::from_millis(350) && took < Duration::from_secs(3),
        "silent: {took:?}"
    );
    let (resp, took) = until_closed(&mut half, t);
    assert!(resp.starts_with("HTTP/1.1 408"), "{resp}");
    assert!(resp.contains("\"code\":\"request_timeout\""), "{resp}");
    assert!(took < Duration::from_secs(3), "half-sent body: {took:?}");
    let slow_took = slowloris.join().unwrap();
    assert!(
        slow_took < Duration::from_secs(3),
        "slowloris kept its connection {slow_took:?}"
    );

    assert!(closed(&q, "header_timeout") >= 2.0);
    // The daemon is unharmed.
    assert_eq!(q.check1("api", "after")["outcome"], "allowed");
}

#[test]
fn an_idle_keep_alive_connection_closes_after_idle_timeout_and_a_busy_one_stays() {
    let q = start("idle_timeout = \"500ms\"");
    let mut busy = connect(&q);
    let mut idle = connect(&q);
    assert!(keep_alive_check(&mut idle, "i").starts_with("HTTP/1.1 200"));
    let idled = Instant::now();
    // A request every 200 ms keeps the other one open well past the idle timeout.
    for i in 0..8 {
        assert!(keep_alive_check(&mut busy, &format!("b{i}")).starts_with("HTTP/1.1 200"));
        std::thread::sleep(Duration::from_millis(200));
    }
    let (_, took) = until_closed(&mut idle, idled);
    assert!(
        took >= Duration::from_millis(450) && took < Duration::from_secs(3),
        "{took:?}"
    );
    assert!(keep_alive_check(&mut busy, "last").starts_with("HTTP/1.1 200"));
    assert!(closed(&q, "idle_timeout") >= 1.0);
}

#[test]
fn oversized_headers_get_431_and_broken_chunked_framing_gets_400() {
    let q = start("max_header_bytes = 4096");
    let mut s = connect(&q);
    let big = "x".repeat(8000);
    write!(
        s,
        "GET /healthz HTTP/1.1\r\nhost: q\r\nx-big: {big}\r\n\r\n"
    )
    .unwrap();
    let (resp, _) = until_closed(&mut s, Instant::now());
    assert!(resp.starts_with("HTTP/1.1 431"), "{resp}");

    let mut s = connect(&q);
    s.write_all(b"POST /v1/check HTTP/1.1\r\nhost: q\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n")
        .unwrap();
    let (resp, _) = until_closed(&mut s, Instant::now());
    assert!(resp.starts_with("HTTP/1.1 400"), "{resp}");
    assert!(resp.contains("\"code\":\"invalid_body\""), "{resp}");

    // A declared length over the cap is refused before any of it is read.
    let mut s = connect(&q);
    s.write_all(b"POST /v1/check HTTP/1.1\r\nhost: q\r\ncontent-type: application/json\r\ncontent-length: 100000000\r\n\r\n")
        .unwrap();
    let (resp, took) = until_closed(&mut s, Instant::now());
    assert!(resp.starts_with("HTTP/1.1 413"), "{resp}");
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert_eq!(q.check1("api", "after")["outcome"], "allowed");
}

#[test]
fn at_the_connection_bound_the_longest_waiting_connection_makes_room() {
    let q = start("max_connections = 4\nheader_timeout = \"30s\"");
    // A client that has been served keeps its connection, even though it has waited
    // longest of all: silent sockets go first.
    let mut served = connect(&q);
    assert!(keep_alive_check(&mut served, "served").starts_with("HTTP/1.1 200"));
    std::thread::sleep(Duration::from_millis(50));
    // Three connections that send nothing fill the other slots, the oldest first.
    let mut oldest = connect(&q);
    std::thread::sleep(Duration::from_millis(50));
    let _others: Vec<TcpStream> = (0..2)
        .map(|_| {
            let s = connect(&q);
            std::thread::sleep(Duration::from_millis(20));
            s
        })
        .collect();
    // (No polling of /metrics here: every request would itself take a slot.)
    std::thread::sleep(Duration::from_millis(300));
    // A fifth is served: the oldest silent one is closed to make room.
    let mut fresh = connect(&q);
    assert!(keep_alive_check(&mut fresh, "k").starts_with("HTTP/1.1 200"));
    let (sent, _) = until_closed(&mut oldest, Instant::now());
    assert!(sent.is_empty());
    assert!(keep_alive_check(&mut served, "still").starts_with("HTTP/1.1 200"));
    // This very request took a slot too (evicting the next oldest silent connection).
    assert!(closed(&q, "evicted") >= 1.0);
    assert!(q.metric("quotad_connections_open{listener=\"http\"}") <= 4.0);
}

#[test]
fn at_the_connection_bound_with_every_connection_busy_a_new_one_is_turned_away() {
    let q = start("max_connections = 2\nbody_timeout = \"5s\"");
    let body = r#"{"policy":"api","key":"k"}"#;
    // Two requests in progress (waiting for the rest of their bodies).
    let mut busy: Vec<TcpStream> = (0..2)
        .map(|_| {
            let mut s = connect(&q);
            write!(s, "POST /v1/check HTTP/1.1\r\nhost: q\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{}", body.len(), &body[..1])
                .unwrap();
            s
        })
        .collect();
    // Both read by the server (requests in progress, not silent connections it may close
    // to make room) before the third comes.
    until_read(q.port, 2);
    let mut third = connect(&q);
    let _ = third.write_all(check_request("x").as_bytes());
    let (resp, _) = until_closed(&mut third, Instant::now());
    assert!(resp.is_empty(), "served past the bound: {resp}");
    // The busy ones are unaffected: they finish and are answered.
    for s in &mut busy {
        s.write_all(&body.as_bytes()[1..]).unwrap();
        let (resp, _) = until_closed(s, Instant::now());
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    }
    // (Read only now: while both slots were busy, /metrics could not have been served.)
    assert_eq!(closed(&q, "rejected"), 1.0);
}
