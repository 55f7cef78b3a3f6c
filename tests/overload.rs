//! Overload is not an outage: when more requests arrive than quotad lets reach Redis at
//! once, the excess is shed with 503 `overloaded` and `Retry-After`, counted, and charges
//! nothing; every answered decision is still enforced by the store, and the circuit
//! breaker stays closed because Redis is healthy.
//!
//! In-process daemons (`Quotad::serve`): the clients are threads of this process, the
//! daemon runs on its own runtime beside them; nothing here needs a process boundary.

use quotad_testkit as common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::{Config, Policy, Quotad, RedisServer, header, http};
use serde_json::json;

/// One call to Redis at a time and no queue: any request that arrives while another is in
/// flight is shed. Window algorithms over an hour, so that what a key spent reads back
/// exactly (nothing refills during the test). What is tested is shedding, not Redis's
/// latency: store calls get 2 s, so that a call slowed by the busy machine (over the
/// default 50 ms) is not a timeout answered in the policy's fail mode.
fn config(redis: &RedisServer) -> String {
    Config::redis(&redis.url())
        .store("timeout", "2s")
        .store("max_in_flight", 1)
        .store("max_queued", 0)
        .policy(Policy::new("open", "sliding_log", 10000, "1h").on_store_error("open"))
        .policy(Policy::new("closed", "sliding_window", 100000, "1h").on_store_error("closed"))
        .to_toml()
}

#[test]
fn excess_load_is_shed_with_503_and_charges_nothing_while_answers_stay_enforced() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&config(&redis));
    let (answered, shed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let threads: Vec<_> = (0..16)
        .map(|t| {
            let (port, answered, shed) = (q.port, answered.clone(), shed.clone());
            std::thread::spawn(move || {
                for i in 0..40 {
                    // Singles on one key per policy, and batches over both.
                    let body = match i % 3 {
                        0 => json!({"policy": "open", "key": "hot"}),
                        1 => json!({"policy": "closed", "key": "hot"}),
                        _ => json!({"checks": [{"policy": "open", "key": "hot"},
                                               {"policy": "closed", "key": "hot"}]}),
                    };
                    let (status, headers, text) = http(
                        port,
                        "POST",
                        "/v1/check",
                        Some("application/json"),
                        &body.to_string(),
                    )
                    .expect("an answer");
                    let v: serde_json::Value = serde_json::from_str(&text).expect("JSON");
                    match status {
                        200 => {
                            let outcomes: Vec<&str> = match v["results"].as_array() {
                                Some(rs) => {
                                    rs.iter().map(|r| r["outcome"].as_str().unwrap()).collect()
                                }
                                None => vec![v["outcome"].as_str().unwrap()],
                            };
                            assert!(
                                outcomes.iter().all(|o| *o == "allowed"),
                                "thread {t}: an answered decision was not enforced: {v}"
                            );
                            answered.fetch_add(outcomes.len() as u64, Ordering::Relaxed);
                        }
                        503 => {
                            assert_eq!(v["error"]["code"], "overloaded", "{v}");
                            assert_eq!(header(&headers, "retry-after"), Some("1"));
                            shed.fetch_add(1, Ordering::Relaxed);
                        }
                        other => panic!("thread {t}: status {other}: {v}"),
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("client thread");
    }
    let (answered, shed) = (
        answered.load(Ordering::Relaxed),
        shed.load(Ordering::Relaxed),
    );
    eprintln!("answered {answered} checks, shed {shed} requests");
    assert!(
        shed > 0,
        "16 concurrent clients against one permit: some must be shed"
    );
    assert!(answered > 0);
    let counted = q.metric("quotad_shed_total{reason=\"queue_full\"}")
        + q.metric("quotad_shed_total{reason=\"queue_timeout\"}");
    assert_eq!(counted, shed as f64, "every shed request is counted");
    assert_eq!(q.metric("quotad_store_breaker_opens_total"), 0.0);
    assert_eq!(q.metric("quotad_store_errors_total{kind=\"timeout\"}"), 0.0);
    for p in ["open", "closed"] {
        for o in ["fail_open", "fail_closed"] {
            let series = format!("quotad_decisions_total{{outcome=\"{o}\",policy=\"{p}\"}}");
            assert_eq!(q.metric(&series), 0.0, "{series}");
        }
    }
    assert_eq!(q.get("/readyz").0, 200);

    // Shed requests charged nothing: what the keys spent is exactly what was admitted.
    let peek = |policy: &str| {
        let v = common::wait_for("a peek that is not shed", Duration::from_secs(5), || {
            let (s, v) = q.check(&json!({"policy": policy, "key": "hot", "cost": 0}));
            (s == 200).then_some(v)
        });
        v["limit"].as_u64().unwrap() - v["remaining"].as_u64().unwrap()
    };
    let spent = peek("open") + peek("closed");
    assert_eq!(
        spent, answered,
        "units charged by the store vs checks answered"
    );
    redis.assert_every_key_has_ttl();
}

/// The embedded store is bounded: at `store.memory_max_keys` a check that would add a key
/// is answered by its policy's fail mode (counted as a store error of kind `full`) and
/// stores nothing; keys already held are enforced as before.
#[test]
fn the_embedded_store_refuses_new_keys_at_its_bound_and_keeps_enforcing_held_ones() {
    let q = Quotad::serve(
        &Config::redis("memory")
            .store("memory_max_keys", 1000)
            .policy(Policy::new("closed", "sliding_log", 2, "1h").on_store_error("closed"))
            .policy(Policy::new("open", "fixed_window", 2, "1h").on_store_error("open"))
            .to_toml(),
    );
    for i in 0..1000 {
        assert_eq!(
            q.check1("closed", &format!("k{i}"))["outcome"],
            "allowed",
            "k{i}"
        );
    }
    let v = q.check1("closed", "one-too-many");
    assert_eq!(
        (v["allowed"].as_bool(), v["outcome"].as_str()),
        (Some(false), Some("fail_closed")),
        "{v}"
    );
    assert_eq!(q.check1("open", "one-too-many")["outcome"], "fail_open");
    assert_eq!(q.metric("quotad_store_errors_total{kind=\"full\"}"), 2.0);
    // Held keys: enforced, to the limit.
    assert_eq!(q.check1("closed", "k7")["outcome"], "allowed");
    assert_eq!(q.check1("closed", "k7")["outcome"], "denied");
    // A reset frees a key's room.
    let (status, _, _) = q.post("/v1/reset", &json!({"policy": "closed", "key": "k1"}));
    assert_eq!(status, 204);
    assert_eq!(q.check1("closed", "new-key")["outcome"], "allowed");
    assert_eq!(q.check1("closed", "another")["outcome"], "fail_closed");
}
