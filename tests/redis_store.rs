//! The Redis store end to end: NOSCRIPT recovery, batch refunds, reset, peek, shadow mode,
//! SLOWLOG after a load, the policies endpoint and the metric catalogue.
//!
//! In-process daemons (`Quotad::serve`): a config change is a new daemon on the same Redis,
//! not a restart of the old one, so nothing here needs a process boundary.

use quotad_testkit as common;

use common::{Config, Policy, Quotad, RedisServer};
use serde_json::json;

fn config(redis: &RedisServer) -> String {
    Config::redis(&redis.url())
        .policy(Policy::new("fw", "fixed_window", 10, "1h"))
        .policy(Policy::new("sl", "sliding_log", 10, "1h"))
        .policy(Policy::new("sw", "sliding_window", 10, "1h"))
        .policy(Policy::new("tb", "token_bucket", 10, "1h"))
        .policy(Policy::new("gc", "gcra", 10, "1h"))
        .policy(Policy::new("gate", "fixed_window", 1, "1h"))
        .policy(Policy::new("login-user", "sliding_log", 5, "15m").on_store_error("closed"))
        .policy(Policy::new("watch", "fixed_window", 2, "1h").shadow())
        .to_toml()
}

const ALGS: [&str; 5] = ["fw", "sl", "sw", "tb", "gc"];

fn remaining(q: &Quotad, policy: &str, key: &str) -> u64 {
    let (status, v) = q.check(&json!({"policy": policy, "key": key, "cost": 0}));
    assert_eq!(status, 200, "{v}");
    v["remaining"].as_u64().unwrap()
}

#[test]
fn script_flush_is_recovered_with_no_client_visible_error() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&config(&redis));
    let loads = q.metric("quotad_script_loads_total");
    for p in ALGS {
        assert_eq!(q.check1(p, "a")["outcome"], "allowed");
    }
    let _: String = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut redis.conn())
        .unwrap();
    for p in ALGS {
        let v = q.check1(p, "a");
        assert_eq!(v["outcome"], "allowed", "{p} after SCRIPT FLUSH: {v}");
        assert_eq!(
            v["remaining"], 8,
            "{p}: state survived, second admission counted: {v}"
        );
    }
    assert_eq!(
        q.metric("quotad_script_loads_total"),
        loads + ALGS.len() as f64
    );
    assert_eq!(q.metric("quotad_store_errors_total{kind=\"command\"}"), 0.0);
}

#[test]
fn a_denied_batch_refunds_its_admitted_siblings() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&config(&redis));
    // Use up the gate.
    assert_eq!(q.check1("gate", "g")["allowed"], true);
    for p in ALGS {
        let key = format!("batch-{p}");
        q.check(&json!({"policy": p, "key": key, "cost": 3}));
        let before = remaining(&q, p, &key);
        let (status, v) = q.check(&json!({"checks": [
            {"policy": p, "key": key, "cost": 2},
            {"policy": "gate", "key": "g"},
        ]}));
        assert_eq!(status, 200);
        assert_eq!(v["allowed"], false, "{v}");
        assert_eq!(v["results"][0]["outcome"], "allowed", "{v}");
        assert_eq!(v["results"][0]["refunded"], true, "{v}");
        assert_eq!(v["results"][1]["outcome"], "denied", "{v}");
        assert_eq!(
            remaining(&q, p, &key),
            before,
            "{p}: the denied batch charged its sibling"
        );
    }
    // An allowed batch charges every check.
    let (_, v) = q.check(
        &json!({"checks": [{"policy": "fw", "key": "x"}, {"policy": "tb", "key": "x", "cost": 4}]}),
    );
    assert_eq!(v["allowed"], true, "{v}");
    assert_eq!(remaining(&q, "fw", "x"), 9);
    assert_eq!(remaining(&q, "tb", "x"), 6);
    redis.assert_every_key_has_ttl();
}

#[test]
fn login_flow_resets_the_username_after_success() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&config(&redis));
    for _ in 0..5 {
        assert_eq!(q.check1("login-user", "alice")["allowed"], true);
    }
    assert_eq!(q.check1("login-user", "alice")["allowed"], false);
    let (status, _, _) = q.post(
        "/v1/reset",
        &json!({"policy": "login-user", "key": "alice"}),
    );
    assert_eq!(status, 204);
    assert_eq!(redis.dbsize(), 0);
    assert_eq!(q.check1("login-user", "alice")["remaining"], 4);
}

#[test]
fn peek_reports_without_consuming_or_writing() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&config(&redis));
    for p in ALGS {
        for _ in 0..3 {
            assert_eq!(remaining(&q, p, "peek-fresh"), 10, "{p}");
        }
    }
    assert_eq!(redis.dbsize(), 0, "a peek on a fresh key wrote to Redis");
    for p in ALGS {
        q.check1(p, "peek-used");
        assert_eq!(remaining(&q, p, "peek-used"), 9, "{p}");
        assert_eq!(remaining(&q, p, "peek-used"), 9, "{p}");
    }
}

#[test]
fn shadow_mode_allows_what_it_would_deny_and_counts_it() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&config(&redis));
    let outcomes: Vec<String> = (0..4)
        .map(|_| {
            let v = q.check1("watch", "w");
            assert_eq!(v["allowed"], true);
            v["outcome"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(outcomes, ["allowed", "allowed", "shadow", "shadow"]);
    assert_eq!(
        q.metric("quotad_decisions_total{outcome=\"shadow\",policy=\"watch\"}"),
        2.0
    );
}

#[test]
fn slowlog_shows_no_limiter_script_after_a_load() {
    let redis = RedisServer::start();
    // Runs in nextest's serial "heavy" group too, so a stall it finds is Redis's.
    redis.watch_slowlog();
    let q = Quotad::serve(&config(&redis));
    for i in 0..300 {
        for p in ALGS {
            let (status, _) =
                q.check(&json!({"policy": p, "key": format!("k{}", i % 7), "cost": 1 + i % 3}));
            assert_eq!(status, 200);
        }
    }
    let slow = redis.slow_scripts();
    assert!(slow.is_empty(), "SLOWLOG holds limiter scripts: {slow:?}");
    redis.assert_every_key_has_ttl();
}

#[test]
fn policies_endpoint_and_metric_catalogue() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&config(&redis));
    let (status, text) = q.get("/v1/policies");
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let tb = v["policies"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "tb")
        .unwrap();
    assert_eq!(tb["algorithm"], "token_bucket");
    assert_eq!(tb["limit"], 10);
    assert_eq!(tb["window_ms"], 3_600_000);
    assert_eq!(tb["effective_limit"], 10);
    q.check1("fw", "m");
    let (status, metrics) = q.get("/metrics");
    assert_eq!(status, 200);
    for name in [
        "quotad_decisions_total{outcome=\"allowed\",policy=\"fw\"} 1",
        "quotad_check_duration_seconds_bucket",
        "quotad_store_errors_total{kind=\"timeout\"} 0",
        "quotad_store_up 1",
        "quotad_script_loads_total 8", // five algorithms, the composite, settle and concurrency scripts
        "quotad_build_info{revision=",
    ] {
        assert!(metrics.contains(name), "/metrics lacks {name}");
    }
    assert!(!metrics.contains("key=\""), "a metric carries a user key");
    assert_eq!(q.get("/healthz").0, 200);
    assert_eq!(q.get("/readyz").0, 200);
}

/// A config change under live keys: a longer window must not strand old state ahead of the
/// new window (it would be denied for years), and a lowered limit must deny, not error.
#[test]
fn config_changes_under_live_keys_stay_enforced() {
    let redis = RedisServer::start();
    let cfg = |limit: u64, window: &str| {
        Config::redis(&redis.url())
            .policy(Policy::new("p", "fixed_window", limit, window))
            .policy(Policy::new("s", "sliding_window", limit, window))
            .to_toml()
    };
    {
        let q = Quotad::serve(&cfg(100, "1m"));
        for p in ["p", "s"] {
            q.check(&json!({"policy": p, "key": "k", "cost": 50}));
        }
    }
    {
        // Lowered limit, same window: over the new limit already, so denied with 0 left.
        let q = Quotad::serve(&cfg(10, "1m"));
        for p in ["p", "s"] {
            let v = q.check1(p, "k");
            assert_eq!(
                (v["outcome"].as_str(), v["remaining"].as_u64()),
                (Some("denied"), Some(0)),
                "{p}: {v}"
            );
        }
    }
    {
        // Longer window: the old minute-slot state is discarded, not kept for years.
        let q = Quotad::serve(&cfg(100, "1h"));
        for p in ["p", "s"] {
            let v = q.check1(p, "k");
            assert_eq!(v["outcome"], "allowed", "{p}: {v}");
            assert!(
                v["reset_after_ms"].as_u64().unwrap() <= 2 * 3_600_000,
                "{p}: {v}"
            );
        }
    }
    redis.assert_every_key_has_ttl();
}
