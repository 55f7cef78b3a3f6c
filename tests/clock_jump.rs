//! A clock that jumped ahead must not lock a region out of its peers. Peers refuse an
//! incarnation later than the message's signed time plus `coordinator.max_skew` (so that
//! no value can wedge their "newer than" checks); a region must therefore never draw
//! one they would refuse for longer than that skew. Two real regions (eu, us), each with
//! its own redis-server and daemon, talk through loopback proxies; before eu starts, its
//! Redis holds what a clock that was an hour ahead would have left there.

use quotad_testkit as common;

use std::time::Duration;

use common::federation::{TWO_REGIONS as REGIONS, TwoRegions};
use common::{Config, Global, Peer, Policy, RedisServer, wait_for};
use quotad_daemon::testing::Layout;
use quotad_daemon::testing::federation::wall_ms;
use serde_json::Value;

const SECRET: &str = "clock-jump-test-secret-0123456789";
const HOUR_MS: i64 = 3_600_000;
/// The least skew a config allows: a rebased incarnation is accepted within it.
const MAX_SKEW_MS: i64 = 1_000;

struct Pair(TwoRegions);

impl Pair {
    /// Starts both regions; `before_eu` runs on eu's Redis before eu's daemon starts.
    fn start(before_eu: impl FnOnce(&RedisServer)) -> Pair {
        Pair(TwoRegions::start(|redis| before_eu(&redis[0]), config))
    }

    /// Waits until each region's coordinator sees the other connected (messages of the
    /// other's current incarnation accepted both ways).
    fn wait_connected(&self, within: Duration) {
        wait_for("both links connected", within, || {
            self.0
                .daemons
                .iter()
                .all(|d| {
                    let v: Value = d.json("/v1/status");
                    let peers = v["peers"].as_array().cloned().unwrap_or_default();
                    v["coordinator"]["leader"] == true
                        && !peers.is_empty()
                        && peers.iter().all(|p| p["link"] == "connected")
                })
                .then_some(())
        });
    }
}

fn config(me: usize, redis: &str, peer_url: &str) -> String {
    Config::redis(redis)
        .region(REGIONS[me])
        .coordinator("secret", SECRET)
        .coordinator("lock", "1s")
        .coordinator("max_skew", format!("{MAX_SKEW_MS}ms"))
        .peer(Peer::new(REGIONS[1 - me], peer_url))
        .policy(
            Policy::new("g", "token_bucket", 1000, "1s").global(
                Global::escrow(&[("eu", 1), ("us", 1)])
                    .set("round", "200ms")
                    .set("lease", "2s"),
            ),
        )
        .to_toml()
}

fn set(redis: &RedisServer, key: &str, value: i64) {
    let _: () = redis::cmd("SET")
        .arg(key)
        .arg(value)
        .query(&mut redis.conn())
        .unwrap();
}

fn get(redis: &RedisServer, key: &str) -> i64 {
    redis::cmd("GET").arg(key).query(&mut redis.conn()).unwrap()
}

/// A takeover while Redis's clock was an hour ahead left the fencing counter an hour
/// ahead (the region's last incarnation was drawn a minute ago). The incarnation comes
/// from the daemon's clock, so the peer never sees one from the future: it refuses
/// nothing, and the fence still only grows.
#[test]
fn a_redis_clock_that_jumped_ahead_does_not_lock_the_region_out() {
    let layout = Layout::new("rl");
    let ahead = wall_ms() + HOUR_MS;
    let pair = Pair::start(|eu| {
        set(eu, &layout.fence_key(), ahead);
        set(eu, &layout.incarnation_key(), wall_ms() - 60_000);
    });
    pair.wait_connected(Duration::from_secs(10));
    let us = &pair.0.daemons[1];
    assert_eq!(
        us.metric("quotad_exchange_rejected_total{reason=\"invalid\"}"),
        0.0,
        "the peer refused none of eu's exchanges"
    );
    assert!(
        get(&pair.0.redis[0], &layout.fence_key()) > ahead,
        "the fencing token went on above the counter it found"
    );
    let incarnation = get(&pair.0.redis[0], &layout.incarnation_key());
    assert!(
        incarnation <= wall_ms() + MAX_SKEW_MS,
        "eu's incarnation {incarnation} follows its own clock"
    );
    assert_eq!(
        pair.0.daemons[0].metric("quotad_incarnation_rebases_total"),
        0.0
    );
}

/// A takeover while the daemon's own host clock was an hour ahead left the region's last
/// incarnation an hour ahead. No peer can have accepted it, so the next takeover starts
/// again below it, at most 2 × max_skew ahead, and the peer accepts the region within
/// max_skew instead of an hour.
#[test]
fn an_incarnation_from_the_future_is_left_behind_at_the_next_takeover() {
    let layout = Layout::new("rl");
    let ahead = wall_ms() + HOUR_MS;
    let pair = Pair::start(|eu| set(eu, &layout.incarnation_key(), ahead));
    pair.wait_connected(Duration::from_secs(10));
    let eu = &pair.0.daemons[0];
    assert_eq!(eu.metric("quotad_incarnation_rebases_total"), 1.0);
    let incarnation = get(&pair.0.redis[0], &layout.incarnation_key());
    assert!(
        incarnation <= wall_ms() + 2 * MAX_SKEW_MS + 1,
        "eu's incarnation {incarnation} was drawn again from its clock"
    );
}
