//! The deterministic simulator of global budgets: it drives the production coordinator
//! ([`quotad_core::coordinator`]) and the production token bucket ([`quotad_core::algorithm`]) with
//! virtual clocks, a faulty network and seeded load, checks invariant S after every event,
//! and measures quotad's leases against the baselines on identical offered load.
//!
//! Layout, in the order data flows through a run:
//! - [`scenario`]: S1–S18 of docs/simulator.md (and random ones for the property tests).
//! - [`clock`]: real time and each region's drifted, offset, steppable clock.
//! - [`net`]: delays, jitter, loss, duplication, reordering, cuts.
//! - [`store`]: a region's store (books, buckets, counters, replication) as the daemon's
//!   Redis would hold them.
//! - [`regime`]: the modes compared (central, lease, static, independent, count sharing,
//!   naive apportioning).
//! - [`engine`]: the event loop and the invariant check.
//! - [`metrics`]: what a run records and the figures computed from it against central.
//! - [`report`]: aggregation over seeds, the table, JSON and SVG plots.
//!
//! Nothing here is used by the daemon; the coordinator does not know it is simulated.

pub mod clock;
pub mod engine;
pub mod metrics;
pub mod net;
pub mod regime;
pub mod report;
pub mod scenario;
pub mod store;

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

pub use engine::{Violation, run, run_audited};
pub use metrics::{RunMetrics, Sample};
pub use regime::ModeKind;
pub use report::Row;
pub use scenario::Scenario;

/// What to run: every listed mode of every scenario, for seeds `first_seed ..
/// first_seed + seeds`, on `threads` threads.
#[derive(Debug, Clone)]
pub struct SuiteOptions {
    pub scenarios: Vec<Scenario>,
    pub modes: Vec<ModeKind>,
    pub first_seed: u64,
    pub seeds: u64,
    pub threads: usize,
}

/// One (scenario, mode, seed): its figures, or the violation that stopped it.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub scenario: usize,
    pub mode: ModeKind,
    pub seed: u64,
    pub result: Result<RunMetrics, Violation>,
}

#[derive(Debug, Clone)]
pub struct Suite {
    pub rows: Vec<Row>,
    pub violations: Vec<Violation>,
    /// Per scenario: the lease run of the first seed, sampled (for the plots).
    pub plots: Vec<(Scenario, Vec<Sample>)>,
}

/// Runs the suite. Each job is one (scenario, seed): central first (every figure is
/// relative to it), then the other modes on the same offered load.
pub fn run_suite(opts: &SuiteOptions) -> Suite {
    let jobs: Vec<(usize, u64)> = (0..opts.scenarios.len())
        .flat_map(|s| (0..opts.seeds).map(move |k| (s, k)))
        .collect();
    let next = AtomicUsize::new(0);
    let outcomes = Mutex::new(Vec::new());
    let plots = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..opts.threads.max(1) {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(s, k)) = jobs.get(i) else { break };
                    let seed = opts.first_seed + k;
                    let sc = &opts.scenarios[s];
                    let (done, samples) = run_seed(sc, s, &opts.modes, seed);
                    if k == 0
                        && let Some(samples) = samples
                    {
                        plots.lock().expect("no panics hold it").push((s, samples));
                    }
                    outcomes.lock().expect("no panics hold it").extend(done);
                }
            });
        }
    });
    let mut outcomes = outcomes.into_inner().expect("threads joined");
    outcomes.sort_by_key(|o| (o.scenario, o.mode, o.seed));
    let mut plots = plots.into_inner().expect("threads joined");
    plots.sort_by_key(|(s, _)| *s);
    Suite {
        rows: report::aggregate(&opts.scenarios, &opts.modes, &outcomes),
        violations: outcomes
            .iter()
            .filter_map(|o| o.result.as_ref().err().cloned())
            .collect(),
        plots: plots
            .into_iter()
            .map(|(s, samples)| (opts.scenarios[s].clone(), samples))
            .collect(),
    }
}

fn run_seed(
    sc: &Scenario,
    index: usize,
    modes: &[ModeKind],
    seed: u64,
) -> (Vec<Outcome>, Option<Vec<Sample>>) {
    let mut out = Vec::new();
    let central = match run(sc, ModeKind::Central, seed) {
        Ok(rec) => rec,
        Err(v) => {
            out.push(Outcome {
                scenario: index,
                mode: ModeKind::Central,
                seed,
                result: Err(v),
            });
            return (out, None);
        }
    };
    let mut samples = None;
    for &mode in modes {
        let result = if mode == ModeKind::Central {
            Ok(metrics::compare(sc, &central, &central))
        } else {
            run(sc, mode, seed).map(|rec| {
                let m = metrics::compare(sc, &rec, &central);
                if mode == ModeKind::Lease {
                    samples = Some(rec.samples);
                }
                m
            })
        };
        out.push(Outcome {
            scenario: index,
            mode,
            seed,
            result,
        });
    }
    (out, samples)
}
