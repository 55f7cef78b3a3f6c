//! The token bucket: capacity `burst`, refilled continuously at `limit` per window
//! (`lua/token_bucket.lua`), and the same bucket at the varying rate of a global policy's
//! region ([`token_bucket_at`], `lua/global/`).

use super::frame::{self, Reading, carry_tokens};
use super::{
    Algorithm, Limits, Op, Outcome, Stamp, State, Verdict, Write, allowed, ceil, denied, eval_cost,
    floor_u,
};

/// `tokens` written at `ts`, refilled to `now` at the rate of `l`, at most its burst.
fn refill(l: &Limits, tokens: f64, ts: i64, now: i64) -> f64 {
    let elapsed = (now - ts).max(0) as f64;
    (l.burst as f64).min(tokens + elapsed * l.limit as f64 / l.window_us as f64)
}

/// Until a bucket of `l` holding `tokens` is full.
fn full_in(l: &Limits, tokens: f64) -> i64 {
    ceil((l.burst as f64 - tokens) * l.window_us as f64 / l.limit as f64)
}

/// A token bucket key as reader `l` reads it at `now` ([`Reading`]): the tokens under the
/// reading's numbers (refilled at its rate, up to its burst), the stored stamp, and until
/// when the stored state is not at rest (`None`: no state; a state at rest, full in its
/// own frame with its hold passed, reads as none under any numbers, as its expiry makes
/// it).
struct BucketAt {
    r: Reading,
    tokens: f64,
    stamp: Option<Stamp>,
    rest_us: Option<i64>,
    /// A reader held to both: its own bucket of everything spent on the key.
    own: Option<f64>,
}

impl BucketAt {
    fn new(l: &Limits, state: Option<&State>, now: i64) -> Self {
        let (stored, stamp) = match state {
            Some(State::Bucket { tokens, ts, stamp }) => (Some((*tokens, *ts)), *stamp),
            _ => (None, None),
        };
        let f = Reading::frame(l, stamp.as_ref());
        let rest_us = stored.and_then(|(t, ts)| {
            frame::rest_after(stamp.as_ref(), full_in(&f, refill(&f, t, ts, now)), now)
        });
        let stored = stored.filter(|_| rest_us.is_some());
        let stamp = stamp.filter(|_| rest_us.is_some());
        let r = Reading::of(Algorithm::TokenBucket, l, stamp.as_ref());
        let n = &r.numbers;
        let (tokens, ts) = stored.unwrap_or((n.burst as f64, now));
        // Taken over: what was used carries into the reader's burst as of the last write;
        // the time since refills at the reader's rate.
        let tokens = match r.take_over {
            Some(f) => carry_tokens(tokens, f.burst, l.burst),
            None => tokens,
        };
        BucketAt {
            tokens: refill(n, tokens, ts, now),
            own: r.own_tokens(stamp.as_ref(), now),
            stamp,
            rest_us,
            r,
        }
    }

    /// What the reader may spend of `tokens` after `spent` more: all of them, or (a
    /// reader held to a smaller burst than the frame's) what is beyond the difference,
    /// and (held to both) no more than its own bucket holds.
    fn view(&self, tokens: f64, spent: f64) -> f64 {
        let v = carry_tokens(tokens, self.r.numbers.burst, self.r.cap);
        self.own.map_or(v, |own| v.min(own - spent))
    }

    /// The bucket holding `tokens`, written now after spending `spent` (a refund: giving
    /// them back).
    fn put(&self, tokens: f64, spent: i64, now: i64) -> Write {
        let stamp = self
            .r
            .stamp(self.stamp.as_ref(), self.rest_us.unwrap_or(0), spent, now);
        Write::Put {
            state: State::Bucket {
                tokens,
                ts: now,
                stamp: Some(stamp),
            },
            ttl_us: frame::ttl(&stamp, full_in(&self.r.numbers, tokens), now),
        }
    }

    /// The reader's verdict on the bucket holding `tokens` as written now after spending
    /// `spent`, allowed.
    fn written(&self, tokens: f64, spent: f64) -> Verdict {
        allowed(
            floor_u(self.view(tokens, spent)),
            full_in(&self.r.numbers, tokens),
        )
    }

    /// Until a check of `cost`, denied now, passes: once the bucket holds it (a reader
    /// held to a smaller burst than the frame's needs the difference on top) and the
    /// reader's own bucket too (held to both); or once the state is at rest.
    fn retry(&self, cost: u64) -> i64 {
        let n = &self.r.numbers;
        let rest = self.rest_us.unwrap_or(i64::MAX);
        if cost > self.r.cap {
            return rest;
        }
        let need = (cost + n.burst - self.r.cap) as f64;
        let refill = ceil((need - self.tokens) * n.window_us as f64 / n.limit as f64);
        let own = match self.own {
            Some(own) if own < cost as f64 => {
                let l = &self.r.reader();
                ceil((cost as f64 - own) * (l.window_us as f64 / l.limit as f64))
            }
            _ => 0,
        };
        refill.max(own).min(rest)
    }

    /// Until the key is full as it stands: in the reader's view, or at rest.
    fn full_after(&self) -> i64 {
        let full = full_in(&self.r.numbers, self.tokens);
        self.rest_us.map_or(full, |rest| full.min(rest))
    }
}

pub(super) fn apply(l: &Limits, state: Option<&State>, now: i64, op: Op) -> Outcome {
    let at = BucketAt::new(l, state, now);
    let tokens = at.tokens;
    let (cost, write) = eval_cost(op);
    let cost_f = cost as f64;
    if let Op::Refund { .. } = op {
        if at.rest_us.is_none() {
            return Outcome {
                verdict: allowed(floor_u(at.view(tokens, 0.0)), 0),
                write: Write::Keep,
            };
        }
        let tokens = (at.r.numbers.burst as f64).min(tokens + cost_f);
        return Outcome {
            verdict: at.written(tokens, -cost_f),
            write: at.put(tokens, -(cost as i64), now),
        };
    }
    if at.view(tokens, 0.0) >= cost_f {
        if !write {
            return Outcome {
                verdict: allowed(floor_u(at.view(tokens, 0.0)), at.full_after()),
                write: Write::Keep,
            };
        }
        let tokens = tokens - cost_f;
        return Outcome {
            verdict: at.written(tokens, cost_f),
            write: at.put(tokens, cost as i64, now),
        };
    }
    Outcome {
        verdict: denied(
            floor_u(at.view(tokens, 0.0)),
            at.full_after(),
            at.retry(cost),
        ),
        write: Write::Keep,
    }
}

/// What the bucket owes at `now` ([`super::usage`]): the units below zero, whole.
pub(super) fn debt(l: &Limits, state: Option<&State>, now: i64) -> u64 {
    let tokens = BucketAt::new(l, state, now).tokens;
    if tokens < 0.0 {
        ceil(-tokens - 1e-9) as u64
    } else {
        0
    }
}

/// A [`super::charge`]: spent whether or not the bucket has it; below zero is debt,
/// refilled before any check passes again.
pub(super) fn charge(l: &Limits, state: Option<&State>, now: i64, cost: u64) -> Outcome {
    let at = BucketAt::new(l, state, now);
    let tokens = at.tokens - cost as f64;
    Outcome {
        verdict: at.written(tokens, cost as f64),
        write: at.put(tokens, cost as i64, now),
    }
}

/// A token bucket's refill and capacity as plain numbers: `amount` units every `per_us`
/// microseconds, holding at most `capacity`. A policy's [`Limits`] are one such rate; a
/// region's share of a global budget is another (`amount` = the enforced rate R_i per
/// second, `capacity` = B·R_i/ρ), which changes whenever a lease starts or ends.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BucketRate {
    /// Units refilled per `per_us`.
    pub amount: f64,
    /// The refill period, µs.
    pub per_us: f64,
    /// The most the bucket holds.
    pub capacity: f64,
}

impl BucketRate {
    /// `per_second` units per second, holding at most `capacity`.
    pub fn per_second(per_second: f64, capacity: f64) -> Self {
        BucketRate {
            amount: per_second,
            per_us: 1e6,
            capacity,
        }
    }
}

/// The token bucket of a global policy's region, at the rate of its lease book. A rate
/// that changes over time is applied
/// piecewise: `Op::Refund { cost: 0 }` at each change point settles the bucket at the old
/// rate (refill, then clamp to the old capacity) without spending anything, and the next
/// operation at the new rate clamps to the new capacity. A zero rate never refills (and
/// denials then say "retry in i64::MAX us"). Its states carry no frame: the rate is the
/// book's, not the policy's numbers.
pub fn token_bucket_at(rate: &BucketRate, state: Option<&State>, now: i64, op: Op) -> Outcome {
    let cap = rate.capacity;
    let lim = rate.amount;
    let wf = rate.per_us;
    let mut tokens = refilled(rate, state, now);
    let full_in = |tokens: f64| ceil((cap - tokens) * wf / lim);
    let put = |tokens: f64| Write::Put {
        state: State::Bucket {
            tokens,
            ts: now,
            stamp: None,
        },
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
fn refilled(rate: &BucketRate, state: Option<&State>, now: i64) -> f64 {
    let (tokens, ts) = match state {
        Some(State::Bucket { tokens, ts, .. }) => (*tokens, *ts),
        _ => (rate.capacity, now),
    };
    let elapsed = (now - ts).max(0) as f64;
    rate.capacity
        .min(tokens + elapsed * rate.amount / rate.per_us)
}

#[cfg(test)]
mod tests {
    use crate::algorithm::testing::{SEC, check, limits, run};
    use crate::algorithm::{Algorithm, Write, apply};

    #[test]
    fn token_bucket_article_sequence() {
        // Capacity 5 at 2 tokens/s: seven immediate calls, then one after 1 s.
        let l = limits(2, SEC, 5);
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
        let l = limits(2, SEC, 1);
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
}
