//! A limit holds through every change: what a key's stored state means when a limit,
//! burst or window changes under it, on every instance at once or on one instance of two
//! while a change rolls out (the transition rule, docs/architecture.md). Two real daemons
//! on one real redis-server; the changes are reloads of their config files.

use quotad_testkit as common;

use common::{Config, Policy, Quotad, RedisServer};
use serde_json::{Value, json};

/// A daemon on `redis` with `policy`.
fn daemon(redis: &RedisServer, policy: Policy) -> Quotad {
    Quotad::start(&Config::redis(&redis.url()).policy(policy).to_toml())
}

/// `q` reloads to `policy`; panics unless applied.
fn reload(q: &Quotad, redis: &RedisServer, policy: Policy) {
    let text = q.config_file_text(&Config::redis(&redis.url()).policy(policy).to_toml());
    assert_eq!(q.reload(&text), "ok", "{}", q.log());
}

/// `n` checks of one unit of `policy`'s `key` through `q`: how many were allowed.
fn spend(q: &Quotad, policy: &str, key: &str, n: u64) -> u64 {
    (0..n)
        .filter(|_| q.check1(policy, key)["allowed"] == Value::Bool(true))
        .count() as u64
}

/// One check of `cost` units: whether it was allowed.
fn spend_at_once(q: &Quotad, policy: &str, key: &str, cost: u64) -> bool {
    let (status, v) = q.check(&json!({"policy": policy, "key": key, "cost": cost}));
    assert_eq!(status, 200, "{v}");
    v["allowed"] == Value::Bool(true)
}

/// A window change (1 h to 2 h, the version raised) that has reached one instance of two,
/// as a ConfigMap does over a minute: instances taking turns count one count, so the key
/// admits no more than each version's limit once. Both counts used to start over at every
/// switch between the instances: 200 admitted against 10 in 100 rounds.
#[test]
fn a_window_change_on_one_instance_of_two_starts_no_key_over() {
    for algorithm in ["fixed_window", "sliding_window"] {
        let redis = RedisServer::start();
        let hour = || Policy::new("w", algorithm, 10, "1h");
        let (a, b) = (daemon(&redis, hour()), daemon(&redis, hour()));
        reload(
            &b,
            &redis,
            Policy::new("w", algorithm, 10, "2h").set("version", 2),
        );
        let admitted: u64 = (0..100)
            .map(|round| spend(if round % 2 == 0 { &a } else { &b }, "w", "k", 2))
            .sum();
        assert!(
            (10..=20).contains(&admitted),
            "{algorithm}: {admitted} admitted against 10 per version"
        );
    }
}

/// A GCRA or token-bucket limit lowered from 2,000 to 20 an hour after the 2,000 were
/// spent (the limit alone, the burst left at 2,000; or an override to 20): what was spent
/// stays spent, and the key gets no more than the new numbers refill (20 in the hour).
/// GCRA read the stored arrival time at the new rate: 1,980 admitted after the change.
#[test]
fn a_lowered_limit_leaves_the_spent_burst_spent() {
    for algorithm in ["gcra", "token_bucket"] {
        for burst in [2000, 20] {
            let redis = RedisServer::start();
            let before = || Policy::new("g", algorithm, 2000, "1h").burst(2000);
            let (a, b) = (daemon(&redis, before()), daemon(&redis, before()));
            assert!(spend_at_once(&a, "g", "k", 2000), "{algorithm}");
            for q in [&a, &b] {
                reload(
                    q,
                    &redis,
                    Policy::new("g", algorithm, 20, "1h").burst(burst),
                );
            }
            let after = spend(&a, "g", "k", 200) + spend(&b, "g", "k", 200);
            assert!(
                after <= 1,
                "{algorithm}, burst {burst}: {after} admitted after the limit fell to 20 an hour"
            );
        }
    }
}

/// A GCRA or token-bucket limit raised from 20 to 2,000 an hour after the 20 were spent:
/// what was used carries over, and the rest of the new burst is there at once. GCRA read
/// the stored arrival time at the new rate: denied, remaining 0.
#[test]
fn a_raised_limit_keeps_what_was_used_and_gives_the_rest() {
    for algorithm in ["gcra", "token_bucket"] {
        let redis = RedisServer::start();
        let q = daemon(&redis, Policy::new("g", algorithm, 20, "1h"));
        assert_eq!(spend(&q, "g", "k", 21), 20, "{algorithm}");
        reload(&q, &redis, Policy::new("g", algorithm, 2000, "1h"));
        let (status, v) = q.check(&json!({"policy": "g", "key": "k"}));
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["allowed"], true, "{algorithm}: {v}");
        assert_eq!(v["remaining"], 1979, "{algorithm}: {v}");
    }
}
