//! Faults of a real Redis Cluster under load: a hot key's slot moved to another master
//! (ASK redirects, then MOVED), and the master of a hot key SIGKILLed until its replica is
//! promoted. The daemons are processes (`Quotad::start`), the load a closed loop of
//! HTTP checks that records every answer's outcome.

use std::time::{Duration, Instant};

use quotad_testkit::cluster::RedisCluster;
use quotad_testkit::load::{Checks, Sample};
use quotad_testkit::{Config, Policy, Quotad, wait_for};
use serde_json::json;

/// Answers per request body: (allowed, denied).
fn decisions(samples: &[Sample], request: usize) -> (usize, usize) {
    let mine = samples.iter().filter(|s| s.request == request);
    let allowed = mine.clone().filter(|s| s.outcome == "allowed").count();
    let denied = mine.filter(|s| s.outcome == "denied").count();
    (allowed, denied)
}

fn assert_all_200(samples: &[Sample]) {
    let bad: Vec<_> = samples.iter().filter(|s| s.status != 200).collect();
    assert!(
        bad.is_empty(),
        "{} of {} answers not 200, e.g. {:?}",
        bad.len(),
        samples.len(),
        bad.first()
    );
}

/// The slot of a hot key moves to another master (IMPORTING, MIGRATING, MIGRATE key by key,
/// SETSLOT NODE) while checks run: every answer is a decision (no fail mode), and the
/// admitted count stays exactly the limit. Mid-migration the source answers ASK for keys
/// it no longer has; quotad sends ASKING and the script together (store/redis/connect.rs).
#[test]
fn a_hot_keys_slot_moves_to_another_master_under_load_with_exact_admission() {
    const LIMIT: usize = 1000;
    let cluster = RedisCluster::start();
    // Exactness is the point, not latency: a generous timeout keeps a debug build on 2
    // cores from turning a slow answer into a fallback.
    let config = Config::cluster(&cluster.seeds())
        .store("timeout", "1s")
        .policy(Policy::new("fw", "fixed_window", LIMIT as u64, "1h").on_store_error("closed"))
        .policy(Policy::new("sl", "sliding_log", LIMIT as u64, "1h").on_store_error("closed"))
        .to_toml();
    let q = Quotad::start(&config);
    // Both policies' keys (`rl:<policy>:<tag>:{hot}`) are in the slot of the tag.
    let slot = cluster.keyslot("{hot}");
    let from = cluster.master_of(slot, None).expect("the slot's master");
    let masters = cluster.masters();
    let to = cluster
        .nodes
        .iter()
        .position(|n| {
            n.port != cluster.nodes[from].port && masters.iter().any(|m| m.port == n.port)
        })
        .expect("another master");
    let bodies = vec![
        json!({"policy": "fw", "key": "hot"}),
        json!({"policy": "sl", "key": "hot"}),
    ];
    let load = Checks::start(q.port, bodies, 4, Duration::from_secs(60));
    let patience = Duration::from_secs(10);
    load.wait_answers(100, patience);

    let migration = Instant::now();
    cluster.begin_slot_migration(slot, from, to);
    load.wait_answers(100, patience); // MIGRATING, both keys still on the source
    let mut moved = 0;
    // One key at a time, with answers in between: the moved key is reached by ASK while
    // the other is still served by the source.
    while cluster.migrate_keys(slot, from, to, 1) > 0 {
        moved += 1;
        load.wait_answers(100, patience);
    }
    cluster.finish_slot_migration(slot, from, to);
    let finished = Instant::now();
    eprintln!(
        "slot {slot} ({moved} keys) moved from :{} to :{} in {:?} under load",
        cluster.nodes[from].port,
        cluster.nodes[to].port,
        finished - migration
    );
    assert_eq!(moved, 2, "both policies' keys were in the slot");
    // The migration happened while both keys were still admitting.
    let during = load.since(migration);
    let before_end: Vec<Sample> = during.iter().filter(|s| s.at < finished).cloned().collect();
    for r in 0..2 {
        let (allowed, _) = decisions(&before_end, r);
        assert!(
            allowed > 0,
            "request {r}: no admission during the migration"
        );
    }
    // Run on until both keys have been denied for a while.
    wait_for(
        "both keys denied after the migration",
        Duration::from_secs(30),
        || {
            let after = load.since(finished);
            (0..2).all(|r| decisions(&after, r).1 >= 50).then_some(())
        },
    );
    let samples = load.finish();
    assert_all_200(&samples);
    let fallbacks: Vec<_> = samples.iter().filter(|s| !s.enforced()).collect();
    assert!(
        fallbacks.is_empty(),
        "{} answers not enforced, e.g. {:?}; quotad's log:\n{}",
        fallbacks.len(),
        fallbacks.first(),
        q.log()
    );
    let before: Vec<Sample> = samples
        .iter()
        .filter(|s| s.at < finished)
        .cloned()
        .collect();
    for (r, policy) in ["fw", "sl"].iter().enumerate() {
        let (allowed, denied) = decisions(&samples, r);
        let (allowed_before, _) = decisions(&before, r);
        eprintln!(
            "{policy}: {allowed} admitted ({allowed_before} before the slot was moved), {denied} denied"
        );
        assert_eq!(
            allowed, LIMIT,
            "{policy}: admitted {allowed} at limit {LIMIT}"
        );
        assert!(
            allowed_before < LIMIT,
            "{policy}: the limit was reached before the migration ended"
        );
    }
    assert_eq!(cluster.master_of(slot, None), Some(to));
    let on_target: i64 = redis::cmd("CLUSTER")
        .arg("COUNTKEYSINSLOT")
        .arg(slot)
        .query(&mut cluster.nodes[to].conn())
        .unwrap();
    assert_eq!(on_target, 2, "the slot's keys are on the new master");
    for m in cluster.masters() {
        m.assert_every_key_has_ttl();
    }
}

#[test]
fn a_killed_master_fails_over_and_enforcement_resumes_within_a_second() {
    let mut cluster = RedisCluster::start();
    let config = Config::cluster(&cluster.seeds())
        .policy(Policy::new("p-open", "token_bucket", 1_000_000, "1m").on_store_error("open"))
        .policy(Policy::new("p-closed", "fixed_window", 1_000_000, "1m").on_store_error("closed"))
        .to_toml();
    let q = Quotad::start(&config);
    let slot = cluster.keyslot("{hot}");
    let master = cluster.master_of(slot, None).expect("the slot's master");
    let replica = cluster.replica_of(master).unwrap_or_else(|| {
        let nodes: String = redis::cmd("CLUSTER")
            .arg("NODES")
            .query(&mut cluster.nodes[master].conn())
            .unwrap();
        panic!("no replica of node {master} in\n{nodes}")
    });
    let fail_mode = ["fail_open", "fail_closed"];
    let bodies = vec![
        json!({"policy": "p-open", "key": "hot"}),
        json!({"policy": "p-closed", "key": "hot"}),
    ];
    let load = Checks::start(q.port, bodies, 3, Duration::from_secs(60));
    let t0 = Instant::now();
    wait_for("enforced decisions", Duration::from_secs(10), || {
        let s = load.since(t0);
        (s.len() >= 50 && s.iter().all(Sample::enforced)).then_some(())
    });

    cluster.nodes[master].kill();
    let killed = Instant::now();
    let promoted = wait_for("the replica promoted", Duration::from_secs(30), || {
        (cluster.master_of(slot, Some(master)) == Some(replica)).then(Instant::now)
    });
    let failover = promoted - killed;
    // Enforcement back: the latest answers of both policies are decisions again.
    wait_for(
        "enforcement after the failover",
        Duration::from_secs(15),
        || {
            let s = load.since(promoted);
            (0..2)
                .all(|r| {
                    let mine: Vec<_> = s.iter().filter(|x| x.request == r).collect();
                    mine.len() >= 20 && mine[mine.len() - 20..].iter().all(|x| x.enforced())
                })
                .then_some(())
        },
    );
    let samples = load.finish();
    assert_all_200(&samples);
    let after_kill: Vec<&Sample> = samples.iter().filter(|s| s.at >= killed).collect();
    for s in &after_kill {
        assert!(
            s.enforced() || s.outcome == fail_mode[s.request],
            "after the kill, request {} got {:?}",
            s.request,
            s.outcome
        );
    }
    for (r, mode) in fail_mode.iter().enumerate() {
        let n = after_kill
            .iter()
            .filter(|s| s.request == r && s.outcome == *mode)
            .count();
        assert!(n > 0, "no {mode} answer: the kill was not felt");
    }
    // Enforcement resumed with the first decision after the last fallback.
    let last_fallback = after_kill
        .iter()
        .filter(|s| !s.enforced())
        .map(|s| s.at)
        .max()
        .expect("fallbacks");
    let resumed = after_kill
        .iter()
        .filter(|s| s.at > last_fallback && s.enforced())
        .map(|s| s.at + s.latency)
        .min()
        .expect("an enforced answer after the last fallback");
    let resumed_after = resumed - killed;
    let fallbacks = after_kill.iter().filter(|s| !s.enforced()).count();
    eprintln!(
        "master :{} killed: replica :{} promoted after {failover:?}; enforcement back after \
         {resumed_after:?} ({:?} after the promotion); {fallbacks} fallback answers",
        cluster.nodes[master].port,
        cluster.nodes[replica].port,
        resumed_after.saturating_sub(failover)
    );
    assert!(
        resumed_after <= failover + Duration::from_secs(1),
        "enforcement resumed {resumed_after:?} after the kill, the failover took {failover:?}"
    );
    assert_eq!(q.get("/readyz").0, 200);
}
