//! Concurrency limits: `POST /v1/acquire` holds units of a key until `/v1/release`, or
//! until the lease ends by the store's clock; `/v1/extend` moves its end. An acquire is a
//! decision with RateLimit headers and the fail modes of any policy; bad requests are
//! named 4xx that change nothing. (tests/atomicity.rs holds the four-process run: 500
//! acquires at a limit of 50, and holders killed.)
//!
//! In-process daemons (`Quotad::serve`) on real Redis, and on the embedded store.

use quotad_testkit as common;

use std::time::Duration;

use common::{Config, Policy, Quotad, RedisServer, header, http, wait_for};
use serde_json::{Value, json};

/// 3 units at once, leases of a minute at most; and a rate policy.
fn policies(config: Config, on_store_error: &str) -> String {
    config
        .policy(Policy::new("streams", "concurrency", 3, "1m").on_store_error(on_store_error))
        .policy(Policy::new("api", "token_bucket", 10, "1s"))
        .to_toml()
}

fn post(q: &Quotad, path: &str, body: Value) -> (u16, Vec<(String, String)>, Value) {
    q.post(path, &body)
}

fn acquire(q: &Quotad, key: &str, units: u64) -> Value {
    let (status, _, v) = post(
        q,
        "/v1/acquire",
        json!({"policy": "streams", "key": key, "units": units}),
    );
    assert_eq!(status, 200, "{v}");
    v
}

fn lease_call(q: &Quotad, path: &str, key: &str, lease: &Value) -> (u16, Value) {
    let (status, _, v) = post(
        q,
        path,
        json!({"policy": "streams", "key": key, "lease": lease}),
    );
    (status, v)
}

/// On Redis and on the embedded store alike: 2 + 1 of 3 fit, a third unit does not (it
/// is told when the first lease ends), a release frees its units at once, a lease
/// released or never made is a 404.
#[test]
fn at_most_the_limit_is_held_and_a_release_frees_it_at_once() {
    let redis = RedisServer::start();
    for config in [Config::redis(&redis.url()), Config::new()] {
        let q = Quotad::serve(&policies(config, "closed"));
        let a = acquire(&q, "k", 2);
        assert_eq!(
            (a["outcome"].as_str(), a["held"].as_u64()),
            (Some("allowed"), Some(2)),
            "{a}"
        );
        assert_eq!(a["expires_in_ms"], 60_000);
        let b = acquire(&q, "k", 1);
        assert_eq!(b["remaining"], 0, "{b}");
        let (_, headers, c) = post(&q, "/v1/acquire", json!({"policy": "streams", "key": "k"}));
        assert_eq!(
            (c["outcome"].as_str(), c["allowed"].as_bool()),
            (Some("denied"), Some(false))
        );
        assert!(c.get("lease").is_none(), "{c}");
        let retry = c["retry_after_ms"].as_u64().unwrap();
        assert!(
            (59_000..=60_000).contains(&retry),
            "until the first lease ends: {c}"
        );
        assert_eq!(header(&headers, "ratelimit-remaining"), Some("0"));
        assert!(
            header(&headers, "ratelimit-policy")
                .is_some_and(|p| p.starts_with("\"streams\";q=3;pk="))
        );
        assert_eq!(header(&headers, "retry-after"), Some("60"));
        let (status, r) = lease_call(&q, "/v1/release", "k", &a["lease"]);
        assert_eq!((status, r["held"].as_u64()), (200, Some(1)), "{r}");
        assert_eq!(
            acquire(&q, "k", 2)["outcome"],
            "allowed",
            "released units are free at once"
        );
        let (status, again) = lease_call(&q, "/v1/release", "k", &a["lease"]);
        assert_eq!(
            (status, again["error"]["code"].as_str()),
            (404, Some("unknown_lease"))
        );
        // Another key's lease is not this key's.
        let (status, _) = lease_call(&q, "/v1/release", "other", &b["lease"]);
        assert_eq!(status, 404);
        assert_eq!(
            acquire(&q, "k", 1)["outcome"],
            "denied",
            "nothing was released"
        );
        // A lease named with another unit count than it was issued with is no lease of
        // the key's: released or extended, a 404 that changes nothing.
        let two = acquire(&q, "m", 2)["lease"].as_str().unwrap().to_owned();
        for edited in [two.replace("-2", "-3"), two.replace("-2", "-1")] {
            for path in ["/v1/release", "/v1/extend"] {
                let (status, r) = lease_call(&q, path, "m", &json!(edited));
                assert_eq!(
                    (status, r["error"]["code"].as_str()),
                    (404, Some("unknown_lease")),
                    "{path} {edited}: {r}"
                );
            }
        }
        assert_eq!(acquire(&q, "m", 2)["outcome"], "denied", "still 2 held");
        let (status, r) = lease_call(&q, "/v1/release", "m", &json!(two));
        assert_eq!((status, r["held"].as_u64()), (200, Some(0)), "{r}");
        let released = "quotad_lease_units_total{event=\"released\",policy=\"streams\"}";
        assert_eq!(q.metric(released), 2.0 + 2.0, "{r}");
    }
    redis.assert_every_key_has_ttl();
}

/// A limit lowered under a lease: the holder can still release and extend it as it was
/// issued (the release and extend answered `400` when the lease had more units than the
/// new limit, and the units stayed held until the lease ended), and new acquires wait for
/// the new limit.
#[test]
fn a_lease_issued_under_a_higher_limit_is_released_after_a_lowering() {
    let redis = RedisServer::start();
    let config = |limit: u64| {
        Config::redis(&redis.url())
            .policy(Policy::new("streams", "concurrency", limit, "1m"))
            .to_toml()
    };
    let q = Quotad::start(&config(10));
    let five = acquire(&q, "k", 5);
    assert_eq!(five["outcome"], "allowed", "{five}");
    assert_eq!(q.reload(&q.config_file_text(&config(3))), "ok");
    let (status, _, denied) = post(
        &q,
        "/v1/acquire",
        json!({"policy": "streams", "key": "k", "units": 1}),
    );
    assert_eq!((status, denied["outcome"].as_str()), (200, Some("denied")));
    let (status, r) = lease_call(&q, "/v1/extend", "k", &five["lease"]);
    assert_eq!((status, r["held"].as_u64()), (200, Some(5)), "{r}");
    let (status, r) = lease_call(&q, "/v1/release", "k", &five["lease"]);
    assert_eq!((status, r["held"].as_u64()), (200, Some(0)), "{r}");
    assert_eq!(acquire(&q, "k", 3)["outcome"], "allowed");
}

/// A lease ends at its hold unless extended; extended, it outlives that end; an extend
/// of a lease that has ended is a 404 (it holds nothing to extend).
#[test]
fn a_lease_ends_at_its_hold_unless_extended() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&policies(Config::redis(&redis.url()), "closed"));
    let hold = |key: &str, ms: u64| {
        let (_, _, v) = post(
            &q,
            "/v1/acquire",
            json!({"policy": "streams", "key": key, "units": 3, "hold_ms": ms}),
        );
        assert_eq!(v["expires_in_ms"], ms, "{v}");
        v
    };
    let extend = |key: &str, lease: &Value| {
        let body = json!({"policy": "streams", "key": key, "lease": lease, "hold_ms": 60_000});
        let (status, _, v) = post(&q, "/v1/extend", body);
        (status, v)
    };
    // Extended with most of its second still to run, even on a loaded machine.
    let kept = hold("kept", 1_000);
    let (status, v) = extend("kept", &kept["lease"]);
    assert_eq!(
        (status, v["status"].as_str()),
        (200, Some("extended")),
        "{v}"
    );
    // Acquired after `kept`, for as long: once it has ended, so has kept's first hold.
    let short = hold("short", 1_000);
    wait_for("the short lease's end", Duration::from_secs(5), || {
        (acquire(&q, "short", 1)["outcome"] == "allowed").then_some(())
    });
    assert_eq!(
        acquire(&q, "kept", 1)["outcome"],
        "denied",
        "the extended lease ended"
    );
    let expired = "quotad_lease_units_total{event=\"expired\",policy=\"streams\"}";
    assert_eq!(
        q.metric(expired),
        3.0,
        "the short lease's units, counted once"
    );
    let (status, v) = extend("short", &short["lease"]);
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (404, Some("unknown_lease")),
        "{v}"
    );
}

/// A lease nobody releases is counted `expired` when it ends, though nothing touches its
/// key again (the acquiring instance reads the key then); a released one is not.
#[test]
fn a_lease_that_ends_unreleased_is_counted_expired_at_its_end() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&policies(Config::redis(&redis.url()), "closed"));
    let expired = "quotad_lease_units_total{event=\"expired\",policy=\"streams\"}";
    let body = |key: &str, units: u64| json!({"policy": "streams", "key": key, "units": units, "hold_ms": 200});
    let (_, _, kept) = post(&q, "/v1/acquire", body("forgotten", 2));
    assert_eq!(kept["outcome"], "allowed");
    let (_, _, released) = post(&q, "/v1/acquire", body("returned", 1));
    let (status, _) = lease_call(&q, "/v1/release", "returned", &released["lease"]);
    assert_eq!(status, 200);
    wait_for(
        "the forgotten lease counted",
        Duration::from_secs(5),
        || (q.metric(expired) > 0.0).then_some(()),
    );
    assert_eq!(
        q.metric(expired),
        2.0,
        "the forgotten lease's 2 units, once"
    );
    assert_eq!(q.metric("quotad_leases_tracked"), 0.0);
}

/// A reset of a concurrency limit's key gives back every lease it holds (slots a holder
/// will never release, freed before their leases end), counted `released`; the leases'
/// holders are told so until their leases would have ended: a release is `200`
/// `ended_by_reset` that frees nothing more, an extend `404 ended_by_reset`.
#[test]
fn a_reset_frees_every_slot_of_the_key() {
    let redis = RedisServer::start();
    for config in [Config::redis(&redis.url()), Config::new()] {
        let q = Quotad::serve(&policies(config, "closed"));
        let a = acquire(&q, "k", 2);
        acquire(&q, "k", 1);
        acquire(&q, "other", 1);
        let (status, _, _) = post(&q, "/v1/reset", json!({"policy": "streams", "key": "k"}));
        assert_eq!(status, 204);
        let released = "quotad_lease_units_total{event=\"released\",policy=\"streams\"}";
        assert_eq!(q.metric(released), 3.0);
        assert_eq!(acquire(&q, "k", 3)["outcome"], "allowed", "every slot free");
        let (status, r) = lease_call(&q, "/v1/release", "k", &a["lease"]);
        assert_eq!(
            (status, r["status"].as_str()),
            (200, Some("ended_by_reset")),
            "{r}"
        );
        assert_eq!(
            r["held"], 3,
            "the units acquired after the reset stay held: {r}"
        );
        let (status, r) = lease_call(&q, "/v1/extend", "k", &a["lease"]);
        assert_eq!(
            (status, r["error"]["code"].as_str()),
            (404, Some("ended_by_reset")),
            "{r}"
        );
        assert_eq!(q.metric(released), 3.0, "nothing more released");
        assert_eq!(
            acquire(&q, "other", 3)["outcome"],
            "denied",
            "another key kept its lease"
        );
    }
}

/// Redis hung: `closed` denies, `open` admits without a lease (nothing to release),
/// `local` acquires in the daemon's own store, and that lease is released there. A
/// release of a Redis lease is a 503 that changed nothing.
#[test]
fn without_the_store_each_fail_mode_answers_an_acquire() {
    let redis = RedisServer::start();
    let config = Config::redis(&redis.url())
        .store("timeout", "20ms")
        .policy(Policy::new("c", "concurrency", 3, "1m").on_store_error("closed"))
        .policy(Policy::new("o", "concurrency", 3, "1m").on_store_error("open"))
        .policy(Policy::new("l", "concurrency", 1, "1m").on_store_error("local"))
        .to_toml();
    let q = Quotad::serve(&config);
    let on = |p: &str| json!({"policy": p, "key": "k"});
    let (_, _, held) = post(&q, "/v1/acquire", on("c"));
    redis.signal("-STOP");
    let (_, _, c) = post(&q, "/v1/acquire", on("c"));
    assert_eq!(
        (c["outcome"].as_str(), c["retry_after_ms"].as_u64()),
        (Some("fail_closed"), Some(1000))
    );
    let (_, _, o) = post(&q, "/v1/acquire", on("o"));
    assert_eq!(o["outcome"], "fail_open", "{o}");
    assert!(o.get("lease").is_none(), "{o}");
    let (_, _, l) = post(&q, "/v1/acquire", on("l"));
    assert_eq!(l["outcome"], "local", "{l}");
    assert!(
        l["lease"].as_str().is_some_and(|s| s.starts_with("local-")),
        "{l}"
    );
    let (_, _, l2) = post(&q, "/v1/acquire", on("l"));
    assert_eq!(
        l2["outcome"], "denied",
        "the local store holds its limit: {l2}"
    );
    let (status, v) = {
        let (s, _, v) = post(
            &q,
            "/v1/release",
            json!({"policy": "l", "key": "k", "lease": l["lease"]}),
        );
        (s, v)
    };
    assert_eq!(
        status, 200,
        "a local lease is released where it is held: {v}"
    );
    let (status, _, v) = post(
        &q,
        "/v1/release",
        json!({"policy": "c", "key": "k", "lease": held["lease"]}),
    );
    // Sent and unanswered: the outcome is unknown, and the answer says so; not sent (the
    // breaker opened after the acquires timed out): nothing was done.
    let code = v["error"]["code"].as_str().unwrap_or_default().to_owned();
    assert_eq!(status, 503, "{v}");
    assert!(
        code == "outcome_unknown" || code == "store_unavailable",
        "{v}"
    );
    redis.signal("-CONT");
    // A timed-out release may have reached Redis and been done once it woke: a retry
    // answers 200, or 404 for a lease released already. Either way the units are free.
    let status = wait_for("the store back", Duration::from_secs(10), || {
        let body = json!({"policy": "c", "key": "k", "lease": held["lease"]});
        let (s, _, _) = post(&q, "/v1/release", body);
        (s != 503).then_some(s)
    });
    match code.as_str() {
        "outcome_unknown" => assert!(status == 200 || status == 404, "{status}"),
        _ => assert_eq!(status, 200, "nothing was done: the lease was still held"),
    }
    // The acquire that timed out (answered fail_closed) may have been done too: its lease,
    // whose id nobody has, holds 1 unit until it ends. The other 2 are free.
    let two = json!({"policy": "c", "key": "k", "units": 2});
    assert_eq!(post(&q, "/v1/acquire", two).2["outcome"], "allowed");
}

/// Every bad lease request is a 4xx naming its field, and writes nothing.
#[test]
fn bad_lease_requests_are_named_4xx_and_change_nothing() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&policies(Config::redis(&redis.url()), "closed"));
    let a = acquire(&q, "k", 1);
    let lease = a["lease"].as_str().unwrap().to_owned();
    let hex = &lease[..32];
    let dump = || -> Vec<u8> {
        redis::cmd("DUMP")
            .arg("rl:streams:cc:{k}")
            .query(&mut redis.conn())
            .unwrap()
    };
    let before = (redis.dbsize(), dump());
    let cases: Vec<(&str, &str, String, u16, &str)> = vec![
        (
            "/v1/acquire",
            "no units",
            r#"{"policy":"streams","key":"k","units":0}"#.into(),
            400,
            "units",
        ),
        (
            "/v1/acquire",
            "over the limit",
            r#"{"policy":"streams","key":"k","units":4}"#.into(),
            400,
            "units",
        ),
        (
            "/v1/acquire",
            "a hold of 0",
            r#"{"policy":"streams","key":"k","hold_ms":0}"#.into(),
            400,
            "hold_ms",
        ),
        (
            "/v1/acquire",
            "a hold past the lease",
            r#"{"policy":"streams","key":"k","hold_ms":60001}"#.into(),
            400,
            "hold_ms",
        ),
        (
            "/v1/acquire",
            "an unknown field",
            r#"{"policy":"streams","key":"k","cost":1}"#.into(),
            400,
            "cost",
        ),
        (
            "/v1/acquire",
            "a rate policy",
            r#"{"policy":"api","key":"k"}"#.into(),
            400,
            "policy",
        ),
        (
            "/v1/acquire",
            "no such policy",
            r#"{"policy":"nope","key":"k"}"#.into(),
            404,
            "policy",
        ),
        (
            "/v1/acquire",
            "no key",
            r#"{"policy":"streams"}"#.into(),
            400,
            "key",
        ),
        (
            "/v1/check",
            "a check of a concurrency limit",
            r#"{"policy":"streams","key":"k"}"#.into(),
            400,
            "policy",
        ),
        (
            "/v1/release",
            "no lease",
            r#"{"policy":"streams","key":"k"}"#.into(),
            400,
            "lease",
        ),
        (
            "/v1/release",
            // (It could have been issued under a higher limit: the store says it is not.)
            "a lease of 4 units, above the limit",
            format!(r#"{{"policy":"streams","key":"k","lease":"{hex}-4"}}"#),
            404,
            "lease",
        ),
        (
            "/v1/release",
            "a lease of more units than any lease may have",
            format!(r#"{{"policy":"streams","key":"k","lease":"{hex}-10001"}}"#),
            400,
            "lease",
        ),
        (
            "/v1/release",
            "a lease with a brace",
            format!(
                r#"{{"policy":"streams","key":"k","lease":"{}}}-1"}}"#,
                &hex[1..]
            ),
            400,
            "lease",
        ),
        (
            "/v1/release",
            "a hold on a release",
            format!(r#"{{"policy":"streams","key":"k","lease":"{lease}","hold_ms":5}}"#),
            400,
            "hold_ms",
        ),
        (
            "/v1/release",
            "a lease nobody holds",
            format!(
                r#"{{"policy":"streams","key":"k","lease":"{}-1"}}"#,
                "0".repeat(32)
            ),
            404,
            "lease",
        ),
        (
            "/v1/release",
            "fewer units than held",
            format!(r#"{{"policy":"streams","key":"j","lease":"{hex}-1"}}"#),
            404,
            "lease",
        ),
        (
            "/v1/extend",
            "a hold past the lease",
            format!(r#"{{"policy":"streams","key":"k","lease":"{lease}","hold_ms":60001}}"#),
            400,
            "hold_ms",
        ),
        (
            "/v1/extend",
            "a lease nobody holds",
            format!(
                r#"{{"policy":"streams","key":"k","lease":"{}-1"}}"#,
                "0".repeat(32)
            ),
            404,
            "lease",
        ),
    ];
    for (path, name, body, status, field) in cases {
        let (got, _, text) = http(q.port, "POST", path, Some("application/json"), &body).unwrap();
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{name}: {text}"));
        assert_eq!(got, status, "{name}: {text}");
        assert_eq!(v["error"]["field"], field, "{name}: {text}");
    }
    let (status, _, text) = common::request(q.port, "GET", "/v1/authz/streams", &[], "").unwrap();
    assert_eq!(status, 400, "forward-auth of a concurrency limit: {text}");
    assert!(text.contains("cannot release"), "{text}");
    assert_eq!(
        (redis.dbsize(), dump()),
        before,
        "a refused request changed the store"
    );
    let (status, _) = lease_call(&q, "/v1/release", "k", &json!(lease));
    assert_eq!(status, 200, "and the lease still releases");
}
