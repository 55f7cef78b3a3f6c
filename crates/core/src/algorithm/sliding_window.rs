//! The sliding window counter: the previous window's count weighted by how much of it
//! still overlaps, plus the current one (`lua/sliding_window.lua`). Two numbers per key,
//! smooth at boundaries, approximate (it assumes the previous window's admissions were
//! spread evenly).

use super::frame::{self, Reading, carry_slot};
use super::{
    Algorithm, Limits, Op, Outcome, Stamp, State, Write, allowed, ceil, denied, eval_cost, floor_u,
};

/// A sliding-window state as reader `l` reads it at `now` ([`Reading`]): the window
/// counted in under the reading's numbers, the time into it, the slot the state was
/// stored under (`None`: no state), the two counts, the stored stamp, and until when the
/// stored state is not at rest (`None`: no state; a state at rest, both counts gone in its
/// own frame and its hold passed, reads as none under any numbers, as its expiry makes
/// it).
struct SlidingAt {
    r: Reading,
    slot: i64,
    elapsed: i64,
    stored: Option<i64>,
    current: u64,
    previous: u64,
    stamp: Option<Stamp>,
    rest_us: Option<i64>,
}

/// A state stored in window `stored` (`None`: no state), brought to `now` in windows of
/// `w`: one window on, this window's count becomes the previous one; further on, both
/// are zero. Returns the slot, the time into it and the two counts.
fn at_now(
    w: i64,
    stored: Option<i64>,
    current: u64,
    previous: u64,
    now: i64,
) -> (i64, i64, u64, u64) {
    let slot = now.div_euclid(w);
    match stored {
        // Clock stepped back (less than a window): stay at the start of the newer
        // window. A slot further ahead is not the frame's (a state written before
        // frames, under another window length): discarded below.
        Some(s) if s == slot + 1 => (s, 0, current, previous),
        Some(s) if s == slot => (slot, now - slot * w, current, previous),
        Some(s) if s == slot - 1 => (slot, now - slot * w, 0, current),
        _ => (slot, now - slot * w, 0, 0),
    }
}

/// Until both counted windows of `slot` (length `w`) have passed.
fn reset_of(w: i64, slot: i64, now: i64, current: u64, previous: u64) -> i64 {
    if current > 0 {
        (slot + 2) * w - now
    } else if previous > 0 {
        (slot + 1) * w - now
    } else {
        0
    }
}

impl SlidingAt {
    fn new(l: &Limits, state: Option<&State>, now: i64) -> Self {
        let (stored, mut current, mut previous, ts, stamp) = match state {
            Some(State::Sliding {
                slot,
                current,
                previous,
                ts,
                stamp,
            }) => (Some(*slot), *current, *previous, *ts, *stamp),
            _ => (None, 0, 0, now, None),
        };
        let f = Reading::frame(l, stamp.as_ref());
        let (fs, _, fc, fp) = at_now(f.window_us, stored, current, previous, now);
        // (A state ahead of now, after the clock stepped back, keeps its window.)
        let frame_rest = match fc + fp == 0 && fs > now.div_euclid(f.window_us) {
            true => (fs + 1) * f.window_us - now,
            false => reset_of(f.window_us, fs, now, fc, fp),
        };
        let rest_us = stored.and_then(|_| frame::rest_after(stamp.as_ref(), frame_rest, now));
        let stored = stored.filter(|_| rest_us.is_some());
        let stamp = stamp.filter(|_| rest_us.is_some());
        let r = Reading::of(Algorithm::SlidingWindow, l, stamp.as_ref());
        // Taken over: each count moves to the reader's window that holds the last instant
        // it can have been counted at (two in one: summed; not adjacent: the older drops
        // out).
        let stored = match (r.take_over, stored) {
            (Some(f), Some(s)) => {
                let now_slot = carry_slot(s, f.window_us, l.window_us, ts);
                let before = carry_slot(s - 1, f.window_us, l.window_us, ts);
                if before == now_slot {
                    (current, previous) = (current + previous, 0);
                } else if before + 1 < now_slot {
                    previous = 0;
                }
                Some(now_slot)
            }
            (_, s) => s,
        };
        let (slot, elapsed, current, previous) =
            at_now(r.numbers.window_us, stored, current, previous, now);
        SlidingAt {
            r,
            slot,
            elapsed,
            stored,
            current,
            previous,
            stamp,
            rest_us,
        }
    }

    /// previous * (1 - elapsed fraction) + current.
    fn estimate(&self, current: u64, previous: u64) -> f64 {
        let wf = self.r.numbers.window_us as f64;
        let weight = (wf - self.elapsed as f64) / wf;
        previous as f64 * weight + current as f64
    }

    fn remaining_of(&self, current: u64, previous: u64) -> u64 {
        floor_u(self.r.cap as f64 - self.estimate(current, previous))
    }

    /// Until both counted windows have passed; as the state stands (not written), no
    /// later than it comes to rest.
    fn reset_of(&self, now: i64, current: u64, previous: u64, written: bool) -> i64 {
        let reset = reset_of(self.r.numbers.window_us, self.slot, now, current, previous);
        match (written, self.rest_us) {
            (false, Some(rest)) => reset.min(rest),
            _ => reset,
        }
    }

    /// The verdict on the two counts, written (after spending `spent`; a refund: giving
    /// them back) or not (`None`).
    fn outcome(&self, now: i64, current: u64, previous: u64, spent: Option<i64>) -> Outcome {
        let w = self.r.numbers.window_us;
        let write = spent.is_some();
        let stamp = self.r.stamp(
            self.stamp.as_ref(),
            self.rest_us.unwrap_or(0),
            spent.unwrap_or(0),
            now,
        );
        Outcome {
            verdict: allowed(
                self.remaining_of(current, previous),
                self.reset_of(now, current, previous, write),
            ),
            write: match write {
                false => Write::Keep,
                true => Write::Put {
                    state: State::Sliding {
                        slot: self.slot,
                        current,
                        previous,
                        ts: now,
                        stamp: Some(stamp),
                    },
                    ttl_us: frame::ttl(&stamp, (self.slot + 2) * w - now, now),
                },
            },
        }
    }

    /// How long until a request of `cost`, denied now, would fit (the same arithmetic as
    /// the Lua script's).
    fn retry(&self, cost: u64) -> i64 {
        let (w, current, previous) = (self.r.numbers.window_us, self.current, self.previous);
        let wf = w as f64;
        // Room left for carried-over weight once this request is in.
        let need = self.r.cap.saturating_sub(cost) as f64;
        if current as f64 <= need {
            // Wait inside this window for the previous window's weight to decay enough.
            ceil(wf - (need - current as f64) * wf / previous as f64 - self.elapsed as f64)
        } else {
            // Wait for the next window, where this window's count becomes the decaying one.
            let more = ceil(wf - need * wf / current as f64);
            (w - self.elapsed) + more.max(0)
        }
    }
}

pub(super) fn apply(l: &Limits, state: Option<&State>, now: i64, op: Op) -> Outcome {
    let at = SlidingAt::new(l, state, now);
    let (current, previous) = (at.current, at.previous);
    let (cost, write) = eval_cost(op);
    if let Op::Refund { .. } = op {
        let back = Some(-(cost as i64));
        return match at.stored {
            Some(s) if s == at.slot => {
                at.outcome(now, current.saturating_sub(cost), previous, back)
            }
            Some(s) if s == at.slot - 1 => {
                at.outcome(now, current, previous.saturating_sub(cost), back)
            }
            _ => at.outcome(now, current, previous, None),
        };
    }
    if at.estimate(current, previous) + cost as f64 <= at.r.cap as f64 {
        return match write {
            true => at.outcome(now, current + cost, previous, Some(cost as i64)),
            false => at.outcome(now, current, previous, None),
        };
    }
    Outcome {
        verdict: denied(
            at.remaining_of(current, previous),
            at.reset_of(now, current, previous, false),
            match (cost > at.r.cap, at.rest_us) {
                // A reader held to a smaller limit than its own: only once at rest.
                (true, rest) => rest.unwrap_or(i64::MAX),
                (false, Some(rest)) => at.retry(cost).min(rest),
                (false, None) => at.retry(cost),
            },
        ),
        write: Write::Keep,
    }
}

#[cfg(test)]
mod tests {
    use crate::algorithm::Algorithm;
    use crate::algorithm::testing::{SEC, check, limits, run};

    #[test]
    fn sliding_window_weights_the_previous_window() {
        let l = limits(10, SEC, 10);
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
}
