//! Costs known after the work: a check reserves an estimate (`"settle": true`) and
//! `POST /v1/settle` charges the real cost, once. What is charged beyond what the key has
//! is a debt that later checks wait out; a settlement that gives units back ends the
//! denials other instances remember. Bad settlements are named 4xx and change nothing.
//! (tests/atomicity.rs holds the four-process runs: exact totals over HTTP and gRPC.)
//!
//! In-process daemons (`Quotad::serve`) on real Redis, and on the embedded store.

use quotad_testkit as common;

use std::time::Duration;

use common::{Config, Policy, Quotad, RedisServer, header, http, wait_for};
use serde_json::{Value, json};

/// 10 a second at most 10 at once, reservations kept a minute; and one without
/// settlement.
fn policies(config: Config) -> String {
    config
        .policy(
            Policy::new("tokens", "token_bucket", 10, "1s")
                .burst(10)
                .set("settle_within", "1m"),
        )
        .policy(
            Policy::new("daily", "fixed_window", 100, "1d")
                .on_store_error("open")
                .set("settle_within", "1m"),
        )
        .policy(Policy::new("plain", "token_bucket", 10, "1s"))
        .to_toml()
}

fn reserve(q: &Quotad, policy: &str, key: &str, estimate: u64) -> Value {
    let body = json!({"policy": policy, "key": key, "cost": estimate, "settle": true});
    let (status, _, v) = q.post("/v1/check", &body);
    assert_eq!(status, 200, "{v}");
    v
}

fn settle(q: &Quotad, policy: &str, key: &str, reservation: &Value, cost: u64) -> (u16, Value) {
    let body = json!({"policy": policy, "key": key, "reservation": reservation, "cost": cost});
    let (status, _, v) = q.post("/v1/settle", &body);
    (status, v)
}

/// On Redis and on the embedded store alike: reserved at 4, settled at 9, the key was
/// charged 9; settled again, nothing more; a reservation nobody made is a 404 that
/// charges nothing.
#[test]
fn a_reservation_settled_at_its_real_cost_charges_exactly_that_once() {
    let redis = RedisServer::start();
    for (config, on_redis) in [(Config::redis(&redis.url()), true), (Config::new(), false)] {
        let q = Quotad::serve(&policies(config));
        let r = reserve(&q, "tokens", "k", 4);
        if on_redis {
            // Redis forgot its scripts: the settlement loads its own and goes on.
            let _: String = redis::cmd("SCRIPT")
                .arg("FLUSH")
                .query(&mut redis.conn())
                .unwrap();
        }
        assert_eq!(
            (r["outcome"].as_str(), r["remaining"].as_u64()),
            (Some("allowed"), Some(6))
        );
        let id = &r["reservation"];
        assert_eq!(id.as_str().map(str::len), Some(32), "{r}");
        let (status, s) = settle(&q, "tokens", "k", id, 9);
        assert_eq!(status, 200, "{s}");
        assert_eq!(
            (
                s["status"].as_str(),
                s["charged"].as_u64(),
                s["refunded"].as_u64()
            ),
            (Some("settled"), Some(5), Some(0)),
            "{s}"
        );
        assert!(s["remaining"].as_u64() <= Some(1), "9 of 10 spent: {s}");
        let (status, again) = settle(&q, "tokens", "k", id, 9);
        assert_eq!(
            (status, again["status"].as_str()),
            (200, Some("already_settled"))
        );
        assert_eq!(
            again["remaining"], s["remaining"],
            "settling twice charged twice"
        );
        // The same id on another key is not that key's reservation.
        let (status, other) = settle(&q, "tokens", "other", id, 9);
        assert_eq!(status, 404, "{other}");
        let unknown = json!("0123456789abcdef0123456789abcdef");
        let (status, v) = settle(&q, "tokens", "k", &unknown, 1);
        assert_eq!(status, 404, "{v}");
        assert_eq!(v["error"]["code"], "unknown_reservation");
        assert_eq!(v["error"]["field"], "reservation");
        let after = q.check1("tokens", "k");
        assert!(after["remaining"].as_u64() <= Some(1), "{after}");
    }
    // Every key written has a TTL, the reservation's no longer than settle_within.
    redis.assert_every_key_has_ttl();
    let reservation = redis
        .keys()
        .into_iter()
        .find(|k| k.contains(":r:"))
        .expect("the reservation's key");
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&reservation)
        .query(&mut redis.conn())
        .unwrap();
    assert!(ttl > 50_000 && ttl <= 60_000, "{reservation}: {ttl} ms");
}

/// Reserved 10 of 10 and settled at 30: 20 owed, paid at 10 a second, so the next unit
/// waits about 2.1 s and nothing passes meanwhile; then it does. A fixed window of 100
/// a day charged 250 owes the next day and the one after.
#[test]
fn a_key_in_debt_admits_nothing_until_the_debt_is_paid() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&policies(Config::redis(&redis.url())));
    let r = reserve(&q, "tokens", "debtor", 10);
    let (status, s) = settle(&q, "tokens", "debtor", &r["reservation"], 30);
    assert_eq!((status, s["charged"].as_u64()), (200, Some(20)), "{s}");
    let denied = q.check1("tokens", "debtor");
    assert_eq!(denied["outcome"], "denied", "{denied}");
    let retry = denied["retry_after_ms"].as_u64().unwrap();
    assert!(
        (1_000..=2_100).contains(&retry),
        "20 owed + 1 at 10/s, less the time since (without the debt: under 0.1 s): {denied}"
    );
    // A reservation is a check like any other: refused too, and opens nothing.
    let refused = reserve(&q, "tokens", "debtor", 1);
    assert_eq!(refused["outcome"], "denied");
    assert!(refused.get("reservation").is_none(), "{refused}");
    wait_for("the debt paid", Duration::from_secs(5), || {
        (q.check1("tokens", "debtor")["outcome"] == "allowed").then_some(())
    });

    let r = reserve(&q, "daily", "debtor", 100);
    let (status, s) = settle(&q, "daily", "debtor", &r["reservation"], 250);
    assert_eq!((status, s["charged"].as_u64()), (200, Some(150)), "{s}");
    let denied = q.check1("daily", "debtor");
    assert_eq!(denied["outcome"], "denied", "{denied}");
    // Today's window and the next are full; the 50 left over count in the third.
    let retry = denied["retry_after_ms"].as_u64().unwrap();
    assert!(retry > 86_400_000, "{denied}");
}

/// A reset ends the reservations open on its key: the reset's fresh start is given once,
/// so a settlement afterwards gives nothing back and charges nothing, and says so
/// (`ended_by_reset`, again when retried); a reservation opened after the reset settles
/// as any other. On Redis and on the embedded store, for every algorithm that settles.
/// The refund used to be credited to the state after the reset: 200 admitted in the
/// hour against 100.
#[test]
fn a_reset_ends_the_reservations_open_on_its_key() {
    let redis = RedisServer::start();
    for config in [Config::redis(&redis.url()), Config::new()] {
        let mut config = config;
        for algorithm in ["fixed_window", "token_bucket", "gcra"] {
            config = config
                .policy(Policy::new(algorithm, algorithm, 100, "1h").set("settle_within", "1m"));
        }
        let q = Quotad::serve(&config.to_toml());
        for algorithm in ["fixed_window", "token_bucket", "gcra"] {
            let r = reserve(&q, algorithm, "k", 100);
            assert_eq!(r["allowed"], true, "{r}");
            let body = json!({"policy": algorithm, "key": "k"});
            assert_eq!(q.post("/v1/reset", &body).0, 204);
            for _ in 0..2 {
                let (status, s) = settle(&q, algorithm, "k", &r["reservation"], 0);
                assert_eq!(status, 200, "{s}");
                assert_eq!(s["status"], "ended_by_reset", "{algorithm}: {s}");
                assert_eq!((s.get("refunded"), s.get("charged")), (None, None), "{s}");
            }
            // The fresh start, once: a hundred admitted in the hour, not two hundred.
            let admitted = (0..150)
                .filter(|_| q.check1(algorithm, "k")["allowed"] == true)
                .count();
            assert_eq!(admitted, 100, "{algorithm}");
            // Opened after the reset: settled as any other.
            let body = json!({"policy": algorithm, "key": "j", "cost": 10, "settle": true});
            let (_, _, after) = q.post("/v1/check", &body);
            let (status, s) = settle(&q, algorithm, "j", &after["reservation"], 4);
            assert_eq!((status, s["refunded"].as_u64()), (200, Some(6)), "{s}");
        }
    }
    redis.assert_every_key_has_ttl();
}

/// A reload that takes settlement away, or gives the policy another algorithm (other
/// keys), leaves open reservations behind: settling one is a named 400 or a 404, nothing
/// is charged, and the estimate stands.
#[test]
fn a_reload_leaves_open_reservations_unsettleable_and_charges_nothing() {
    let redis = RedisServer::start();
    let policy = |algorithm: &str, settle: bool, version: i64| {
        let p = Policy::new("metered", algorithm, 100, "1d").set("version", version);
        let p = if settle {
            p.set("settle_within", "1m")
        } else {
            p
        };
        Config::redis(&redis.url()).policy(p).to_toml()
    };
    let q = Quotad::start(&policy("fixed_window", true, 1));
    let r = reserve(&q, "metered", "k", 10);
    assert_eq!(
        q.reload(&q.config_file_text(&policy("fixed_window", false, 1))),
        "ok"
    );
    let (status, v) = settle(&q, "metered", "k", &r["reservation"], 50);
    assert_eq!(
        (status, v["error"]["field"].as_str()),
        (400, Some("policy")),
        "{v}"
    );
    assert_eq!(q.check1("metered", "k")["remaining"], 100 - 10 - 1);
    assert_eq!(
        q.reload(&q.config_file_text(&policy("token_bucket", true, 2))),
        "ok"
    );
    let (status, v) = settle(&q, "metered", "k", &r["reservation"], 50);
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (404, Some("unknown_reservation")),
        "{v}"
    );
}

/// Two instances on one Redis: a key spent through A is denied on B, and B remembers the
/// denial. A settlement through A below its estimate gives units back, and B answers
/// from Redis again at once: the give-back is announced like a refund's.
#[test]
fn a_settlement_that_gives_units_back_ends_remembered_denials_elsewhere() {
    let redis = RedisServer::start();
    let config = Config::redis(&redis.url())
        .policy(
            Policy::new("slow", "token_bucket", 1, "1h")
                .burst(10)
                .set("settle_within", "1m"),
        )
        .to_toml();
    let a = Quotad::serve(&config);
    let b = Quotad::serve(&config);
    let r = reserve(&a, "slow", "k", 10);
    assert_eq!(r["outcome"], "allowed");
    let hits = "quotad_deny_cache_hits_total{policy=\"slow\"}";
    wait_for("B answering from memory", Duration::from_secs(5), || {
        assert_eq!(b.check1("slow", "k")["outcome"], "denied");
        (b.metric(hits) > 0.0).then_some(())
    });
    let (status, s) = settle(&a, "slow", "k", &r["reservation"], 2);
    assert_eq!((status, s["refunded"].as_u64()), (200, Some(8)), "{s}");
    wait_for("B admitting again", Duration::from_secs(5), || {
        (b.check1("slow", "k")["outcome"] == "allowed").then_some(())
    });
}

/// Through an instance whose Redis user may not PUBLISH, a settlement that would give
/// units back is refused whole (its invalidation and its refund are one script), so no
/// instance keeps a denial it made stale; one that only charges goes through.
#[test]
fn a_settlement_that_cannot_announce_its_give_back_changes_nothing() {
    let pass = ">settle-test-password";
    let redis = RedisServer::start_with_args(
        false,
        &[
            "--user", "mute", "on", pass, "~*", "&*", "+@all", "-publish",
        ],
    );
    let config = Config::redis(&redis.url())
        .store("username", "mute")
        .store("password", &pass[1..])
        .policy(
            Policy::new("slow", "token_bucket", 1, "1h")
                .burst(10)
                .set("settle_within", "1m"),
        )
        .to_toml();
    let q = Quotad::serve(&config);
    let r = reserve(&q, "slow", "k", 6);
    let before: Vec<String> = redis::cmd("HGETALL")
        .arg("rl:slow:tb:{k}")
        .query(&mut redis.conn())
        .unwrap();
    let (status, v) = settle(&q, "slow", "k", &r["reservation"], 2);
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (503, Some("settle_refused")),
        "{v}"
    );
    let after: Vec<String> = redis::cmd("HGETALL")
        .arg("rl:slow:tb:{k}")
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(before, after, "the refused settlement changed the key");
    // Still open: settled at more than its estimate, it needs no announcement.
    let (status, s) = settle(&q, "slow", "k", &r["reservation"], 7);
    assert_eq!((status, s["charged"].as_u64()), (200, Some(1)), "{s}");
}

/// Without Redis a reserving check gets its policy's fail mode, and no reservation
/// (nothing would hold it); a settlement is a 503 that changed nothing, counted
/// `failed`, safe to retry once Redis is back (settling twice charges once).
#[test]
fn without_the_store_no_reservation_opens_and_a_settlement_is_retried() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&policies(Config::redis(&redis.url())));
    let r = reserve(&q, "daily", "k", 5);
    // Hung, not gone: what it holds is there when it answers again.
    redis.signal("-STOP");
    let open = reserve(&q, "daily", "k2", 5);
    assert_eq!(open["outcome"], "fail_open", "{open}");
    assert!(open.get("reservation").is_none(), "{open}");
    // Sent, and no answer in time: Redis may run it when it wakes, and the answer says
    // so (it said "nothing was changed", and Redis ran it after resuming).
    let (status, v) = settle(&q, "daily", "k", &r["reservation"], 7);
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["code"], "outcome_unknown", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("may have done it") && m.contains("retrying is safe")),
        "{v}"
    );
    let failed = "quotad_settlements_total{policy=\"daily\",result=\"failed\"}";
    assert_eq!(q.metric(failed), 1.0);
    redis.signal("-CONT");
    // The retry is safe: done by then (the script ran as Redis woke), it answers
    // already_settled; else it settles now. The key is charged the real cost once.
    let first = wait_for("the store back", Duration::from_secs(10), || {
        let (status, v) = settle(&q, "daily", "k", &r["reservation"], 7);
        (status == 200).then_some(v)
    });
    assert!(
        first["status"] == "already_settled" || first["status"] == "settled",
        "{first}"
    );
    let (_, again) = settle(&q, "daily", "k", &r["reservation"], 7);
    assert_eq!(again["status"], "already_settled");
    assert_eq!(q.check1("daily", "k")["remaining"], 100 - 7 - 1);
}

/// Every bad reservation or settlement is a 4xx naming its field, and writes nothing:
/// the key's state in Redis is byte for byte what it was.
#[test]
fn bad_reservations_and_settlements_are_named_4xx_and_change_nothing() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&policies(Config::redis(&redis.url())));
    let r = reserve(&q, "tokens", "k", 3);
    let id = r["reservation"].as_str().unwrap().to_owned();
    let state = || -> Vec<(String, String)> {
        let mut keys = redis.keys();
        keys.sort();
        keys.into_iter()
            .map(|k| {
                let v: redis::Value = redis::cmd("DUMP").arg(&k).query(&mut redis.conn()).unwrap();
                (k, format!("{v:?}"))
            })
            .collect()
    };
    let before = state();
    let settle_body =
        |extra: &str| format!(r#"{{"policy":"tokens","key":"k","reservation":"{id}"{extra}}}"#);
    let cases: Vec<(&str, &str, String, u16, &str)> = vec![
        ("/v1/check", "a batch", r#"{"checks":[{"policy":"tokens","key":"k","settle":true}]}"#.into(), 400, "checks[0].settle"),
        ("/v1/check", "a policy without", r#"{"policy":"plain","key":"k","settle":true}"#.into(), 400, "settle"),
        ("/v1/check", "not a bool", r#"{"policy":"tokens","key":"k","settle":"yes"}"#.into(), 400, "settle"),
        ("/v1/check", "an estimate of 0", r#"{"policy":"tokens","key":"k","cost":0,"settle":true}"#.into(), 400, "settle"),
        ("/v1/check", "in a group", r#"{"policy":"tokens","key":"k","group":"g","settle":true}"#.into(), 400, "settle"),
        ("/v1/settle", "no cost", settle_body(""), 400, "cost"),
        ("/v1/settle", "a negative cost", settle_body(r#","cost":-1"#), 400, "cost"),
        ("/v1/settle", "a fractional cost", settle_body(r#","cost":1.5"#), 400, "cost"),
        ("/v1/settle", "a cost past a year", settle_body(r#","cost":315576001"#), 400, "cost"),
        ("/v1/settle", "a huge cost", settle_body(r#","cost":1e300"#), 400, "cost"),
        ("/v1/settle", "an unknown field", settle_body(r#","cost":1,"refund":true"#), 400, "refund"),
        ("/v1/settle", "a policy without", format!(r#"{{"policy":"plain","key":"k","reservation":"{id}","cost":1}}"#), 400, "policy"),
        ("/v1/settle", "an unknown policy", format!(r#"{{"policy":"nope","key":"k","reservation":"{id}","cost":1}}"#), 404, "policy"),
        ("/v1/settle", "an id too short", r#"{"policy":"tokens","key":"k","reservation":"abc","cost":1}"#.into(), 400, "reservation"),
        ("/v1/settle", "an id with a brace", r#"{"policy":"tokens","key":"k","reservation":"0123456789abcdef0123456789abcde}","cost":1}"#.into(), 400, "reservation"),
        ("/v1/settle", "an id in capitals", format!(r#"{{"policy":"tokens","key":"k","reservation":"{}","cost":1}}"#, id.to_uppercase()), 400, "reservation"),
        ("/v1/settle", "no id", r#"{"policy":"tokens","key":"k","cost":1}"#.into(), 400, "reservation"),
        ("/v1/settle", "another key's", format!(r#"{{"policy":"tokens","key":"j","reservation":"{id}","cost":1}}"#), 404, "reservation"),
    ];
    for (path, name, body, status, field) in cases {
        let (got, _, text) = http(q.port, "POST", path, Some("application/json"), &body).unwrap();
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{name}: {text}"));
        assert_eq!(got, status, "{name}: {text}");
        assert_eq!(v["error"]["field"], field, "{name}: {text}");
    }
    assert_eq!(state(), before, "a refused request changed the store");
    // And the reservation still settles.
    let (status, s) = settle(&q, "tokens", "k", &json!(id), 3);
    assert_eq!(
        (status, s["status"].as_str()),
        (200, Some("settled")),
        "{s}"
    );
}

/// A proxy in front of metered work: its forward-auth check is a peek (`cost = 0`), so a
/// request passes while the key has anything left; the service charges what the work
/// really cost afterwards (`POST /v1/charge`, never denied), and the key, now in debt, is
/// refused at the proxy until refill has paid it.
#[test]
fn a_proxy_peeks_and_the_service_charges_the_real_cost_after() {
    let redis = RedisServer::start();
    let config = Config::redis(&redis.url())
        .policy(
            Policy::new("tokens", "token_bucket", 100, "1h")
                .burst(100)
                .set("settle_within", "1m")
                .forward_auth(&["header:x-api-key"], "deny", 429)
                .forward_auth_cost(0),
        )
        .policy(Policy::new("plain", "token_bucket", 10, "1s"))
        .to_toml();
    let q = Quotad::serve(&config);
    let proxy = || {
        let (status, headers, _) =
            common::request(q.port, "GET", "/v1/authz/tokens", &[("x-api-key", "k")], "").unwrap();
        (status, header(&headers, "retry-after").map(str::to_owned))
    };
    assert_eq!(proxy(), (200, None), "a fresh key passes");
    assert_eq!(proxy(), (200, None), "a peek spends nothing");
    let (status, _, v) = q.post(
        "/v1/charge",
        &json!({"policy": "tokens", "key": "k", "cost": 150}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        (v["outcome"].as_str(), v["charged"].as_u64()),
        (Some("allowed"), Some(150)),
        "{v}"
    );
    let (status, retry) = proxy();
    assert_eq!(status, 429, "in debt");
    // 50 owed and 1 more, at 100 an hour: about 31 minutes.
    let retry: u64 = retry.unwrap().parse().unwrap();
    assert!((1_800..=1_900).contains(&retry), "{retry}");
    for (body, field) in [
        (json!({"policy": "plain", "key": "k", "cost": 1}), "policy"),
        (json!({"policy": "tokens", "key": "k"}), "cost"),
        (
            json!({"policy": "tokens", "key": "k", "cost": 876_601}),
            "cost",
        ),
        (
            json!({"policy": "tokens", "key": "k", "cost": 1, "settle": true}),
            "settle",
        ),
    ] {
        let (status, _, v) = q.post("/v1/charge", &body);
        assert_eq!(
            (status, v["error"]["field"].as_str()),
            (400, Some(field)),
            "{body}: {v}"
        );
    }
}

/// A reset forgives a debt, the same for every algorithm that holds one: the key starts
/// over as a new key does (docs/api.md, Resets). A GCRA key charged into debt and reset
/// was still denied.
#[test]
fn a_reset_forgives_a_debt_for_every_algorithm() {
    let redis = RedisServer::start();
    for config in [Config::redis(&redis.url()), Config::new()] {
        let mut config = config;
        for algorithm in ["fixed_window", "token_bucket", "gcra"] {
            config = config
                .policy(Policy::new(algorithm, algorithm, 10, "1h").set("settle_within", "1m"));
        }
        let q = Quotad::serve(&config.to_toml());
        for algorithm in ["fixed_window", "token_bucket", "gcra"] {
            let body = json!({"policy": algorithm, "key": "k", "cost": 30});
            let (status, _, v) = q.post("/v1/charge", &body);
            assert_eq!(status, 200, "{v}");
            let denied = q.check1(algorithm, "k");
            assert_eq!(denied["allowed"], false, "{algorithm} in debt: {denied}");
            let reset = json!({"policy": algorithm, "key": "k"});
            assert_eq!(q.post("/v1/reset", &reset).0, 204);
            let v = q.check1(algorithm, "k");
            assert_eq!(
                (v["allowed"].as_bool(), v["remaining"].as_u64()),
                (Some(true), Some(9)),
                "{algorithm} after the reset: {v}"
            );
        }
    }
}

/// The same through two instances: a denial another instance remembers for a key in debt
/// ends with the reset, as the reset's invalidation arrives there.
#[test]
fn a_reset_forgives_a_debt_another_instance_remembers() {
    let redis = RedisServer::start();
    let mut config = Config::redis(&redis.url());
    for algorithm in ["fixed_window", "token_bucket", "gcra"] {
        config =
            config.policy(Policy::new(algorithm, algorithm, 10, "1h").set("settle_within", "1m"));
    }
    let config = config.to_toml();
    let (a, b) = (Quotad::serve(&config), Quotad::serve(&config));
    for algorithm in ["fixed_window", "token_bucket", "gcra"] {
        let body = json!({"policy": algorithm, "key": "k", "cost": 30});
        assert_eq!(a.post("/v1/charge", &body).0, 200);
        for _ in 0..3 {
            assert_eq!(b.check1(algorithm, "k")["allowed"], false, "{algorithm}");
        }
        let received = b.metric("quotad_invalidations_received_total");
        let reset = json!({"policy": algorithm, "key": "k"});
        assert_eq!(a.post("/v1/reset", &reset).0, 204);
        common::wait_for(
            "the reset's invalidation",
            std::time::Duration::from_secs(5),
            || (b.metric("quotad_invalidations_received_total") > received).then_some(()),
        );
        let v = b.check1(algorithm, "k");
        assert_eq!(v["allowed"], true, "{algorithm} after the reset: {v}");
    }
}
