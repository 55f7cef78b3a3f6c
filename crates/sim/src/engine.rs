//! The discrete-event loop: one scenario, one mode, one seed.
//!
//! Events (arrivals every tick, protocol timers and senses, message deliveries, lease
//! expiries, faults) are popped in time order; real time jumps to each, and every region's clock
//! reads its own drifted, offset local time from it. After every event the invariant is
//! checked for every key whose rates may have changed: Σ_i R_i ≤ ρ, and every bucket
//! within its capacity share. Lease expiries are events of their own (scheduled at the
//! real instant each region's clock reaches them), so "after every event" covers every
//! instant at which a rate can change. A violation stops the run; the run is then replayed
//! from the same seed with tracing on, and the error carries the events that led to it.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Poisson, Zipf};

use quotad_core::coordinator::bucket::KeyLimit;
use quotad_core::coordinator::message::Message;
use quotad_core::coordinator::wire;
use quotad_core::coordinator::{GlobalPolicy, LocalUs};

use super::clock::{RealTime, SimClock};
use super::metrics::Record;
use super::net::{Cut, Network};
use super::regime::{ModeKind, Regime, RegionEvent, Send};
use super::scenario::{Fault, Load, Scenario};
use super::store::{ALL_KEYS, RegionStore};

/// Real time at the start of the warm-up: a realistic epoch, so local clocks look like
/// Redis TIME readings.
const EPOCH_US: i64 = 1_700_000_000_000_000;
/// Σ R / ρ above this is a violation (float rounding aside).
pub const RATE_TOLERANCE: f64 = 1e-9;
const TRACE_LEN: usize = 120;

/// Invariant S broke: where, when, and the events that led to it.
#[derive(Debug, Clone)]
pub struct Violation {
    pub scenario: String,
    pub mode: ModeKind,
    pub seed: u64,
    /// Seconds from the start of the measured period (negative: in the warm-up).
    pub t_s: f64,
    pub what: String,
    /// Σ R / ρ when that is what broke.
    pub ratio: Option<f64>,
    pub trace: Vec<String>,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "invariant S violated: scenario {} mode {} seed {} at t = {:.6} s: {}",
            self.scenario,
            self.mode.name(),
            self.seed,
            self.t_s,
            self.what
        )?;
        writeln!(
            f,
            "reproduce: quotad sim --scenario {} --seed {} --modes {}",
            self.scenario,
            self.seed,
            self.mode.name()
        )?;
        writeln!(f, "last {} events:", self.trace.len())?;
        for line in &self.trace {
            writeln!(f, "  {line}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Violation {}

/// Runs one scenario in one mode with one seed. The load, the clocks and the fault times
/// depend on the seed only, so every mode of a seed sees the same offered load.
pub fn run(sc: &Scenario, mode: ModeKind, seed: u64) -> Result<Record, Violation> {
    run_checked(sc, mode, seed, false)
}

/// [`run`], with the checker audited: every check compares the rates it keeps (read again
/// only where an event changed them) with every region read afresh, and checks every
/// region's bucket and book, not only the changed ones. A difference is a violation. The
/// test suite runs this; the gate and the figures run [`run`], which the audit vouches
/// for.
pub fn run_audited(sc: &Scenario, mode: ModeKind, seed: u64) -> Result<Record, Violation> {
    run_checked(sc, mode, seed, true)
}

fn run_checked(sc: &Scenario, mode: ModeKind, seed: u64, audit: bool) -> Result<Record, Violation> {
    match Run::new(sc, mode, seed, audit, false).go() {
        Ok(rec) => Ok(rec),
        Err(v) => match Run::new(sc, mode, seed, audit, true).go() {
            Err(traced) => Err(traced),
            Ok(_) => Err(v), // cannot happen: runs are deterministic
        },
    }
}

enum Event {
    Tick,
    Timer(usize),
    /// A region's coordinator reads demand between rounds ([`Node::sense`]).
    Sense(usize),
    Deliver {
        from: usize,
        to: usize,
        bytes: Vec<u8>,
    },
    Expiry {
        region: usize,
        key: u32,
        local: i64,
    },
    Region(usize, RegionEvent),
    ClockStep(usize, i64),
    Retry {
        from: usize,
        to: usize,
        t_req: i64,
    },
    /// Keys' own numbers are set in `origin` ([`Fault::Limit`]).
    LimitSet {
        origin: usize,
        scale: Option<f64>,
    },
    /// A region asks each peer for its keys' numbers (every round).
    LimitPull(usize),
    /// A peer's numbers arrive.
    LimitArrive {
        from: usize,
        to: usize,
        view: LimitView,
    },
}

/// Keys' own numbers as one region has them: the write's (time, origin), last writer wins.
#[derive(Debug, Clone, Copy, PartialEq)]
struct LimitView {
    stamp: (i64, usize),
    /// ρ_K/ρ (and B_K/B); none: the policy's numbers.
    scale: Option<f64>,
}

const POLICY_NUMBERS: LimitView = LimitView {
    stamp: (i64::MIN, 0),
    scale: None,
};

struct Queued {
    at: i64,
    seq: u64,
    event: Event,
}

impl PartialEq for Queued {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Queued {}
impl PartialOrd for Queued {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Queued {
    /// Reversed: the heap pops the earliest (and among equal times, the first queued).
    fn cmp(&self, o: &Self) -> Ordering {
        (o.at, o.seq).cmp(&(self.at, self.seq))
    }
}

struct Run<'a> {
    sc: &'a Scenario,
    mode: ModeKind,
    seed: u64,
    real: RealTime,
    clocks: Vec<SimClock>,
    net: Network,
    regime: Regime,
    queue: BinaryHeap<Queued>,
    seq: u64,
    load_rng: ChaCha8Rng,
    net_rng: ChaCha8Rng,
    zipf: Option<Zipf<f64>>,
    /// Real time of scenario t = 0, and of the end.
    t0: i64,
    end: i64,
    rec: Record,
    /// Expiry events in the queue, not yet handled: for each region and key, the next
    /// instant its rate changes by itself (and any it was superseded by), so that the
    /// queue holds one chain per book, not one event per lease. Per region and key (a
    /// few instants at most each): a set of all of them hashed every event was a tenth
    /// of a run with 10,000 keys.
    scheduled: Vec<Vec<Vec<i64>>>,
    /// The region and key whose rate changed by itself in this event (an expiry), to
    /// check besides those whose books were written.
    expired: Option<(usize, u32)>,
    check_all: bool,
    /// Whether checks compare `rates` with a full read and check every region
    /// ([`run_audited`]).
    audit: bool,
    /// Per region, per key: the rate as of the last event that could change it (a write, a
    /// dropped loan, an expiry, a clock step, a new default). A key's Σ R is the sum of its
    /// column, so a check reads again only the entries that changed, not every region's
    /// rate of every changed key: with ten regions and many keys that was half of a run.
    /// An audited run (the test suite) compares the column with every region read afresh.
    rates: Vec<Vec<f64>>,
    trace: Option<VecDeque<String>>,
    out: Vec<Send>,
    /// The policy as the scenario starts it (partition scenarios do not re-split).
    policy: GlobalPolicy,
    /// Per region, keys' own numbers as it has them ([`Fault::Limit`]).
    limits: Vec<LimitView>,
}

impl<'a> Run<'a> {
    /// Builds a run: clocks, regime, network and the queue primed with the first tick, the
    /// protocol timers and the fault schedule. Kept to the order of construction; the
    /// pieces are helpers below. `clock_rng` (stream 3) is drawn from in a fixed order
    /// that every recorded seed depends on: each region's offset and drift, then the timer
    /// phases, then the re-split rollout delays.
    fn new(sc: &'a Scenario, mode: ModeKind, seed: u64, audit: bool, trace: bool) -> Self {
        let start = EPOCH_US;
        let real = RealTime::new(start);
        let mut clock_rng = stream(seed, 3);
        let clocks = draw_clocks(sc, &real, &mut clock_rng);
        let policy = sc.policy(1, &sc.weights);
        let keys = sc.load.keys();
        let regime = Regime::new(
            mode,
            &policy,
            sc.params,
            clocks.clone(),
            SimClock::new(real.clone(), 0, 0.0),
            keys,
            stream(seed, 4),
        );
        let t0 = start + secs(sc.warmup_s);
        let end = t0 + secs(sc.duration_s);
        let stores = regime.stores.len();
        let mut run = Run {
            sc,
            mode,
            seed,
            real,
            clocks,
            net: Network::new(sc.net.clone(), cuts(sc, t0)),
            regime,
            queue: BinaryHeap::new(),
            seq: 0,
            load_rng: stream(seed, 1),
            net_rng: stream(seed, 2),
            zipf: zipf(&sc.load),
            t0,
            end,
            rec: Record::new(sc, mode),
            scheduled: vec![vec![Vec::new(); keys as usize]; stores],
            expired: None,
            // The first check covers every key: the rates the regime starts with.
            check_all: true,
            audit,
            rates: vec![vec![0.0; keys as usize]; stores],
            trace: trace.then(VecDeque::new),
            out: Vec::new(),
            policy: policy.clone(),
            limits: vec![POLICY_NUMBERS; sc.regions],
        };
        run.push(start, Event::Tick);
        run.schedule_timers(start, &mut clock_rng);
        run.schedule_faults(&mut clock_rng);
        if sc.has_limit_changes() {
            let (round, n) = (sc.params.round_us, sc.regions as i64);
            for r in 0..sc.regions {
                run.push(
                    start + round * (r as i64 + 1) / (n + 1),
                    Event::LimitPull(r),
                );
            }
        }
        run
    }

    /// Queues each region's first protocol round (if the mode has rounds) at a random
    /// phase within one period of `start`, so that the regions do not run in lockstep.
    /// Split out of [`Run::new`]; draws one phase per region from `clock_rng`, in region
    /// order, after the clocks were drawn.
    fn schedule_timers(&mut self, start: i64, clock_rng: &mut ChaCha8Rng) {
        if let Some(period) = self.regime.timer_us() {
            for r in 0..self.sc.regions {
                let phase = (clock_rng.random::<f64>() * period as f64) as i64;
                self.push(start + phase, Event::Timer(r));
            }
        }
        if let Some(every) = self.regime.sense_us() {
            let n = self.sc.regions as i64;
            for r in 0..self.sc.regions {
                self.push(start + every * (r as i64 + 1) / (n + 1), Event::Sense(r));
            }
        }
    }

    /// Queues the scenario's faults as events, in the order the scenario lists them (the
    /// queue breaks ties by that order). Cuts are not events: the network holds them.
    /// Split out of [`Run::new`]; each re-split draws one rollout delay per region from
    /// `clock_rng`, after the timer phases.
    fn schedule_faults(&mut self, clock_rng: &mut ChaCha8Rng) {
        let sc = self.sc;
        let n = sc.regions;
        let t0 = self.t0;
        let at = |s: f64| real_of(t0, s);
        let mut version = 1;
        for f in &sc.faults {
            match f {
                Fault::Cut { .. } => {}
                Fault::Crash {
                    region,
                    at_s,
                    restart_s,
                } => {
                    self.push(at(*at_s), Event::Region(*region, RegionEvent::Crash));
                    if let Some(r) = restart_s {
                        self.push(at(*r), Event::Region(*region, RegionEvent::Restart));
                    }
                }
                Fault::ClockStep {
                    region,
                    at_s,
                    by_us,
                } => self.push(at(*at_s), Event::ClockStep(*region, *by_us)),
                Fault::Failover {
                    region,
                    lag_from_s,
                    at_s,
                } => {
                    self.push(
                        at(*lag_from_s),
                        Event::Region(*region, RegionEvent::LagStart),
                    );
                    self.push(at(*at_s), Event::Region(*region, RegionEvent::Failover));
                }
                Fault::Limit {
                    at_s,
                    origin,
                    scale,
                } => self.push(
                    at(*at_s),
                    Event::LimitSet {
                        origin: *origin,
                        scale: *scale,
                    },
                ),
                Fault::Resplit {
                    at_s,
                    weights,
                    rollout_s,
                } => {
                    version += 1;
                    let p = sc.policy(version, weights);
                    for r in 0..n {
                        let delay = clock_rng.random::<f64>() * rollout_s;
                        self.push(
                            at(at_s + delay),
                            Event::Region(r, RegionEvent::Policy(p.clone())),
                        );
                    }
                }
            }
        }
    }

    /// Region `r` takes `view` if it is newer than what it has (last writer wins by time,
    /// then origin), and every decision of its store carries it from then on. A regime
    /// with one store (central) has one copy of the numbers: the newest anywhere.
    fn adopt(&mut self, r: usize, view: LimitView) -> bool {
        if view.stamp <= self.limits[r].stamp {
            return false;
        }
        self.limits[r] = view;
        let (store, view) = if self.regime.stores.len() == self.sc.regions {
            (r, view)
        } else {
            let newest = self.limits.iter().max_by_key(|l| l.stamp).copied();
            (0, newest.unwrap_or(view))
        };
        let limit = view.scale.map(|s| KeyLimit {
            rate: s * self.sc.rho,
            burst: s * self.sc.burst,
        });
        if let Some(s) = self.regime.stores.get_mut(store) {
            s.set_limit(limit);
        }
        // What every region enforces is R·ρ_K/ρ: every key's sum changed.
        self.check_all = true;
        true
    }

    fn push(&mut self, at: i64, event: Event) {
        self.seq += 1;
        self.queue.push(Queued {
            at,
            seq: self.seq,
            event,
        });
    }

    fn t_s(&self, at: i64) -> f64 {
        (at - self.t0) as f64 / 1e6
    }

    fn go(mut self) -> Result<Record, Violation> {
        while let Some(q) = self.queue.pop() {
            if q.at > self.end {
                break;
            }
            self.real.set(q.at);
            let desc = self.handle(q.event);
            if let Some(trace) = self.trace.as_mut()
                && let Some(d) = desc
            {
                if trace.len() == TRACE_LEN {
                    trace.pop_front();
                }
                let t = (q.at - self.t0) as f64 / 1e6;
                trace.push_back(format!("{t:>12.6} s  {d}"));
            }
            self.check(q.at)?;
            self.observe_fallback(q.at);
        }
        // Keys' own numbers set anywhere reach every region: after the last change and the
        // heal, every region has the newest.
        if self.limits.iter().any(|l| l.stamp != self.limits[0].stamp) {
            return Err(self.violation(
                self.end,
                format!("keys' own numbers did not converge: {:?}", self.limits),
            ));
        }
        self.rec.book_writes = self.regime.stores.iter().map(|s| s.book_writes).sum();
        self.rec.finish();
        Ok(self.rec)
    }

    /// Applies one event; returns a line for the trace (none for ticks, which are many).
    fn handle(&mut self, event: Event) -> Option<String> {
        let now = self.real.get();
        match event {
            Event::Tick => {
                self.tick(now);
                self.push(now + self.sc.tick_us, Event::Tick);
                None
            }
            Event::Timer(r) => {
                self.regime.timer(r, &mut self.out);
                self.rec.rounds += 1;
                let period = self.regime.timer_us().unwrap_or(1_000_000);
                // ±5% jitter on the timer, as a daemon's interval timer would have.
                let next =
                    period + ((self.net_rng.random::<f64>() - 0.5) * 0.1 * period as f64) as i64;
                self.push(now + next, Event::Timer(r));
                let sent = self.send(now);
                self.trace.is_some().then(|| format!("round r{r}: {sent}"))
            }
            Event::Sense(r) => {
                self.regime.sense(r, &mut self.out);
                if let Some(every) = self.regime.sense_us() {
                    self.push(now + every, Event::Sense(r));
                }
                let sent = self.send(now);
                self.trace.is_some().then(|| format!("sense r{r}: {sent}"))
            }
            Event::Deliver { from, to, bytes } => {
                if self.net.is_cut(from, to, now) {
                    // A cut also loses what was in flight when it began.
                    return self
                        .trace
                        .is_some()
                        .then(|| format!("lost in flight r{from}->r{to}"));
                }
                let desc = self.trace.is_some().then(|| describe(&bytes));
                self.regime.deliver(from, to, &bytes, &mut self.out);
                let sent = self.send(now);
                desc.map(|d| format!("deliver r{from}->r{to} {d}; {sent}"))
            }
            Event::Expiry { region, key, local } => {
                self.scheduled[region][key as usize].retain(|&t| t != local);
                // The next instant after this one, scheduled now that this one is here.
                self.schedule_next_expiry(region, key, local);
                self.expired = Some((region, key));
                self.trace
                    .is_some()
                    .then(|| format!("expiry r{region} k{key} at local {local}"))
            }
            Event::Region(r, ev) => {
                let d = self.trace.is_some().then(|| format!("r{r}: {ev:?}"));
                self.regime.region_event(r, &ev);
                d
            }
            Event::Retry { from, to, t_req } => {
                self.regime.retry(from, to, t_req, &mut self.out);
                let sent = self.send(now);
                (self.trace.is_some() && !sent.is_empty())
                    .then(|| format!("retry r{from}->r{to}: {sent}"))
            }
            Event::LimitSet { origin, scale } => {
                let view = LimitView {
                    stamp: (now, origin),
                    scale,
                };
                self.adopt(origin, view);
                self.trace
                    .is_some()
                    .then(|| format!("r{origin}: keys' own numbers set to {scale:?}"))
            }
            Event::LimitPull(r) => {
                // A request to each peer and its reply, each through the network (lost
                // when cut or dropped); the reply carries what the peer has now.
                for p in (0..self.sc.regions).filter(|&p| p != r) {
                    for asked in self.net.send(r, p, now, &mut self.net_rng) {
                        for back in self.net.send(p, r, asked, &mut self.net_rng) {
                            let view = self.limits[p];
                            self.push(
                                back,
                                Event::LimitArrive {
                                    from: p,
                                    to: r,
                                    view,
                                },
                            );
                        }
                    }
                }
                self.push(now + self.sc.params.round_us, Event::LimitPull(r));
                None
            }
            Event::LimitArrive { from, to, view } => {
                if self.net.is_cut(from, to, now) || !self.adopt(to, view) {
                    return None;
                }
                self.trace
                    .is_some()
                    .then(|| format!("r{to}: keys' own numbers {:?} from r{from}", view.scale))
            }
            Event::ClockStep(r, by) => {
                self.clocks[r].step(by);
                // Every rate of that region is read at a different local time now, and its
                // expiries fall at different real times: check all, schedule all again.
                self.check_all = true;
                // (Only lease runs schedule expiries: the others have one store.)
                if let Some(pending) = self.scheduled.get_mut(r) {
                    pending.iter_mut().for_each(Vec::clear);
                }
                for k in 0..self.sc.load.keys() {
                    self.schedule_expiries(r, k);
                }
                self.trace
                    .is_some()
                    .then(|| format!("r{r}: clock steps {by} us"))
            }
        }
    }

    /// Offered load for one tick: Poisson arrivals per region (and key), each admitted or
    /// not by the regime, recorded for the report.
    fn tick(&mut self, now: i64) {
        let t_s = self.t_s(now);
        let n = self.sc.regions;
        let dt = self.sc.tick_us as f64 / 1e6;
        let rates = self.sc.load.rates(t_s.max(0.0), n);
        let mut arrivals: Vec<(usize, u32, u64)> = Vec::new();
        for (r, rate) in rates.iter().enumerate() {
            let count = poisson(&mut self.load_rng, rate * dt);
            match &self.zipf {
                None => arrivals.push((r, 0, count)),
                Some(zipf) => {
                    let mut keys: Vec<u32> = (0..count)
                        .map(|_| (zipf.sample(&mut self.load_rng) as u32).saturating_sub(1))
                        .collect();
                    keys.sort_unstable();
                    for chunk in keys.chunk_by(|a, b| a == b) {
                        arrivals.push((r, chunk[0], chunk.len() as u64));
                    }
                }
            }
        }
        arrivals.retain(|a| a.2 > 0);
        let admitted = self.regime.admit_tick(&arrivals);
        for (&(r, key, n), &a) in arrivals.iter().zip(&admitted) {
            self.rec.arrivals(t_s, r, key, n, a);
        }
        self.rec.tick_total(t_s, admitted.iter().sum());
        if t_s >= 0.0 {
            let rates_now = self.regime.rates(self.sc.plot_key);
            self.rec.observe_rates(t_s, &rates_now, &rates);
            if self.mode == ModeKind::Lease {
                self.observe_heal(t_s, &rates_now, &rates);
            }
        }
    }

    /// Fallback during the scenario's partition (lease mode), after every event: the
    /// instant the last lease across the cut ends is an event (an expiry), so the time is
    /// exact, not rounded to a tick.
    fn observe_fallback(&mut self, at: i64) {
        let Some(p) = &self.sc.partition else {
            return;
        };
        let t_s = self.t_s(at);
        if self.mode != ModeKind::Lease || t_s < p.start_s || t_s >= p.end_s {
            return;
        }
        let escrow = &self.policy.escrow;
        let rates = self.regime.rates(self.sc.plot_key);
        let fallen_back = p
            .isolated
            .iter()
            .all(|&r| (rates[r] - escrow[r]).abs() <= 1e-9 * self.sc.rho)
            && !self.regime.crossing_leases(self.sc.plot_key, &p.isolated);
        self.rec.fallback_since = match (fallen_back, self.rec.fallback_since) {
            (true, None) => Some(t_s),
            (true, since) => since,
            (false, _) => None,
        };
    }

    /// Reconvergence after the scenario's partition heals (lease mode), per tick: the
    /// first time every enforced rate is within 5% of ρ of the allocation that the true
    /// demand calls for.
    fn observe_heal(&mut self, t_s: f64, rates: &[f64], demand: &[f64]) {
        let Some(p) = &self.sc.partition else {
            return;
        };
        if t_s < p.end_s || self.rec.reconverge_s.is_some() {
            return;
        }
        let target = self
            .policy
            .allocate(&self.sc.params, demand, &vec![false; self.sc.regions]);
        let off = rates
            .iter()
            .zip(&target)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        let inside = off <= RECONVERGED * self.sc.rho;
        self.rec.reconverge_since = match (inside, self.rec.reconverge_since) {
            (true, None) => Some(t_s),
            (true, since) => since,
            (false, _) => None,
        };
        if let Some(since) = self.rec.reconverge_since
            && t_s - since >= RECONVERGED_HOLD_S
        {
            self.rec.reconverge_s = Some(since - p.end_s);
        }
    }

    /// Puts every message the regime produced on the network.
    fn send(&mut self, now: i64) -> String {
        let mut lines = Vec::new();
        for m in std::mem::take(&mut self.out) {
            self.rec.bytes += m.bytes.len() as u64;
            self.rec.key_reports += m.keys as u64;
            let arrivals = self.net.send(m.from, m.to, now, &mut self.net_rng);
            if let Some((after, t_req)) = m.retry {
                self.push(
                    now + after,
                    Event::Retry {
                        from: m.from,
                        to: m.to,
                        t_req,
                    },
                );
            }
            if self.trace.is_some() {
                lines.push(format!(
                    "r{}->r{} {} B arrives {:?}",
                    m.from,
                    m.to,
                    m.bytes.len(),
                    arrivals.iter().map(|a| self.t_s(*a)).collect::<Vec<_>>()
                ));
            }
            for at in arrivals {
                self.push(
                    at,
                    Event::Deliver {
                        from: m.from,
                        to: m.to,
                        bytes: m.bytes.clone(),
                    },
                );
            }
        }
        lines.join(", ")
    }

    /// Schedules a check at the next instant region `r`'s rate for `key` changes by
    /// itself (after its book changed); each such event schedules the next when it comes,
    /// so every instant gets its check.
    fn schedule_expiries(&mut self, r: usize, key: u32) {
        let now_local = self.clocks[r].local_at(self.real.get());
        self.schedule_next_expiry(r, key, now_local);
    }

    /// Schedules the first instant after `after` (local time of region `r`) at which its
    /// rate for `key` changes by itself, unless it is in the queue already.
    fn schedule_next_expiry(&mut self, r: usize, key: u32, after: LocalUs) {
        if self.mode != ModeKind::Lease {
            return;
        }
        let Some(local) = self.regime.next_expiry(r, key, after) else {
            return;
        };
        let pending = &mut self.scheduled[r][key as usize];
        if !pending.contains(&local) {
            pending.push(local);
            let at = self.clocks[r].real_at(local);
            self.push(
                at,
                Event::Expiry {
                    region: r,
                    key,
                    local,
                },
            );
        }
    }

    /// Invariant S for every key whose rates may have changed in the last event.
    fn check(&mut self, at: i64) -> Result<(), Violation> {
        let mut all = std::mem::take(&mut self.check_all);
        let mut changed = Vec::new();
        for r in 0..self.regime.stores.len() {
            for k in self.regime.stores[r].take_changed() {
                if k == ALL_KEYS {
                    all = true;
                } else {
                    changed.push((r, k));
                    self.schedule_expiries(r, k);
                }
            }
        }
        changed.extend(self.expired.take());
        if all {
            for (r, column) in self.rates.iter_mut().enumerate() {
                let store = &self.regime.stores[r];
                for (k, rate) in column.iter_mut().enumerate() {
                    *rate = store.rate(k as u32, store.now());
                }
            }
        } else {
            for &(r, k) in &changed {
                let store = &self.regime.stores[r];
                self.rates[r][k as usize] = store.rate(k, store.now());
            }
        }
        if all {
            // A clock step or a new default: every key, every region.
            let every: Vec<usize> = (0..self.regime.stores.len()).collect();
            for k in 0..self.sc.load.keys() {
                self.check_key(at, k, &every)?;
            }
            return Ok(());
        }
        // Per key, the regions whose entry changed: only their buckets and books can have
        // broken the per-region checks.
        let mut regions: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
        for (r, k) in changed {
            regions.entry(k).or_default().push(r);
        }
        for (k, rs) in &regions {
            self.check_key(at, *k, rs)?;
        }
        Ok(())
    }

    /// Σ R ≤ ρ for `key`, and each region in `changed` within its capacity share and not
    /// reserving more than it has (audited runs: every region, as a check of the rest).
    fn check_key(&mut self, at: i64, key: u32, changed: &[usize]) -> Result<(), Violation> {
        let rates: Vec<f64> = self
            .rates
            .iter()
            .map(|column| column[key as usize])
            .collect();
        if self.audit {
            let read = self.regime.rates(key);
            if rates
                .iter()
                .map(|r| r.to_bits())
                .ne(read.iter().map(|r| r.to_bits()))
            {
                return Err(self.violation(
                    at,
                    format!(
                        "k{key}: a region's rate changed without an event that says so \
                         (kept {rates:?}, read {read:?})"
                    ),
                ));
            }
        }
        // Each region's bucket refills at R·ρ_K/ρ under the numbers stored with it (read
        // from the bucket itself); together at most ρ times the largest numbers any region
        // has (ρ_K, or ρ without a limit of its own): while a change spreads, the larger
        // of old and new; once all have it, the new.
        let stores = &self.regime.stores;
        let enforced: Vec<f64> = rates
            .iter()
            .enumerate()
            .map(|(r, &rate)| stores[r].enforced(key, rate))
            .collect();
        let largest = stores
            .iter()
            .map(RegionStore::scale)
            .fold(f64::MIN, f64::max);
        let sum: f64 = enforced.iter().sum();
        let ratio = sum / (self.sc.rho * largest);
        self.rec.max_rate_ratio = self.rec.max_rate_ratio.max(ratio);
        if !self.mode.promises_bound() {
            return Ok(());
        }
        if ratio > 1.0 + RATE_TOLERANCE {
            let books: Vec<String> = self
                .regime
                .stores
                .iter()
                .enumerate()
                .map(|(r, s)| format!("r{r} at local {}: {:?}", s.now(), s.book(key)))
                .collect();
            let mut v = self.violation(
                at,
                format!(
                    "k{key}: Σ R = {sum:.9} > ρ = {} (rates {rates:?}; each enforced at \
                     R·ρ_K/ρ: {enforced:?})\n  {}",
                    self.sc.rho * largest,
                    books.join("\n  ")
                ),
            );
            v.ratio = Some(ratio);
            return Err(v);
        }
        for (r, s) in self.regime.stores.iter().enumerate() {
            if !cfg!(debug_assertions) && !changed.contains(&r) {
                continue;
            }
            if let Err(e) = s.check_capacity(key).and_then(|()| s.check_net_rate(key)) {
                return Err(self.violation(at, format!("k{key} r{r}: {e}")));
            }
        }
        Ok(())
    }

    fn violation(&self, at: i64, what: String) -> Violation {
        Violation {
            scenario: self.sc.id.clone(),
            mode: self.mode,
            seed: self.seed,
            t_s: self.t_s(at),
            what,
            ratio: None,
            trace: self
                .trace
                .as_ref()
                .map(|t| t.iter().cloned().collect())
                .unwrap_or_default(),
        }
    }
}

/// Reconverged means staying inside the band this long.
pub const RECONVERGED_HOLD_S: f64 = 2.0;

/// Every |R_i − target_i| ≤ this × ρ counts as reconverged after a heal. In steady state
/// (S6 before the cut, seeds 0–4) the largest regional deviation, from demand-estimate
/// noise alone, averages 1.2% of ρ and peaks at 4.6%: a tighter band would time noise.
pub const RECONVERGED: f64 = 0.05;

/// Each region's clock, offset by up to ±`offset_us` and drifting by up to ±`drift`.
/// Split out of [`Run::new`]; the draws from `clock_rng` come first of all its draws and
/// go region by region, offset before drift.
fn draw_clocks(sc: &Scenario, real: &RealTime, clock_rng: &mut ChaCha8Rng) -> Vec<SimClock> {
    (0..sc.regions)
        .map(|_| {
            let offset = clock_rng.random_range(-sc.offset_us..=sc.offset_us);
            let drift = clock_rng.random_range(-sc.drift..=sc.drift);
            SimClock::new(real.clone(), offset, drift)
        })
        .collect()
}

/// The scenario's link cuts, in real time (`t0` is real time at scenario t = 0), for the
/// network. Split out of [`Run::new`]; draws nothing.
fn cuts(sc: &Scenario, t0: i64) -> Vec<Cut> {
    sc.faults
        .iter()
        .filter_map(|f| match *f {
            Fault::Cut {
                from,
                to,
                start_s,
                end_s,
                period_s,
            } => Some(Cut {
                from,
                to,
                start: real_of(t0, start_s),
                end: real_of(t0, end_s),
                period: period_s.map(secs),
            }),
            _ => None,
        })
        .collect()
}

/// The key popularity of a Zipf load (none for single-key loads). Split out of
/// [`Run::new`]; draws nothing.
fn zipf(load: &Load) -> Option<Zipf<f64>> {
    match load {
        Load::Zipf { keys, exponent, .. } => Zipf::new(*keys as f64, *exponent).ok(),
        _ => None,
    }
}

/// Real time of scenario second `s`, given real time `t0` of scenario t = 0.
fn real_of(t0: i64, s: f64) -> i64 {
    t0 + secs(s)
}

fn poisson(rng: &mut ChaCha8Rng, mean: f64) -> u64 {
    if mean <= 0.0 || !mean.is_finite() {
        return 0;
    }
    match Poisson::new(mean) {
        Ok(d) => {
            let x: f64 = d.sample(rng);
            x as u64
        }
        Err(_) => 0,
    }
}

fn stream(seed: u64, n: u64) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(n);
    rng
}

fn secs(s: f64) -> i64 {
    (s * 1e6).round() as i64
}

/// A message, briefly, for the trace.
fn describe(bytes: &[u8]) -> String {
    if let Some(kind) = wire::kind(bytes) {
        return format!("{kind:?}, {} bytes (binary)", bytes.len());
    }
    let s = match Message::decode(bytes) {
        Ok(m) => format!("{m:?}"),
        Err(_) => String::from_utf8_lossy(bytes).into_owned(),
    };
    if s.len() > 400 {
        format!("{}...", &s[..400])
    } else {
        s
    }
}
