//! The limiter protects itself: once the store denies a key, checks of that key are
//! answered from memory until the retry time the store gave (no Redis call), with the
//! same answer the store would give; a reset through any instance ends that at once.
//!
//! In-process daemons (`Quotad::serve`): two instances on one Redis need two daemons, each
//! with its own store, deny cache and subscription, not two processes.

use quotad_testkit as common;

use std::time::{Duration, Instant};

use common::{Config, Policy, Quotad, RedisServer, wait_for};
use serde_json::json;

fn config(redis: &RedisServer) -> String {
    Config::redis(&redis.url())
        .policy(Policy::new("login", "sliding_log", 3, "1h").on_store_error("closed"))
        .policy(Policy::new("burst", "sliding_log", 2, "1s"))
        .to_toml()
}

/// Scripts Redis has run (every decision is one EVALSHA).
fn evalsha_calls(redis: &RedisServer) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut redis.conn())
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|v| v.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

#[test]
fn a_hammered_denied_key_costs_no_redis_call_until_its_retry_time() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&config(&redis));
    for _ in 0..3 {
        assert_eq!(q.check1("login", "mallory")["outcome"], "allowed");
    }
    // The invalidation subscription is up once a denial is remembered.
    wait_for("a remembered denial", Duration::from_secs(5), || {
        assert_eq!(q.check1("login", "mallory")["outcome"], "denied");
        (q.metric("quotad_deny_cache_hits_total{policy=\"login\"}") > 0.0).then_some(())
    });
    let before = evalsha_calls(&redis);
    let hits = q.metric("quotad_deny_cache_hits_total{policy=\"login\"}");
    for _ in 0..200 {
        let v = q.check1("login", "mallory");
        assert_eq!(
            (v["allowed"].as_bool(), v["outcome"].as_str()),
            (Some(false), Some("denied")),
            "{v}"
        );
        assert_eq!(v["remaining"], 0, "{v}");
        let retry = v["retry_after_ms"].as_u64().unwrap();
        assert!(retry > 3_500_000 && retry <= 3_600_000, "{v}");
    }
    let asked = evalsha_calls(&redis) - before;
    let answered = q.metric("quotad_deny_cache_hits_total{policy=\"login\"}") - hits;
    eprintln!("200 denials, {answered} from memory, {asked} scripts run");
    assert_eq!(asked, 0, "Redis calls for 200 hammered denials");
    assert_eq!(answered, 200.0);
    // A peek asks what a cost-1 check asks: from memory. Another cost is another
    // question, with its own answer: the store's.
    let (_, v) = q.check(&json!({"policy": "login", "key": "mallory", "cost": 0}));
    assert_eq!(v["allowed"], false);
    assert_eq!(evalsha_calls(&redis) - before, 0);
    let (_, v) = q.check(&json!({"policy": "login", "key": "mallory", "cost": 2}));
    assert_eq!(v["outcome"], "denied");
    assert_eq!(evalsha_calls(&redis) - before, 1);
}

#[test]
fn a_remembered_denial_ends_at_the_retry_time_the_store_gave() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&config(&redis));
    assert_eq!(q.check1("burst", "warmup")["outcome"], "allowed");
    wait_for(
        "the invalidation subscription",
        Duration::from_secs(5),
        || {
            // A remembered denial shows the subscription is up.
            let key = format!("probe-{}", rand_key());
            for _ in 0..3 {
                q.check1("burst", &key);
            }
            q.check1("burst", &key);
            (q.metric("quotad_deny_cache_hits_total{policy=\"burst\"}") > 0.0).then_some(())
        },
    );
    for _ in 0..2 {
        assert_eq!(q.check1("burst", "k")["outcome"], "allowed");
    }
    let first = q.check1("burst", "k");
    let denied_at = Instant::now();
    assert_eq!(first["outcome"], "denied");
    let retry = Duration::from_millis(first["retry_after_ms"].as_u64().unwrap());
    wait_for(
        "admission after the retry time",
        Duration::from_secs(5),
        || (q.check1("burst", "k")["outcome"] == "allowed").then_some(()),
    );
    let took = denied_at.elapsed();
    assert!(
        took + Duration::from_millis(20) >= retry,
        "allowed {took:?} after a denial that said {retry:?}"
    );
}

fn rand_key() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

#[test]
fn a_reset_through_another_instance_ends_a_remembered_denial_at_once() {
    let redis = RedisServer::start();
    let a = Quotad::serve(&config(&redis));
    let b = Quotad::serve(&config(&redis));
    for _ in 0..3 {
        assert_eq!(a.check1("login", "alice")["outcome"], "allowed");
    }
    // Denied for an hour, remembered in a.
    wait_for("a remembered denial in a", Duration::from_secs(5), || {
        assert_eq!(a.check1("login", "alice")["outcome"], "denied");
        (a.metric("quotad_deny_cache_hits_total{policy=\"login\"}") > 0.0).then_some(())
    });
    let (status, _, _) = b.post("/v1/reset", &json!({"policy": "login", "key": "alice"}));
    assert_eq!(status, 204);
    // a hears of it through Redis and asks the store again.
    let took = Instant::now();
    wait_for(
        "a to admit alice after b's reset",
        Duration::from_secs(2),
        || (a.check1("login", "alice")["outcome"] == "allowed").then_some(()),
    );
    eprintln!("a admitted alice {:?} after b's reset", took.elapsed());
    redis.assert_every_key_has_ttl();
}

/// A remembered denial answers what the store would: its `remaining` too. A fixed
/// window denies a check of 2 with 1 unit left, on both instances, while their
/// invalidation channels are live (denials are being remembered); that unit is then
/// admitted (a check of 1, through A), and the next check of 2 is told 0 left on both,
/// as the store says. A remembered denial of 2 told 1.
#[test]
fn a_remembered_denial_of_a_larger_cost_tells_what_is_left_now() {
    let redis = RedisServer::start();
    let config = Config::redis(&redis.url())
        .policy(Policy::new("w", "fixed_window", 3, "100d"))
        .to_toml();
    let (a, b) = (Quotad::serve(&config), Quotad::serve(&config));
    let two = |key: &str| json!({"policy": "w", "key": key, "cost": 2});
    for q in [&a, &b] {
        // Live: a denial of another key is answered from memory.
        q.check(&json!({"policy": "w", "key": "full", "cost": 3}));
        wait_for("a remembered denial", Duration::from_secs(5), || {
            assert_eq!(q.check1("w", "full")["allowed"], false);
            (q.metric("quotad_deny_cache_hits_total{policy=\"w\"}") > 0.0).then_some(())
        });
    }
    assert_eq!(a.check(&two("k")).1["allowed"], true);
    for q in [&a, &b, &a, &b] {
        let v = q.check(&two("k")).1;
        assert_eq!(
            (&v["allowed"], &v["remaining"]),
            (&json!(false), &json!(1)),
            "{v}"
        );
    }
    assert_eq!(a.check1("w", "k")["remaining"], 0);
    for q in [&a, &b] {
        let v = q.check(&two("k")).1;
        assert_eq!(v["allowed"], false, "{v}");
        assert_eq!(v["remaining"], 0, "{v}");
    }
}
