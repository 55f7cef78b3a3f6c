//! The exchange between real regions in its binary form: hot keys cross at a few bytes
//! each, a region pinned to the JSON envelope (as versions before the binary form) and
//! one on the binary form still lend to each other, and a peer that lost our key numbers
//! (a restart) is sent the keys spelled out again. Two regions (eu, us), a redis-server
//! and a daemon each; load is many keys of one global policy, each checked in batches.
//!
//! The figure for 100,000 keys comes from a release build (about 7 minutes):
//! `QUOTAD_WIRE_KEYS=100000 cargo test --release --all-features --test suite exchange_wire::hot -- --nocapture`.

use quotad_testkit as common;

use std::time::Duration;

use common::federation::{TWO_REGIONS as REGIONS, TwoRegions};
use common::load::ManyKeys;
use common::{Config, Global, Peer, Policy, Quotad, wait_for};
use serde_json::Value;

const SECRET: &str = "exchange-wire-test-secret-0123456789";
/// Per key: ρ 10/s, eu's escrow 2, us's 8. eu's load is 4/s per key, so each key borrows.
const RHO: u64 = 10;

/// Two regions; `encoding[i]` is region i's `coordinator.exchange_encoding`.
fn start(encoding: [&'static str; 2]) -> TwoRegions {
    TwoRegions::start(
        |_| {},
        move |me, redis, peer| config(me, redis, peer, encoding[me], 200_000),
    )
}

fn config(me: usize, redis: &str, peer_url: &str, encoding: &str, cap: usize) -> String {
    Config::redis(redis)
        .region(REGIONS[me])
        .coordinator("secret", SECRET)
        .coordinator("lock", timing().2)
        .coordinator("exchange_encoding", encoding)
        .coordinator("max_exchange_keys", cap as i64)
        .peer(Peer::new(REGIONS[1 - me], peer_url))
        .policy(
            Policy::new("g", "token_bucket", RHO, "1s")
                .burst(100)
                .global(
                    Global::escrow(&[("eu", 1), ("us", 4)])
                        .set("round", timing().0)
                        .set("lease", timing().1),
                ),
        )
        .to_toml()
}

/// Round, lease and lock: short in the suite. At 10,000 keys and more, long enough for
/// a round of that many keys, with the load and both regions on the same two cores (a
/// round of 100,000 borrowing keys took 4-7 s in a release build here), and the peer's
/// exchange after it.
fn timing() -> (&'static str, &'static str, &'static str) {
    match keys_in_test() {
        0..=1_000 => ("250ms", "1s", "1s"),
        1_001..=10_000 => ("3s", "12s", "15s"),
        _ => ("20s", "80s", "60s"),
    }
}

fn key(i: usize) -> String {
    format!("customer-{i:06}")
}

/// Offers each of `keys` keys 4 units/s in the daemon at `port` until dropped.
fn key_load(port: u16, keys: usize) -> ManyKeys {
    ManyKeys::start(
        "g",
        vec![(port, (0..keys).map(key).collect())],
        4.0,
        Duration::from_millis(500),
    )
}

/// `key`'s entry on a status page.
fn key_on(page: &Value, key: &str) -> Option<Value> {
    page["policies"]
        .as_array()?
        .iter()
        .flat_map(|p| p["keys"].as_array().cloned().unwrap_or_default())
        .find(|k| k["key"] == key)
}

/// `key`'s entry on `daemon`'s status page now.
fn status_key(daemon: &Quotad, key: &str) -> Option<Value> {
    key_on(&daemon.json("/v1/status"), key)
}

fn borrowed(daemon: &Quotad, key: &str) -> f64 {
    status_key(daemon, key)
        .and_then(|k| k["borrowed"].as_f64())
        .unwrap_or(0.0)
}

/// The enforced rate of `key` on `daemon`'s status page, and the instant (µs of the
/// region's Redis clock) at which the page holds.
fn enforced_at(daemon: &Quotad, key: &str) -> Option<(i64, f64)> {
    let page: Value = daemon.json("/v1/status");
    let at = page["coordinator"]["as_of_us"].as_i64()?;
    Some((at, key_on(&page, key)?["enforced"].as_f64()?))
}

/// What the two regions' metrics say of their link, at one moment: rounds of eu, bytes
/// both sent (exchanges with their retries, and replies), keys both reported.
#[derive(Debug, Clone, Copy)]
struct Wire {
    rounds: f64,
    bytes: f64,
    keys: f64,
}

fn wire(pair: &TwoRegions) -> Wire {
    let sent = |d: &Quotad, peer: &str| {
        let bytes = d.metric(&format!(
            "quotad_exchange_bytes_total{{direction=\"sent\",peer=\"{peer}\"}}"
        ));
        let keys = d.metric(&format!("quotad_exchange_keys_total{{peer=\"{peer}\"}}"));
        (bytes, keys)
    };
    let (eu_bytes, eu_keys) = sent(pair.eu(), "us");
    let (us_bytes, us_keys) = sent(pair.us(), "eu");
    Wire {
        rounds: pair.eu().metric("quotad_rounds_total"),
        bytes: eu_bytes + us_bytes,
        keys: eu_keys + us_keys,
    }
}

fn keys_in_test() -> usize {
    std::env::var("QUOTAD_WIRE_KEYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300)
}

/// Every key of the load borrows from us, so each is in every exchange both ways with a
/// loan: its ask, its release, its grant. Over ten rounds, the bytes both regions sent
/// over the keys both reported: the exchange's cost per key and round (JSON: about 92).
#[test]
fn hot_keys_cross_in_the_binary_form_at_under_forty_bytes_a_key() {
    let n = keys_in_test();
    let pair = start(["binary", "binary"]);
    let _load = key_load(pair.eu().port, n);
    wait_for(
        "every key tracked, and borrowing",
        Duration::from_secs(600),
        || {
            let tracked = |d: &Quotad| d.metric("quotad_hot_keys{policy=\"g\"}") >= n as f64;
            let borrowing = pair.eu().metric("quotad_borrowed_rate{policy=\"g\"}") > 0.0;
            (tracked(pair.eu()) && tracked(pair.us()) && borrowing).then_some(())
        },
    );
    assert_eq!(pair.eu().metric("quotad_exchange_binary{peer=\"us\"}"), 1.0);
    let cpu = |d: &Quotad| d.metric("quotad_coordinator_cpu_seconds_total");
    let cpu_before = [cpu(pair.eu()), cpu(pair.us())];
    let before = wire(&pair);
    wait_for("ten more rounds", Duration::from_secs(600), || {
        (pair.eu().metric("quotad_rounds_total") >= before.rounds + 10.0).then_some(())
    });
    let after = wire(&pair);
    let cpu_spent = [
        cpu(pair.eu()) - cpu_before[0],
        cpu(pair.us()) - cpu_before[1],
    ];
    let rounds = after.rounds - before.rounds;
    let bytes = after.bytes - before.bytes;
    let keys = after.keys - before.keys;
    let per_key = bytes / keys;
    eprintln!(
        "{n} keys: {rounds} rounds, {bytes} bytes both ways for {keys} key reports: \
         {per_key:.1} bytes per key and round, {:.0} keys per round",
        keys / rounds
    );
    assert!(
        keys >= rounds * n as f64 * 0.9,
        "most keys in every exchange: {keys}"
    );
    assert!(per_key < 40.0, "{per_key} bytes per key");
    eprintln!(
        "coordinator CPU over those rounds: eu {:.3} s, us {:.3} s",
        cpu_spent[0], cpu_spent[1]
    );
    assert!(
        cpu_spent.iter().all(|&s| s > 0.0),
        "both coordinators' threads ran: {cpu_spent:?}"
    );
    let ours = pair
        .eu()
        .metric("quotad_exchange_dictionary_keys{peer=\"us\",side=\"ours\"}");
    let theirs = pair
        .us()
        .metric("quotad_exchange_dictionary_keys{peer=\"eu\",side=\"theirs\"}");
    assert!(
        ours >= n as f64 && theirs >= n as f64,
        "dictionaries: {ours}, {theirs}"
    );
    assert_eq!(
        pair.us()
            .metric("quotad_exchange_rejected_total{reason=\"malformed\"}"),
        0.0
    );
    assert_eq!(
        pair.eu().metric("quotad_exchange_keys_deferred_total"),
        0.0,
        "a cap above the hot keys defers none"
    );
    assert!(
        pair.eu().metric("quotad_sense_duration_seconds_count") > 0.0,
        "the coordinator reads demand between rounds"
    );
}

/// More keys are hot than an exchange may carry (300 against a cap of 100): the most
/// pressing go, and the operator sees the rest counted as deferred, not dropped in
/// silence; the region still borrows for the keys that went.
#[test]
fn keys_beyond_the_exchange_cap_are_counted_as_deferred() {
    let pair = TwoRegions::start(
        |_| {},
        |me, redis, peer| config(me, redis, peer, "binary", 100),
    );
    let _load = key_load(pair.eu().port, 300);
    wait_for(
        "keys deferred, and some borrowing",
        Duration::from_secs(60),
        || {
            let deferred = pair.eu().metric("quotad_exchange_keys_deferred_total");
            let borrowing = pair.eu().metric("quotad_borrowed_rate{policy=\"g\"}") > 0.0;
            (deferred > 0.0 && borrowing).then_some(deferred)
        },
    );
    let status: Value = pair.eu().json("/v1/status");
    assert!(
        status["coordinator"]["stats"]["keys_deferred"].as_u64() > Some(0),
        "/v1/status: {}",
        status["coordinator"]["stats"]
    );
}

/// us speaks only JSON (as a version before the binary form): it refuses eu's first
/// binary exchange as malformed, eu sends it JSON from then on, and the loans flow as
/// before. What both enforce for a key never sums past ρ at any instant.
///
/// Each status page holds at the instant it names (`as_of_us`, the region's Redis clock:
/// both Redis servers here read one host clock), and pages are published after events,
/// so two pages read one after the other hold at different instants. eu grows only after
/// us has shrunk, and us grows only after eu has shrunk; so eu's page is read before and
/// after us's, a reading counts only where eu's two instants bracket us's within a tenth
/// of a second, and the smaller of eu's two figures is the one summed: a give-back
/// between them (eu down, then us up) shows in eu's first figure only, a breach in both.
#[test]
fn a_region_on_the_json_envelope_and_one_on_the_binary_form_keep_lending() {
    let pair = start(["binary", "json"]);
    let _load = key_load(pair.eu().port, 50);
    wait_for("eu borrowing from us", Duration::from_secs(30), || {
        (borrowed(pair.eu(), &key(0)) > 0.0).then_some(())
    });
    assert_eq!(pair.eu().metric("quotad_exchange_binary{peer=\"us\"}"), 0.0);
    assert!(
        pair.us()
            .metric("quotad_exchange_rejected_total{reason=\"malformed\"}")
            >= 1.0
    );
    assert_eq!(pair.us().metric("quotad_exchange_binary{peer=\"eu\"}"), 0.0);
    let (mut bracketed, mut above_escrow) = (0, 0);
    let started = std::time::Instant::now();
    while bracketed < 20 && started.elapsed() < Duration::from_secs(60) {
        let page = |d: &Quotad| enforced_at(d, &key(0));
        let (Some((a1, before)), Some((b, us)), Some((a2, after))) =
            (page(pair.eu()), page(pair.us()), page(pair.eu()))
        else {
            continue;
        };
        if !(a1 <= b && b <= a2 && a2 - a1 <= 100_000) {
            continue;
        }
        bracketed += 1;
        let eu = before.min(after);
        assert!(
            eu + us <= RHO as f64 + 1e-9,
            "eu {before} at {a1} then {after} at {a2} + us {us} at {b} > {RHO}"
        );
        above_escrow += (eu > 2.0) as usize;
    }
    eprintln!(
        "bracketed {bracketed} in {:?}, above escrow {above_escrow}",
        started.elapsed()
    );
    assert_eq!(bracketed, 20, "pages of eu bracketing one of us's");
    assert!(above_escrow > 0, "eu never enforced more than its escrow");
}

/// us restarts: its new process has none of eu's key numbers, refuses them (409), and eu
/// starts its numbering over; the keys borrow again. Then eu restarts, and us takes its
/// new numbering without refusing anything.
#[test]
fn a_restarted_peer_is_sent_the_keys_spelled_out_again() {
    let mut pair = start(["binary", "binary"]);
    let _load = key_load(pair.eu().port, 50);
    wait_for("eu borrowing from us", Duration::from_secs(30), || {
        (borrowed(pair.eu(), &key(0)) > 0.0).then_some(())
    });
    assert_eq!(
        pair.eu()
            .metric("quotad_exchange_renumbered_total{peer=\"us\"}"),
        0.0
    );
    pair.daemons[1].restart();
    wait_for(
        "eu renumbering its keys for us",
        Duration::from_secs(30),
        || {
            (pair
                .eu()
                .metric("quotad_exchange_renumbered_total{peer=\"us\"}")
                >= 1.0)
                .then_some(())
        },
    );
    assert!(
        pair.us()
            .metric("quotad_exchange_rejected_total{reason=\"unknown_keys\"}")
            >= 1.0
    );
    let renumbered = pair
        .eu()
        .metric("quotad_exchange_renumbered_total{peer=\"us\"}");
    wait_for("us lending again", Duration::from_secs(30), || {
        let lent = status_key(pair.us(), &key(0)).and_then(|k| k["lent"].as_f64());
        (lent.unwrap_or(0.0) > 0.0).then_some(())
    });
    assert_eq!(pair.eu().metric("quotad_exchange_binary{peer=\"us\"}"), 1.0);
    assert_eq!(
        pair.eu()
            .metric("quotad_exchange_renumbered_total{peer=\"us\"}"),
        renumbered,
        "once renumbered, the numbers hold"
    );
    // eu restarts: a new incarnation, a numbering from the start, which us takes as a
    // new table rather than refusing it.
    let refused = pair
        .us()
        .metric("quotad_exchange_rejected_total{reason=\"unknown_keys\"}");
    pair.daemons[0].restart();
    wait_for("eu borrowing again", Duration::from_secs(30), || {
        (borrowed(pair.eu(), &key(0)) > 0.0).then_some(())
    });
    assert_eq!(
        pair.us()
            .metric("quotad_exchange_rejected_total{reason=\"unknown_keys\"}"),
        refused,
        "a restarted sender's numbers are taken, not refused"
    );
}
