//! The coordinator at scale: a region whose Redis holds the books of many hot keys of a
//! global policy (each lent to a peer, so each is planned, re-asserted and reported every
//! round) loses its coordinator; a standby quotad takes the lock, loads every book in
//! pipelined batches, and keeps the lock and its rounds going: it never loses the lock to
//! its own slowness, and exchanges stay within the key cap.
//!
//! 20,000 keys in the suite (a debug build). The figure for 100,000 comes from a release
//! build: `QUOTAD_SCALE_KEYS=100000 cargo test --release --test suite coordinator_scale:: --
//! --nocapture` prints the takeover and round times.
//!
//! A process daemon (`Quotad::start`): the takeover and round times are read from its log.

use quotad_testkit as common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::federation::{eu_with_silent_us, even_escrow};
use common::{Policy, Quotad, RedisServer, wait_for};
use quotad_core::clock::Clock;
use quotad_core::coordinator::RegionId;
use quotad_core::coordinator::lease::{LeaseBook, Reservation};
use quotad_core::coordinator::node::LeaseStore;
use quotad_daemon::Settings;
use quotad_daemon::testing::Layout;
use quotad_daemon::testing::federation as incarnation;
use quotad_daemon::testing::federation::Coordinated;
use quotad_daemon::testing::federation::Lock;
use quotad_daemon::testing::federation::global_policies;
use quotad_daemon::testing::federation::{RedisClock, RedisLeaseStore};

/// Regions sorted: eu = 0 (the daemon), us = 1 (a peer that never answers).
fn config(redis: &RedisServer) -> String {
    eu_with_silent_us(&redis.url(), "0123456789abcdef")
        .coordinator("lock", "3s")
        .policy(Policy::new("g", "token_bucket", 100, "1s").global(even_escrow()))
        .to_toml()
}

/// Writes `n` books, each with a live reservation for us, as the region's previous
/// coordinator did; then that coordinator dies (its lock is gone).
fn previous_coordinator_wrote(redis: &RedisServer, n: usize) {
    let settings = Settings::parse("scale.toml", &config(redis)).unwrap();
    let global = quotad_daemon::testing::global(&settings).expect("a global policy");
    let layouts = quotad_daemon::testing::layouts(&settings);
    let policies = quotad_daemon::testing::policies(&settings);
    let lock = Arc::new(Lock::new(
        &Layout::new("rl"),
        "previous".into(),
        Duration::from_secs(30),
        Duration::from_secs(30),
    ));
    let mut conn = redis.conn();
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
    let mut store = RedisLeaseStore::new(
        quotad_daemon::testing::redis::SyncConn::Single(conn),
        clock.clone(),
        lock,
        token,
        entries,
        Duration::from_millis(500),
        &global,
    );
    store.begin(true).unwrap();
    let now = clock.now_us();
    let mut book = LeaseBook::new(50.0);
    book.reserved.push(Reservation {
        borrower: RegionId(1),
        seq: 1,
        amount: 10.0,
        until: now + 120_000_000,
    });
    book.high_water = now;
    let keys: Vec<String> = (0..n).map(|i| format!("key-{i}")).collect();
    let books: Vec<(&str, &LeaseBook)> = keys.iter().map(|k| (k.as_str(), &book)).collect();
    let started = Instant::now();
    let written = store.write_books("g", &books);
    assert!(written.iter().all(|w| w.durable), "{:?}", store.failure());
    eprintln!("wrote {n} books in {:?}", started.elapsed());
    let _: () = redis::cmd("DEL")
        .arg(Layout::new("rl").lock_key())
        .query(&mut redis.conn())
        .unwrap();
}

fn scale() -> usize {
    std::env::var("QUOTAD_SCALE_KEYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000)
}

/// `took_ms=...` of the log line that announces the takeover.
fn takeover_ms(log: &str) -> Option<u64> {
    let line = log.lines().find(|l| l.contains("coordinator lock taken"))?;
    line.split("took_ms=")
        .nth(1)?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[test]
fn a_standby_loads_every_book_and_keeps_the_lock_and_its_rounds() {
    let n = scale();
    let redis = RedisServer::start();
    previous_coordinator_wrote(&redis, n);
    let started = Instant::now();
    let q = Quotad::start(&config(&redis));
    let log = wait_for("the takeover", Duration::from_secs(60), || {
        let log = q.log();
        log.contains("coordinator lock taken").then_some(log)
    });
    let took = takeover_ms(&log).expect("took_ms in the takeover line");
    assert!(
        log.contains(&format!("keys={n}")),
        "every book adopted: {log}"
    );
    // Rounds go on, each one writing every book, and the lock stays.
    let want = std::env::var("QUOTAD_SCALE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5.0);
    let first = wait_for("the rounds", Duration::from_secs(120), || {
        (q.metric("quotad_rounds_total") >= want).then_some(started.elapsed())
    });
    let log = q.log();
    for lost in [
        "lock lost",
        "renewal failed",
        "start failed",
        "store failed mid-event",
    ] {
        assert!(!log.contains(lost), "{lost}: {log}");
    }
    assert_eq!(q.metric("quotad_coordinator_leader{region=\"eu\"}"), 1.0);
    let rounds = q.metric("quotad_round_duration_seconds_count");
    let round_s = q.metric("quotad_round_duration_seconds_sum") / rounds;
    let durations: Vec<String> = q
        .log()
        .lines()
        .filter(|l| l.contains("round took"))
        .filter_map(|l| {
            l.split("took_ms=")
                .nth(1)?
                .split_whitespace()
                .next()
                .map(str::to_owned)
        })
        .collect();
    eprintln!("rounds over a quarter of the lock period (ms): {durations:?}");
    // The exchange to us carries at most the cap; the rest waits its turn.
    let status = q.json("/v1/status");
    let deferred = status["coordinator"]["stats"]["keys_deferred"]
        .as_u64()
        .unwrap();
    assert!(n <= 10_000 || deferred > 0, "{status}");
    eprintln!(
        "{n} keys: lock taken and books loaded in {took} ms; mean round {:.0} ms over {rounds} rounds; \
         {want} rounds done {first:?} after start; keys deferred by the exchange cap {deferred}",
        round_s * 1000.0
    );
}
