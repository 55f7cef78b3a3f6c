//! Usage a customer can see (`GET /v1/usage/{policy}/{key}`, `POST /v1/usage`): what a
//! key used, what remains, its limit and where that comes from, the period and the debt,
//! read from real Redis without changing a byte of it.

use quotad_testkit as common;

use common::{Config, Global, Peer, Policy, Quotad, RedisServer, free_port};
use quotad_core::calendar::{Calendar, Period};
use serde_json::{Value, json};

/// Keys with their value and when they expire (Unix ms), and how many there are.
type Snapshot = (i64, Vec<(String, Option<Vec<u8>>, i64)>);

/// Every key of `redis` with its value and its expiry, and how many there are.
fn snapshot(redis: &RedisServer) -> Snapshot {
    snapshot_of(redis, |_| true)
}

/// [`snapshot`] of the keys `pick` names.
fn snapshot_of(redis: &RedisServer, pick: impl Fn(&str) -> bool) -> Snapshot {
    let mut conn = redis.conn();
    let mut keys: Vec<String> = redis.keys().into_iter().filter(|k| pick(k)).collect();
    keys.sort();
    let rows: Vec<(String, Option<Vec<u8>>, i64)> = keys
        .into_iter()
        .map(|k| {
            let dump: Option<Vec<u8>> = redis::cmd("DUMP").arg(&k).query(&mut conn).unwrap();
            // When it expires, absolute (a PTTL read twice moves by the time between).
            let ttl: i64 = redis::cmd("PEXPIRETIME").arg(&k).query(&mut conn).unwrap();
            (k, dump, ttl)
        })
        .collect();
    (rows.len() as i64, rows)
}

fn usage(q: &Quotad, path: &str) -> Value {
    let (status, body) = q.get(path);
    let body: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
    assert_eq!(status, 200, "{body}");
    body
}

/// Microseconds since the epoch of an RFC 3339 time in an answer.
fn us(v: &Value) -> i64 {
    let t: jiff::Timestamp = v.as_str().unwrap_or_else(|| panic!("{v}")).parse().unwrap();
    t.as_microsecond()
}

/// A monthly plan in Berlin: what customer 42 used this month, its runtime limit, the
/// month's start and end in the zone's offset; and reading it twice changes no key,
/// no value and no expiry, and creates none for a key that never spent.
#[test]
fn usage_tells_what_a_key_used_this_month_and_changes_nothing() {
    let redis = RedisServer::start();
    let q = Quotad::start(
        &Config::redis(&redis.url())
            .policy(
                Policy::new("plan", "fixed_window", 1000, "month")
                    .set("time_zone", "Europe/Berlin")
                    .runtime_limits(10),
            )
            .to_toml(),
    );
    let (status, d) = q.check(&json!({"policy": "plan", "key": "customer-42", "cost": 3}));
    assert_eq!((status, &d["allowed"]), (200, &json!(true)), "{d}");
    let (status, body) = q.admin(
        "PUT",
        "/v1/limits/plan/customer-42",
        Some(&json!({"limit": 50000})),
    );
    assert_eq!(status, 200, "{body}");
    let before = snapshot(&redis);
    let u = usage(&q, "/v1/usage/plan/customer-42");
    assert_eq!(
        (
            &u["used"],
            &u["remaining"],
            &u["debt"],
            &u["limit"],
            &u["limit_source"]
        ),
        (
            &json!(3),
            &json!(49997),
            &json!(0),
            &json!(50000),
            &json!("runtime")
        ),
        "{u}"
    );
    // The month as the calendar in Berlin has it, around the store's clock.
    let month = Calendar::new(Period::Month, "Europe/Berlin").unwrap();
    let span = month.containing(us(&u["read_at"]));
    let period = &u["period"];
    assert_eq!(
        (us(&period["start"]), us(&period["end"])),
        (span.start_us, span.end_us),
        "{u}"
    );
    assert_eq!(period["time_zone"], "Europe/Berlin");
    // Written in the zone's offset, as a page would show it: midnight on the first.
    let start = period["start"].as_str().unwrap();
    assert!(start.contains("-01T00:00:00+0"), "{start}");
    assert!(
        u["reset_after_ms"].as_u64().unwrap() as i64 * 1000 >= span.end_us - us(&u["read_at"]),
        "{u}"
    );
    // A key that never spent: all of the config's limit, and no key made for it.
    let fresh = usage(&q, "/v1/usage/plan/customer-7");
    assert_eq!(
        (&fresh["used"], &fresh["remaining"], &fresh["limit_source"]),
        (&json!(0), &json!(1000), &json!("config")),
        "{fresh}"
    );
    let _ = usage(&q, "/v1/usage/plan/customer-42");
    assert_eq!(snapshot(&redis), before, "a usage read changed Redis");
    // What the reads said is what a check finds.
    let d = q.check1("plan", "customer-42");
    assert_eq!(d["remaining"], 49996, "{d}");
}

/// Work charged after the fact beyond what a key had is debt, and usage shows it: a
/// token bucket's tokens below zero, a fixed window's units owed to the windows after.
#[test]
fn usage_shows_the_debt_a_charge_left() {
    let redis = RedisServer::start();
    let q = Quotad::start(
        &Config::redis(&redis.url())
            .policy(
                Policy::new("tokens", "token_bucket", 10, "1h")
                    .burst(10)
                    .set("settle_within", "1m"),
            )
            .policy(Policy::new("calls", "fixed_window", 3, "1h").set("settle_within", "1m"))
            .to_toml(),
    );
    for (policy, cost) in [("tokens", 25), ("calls", 5)] {
        let (status, _, body) = q.post(
            "/v1/charge",
            &json!({"policy": policy, "key": "k", "cost": cost}),
        );
        assert_eq!(status, 200, "{body}");
    }
    let t = usage(&q, "/v1/usage/tokens/k");
    assert_eq!(
        (&t["used"], &t["remaining"], &t["debt"], &t["period"]),
        (&json!(10), &json!(0), &json!(15), &Value::Null),
        "{t}"
    );
    let c = usage(&q, "/v1/usage/calls/k");
    assert_eq!(
        (&c["used"], &c["remaining"], &c["debt"]),
        (&json!(3), &json!(0), &json!(2)),
        "{c}"
    );
    // The hour the window counts in.
    let (start, end) = (us(&c["period"]["start"]), us(&c["period"]["end"]));
    assert_eq!(
        (start % 3_600_000_000, end - start),
        (0, 3_600_000_000),
        "{c}"
    );
}

/// The batch form answers each key in order; bad input is a 4xx naming the field, and
/// neither form changes anything.
#[test]
fn usage_of_several_keys_answers_each_and_bad_input_names_the_field() {
    let redis = RedisServer::start();
    let q = Quotad::start(
        &Config::redis(&redis.url())
            .policy(Policy::new("api", "sliding_log", 5, "1m"))
            .policy(Policy::new("tb", "token_bucket", 10, "1s").burst(20))
            .to_toml(),
    );
    q.check1("api", "a");
    q.check1("api", "a");
    q.check1("tb", "b");
    let before = snapshot(&redis);
    let (status, _, body) = q.post(
        "/v1/usage",
        &json!({"keys": [{"policy": "api", "key": "a"}, {"policy": "tb", "key": "b"}]}),
    );
    assert_eq!(status, 200, "{body}");
    let r = &body["results"];
    assert_eq!(
        (
            &r[0]["key"],
            &r[0]["used"],
            &r[0]["remaining"],
            &r[0]["period"]
        ),
        (&json!("a"), &json!(2), &json!(3), &Value::Null),
        "{body}"
    );
    assert_eq!(
        (&r[1]["policy"], &r[1]["burst"], &r[1]["algorithm"]),
        (&json!("tb"), &json!(20), &json!("token_bucket")),
        "{body}"
    );
    assert!(r[1]["used"].as_u64().unwrap() <= 1, "{body}");
    let long = "k".repeat(513);
    let cases = [
        (json!({"keys": []}), 400, "keys"),
        (json!({"keys": "api"}), 400, "keys"),
        (json!({"key": "a"}), 400, "key"),
        (
            json!({"keys": [{"policy": "api", "key": "a"}, {"policy": "nope", "key": "a"}]}),
            404,
            "keys[1].policy",
        ),
        (
            json!({"keys": [{"policy": "api", "key": long}]}),
            400,
            "keys[0].key",
        ),
        (
            json!({"keys": [{"policy": "api", "key": ""}]}),
            400,
            "keys[0].key",
        ),
        (
            json!({"keys": [{"policy": "api", "key": "a", "cost": 1}]}),
            400,
            "keys[0].cost",
        ),
    ];
    for (body, want, field) in cases {
        let (status, _, answer) = q.post("/v1/usage", &body);
        assert_eq!(
            (status, &answer["error"]["field"]),
            (want, &json!(field)),
            "{body} -> {answer}"
        );
    }
    let (status, answer) = q.get("/v1/usage/nope/a");
    assert_eq!(status, 404, "{answer}");
    let (status, answer) = q.get(&format!("/v1/usage/api/{}", "k".repeat(513)));
    assert_eq!(status, 400, "{answer}");
    assert!(answer.contains("\"field\":\"key\""), "{answer}");
    assert_eq!(
        snapshot(&redis),
        before,
        "usage reads and refusals changed Redis"
    );
}

/// The embedded store answers the same numbers from its own map.
#[test]
fn usage_on_the_embedded_store_reads_its_map() {
    let q = Quotad::start(
        &Config::new()
            .policy(Policy::new("api", "fixed_window", 4, "1m"))
            .to_toml(),
    );
    q.check1("api", "a");
    for _ in 0..2 {
        let u = usage(&q, "/v1/usage/api/a");
        assert_eq!(
            (&u["used"], &u["remaining"], &u["limit_source"]),
            (&json!(1), &json!(3), &json!("config")),
            "{u}"
        );
    }
    assert_eq!(
        q.check1("api", "a")["remaining"],
        2,
        "the reads spent nothing"
    );
}

/// A global policy's key: what this region holds of the budget (its escrow share while
/// it lends and borrows nothing), read from the key's hash without a write.
#[test]
fn usage_of_a_global_key_shows_what_this_region_holds() {
    let redis = RedisServer::start();
    let q = Quotad::start(
        &Config::redis(&redis.url())
            .region("eu")
            .coordinator("secret", "0123456789abcdef0123")
            .peer(Peer::new(
                "us",
                &format!("http://127.0.0.1:{}", free_port()),
            ))
            .policy(
                Policy::new("g", "token_bucket", 100, "1s")
                    .burst(100)
                    .on_store_error("closed")
                    .global(Global::escrow(&[("eu", 1), ("us", 3)])),
            )
            .to_toml(),
    );
    q.check1("g", "k");
    // The key's own hash (the coordinator writes its lock and books meanwhile).
    let key = |k: &str| k.contains("{k}") || k.ends_with(":k");
    let before = snapshot_of(&redis, key);
    let u = usage(&q, "/v1/usage/g/k");
    let g = &u["global"];
    assert_eq!(
        (
            &g["region"],
            &g["rate"],
            &g["escrow"],
            &g["lent"],
            &g["borrowed"]
        ),
        (
            &json!("eu"),
            &json!(25.0),
            &json!(25.0),
            &json!(0.0),
            &json!(0.0)
        ),
        "{u}"
    );
    assert_eq!(g["capacity"], 25.0, "{u}");
    assert!(u["remaining"].as_u64().unwrap() >= 23, "{u}");
    assert_eq!(
        snapshot_of(&redis, key),
        before,
        "a usage read changed Redis"
    );
    assert!(!before.1.is_empty(), "the key's hash: {:?}", redis.keys());
}

/// A read of a store that is gone has no answer: 503, never a made-up usage, whatever
/// the policy's fail mode says about checks.
#[test]
fn usage_of_a_store_that_is_gone_is_unavailable() {
    let mut redis = RedisServer::start();
    let q = Quotad::start(
        &Config::redis(&redis.url())
            .policy(Policy::new("api", "fixed_window", 5, "1m").on_store_error("open"))
            .to_toml(),
    );
    q.check1("api", "a");
    redis.kill();
    let (status, body) = q.get("/v1/usage/api/a");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("store_unavailable"), "{body}");
    let (status, _, body) = q.post(
        "/v1/usage",
        &json!({"keys": [{"policy": "api", "key": "a"}]}),
    );
    assert_eq!(
        (status, &body["error"]["code"]),
        (503, &json!("store_unavailable")),
        "{body}"
    );
}
