//! quotad on a real Redis Cluster (three masters, three replicas): the atomicity race of
//! tests/atomicity.rs for every algorithm, keys spread over every master with a TTL each,
//! and the TTL janitor sweeping every master. Slot migration and a killed master are in
//! tests/cluster_faults.rs.
//!
//! Its own harness (libtest-mimic), like tests/atomicity.rs: the race's load comes from
//! child processes that re-run this binary (`quotad_testkit::race`).

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use quotad_testkit::cluster::RedisCluster;
use quotad_testkit::race::{self, Race};
use quotad_testkit::{Config, Policy, Quotad, RedisServer, wait_for};
use serde_json::json;

/// 500 requests from 4 processes at limit 100, on a key of one master of the cluster.
fn five_hundred_parallel_requests_admit_exactly_the_limit_for_every_algorithm() {
    let cluster = RedisCluster::start();
    let race = Race {
        processes: 4,
        per_process: 125,
    };
    let _q = race::assert_every_algorithm_admits_exactly_the_limit(
        Config::cluster(&cluster.seeds()),
        race,
        100,
    );
    for m in cluster.masters() {
        m.assert_every_key_has_ttl();
    }
}

/// Checks `n` distinct keys (`{prefix}-{i}`) of `policy` through quotad, in batches of
/// 64 from 4 threads; every check must be allowed.
fn check_distinct_keys(q: &Quotad, policy: &str, prefix: &str, n: usize) {
    let threads = 4;
    std::thread::scope(|s| {
        for t in 0..threads {
            s.spawn(move || {
                let mine: Vec<usize> = (t..n).step_by(threads).collect();
                for chunk in mine.chunks(64) {
                    let checks: Vec<_> = chunk
                        .iter()
                        .map(|i| json!({"policy": policy, "key": format!("{prefix}-{i}")}))
                        .collect();
                    let (status, _, body) = q.post("/v1/check", &json!({"checks": checks}));
                    assert_eq!(status, 200, "{body}");
                    assert_eq!(body["allowed"], true, "{body}");
                }
            });
        }
    });
}

/// quotad's keys on one node (SCAN; the janitor's claim is quotad's too).
fn quotad_keys(node: &RedisServer) -> Vec<String> {
    node.keys()
        .into_iter()
        .filter(|k| k.starts_with("rl:"))
        .collect()
}

/// The name of this test's own connections, so that SLOWLOG entries of its PTTLs are
/// not taken for the janitor's.
const TEST_CLIENT: &str = "cluster-test";

/// A connection to `node` named [`TEST_CLIENT`].
fn test_conn(node: &RedisServer) -> redis::Connection {
    let mut conn = node.conn();
    let _: () = redis::cmd("CLIENT")
        .arg("SETNAME")
        .arg(TEST_CLIENT)
        .query(&mut conn)
        .expect("CLIENT SETNAME");
    conn
}

/// PTTL of each of `keys` on `node`, in one pipeline.
fn pttls(node: &RedisServer, keys: &[String]) -> Vec<i64> {
    let mut pipe = redis::pipe();
    for k in keys {
        pipe.cmd("PTTL").arg(k);
    }
    pipe.query(&mut test_conn(node)).expect("PTTL")
}

fn ten_thousand_keys_spread_over_every_master_each_with_a_ttl() {
    let cluster = RedisCluster::start();
    // About where keys land, not latency: generous bounds keep a loaded 2-core machine
    // from turning a slow call into a fail_open that writes no key.
    let config = Config::cluster(&cluster.seeds())
        .store("timeout", "5s")
        .store("queue_timeout", "5s")
        .policy(Policy::new("fw", "fixed_window", 10, "1h").on_store_error("closed"))
        .to_toml();
    let q = Quotad::serve(&config);
    let n = 10_000;
    let started = Instant::now();
    check_distinct_keys(&q, "fw", "user", n);
    eprintln!("{n} checks of distinct keys in {:?}", started.elapsed());

    let masters = cluster.masters();
    assert_eq!(masters.len(), 3);
    let per_master: Vec<usize> = masters.iter().map(|m| quotad_keys(m).len()).collect();
    eprintln!("keys per master: {per_master:?}");
    assert_eq!(
        per_master.iter().sum::<usize>(),
        n,
        "one key per checked key"
    );
    for (m, count) in masters.iter().zip(&per_master) {
        assert!(
            *count * 5 > n,
            "master {} holds {count} of {n} keys, not over 20%",
            m.port
        );
        let keys = quotad_keys(m);
        let without: Vec<_> = keys
            .iter()
            .zip(pttls(m, &keys))
            .filter(|(_, t)| *t <= 0)
            .collect();
        assert!(
            without.is_empty(),
            "master {}: {} keys without a TTL, e.g. {:?}",
            m.port,
            without.len(),
            without.first()
        );
    }
}

/// Nothing of the janitor's in SLOWLOG (its connections are named, as tests/janitor.rs
/// checks on one server).
fn assert_no_janitor_command_in_slowlog(node: &RedisServer) {
    let slow = node.slowlog_of(quotad_daemon::testing::redis::CLIENT_NAME);
    assert!(
        slow.is_empty(),
        "the janitor in SLOWLOG of {}: {slow:?}",
        node.port
    );
}

fn the_janitor_gives_persisted_keys_their_ttl_back_on_every_master() {
    let cluster = RedisCluster::start();
    let interval = Duration::from_secs(1);
    let config = Config::cluster(&cluster.seeds())
        .store("janitor_interval", "1s")
        .store("timeout", "5s")
        .store("queue_timeout", "5s")
        .policy(Policy::new("fw", "fixed_window", 10, "1h").on_store_error("closed"))
        .to_toml();
    let masters = cluster.masters();
    for m in &masters {
        m.watch_slowlog();
    }
    let q = Quotad::serve(&config);
    check_distinct_keys(&q, "fw", "k", 3000);
    // 1,000 of quotad's policy keys, a third from each master.
    let persisted: BTreeMap<u16, Vec<String>> = masters
        .iter()
        .map(|m| {
            let mut keys: Vec<String> = quotad_keys(m)
                .into_iter()
                .filter(|k| k.starts_with("rl:fw:"))
                .collect();
            keys.sort();
            keys.truncate(334);
            (m.port, keys)
        })
        .collect();
    let total: usize = persisted.values().map(Vec::len).sum();
    assert!(total >= 1000, "{total} keys to persist");
    let node = |port: u16| *masters.iter().find(|m| m.port == port).unwrap();
    // Wait out a sweep first, so the PERSISTs land between two of them.
    wait_for("a first sweep", Duration::from_secs(20), || {
        (q.metric("quotad_janitor_last_scan_timestamp_seconds") > 0.0).then_some(())
    });
    for (port, keys) in &persisted {
        let mut pipe = redis::pipe();
        for k in keys {
            pipe.cmd("PERSIST").arg(k);
        }
        let done: Vec<i64> = pipe.query(&mut test_conn(node(*port))).unwrap();
        assert!(done.iter().all(|d| *d == 1), "PERSIST on {port}: {done:?}");
    }
    let t0 = Instant::now();
    let mut most_without_ttl = 0.0f64;
    wait_for(
        "every persisted key with a TTL again",
        Duration::from_secs(15),
        || {
            most_without_ttl = most_without_ttl.max(q.metric("quotad_keys_without_ttl"));
            persisted
                .iter()
                .all(|(port, keys)| pttls(node(*port), keys).iter().all(|t| *t > 0))
                .then_some(())
        },
    );
    let took = t0.elapsed();
    eprintln!("{total} persisted keys on 3 masters had TTLs again after {took:?}");
    let bound = interval * 2 + Duration::from_secs(2);
    assert!(
        took <= bound,
        "two janitor intervals plus 2 s: {took:?} > {bound:?}"
    );
    // The counter moves when the sweep of every master is done, just after the last TTL.
    let repaired = wait_for("the repairs counted", Duration::from_secs(5), || {
        let n = q.metric("quotad_janitor_repaired_total");
        (n >= total as f64).then_some(n)
    });
    eprintln!("quotad_janitor_repaired_total {repaired}");
    // The gauge reports what a sweep found (here at some point, during the repairs),
    // and 0 again once a sweep finds every key with its TTL.
    wait_for("a clean sweep", Duration::from_secs(5), || {
        most_without_ttl = most_without_ttl.max(q.metric("quotad_keys_without_ttl"));
        (most_without_ttl > 0.0 && q.metric("quotad_keys_without_ttl") == 0.0).then_some(())
    });
    eprintln!("quotad_keys_without_ttl peaked at {most_without_ttl}, then 0");
    for m in &masters {
        m.assert_every_key_has_ttl();
        assert_no_janitor_command_in_slowlog(m);
    }
}

/// The tests, or, in a child started by the race, that child's share of the load.
fn main() -> ExitCode {
    if race::child_main() {
        return ExitCode::SUCCESS;
    }
    quotad_testkit::run_tests!(
        five_hundred_parallel_requests_admit_exactly_the_limit_for_every_algorithm,
        ten_thousand_keys_spread_over_every_master_each_with_a_ttl,
        the_janitor_gives_persisted_keys_their_ttl_back_on_every_master,
    )
}
