//! Every script quotad runs, on a real Redis Cluster, which refuses a script whose keys
//! are not all in one slot (CROSSSLOT): each algorithm's, the composite script of a group,
//! a reservation and its settlement, a concurrency limit's lease,
//! the hot-key slices' takes and returns, and the coordinator's whole lease store (lock and fences, replication and WAIT routed
//! to the policy's master, books written, read, listed and dropped after a failover,
//! active keys, counters, the default escrow) beside the global decision script.

use quotad_testkit as common;

use std::sync::Arc;
use std::time::Duration;

use common::cluster::RedisCluster;
use common::federation::{eu_with_silent_us, even_escrow};
use common::{Policy, wait_for};
use quotad_core::algorithm::{Algorithm, Op};
use quotad_core::clock::Clock;
use quotad_core::coordinator::lease::LeaseBook;
use quotad_core::coordinator::node::LeaseStore;
use quotad_daemon::Settings;
use quotad_daemon::testing::federation as incarnation;
use quotad_daemon::testing::federation::Coordinated;
use quotad_daemon::testing::federation::Lock;
use quotad_daemon::testing::federation::{RedisClock, RedisLeaseStore, global_policies};
use quotad_daemon::testing::redis::{self as scripts, self as global};
use quotad_daemon::testing::redis::{Target, Topology};
use quotad_daemon::testing::slot;
use quotad_daemon::testing::{PolicyLayout, ReservationId};

const ALGORITHMS: [&str; 5] = [
    "fixed_window",
    "sliding_log",
    "sliding_window",
    "token_bucket",
    "gcra",
];

fn settings() -> Settings {
    // Parsed only (never connected): the URL does not matter.
    let mut config = eu_with_silent_us("redis://127.0.0.1:1", "0123456789abcdef")
        .policy(Policy::new("g", "token_bucket", 100, "1s").global(even_escrow()));
    for a in ALGORITHMS {
        config = config.policy(Policy::new(a, a, 10, "1s"));
    }
    config = config.policy(Policy::new("slots", "concurrency", 5, "1m"));
    Settings::parse("cluster.toml", &config.to_toml()).unwrap()
}

fn cluster_target(cluster: &RedisCluster) -> Target {
    Target {
        topology: Topology::Cluster(cluster.seeds()),
        ..Target::standalone("redis://127.0.0.1:1")
    }
}

#[test]
fn every_script_runs_in_one_slot_on_a_cluster() {
    let cluster = RedisCluster::start();
    let settings = settings();
    let layouts = quotad_daemon::testing::layouts(&settings);
    let policies = quotad_daemon::testing::policies(&settings);
    let target = cluster_target(&cluster);
    let mut conn = target.connect_sync(Duration::from_secs(2)).unwrap();

    // Each algorithm on a plain key and on a key of a group, then the group's composite.
    let mut grouped = Vec::new();
    for a in ALGORITHMS {
        let policy = policies.iter().find(|p| p.name == a).unwrap();
        let layout = layouts.by_name(a).unwrap();
        let limits = policy.limits();
        for key in [
            layout.storage_key("alice"),
            layout.grouped_key("acme", "alice"),
        ] {
            let reply: Vec<i64> = redis::Script::new(scripts::source(policy.algorithm))
                .key(&key)
                .arg("check")
                .arg(limits.limit)
                .arg(limits.window_us)
                .arg(limits.burst)
                .arg(1)
                .arg("m1")
                .arg(scripts::frame_args(&limits).0)
                .arg(scripts::frame_args(&limits).1)
                .invoke(&mut conn)
                .unwrap_or_else(|e| panic!("{a} on {key}: {e}"));
            assert_eq!(reply[0], 1, "{a}: the first check is allowed");
        }
        grouped.push((policy.algorithm, limits, layout.grouped_key("acme", "bob")));
    }
    // Hot-key slices: a take of two units for a check of one (so a slice is recorded) and
    // the return of its unit, by each algorithm that takes part.
    let slice = redis::Script::new(scripts::SLICE);
    let bucket_slice = redis::Script::new(scripts::BUCKET_SLICE);
    for a in ["fixed_window", "token_bucket", "gcra"] {
        let policy = policies.iter().find(|p| p.name == a).unwrap();
        let key = layouts.by_name(a).unwrap().storage_key("carol");
        let l = policy.limits();
        let back: i64 = if a == "fixed_window" {
            let took: Vec<i64> = slice
                .key(&key)
                .arg("take")
                .arg(l.limit)
                .arg(l.window_us)
                .arg(1)
                .arg(2)
                .arg(0)
                .arg(scripts::frame_args(&l).0)
                .arg(scripts::frame_args(&l).1)
                .invoke(&mut conn)
                .unwrap_or_else(|e| panic!("{a} slice take on {key}: {e}"));
            assert_eq!(took[0], 2, "{a}: {took:?}");
            slice
                .key(&key)
                .arg("return")
                .arg(took[3])
                .arg(took[4])
                .arg(1)
                .arg(scripts::frame_args(&l).0)
                .arg(scripts::frame_args(&l).1)
                .invoke(&mut conn)
                .unwrap_or_else(|e| panic!("{a} slice return on {key}: {e}"))
        } else {
            let kind = if a == "gcra" { "gc" } else { "tb" };
            let took: Vec<i64> = bucket_slice
                .key(&key)
                .arg("take")
                .arg(kind)
                .arg(l.limit)
                .arg(l.window_us)
                .arg(l.burst)
                .arg(1)
                .arg(2)
                .arg(0)
                .arg(1_000_000)
                .arg(0)
                .arg(0)
                .arg(scripts::frame_args(&l).0)
                .arg(scripts::frame_args(&l).1)
                .invoke(&mut conn)
                .unwrap_or_else(|e| panic!("{a} slice take on {key}: {e}"));
            assert!(took[0] == 2 && took[4] > 0, "{a}: {took:?}");
            bucket_slice
                .key(&key)
                .arg("return")
                .arg(kind)
                .arg(l.limit)
                .arg(l.window_us)
                .arg(l.burst)
                .arg(took[4])
                .arg(1)
                .arg(scripts::frame_args(&l).0)
                .arg(scripts::frame_args(&l).1)
                .invoke(&mut conn)
                .unwrap_or_else(|e| panic!("{a} slice return on {key}: {e}"))
        };
        assert_eq!(back, 1, "{a}: the slice's unit did not go back");
    }

    // A reservation beside its key, and its settlement: two keys, one slot.
    let settle = redis::Script::new(scripts::SETTLE);
    for a in ["fixed_window", "token_bucket", "gcra"] {
        let policy = policies.iter().find(|p| p.name == a).unwrap();
        let key = layouts.by_name(a).unwrap().storage_key("dave");
        let id = ReservationId::random();
        let reservation = PolicyLayout::reservation_key(&key, &id);
        assert_eq!(slot(&key), slot(&reservation), "{a}");
        assert_eq!(slot(&key), slot(&PolicyLayout::reset_mark_key(&key)), "{a}");
        let l = policy.limits();
        for (mode, cost) in [("reserve", 2), ("settle", 5)] {
            let reply: Vec<i64> = settle
                .key(&key)
                .key(&reservation)
                .key(PolicyLayout::reset_mark_key(&key))
                .arg(mode)
                .arg(policy.algorithm.key_tag())
                .arg(l.limit)
                .arg(l.window_us)
                .arg(l.burst)
                .arg(cost)
                .arg("m3")
                .arg(60_000)
                .arg("rl:invalidate")
                .arg(scripts::frame_args(&l).0)
                .arg(scripts::frame_args(&l).1)
                .invoke(&mut conn)
                .unwrap_or_else(|e| panic!("{a} {mode} on {key}: {e}"));
            assert_eq!(reply[0], 1, "{a} {mode}: {reply:?}");
        }
    }
    // A concurrency limit's lease: acquired and released.
    let concurrency = redis::Script::new(scripts::CONCURRENCY);
    let slots = settings
        .concurrency
        .iter()
        .find(|c| c.name == "slots")
        .unwrap();
    let key = layouts.of_concurrency(slots).storage_key("erin");
    for (mode, held) in [("acquire", 2), ("release", 0), ("acquire", 2), ("clear", 0)] {
        let reply: Vec<i64> = concurrency
            .key(&key)
            .key(PolicyLayout::ended_leases_key(&key))
            .arg(mode)
            .arg(5)
            .arg("0123456789abcdef0123456789abcdef")
            .arg(2)
            .arg(60_000_000)
            .invoke(&mut conn)
            .unwrap_or_else(|e| panic!("{mode} on {key}: {e}"));
        assert_eq!(reply[..2], [1, held], "{mode}: {reply:?}");
    }

    let composite = redis::Script::new(scripts::COMPOSITE);
    let mut inv = composite.prepare_invoke();
    for (_, _, key) in &grouped {
        inv.key(key);
    }
    for (alg, l, _) in &grouped {
        inv.arg(alg.key_tag())
            .arg(l.limit)
            .arg(l.window_us)
            .arg(l.burst)
            .arg(1)
            .arg("m2")
            .arg(1)
            .arg(scripts::frame_args(l).0)
            .arg(scripts::frame_args(l).1);
    }
    let reply: Vec<i64> = inv.invoke(&mut conn).expect("the composite script");
    assert_eq!(reply.len(), 4 * grouped.len());
    assert!(reply.chunks(4).all(|v| v[0] == 1), "{reply:?}");
    let group_slot = slot(&grouped[0].2);
    assert!(grouped.iter().all(|(_, _, k)| slot(k) == group_slot));
    assert_eq!(Algorithm::ALL.len(), grouped.len());

    // The coordinator's store, as a coordinator uses it.
    let entries = global_policies(&policies, &layouts);
    let g = entries["g"].global.clone();
    let fences: Vec<&str> = entries
        .values()
        .map(|p| p.global.keys.fence.as_str())
        .collect();
    let lock = Arc::new(Lock::new(
        layouts.layout(),
        "cluster-test".into(),
        Duration::from_secs(30),
        Duration::from_secs(30),
    ));
    let token = lock
        .try_acquire(&mut conn, &fences, incarnation::now_ms())
        .unwrap()
        .expect("the lock")
        .token;
    let global_settings = quotad_daemon::testing::global(&settings).expect("a global policy");
    let clock = RedisClock::new();
    let mut store = RedisLeaseStore::new(
        conn,
        clock.clone(),
        lock,
        token,
        entries,
        Duration::from_millis(500),
        &global_settings,
    );
    let mut book = LeaseBook::new(40.0);
    book.high_water = clock.now_us();
    // A write the replica has not acknowledged within the WAIT is not durable (the safe
    // answer: a round writes it again). On a busy machine the first WAIT may time out,
    // so the event is begun and the books written until one is; never a failure.
    wait_for("books written durably", Duration::from_secs(30), || {
        store.begin(true).unwrap();
        let written = store.write_books("g", &[("k1", &book), ("k2", &book)]);
        assert!(store.failure().is_none(), "{:?}", store.failure());
        written.iter().all(|w| w.durable).then_some(())
    });
    // A retried write finds the earlier one's book and raises its high-water mark to
    // Redis's now (it only rises); the rest is the book written.
    let read = store.read_book("g", "k1").expect("k1's book");
    assert!(read.high_water >= book.high_water, "{read:?}");
    assert_eq!(
        LeaseBook {
            high_water: book.high_water,
            ..read
        },
        book
    );
    assert_eq!(store.books("g").len(), 2);
    assert!(store.set_default_escrow("g", 45.0), "{:?}", store.failure());
    assert_eq!(store.default_escrow("g"), Some(45.0));

    // A decision on a global key, from a connection of the request path's kind.
    let mut conn = target.connect_sync(Duration::from_secs(2)).unwrap();
    let layout = layouts.by_name("g").unwrap();
    let check = scripts::Global::Check.script();
    let storage_key = layout.storage_key("k1");
    let key = global::GlobalKey {
        storage_key: &storage_key,
        user_key: "k1",
        keys: &g.keys,
        shape: &g.shape,
        limit: None,
    };
    let inv = global::check_invocation(&check, &key, Op::Check { cost: 1 }, None);
    let reply: Vec<i64> = inv.invoke(&mut conn).expect("the global check");
    assert_eq!(reply[0], 1);
    assert_eq!(store.take_active("g"), vec!["k1".to_owned()]);
    assert_eq!(store.counters("g", "k1").admitted, 1);

    // A lost replication-ID key reads as a failover: every loan is dropped, by script.
    let _: () = redis::cmd("DEL")
        .arg(&g.keys.replid)
        .query(&mut conn)
        .unwrap();
    store.begin(true).unwrap();
    assert!(store.take_failover(), "the failover was noticed");
    assert!(store.failure().is_none(), "{:?}", store.failure());

    // Everything of the global policy is in one slot, on one master.
    let policy_slot = slot(&g.keys.meta);
    for k in [
        &layout.storage_key("k2"),
        &g.keys.books,
        &g.keys.fence,
        &g.keys.active,
    ] {
        assert_eq!(slot(k), policy_slot, "{k}");
    }
    let holding = cluster
        .masters()
        .iter()
        .filter(|m| {
            redis::cmd("EXISTS")
                .arg(&g.keys.books)
                .query::<i64>(&mut m.conn())
                .unwrap_or(0) // MOVED: another master's slot
                == 1
        })
        .count();
    assert_eq!(holding, 1);
}
