//! Hot-key slices of token buckets and GCRA keys, in the scripts themselves
//! (`lua/bucket_slice.lua` beside `lua/token_bucket.lua` and `lua/gcra.lua`) on a real Redis
//! and its clock: while a slice is live, the bucket holds at most its burst less the
//! slice's units, so the tokens in Redis and the units an instance holds never pass the
//! burst together (the bucket's envelope, whatever the refill meanwhile); a return gives
//! the units back and ends the slice; a slice that ends unreturned frees the capacity
//! and its units are gone; a return after a reset gives nothing.

use quotad_core::algorithm::Algorithm;
use quotad_daemon::store::scripts;
use quotad_testkit::{RedisServer, wait_for};
use std::time::Duration;

/// 1,000 per second (one token a millisecond), burst 100.
const LIMIT: u64 = 1_000;
const WINDOW_US: i64 = 1_000_000;
const BURST: u64 = 100;

struct Bucket {
    redis: RedisServer,
    algorithm: Algorithm,
    key: &'static str,
}

impl Bucket {
    fn kind(&self) -> &'static str {
        match self.algorithm {
            Algorithm::Gcra => "gc",
            _ => "tb",
        }
    }

    /// A check of `cost` (0: a peek) through the algorithm's own script.
    fn check(&self, cost: u64) -> (bool, u64) {
        let r: Vec<i64> = redis::cmd("EVAL")
            .arg(scripts::source(self.algorithm))
            .arg(1)
            .arg(self.key)
            .arg("check")
            .arg(LIMIT)
            .arg(WINDOW_US)
            .arg(BURST)
            .arg(cost)
            .arg("m")
            .query(&mut self.redis.conn())
            .unwrap();
        (r[0] == 1, r[1] as u64)
    }

    /// A take of `demand` units for a check of 1, living `life`: (granted, slice id).
    fn take(&self, demand: u64, life: Duration) -> (u64, i64) {
        let r: Vec<i64> = redis::cmd("EVAL")
            .arg(scripts::BUCKET_SLICE)
            .arg(1)
            .arg(self.key)
            .arg("take")
            .arg(self.kind())
            .arg(LIMIT)
            .arg(WINDOW_US)
            .arg(BURST)
            .arg(1)
            .arg(demand)
            .arg(0)
            .arg(life.as_micros() as i64)
            .query(&mut self.redis.conn())
            .unwrap();
        (r[0] as u64, r[4])
    }

    fn give_back(&self, id: i64, units: u64) -> u64 {
        redis::cmd("EVAL")
            .arg(scripts::BUCKET_SLICE)
            .arg(1)
            .arg(self.key)
            .arg("return")
            .arg(self.kind())
            .arg(LIMIT)
            .arg(WINDOW_US)
            .arg(BURST)
            .arg(id)
            .arg(units)
            .query(&mut self.redis.conn())
            .unwrap()
    }
}

fn a_slice_counts_against_the_burst_until_it_goes_back(algorithm: Algorithm) {
    let b = Bucket {
        redis: RedisServer::start(),
        algorithm,
        key: "rl:hot:{k}",
    };
    // A slice of 59 (60 granted, 1 of them the taker's own check), living far longer
    // than the test.
    let (granted, id) = b.take(60, Duration::from_secs(60));
    assert_eq!(granted, 60);
    assert!(id > 0, "no slice recorded");
    // The refill (a token a millisecond) fills the bucket to the burst less the slice:
    // 41, and never more while the slice lives.
    wait_for(
        "the bucket at its lowered capacity",
        Duration::from_secs(10),
        || (b.check(0).1 == BURST - 59).then_some(()),
    );
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        b.check(0).1,
        BURST - 59,
        "{algorithm:?}: refilled past the slice"
    );
    assert!(
        !b.check(BURST - 59 + 1).0,
        "{algorithm:?}: admitted more than the burst less the units held"
    );
    // Given back: the units return and the capacity with them.
    assert_eq!(b.give_back(id, 59), 59);
    assert_eq!(
        b.check(0).1,
        BURST,
        "{algorithm:?}: the return did not refill"
    );
    assert_eq!(
        b.give_back(id, 59),
        0,
        "{algorithm:?}: a slice went back twice"
    );

    // A slice that ends unreturned: the capacity comes back, its units do not.
    let (granted, id) = b.take(80, Duration::from_millis(300));
    assert_eq!(granted, 80);
    assert!(b.check(0).1 <= BURST - 79);
    wait_for(
        "the slice's end frees the capacity",
        Duration::from_secs(10),
        || (b.check(0).1 == BURST).then_some(()),
    );
    assert_eq!(
        b.give_back(id, 79),
        0,
        "{algorithm:?}: units of an ended slice came back"
    );

    // After a reset (the key deleted) a return gives nothing.
    let (_, id) = b.take(40, Duration::from_secs(60));
    let _: () = redis::cmd("DEL")
        .arg(b.key)
        .query(&mut b.redis.conn())
        .unwrap();
    assert_eq!(
        b.give_back(id, 39),
        0,
        "{algorithm:?}: a return crossed a reset"
    );
    assert_eq!(b.check(0).1, BURST);
}

#[test]
fn a_token_bucket_slice_counts_against_the_burst_until_it_goes_back() {
    a_slice_counts_against_the_burst_until_it_goes_back(Algorithm::TokenBucket);
}

#[test]
fn a_gcra_slice_counts_against_the_burst_until_it_goes_back() {
    a_slice_counts_against_the_burst_until_it_goes_back(Algorithm::Gcra);
}
