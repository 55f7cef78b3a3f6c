//! Where features meet: one feature keeps derived state (the deny cache, a lease book)
//! and another changes its source. Each test here is one such pair from
//! docs/architecture.md's derived-state table, driven through the public API against a
//! real redis-server.

use quotad_testkit as common;

use std::time::Duration;

use common::federation::{eu_with_silent_us, even_escrow};
use common::{Config, Policy, Quotad, RedisServer, wait_for};
use serde_json::{Value, json};

fn reset(q: &Quotad, policy: &str, key: &str) -> (u16, Value) {
    let (status, _, body) = q.post("/v1/reset", &json!({"policy": policy, "key": key}));
    (status, body)
}

/// Denies `key` of `policy` until its denial is remembered (a deny-cache hit counted).
fn remembered_denial(q: &Quotad, policy: &str, key: &str) {
    let hits = format!("quotad_deny_cache_hits_total{{policy=\"{policy}\"}}");
    let before = q.metric(&hits);
    wait_for("a remembered denial", Duration::from_secs(10), || {
        let v = q.check1(policy, key);
        assert_eq!(v["allowed"], false, "{v}");
        (q.metric(&hits) > before).then_some(())
    });
}

/// A reset of a global policy's key forgets what the user spent (its bucket starts full,
/// as a new key's) and never the coordinator's lease book or offered-load counters:
/// deleting the book would let a lender admit again what it had lent.
#[test]
fn a_reset_of_a_global_key_keeps_its_lease_book() {
    let redis = RedisServer::start();
    let config = eu_with_silent_us(&redis.url(), "0123456789abcdef0123456789abcdef")
        .policy(Policy::new("g", "token_bucket", 100, "1s").global(even_escrow()))
        .to_toml();
    let q = Quotad::serve(&config);
    for _ in 0..3 {
        assert_eq!(q.check1("g", "k")["allowed"], true);
    }
    let key = "rl:g:g:{rl:g}:{k}";
    let mut conn = redis.conn();
    // The coordinator's book for the key: an escrow and a loan to region 1 (us).
    let until = 4_000_000_000_000_000i64;
    let _: () = redis::cmd("HSET")
        .arg(key)
        .arg("e")
        .arg("20")
        .arg("l")
        .arg(format!("1 1 7 30 {until}"))
        .arg("ep")
        .arg("1")
        .query(&mut conn)
        .unwrap();
    let fields = |conn: &mut redis::Connection| -> Vec<Option<String>> {
        redis::cmd("HMGET")
            .arg(key)
            .arg(&["e", "l", "ep", "a", "t", "ts"])
            .query(conn)
            .unwrap()
    };
    let before = fields(&mut conn);
    assert!(before[4].is_some(), "the bucket is there: {before:?}");
    assert_eq!(reset(&q, "g", "k").0, 204);
    let after = fields(&mut conn);
    assert_eq!(
        after[..4],
        before[..4],
        "the book and counters are the coordinator's"
    );
    assert_eq!(after[4..], [None, None], "what the user spent is forgotten");
    assert_eq!(q.check1("g", "k")["allowed"], true);
}

/// A reset is reported done only if every instance was told: the invalidation is
/// published in the same script as the reset. An instance whose Redis user may not
/// PUBLISH gets a refusal and changes nothing, so another instance's remembered denial
/// stays true.
#[test]
fn a_reset_that_cannot_be_published_is_not_done() {
    const PASSWORD: &str = "s3cret-for-tests";
    let pass = format!(">{PASSWORD}");
    let redis = RedisServer::start_with_args(
        false,
        &[
            "--user", "quotad", "on", &pass, "~*", "&*", "+@all", "--user", "nopub", "on", &pass,
            "~*", "&*", "+@all", "-publish",
        ],
    );
    let as_user = |user: &str| {
        Config::redis(&redis.url())
            .store("username", user)
            .store("password", PASSWORD)
            .policy(Policy::new("login", "fixed_window", 3, "1d").on_store_error("closed"))
            .to_toml()
    };
    let a = Quotad::serve(&as_user("quotad"));
    let b = Quotad::serve(&as_user("nopub"));
    for _ in 0..3 {
        assert_eq!(a.check1("login", "alice")["allowed"], true);
    }
    remembered_denial(&a, "login", "alice");
    let (status, body) = reset(&b, "login", "alice");
    assert_eq!(status, 503, "reported done without telling A: {body}");
    assert_eq!(body["error"]["code"], "reset_refused", "{body}");
    let count: Option<i64> = redis::cmd("HGET")
        .arg("rl:login:fw:{alice}")
        .arg("n")
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(count, Some(3), "nothing changed");
    assert_eq!(a.check1("login", "alice")["allowed"], false);
    // Through A, whose user may publish: done, and A's memory ends at once.
    assert_eq!(reset(&a, "login", "alice").0, 204);
    assert_eq!(a.check1("login", "alice")["allowed"], true);
}

/// A remembered denial answers only the same question: a check of another cost goes to
/// the store and gets its own retry time and remaining, not the remembered ones.
#[test]
fn a_remembered_denial_answers_only_its_own_cost() {
    let redis = RedisServer::start();
    let config = Config::redis(&redis.url())
        .policy(Policy::new("bucket", "token_bucket", 10, "10s"))
        .to_toml();
    let q = Quotad::serve(&config);
    for _ in 0..10 {
        assert_eq!(q.check1("bucket", "k")["allowed"], true);
    }
    remembered_denial(&q, "bucket", "k");
    let (status, v) = q.check(&json!({"policy": "bucket", "key": "k", "cost": 5}));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["allowed"], false, "{v}");
    let retry = v["retry_after_ms"].as_u64().unwrap();
    assert!(
        retry > 3_000,
        "5 tokens at 1/s take over 3 s, not the cost-1 denial's 1 s: {v}"
    );
}
