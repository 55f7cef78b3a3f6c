//! The five limiting algorithms as pure functions: the reference model.
//!
//! This module owns the arithmetic of every algorithm and nothing else: no I/O, no clock,
//! no maps. The embedded memory store ([`crate::store::memory`]) keeps one [`State`] per key
//! and runs [`apply`] on it; the Lua scripts in `lua/` do the same arithmetic inside Redis.
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
//!   "absent" mean the same thing ([`Outcome::ttl_us`]).
//! - `cost = 0` is a peek: the verdict says whether a cost-1 request would pass now, and
//!   nothing is written.
//! - A [`charge`] spends whether or not the key has the units (a cost known only after the
//!   work was done); a token bucket, GCRA or fixed-window key then owes the rest, and its
//!   TTL lasts until it is paid.

use serde::{Deserialize, Serialize};

/// Which algorithm a policy uses. The names are the config and API names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    FixedWindow,
    SlidingLog,
    SlidingWindow,
    TokenBucket,
    Gcra,
}

impl Algorithm {
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

/// The numbers of a quota. Built only by [`crate::policy`], which guarantees
/// `limit >= 1`, `burst >= 1` and `window_us >= 1000`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Admissions per window (token bucket / GCRA: refill of `limit` per `window_us`).
    pub limit: u64,
    pub window_us: i64,
    /// Token bucket / GCRA capacity; equal to `limit` for the window algorithms.
    pub burst: u64,
}

impl Limits {
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
    Check { cost: u64 },
    /// Give back `cost` units admitted moments ago (a denied batch un-charges its siblings).
    Refund { cost: u64 },
}

/// The answer to one operation, as the scripts return it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Verdict {
    pub allowed: bool,
    pub remaining: u64,
    /// Time until the key's state is back to "full" (RateLimit reset).
    pub reset_after_us: i64,
    /// When denied: time until the same request could pass. 0 when allowed.
    pub retry_after_us: i64,
}

/// Stored per key. `Log` entries are `(timestamp, member)`, sorted by timestamp, one per
/// admitted unit, mirroring the Redis sorted set (members make same-microsecond entries unique).
#[derive(Debug, Clone, PartialEq)]
pub enum State {
    Fixed {
        slot: i64,
        count: u64,
        /// Units charged beyond the limit in `slot` ([`charge`]): the windows after it
        /// start with them counted, up to the limit each, until they are paid.
        owed: u64,
    },
    Log {
        entries: Vec<(i64, String)>,
    },
    Sliding {
        slot: i64,
        current: u64,
        previous: u64,
    },
    Bucket {
        tokens: f64,
        ts: i64,
    },
    Gcra {
        tat: f64,
    },
}

/// What to do with the stored state after an operation.
#[derive(Debug, Clone, PartialEq)]
pub enum Write {
    /// Leave the stored state (and its TTL) as it was.
    Keep,
    /// Store this state; it may be dropped after `ttl_us` with no change to any decision.
    Put { state: State, ttl_us: i64 },
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

#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub verdict: Verdict,
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
        Algorithm::FixedWindow => fixed_window(limits, state, now_us, op),
        Algorithm::SlidingLog => sliding_log(limits, state, now_us, op, member),
        Algorithm::SlidingWindow => sliding_window(limits, state, now_us, op),
        Algorithm::TokenBucket => token_bucket(limits, state, now_us, op),
        Algorithm::Gcra => gcra(limits, state, now_us, op),
    }
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
        Algorithm::FixedWindow => Some(fixed_window_charge(limits, state, now_us, cost)),
        Algorithm::TokenBucket => Some(token_bucket_charge(limits, state, now_us, cost)),
        Algorithm::Gcra => Some(gcra_charge(limits, state, now_us, cost)),
        _ => None,
    }
}

/// One check of an all-or-nothing batch ([`apply_all`]).
#[derive(Debug, Clone, Copy)]
pub struct Part<'a> {
    pub algorithm: Algorithm,
    pub limits: Limits,
    /// The key's state before the batch (keys are distinct within a batch).
    pub state: Option<&'a State>,
    pub cost: u64,
    pub member: &'a str,
    /// Whether a denial of this check stops the batch (false in shadow mode: observed, not
    /// enforced).
    pub enforced: bool,
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
            apply(p.algorithm, &p.limits, p.state, now_us, op, p.member)
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
                apply(p.algorithm, &p.limits, p.state, now_us, peek, p.member).verdict
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

// ---------------------------------------------------------------------------- fixed window

/// A fixed window's count and debt in `slot`, from those stored in window `stored`: the
/// debt fills the windows after `stored`, up to `limit` units each, until it is paid.
fn fixed_roll(stored: i64, owed: u64, slot: i64, limit: u64) -> (u64, u64) {
    let between = u64::try_from(slot - stored - 1).unwrap_or(0);
    let left = owed.saturating_sub(limit.saturating_mul(between));
    let count = left.min(limit);
    (count, left - count)
}

/// The fixed window's state at `now`: the slot counted in, its count and the debt beyond
/// it, and the slot the state was stored under (`None`: no state).
fn fixed_at(l: &Limits, state: Option<&State>, now: i64) -> (i64, u64, u64, Option<i64>) {
    let mut slot = now.div_euclid(l.window_us);
    let (stored, mut count, mut owed) = match state {
        Some(State::Fixed { slot, count, owed }) => (Some(*slot), *count, *owed),
        _ => (None, 0, 0),
    };
    match stored {
        // A clock that stepped back (by less than a window) stays in the newer window rather
        // than reopening it. A slot further ahead is not ours: state written under another
        // window length (a config change); it is discarded.
        Some(s) if s == slot + 1 => slot = s,
        Some(s) if s == slot => {}
        Some(s) if s < slot => (count, owed) = fixed_roll(s, owed, slot, l.limit),
        _ => (count, owed) = (0, 0),
    }
    (slot, count, owed, stored)
}

/// Until a fixed window in `slot` owing `owed` is as if absent at `now`: the window's
/// end, then one window per `limit` units still owed.
fn fixed_clear_after(l: &Limits, slot: i64, now: i64, owed: u64) -> i64 {
    (slot + 1) * l.window_us - now + owed.div_ceil(l.limit) as i64 * l.window_us
}

fn fixed_window(l: &Limits, state: Option<&State>, now: i64, op: Op) -> Outcome {
    let w = l.window_us;
    let (slot, mut count, mut owed, stored_slot) = fixed_at(l, state, now);
    let reset_after = (slot + 1) * w - now;
    let clear_after = |owed: u64| fixed_clear_after(l, slot, now, owed);
    // Saturating: after the limit is lowered, a count may exceed it.
    let left = |count: u64| l.limit.saturating_sub(count);
    let put = |count: u64, owed: u64| Write::Put {
        state: State::Fixed { slot, count, owed },
        ttl_us: clear_after(owed),
    };
    let (cost, write) = eval_cost(op);
    if let Op::Refund { .. } = op {
        if stored_slot != Some(slot) {
            // The charge belonged to a window that no longer counts: nothing to give back.
            return Outcome {
                verdict: allowed(left(count), clear_after(owed)),
                write: Write::Keep,
            };
        }
        // What is given back comes off the debt first: it was charged beyond the window.
        let off_debt = cost.min(owed);
        owed -= off_debt;
        count = count.saturating_sub(cost - off_debt);
        return Outcome {
            verdict: allowed(left(count), clear_after(owed)),
            write: put(count, owed),
        };
    }
    if count + cost <= l.limit {
        if !write {
            return Outcome {
                verdict: allowed(left(count), clear_after(owed)),
                write: Write::Keep,
            };
        }
        count += cost;
        Outcome {
            verdict: allowed(left(count), clear_after(owed)),
            write: put(count, owed),
        }
    } else {
        // The first window with room: the next, or one past the windows the debt fills.
        let full = (owed + cost).saturating_sub(l.limit).div_ceil(l.limit);
        let retry = reset_after + full as i64 * w;
        Outcome {
            verdict: denied(left(count), clear_after(owed), retry),
            write: Write::Keep,
        }
    }
}

/// A fixed window's [`charge`]: the units that fit count in this window, the rest is owed
/// to the windows after it.
fn fixed_window_charge(l: &Limits, state: Option<&State>, now: i64, cost: u64) -> Outcome {
    let (slot, count, owed, _) = fixed_at(l, state, now);
    let total = count + cost;
    let count = count.max(total.min(l.limit));
    let owed = owed + (total - count);
    let ttl_us = fixed_clear_after(l, slot, now, owed);
    Outcome {
        verdict: allowed(l.limit.saturating_sub(count), ttl_us),
        write: Write::Put {
            state: State::Fixed { slot, count, owed },
            ttl_us,
        },
    }
}

// ---------------------------------------------------------------------------- sliding log

fn sliding_log(l: &Limits, state: Option<&State>, now: i64, op: Op, member: &str) -> Outcome {
    let w = l.window_us;
    // Entries at or before now - window have left the window (ZREMRANGEBYSCORE -inf, now-w).
    let mut entries: Vec<(i64, String)> = match state {
        Some(State::Log { entries }) => entries
            .iter()
            .filter(|(t, _)| *t > now - w)
            .cloned()
            .collect(),
        _ => Vec::new(),
    };
    let trimmed = match state {
        Some(State::Log { entries: old }) => old.len() != entries.len(),
        _ => false,
    };
    let put_or_delete = |entries: Vec<(i64, String)>| {
        if entries.is_empty() {
            Write::Delete
        } else {
            let newest = entries.last().map(|e| e.0).unwrap_or(now);
            Write::Put {
                state: State::Log { entries },
                ttl_us: newest + w - now,
            }
        }
    };
    let reset_of = |entries: &[(i64, String)]| entries.last().map(|e| e.0 + w - now).unwrap_or(0);
    let (cost, write) = eval_cost(op);
    if let Op::Refund { .. } = op {
        let before = entries.len();
        entries.retain(|(_, m)| !is_member_of(m, member, cost));
        let count = entries.len() as u64;
        let verdict = allowed(l.limit.saturating_sub(count), reset_of(&entries));
        let changed = trimmed || entries.len() != before;
        return Outcome {
            verdict,
            write: if changed {
                put_or_delete(entries)
            } else {
                Write::Keep
            },
        };
    }
    let count = entries.len() as u64;
    let keep_or_trim = |entries: Vec<(i64, String)>| {
        if trimmed {
            put_or_delete(entries)
        } else {
            Write::Keep
        }
    };
    if count + cost <= l.limit {
        if !write {
            let verdict = allowed(l.limit - count, reset_of(&entries));
            return Outcome {
                verdict,
                write: keep_or_trim(entries),
            };
        }
        // Insert after every entry with a timestamp <= now (ZADD keeps score order; equal
        // scores order by member, which no decision depends on).
        let at = entries.partition_point(|(t, _)| *t <= now);
        entries.splice(at..at, (1..=cost).map(|i| (now, format!("{member}:{i}"))));
        let count = entries.len() as u64;
        let verdict = allowed(l.limit - count, reset_of(&entries));
        Outcome {
            verdict,
            write: put_or_delete(entries),
        }
    } else {
        // The request fits once the oldest (count + cost - limit) entries have left.
        let k = (count + cost - l.limit) as usize;
        let retry = entries[k - 1].0 + w - now;
        let verdict = denied(l.limit.saturating_sub(count), reset_of(&entries), retry);
        Outcome {
            verdict,
            write: keep_or_trim(entries),
        }
    }
}

/// Whether `m` is one of the entries `member:1 ..= member:cost`.
fn is_member_of(m: &str, member: &str, cost: u64) -> bool {
    m.strip_prefix(member)
        .and_then(|rest| rest.strip_prefix(':'))
        .and_then(|n| n.parse::<u64>().ok())
        .is_some_and(|n| (1..=cost).contains(&n))
}

// ---------------------------------------------------------------------------- sliding window

/// A sliding-window state as it stands at `now`: the window counted in, the time into it,
/// the two counts, and the slot the state was stored under (`None`: no state).
struct SlidingAt {
    slot: i64,
    elapsed: i64,
    stored: Option<i64>,
    current: u64,
    previous: u64,
}

/// Brings the stored sliding-window state to `now`: one window on, this window's count
/// becomes the previous one; further on, or from another window length, both are zero.
fn sliding_at(w: i64, state: Option<&State>, now: i64) -> SlidingAt {
    let mut slot = now.div_euclid(w);
    let (stored, mut current, mut previous) = match state {
        Some(State::Sliding {
            slot,
            current,
            previous,
        }) => (Some(*slot), *current, *previous),
        _ => (None, 0, 0),
    };
    let mut elapsed = now - slot * w;
    match stored {
        Some(s) if s == slot + 1 => {
            // Clock stepped back (less than a window): stay at the start of the newer window.
            // A slot further ahead is state from another window length: discarded below.
            slot = s;
            elapsed = 0;
        }
        Some(s) if s == slot => {}
        Some(s) if s == slot - 1 => {
            previous = current;
            current = 0;
        }
        _ => {
            previous = 0;
            current = 0;
        }
    }
    SlidingAt {
        slot,
        elapsed,
        stored,
        current,
        previous,
    }
}

/// How long until a request of `cost`, denied now, would fit (the same arithmetic as the
/// Lua script's).
fn sliding_retry(l: &Limits, cost: u64, current: u64, previous: u64, elapsed: i64) -> i64 {
    let w = l.window_us;
    let wf = w as f64;
    // Room left for carried-over weight once this request is in.
    let need = l.limit.saturating_sub(cost) as f64;
    if current as f64 <= need {
        // Wait inside this window for the previous window's weight to decay enough.
        ceil(wf - (need - current as f64) * wf / previous as f64 - elapsed as f64)
    } else {
        // Wait for the next window, where this window's count becomes the decaying one.
        let more = ceil(wf - need * wf / current as f64);
        (w - elapsed) + more.max(0)
    }
}

fn sliding_window(l: &Limits, state: Option<&State>, now: i64, op: Op) -> Outcome {
    let w = l.window_us;
    let SlidingAt {
        slot,
        elapsed,
        stored,
        current,
        previous,
    } = sliding_at(w, state, now);
    let wf = w as f64;
    let weight = (wf - elapsed as f64) / wf;
    let estimate = |current: u64, previous: u64| previous as f64 * weight + current as f64;
    let remaining_of =
        |current: u64, previous: u64| floor_u(l.limit as f64 - estimate(current, previous));
    let reset_of = |current: u64, previous: u64| {
        if current > 0 {
            (slot + 2) * w - now
        } else if previous > 0 {
            (slot + 1) * w - now
        } else {
            0
        }
    };
    let ttl = (slot + 2) * w - now;
    let verdict =
        |current, previous| allowed(remaining_of(current, previous), reset_of(current, previous));
    let keep = |current, previous| Outcome {
        verdict: verdict(current, previous),
        write: Write::Keep,
    };
    let put = |current, previous| Outcome {
        verdict: verdict(current, previous),
        write: Write::Put {
            state: State::Sliding {
                slot,
                current,
                previous,
            },
            ttl_us: ttl,
        },
    };
    let (cost, write) = eval_cost(op);
    if let Op::Refund { .. } = op {
        return match stored {
            Some(s) if s == slot => put(current.saturating_sub(cost), previous),
            Some(s) if s == slot - 1 => put(current, previous.saturating_sub(cost)),
            _ => keep(current, previous),
        };
    }
    if estimate(current, previous) + cost as f64 <= l.limit as f64 {
        if write {
            put(current + cost, previous)
        } else {
            keep(current, previous)
        }
    } else {
        let retry = sliding_retry(l, cost, current, previous, elapsed);
        Outcome {
            verdict: denied(
                remaining_of(current, previous),
                reset_of(current, previous),
                retry,
            ),
            write: Write::Keep,
        }
    }
}

// ---------------------------------------------------------------------------- token bucket

fn token_bucket(l: &Limits, state: Option<&State>, now: i64, op: Op) -> Outcome {
    token_bucket_at(&BucketRate::of(l), state, now, op)
}

fn token_bucket_charge(l: &Limits, state: Option<&State>, now: i64, cost: u64) -> Outcome {
    let rate = BucketRate::of(l);
    let tokens = bucket_tokens(&rate, state, now) - cost as f64;
    let full_in = ceil((rate.capacity - tokens) * rate.per_us / rate.amount);
    Outcome {
        verdict: allowed(floor_u(tokens), full_in),
        write: Write::Put {
            state: State::Bucket { tokens, ts: now },
            ttl_us: full_in,
        },
    }
}

/// A token bucket's refill and capacity as plain numbers: `amount` units every `per_us`
/// microseconds, holding at most `capacity`. A policy's [`Limits`] are one such rate; a
/// region's share of a global budget is another (`amount` = the enforced rate R_i per
/// second, `capacity` = B·R_i/ρ), which changes whenever a lease starts or ends.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BucketRate {
    pub amount: f64,
    pub per_us: f64,
    pub capacity: f64,
}

impl BucketRate {
    /// A policy's token bucket: `limit` per window, holding at most `burst`.
    fn of(l: &Limits) -> Self {
        BucketRate {
            amount: l.limit as f64,
            per_us: l.window_us as f64,
            capacity: l.burst as f64,
        }
    }

    /// `per_second` units per second, holding at most `capacity`.
    pub fn per_second(per_second: f64, capacity: f64) -> Self {
        BucketRate {
            amount: per_second,
            per_us: 1e6,
            capacity,
        }
    }
}

/// The token bucket at a given rate: the one implementation behind [`Algorithm::TokenBucket`]
/// and the regional buckets of global policies. A rate that changes over time is applied
/// piecewise: `Op::Refund { cost: 0 }` at each change point settles the bucket at the old
/// rate (refill, then clamp to the old capacity) without spending anything, and the next
/// operation at the new rate clamps to the new capacity. A zero rate never refills (and
/// denials then say "retry in i64::MAX us").
pub fn token_bucket_at(rate: &BucketRate, state: Option<&State>, now: i64, op: Op) -> Outcome {
    let cap = rate.capacity;
    let lim = rate.amount;
    let wf = rate.per_us;
    let mut tokens = bucket_tokens(rate, state, now);
    let full_in = |tokens: f64| ceil((cap - tokens) * wf / lim);
    let put = |tokens: f64| Write::Put {
        state: State::Bucket { tokens, ts: now },
        ttl_us: full_in(tokens),
    };
    let (cost, write) = eval_cost(op);
    let cost_f = cost as f64;
    if let Op::Refund { .. } = op {
        if state.is_none() {
            return Outcome {
                verdict: allowed(floor_u(tokens), 0),
                write: Write::Keep,
            };
        }
        tokens = cap.min(tokens + cost_f);
        return Outcome {
            verdict: allowed(floor_u(tokens), full_in(tokens)),
            write: put(tokens),
        };
    }
    if tokens >= cost_f {
        if !write {
            return Outcome {
                verdict: allowed(floor_u(tokens), full_in(tokens)),
                write: Write::Keep,
            };
        }
        tokens -= cost_f;
        Outcome {
            verdict: allowed(floor_u(tokens), full_in(tokens)),
            write: put(tokens),
        }
    } else {
        let retry = ceil((cost_f - tokens) * wf / lim);
        Outcome {
            verdict: denied(floor_u(tokens), full_in(tokens), retry),
            write: Write::Keep,
        }
    }
}

/// The bucket's tokens at `now`: refilled since its last write, at most its capacity (a
/// missing key is a full bucket).
fn bucket_tokens(rate: &BucketRate, state: Option<&State>, now: i64) -> f64 {
    let (tokens, ts) = match state {
        Some(State::Bucket { tokens, ts }) => (*tokens, *ts),
        _ => (rate.capacity, now),
    };
    let elapsed = (now - ts).max(0) as f64;
    rate.capacity
        .min(tokens + elapsed * rate.amount / rate.per_us)
}

// ---------------------------------------------------------------------------- GCRA

/// Keeps `remaining` from reading 4 where exact arithmetic gives 5 (e.g. T = 1/3 s).
const GCRA_EPSILON: f64 = 1e-9;

/// A GCRA key as of `now`: the emission interval T, the tolerance τ and the stored TAT.
struct GcraAt {
    /// Microseconds per unit (may be below 1 ms).
    interval: f64,
    /// How far ahead of now the TAT may run.
    tau: f64,
    nowf: f64,
    tat: Option<f64>,
}

impl GcraAt {
    fn new(l: &Limits, state: Option<&State>, now: i64) -> Self {
        let interval = l.window_us as f64 / l.limit as f64;
        let tat = match state {
            Some(State::Gcra { tat }) => Some(*tat),
            _ => None,
        };
        GcraAt {
            interval,
            tau: interval * l.burst as f64,
            nowf: now as f64,
            tat,
        }
    }

    /// Where the next unit's emission starts: the TAT, or now if it has passed.
    fn base(&self) -> f64 {
        self.nowf.max(self.tat.unwrap_or(self.nowf))
    }

    /// Units that would still conform now with the TAT at `t`.
    fn remaining_of(&self, t: f64) -> u64 {
        floor_u((self.tau - (t - self.nowf)) / self.interval + GCRA_EPSILON)
    }
}

fn gcra(l: &Limits, state: Option<&State>, now: i64, op: Op) -> Outcome {
    let g = GcraAt::new(l, state, now);
    let (interval, tau, nowf, tat, base) = (g.interval, g.tau, g.nowf, g.tat, g.base());
    let remaining_of = |t: f64| g.remaining_of(t);
    let (cost, write) = eval_cost(op);
    let cost_f = cost as f64;
    if let Op::Refund { .. } = op {
        let Some(tat) = tat else {
            return Outcome {
                verdict: allowed(remaining_of(base), 0),
                write: Write::Keep,
            };
        };
        let new_tat = tat - cost_f * interval;
        let write = if new_tat > nowf {
            Write::Put {
                state: State::Gcra { tat: new_tat },
                ttl_us: ceil(new_tat - nowf),
            }
        } else {
            Write::Delete
        };
        let t = nowf.max(new_tat);
        return Outcome {
            verdict: allowed(remaining_of(t), ceil(t - nowf)),
            write,
        };
    }
    let new_tat = base + cost_f * interval;
    let allow_at = new_tat - tau;
    if nowf >= allow_at {
        if !write {
            return Outcome {
                verdict: allowed(remaining_of(base), ceil(base - nowf)),
                write: Write::Keep,
            };
        }
        Outcome {
            verdict: allowed(remaining_of(new_tat), ceil(new_tat - nowf)),
            write: Write::Put {
                state: State::Gcra { tat: new_tat },
                ttl_us: ceil(new_tat - nowf),
            },
        }
    } else {
        Outcome {
            verdict: denied(remaining_of(base), ceil(base - nowf), ceil(allow_at - nowf)),
            write: Write::Keep,
        }
    }
}

fn gcra_charge(l: &Limits, state: Option<&State>, now: i64, cost: u64) -> Outcome {
    let g = GcraAt::new(l, state, now);
    let new_tat = g.base() + cost as f64 * g.interval;
    Outcome {
        verdict: allowed(g.remaining_of(new_tat), ceil(new_tat - g.nowf)),
        write: Write::Put {
            state: State::Gcra { tat: new_tat },
            ttl_us: ceil(new_tat - g.nowf),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: i64 = 1_000_000;

    /// Runs a sequence on one key, applying writes, and returns the verdicts.
    fn run(alg: Algorithm, limits: Limits, steps: &[(i64, Op)]) -> Vec<Verdict> {
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

    fn check(cost: u64) -> Op {
        Op::Check { cost }
    }

    fn limits(limit: u64, window_us: i64, burst: u64) -> Limits {
        Limits {
            limit,
            window_us,
            burst,
        }
    }

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

    /// A fixed window owes what a charge could not count in it: the windows after start
    /// with the debt counted, a limit's worth each, until it is paid.
    #[test]
    fn a_fixed_windows_debt_fills_the_windows_after_it() {
        let (l, t0) = (limits(10, SEC, 10), 100 * SEC);
        // 4 spent, then 31 charged: 6 fit here and 25 are owed: the two windows after
        // this one are full, and the third starts with 5.
        let mut state = match apply(Algorithm::FixedWindow, &l, None, t0, check(4), "a").write {
            Write::Put { state, .. } => state,
            w => panic!("{w:?}"),
        };
        let out = charge(Algorithm::FixedWindow, &l, Some(&state), t0 + 1, 31).unwrap();
        assert_eq!(out.verdict.remaining, 0);
        assert_eq!(out.verdict.reset_after_us, 4 * SEC - 1, "clear once paid");
        if let Write::Put { state: s, ttl_us } = out.write {
            assert_eq!(ttl_us, 4 * SEC - 1);
            state = s;
        }
        let at = |t: i64, c: u64| {
            apply(Algorithm::FixedWindow, &l, Some(&state), t, check(c), "b").verdict
        };
        let v = at(t0 + 2, 1);
        assert!(!v.allowed);
        assert_eq!(v.retry_after_us, 3 * SEC - 2, "the third window has room");
        assert!(!at(t0 + SEC, 1).allowed, "the next window is full of debt");
        assert!(!at(t0 + 2 * SEC, 1).allowed, "and the one after");
        assert!(!at(t0 + 3 * SEC, 6).allowed, "the third holds 5 owed");
        assert!(at(t0 + 3 * SEC, 5).allowed);
        let paid = at(t0 + 4 * SEC, 10);
        assert!(paid.allowed, "paid: a whole window again");
    }

    #[test]
    fn fixed_window_counts_down_and_resets_at_the_boundary() {
        let (l, t0) = (limits(3, SEC, 3), 10 * SEC);
        let v = run(
            Algorithm::FixedWindow,
            l,
            &[
                (t0, check(1)),
                (t0 + 1, check(1)),
                (t0 + 2, check(1)),
                (t0 + 3, check(1)),
                (t0 + SEC, check(1)),
            ],
        );
        let got: Vec<_> = v.iter().map(|v| (v.allowed, v.remaining)).collect();
        assert_eq!(
            got,
            vec![(true, 2), (true, 1), (true, 0), (false, 0), (true, 2)]
        );
        assert_eq!(v[3].retry_after_us, SEC - 3);
    }

    #[test]
    fn sliding_log_article_sequence() {
        // Limit 3 per 60 s; requests at 0, 100, 200, 300, 59 999, 60 001, 60 150 ms.
        let l = Limits {
            limit: 3,
            window_us: 60 * SEC,
            burst: 3,
        };
        let ms = 1000;
        let t0 = 1_000 * SEC;
        let times = [0, 100, 200, 300, 59_999, 60_001, 60_150];
        let steps: Vec<_> = times.iter().map(|t| (t0 + t * ms, check(1))).collect();
        let got: Vec<_> = run(Algorithm::SlidingLog, l, &steps)
            .iter()
            .map(|v| v.allowed)
            .collect();
        assert_eq!(got, vec![true, true, true, false, false, true, true]);
    }

    #[test]
    fn sliding_log_refund_removes_exactly_its_entries() {
        let l = Limits {
            limit: 5,
            window_us: SEC,
            burst: 5,
        };
        let st = None;
        let a = apply(Algorithm::SlidingLog, &l, st.as_ref(), 0, check(3), "a");
        let Write::Put { state, .. } = a.write else {
            panic!()
        };
        let b = apply(Algorithm::SlidingLog, &l, Some(&state), 1, check(2), "b");
        assert_eq!(b.verdict.remaining, 0);
        let Write::Put { state, .. } = b.write else {
            panic!()
        };
        let r = apply(
            Algorithm::SlidingLog,
            &l,
            Some(&state),
            2,
            Op::Refund { cost: 3 },
            "a",
        );
        assert_eq!(r.verdict.remaining, 3);
    }

    #[test]
    fn token_bucket_article_sequence() {
        // Capacity 5 at 2 tokens/s: seven immediate calls, then one after 1 s.
        let l = Limits {
            limit: 2,
            window_us: SEC,
            burst: 5,
        };
        let t0 = 50 * SEC;
        let mut steps: Vec<_> = (0..7).map(|i| (t0 + i * 100, check(1))).collect();
        steps.push((t0 + 600 + SEC, check(1)));
        let got: Vec<_> = run(Algorithm::TokenBucket, l, &steps)
            .iter()
            .map(|v| (v.allowed, v.remaining))
            .collect();
        assert_eq!(
            got,
            vec![
                (true, 4),
                (true, 3),
                (true, 2),
                (true, 1),
                (true, 0),
                (false, 0),
                (false, 0),
                (true, 1)
            ]
        );
    }

    #[test]
    fn token_bucket_keeps_fractional_tokens() {
        let l = Limits {
            limit: 2,
            window_us: SEC,
            burst: 1,
        };
        let a = apply(Algorithm::TokenBucket, &l, None, 0, check(1), "");
        let Write::Put { state, .. } = a.write else {
            panic!()
        };
        // 0.25 s later: 0.5 tokens, not enough; the deny says 0.25 s more.
        let b = apply(
            Algorithm::TokenBucket,
            &l,
            Some(&state),
            SEC / 4,
            check(1),
            "",
        );
        assert!(!b.verdict.allowed);
        assert_eq!(b.verdict.retry_after_us, SEC / 4);
    }

    #[test]
    fn gcra_admits_at_ten_thousand_per_second() {
        // 10,000/s, burst 1: emission interval 100 us. Offer one request every 50 us for 1 s.
        let l = Limits {
            limit: 10_000,
            window_us: SEC,
            burst: 1,
        };
        let t0 = 7 * SEC;
        let steps: Vec<_> = (0..20_000).map(|i| (t0 + i * 50, check(1))).collect();
        let admitted = run(Algorithm::Gcra, l, &steps)
            .iter()
            .filter(|v| v.allowed)
            .count();
        assert_eq!(admitted, 10_000);
    }

    #[test]
    fn sliding_window_weights_the_previous_window() {
        let l = Limits {
            limit: 10,
            window_us: SEC,
            burst: 10,
        };
        let t0 = 100 * SEC;
        // 10 in window 0, then at 25% into window 1 the estimate is 7.5: 2 more fit, not 3.
        let mut steps: Vec<_> = (0..10).map(|i| (t0 + i, check(1))).collect();
        steps.push((t0 + SEC + SEC / 4, check(2)));
        steps.push((t0 + SEC + SEC / 4, check(1)));
        let v = run(Algorithm::SlidingWindow, l, &steps);
        assert!(v[..10].iter().all(|v| v.allowed));
        assert!(v[10].allowed);
        assert!(!v[11].allowed, "{:?}", v[11]);
        assert!(v[11].retry_after_us > 0);
    }

    #[test]
    fn peek_never_writes() {
        let l = Limits {
            limit: 2,
            window_us: SEC,
            burst: 2,
        };
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

    proptest::proptest! {
        /// Expiry is garbage collection: once a written state's TTL has passed, every
        /// operation gives the same verdict on it as on an absent key; and no TTL is longer
        /// than `Limits::longest_ttl_us`. This is what lets Redis
        /// (and the memory store) drop keys without changing any decision.
        #[test]
        fn expiry_is_equivalent_to_absence(
            alg_i in 0usize..5,
            limit in 1u64..20,
            window_ms in 1i64..2000,
            burst in 1u64..30,
            steps in proptest::collection::vec((0i64..3_000_000, 0u64..25, proptest::bool::ANY), 1..40),
            probe_cost in 0u64..25,
            extra in 0i64..5_000_000,
        ) {
            let alg = Algorithm::ALL[alg_i];
            let l = Limits { limit, window_us: window_ms * 1000, burst: if alg.has_burst() { burst } else { limit } };
            let cap = l.capacity(alg);
            let mut now = 1_700_000_000_000_000i64;
            let mut state: Option<(State, i64)> = None; // (state, expires at)
            for (i, (dt, cost, refund)) in steps.iter().enumerate() {
                now += dt;
                let cost = cost % (cap + 1);
                let op = if *refund { Op::Refund { cost } } else { Op::Check { cost } };
                let live = state.as_ref().filter(|(_, exp)| *exp > now).map(|(s, _)| s);
                let out = apply(alg, &l, live, now, op, &format!("m{}", i % 3));
                if let Some(ttl_us) = take(&mut state, out.write, now) {
                    // What the TTL janitor relies on to repair a key's lost TTL.
                    proptest::prop_assert!(
                        ttl_us <= l.longest_ttl_us(alg),
                        "{alg:?}: ttl {ttl_us} over {}", l.longest_ttl_us(alg)
                    );
                }
            }
            if let Some((a, b)) = after_expiry(alg, &l, &state, extra, probe_cost % (cap + 1)) {
                proptest::prop_assert_eq!(a, b);
            }
        }

        /// A key in debt keeps it until refilled: with charges beyond the capacity among
        /// the checks and refunds, a written state's TTL still ends exactly where it has
        /// become equivalent to an absent key, however long the debt makes it.
        #[test]
        fn a_key_in_debt_expires_only_once_its_debt_is_refilled(
            alg_i in 0usize..3,
            limit in 1u64..20,
            window_ms in 1i64..2000,
            burst in 1u64..30,
            steps in proptest::collection::vec((0i64..3_000_000, 0u64..80, 0u8..3), 1..40),
            probe_cost in 0u64..25,
            extra in 0i64..5_000_000,
        ) {
            let alg = [Algorithm::FixedWindow, Algorithm::TokenBucket, Algorithm::Gcra][alg_i];
            let l = Limits { limit, window_us: window_ms * 1000, burst: if alg.has_burst() { burst } else { limit } };
            let cap = l.capacity(alg);
            let mut now = 1_700_000_000_000_000i64;
            let mut state: Option<(State, i64)> = None; // (state, expires at)
            for (dt, cost, kind) in &steps {
                now += dt;
                let live = state.as_ref().filter(|(_, exp)| *exp > now).map(|(s, _)| s);
                let out = match kind {
                    0 => charge(alg, &l, live, now, (*cost).max(1)).expect("holds debt"),
                    1 => apply(alg, &l, live, now, Op::Refund { cost: cost % (cap + 1) }, "m"),
                    _ => apply(alg, &l, live, now, Op::Check { cost: cost % (cap + 1) }, "m"),
                };
                take(&mut state, out.write, now);
            }
            if let Some((a, b)) = after_expiry(alg, &l, &state, extra, probe_cost % (cap + 1)) {
                proptest::prop_assert_eq!(a, b);
            }
        }

        /// What lets a denial be answered from memory (`store::deny_cache`), also for a
        /// key in debt ([`charge`]): a denial
        /// writes nothing, and with no other write to the key the same check, or one that
        /// costs more (a peek counting as 1), is denied at every instant up to a microsecond
        /// before the retry time the denial gave (which is rounded up to the microsecond;
        /// the cache lets an entry go at least that much earlier), and the check itself
        /// fits a microsecond after it (the float arithmetic of the refill can land the
        /// exact instant a hair past the rounded one).
        #[test]
        fn a_denial_holds_until_its_retry_time_for_equal_and_larger_costs(
            alg_i in 0usize..5,
            limit in 1u64..20,
            window_ms in 1i64..2000,
            burst in 1u64..30,
            steps in proptest::collection::vec((0i64..400_000, 1u64..25, 0u8..20), 1..60),
            cost in 0u64..25,
            more in 0u64..25,
            probes in proptest::collection::vec(0.0f64..1.0, 8),
        ) {
            let alg = Algorithm::ALL[alg_i];
            let l = Limits { limit, window_us: window_ms * 1000, burst: if alg.has_burst() { burst } else { limit } };
            let cap = l.capacity(alg);
            let mut now = 1_700_000_000_000_000i64;
            let mut state: Option<State> = None;
            for (i, (dt, c, kind)) in steps.iter().enumerate() {
                now += dt;
                // A tenth refunds; where keys can owe, a twentieth charges up to twice the
                // capacity (a key in debt); the rest checks.
                let debt = (*kind == 2).then(|| charge(alg, &l, state.as_ref(), now, 2 * c)).flatten();
                let c = c % (cap + 1);
                let op = if *kind < 2 { Op::Refund { cost: c } } else { Op::Check { cost: c } };
                let out = debt.unwrap_or_else(|| apply(alg, &l, state.as_ref(), now, op, &format!("m{}", i % 3)));
                match out.write {
                    Write::Keep => {}
                    Write::Put { state: s, .. } => state = Some(s),
                    Write::Delete => state = None,
                }
            }
            let cost = cost % (cap + 1);
            let out = apply(alg, &l, state.as_ref(), now, Op::Check { cost }, "d");
            if !out.verdict.allowed {
                proptest::prop_assert!(matches!(out.write, Write::Keep), "{alg:?}: a denial wrote");
                let r = out.verdict.retry_after_us;
                proptest::prop_assert!(r >= 1);
                let larger = (cost.max(1) + more).min(cap);
                let mut at: Vec<i64> = probes.iter().map(|f| now + (f * r as f64) as i64).collect();
                at.push(now + r - 2);
                for t in at.into_iter().filter(|t| *t >= now && *t < now + r - 1) {
                    for c in [cost, cost.max(1), larger] {
                        let v = apply(alg, &l, state.as_ref(), t, Op::Check { cost: c }, "p").verdict;
                        proptest::prop_assert!(!v.allowed, "{alg:?}: cost {c} allowed at +{} us, retry was {r} us", t - now);
                    }
                }
                // And it is not late by more than the rounding of the float arithmetic.
                let v = apply(alg, &l, state.as_ref(), now + r + 1, Op::Check { cost }, "p").verdict;
                proptest::prop_assert!(v.allowed, "{alg:?}: cost {cost} still denied after its retry time +{r} us");
            }
        }
    }
}
