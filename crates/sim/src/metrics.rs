//! What a run records, and the figures of the report computed from it against the central
//! oracle's run of the same seed (identical offered load).
//!
//! Definitions (docs/simulator.md's, made exact):
//! - OA_W = max over t of admitted in [t − W, t) / (ρW + B), summed over regions, per key
//!   (the scenario's `oa_keys` most popular), at tick resolution; `oa60` is W = 60 s and
//!   `oa_short` the largest of W = 1, 2, ..., 10 s.
//! - max Σ R/ρ: the largest sum of enforced rates over ρ seen at any check (after every
//!   event; for the baselines, what their buckets refill at).
//! - utilisation η = admitted / admitted by central, over the measured period.
//! - false rejections = Σ over 1 s bins and regions of max(0, expected − ours), over
//!   central's admissions, where expected is central's admissions in that second split in
//!   proportion to what each region offered: what one bucket would have let through from
//!   that region then.
//! - τ5 = for each demand step, the time until the admissions of the last second (a
//!   window evaluated every 100 ms, timed at its end) are within 5% of central's and stay
//!   so for 5 s; the largest over the scenario's steps.
//! - partition: fallback = time from the cut until every isolated region enforces exactly
//!   its escrow and no lease crosses the cut (and stays so); utilisation = ours / central
//!   during the cut; best-safe = Σ over 1 s bins and components of min(offered there,
//!   escrow owned there × 1 s), over central; reconvergence = time after the heal until
//!   every |R_i − target_i| ≤ 5% of ρ for 2 s running, target from the true demand (0: it
//!   already was at the heal).
//! - bytes per key per round = exchange bytes (both directions) / keys reported to peers.

use serde::Serialize;

use super::regime::ModeKind;
use super::scenario::Scenario;

#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    pub t_s: f64,
    pub rates: Vec<f64>,
    pub demand: Vec<f64>,
}

#[derive(Debug, Clone)]
pub struct Record {
    pub mode: ModeKind,
    tick_us: i64,
    /// Per 1 s bin, per region.
    pub admitted: Vec<Vec<u64>>,
    pub offered: Vec<Vec<u64>>,
    /// Per OA key, per tick: admitted over all regions.
    pub oa: Vec<Vec<u32>>,
    pub max_rate_ratio: f64,
    pub rounds: u64,
    pub bytes: u64,
    pub key_reports: u64,
    /// Book writes over every region's store (warm-up included, as `bytes`).
    pub book_writes: u64,
    pub fallback_since: Option<f64>,
    pub fallback_s: Option<f64>,
    pub reconverge_since: Option<f64>,
    pub reconverge_s: Option<f64>,
    /// Per tick: admitted over all regions and keys.
    pub ticks: Vec<u32>,
    partition_start: Option<f64>,
    /// Rates and true demand of key 0 every 100 ms (the plots).
    pub samples: Vec<Sample>,
}

const SAMPLE_S: f64 = 0.1;

impl Record {
    pub fn new(sc: &Scenario, mode: ModeKind) -> Self {
        let bins = sc.duration_s.ceil() as usize;
        let ticks = (sc.duration_s * 1e6 / sc.tick_us as f64).ceil() as usize + 1;
        Record {
            mode,
            tick_us: sc.tick_us,
            admitted: vec![vec![0; sc.regions]; bins],
            offered: vec![vec![0; sc.regions]; bins],
            oa: vec![vec![0; ticks]; sc.oa_keys.min(sc.load.keys()) as usize],
            max_rate_ratio: 0.0,
            rounds: 0,
            bytes: 0,
            key_reports: 0,
            book_writes: 0,
            fallback_since: None,
            fallback_s: None,
            reconverge_since: None,
            reconverge_s: None,
            ticks: vec![0; ticks],
            partition_start: sc.partition.as_ref().map(|p| p.start_s),
            samples: Vec::new(),
        }
    }

    pub fn arrivals(&mut self, t_s: f64, r: usize, key: u32, offered: u64, admitted: u64) {
        if t_s < 0.0 {
            return;
        }
        let bin = t_s as usize;
        if let (Some(a), Some(o)) = (self.admitted.get_mut(bin), self.offered.get_mut(bin)) {
            a[r] += admitted;
            o[r] += offered;
        }
        let tick = (t_s * 1e6 / self.tick_us as f64).round() as usize;
        if let Some(series) = self.oa.get_mut(key as usize)
            && let Some(x) = series.get_mut(tick)
        {
            *x += admitted as u32;
        }
    }

    pub fn tick_total(&mut self, t_s: f64, admitted: u64) {
        if t_s < 0.0 {
            return;
        }
        let tick = (t_s * 1e6 / self.tick_us as f64).round() as usize;
        if let Some(x) = self.ticks.get_mut(tick) {
            *x += admitted as u32;
        }
    }

    pub fn observe_rates(&mut self, t_s: f64, rates: &[f64], demand: &[f64]) {
        let due = self
            .samples
            .last()
            .is_none_or(|s| t_s >= s.t_s + SAMPLE_S - 1e-9);
        if due {
            self.samples.push(Sample {
                t_s,
                rates: rates.to_vec(),
                demand: demand.to_vec(),
            });
        }
    }

    pub fn finish(&mut self) {
        self.fallback_s = match (self.partition_start, self.fallback_since) {
            (Some(start), Some(since)) => Some(since - start),
            _ => None,
        };
    }
}

/// One run's figures against central.
#[derive(Debug, Clone, Serialize)]
pub struct RunMetrics {
    pub max_rate_ratio: f64,
    pub oa60: f64,
    pub oa_short: f64,
    pub utilization: f64,
    pub false_rejections: f64,
    /// `None`: a step never settled within the run.
    pub tau5_s: Option<f64>,
    pub fallback_s: Option<f64>,
    pub partition_utilization: Option<f64>,
    pub best_safe_utilization: Option<f64>,
    pub reconverge_s: Option<f64>,
    pub bytes_per_key_round: Option<f64>,
    /// Book writes per key and round in a region, over the keys it exchanges: writes ×
    /// (regions − 1) / key reports. In Redis each is a script call: this is what the
    /// coordinator costs the region's store per key.
    pub writes_per_key_round: Option<f64>,
}

pub fn compare(sc: &Scenario, ours: &Record, central: &Record) -> RunMetrics {
    let total = |rec: &Record, bins: std::ops::Range<usize>| -> u64 {
        rec.admitted[bins].iter().flatten().sum()
    };
    let all = 0..ours.admitted.len();
    let central_total = total(central, all.clone()).max(1) as f64;
    // Against central's *expected* admissions per region (its total in the second, split in
    // proportion to what each region offered: one bucket gives every request the same
    // chance), not its random split, whose noise alone would read as 1-2%.
    let false_rej: f64 = (0..ours.admitted.len())
        .map(|b| {
            let offered: u64 = ours.offered[b].iter().sum();
            let c: u64 = central.admitted[b].iter().sum();
            if offered == 0 {
                return 0.0;
            }
            (0..ours.admitted[b].len())
                .map(|r| {
                    let expected = c as f64 * ours.offered[b][r] as f64 / offered as f64;
                    (expected - ours.admitted[b][r] as f64).max(0.0)
                })
                .sum::<f64>()
        })
        .sum();
    let oa = |w_s: f64| -> f64 {
        ours.oa
            .iter()
            .map(|series| windowed_max(series, (w_s * 1e6 / ours.tick_us as f64).round() as usize))
            .fold(0.0, f64::max)
            / (sc.rho * w_s + sc.burst)
    };
    let (partition_utilization, best_safe_utilization) = match &sc.partition {
        Some(p) => {
            let bins = (p.start_s as usize)..(p.end_s.ceil() as usize).min(ours.admitted.len());
            let c = total(central, bins.clone()).max(1) as f64;
            let escrow = sc.policy(1, &sc.weights).escrow;
            let components: [Vec<usize>; 2] = [
                p.isolated.clone(),
                (0..sc.regions)
                    .filter(|r| !p.isolated.contains(r))
                    .collect(),
            ];
            let best: f64 = ours.offered[bins.clone()]
                .iter()
                .map(|offered| {
                    components
                        .iter()
                        .map(|comp| {
                            let o: u64 = comp.iter().map(|&r| offered[r]).sum();
                            let budget: f64 = comp.iter().map(|&r| escrow[r]).sum();
                            (o as f64).min(budget)
                        })
                        .sum::<f64>()
                })
                .sum();
            (Some(total(ours, bins) as f64 / c), Some(best / c))
        }
        None => (None, None),
    };
    RunMetrics {
        max_rate_ratio: ours.max_rate_ratio,
        oa60: oa(60.0),
        oa_short: (1..=10).map(|w| oa(w as f64)).fold(0.0, f64::max),
        utilization: total(ours, all) as f64 / central_total,
        false_rejections: false_rej / central_total,
        tau5_s: tau5(sc, ours, central),
        fallback_s: ours.fallback_s,
        partition_utilization,
        best_safe_utilization,
        reconverge_s: ours.reconverge_s,
        bytes_per_key_round: (ours.key_reports > 0)
            .then(|| ours.bytes as f64 / ours.key_reports as f64),
        writes_per_key_round: (ours.key_reports > 0 && ours.book_writes > 0)
            .then(|| ours.book_writes as f64 * (sc.regions - 1) as f64 / ours.key_reports as f64),
    }
}

/// The largest sum of `w` consecutive entries (the whole series if shorter).
fn windowed_max(series: &[u32], w: usize) -> f64 {
    let w = w.max(1).min(series.len());
    let mut sum: u64 = series[..w].iter().map(|&x| x as u64).sum();
    let mut best = sum;
    for i in w..series.len() {
        sum = sum + series[i] as u64 - series[i - w] as u64;
        best = best.max(sum);
    }
    best as f64
}

const TAU_BAND: f64 = 0.05;
const TAU_HOLD_S: f64 = 5.0;
/// τ5 is evaluated every this often, on the admissions of the second before.
const TAU_EVERY_S: f64 = 0.1;

/// For each demand step: the time from the step until the admissions of the last second,
/// evaluated every 100 ms at the end of that second, are within 5% of central's and stay
/// so for 5 s. The largest over the steps; `None` if one never settles.
fn tau5(sc: &Scenario, ours: &Record, central: &Record) -> Option<f64> {
    tau5_ticks(
        &ours.ticks,
        &central.ticks,
        ours.tick_us as f64 / 1e6,
        &sc.steps_s,
    )
}

/// τ5 over admissions per tick (all regions) of ours and of the central oracle, for demand
/// steps at `steps_s` (seconds from the first tick): the definition above, shared with the
/// real-process measurement (tests/multi_region.rs).
pub fn tau5_ticks(ours: &[u32], central: &[u32], tick_s: f64, steps_s: &[f64]) -> Option<f64> {
    if steps_s.is_empty() {
        return None;
    }
    let per_s = (1.0 / tick_s).round() as usize;
    let every = ((TAU_EVERY_S / tick_s).round() as usize).max(1);
    let prefix = |ticks: &[u32]| -> Vec<u64> {
        let mut p = vec![0u64];
        for &x in ticks {
            p.push(p[p.len() - 1] + x as u64);
        }
        p
    };
    let (po, pc) = (prefix(ours), prefix(central));
    let last = po.len().min(pc.len()) - 1;
    // Window (end − 1 s, end], `end` in ticks.
    let close = |end: usize| {
        let start = end.saturating_sub(per_s);
        let o = (po[end] - po[start]) as f64;
        let c = (pc[end] - pc[start]) as f64;
        (o - c).abs() <= TAU_BAND * c
    };
    let hold = (TAU_HOLD_S / tick_s).round() as usize;
    let mut worst: f64 = 0.0;
    for &step in steps_s {
        let first = (step / tick_s).ceil() as usize;
        let settled = (first..=last.saturating_sub(hold))
            .step_by(every)
            .find(|&end| (end..=end + hold).step_by(every).all(close))?;
        worst = worst.max(settled as f64 * tick_s - step);
    }
    Some(worst)
}

/// The central oracle over a recorded stream of requests (time in µs, cost), in time
/// order: one token bucket of rate ρ and capacity B (the production bucket) deciding them
/// all. Returns which were admitted.
pub fn central_decisions(requests: &[(i64, u64)], rho: f64, burst: f64) -> Vec<bool> {
    use quotad_core::algorithm::{BucketRate, Op, Write, token_bucket_at};
    let rate = BucketRate::per_second(rho, burst);
    let mut state = None;
    requests
        .iter()
        .map(|&(t, cost)| {
            let out = token_bucket_at(&rate, state.as_ref(), t, Op::Check { cost });
            if let Write::Put { state: s, .. } = out.write {
                state = Some(s);
            }
            out.verdict.allowed
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windowed_max_slides() {
        assert_eq!(windowed_max(&[1, 5, 0, 3, 3], 2), 6.0);
        assert_eq!(windowed_max(&[1, 5], 9), 6.0);
    }
}
