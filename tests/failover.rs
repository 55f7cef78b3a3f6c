//! A Redis failover (or a restart that reloaded its data) may bring back loans the region
//! had already dropped; the coordinator drops every loan when it finds the books were
//! written under another replication ID, even as a coordinator that only just connected
//! (the ID is kept in Redis, replicated with the books).

use quotad_testkit as common;

use std::sync::Arc;
use std::time::Duration;

use common::federation::{eu_with_silent_us, even_escrow};
use common::{Policy, RedisServer};
use quotad_core::clock::Clock;
use quotad_core::coordinator::RegionId;
use quotad_core::coordinator::lease::{LeaseBook, Loan, Reservation};
use quotad_core::coordinator::node::LeaseStore;
use quotad_daemon::Settings;
use quotad_daemon::testing::Layout;
use quotad_daemon::testing::federation as incarnation;
use quotad_daemon::testing::federation::Coordinated;
use quotad_daemon::testing::federation::Lock;
use quotad_daemon::testing::federation::global_policies;
use quotad_daemon::testing::federation::{RedisClock, RedisLeaseStore};

fn store(redis: &RedisServer) -> (RedisLeaseStore, RedisClock) {
    let config = eu_with_silent_us(&redis.url(), "0123456789abcdef")
        .policy(Policy::new("g", "token_bucket", 100, "1s").global(even_escrow()))
        .to_toml();
    let settings = Settings::parse("failover.toml", &config).unwrap();
    let global = quotad_daemon::testing::global(&settings).expect("a global policy");
    let layouts = quotad_daemon::testing::layouts(&settings);
    let policies = quotad_daemon::testing::policies(&settings);
    let lock = Arc::new(Lock::new(
        &Layout::new("rl"),
        format!("test-{}", rand::random::<u32>()),
        Duration::from_secs(30),
        Duration::from_secs(30),
    ));
    let mut conn = redis.conn();
    // A new holder each time (the previous one's lock is gone with the restart, or released).
    let _: () = redis::cmd("DEL")
        .arg(Layout::new("rl").lock_key())
        .query(&mut conn)
        .unwrap();
    let entries = global_policies(&policies, &layouts);
    let fences: Vec<&str> = entries
        .values()
        .map(|p| p.global.keys.fence.as_str())
        .collect();
    let token = lock
        .try_acquire(&mut conn, &fences, incarnation::now_ms())
        .unwrap()
        .expect("the lock")
        .token;
    let clock = RedisClock::new();
    let s = RedisLeaseStore::new(
        quotad_daemon::testing::redis::SyncConn::Single(conn),
        clock.clone(),
        lock,
        token,
        entries,
        Duration::from_millis(500),
        &global,
    );
    (s, clock)
}

fn book(now: i64) -> LeaseBook {
    let mut b = LeaseBook::new(50.0);
    b.borrowed.push(Loan {
        lender: RegionId(1),
        lender_incarnation: 3,
        seq: 7,
        amount: 30.0,
        until: now + 30_000_000,
    });
    b.reserved.push(Reservation {
        borrower: RegionId(1),
        seq: 2,
        amount: 10.0,
        until: now + 30_000_000,
    });
    b.high_water = now;
    b
}

#[test]
fn a_new_replication_id_drops_every_loan_and_keeps_reservations() {
    let mut redis = RedisServer::start_persistent();
    let (mut s, clock) = store(&redis);
    s.begin(true).unwrap();
    let written = s.write_book("g", "k", &book(clock.now_us()));
    assert!(written.durable && written.epoch == 0);
    // A round under the same ID changes nothing.
    s.begin(true).unwrap();
    let b = s.read_book("g", "k").expect("book");
    assert_eq!(b.borrowed.len(), 1);

    // Restart with the data (AOF): a new replication ID, the old one in the books' key.
    drop(s);
    redis.restart();
    let (mut s, _) = store(&redis);
    s.begin(true).unwrap();
    assert!(s.failure().is_none(), "{:?}", s.failure());
    let b = s
        .read_book("g", "k")
        .expect("the book survived the restart");
    assert!(
        b.borrowed.is_empty(),
        "loans must go after a failover: {b:?}"
    );
    assert_eq!(
        b.epoch, 1,
        "and the epoch rises, so no stale copy brings them back"
    );
    assert_eq!(
        b.reserved.len(),
        1,
        "reservations stay: dropping them would not be safe"
    );
    // The next round is under the new ID: nothing more to drop, nothing else changes.
    s.begin(true).unwrap();
    assert_eq!(s.read_book("g", "k").unwrap(), b);
}

/// The books index is pruned of expired keys only by the current coordinator: one that
/// lost the lock must not remove what the new one may have just added.
#[test]
fn a_deposed_coordinator_cannot_prune_the_books_index() {
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let (mut old, clock) = store(&redis);
    old.begin(true).unwrap();
    assert!(old.write_book("g", "gone", &book(clock.now_us())).durable);
    // The key's hash expires (idle for the keep time); its name stays in the index.
    let _: () = redis::cmd("DEL")
        .arg("rl:g:g:{rl:g}:{gone}")
        .query(&mut conn)
        .unwrap();
    let listed = |conn: &mut redis::Connection| -> bool {
        redis::cmd("SISMEMBER")
            .arg("rl:g:g:{rl:g}:books")
            .arg("gone")
            .query(conn)
            .unwrap()
    };
    let (mut new, _) = store(&redis); // takes the lock over: a higher token
    assert!(old.books("g").is_empty());
    assert!(
        listed(&mut conn),
        "the deposed coordinator pruned the index"
    );
    new.begin(true).unwrap();
    assert!(new.books("g").is_empty());
    assert!(!listed(&mut conn), "the current coordinator prunes it");
}
