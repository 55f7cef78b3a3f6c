//! Runtime limits (`/v1/limits/{policy}/{key}`): a key's own limit set by an admin at
//! runtime, kept in the region's Redis, and applied by every instance: at once through
//! the change messages, and by the resync when a message was missed or an instance is new.
//! Real daemons on one real Redis.

use quotad_testkit as common;

use std::time::{Duration, Instant};

use common::{Config, Policy, Quotad, RedisServer, request, wait_for};
use serde_json::{Value, json};

/// `api`: 3 an hour, fixed window, up to `max_keys` keys with their own limit.
fn config(redis: &RedisServer, max_keys: u64) -> String {
    Config::redis(&redis.url())
        .policy(Policy::new("api", "fixed_window", 3, "1h").runtime_limits(max_keys))
        .policy(Policy::new("plain", "fixed_window", 3, "1h"))
        .to_toml()
}

/// A peek: the numbers `key` is decided under here, without spending.
fn peek(q: &Quotad, key: &str) -> Value {
    let (status, body) = q.check(&json!({"policy": "api", "key": key, "cost": 0}));
    assert_eq!(status, 200, "{body}");
    body
}

fn spend(q: &Quotad, key: &str) -> Value {
    q.check1("api", key)
}

/// Polls `q` until `key` is decided under `limit` from `source`; how long it took.
fn until_applied(q: &Quotad, key: &str, limit: u64, source: &str) -> Duration {
    let start = Instant::now();
    wait_for(
        &format!("{key} at {limit} from {source} on :{}", q.port),
        Duration::from_secs(10),
        || {
            let d = peek(q, key);
            (d["limit"] == limit && d["limit_source"] == source).then_some(())
        },
    );
    start.elapsed()
}

/// A change through one instance is applied by every other one from the channel, without
/// waiting for the resync; the key keeps what it used (the transition rule): 2 spent under
/// the config's 3 leave 8 of a runtime 10, then 0 of a runtime 1, and deleting it brings
/// the config's 3 back, with 1 left.
#[test]
fn a_runtime_limit_set_through_one_instance_applies_on_every_instance() {
    let redis = RedisServer::start();
    let text = config(&redis, 100);
    let qs: Vec<Quotad> = (0..3).map(|_| Quotad::start(&text)).collect();
    for q in &qs {
        until_applied(q, "customer-42", 3, "config");
    }
    spend(&qs[1], "customer-42");
    spend(&qs[2], "customer-42");
    let (status, body) = qs[0].admin(
        "PUT",
        "/v1/limits/api/customer-42",
        Some(&json!({"limit": 10})),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        (&body["limit"], &body["previous"]),
        (&json!(10), &Value::Null),
        "{body}"
    );
    // Counted, and in the audit log: who, on which policy, the key's hash, old and new.
    assert_eq!(
        qs[0].metric(r#"quotad_admin_requests_total{action="limit_set",result="done"}"#),
        1.0
    );
    let log = qs[0].log();
    let line = log
        .lines()
        .find(|l| l.contains("admin request") && l.contains("limit_set"))
        .unwrap_or_else(|| panic!("no audit line:\n{log}"));
    assert!(
        line.contains("token=tests")
            && line.contains("key_sha256=")
            && !line.contains("customer-42")
            && line.contains("none")
            && line.contains("limit=10"),
        "{line}"
    );
    // The writer at once; the others from the channel.
    let d = peek(&qs[0], "customer-42");
    assert_eq!(
        (&d["limit"], &d["limit_source"]),
        (&json!(10), &json!("runtime")),
        "{d}"
    );
    let mut took = Vec::new();
    for q in &qs[1..] {
        took.push(until_applied(q, "customer-42", 10, "runtime"));
    }
    eprintln!("applied elsewhere after {took:?}");
    assert_eq!(
        spend(&qs[1], "customer-42")["remaining"],
        7,
        "2 used carried over"
    );
    // Lowered below what was used: nothing left, on every instance.
    let (status, body) = qs[2].admin(
        "PUT",
        "/v1/limits/api/customer-42",
        Some(&json!({"limit": 1})),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["previous"]["limit"], 10);
    for q in &qs {
        until_applied(q, "customer-42", 1, "runtime");
        let d = spend(q, "customer-42");
        assert_eq!(
            (&d["allowed"], &d["remaining"]),
            (&json!(false), &json!(0)),
            "{d}"
        );
    }
    // Another key keeps the policy's numbers.
    assert_eq!(peek(&qs[0], "customer-7")["limit_source"], "config");
    // Deleted: the config's 3, with the 3 used counted.
    let (status, body) = qs[1].admin("DELETE", "/v1/limits/api/customer-42", None);
    assert_eq!((status, &body["deleted"]), (200, &json!(true)), "{body}");
    for q in &qs {
        until_applied(q, "customer-42", 3, "config");
        assert_eq!(spend(q, "customer-42")["allowed"], false);
    }
    let (status, body) = qs[0].admin("GET", "/v1/limits/api/customer-42", None);
    assert_eq!(
        (status, &body["error"]["code"]),
        (404, &json!("no_runtime_limit"))
    );
    let applied = qs[1].metric("quotad_runtime_limit_propagation_seconds_count");
    // The two changes made elsewhere, and its own delete when its message came before
    // its own write applied it.
    assert!(
        (2.0..=3.0).contains(&applied),
        "changes from the channel are timed as they arrive: {applied}"
    );
}

/// A denied key remembered by an instance's deny cache sees a changed runtime limit at its
/// next check there: the change ends the remembered denial. Lowered, the key stays denied,
/// now under the new numbers (not the remembered answer's); raised, it is admitted.
#[test]
fn a_raised_runtime_limit_ends_a_remembered_denial_on_every_instance() {
    let redis = RedisServer::start();
    let text = config(&redis, 100);
    let (a, b) = (Quotad::start(&text), Quotad::start(&text));
    for _ in 0..3 {
        spend(&b, "busy");
    }
    for _ in 0..3 {
        assert_eq!(
            spend(&b, "busy")["allowed"],
            false,
            "denied, and remembered"
        );
    }
    let (status, _) = a.admin("PUT", "/v1/limits/api/busy", Some(&json!({"limit": 2})));
    assert_eq!(status, 200);
    until_applied(&b, "busy", 2, "runtime");
    let d = spend(&b, "busy");
    assert_eq!(
        (&d["allowed"], &d["limit"], &d["limit_source"]),
        (&json!(false), &json!(2), &json!("runtime")),
        "lowered: denied under the new numbers, not from memory: {d}"
    );
    let (status, _) = a.admin("PUT", "/v1/limits/api/busy", Some(&json!({"limit": 5})));
    assert_eq!(status, 200);
    until_applied(&b, "busy", 5, "runtime");
    let d = spend(&b, "busy");
    assert_eq!(
        (&d["allowed"], &d["remaining"]),
        (&json!(true), &json!(1)),
        "{d}"
    );
}

/// What a message cannot repair, the resync does: an entry written to Redis without its
/// message (as a lost message leaves it), and an instance started after the writes, both
/// have every key's limit within the resync's round; the restarted one is not ready until
/// it has read them.
#[test]
fn a_missed_change_and_a_restart_are_repaired_by_the_resync() {
    let redis = RedisServer::start();
    let text = config(&redis, 100);
    let mut a = Quotad::start(&text);
    let (status, _) = a.admin("PUT", "/v1/limits/api/gold", Some(&json!({"limit": 20})));
    assert_eq!(status, 200);
    // Written behind every instance's back: no message.
    let mut conn = redis.conn();
    let _: () = redis::pipe()
        .cmd("HSET")
        .arg("rl:api:limits:{api}:h")
        .arg("silver")
        .arg("7:0:0:1700000000000")
        .ignore()
        .cmd("INCR")
        .arg("rl:api:limits:{api}:v")
        .ignore()
        .query(&mut conn)
        .unwrap();
    until_applied(&a, "silver", 7, "runtime");
    assert!(a.metric("quotad_runtime_limit_resyncs_total") >= 1.0);
    a.restart();
    synced(&a);
    for (key, limit) in [("gold", 20), ("silver", 7)] {
        let d = peek(&a, key);
        assert_eq!(
            (&d["limit"], &d["limit_source"]),
            (&json!(limit), &json!("runtime")),
            "{key}: {d}"
        );
    }
    let b = Quotad::start(&text);
    synced(&b);
    assert_eq!(
        peek(&b, "gold")["limit"],
        20,
        "a new instance reads them before it is ready"
    );
}

/// A trial: a runtime limit with an expiry ends on every instance at that time, and the
/// key's config numbers apply again.
#[test]
fn a_runtime_limit_ends_at_its_expiry() {
    let redis = RedisServer::start();
    let text = config(&redis, 100);
    let (a, b) = (Quotad::start(&text), Quotad::start(&text));
    let at = jiff::Timestamp::now() + jiff::SignedDuration::from_secs(2);
    let (status, body) = a.admin(
        "PUT",
        "/v1/limits/api/trial",
        Some(&json!({"limit": 50, "expires_at": at.to_string()})),
    );
    assert_eq!(status, 200, "{body}");
    until_applied(&b, "trial", 50, "runtime");
    for q in [&a, &b] {
        until_applied(q, "trial", 3, "config");
    }
    assert!(jiff::Timestamp::now() >= at, "not before its expiry");
    let (status, body) = a.admin("GET", "/v1/limits/api/trial", None);
    assert_eq!(status, 404, "{body}");
}

/// A listing pages through every key's limit, each once (nothing changes meanwhile).
#[test]
fn a_listing_pages_through_every_runtime_limit() {
    let redis = RedisServer::start();
    let q = Quotad::start(&config(&redis, 1000));
    for i in 0..250 {
        let (status, _) = q.admin(
            "PUT",
            &format!("/v1/limits/api/k{i}"),
            Some(&json!({"limit": 100 + i})),
        );
        assert_eq!(status, 200);
    }
    let mut seen = std::collections::BTreeMap::new();
    let mut cursor = String::new();
    loop {
        let (status, body) = q.admin(
            "GET",
            &format!("/v1/limits/api?count=100&cursor={cursor}"),
            None,
        );
        assert_eq!(status, 200, "{body}");
        for l in body["limits"].as_array().unwrap() {
            seen.insert(
                l["key"].as_str().unwrap().to_owned(),
                l["limit"].as_u64().unwrap(),
            );
        }
        match body["next_cursor"].as_str() {
            Some(c) => cursor = c.to_owned(),
            None => break,
        }
    }
    assert_eq!(seen.len(), 250);
    assert!(seen.iter().all(|(k, l)| *k == format!("k{}", l - 100)));
    wait_for(
        "the copy's size in the gauge",
        Duration::from_secs(5),
        || (q.metric(r#"quotad_runtime_limits{policy="api"}"#) == 250.0).then_some(()),
    );
}

/// Every bad write is a 4xx naming its field and changes nothing in Redis; a write
/// beyond the policy's `max_keys` is a 409; without the admin token, or with a check
/// caller's credentials, a 401.
#[test]
fn bad_runtime_limit_writes_change_nothing() {
    let redis = RedisServer::start();
    let q = Quotad::start(&config(&redis, 2));
    for k in ["a", "b"] {
        let (status, _) = q.admin(
            "PUT",
            &format!("/v1/limits/api/{k}"),
            Some(&json!({"limit": 5})),
        );
        assert_eq!(status, 200);
    }
    let mut conn = redis.conn();
    let dump = |conn: &mut redis::Connection| -> (i64, Vec<Option<Vec<u8>>>) {
        let keys = [
            "rl:api:limits:{api}:h",
            "rl:api:limits:{api}:v",
            "rl:api:limits:{api}:x",
            "rl:api:limits:{api}:d",
        ];
        let size: i64 = redis::cmd("DBSIZE").query(conn).unwrap();
        let dumps = keys
            .iter()
            .map(|k| redis::cmd("DUMP").arg(k).query(conn).unwrap())
            .collect();
        (size, dumps)
    };
    let before = dump(&mut conn);
    let past = (jiff::Timestamp::now() - jiff::SignedDuration::from_secs(60)).to_string();
    // One byte over `server.max_key_bytes` (512).
    let long_key = "k".repeat(513);
    let cases: Vec<(&str, String, Value, u16, &str)> = vec![
        (
            "PUT",
            "/v1/limits/api/a".into(),
            json!({"limit": 0}),
            400,
            "limit",
        ),
        (
            "PUT",
            "/v1/limits/api/a".into(),
            json!({"limit": -5}),
            400,
            "limit",
        ),
        (
            "PUT",
            "/v1/limits/api/a".into(),
            json!({"limit": 1.5}),
            400,
            "limit",
        ),
        (
            "PUT",
            "/v1/limits/api/a".into(),
            json!({"limit": 2_000_000_000u64}),
            400,
            "limit",
        ),
        (
            "PUT",
            "/v1/limits/api/a".into(),
            json!({"limt": 5}),
            400,
            "limt",
        ),
        (
            "PUT",
            "/v1/limits/api/a".into(),
            json!({"limit": 5, "burst": 9}),
            400,
            "burst",
        ),
        (
            "PUT",
            "/v1/limits/api/a".into(),
            json!({"limit": 5, "expires_at": past}),
            400,
            "expires_at",
        ),
        (
            "PUT",
            "/v1/limits/api/a".into(),
            json!({"limit": 5, "expires_at": "tomorrow"}),
            400,
            "expires_at",
        ),
        (
            "PUT",
            "/v1/limits/nope/a".into(),
            json!({"limit": 5}),
            404,
            "policy",
        ),
        (
            "PUT",
            "/v1/limits/plain/a".into(),
            json!({"limit": 5}),
            400,
            "policy",
        ),
        (
            "PUT",
            format!("/v1/limits/api/{long_key}"),
            json!({"limit": 5}),
            400,
            "key",
        ),
        (
            "PUT",
            "/v1/limits/api/c".into(),
            json!({"limit": 5}),
            409,
            "key",
        ),
        ("DELETE", "/v1/limits/api/c".into(), Value::Null, 404, "key"),
    ];
    for (method, path, body, want, field) in &cases {
        let body = (!body.is_null()).then_some(body);
        let (status, answer) = q.admin(method, path, body);
        assert_eq!(
            status,
            *want,
            "{method} {}: {answer}",
            &path[..path.len().min(60)]
        );
        assert_eq!(answer["error"]["field"], *field, "{answer}");
    }
    for headers in [
        vec![("content-type", "application/json")],
        vec![
            ("content-type", "application/json"),
            ("authorization", "Bearer not-the-token-0123456789"),
        ],
        vec![
            ("content-type", "application/json"),
            ("x-api-key", "customer-42"),
        ],
    ] {
        let (status, _, _) = request(
            q.port,
            "PUT",
            "/v1/limits/api/a",
            &headers,
            r#"{"limit": 500}"#,
        )
        .unwrap();
        assert_eq!(status, 401, "{headers:?}");
    }
    assert_eq!(dump(&mut conn), before, "nothing changed in Redis");
    // A refused change that named its policy and key is in the audit log as failed.
    let log = q.log();
    assert!(
        log.lines().any(|l| l.contains("admin request")
            && l.contains("limit_set")
            && l.contains("failed")),
        "no audit line of a refused change:\n{log}"
    );
    assert_eq!(peek(&q, "a")["limit"], 5);
}

/// On the embedded store the instance's copy is the store: the same API, one instance.
#[test]
fn runtime_limits_work_on_the_embedded_store() {
    let text = Config::redis("memory")
        .policy(Policy::new("api", "token_bucket", 10, "1m").runtime_limits(10))
        .to_toml();
    let q = Quotad::start(&text);
    let (status, body) = q.admin(
        "PUT",
        "/v1/limits/api/k",
        Some(&json!({"limit": 60, "burst": 100})),
    );
    assert_eq!(status, 200, "{body}");
    let d = peek(&q, "k");
    assert_eq!(
        (&d["limit"], &d["limit_source"]),
        (&json!(60), &json!("runtime")),
        "{d}"
    );
    assert_eq!(spend(&q, "k")["remaining"], 99, "the runtime burst");
    let (status, body) = q.admin("GET", "/v1/limits/api/k", None);
    assert_eq!((status, &body["burst"]), (200, &json!(100)), "{body}");
}

/// A hot key's slices meet a runtime limit: lowered below what was spent while one
/// instance holds slices, no instance admits anything (a slice answers only the numbers it
/// was taken under) and the denials are remembered; deleted, the config's limit is back
/// everywhere, and once the slices are back the key has exactly what was not admitted left.
#[test]
fn a_runtime_limit_lowered_on_a_hot_key_holds_on_every_instance() {
    use super::features_meet::{drive_until_held, remembered_denial};
    const LIMIT: u64 = 100_000;
    let redis = RedisServer::start();
    let text = Config::redis(&redis.url())
        .store("timeout", "2s")
        .policy(
            Policy::new("hot", "fixed_window", LIMIT, "1h")
                .set("hot_key_rate", 5)
                .runtime_limits(10),
        )
        .to_toml();
    let (a, b) = (Quotad::start(&text), Quotad::start(&text));
    let remaining = |q: &Quotad| {
        let v = q.check(&json!({"policy": "hot", "key": "k", "cost": 0})).1;
        v["remaining"].as_u64().unwrap_or_else(|| panic!("{v}"))
    };
    let held = |admitted: u64| LIMIT as i64 - remaining(&b) as i64 - admitted as i64;
    let (mut admitted, now_held) = drive_until_held(&a, "k", Duration::from_millis(1300), held);
    assert!(now_held > 0, "A held no slice");
    let spend = |q: &Quotad, n: usize| {
        (0..n)
            .filter(|_| q.check1("hot", "k")["allowed"] == true)
            .count() as u64
    };
    let (status, body) = b.admin("PUT", "/v1/limits/hot/k", Some(&json!({"limit": 100})));
    assert_eq!(status, 200, "{body}");
    for q in [&a, &b] {
        wait_for("the lowered limit", Duration::from_secs(5), || {
            (q.check(&json!({"policy": "hot", "key": "k", "cost": 0})).1["limit"] == 100)
                .then_some(())
        });
    }
    assert_eq!(
        spend(&a, 50) + spend(&b, 50),
        0,
        "under the lowered limit everywhere"
    );
    remembered_denial(&a, "hot", "k");
    let (status, _) = a.admin("DELETE", "/v1/limits/hot/k", None);
    assert_eq!(status, 200);
    for q in [&a, &b] {
        wait_for("the config's limit back", Duration::from_secs(5), || {
            let v = q.check1("hot", "k");
            (v["allowed"] == true).then_some(())
        });
        admitted += 1;
    }
    wait_for("the slices back", Duration::from_secs(10), || {
        (a.metric("quotad_hot_key_entries") == 0.0).then_some(())
    });
    wait_for("what was not admitted left", Duration::from_secs(5), || {
        (remaining(&b) == LIMIT - admitted).then_some(())
    });
}

/// A key in debt (a settlement far above its estimate) meets runtime limits: lowered, it
/// admits nothing on any instance and its wait grows, up to where the debt is paid at the
/// rate it was taken under (the transition rule: a state is at rest where its own numbers
/// put it, and no later reader's numbers make it last longer); raised above what it
/// counts, it admits again at once, everywhere.
#[test]
fn a_key_in_debt_keeps_its_debt_through_runtime_limit_changes() {
    let redis = RedisServer::start();
    let text = Config::redis(&redis.url())
        .policy(
            Policy::new("tokens", "fixed_window", 10, "1h")
                .set("settle_within", "1m")
                .runtime_limits(10),
        )
        .to_toml();
    let (a, b) = (Quotad::start(&text), Quotad::start(&text));
    let body = json!({"policy": "tokens", "key": "k", "cost": 1, "settle": true});
    let (status, _, r) = a.post("/v1/check", &body);
    assert_eq!(status, 200, "{r}");
    let settle =
        json!({"policy": "tokens", "key": "k", "reservation": r["reservation"], "cost": 25});
    let (status, _, s) = a.post("/v1/settle", &settle);
    assert_eq!(status, 200, "{s}");
    const HOUR_MS: u64 = 3_600_000;
    let retry = |q: &Quotad| {
        let v = q.check1("tokens", "k");
        assert_eq!(v["allowed"], false, "{v}");
        v["retry_after_ms"].as_u64().unwrap()
    };
    // 10 counted, 15 owed: the next window is full of it, and half the one after.
    let before = retry(&a);
    assert!((HOUR_MS..3 * HOUR_MS).contains(&before), "{before} ms");
    let (status, _) = b.admin("PUT", "/v1/limits/tokens/k", Some(&json!({"limit": 5})));
    assert_eq!(status, 200);
    for q in [&a, &b] {
        until_limit(q, "tokens", "k", 5);
        let wait = retry(q);
        assert!(
            wait > before && wait <= before + HOUR_MS + 60_000,
            "{wait} ms, {before} before"
        );
    }
    let (status, _) = a.admin("PUT", "/v1/limits/tokens/k", Some(&json!({"limit": 30})));
    assert_eq!(status, 200);
    for q in [&a, &b] {
        until_limit(q, "tokens", "k", 30);
        assert_eq!(q.check1("tokens", "k")["allowed"], true, "10 counted of 30");
    }
}

/// Until `q` is on Redis and has read the runtime limits (`/readyz`).
fn synced(q: &Quotad) {
    wait_for(
        "on Redis, runtime limits read",
        Duration::from_secs(10),
        || {
            let r: Value = serde_json::from_str(&q.get("/readyz").1).unwrap_or_default();
            (r["store_ready"] == true && r["runtime_limits_synced"] == true).then_some(())
        },
    );
}

fn until_limit(q: &Quotad, policy: &str, key: &str, limit: u64) {
    wait_for("the new limit", Duration::from_secs(5), || {
        let v = q.check(&json!({"policy": policy, "key": key, "cost": 0})).1;
        (v["limit"] == limit).then_some(())
    });
}

/// A reload that takes `[policy.runtime_limits]` away answers every key with the config's
/// numbers (the entries stay in Redis, refused new writes); put back, they apply again. A
/// reset of a key forgets what it spent, never its runtime limit.
#[test]
fn a_reload_and_a_reset_leave_runtime_limits_where_they_belong() {
    let redis = RedisServer::start();
    let with = config(&redis, 100);
    let without = Config::redis(&redis.url())
        .policy(Policy::new("api", "fixed_window", 3, "1h"))
        .policy(Policy::new("plain", "fixed_window", 3, "1h"))
        .to_toml();
    let q = Quotad::start(&with);
    let (status, _) = q.admin("PUT", "/v1/limits/api/vip", Some(&json!({"limit": 9})));
    assert_eq!(status, 200);
    spend(&q, "vip");
    let (status, _, _) = q.post("/v1/reset", &json!({"policy": "api", "key": "vip"}));
    assert_eq!(status, 204);
    let d = peek(&q, "vip");
    assert_eq!(
        (&d["limit"], &d["remaining"]),
        (&json!(9), &json!(9)),
        "{d}"
    );
    assert_eq!(q.reload(&q.config_file_text(&without)), "ok");
    assert_eq!(peek(&q, "vip")["limit_source"], "config");
    let (status, body) = q.admin("PUT", "/v1/limits/api/vip", Some(&json!({"limit": 4})));
    assert_eq!((status, &body["error"]["field"]), (400, &json!("policy")));
    assert_eq!(q.reload(&q.config_file_text(&with)), "ok");
    let d = peek(&q, "vip");
    assert_eq!(
        (&d["limit"], &d["limit_source"]),
        (&json!(9), &json!("runtime")),
        "{d}"
    );
}

/// A Redis that comes back without the writes (a restart without persistence; a failover
/// to a replica that had not received them): every copy follows what Redis has, by the
/// version that no longer matches, so no instance keeps enforcing a limit the store lost.
#[test]
fn copies_follow_a_redis_that_lost_its_runtime_limits() {
    let mut redis = RedisServer::start();
    let text = config(&redis, 100);
    let (a, b) = (Quotad::start(&text), Quotad::start(&text));
    let (status, _) = a.admin("PUT", "/v1/limits/api/vip", Some(&json!({"limit": 9})));
    assert_eq!(status, 200);
    until_applied(&b, "vip", 9, "runtime");
    redis.restart();
    for q in [&a, &b] {
        until_applied(q, "vip", 3, "config");
    }
    // Written again after it: applied again.
    let (status, _) = b.admin("PUT", "/v1/limits/api/vip", Some(&json!({"limit": 7})));
    assert_eq!(status, 200);
    until_applied(&a, "vip", 7, "runtime");
}

/// A Redis that lost the runtime limits and was written again before any copy read it
/// has versions of its own, far above the lost ones: no copy mistakes a new change for one
/// it applied before the loss.
#[test]
fn a_change_after_a_loss_is_never_taken_for_one_before_it() {
    let mut redis = RedisServer::start();
    let text = config(&redis, 100);
    let (a, b) = (Quotad::start(&text), Quotad::start(&text));
    let (status, _) = a.admin("PUT", "/v1/limits/api/old", Some(&json!({"limit": 9})));
    assert_eq!(status, 200);
    until_applied(&b, "old", 9, "runtime");
    redis.restart();
    // At once, before the resync's round: the store's first version after the loss.
    let (status, _) = wait_for("Redis back", Duration::from_secs(10), || {
        let r = a.admin("PUT", "/v1/limits/api/new", Some(&json!({"limit": 7})));
        (r.0 == 200).then_some(r)
    });
    assert_eq!(status, 200);
    for q in [&a, &b] {
        until_applied(q, "new", 7, "runtime");
        until_applied(q, "old", 3, "config");
    }
}

/// On a Redis Cluster (three masters): a policy's runtime limits share one slot, the
/// change message reaches every instance whichever node it subscribed to, and a new
/// instance reads the set from the slot's master.
#[test]
fn runtime_limits_work_on_a_redis_cluster() {
    let cluster = common::cluster::RedisCluster::start();
    let text = Config::cluster(&cluster.seeds())
        .policy(Policy::new("api", "fixed_window", 3, "1h").runtime_limits(100))
        .to_toml();
    let (a, b) = (Quotad::start(&text), Quotad::start(&text));
    synced(&a);
    synced(&b);
    for (i, key) in ["alpha", "beta", "gamma"].into_iter().enumerate() {
        let (status, body) = a.admin(
            "PUT",
            &format!("/v1/limits/api/{key}"),
            Some(&json!({"limit": 10 + i})),
        );
        assert_eq!(status, 200, "{body}");
        until_applied(&b, key, 10 + i as u64, "runtime");
    }
    let c = Quotad::start(&text);
    synced(&c);
    assert_eq!(peek(&c, "gamma")["limit"], 12);
    let (status, body) = c.admin("GET", "/v1/limits/api?count=10", None);
    assert_eq!(
        (status, body["limits"].as_array().map(Vec::len)),
        (200, Some(3)),
        "{body}"
    );
}

/// Behind Sentinel: the runtime limits are on the master and its replica, so a failover
/// keeps them; a change after it reaches every instance.
#[test]
fn runtime_limits_survive_a_sentinel_failover() {
    use common::sentinel::{MASTER_NAME, SentinelSetup};
    let setup = SentinelSetup::start();
    let text = Config::sentinel(&setup.sentinel_urls(), MASTER_NAME)
        .store("probe_interval", "100ms")
        .policy(Policy::new("api", "fixed_window", 3, "1h").runtime_limits(100))
        .to_toml();
    let (a, b) = (Quotad::start(&text), Quotad::start(&text));
    synced(&a);
    let (status, _) = a.admin("PUT", "/v1/limits/api/vip", Some(&json!({"limit": 9})));
    assert_eq!(status, 200);
    until_applied(&b, "vip", 9, "runtime");
    // Replicated before the switch.
    let mut master = setup.master.conn();
    let _: () = redis::cmd("WAIT")
        .arg(1)
        .arg(5000)
        .query(&mut master)
        .unwrap();
    setup.sentinels[0].failover();
    wait_for("the replica promoted", Duration::from_secs(20), || {
        setup
            .sentinels
            .iter()
            .all(|s| s.master_port() == Some(setup.replica.port))
            .then_some(())
    });
    let (status, _) = wait_for("a write on the new master", Duration::from_secs(20), || {
        let r = b.admin("PUT", "/v1/limits/api/gold", Some(&json!({"limit": 7})));
        (r.0 == 200).then_some(r)
    });
    assert_eq!(status, 200);
    for q in [&a, &b] {
        until_applied(q, "gold", 7, "runtime");
        until_applied(q, "vip", 9, "runtime");
    }
}
