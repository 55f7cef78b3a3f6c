//! The sequences of the article quotad started from (see docs/api.md), through the HTTP API against a real Redis.
//!
//! In-process daemons (`Quotad::serve`): every test here speaks HTTP and reads Redis, and
//! none needs a process boundary.

use quotad_testkit as common;

use std::time::{Duration, Instant};

use common::{Config, Policy, Quotad, RedisServer, wait_for};
use serde_json::json;

fn config(redis: &RedisServer) -> String {
    Config::redis(&redis.url())
        .policy(Policy::new("fw", "fixed_window", 100, "1m"))
        .policy(Policy::new("log", "sliding_log", 3, "60s"))
        .policy(Policy::new("log-short", "sliding_log", 3, "1s"))
        .policy(Policy::new("tb", "token_bucket", 2, "1s").burst(5))
        .to_toml()
}

fn remaining(v: &serde_json::Value) -> u64 {
    v["remaining"].as_u64().expect("remaining")
}

#[test]
fn fixed_window_counts_down_with_a_ttl() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&config(&redis));
    let got: Vec<u64> = (0..4).map(|_| remaining(&q.check1("fw", "u1"))).collect();
    assert_eq!(got, vec![99, 98, 97, 96]);
    let keys = redis.keys();
    assert_eq!(keys, vec!["rl:fw:fw:{u1}".to_owned()]);
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&keys[0])
        .query(&mut redis.conn())
        .unwrap();
    assert!(pttl > 0 && pttl <= 61_000, "PTTL {pttl}");
    redis.assert_every_key_has_ttl();
}

#[test]
fn sliding_log_admits_three_per_window_then_denies() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&config(&redis));
    let start = Instant::now();
    let mut got = Vec::new();
    for at_ms in [0u64, 100, 200, 300] {
        let due = Duration::from_millis(at_ms);
        if let Some(wait) = due.checked_sub(start.elapsed()) {
            std::thread::sleep(wait);
        }
        got.push(q.check1("log", "alice")["allowed"].as_bool().unwrap());
    }
    assert_eq!(got, vec![true, true, true, false]);
    redis.assert_every_key_has_ttl();
}

#[test]
fn sliding_log_capacity_returns_exactly_as_entries_leave() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&config(&redis));
    // Three admissions 200 ms apart in a 1 s window.
    let t0 = Instant::now();
    for i in 0..3u64 {
        if let Some(w) = Duration::from_millis(200 * i).checked_sub(t0.elapsed()) {
            std::thread::sleep(w);
        }
        assert_eq!(q.check1("log-short", "bob")["allowed"], true);
    }
    // Full: the denial says when the oldest entry leaves.
    let denied = q.check1("log-short", "bob");
    assert_eq!(denied["allowed"], false);
    let retry = denied["retry_after_ms"].as_u64().unwrap();
    assert!((1..=1000).contains(&retry), "retry_after_ms {retry}");
    // Poll: the first admission comes back once the oldest entry has left...
    let freed_at = wait_for("first entry to leave", Duration::from_secs(5), || {
        (q.check1("log-short", "bob")["allowed"] == true).then(|| t0.elapsed())
    });
    assert!(
        freed_at >= Duration::from_millis(1000),
        "freed after {freed_at:?}, before the window passed"
    );
    // ...and exactly one: the second-oldest entry (t0 + 200 ms) is still inside.
    let again = q.check1("log-short", "bob");
    if t0.elapsed() < Duration::from_millis(1150) {
        assert_eq!(again["allowed"], false, "{again}");
    }
    redis.assert_every_key_has_ttl();
}

#[test]
fn token_bucket_five_then_denied_then_refills() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&config(&redis));
    let got: Vec<(bool, u64)> = (0..7)
        .map(|_| {
            let v = q.check1("tb", "42");
            (v["allowed"].as_bool().unwrap(), remaining(&v))
        })
        .collect();
    assert_eq!(
        got,
        vec![
            (true, 4),
            (true, 3),
            (true, 2),
            (true, 1),
            (true, 0),
            (false, 0),
            (false, 0)
        ]
    );
    std::thread::sleep(Duration::from_secs(1));
    let v = q.check1("tb", "42");
    assert_eq!(
        (v["allowed"].as_bool().unwrap(), remaining(&v)),
        (true, 1),
        "{v}"
    );
    // Fractional tokens survive in the hash as a string, never truncated.
    let tokens: String = redis::cmd("HGET")
        .arg("rl:tb:tb:{42}")
        .arg("t")
        .query(&mut redis.conn())
        .unwrap();
    let t: f64 = tokens.parse().unwrap();
    assert!(t > 1.0 && t < 2.0 && t.fract() != 0.0, "tokens {tokens}");
    redis.assert_every_key_has_ttl();
}

#[test]
fn headers_follow_the_ietf_draft_and_retry_after_on_denial() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&config(&redis));
    for _ in 0..5 {
        q.check1("tb", "h");
    }
    let (status, headers, body) = q.post("/v1/check", &json!({"policy": "tb", "key": "h"}));
    assert_eq!(status, 200);
    assert_eq!(body["allowed"], false);
    let h = |n| common::header(&headers, n).unwrap_or_else(|| panic!("missing {n}: {headers:?}"));
    // q is the burst (what `remaining` counts against); refilling 5 at 2/s takes 2.5 s,
    // not a whole number of seconds, so no w (tests/headers.rs has the whole table).
    let pk = quotad_daemon::partition_key("tb", "h");
    assert_eq!(h("ratelimit-policy"), format!("\"tb\";q=5;pk={pk}"));
    // After a denial, t is the wait until a token is back: the same as Retry-After.
    assert_eq!(h("ratelimit"), format!("\"tb\";r=0;t=1;pk={pk}"));
    assert_eq!(h("retry-after"), "1");
    assert_eq!(h("ratelimit-limit"), "2");
    assert_eq!(h("ratelimit-remaining"), "0");
}
