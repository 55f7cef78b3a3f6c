//! GCRA: the generic cell rate algorithm, one theoretical arrival time (TAT) per key
//! (`lua/gcra.lua`). Emission interval T = window / limit and tolerance τ = T · burst are
//! doubles in microseconds, so rates of 10,000/s and more stay exact.

use super::frame::{self, Reading, carry_tokens};
use super::{
    Algorithm, Limits, Op, Outcome, Stamp, State, Verdict, Write, allowed, ceil, denied, eval_cost,
    floor_u,
};

/// Keeps `remaining` from reading 4 where exact arithmetic gives 5 (e.g. T = 1/3 s).
const EPSILON: f64 = 1e-9;

/// A GCRA key as reader `l` reads it at `now` ([`Reading`]): the emission interval T
/// and tolerance τ of the reading's numbers (τ of the capacity the reader admits
/// against), the TAT, the stored stamp, and until when the stored state is not at rest
/// (`None`: no state; a state at rest, its TAT passed and its hold too, reads as none
/// under any numbers, as its expiry makes it).
struct GcraAt {
    r: Reading,
    /// Microseconds per unit (may be below 1 ms).
    interval: f64,
    /// How far ahead of now the TAT may run.
    tau: f64,
    nowf: f64,
    tat: Option<f64>,
    stamp: Option<Stamp>,
    rest_us: Option<i64>,
    /// A reader held to both: its own bucket of everything spent on the key.
    own: Option<f64>,
}

fn interval_of(l: &Limits) -> f64 {
    l.window_us as f64 / l.limit as f64
}

impl GcraAt {
    fn new(l: &Limits, state: Option<&State>, now: i64) -> Self {
        let nowf = now as f64;
        let (stored, stamp) = match state {
            Some(State::Gcra { tat, ts, stamp }) => (Some((*tat, *ts)), *stamp),
            _ => (None, None),
        };
        let rest_us =
            stored.and_then(|(tat, _)| frame::rest_after(stamp.as_ref(), ceil(tat - nowf), now));
        let stored = stored.filter(|_| rest_us.is_some());
        let stamp = stamp.filter(|_| rest_us.is_some());
        let r = Reading::of(Algorithm::Gcra, l, stamp.as_ref());
        let interval = interval_of(&r.numbers);
        let tat = stored.map(|(tat, ts)| match r.take_over {
            // Taken over: the units the TAT was ahead when it was written carry into the
            // reader's burst (as a bucket's used tokens do); the time since refills at the
            // reader's rate.
            Some(f) => {
                let at = ts as f64;
                let used = if tat > at {
                    (tat - at) / interval_of(&f)
                } else {
                    0.0
                };
                let left = carry_tokens(f.burst as f64 - used, f.burst, l.burst);
                at + (l.burst as f64 - left) * interval
            }
            None => tat,
        });
        GcraAt {
            r,
            interval,
            tau: interval * r.cap as f64,
            nowf,
            tat,
            own: r.own_tokens(stamp.as_ref(), now),
            stamp,
            rest_us,
        }
    }

    /// Where the next unit's emission starts: the TAT, or now if it has passed.
    fn base(&self) -> f64 {
        self.nowf.max(self.tat.unwrap_or(self.nowf))
    }

    /// Units that would still conform now with the TAT at `t`, after `spent` more (held
    /// to both: no more than the reader's own bucket holds).
    fn remaining_of(&self, t: f64, spent: f64) -> u64 {
        let left = floor_u((self.tau - (t - self.nowf)) / self.interval + EPSILON);
        self.own.map_or(left, |own| left.min(floor_u(own - spent)))
    }

    /// The reader's verdict with the TAT at `t` after `spent`, allowed.
    fn allowed(&self, t: f64, spent: f64) -> Verdict {
        allowed(self.remaining_of(t, spent), ceil(t - self.nowf))
    }

    /// Until a check of `cost` that conforms at `allow_at`, denied now, passes: then,
    /// once the reader's own bucket holds it too (held to both), or once the state is at
    /// rest.
    fn retry(&self, cost: u64, allow_at: f64) -> i64 {
        let rest = self.rest_us.unwrap_or(i64::MAX);
        if cost > self.r.cap {
            return rest;
        }
        let own = match self.own {
            Some(own) if own < cost as f64 => {
                let l = &self.r.reader();
                ceil((cost as f64 - own) * (l.window_us as f64 / l.limit as f64))
            }
            _ => 0,
        };
        ceil(allow_at - self.nowf).max(own).min(rest)
    }

    /// The TAT `tat` written in the reading's numbers at `now` after spending `spent` (a
    /// refund: giving them back).
    fn put(&self, tat: f64, spent: i64, now: i64) -> Write {
        let stamp = self
            .r
            .stamp(self.stamp.as_ref(), self.rest_us.unwrap_or(0), spent, now);
        Write::Put {
            state: State::Gcra {
                tat,
                ts: now,
                stamp: Some(stamp),
            },
            ttl_us: frame::ttl(&stamp, ceil(tat - self.nowf), now),
        }
    }

    /// `us`, or sooner if the state comes to rest first.
    fn or_rest(&self, us: i64) -> i64 {
        self.rest_us.map_or(us, |rest| us.min(rest))
    }
}

/// What the key owes at `now` ([`super::usage`]): how far its TAT runs beyond now + τ,
/// in whole units.
pub(super) fn debt(l: &Limits, state: Option<&State>, now: i64) -> u64 {
    let at = GcraAt::new(l, state, now);
    let over = at.base() - at.nowf - at.tau;
    if over > 0.0 {
        ceil(over / at.interval - EPSILON) as u64
    } else {
        0
    }
}

pub(super) fn apply(l: &Limits, state: Option<&State>, now: i64, op: Op) -> Outcome {
    let g = GcraAt::new(l, state, now);
    let (nowf, base) = (g.nowf, g.base());
    let (cost, write) = eval_cost(op);
    let cost_f = cost as f64;
    if let Op::Refund { .. } = op {
        let Some(tat) = g.tat else {
            return Outcome {
                verdict: allowed(g.remaining_of(base, 0.0), 0),
                write: Write::Keep,
            };
        };
        // (Not before now: a TAT behind now means the same, and a clock that steps back
        // must not find it ahead again.)
        let new_tat = (tat - cost_f * g.interval).max(nowf);
        let back = -(cost as i64);
        let held =
            g.r.stamp(g.stamp.as_ref(), g.rest_us.unwrap_or(0), back, now)
                .hold;
        let write = if new_tat > nowf || held.is_some() {
            g.put(new_tat, back, now)
        } else {
            Write::Delete
        };
        return Outcome {
            verdict: g.allowed(nowf.max(new_tat), -cost_f),
            write,
        };
    }
    // Until the key is empty as it stands: in the reader's view, or at rest in its frame.
    let empty_after = g.or_rest(ceil(base - nowf));
    let new_tat = base + cost_f * g.interval;
    let allow_at = new_tat - g.tau;
    if nowf >= allow_at && g.own.is_none_or(|own| own >= cost_f) {
        if !write {
            return Outcome {
                verdict: allowed(g.remaining_of(base, 0.0), empty_after),
                write: Write::Keep,
            };
        }
        return Outcome {
            verdict: g.allowed(new_tat, cost_f),
            write: g.put(new_tat, cost as i64, now),
        };
    }
    Outcome {
        verdict: denied(
            g.remaining_of(base, 0.0),
            empty_after,
            g.retry(cost, allow_at),
        ),
        write: Write::Keep,
    }
}

/// A [`super::charge`]: spent whether or not it conforms; a TAT beyond now + τ is debt,
/// waited out before any check passes again.
pub(super) fn charge(l: &Limits, state: Option<&State>, now: i64, cost: u64) -> Outcome {
    let g = GcraAt::new(l, state, now);
    let new_tat = g.base() + cost as f64 * g.interval;
    Outcome {
        verdict: g.allowed(new_tat, cost as f64),
        write: g.put(new_tat, cost as i64, now),
    }
}

#[cfg(test)]
mod tests {
    use crate::algorithm::Algorithm;
    use crate::algorithm::testing::{SEC, check, limits, run};

    #[test]
    fn gcra_admits_at_ten_thousand_per_second() {
        // 10,000/s, burst 1: emission interval 100 us. Offer one request every 50 us for 1 s.
        let l = limits(10_000, SEC, 1);
        let t0 = 7 * SEC;
        let steps: Vec<_> = (0..20_000).map(|i| (t0 + i * 50, check(1))).collect();
        let admitted = run(Algorithm::Gcra, l, &steps)
            .iter()
            .filter(|v| v.allowed)
            .count();
        assert_eq!(admitted, 10_000);
    }
}
