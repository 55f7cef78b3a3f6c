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
pub(super) fn remembered_denial(q: &Quotad, policy: &str, key: &str) {
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

/// Redis's count of `key` in policy `policy`'s current fixed window (`n` of its hash).
fn window_count(redis: &RedisServer, policy: &str, key: &str) -> u64 {
    let n: Option<u64> = redis::cmd("HGET")
        .arg(format!("rl:{policy}:fw:{{{key}}}"))
        .arg("n")
        .query(&mut redis.conn())
        .unwrap();
    n.unwrap_or(0)
}

/// A config on `redis` for the tests that compare Redis's count with what was admitted:
/// they test the accounting, not latency. A take or a give-back that times out on a busy
/// machine may still run in Redis, and its units are then lost to the instance (the safe
/// direction), which reads as an inexact count; so store calls get 2 s, not 50 ms.
fn exact(redis: &RedisServer) -> Config {
    Config::redis(&redis.url()).store("timeout", "2s")
}

/// A policy whose keys turn hot at 5 checks a second and take slices of an hour's window.
fn hot_policy(limit: u64) -> Policy {
    Policy::new("hot", "fixed_window", limit, "1h").set("hot_key_rate", 5)
}

/// Checks `key` one after the other for `how_long`; the number admitted.
fn drive(q: &Quotad, key: &str, how_long: Duration) -> u64 {
    let start = std::time::Instant::now();
    let mut admitted = 0;
    while start.elapsed() < how_long {
        if q.check1("hot", key)["allowed"] == true {
            admitted += 1;
        }
    }
    admitted
}

/// [`drive`], then one check more at a time while `held` (of the units admitted so far)
/// finds nothing held: the last check may have spent a slice's last unit, and the next
/// one takes a slice with a prefetch. Returns the units admitted and `held`'s last
/// figure (at most 100 checks more: a daemon that never holds a slice still fails).
pub(super) fn drive_until_held(
    q: &Quotad,
    key: &str,
    how_long: Duration,
    held: impl Fn(u64) -> i64,
) -> (u64, i64) {
    let mut admitted = drive(q, key, how_long);
    let mut now_held = held(admitted);
    for _ in 0..100 {
        if now_held > 0 {
            break;
        }
        if q.check1("hot", key)["allowed"] == true {
            admitted += 1;
        }
        now_held = held(admitted);
    }
    (admitted, now_held)
}

/// Hot-key slices (units taken in Redis and admitted from in memory) meet a reload and
/// cooling: a reload that raises the limit takes a new slice under the new limit and
/// gives the old one back; a key left alone cools and gives back what it holds. Once
/// every slice is back, Redis's count of the window is exactly what was admitted:
/// nothing lost (under-admission) and nothing spent that Redis did not count.
#[test]
fn a_hot_keys_slices_go_back_on_reload_and_cooling_and_the_count_is_exact() {
    let redis = RedisServer::start();
    let config = exact(&redis).policy(hot_policy(100_000));
    let q = Quotad::start(&config.to_toml());
    // Hot for more than a second: a lone taker then prefetches.
    let mut admitted = drive(&q, "k", Duration::from_millis(1500));
    let taken = q.metric("quotad_hot_key_units_total{event=\"taken\"}");
    let slices = q.metric("quotad_hot_key_slices_total{event=\"taken\"}");
    assert!(
        taken > slices,
        "no slice carried more than its check: {slices} slices, {taken} units"
    );
    assert!(q.metric("quotad_hot_key_admits_total{policy=\"hot\"}") > 0.0);
    let raised = exact(&redis).policy(hot_policy(200_000));
    assert_eq!(q.reload(&q.config_file_text(&raised.to_toml())), "ok");
    admitted += drive(&q, "k", Duration::from_millis(500));
    wait_for("every slice back", Duration::from_secs(10), || {
        (q.metric("quotad_hot_key_entries") == 0.0
            && q.metric("quotad_hot_key_units_total{event=\"returned\"}") > 0.0)
            .then_some(())
    });
    let (_, metrics) = q.get("/metrics");
    let errors: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("quotad_store_errors_total") && !l.ends_with(" 0"))
        .collect();
    assert_eq!(
        window_count(&redis, "hot", "k"),
        admitted,
        "Redis's count against the admissions; store errors: {errors:?}"
    );
    redis.assert_every_key_has_ttl();
}

/// Hot-key slices meet a reset: a reset on another instance reaches this instance's
/// slice while the key is in constant use (it is ended at once, not when the key cools).
/// What the give-back returns is the script's to decide (nothing, after a reset):
/// [`a_window_slice_given_back_after_a_reset_returns_nothing`]; counting it here raced
/// with the legitimate give-back of a slice a prefetch replaced just before the reset.
/// Waiting for a give-back alone raced too: on a busy machine slices are small, and the
/// reset can find the slice spent, with nothing to give back.
#[test]
fn a_reset_elsewhere_ends_a_hot_keys_slice() {
    let redis = RedisServer::start();
    let config = Config::redis(&redis.url())
        .policy(hot_policy(1_000_000))
        .to_toml();
    let (a, b) = (Quotad::serve(&config), Quotad::serve(&config));
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                a.check1("hot", "k");
            }
        });
        let _stop = StopOnDrop(&stop);
        wait_for("a prefetched slice on A", Duration::from_secs(10), || {
            (a.metric("quotad_hot_key_units_total{event=\"taken\"}")
                > a.metric("quotad_hot_key_slices_total{event=\"taken\"}") + 1.0)
                .then_some(())
        });
        let slices =
            |event: &str| a.metric(&format!("quotad_hot_key_slices_total{{event=\"{event}\"}}"));
        let (returned, ended) = (slices("returned"), slices("ended"));
        assert_eq!(reset(&b, "hot", "k").0, 204);
        // Ended by the invalidation (given back, unless it was spent to its last unit),
        // or, for a take in flight when it came, given back as it lands.
        wait_for("A's slice ended", Duration::from_secs(5), || {
            (slices("ended") > ended || slices("returned") > returned).then_some(())
        });
    });
}

/// The window-slice script gives nothing back across a reset: a slice taken before the
/// key was deleted returns 0 units, to the deleted state or to a window opened after it,
/// and the new window's count is left as it is.
#[test]
fn a_window_slice_given_back_after_a_reset_returns_nothing() {
    let redis = RedisServer::start();
    let window_us: i64 = 3_600_000_000;
    let eval = |args: &[String]| -> redis::Value {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(quotad_daemon::testing::redis::SLICE)
            .arg(1)
            .arg("w");
        for a in args {
            cmd.arg(a);
        }
        cmd.query(&mut redis.conn()).unwrap()
    };
    let take = |demand: u64| -> Vec<i64> {
        let v = eval(
            &[
                "take",
                "1000",
                &window_us.to_string(),
                "1",
                &demand.to_string(),
                "0",
                &format!("1000:{window_us}:1000"),
                "0",
            ]
            .map(String::from),
        );
        redis::from_redis_value(v).unwrap()
    };
    let give_back = |slot: i64, ledger: i64, units: u64| -> i64 {
        let v = eval(&[
            "return".into(),
            slot.to_string(),
            ledger.to_string(),
            units.to_string(),
            format!("1000:{window_us}:1000"),
            "0".into(),
        ]);
        redis::from_redis_value(v).unwrap()
    };
    let first = take(40);
    assert_eq!(first[0], 40);
    // Sanity: the same slice, returned before any reset, gives its units back.
    assert_eq!(give_back(first[3], first[4], 5), 5);
    let _: () = redis::cmd("DEL").arg("w").query(&mut redis.conn()).unwrap();
    assert_eq!(
        give_back(first[3], first[4], 35),
        0,
        "returned to a deleted key"
    );
    let second = take(10);
    assert_eq!(second[0], 10);
    assert_ne!(
        second[4], first[4],
        "a ledger opened after the reset is another one"
    );
    assert_eq!(
        give_back(first[3], first[4], 35),
        0,
        "units from before the reset went to the window after it"
    );
    let n: i64 = redis::cmd("HGET")
        .arg("w")
        .arg("n")
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(n, 10);
}

/// Sets its flag when dropped: a scoped thread polling it stops when the scope's body
/// ends, by return or by panic.
struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The tokens a peek finds in `algorithm`'s bucket for `key` of policy `hot` (burst and
/// refill as [`hot_bucket`]), through the algorithm's own script.
/// A fixed window's debt (a charge beyond its limit, owed to the windows after it) is
/// counted by a hot key's slices too: the window-slice script rolls the window with the
/// debt carried, as the window script does, so a slice cannot spend what is owed.
#[test]
fn a_hot_keys_window_slice_counts_the_debt_carried_into_its_window() {
    use quotad_core::algorithm::Algorithm;
    use quotad_daemon::testing::redis as scripts;
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let window_us: i64 = 3_600_000_000;
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64;
    // A charge in the window before this one: `cost` units, 1,000 of them fit there.
    let charge_last_window = |key: &str, cost: u64, conn: &mut redis::Connection| {
        let _: Vec<i64> = redis::cmd("EVAL")
            .arg(scripts::source(Algorithm::FixedWindow))
            .arg(1)
            .arg(key)
            .arg("charge")
            .arg(1000)
            .arg(window_us)
            .arg(1000)
            .arg(cost)
            .arg("m")
            .arg(format!("1000:{window_us}:1000"))
            .arg("0")
            .arg(now_us - window_us)
            .query(conn)
            .unwrap();
    };
    let take = |key: &str, demand: u64, conn: &mut redis::Connection| -> Vec<i64> {
        redis::cmd("EVAL")
            .arg(scripts::SLICE)
            .arg(1)
            .arg(key)
            .arg("take")
            .arg(1000)
            .arg(window_us)
            .arg(1)
            .arg(demand)
            .arg(0)
            .arg(format!("1000:{window_us}:1000"))
            .arg("0")
            .query(conn)
            .unwrap()
    };
    // 1,500 owed: this window is full, and so nothing is taken.
    charge_last_window("full", 2500, &mut conn);
    let t = take("full", 10, &mut conn);
    assert_eq!(
        (t[0], t[1]),
        (0, 0),
        "a slice of a window the debt fills: {t:?}"
    );
    // 300 owed: 700 are left in this window, and the debt is paid once taken.
    charge_last_window("part", 1300, &mut conn);
    let t = take("part", 1000, &mut conn);
    assert_eq!((t[0], t[1]), (700, 0), "{t:?}");
    let owed: Option<u64> = redis::cmd("HGET")
        .arg("part")
        .arg("o")
        .query(&mut conn)
        .unwrap();
    assert_eq!(owed, None, "paid in this window");
}

fn bucket_tokens(
    redis: &RedisServer,
    algorithm: quotad_core::algorithm::Algorithm,
    key: &str,
) -> u64 {
    let r: Vec<i64> = redis::cmd("EVAL")
        .arg(quotad_daemon::script_source(algorithm))
        .arg(1)
        .arg(format!("rl:hot:{}:{{{key}}}", algorithm.key_tag()))
        .arg("check")
        .arg(HOT_BURST)
        .arg(365 * 86_400 * 1_000_000i64)
        .arg(HOT_BURST)
        .arg(0)
        .arg("m")
        .arg(format!(
            "{HOT_BURST}:{}:{HOT_BURST}",
            365 * 86_400 * 1_000_000i64
        ))
        .arg("0")
        .query(&mut redis.conn())
        .unwrap();
    r[1] as u64
}

const HOT_BURST: u64 = 100_000;

/// A bucket whose keys turn hot at 5 checks a second, refilled so slowly (its burst a
/// year) that a test's refill stays far below one token.
fn hot_bucket(algorithm: &str) -> Policy {
    Policy::new("hot", algorithm, HOT_BURST, "365days").set("hot_key_rate", 5)
}

/// Hot-key slices of a token bucket and of a GCRA key meet shutdown: a daemon stopped
/// while the key is hot (checked without a pause for 1.5 s: slices taken and replaced,
/// one held) gives back what it holds before it exits. Then the bucket holds exactly its
/// burst less what was admitted: nothing lost, nothing spent that Redis did not count.
#[test]
fn a_daemon_gives_its_hot_buckets_slices_back_when_it_stops() {
    use quotad_core::algorithm::Algorithm;
    let redis = RedisServer::start();
    for (name, algorithm) in [
        ("token_bucket", Algorithm::TokenBucket),
        ("gcra", Algorithm::Gcra),
    ] {
        let key = format!("k-{name}");
        let config = exact(&redis).policy(hot_bucket(name)).to_toml();
        let q = Quotad::serve(&config);
        let (admitted, held) = drive_until_held(&q, &key, Duration::from_millis(1500), |a| {
            HOT_BURST as i64 - a as i64 - bucket_tokens(&redis, algorithm, &key) as i64
        });
        assert!(held > 0, "{name}: no slice was held at the stop");
        drop(q);
        assert_eq!(
            bucket_tokens(&redis, algorithm, &key),
            HOT_BURST - admitted,
            "{name}: the bucket is not its burst less what was admitted"
        );
    }
    redis.assert_every_key_has_ttl();
}

/// Hot-key slices meet shutdown: a daemon stopped while a key is hot gives its slice back
/// before it exits (the key has not cooled yet), so Redis's count is what was admitted.
#[test]
fn a_daemon_gives_its_hot_keys_slices_back_when_it_stops() {
    let redis = RedisServer::start();
    let config = exact(&redis).policy(hot_policy(100_000)).to_toml();
    let q = Quotad::serve(&config);
    // Redis counts the units the daemon holds unspent as admitted: more than were.
    let (admitted, held) = drive_until_held(&q, "k", Duration::from_millis(1500), |a| {
        window_count(&redis, "hot", "k") as i64 - a as i64
    });
    let counted = admitted as i64 + held;
    assert!(
        held > 0,
        "no slice was held at the stop: Redis counts {counted}, {admitted} admitted"
    );
    drop(q);
    assert_eq!(window_count(&redis, "hot", "k"), admitted);
}

/// Hot keys meet denied batches: a batch that spends a hot key from its slice and is
/// denied by another, cold key gives the units back to the slice, not to Redis past it.
/// After thousands of such batches and the key cooled, nothing of the hot key was spent,
/// and a window's ledger holds no more than its count. They lost 3-6 units per 13,000
/// batches, and the ledger grew past the count without bound.
#[test]
fn a_denied_batch_gives_a_hot_keys_units_back_to_its_slice() {
    for algorithm in ["token_bucket", "gcra", "fixed_window"] {
        let redis = RedisServer::start();
        let config = exact(&redis)
            // A burst of 1,000 refilled per year: whatever is lost stays lost.
            .policy(Policy::new("hot", algorithm, 1000, "365d").set("hot_key_rate", 5))
            .policy(Policy::new("cold", "fixed_window", 1, "1h"))
            .to_toml();
        let q = Quotad::serve(&config);
        assert_eq!(q.check1("cold", "c")["allowed"], true);
        let batch = json!({"checks": [
            {"policy": "hot", "key": "k"},
            {"policy": "cold", "key": "c"},
        ]});
        // Two clients: a slice ends and is given back while the other's batch is in flight.
        let batches: u64 = std::thread::scope(|s| {
            let clients: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        let start = std::time::Instant::now();
                        let mut batches = 0;
                        while start.elapsed() < Duration::from_millis(2500) {
                            let (status, v) = q.check(&batch);
                            assert_eq!(status, 200, "{v}");
                            assert_eq!(v["allowed"], false, "{v}");
                            batches += 1;
                        }
                        batches
                    })
                })
                .collect();
            clients.into_iter().map(|c| c.join().unwrap()).sum()
        });
        let taken = "quotad_hot_key_slices_total{event=\"taken\"}";
        assert!(
            q.metric(taken) > 100.0,
            "{algorithm}: the key never turned hot"
        );
        // Cooled, its slice given back: every unit of the key is in Redis again.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let peek = q.check(&json!({"policy": "hot", "key": "k", "cost": 0})).1;
            let cooled = q.metric("quotad_hot_key_entries") == 0.0;
            if cooled && peek["remaining"] == 1000 {
                break;
            }
            if std::time::Instant::now() >= deadline {
                let text = q.get("/metrics").1;
                let hot: Vec<&str> = text
                    .lines()
                    .filter(|l| l.starts_with("quotad_hot") || l.starts_with("quotad_refund"))
                    .collect();
                panic!(
                    "{algorithm}: after {batches} denied batches: {peek}\n{}",
                    hot.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if algorithm == "fixed_window" {
            let (n, h): (Option<u64>, Option<u64>) = redis::cmd("HMGET")
                .arg("rl:hot:fw:{k}")
                .arg("n")
                .arg("h")
                .query(&mut redis.conn())
                .unwrap();
            assert!(
                h.unwrap_or(0) <= n.unwrap_or(0),
                "ledger {h:?} over the count {n:?}"
            );
        }
    }
}

/// Hot-key slices and remembered denials meet a lowered limit, then a raised one (the
/// transition rule), on two instances. A spends a hot key from slices and still holds
/// some when the limit falls below what was spent, on A first and then on B: neither
/// admits anything after (what the slices took counts as spent; units taken under the
/// old numbers are not spent under the new), and the denials are remembered. Raised
/// back, both admit at once (no remembered denial outlives the numbers it was given
/// under), and once the slices are back the key has exactly what was not admitted left:
/// nothing they held was lost or admitted twice across the changes.
#[test]
fn hot_slices_and_remembered_denials_keep_a_lowered_then_raised_limit() {
    const LIMIT: u64 = 100_000;
    for algorithm in ["fixed_window", "token_bucket", "gcra"] {
        let redis = RedisServer::start();
        // Refilled per year: what a test's seconds refill is a fraction of a unit.
        let config = |limit: u64| {
            exact(&redis)
                .policy(Policy::new("hot", algorithm, limit, "365d").set("hot_key_rate", 5))
                .to_toml()
        };
        let (a, b) = (Quotad::start(&config(LIMIT)), Quotad::start(&config(LIMIT)));
        let remaining = |q: &Quotad| {
            let v = q.check(&json!({"policy": "hot", "key": "k", "cost": 0})).1;
            v["remaining"].as_u64().unwrap_or_else(|| panic!("{v}"))
        };
        // Held by A: what Redis counts as spent less what A admitted (B peeks: peeks
        // never go through slices).
        let held = |admitted: u64| LIMIT as i64 - remaining(&b) as i64 - admitted as i64;
        let (mut admitted, now_held) = drive_until_held(&a, "k", Duration::from_millis(1300), held);
        assert!(now_held > 0, "{algorithm}: A held no slice");

        let reload = |q: &Quotad, limit: u64| {
            assert_eq!(q.reload(&q.config_file_text(&config(limit))), "ok");
        };
        let spend = |q: &Quotad, n: usize| {
            (0..n)
                .filter(|_| q.check1("hot", "k")["allowed"] == true)
                .count() as u64
        };
        reload(&a, 100);
        assert_eq!(spend(&a, 50), 0, "{algorithm}: A under the lowered limit");
        reload(&b, 100);
        assert_eq!(
            spend(&a, 50) + spend(&b, 50),
            0,
            "{algorithm}: under the lowered limit everywhere"
        );
        remembered_denial(&a, "hot", "k");

        reload(&a, LIMIT);
        reload(&b, LIMIT);
        for q in [&a, &b] {
            let v = q.check1("hot", "k");
            assert_eq!(v["allowed"], true, "{algorithm}: raised again: {v}");
            admitted += 1;
        }
        wait_for("the slices back", Duration::from_secs(10), || {
            (a.metric("quotad_hot_key_entries") == 0.0).then_some(())
        });
        // (Given back after the tend that dropped the key: poll the figure.)
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while remaining(&b) != LIMIT - admitted && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(
            remaining(&b),
            LIMIT - admitted,
            "{algorithm}: {admitted} admitted in all"
        );
    }
}
