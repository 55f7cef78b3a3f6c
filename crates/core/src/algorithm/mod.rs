//! The five limiting algorithms as pure functions: the reference model.
//!
//! This module owns the arithmetic of every algorithm and nothing else: no I/O, no clock,
//! no maps, one file per algorithm, and the transition rule ([`frame`]: what a key's state
//! means under other numbers than it was written with) beside them. The daemon's embedded
//! store keeps one [`State`] per key and runs [`apply`] on it; the Lua scripts in
//! `lua/` do the same arithmetic inside Redis.
//! The differential test (`tests/differential.rs`) drives both with the same random
//! sequences and requires identical answers, so the two copies cannot drift apart.
//!
//! Conventions shared with the Lua scripts (keep them in step):
//! - Time is an integer count of microseconds (`now_us`): Redis `TIME` gives microseconds,
//!   and GCRA at 10,000/s needs sub-millisecond emission intervals (redis-cell#50, #80 broke
//!   on millisecond truncation). Values stay below 2^53, so Lua's doubles hold them exactly.
//! - Fractions (tokens, GCRA's theoretical arrival time) are `f64`, computed with the same
//!   operations in the same order as the Lua code, so both give bit-identical results.
//! - Expiry is garbage collection only. Every decision comes from stored timestamps, never
//!   from whether a key still exists; each state's TTL is chosen so that "expired" and
//!   "absent" mean the same thing (`Write::Put`'s `ttl_us`).
//! - `cost = 0` is a peek: the verdict says whether a cost-1 request would pass now, and
//!   nothing is written.
//! - A [`charge`] spends whether or not the key has the units (a cost known only after the
//!   work was done); a token bucket, GCRA or fixed-window key then owes the rest, and its
//!   TTL lasts until it is paid.

use serde::{Deserialize, Serialize};

use crate::calendar::Periods;

mod fixed_window;
pub mod frame;
mod gcra;
mod sliding_log;
mod sliding_window;
mod token_bucket;

pub use token_bucket::{BucketRate, token_bucket_at};

/// Which algorithm a policy uses. The names are the config and API names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// Counts per fixed window (`fixed_window.rs`).
    FixedWindow,
    /// One entry per admitted unit over the last window (`sliding_log.rs`).
    SlidingLog,
    /// Two windows' counts, the previous weighted (`sliding_window.rs`).
    SlidingWindow,
    /// Tokens refilled at `limit` per window up to `burst` (`token_bucket.rs`).
    TokenBucket,
    /// The generic cell rate algorithm: a theoretical arrival time (`gcra.rs`).
    Gcra,
}

impl Algorithm {
    /// Every algorithm, in declaration order.
    pub const ALL: [Algorithm; 5] = [
        Algorithm::FixedWindow,
        Algorithm::SlidingLog,
        Algorithm::SlidingWindow,
        Algorithm::TokenBucket,
        Algorithm::Gcra,
    ];

    /// Position in [`Algorithm::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The config/API spelling.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingLog => "sliding_log",
            Algorithm::SlidingWindow => "sliding_window",
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::Gcra => "gcra",
        }
    }

    /// Short tag used in storage keys, so that a policy whose algorithm changes never reads
    /// a value of another shape (Redis would answer WRONGTYPE).
    pub fn key_tag(self) -> &'static str {
        match self {
            Algorithm::FixedWindow => "fw",
            Algorithm::SlidingLog => "sl",
            Algorithm::SlidingWindow => "sw",
            Algorithm::TokenBucket => "tb",
            Algorithm::Gcra => "gc",
        }
    }

    /// Whether `burst` means anything for this algorithm (a capacity distinct from `limit`).
    pub fn has_burst(self) -> bool {
        matches!(self, Algorithm::TokenBucket | Algorithm::Gcra)
    }

    /// Whether a key can owe units ([`charge`]): a token bucket (tokens below zero) and
    /// GCRA (a TAT beyond now + τ) keep a debt until it is refilled, a fixed window carries
    /// it into the windows after. A sliding window or log forgets what leaves it.
    pub fn holds_debt(self) -> bool {
        matches!(
            self,
            Algorithm::FixedWindow | Algorithm::TokenBucket | Algorithm::Gcra
        )
    }
}

/// The numbers of a quota, and since when they are in force. Built by the daemon's
/// policies, which guarantee `limit >= 1`, `burst >= 1` and `window_us >= 1000`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Limits {
    /// Admissions per window (token bucket / GCRA: refill of `limit` per `window_us`).
    pub limit: u64,
    /// The window, or the refill period, in µs.
    pub window_us: i64,
    /// Token bucket / GCRA capacity; equal to `limit` for the window algorithms.
    pub burst: u64,
    /// When these numbers came into force: which of two configs is newer when a key's
    /// state was written under other numbers than it is read with ([`frame`]).
    pub since: Since,
}

/// When a policy's numbers came into force, in the transition rule's order
/// ([`frame`]): the policy's `version` first, then the instant (ms since the Unix epoch,
/// by the clock of the instance) its numbers began to apply there. `Since::ZERO` for
/// numbers that never change live (a global policy's) and in tests of one config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Since {
    /// The policy's `version`.
    pub version: u64,
    /// When the numbers began to apply on the instance, ms since the Unix epoch.
    pub at_ms: u64,
}

impl Since {
    /// Numbers that never change live.
    pub const ZERO: Since = Since {
        version: 0,
        at_ms: 0,
    };
}

impl Limits {
    /// Whether two configs have the same numbers (whenever they came into force): a
    /// state written under one reads the same under the other.
    pub fn same_numbers(&self, other: &Limits) -> bool {
        (self.limit, self.window_us, self.burst) == (other.limit, other.window_us, other.burst)
    }

    /// The largest cost one request may have: the bucket capacity or the window limit.
    pub fn capacity(&self, algorithm: Algorithm) -> u64 {
        if algorithm.has_burst() {
            self.burst
        } else {
            self.limit
        }
    }

    /// The longest TTL any write of `algorithm` under these limits carries: one window
    /// (fixed window, sliding log), two (the sliding counter keeps the previous window),
    /// or the time to refill a whole burst (token bucket, GCRA). A key of the policy found
    /// without a TTL can be given this (plus the stores' grace) without changing any
    /// decision: by then its state would have expired anyway. A key in debt ([`charge`])
    /// is the exception: its script gives it the longer TTL of its refill.
    pub fn longest_ttl_us(&self, algorithm: Algorithm) -> i64 {
        match algorithm {
            Algorithm::FixedWindow | Algorithm::SlidingLog => self.window_us,
            Algorithm::SlidingWindow => self.window_us.saturating_mul(2),
            Algorithm::TokenBucket | Algorithm::Gcra => {
                let refill = self.burst as u128 * self.window_us.max(0) as u128;
                i64::try_from(refill.div_ceil(self.limit.max(1) as u128)).unwrap_or(i64::MAX)
            }
        }
    }
}

/// What the caller wants done to a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Admit `cost` units if they fit (0 = peek).
    /// Admit `cost` units if they fit (0 = peek).
    Check {
        /// Units asked for.
        cost: u64,
    },
    /// Give back `cost` units admitted moments ago (a denied batch un-charges its siblings).
    /// Give back `cost` units admitted moments ago.
    Refund {
        /// Units given back.
        cost: u64,
    },
}

/// The answer to one operation, as the scripts return it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Verdict {
    /// Whether the operation was admitted.
    pub allowed: bool,
    /// Units left after it.
    pub remaining: u64,
    /// Time until the key's state is back to "full" (RateLimit reset).
    pub reset_after_us: i64,
    /// When denied: time until the same request could pass. 0 when allowed.
    pub retry_after_us: i64,
}

/// Stored per key. `Log` entries are `(timestamp, member)`, sorted by timestamp, one per
/// admitted unit, mirroring the Redis sorted set (members make same-microsecond entries unique).
///
/// `stamp`: what the transition rule ([`frame`]) keeps with a state: the numbers it was
/// written under and its hold; `None` for a state written before frames (read as the
/// reader's own) and for a global policy's regional bucket, whose rate is its lease
/// book's.
#[derive(Debug, Clone, PartialEq)]
pub enum State {
    /// A fixed window's count.
    Fixed {
        /// The window's index (time / window).
        slot: i64,
        /// Units admitted in it.
        count: u64,
        /// Units charged beyond the limit in `slot` ([`charge`]): the windows after it
        /// start with them counted, up to the limit each, until they are paid.
        owed: u64,
        /// When it was written: where a reader with newer numbers takes it over.
        ts: i64,
        /// The numbers it was written under and its hold ([`Stamp`]).
        stamp: Option<Stamp>,
    },
    /// A sliding log's entries.
    Log {
        /// `(timestamp_us, member)`, one per admitted unit, by time.
        entries: Vec<(i64, String)>,
    },
    /// A sliding window's two counts.
    Sliding {
        /// The current window's index.
        slot: i64,
        /// Units admitted in the current window.
        current: u64,
        /// Units admitted in the window before it.
        previous: u64,
        /// When it was written: where a reader with newer numbers takes it over.
        ts: i64,
        /// The numbers it was written under and its hold ([`Stamp`]).
        stamp: Option<Stamp>,
    },
    /// A token bucket.
    Bucket {
        /// Tokens in the bucket at `ts` (below zero: a debt).
        tokens: f64,
        /// When `tokens` was computed, µs.
        ts: i64,
        /// The numbers it was written under and its hold ([`Stamp`]).
        stamp: Option<Stamp>,
    },
    /// A GCRA key.
    Gcra {
        /// The theoretical arrival time, µs.
        tat: f64,
        /// When the TAT was written: where a reader with newer numbers takes it over.
        ts: i64,
        /// The numbers it was written under and its hold ([`Stamp`]).
        stamp: Option<Stamp>,
    },
}

/// What the transition rule ([`frame`]) keeps with a key's state.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stamp {
    /// The numbers the state was written under.
    pub frame: Limits,
    /// While two configs meet on the key: until when it is not at rest ([`Hold`]).
    pub hold: Option<Hold>,
}

/// While two configs of a policy meet on a key, until when the state is not at rest
/// whatever its frame says: when the older numbers would have let the key go, had they
/// counted everything spent on it. A reader with newer numbers that takes a state over
/// starts it at the rest of the state it took over; every spend moves it at the older
/// numbers' pace; a reader still on the older numbers keeps it at its own. So an instance
/// on the older numbers never finds a key forgotten (at rest, or expired) sooner than its
/// own numbers would have forgotten it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hold {
    /// Store time, us.
    pub until_us: i64,
    /// What a unit of the older numbers moves it by: a bucket's refill time per unit, a
    /// window's length (us).
    pub unit_us: f64,
    /// The furthest spending moves it from now: a bucket's refill of its whole burst, a
    /// window's length (us).
    pub full_us: f64,
}

/// What to do with the stored state after an operation.
#[derive(Debug, Clone, PartialEq)]
pub enum Write {
    /// Leave the stored state (and its TTL) as it was.
    Keep,
    /// Store this state; it may be dropped after `ttl_us` with no change to any decision.
    Put {
        /// The state.
        state: State,
        /// µs from now after which it may be dropped.
        ttl_us: i64,
    },
    /// Remove the key (it is equivalent to absent).
    Delete,
}

impl Write {
    /// Applies this write to a key's state held in memory (`None`: no key).
    pub fn apply_to(self, state: &mut Option<State>) {
        match self {
            Write::Keep => {}
            Write::Put { state: s, .. } => *state = Some(s),
            Write::Delete => *state = None,
        }
    }
}

/// What one operation decided, and what to store.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// The answer.
    pub verdict: Verdict,
    /// What to do with the stored state.
    pub write: Write,
}

/// Runs one operation. `member` is the unique id of this request (sliding log only: its
/// entries are `member:1 ..= member:cost`, so a refund removes exactly those).
pub fn apply(
    algorithm: Algorithm,
    limits: &Limits,
    state: Option<&State>,
    now_us: i64,
    op: Op,
    member: &str,
) -> Outcome {
    match algorithm {
        Algorithm::FixedWindow => fixed_window::apply(limits, state, now_us, op),
        Algorithm::SlidingLog => sliding_log::apply(limits, state, now_us, op, member),
        Algorithm::SlidingWindow => sliding_window::apply(limits, state, now_us, op),
        Algorithm::TokenBucket => token_bucket::apply(limits, state, now_us, op),
        Algorithm::Gcra => gcra::apply(limits, state, now_us, op),
    }
}

/// Runs `run` on a fixed window of calendar periods (`periods`; `None`: any other
/// window, run at `now_us` as it is): at `now_us` in period time ([`Periods`]), with the
/// outcome's reset, retry and TTL brought back to real time. The scripts do the same
/// (`lua/helpers.lua`, `window_enter`).
pub fn on_periods(
    periods: Option<&Periods>,
    now_us: i64,
    run: impl FnOnce(i64) -> Outcome,
) -> Outcome {
    let Some(p) = periods else {
        return run(now_us);
    };
    let now_pt = p.to_period_time(now_us);
    let mut out = run(now_pt);
    let real = |us: i64| p.real_after(now_us, now_pt, us);
    let v = &mut out.verdict;
    v.reset_after_us = real(v.reset_after_us);
    if !v.allowed {
        v.retry_after_us = real(v.retry_after_us).max(1);
    }
    if let Write::Put { ttl_us, .. } = &mut out.write {
        *ttl_us = real(*ttl_us);
    }
    out
}

/// Spends `cost` units of a key whether or not it has them: the settlement of a cost known
/// only once the work was done. Never denied. What the key lacked becomes debt, which
/// later checks wait out: a token bucket's tokens go below zero, a GCRA key's TAT runs
/// beyond now + τ, a fixed window owes the windows after it. `None` for an algorithm that
/// cannot hold a debt ([`Algorithm::holds_debt`]). The scripts' `charge` operation does
/// the same.
pub fn charge(
    algorithm: Algorithm,
    limits: &Limits,
    state: Option<&State>,
    now_us: i64,
    cost: u64,
) -> Option<Outcome> {
    match algorithm {
        Algorithm::FixedWindow => Some(fixed_window::charge(limits, state, now_us, cost)),
        Algorithm::TokenBucket => Some(token_bucket::charge(limits, state, now_us, cost)),
        Algorithm::Gcra => Some(gcra::charge(limits, state, now_us, cost)),
        _ => None,
    }
}

/// [`charge`] on a fixed window of calendar periods ([`on_periods`]).
pub fn charge_on(
    periods: Option<&Periods>,
    algorithm: Algorithm,
    limits: &Limits,
    state: Option<&State>,
    now_us: i64,
    cost: u64,
) -> Option<Outcome> {
    if !algorithm.holds_debt() {
        return None;
    }
    // (An algorithm that holds a debt always charges: the fallback is never taken.)
    let keep = Outcome {
        verdict: allowed(0, 0),
        write: Write::Keep,
    };
    Some(on_periods(periods, now_us, |t| {
        charge(algorithm, limits, state, t, cost).unwrap_or(keep)
    }))
}

/// What a key used and owes, read without changing it: `GET /v1/usage`, and the
/// scripts' `usage` operation (`lua/helpers.lua`), which writes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// A peek's verdict (a check of cost 0): whether one unit would pass now, what
    /// remains, until when.
    pub verdict: Verdict,
    /// Units counted against the capacity now: a fixed window's count (which may exceed a
    /// lowered limit); for the others, the capacity (`burst`, the limit for window
    /// algorithms) less what remains.
    pub used: u64,
    /// Units charged beyond what the key had and not yet paid back ([`charge`]).
    pub debt: u64,
}

/// A key's [`Usage`] at `now_us`; on a fixed window of calendar periods ([`on_periods`])
/// when `periods` is given.
pub fn usage(
    periods: Option<&Periods>,
    algorithm: Algorithm,
    limits: &Limits,
    state: Option<&State>,
    now_us: i64,
) -> Usage {
    let mut held = (None, 0);
    let out = on_periods(periods, now_us, |t| {
        held = match algorithm {
            Algorithm::FixedWindow => {
                let (count, owed) = fixed_window::usage(limits, state, t);
                (Some(count), owed)
            }
            Algorithm::TokenBucket => (None, token_bucket::debt(limits, state, t)),
            Algorithm::Gcra => (None, gcra::debt(limits, state, t)),
            Algorithm::SlidingLog | Algorithm::SlidingWindow => (None, 0),
        };
        apply(algorithm, limits, state, t, Op::Check { cost: 0 }, "")
    });
    let verdict = out.verdict;
    Usage {
        verdict,
        used: held
            .0
            .unwrap_or_else(|| limits.burst.saturating_sub(verdict.remaining)),
        debt: held.1,
    }
}

/// One check of an all-or-nothing batch ([`apply_all`]).
#[derive(Debug, Clone, Copy)]
pub struct Part<'a> {
    /// The check's algorithm.
    pub algorithm: Algorithm,
    /// Its policy's numbers.
    pub limits: Limits,
    /// The key's state before the batch (keys are distinct within a batch).
    pub state: Option<&'a State>,
    /// Units it asks for.
    pub cost: u64,
    /// The request's unique id (sliding log entries).
    pub member: &'a str,
    /// Whether a denial of this check stops the batch (false in shadow mode: observed, not
    /// enforced).
    pub enforced: bool,
    /// A fixed window of calendar periods: the periods around now ([`on_periods`]).
    pub periods: Option<&'a Periods>,
}

/// An all-or-nothing batch (a composite limit, the article's "check every limit, charge
/// only if all pass"): every part is decided against the state before any is charged, and
/// the writes are returned only if no enforced part is denied. Otherwise nothing is
/// written: a denied part reports its denial, and a part that alone would have passed
/// reports the state as it is, as a peek does (nothing of it was spent).
/// `lua/composite.lua` does the same in one script.
pub fn apply_all(parts: &[Part<'_>], now_us: i64) -> (Vec<Verdict>, Option<Vec<Write>>) {
    let outcomes: Vec<Outcome> = parts
        .iter()
        .map(|p| {
            let op = Op::Check { cost: p.cost };
            on_periods(p.periods, now_us, |t| {
                apply(p.algorithm, &p.limits, p.state, t, op, p.member)
            })
        })
        .collect();
    let pass = parts
        .iter()
        .zip(&outcomes)
        .all(|(p, o)| o.verdict.allowed || !p.enforced);
    if pass {
        let verdicts = outcomes.iter().map(|o| o.verdict).collect();
        return (
            verdicts,
            Some(outcomes.into_iter().map(|o| o.write).collect()),
        );
    }
    let verdicts = parts
        .iter()
        .zip(outcomes)
        .map(|(p, o)| match o.verdict.allowed {
            false => o.verdict,
            true => {
                let peek = Op::Check { cost: 0 };
                on_periods(p.periods, now_us, |t| {
                    apply(p.algorithm, &p.limits, p.state, t, peek, p.member)
                })
                .verdict
            }
        })
        .collect();
    (verdicts, None)
}

/// Splits an op into (cost to evaluate, whether to write). A peek evaluates cost 1.
fn eval_cost(op: Op) -> (u64, bool) {
    match op {
        Op::Check { cost: 0 } => (1, false),
        Op::Check { cost } => (cost, true),
        Op::Refund { cost } => (cost, true),
    }
}

fn allowed(remaining: u64, reset_after_us: i64) -> Verdict {
    Verdict {
        allowed: true,
        remaining,
        reset_after_us,
        retry_after_us: 0,
    }
}

fn denied(remaining: u64, reset_after_us: i64, retry_after_us: i64) -> Verdict {
    Verdict {
        allowed: false,
        remaining,
        reset_after_us,
        retry_after_us: retry_after_us.max(1),
    }
}

/// Lua `math.ceil` / `math.floor` on a double, then to an integer (values are far below 2^53).
fn ceil(x: f64) -> i64 {
    x.ceil() as i64
}
fn floor_u(x: f64) -> u64 {
    if x <= 0.0 { 0 } else { x.floor() as u64 }
}

/// What the algorithms' tests share: a sequence run on one key, and limits to run it at.
#[cfg(test)]
mod testing {
    use super::{Algorithm, Limits, Op, Since, State, Verdict, Write, apply};

    pub(super) const SEC: i64 = 1_000_000;

    /// Runs a sequence on one key, applying writes, and returns the verdicts.
    pub(super) fn run(alg: Algorithm, limits: Limits, steps: &[(i64, Op)]) -> Vec<Verdict> {
        let mut state: Option<State> = None;
        steps
            .iter()
            .enumerate()
            .map(|(i, (now, op))| {
                let out = apply(alg, &limits, state.as_ref(), *now, *op, &format!("r{i}"));
                match out.write {
                    Write::Keep => {}
                    Write::Put { state: s, ttl_us } => {
                        assert!(ttl_us >= 0, "{alg:?} wrote a state with ttl {ttl_us}");
                        state = Some(s)
                    }
                    Write::Delete => state = None,
                }
                out.verdict
            })
            .collect()
    }

    pub(super) fn check(cost: u64) -> Op {
        Op::Check { cost }
    }

    pub(super) fn limits(limit: u64, window_us: i64, burst: u64) -> Limits {
        Limits {
            limit,
            window_us,
            burst,
            since: Since::ZERO,
        }
    }

    /// `l` as a config that came into force at `at_ms`.
    pub(super) fn since(l: Limits, at_ms: u64) -> Limits {
        Limits {
            since: Since { version: 1, at_ms },
            ..l
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;

    /// A charge beyond what a key has is debt: checks wait it out, so over time the key
    /// admits no more than its rate whatever the charges were.
    #[test]
    fn a_charge_beyond_the_capacity_is_debt_that_later_checks_wait_out() {
        let (l, t0) = (limits(10, SEC, 10), 100 * SEC);
        for alg in [Algorithm::TokenBucket, Algorithm::Gcra] {
            // 25 units spent at once from a full key of 10: 15 owed, 1.5 s of refill.
            let out = charge(alg, &l, None, t0, 25).expect("holds debt");
            assert!(out.verdict.allowed);
            assert_eq!(out.verdict.remaining, 0, "{alg:?}");
            let Write::Put { state, .. } = out.write else {
                panic!("{alg:?}: {:?}", out.write)
            };
            let at = |t: i64| apply(alg, &l, Some(&state), t, check(1), "r").verdict;
            let v = at(t0 + SEC);
            assert!(!v.allowed, "{alg:?} admitted while 5 units are still owed");
            // The first unit passes once the debt is refilled and one unit more.
            assert_eq!(v.retry_after_us, 600_000, "{alg:?}");
            assert!(at(t0 + SEC + 600_000).allowed, "{alg:?}");
        }
        for alg in [Algorithm::SlidingLog, Algorithm::SlidingWindow] {
            assert!(charge(alg, &l, None, t0, 1).is_none());
            assert!(!alg.holds_debt());
        }
    }

    #[test]
    fn peek_never_writes() {
        let l = limits(2, SEC, 2);
        for alg in Algorithm::ALL {
            let out = apply(alg, &l, None, SEC, check(0), "p");
            assert_eq!(out.write, Write::Keep, "{alg:?}");
            assert!(out.verdict.allowed);
            assert_eq!(out.verdict.remaining, 2, "{alg:?}");
        }
    }

    /// Applies a write to a key held with its expiry; the TTL written, if any.
    fn take(state: &mut Option<(State, i64)>, write: Write, now: i64) -> Option<i64> {
        match write {
            Write::Keep => None,
            Write::Put { state: s, ttl_us } => {
                *state = Some((s, now + ttl_us));
                Some(ttl_us)
            }
            Write::Delete => {
                *state = None;
                None
            }
        }
    }

    /// A check of `cost`, `extra` after the key's expiry, on the expired state and on an
    /// absent key (`None`: no key was left).
    fn after_expiry(
        alg: Algorithm,
        l: &Limits,
        state: &Option<(State, i64)>,
        extra: i64,
        cost: u64,
    ) -> Option<(Verdict, Verdict)> {
        let (s, exp) = state.as_ref()?;
        let op = Op::Check { cost };
        let a = apply(alg, l, Some(s), exp + extra, op, "p").verdict;
        let b = apply(alg, l, None, exp + extra, op, "p").verdict;
        Some((a, b))
    }

    /// Two configs of a policy (the transition rule's two frames): the numbers in force
    /// before and after a change, drawn as proptest does.
    /// The second came into force after the first.
    fn frames(alg: Algorithm, a: (u64, i64, u64), b: (u64, i64, u64)) -> [Limits; 2] {
        let [a, b] = [a, b].map(|(limit, window_ms, burst)| Limits {
            limit,
            window_us: window_ms * 1000,
            burst: if alg.has_burst() { burst } else { limit },
            since: Since::ZERO,
        });
        [since(a, 1), since(b, 2)]
    }

    fn numbers() -> impl proptest::strategy::Strategy<Value = (u64, i64, u64)> {
        (1u64..20, 1i64..2000, 1u64..30)
    }

    proptest::proptest! {
        /// Expiry is garbage collection: once a written state's TTL has passed, every
        /// operation gives the same verdict on it as on an absent key, under the numbers
        /// it was written with or any others (two configs take turns: the transition
        /// rule); and no TTL is longer than the longest `Limits::longest_ttl_us` of the
        /// numbers in play. This is what lets Redis (and the memory store) drop keys
        /// without changing any decision.
        #[test]
        fn expiry_is_equivalent_to_absence(
            alg_i in 0usize..5,
            a in numbers(),
            b in numbers(),
            steps in proptest::collection::vec((0i64..3_000_000, 0u64..25, proptest::bool::ANY, proptest::bool::ANY), 1..40),
            probe_cost in 0u64..25,
            extra in 0i64..5_000_000,
        ) {
            let alg = Algorithm::ALL[alg_i];
            let ls = frames(alg, a, b);
            let longest = ls.iter().map(|l| l.longest_ttl_us(alg)).max().unwrap_or(0);
            let mut now = 1_700_000_000_000_000i64;
            let mut state: Option<(State, i64)> = None; // (state, expires at)
            let mut last = 0;
            for (i, (dt, cost, refund, second)) in steps.iter().enumerate() {
                now += dt;
                let l = &ls[usize::from(*second)];
                let cost = cost % (l.capacity(alg) + 1);
                let op = if *refund { Op::Refund { cost } } else { Op::Check { cost } };
                let live = state.as_ref().filter(|(_, exp)| *exp > now).map(|(s, _)| s);
                let out = apply(alg, l, live, now, op, &format!("m{}", i % 3));
                if let Some(ttl_us) = take(&mut state, out.write, now) {
                    last = usize::from(*second);
                    // What the TTL janitor relies on to repair a key's lost TTL.
                    proptest::prop_assert!(ttl_us <= longest, "{alg:?}: ttl {ttl_us} over {longest}");
                }
            }
            // A sliding log's entries last as long as its last writer's window: a reader
            // with a longer one counts only what the key still holds.
            let readers = match alg {
                Algorithm::SlidingLog => &ls[last..=last],
                _ => &ls[..],
            };
            for l in readers {
                let probe = probe_cost % (l.capacity(alg) + 1);
                if let Some((a, b)) = after_expiry(alg, l, &state, extra, probe) {
                    proptest::prop_assert_eq!(a, b);
                }
            }
        }

        /// A key in debt keeps it until refilled: with charges beyond the capacity among
        /// the checks and refunds, under two configs taking turns, a written state's TTL
        /// still ends exactly where it has become equivalent to an absent key, however
        /// long the debt makes it.
        #[test]
        fn a_key_in_debt_expires_only_once_its_debt_is_refilled(
            alg_i in 0usize..3,
            a in numbers(),
            b in numbers(),
            steps in proptest::collection::vec((0i64..3_000_000, 0u64..80, 0u8..3, proptest::bool::ANY), 1..40),
            probe_cost in 0u64..25,
            extra in 0i64..5_000_000,
        ) {
            let alg = [Algorithm::FixedWindow, Algorithm::TokenBucket, Algorithm::Gcra][alg_i];
            let ls = frames(alg, a, b);
            let mut now = 1_700_000_000_000_000i64;
            let mut state: Option<(State, i64)> = None; // (state, expires at)
            for (dt, cost, kind, second) in &steps {
                now += dt;
                let l = &ls[usize::from(*second)];
                let cap = l.capacity(alg);
                let live = state.as_ref().filter(|(_, exp)| *exp > now).map(|(s, _)| s);
                let out = match kind {
                    0 => charge(alg, l, live, now, (*cost).max(1)).expect("holds debt"),
                    1 => apply(alg, l, live, now, Op::Refund { cost: cost % (cap + 1) }, "m"),
                    _ => apply(alg, l, live, now, Op::Check { cost: cost % (cap + 1) }, "m"),
                };
                take(&mut state, out.write, now);
            }
            for l in &ls {
                let probe = probe_cost % (l.capacity(alg) + 1);
                if let Some((a, b)) = after_expiry(alg, l, &state, extra, probe) {
                    proptest::prop_assert_eq!(a, b);
                }
            }
        }

        /// What lets a denial be answered from memory (`store::redis::deny_cache`), also for a
        /// key in debt ([`charge`]) and for a state written under other numbers (two
        /// configs take turns, as in a rollout): a denial writes nothing, and with no
        /// other write to the key the same check, or one that costs more (a peek counting
        /// as 1), is denied at every instant up to a microsecond before the retry time the
        /// denial gave (which is rounded up to the microsecond; the cache lets an entry go
        /// at least that much earlier), and the check itself fits a microsecond after it
        /// (the float arithmetic of the refill can land the exact instant a hair past the
        /// rounded one).
        #[test]
        fn a_denial_holds_until_its_retry_time_for_equal_and_larger_costs(
            alg_i in 0usize..5,
            a in numbers(),
            b in numbers(),
            steps in proptest::collection::vec((0i64..400_000, 1u64..25, 0u8..20, proptest::bool::ANY), 1..60),
            reader in proptest::bool::ANY,
            cost in 0u64..25,
            more in 0u64..25,
            probes in proptest::collection::vec(0.0f64..1.0, 8),
        ) {
            let alg = Algorithm::ALL[alg_i];
            let ls = frames(alg, a, b);
            let mut now = 1_700_000_000_000_000i64;
            let mut state: Option<State> = None;
            for (i, (dt, c, kind, second)) in steps.iter().enumerate() {
                now += dt;
                let l = &ls[usize::from(*second)];
                let cap = l.capacity(alg);
                // A tenth refunds; where keys can owe, a twentieth charges up to twice the
                // capacity (a key in debt); the rest checks.
                let debt = (*kind == 2).then(|| charge(alg, l, state.as_ref(), now, 2 * c)).flatten();
                let c = c % (cap + 1);
                let op = if *kind < 2 { Op::Refund { cost: c } } else { Op::Check { cost: c } };
                let out = debt.unwrap_or_else(|| apply(alg, l, state.as_ref(), now, op, &format!("m{}", i % 3)));
                out.write.apply_to(&mut state);
            }
            let l = &ls[usize::from(reader)];
            let cap = l.capacity(alg);
            let cost = cost % (cap + 1);
            let out = apply(alg, l, state.as_ref(), now, Op::Check { cost }, "d");
            if !out.verdict.allowed {
                // (A sliding log's denial drops the entries that left the reader's window.)
                let wrote = !matches!(out.write, Write::Keep);
                proptest::prop_assert!(!wrote || alg == Algorithm::SlidingLog, "{alg:?}: a denial wrote");
                let r = out.verdict.retry_after_us;
                proptest::prop_assert!(r >= 1);
                let larger = (cost.max(1) + more).min(cap);
                let mut at: Vec<i64> = probes.iter().map(|f| now + (f * r as f64) as i64).collect();
                at.push(now + r - 2);
                for t in at.into_iter().filter(|t| *t >= now && *t < now + r - 1) {
                    for c in [cost, cost.max(1), larger] {
                        let v = apply(alg, l, state.as_ref(), t, Op::Check { cost: c }, "p").verdict;
                        proptest::prop_assert!(!v.allowed, "{alg:?}: cost {c} allowed at +{} us, retry was {r} us", t - now);
                    }
                }
                // And it is not late by more than the rounding of the float arithmetic.
                let v = apply(alg, l, state.as_ref(), now + r + 1, Op::Check { cost }, "p").verdict;
                proptest::prop_assert!(v.allowed, "{alg:?}: cost {cost} still denied after its retry time +{r} us");
            }
        }

        /// The rollout bound: two configs of a bucket taking turns on one key (two
        /// instances, one already reloaded) admit no more, from any instant on, than the
        /// envelope of the two: the larger burst, refilled at the faster rate. Checks
        /// only; charges and refunds are other operations.
        #[test]
        fn two_configs_taking_turns_admit_within_their_envelope(
            gcra_i in proptest::bool::ANY,
            a in numbers(),
            b in numbers(),
            steps in proptest::collection::vec((0i64..300_000, 1u64..30, proptest::bool::ANY), 1..120),
            from in 0usize..120,
        ) {
            let alg = if gcra_i { Algorithm::Gcra } else { Algorithm::TokenBucket };
            let ls = frames(alg, a, b);
            let burst = ls.iter().map(|l| l.burst).max().unwrap_or(0) as f64;
            let rate = ls.iter().map(|l| l.limit as f64 / l.window_us as f64).fold(0.0, f64::max);
            let mut now = 1_700_000_000_000_000i64;
            let mut state: Option<State> = None;
            let (mut since, mut admitted) = (None, 0u64);
            for (i, (dt, c, second)) in steps.iter().enumerate() {
                now += dt;
                let l = &ls[usize::from(*second)];
                let c = 1 + c % l.burst;
                let out = apply(alg, l, state.as_ref(), now, Op::Check { cost: c }, "m");
                if i >= from {
                    let t0 = *since.get_or_insert(now);
                    if out.verdict.allowed {
                        admitted += c;
                    }
                    let envelope = burst + rate * (now - t0) as f64;
                    proptest::prop_assert!(admitted as f64 <= envelope + 1e-6,
                        "{alg:?} {ls:?}: {admitted} admitted in {} us, envelope {envelope}", now - t0);
                }
                out.write.apply_to(&mut state);
            }
        }
    }

    /// Spends `n` checks of one unit under `l` at `now`, returning the state and how many
    /// were admitted.
    fn spend(alg: Algorithm, l: &Limits, state: &mut Option<State>, now: i64, n: u64) -> u64 {
        let mut admitted = 0;
        for _ in 0..n {
            let out = apply(alg, l, state.as_ref(), now, check(1), "s");
            admitted += u64::from(out.verdict.allowed);
            out.write.apply_to(state);
        }
        admitted
    }

    /// Checks of one unit every `every` from `from` for `span` under `l`: how many passed.
    fn hammer(
        alg: Algorithm,
        l: &Limits,
        state: &mut Option<State>,
        from: i64,
        span: i64,
        every: i64,
    ) -> u64 {
        let mut admitted = 0;
        let mut t = from;
        while t < from + span {
            admitted += spend(alg, l, state, t, 1);
            t += every;
        }
        admitted
    }

    const HOUR: i64 = 3600 * SEC;

    /// A lowered rate (an override to 20 an hour, or the limit alone with the burst left
    /// at 2,000) after the burst was spent: what was spent stays spent, and the key gets
    /// no more than the new numbers refill. GCRA read the stored TAT at the new rate
    /// (1,980 more admitted in the hour).
    #[test]
    fn a_lowered_limit_leaves_what_was_spent_spent() {
        let t0 = 1_000 * HOUR;
        let before = since(limits(2000, HOUR, 2000), 1);
        for alg in [Algorithm::TokenBucket, Algorithm::Gcra] {
            for after in [limits(20, HOUR, 20), limits(20, HOUR, 2000)].map(|l| since(l, 2)) {
                let mut state = None;
                assert_eq!(spend(alg, &before, &mut state, t0, 2000), 2000);
                let more = hammer(alg, &after, &mut state, t0 + SEC, HOUR, 10 * SEC);
                assert!(
                    (19..=20).contains(&more),
                    "{alg:?} {after:?}: {more} admitted in the hour after 2,000 were spent"
                );
            }
        }
    }

    /// A raised limit after 20 of 20 were spent: the 20 used carry over, the rest of the
    /// new burst is there at once. GCRA read the stored TAT at the new rate (denied,
    /// remaining 0).
    #[test]
    fn a_raised_limit_keeps_what_was_used_and_gives_the_rest() {
        let t0 = 1_000 * HOUR;
        let (before, after) = (
            since(limits(20, HOUR, 20), 1),
            since(limits(2000, HOUR, 2000), 2),
        );
        for alg in [Algorithm::TokenBucket, Algorithm::Gcra] {
            let mut state = None;
            assert_eq!(spend(alg, &before, &mut state, t0, 21), 20);
            let v = apply(alg, &after, state.as_ref(), t0 + 1, check(1), "r").verdict;
            assert!(v.allowed, "{alg:?}: {v:?}");
            assert_eq!(v.remaining, 1979, "{alg:?}");
        }
        // The window algorithms count: the count carries as it is.
        for alg in [
            Algorithm::FixedWindow,
            Algorithm::SlidingWindow,
            Algorithm::SlidingLog,
        ] {
            let mut state = None;
            assert_eq!(spend(alg, &before, &mut state, t0, 21), 20);
            let v = apply(alg, &after, state.as_ref(), t0 + 1, check(1), "r").verdict;
            assert_eq!((v.allowed, v.remaining), (true, 1979), "{alg:?}");
        }
    }

    /// A window change rolled out to one instance of two (1 h to 2 h, 10 each): the
    /// count carries between the window lengths, so instances taking turns admit no more
    /// in the two hours than the more permissive config alone would (10 an hour), where
    /// each switch used to start the key over (200 against 10 in 100 rounds).
    #[test]
    fn two_window_lengths_taking_turns_count_one_count() {
        let t0 = 1_000 * 2 * HOUR; // a boundary of both window lengths
        for alg in [
            Algorithm::FixedWindow,
            Algorithm::SlidingWindow,
            Algorithm::SlidingLog,
        ] {
            let ls = [
                since(limits(10, HOUR, 10), 1),
                since(limits(10, 2 * HOUR, 10), 2),
            ];
            let mut state = None;
            let mut admitted = 0;
            for round in 0..100i64 {
                let t = t0 + round * (2 * HOUR / 100);
                admitted += spend(alg, &ls[(round % 2) as usize], &mut state, t, 3);
            }
            assert!(
                (10..=20).contains(&admitted),
                "{alg:?}: {admitted} admitted in two hours"
            );
        }
    }
}
