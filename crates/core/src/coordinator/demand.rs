//! Demand: the offered load of a key in one region, from the store's cumulative counters.
//!
//! Offered = admitted + rejected locally. Admitted alone would trap a throttled region at
//! its share forever (it can never show that it wants more). The counters are cumulative,
//! so a round that is skipped or late loses nothing: the next one sees the whole difference.
//! The estimate rises fast (a flash crowd must get budget within a round or two) and falls
//! as fast (after a step the old owner's share must move; a lull that hands it away is
//! taken back within a sense and a round trip, see `Node::sense`), weighs each sample by
//! the arrivals it held, and is clamped to a multiple of ρ so that clients retrying in a
//! tight loop cannot claim the whole budget by noise alone. Readings between rounds move
//! it as far per unit of time as a round's reading would, and only when they show more
//! than noise.

use serde::{Deserialize, Serialize};

use super::{LocalUs, Params};

/// Cumulative counts the store keeps per key and region.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Units admitted.
    pub admitted: u64,
    /// Units refused.
    pub rejected: u64,
}

impl Counters {
    /// Units asked for: admitted plus refused.
    pub fn offered(&self) -> u64 {
        self.admitted + self.rejected
    }
}

/// A key's offered load, smoothed over rounds (see [`super::Params`]'s weights).
#[derive(Debug, Clone, Default)]
pub struct DemandEstimator {
    last: Option<(LocalUs, u64)>,
    estimate: Option<f64>,
}

impl DemandEstimator {
    /// Feeds one reading; returns the smoothed offered rate (units per second).
    /// A counter that went backwards (store failover, key expired) starts a new baseline.
    pub fn observe(&mut self, now: LocalUs, counters: Counters, rho: f64, p: &Params) -> f64 {
        let total = counters.offered();
        if let Some((t0, c0)) = self.last {
            let dt = now - t0;
            if dt <= 0 {
                return self.value();
            }
            if total >= c0 {
                let sample = ((total - c0) as f64 * 1e6 / dt as f64).min(p.demand_clamp * rho);
                let est = match self.estimate {
                    None => sample,
                    Some(e) => {
                        let a = if sample > e { p.ewma_up } else { p.ewma_down };
                        // Evidence as over a round at least: a shorter reading weighs its
                        // share of a round's weight (`per_interval`), not less again.
                        let a = a * evidence(sample.max(e), dt.max(p.round_us), p);
                        e + per_interval(a, dt, p.round_us) * (sample - e)
                    }
                };
                self.estimate = Some(est);
            }
        }
        self.last = Some((now, total));
        self.value()
    }

    /// Feeds one reading between rounds, only if it shows demand that moved: a sample
    /// at least `min_change` away from the estimate and further than Poisson noise could
    /// carry it (three standard deviations at the larger rate). Otherwise the reading is
    /// dropped, and the next one covers its interval too (the counters are cumulative), so
    /// that steady demand is estimated from whole rounds exactly as without these readings.
    /// Returns whether the estimate took it.
    pub fn observe_if_moved(
        &mut self,
        now: LocalUs,
        counters: Counters,
        rho: f64,
        min_change: f64,
        p: &Params,
    ) -> bool {
        let (Some((t0, c0)), Some(e)) = (self.last, self.estimate) else {
            return false;
        };
        let total = counters.offered();
        let dt = now - t0;
        if dt <= 0 || total < c0 {
            return false;
        }
        let secs = dt as f64 / 1e6;
        let sample = (total - c0) as f64 / secs;
        let noise = 3.0 * (sample.max(e) / secs).sqrt();
        if (sample - e).abs() < noise.max(min_change) {
            return false;
        }
        self.observe(now, counters, rho, p);
        true
    }

    /// The current estimate (0 before two readings).
    pub fn value(&self) -> f64 {
        self.estimate.unwrap_or(0.0)
    }

    /// Whether two readings have been taken.
    pub fn is_known(&self) -> bool {
        self.estimate.is_some()
    }
}

/// The weight `a` of a one-round sample, for a sample of `dt`: the estimate moves as far
/// in a round whether it is read once in it or several times (1 − (1 − a)^(dt/round)).
fn per_interval(a: f64, dt: LocalUs, round_us: i64) -> f64 {
    if round_us <= 0 || dt >= round_us {
        return a;
    }
    1.0 - (1.0 - a).powf(dt as f64 / round_us as f64)
}

/// How far a sample may move the estimate, from 0 to 1: in proportion to the arrivals
/// the interval held at `rate` (the larger of the sample and the estimate: a rise counts
/// what it brought, a fall what the old rate would have), in full from
/// [`Params::demand_events`] arrivals on. Arrivals are random: a key offered 2/s shows 0
/// to 5 in a one-second round, and taking each such sample at face value moves its share
/// between regions on noise. Where few arrive, several rounds count together.
fn evidence(rate: f64, dt: LocalUs, p: &Params) -> f64 {
    if p.demand_events <= 0.0 {
        return 1.0;
    }
    (rate * dt as f64 / 1e6 / p.demand_events).min(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(admitted: u64, rejected: u64) -> Counters {
        Counters { admitted, rejected }
    }

    #[test]
    fn counts_rejections_as_demand_and_moves_by_the_weights_of_a_round() {
        let p = Params::default();
        let mut d = DemandEstimator::default();
        d.observe(0, reading(0, 0), 1000.0, &p);
        // 100 admitted + 100 rejected in one second: offered 200/s.
        assert_eq!(d.observe(1_000_000, reading(100, 100), 1000.0, &p), 200.0);
        let up = d.observe(2_000_000, reading(500, 300), 1000.0, &p) - 200.0; // sample 600
        let before = d.value();
        let down = before - d.observe(3_000_000, reading(500, 300), 1000.0, &p); // sample 0
        assert!((up - p.ewma_up * 400.0).abs() < 1e-9);
        assert!((down - p.ewma_down * before).abs() < 1e-9);
    }

    #[test]
    fn a_sample_of_few_arrivals_moves_the_estimate_in_proportion_to_them() {
        let p = Params::default();
        let k = p.demand_events;
        let mut d = DemandEstimator::default();
        d.observe(0, reading(0, 0), 1000.0, &p);
        d.observe(1_000_000, reading(2, 0), 1000.0, &p); // 2/s
        // 6 in the next second: 6 arrivals of evidence, not the full up weight.
        let up = d.observe(2_000_000, reading(8, 0), 1000.0, &p) - 2.0;
        assert!((up - p.ewma_up * 6.0 / k * 4.0).abs() < 1e-9, "rose {up}");
        // None in the next: the 5.x/s it came from would have brought 5.x.
        let before = d.value();
        let down = before - d.observe(3_000_000, reading(8, 0), 1000.0, &p);
        assert!(
            (down - p.ewma_down * before / k * before).abs() < 1e-9,
            "fell {down}"
        );
        // With many arrivals, the weights in full.
        let mut busy = DemandEstimator::default();
        busy.observe(0, reading(0, 0), 1000.0, &p);
        busy.observe(1_000_000, reading(2 * k as u64, 0), 1000.0, &p);
        let up = busy.observe(2_000_000, reading(6 * k as u64, 0), 1000.0, &p) - 2.0 * k;
        assert!((up - p.ewma_up * 2.0 * k).abs() < 1e-9, "rose {up}");
    }

    #[test]
    fn a_reading_between_rounds_is_taken_only_when_demand_moved_beyond_noise() {
        let p = Params::default();
        let change = p.sense_change * 1000.0;
        let mut d = DemandEstimator::default();
        d.observe(0, reading(0, 0), 1000.0, &p);
        d.observe(1_000_000, reading(400, 0), 1000.0, &p); // 400/s
        // 108 in a quarter (432/s): within noise, dropped; the next round counts it.
        assert!(!d.observe_if_moved(1_250_000, reading(508, 0), 1000.0, change, &p));
        assert_eq!(d.value(), 400.0);
        // 200 in the next quarter: 308 in half a round (616/s), beyond noise: taken.
        assert!(d.observe_if_moved(1_500_000, reading(708, 0), 1000.0, change, &p));
        assert!(d.value() > 450.0, "estimate {}", d.value());
    }

    #[test]
    fn readings_within_a_round_move_the_estimate_as_far_as_one_reading_of_it() {
        let p = Params::default();
        let start = |d: &mut DemandEstimator| {
            d.observe(0, reading(0, 0), 1000.0, &p);
            d.observe(1_000_000, reading(100, 0), 1000.0, &p); // 100/s
        };
        let (mut once, mut quarters) = (DemandEstimator::default(), DemandEstimator::default());
        start(&mut once);
        start(&mut quarters);
        once.observe(2_000_000, reading(600, 0), 1000.0, &p); // 500/s
        for q in 1..=4u64 {
            quarters.observe(
                1_000_000 + q as i64 * 250_000,
                reading(100 + 125 * q, 0),
                1000.0,
                &p,
            );
        }
        assert!(
            (once.value() - quarters.value()).abs() < 1e-9,
            "{} against {}",
            once.value(),
            quarters.value()
        );
    }

    #[test]
    fn clamps_retry_storms_and_survives_counter_resets() {
        let p = Params::default();
        let mut d = DemandEstimator::default();
        d.observe(0, reading(0, 0), 10.0, &p);
        assert_eq!(d.observe(1_000_000, reading(0, 1_000_000), 10.0, &p), 40.0);
        // The store lost its counters: no negative sample, a new baseline.
        assert_eq!(d.observe(2_000_000, reading(0, 5), 10.0, &p), 40.0);
        assert!(d.observe(3_000_000, reading(0, 15), 10.0, &p) < 40.0);
    }
}
