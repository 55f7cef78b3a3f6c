//! Hot-key slices of token buckets and GCRA keys, in the scripts themselves
//! (`lua/bucket_slice.lua` beside `lua/token_bucket.lua` and `lua/gcra.lua`) on a real Redis
//! and its clock: while a slice is live, the bucket holds at most its burst less the
//! slice's units, so the tokens in Redis and the units an instance holds never pass the
//! burst together (the bucket's envelope, whatever the refill meanwhile); a return gives
//! the units back and ends the slice; a slice that ends unreturned frees the capacity
//! and its units are gone; a return after a reset gives nothing. Then through four
//! daemons: what they admit together stays inside the bucket's envelope.

use quotad_core::algorithm::Algorithm;
use quotad_daemon::testing::redis as scripts;
use quotad_testkit::{Config, Policy, Quotad, RedisServer, wait_for};
use std::time::Duration;

/// 1,000 per second (one token a millisecond), burst 100.
const LIMIT: u64 = 1_000;
const WINDOW_US: i64 = 1_000_000;
const BURST: u64 = 100;
/// The numbers above as the scripts take them (`scripts::frame_args`).
const FRAME: &str = "1000:1000000:100";

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
            .arg(FRAME)
            .arg("0")
            .query(&mut self.redis.conn())
            .unwrap();
        (r[0] == 1, r[1] as u64)
    }

    /// A take of `demand` units for a check of 1, living `life`, ending slice `ends` (id,
    /// unspent units; id 0: none): (granted, slice id, units given back).
    fn take(&self, demand: u64, life: Duration, ends: (i64, u64)) -> (u64, i64, u64) {
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
            .arg(ends.0)
            .arg(ends.1)
            .arg(FRAME)
            .arg("0")
            .query(&mut self.redis.conn())
            .unwrap();
        (r[0] as u64, r[4], r[6] as u64)
    }

    /// Gives back `units` an instance spent from slice `id` (a denied batch's refund).
    fn refund_spent(&self, id: i64, units: u64) {
        let _: Vec<i64> = self.on_slice("refund", id, units);
    }

    fn give_back(&self, id: i64, units: u64) -> u64 {
        self.on_slice("return", id, units)
    }

    /// `op` (`return`, `refund`) on slice `id` with `units`.
    fn on_slice<T: redis::FromRedisValue>(&self, op: &str, id: i64, units: u64) -> T {
        redis::cmd("EVAL")
            .arg(scripts::BUCKET_SLICE)
            .arg(1)
            .arg(self.key)
            .arg(op)
            .arg(self.kind())
            .arg(LIMIT)
            .arg(WINDOW_US)
            .arg(BURST)
            .arg(id)
            .arg(units)
            .arg(FRAME)
            .arg("0")
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
    let (granted, id, _) = b.take(60, Duration::from_secs(60), (0, 0));
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
    let (granted, id, _) = b.take(80, Duration::from_millis(300), (0, 0));
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

    // The next take ends the previous slice: its capacity (and what it had left) comes
    // back at once, and only the new slice lowers the burst.
    let (_, first, _) = b.take(50, Duration::from_secs(60), (0, 0));
    let (granted, second, back) = b.take(10, Duration::from_secs(60), (first, 4));
    assert_eq!((granted, back), (10, 4), "{algorithm:?}");
    assert_eq!(
        b.give_back(first, 1),
        0,
        "{algorithm:?}: an ended slice went back"
    );
    wait_for(
        "the capacity of the ended slice back",
        Duration::from_secs(10),
        || (b.check(0).1 == BURST - 9).then_some(()),
    );
    assert_eq!(b.give_back(second, 9), 9);

    // After a reset (the key deleted) a return gives nothing.
    let (_, id, _) = b.take(40, Duration::from_secs(60), (0, 0));
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

/// Units an instance spent from its slice and then refunded (a batch denied by another
/// check), after the slice left the instance's table but while Redis still holds it: the
/// slice stops holding them, so the capacity it lowers rises by them with the tokens.
/// A plain refund there was capped at the lowered capacity and lost them. Once the slice
/// has ended, such a refund is a plain one.
fn a_refund_of_what_a_slice_spent_lifts_the_slice(algorithm: Algorithm) {
    let b = Bucket {
        redis: RedisServer::start(),
        algorithm,
        key: "rl:hot:{k}",
    };
    // A slice of 59; the instance spends 10 of them, then refunds them.
    let (_, id, _) = b.take(60, Duration::from_secs(60), (0, 0));
    b.refund_spent(id, 10);
    // The slice holds 49 now: the bucket refills to 51, and no further.
    wait_for(
        "the capacity the refund lifted",
        Duration::from_secs(10),
        || (b.check(0).1 == BURST - 49).then_some(()),
    );
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(b.check(0).1, BURST - 49, "{algorithm:?}: past the slice");
    // Its 49 unspent units back: the whole burst.
    assert_eq!(b.give_back(id, 49), 49);
    assert_eq!(b.check(0).1, BURST, "{algorithm:?}");
    // An ended slice: a plain refund (of a spend below the burst).
    assert!(b.check(30).0);
    b.refund_spent(id, 30);
    let left = b.check(0).1;
    assert!(left >= BURST - 1, "{algorithm:?}: {left} after the refund");
}

#[test]
fn a_refund_of_what_a_token_bucket_slice_spent_lifts_the_slice() {
    a_refund_of_what_a_slice_spent_lifts_the_slice(Algorithm::TokenBucket);
}

#[test]
fn a_refund_of_what_a_gcra_slice_spent_lifts_the_slice() {
    a_refund_of_what_a_slice_spent_lifts_the_slice(Algorithm::Gcra);
}

/// Redis's clock, in microseconds.
fn redis_now_us(redis: &RedisServer) -> i64 {
    let (secs, us): (i64, i64) = redis::cmd("TIME").query(&mut redis.conn()).unwrap();
    secs * 1_000_000 + us
}

/// Four daemons (processes), one hot key of a token bucket and of a GCRA key at 1,000 a
/// second with a burst of 100, each daemon's client checking it in pulses for 3 s (150
/// ms on, 100 ms off): the sum admitted stays inside the envelope, the burst plus the
/// rate times the span between Redis's clock before the first check and after the last,
/// and slices were in play (units beyond their takes' own checks). A slice spent twice,
/// or given back twice, breaks it; the lowered capacity itself is shown by the tests
/// above (at this load the slices are small: the bucket is near empty).
#[test]
fn four_instances_on_a_hot_bucket_admit_within_its_envelope() {
    const RATE: u64 = 1_000;
    const BUCKET: u64 = 100;
    for algorithm in ["token_bucket", "gcra"] {
        let redis = RedisServer::start();
        let config = Config::redis(&redis.url())
            .policy(
                Policy::new("p", algorithm, RATE, "1s")
                    .burst(BUCKET)
                    .on_store_error("closed")
                    .set("hot_key_rate", 5),
            )
            .to_toml();
        let daemons: Vec<Quotad> = (0..4).map(|_| Quotad::start(&config)).collect();
        let from = redis_now_us(&redis);
        let admitted: u64 = std::thread::scope(|s| {
            let clients: Vec<_> = daemons
                .iter()
                .map(|q| {
                    s.spawn(move || {
                        let mut admitted = 0;
                        for _ in 0..12 {
                            let on = std::time::Instant::now();
                            while on.elapsed() < Duration::from_millis(150) {
                                if q.check1("p", "k")["allowed"] == true {
                                    admitted += 1;
                                }
                            }
                            std::thread::sleep(Duration::from_millis(100));
                        }
                        admitted
                    })
                })
                .collect();
            clients.into_iter().map(|c| c.join().unwrap()).sum()
        });
        let to = redis_now_us(&redis);
        let envelope = BUCKET as f64 + RATE as f64 * (to - from) as f64 / 1e6;
        let sum = |series: &str| daemons.iter().map(|q| q.metric(series)).sum::<f64>();
        let slices = sum("quotad_hot_key_slices_total{event=\"taken\"}");
        let units = sum("quotad_hot_key_units_total{event=\"taken\"}");
        eprintln!(
            "{algorithm}: admitted {admitted} of an envelope of {envelope:.0} ({:.3}); {slices} slices carried {units} units",
            admitted as f64 / envelope
        );
        assert!(
            admitted as f64 <= envelope,
            "{algorithm}: four instances admitted {admitted}, above the envelope {envelope:.1}"
        );
        assert!(
            slices >= 1.0 && units > slices,
            "{algorithm}: the key was never hot: {slices} slices, {units} units"
        );
    }
}
