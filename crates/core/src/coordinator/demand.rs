//! Demand: the offered load of a key in one region, from the store's cumulative counters.
//!
//! Offered = admitted + rejected locally. Admitted alone would trap a throttled region at
//! its share forever (it can never show that it wants more). The counters are cumulative,
//! so a round that is skipped or late loses nothing: the next one sees the whole difference.
//! The estimate rises fast (a flash crowd must get budget within a round or two) and falls
//! slowly (a brief lull should not hand the share away), and is clamped to a multiple of ρ
//! so that clients retrying in a tight loop cannot claim the whole budget by noise alone.

use serde::{Deserialize, Serialize};

use super::{LocalUs, Params};

/// Cumulative counts the store keeps per key and region.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    pub admitted: u64,
    pub rejected: u64,
}

impl Counters {
    pub fn offered(&self) -> u64 {
        self.admitted + self.rejected
    }
}

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
                        e + a * evidence(sample.max(e), dt, p) * (sample - e)
                    }
                };
                self.estimate = Some(est);
            }
        }
        self.last = Some((now, total));
        self.value()
    }

    /// The current estimate (0 before two readings).
    pub fn value(&self) -> f64 {
        self.estimate.unwrap_or(0.0)
    }

    pub fn is_known(&self) -> bool {
        self.estimate.is_some()
    }
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
    fn counts_rejections_as_demand_and_rises_faster_than_it_falls() {
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
        assert!(p.ewma_up > p.ewma_down, "fast up, slower down");
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
