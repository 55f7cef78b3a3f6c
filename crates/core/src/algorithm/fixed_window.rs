//! The fixed window: a count per window (`lua/fixed_window.lua`). A charge beyond the
//! limit is owed to the windows after it, a limit's worth each.

use super::frame::{self, Reading, carry_slot};
use super::{Algorithm, Limits, Op, Outcome, Stamp, State, Write, allowed, denied, eval_cost};

/// A fixed window's count and debt in `slot`, from those stored in window `stored`: the
/// debt fills the windows after `stored`, up to `limit` units each, until it is paid.
fn roll(stored: i64, owed: u64, slot: i64, limit: u64) -> (u64, u64) {
    let between = u64::try_from(slot - stored - 1).unwrap_or(0);
    let left = owed.saturating_sub(limit.saturating_mul(between));
    let count = left.min(limit);
    (count, left - count)
}

/// A fixed window's state as reader `l` reads it at `now` ([`Reading`]): the window it is
/// in under the reading's numbers, its count and the debt beyond it, the slot it was
/// stored under (`None`: no state), the stored stamp, and until when the stored state is
/// not at rest (`None`: no state; a state at rest, nothing counted or owed in its own
/// frame and its hold passed, reads as none under any numbers, as its expiry makes it).
struct FixedAt {
    r: Reading,
    slot: i64,
    count: u64,
    owed: u64,
    stored: Option<i64>,
    stamp: Option<Stamp>,
    rest_us: Option<i64>,
}

/// A state stored in window `stored` (`None`: no state) with `count` and `owed`, brought
/// to `now` in windows and limits of `n`: its slot, count and debt.
fn at_now(n: &Limits, stored: Option<i64>, count: u64, owed: u64, now: i64) -> (i64, u64, u64) {
    let slot = now.div_euclid(n.window_us);
    match stored {
        // A clock that stepped back (by less than a window) stays in the newer window
        // rather than reopening it. A slot further ahead is not the frame's (a state
        // written before frames, under another window length): it is discarded.
        Some(s) if s == slot + 1 => (s, count, owed),
        Some(s) if s == slot => (slot, count, owed),
        Some(s) if s < slot => {
            let (count, owed) = roll(s, owed, slot, n.limit);
            (slot, count, owed)
        }
        _ => (slot, 0, 0),
    }
}

/// Until a window `slot` of `n` owing `owed` is as if absent: its end, then a window
/// per `limit` units owed.
fn clear_after(n: &Limits, slot: i64, now: i64, owed: u64) -> i64 {
    (slot + 1) * n.window_us - now + owed.div_ceil(n.limit) as i64 * n.window_us
}

impl FixedAt {
    fn new(l: &Limits, state: Option<&State>, now: i64) -> Self {
        let (stored, count, owed, ts, stamp) = match state {
            Some(State::Fixed {
                slot,
                count,
                owed,
                ts,
                stamp,
            }) => (Some(*slot), *count, *owed, *ts, *stamp),
            _ => (None, 0, 0, now, None),
        };
        let f = Reading::frame(l, stamp.as_ref());
        let (slot, c, o) = at_now(&f, stored, count, owed, now);
        // (A state ahead of now, after the clock stepped back, keeps its window.)
        let frame_rest = match c + o == 0 && slot <= now.div_euclid(f.window_us) {
            true => 0,
            false => clear_after(&f, slot, now, o),
        };
        let rest_us = stored.and_then(|_| frame::rest_after(stamp.as_ref(), frame_rest, now));
        let stored = stored.filter(|_| rest_us.is_some());
        let stamp = stamp.filter(|_| rest_us.is_some());
        let r = Reading::of(Algorithm::FixedWindow, l, stamp.as_ref());
        // Taken over: the count and debt move to the reader's window that holds the last
        // instant they can have been counted at.
        let stored = match (r.take_over, stored) {
            (Some(f), Some(s)) => Some(carry_slot(s, f.window_us, l.window_us, ts)),
            (_, s) => s,
        };
        let (slot, count, owed) = at_now(&r.numbers, stored, count, owed, now);
        FixedAt {
            r,
            slot,
            count,
            owed,
            stored,
            stamp,
            rest_us,
        }
    }

    /// Until the state is as if absent, owing `owed`: its window's end, then a window
    /// per `limit` units owed.
    fn clear_after(&self, now: i64, owed: u64) -> i64 {
        clear_after(&self.r.numbers, self.slot, now, owed)
    }

    /// The state with `count` and `owed`, written in the reading's numbers after spending
    /// `spent` (a refund: giving them back).
    fn put(&self, count: u64, owed: u64, spent: i64, now: i64) -> Write {
        let stamp = self
            .r
            .stamp(self.stamp.as_ref(), self.rest_us.unwrap_or(0), spent, now);
        Write::Put {
            state: State::Fixed {
                slot: self.slot,
                count,
                owed,
                ts: now,
                stamp: Some(stamp),
            },
            ttl_us: frame::ttl(&stamp, self.clear_after(now, owed), now),
        }
    }

    /// `us`, or sooner if the state comes to rest first.
    fn or_rest(&self, us: i64) -> i64 {
        self.rest_us.map_or(us, |rest| us.min(rest))
    }
}

/// The window's count at `now` in the reader's numbers (above the limit after it was
/// lowered) and the debt beyond it ([`super::usage`]).
pub(super) fn usage(l: &Limits, state: Option<&State>, now: i64) -> (u64, u64) {
    let at = FixedAt::new(l, state, now);
    (at.count, at.owed)
}

pub(super) fn apply(l: &Limits, state: Option<&State>, now: i64, op: Op) -> Outcome {
    let at = FixedAt::new(l, state, now);
    let (count, owed, cap) = (at.count, at.owed, at.r.cap);
    // Saturating: after the limit is lowered, a count may exceed it.
    let left = |count: u64| cap.saturating_sub(count);
    let (cost, write) = eval_cost(op);
    if let Op::Refund { .. } = op {
        if at.stored != Some(at.slot) {
            // The charge belonged to a window that no longer counts: nothing to give back.
            return Outcome {
                verdict: allowed(left(count), at.or_rest(at.clear_after(now, owed))),
                write: Write::Keep,
            };
        }
        // What is given back comes off the debt first: it was charged beyond the window.
        let off_debt = cost.min(owed);
        let owed = owed - off_debt;
        let count = count.saturating_sub(cost - off_debt);
        return Outcome {
            verdict: allowed(left(count), at.clear_after(now, owed)),
            write: at.put(count, owed, -(cost as i64), now),
        };
    }
    if count + cost <= cap && write {
        let count = count + cost;
        return Outcome {
            verdict: allowed(left(count), at.clear_after(now, owed)),
            write: at.put(count, owed, cost as i64, now),
        };
    }
    // Until the key is as if absent as it stands: in the reader's view, or at rest in
    // its frame.
    let clear = at.or_rest(at.clear_after(now, owed));
    if count + cost <= cap {
        return Outcome {
            verdict: allowed(left(count), clear),
            write: Write::Keep,
        };
    }
    // The first window with room: the next, or one past the windows the debt fills (a
    // limit's worth each); or the state at rest.
    let n = &at.r.numbers;
    let full = (owed + cost).saturating_sub(cap).div_ceil(n.limit);
    let retry = match cost > cap {
        // A reader held to a smaller limit than its own: only once the key is at rest.
        true => at.rest_us.unwrap_or(i64::MAX),
        false => at.or_rest((at.slot + 1) * n.window_us - now + full as i64 * n.window_us),
    };
    Outcome {
        verdict: denied(left(count), clear, retry),
        write: Write::Keep,
    }
}

/// A [`super::charge`]: the units that fit count in this window, the rest is owed to the
/// windows after it.
pub(super) fn charge(l: &Limits, state: Option<&State>, now: i64, cost: u64) -> Outcome {
    let at = FixedAt::new(l, state, now);
    let total = at.count + cost;
    let count = at.count.max(total.min(at.r.cap));
    let owed = at.owed + (total - count);
    Outcome {
        verdict: allowed(at.r.cap.saturating_sub(count), at.clear_after(now, owed)),
        write: at.put(count, owed, cost as i64, now),
    }
}

#[cfg(test)]
mod tests {
    use crate::algorithm::testing::{SEC, check, limits, run};
    use crate::algorithm::{Algorithm, Write, apply, charge};

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

    /// A fixed window of calendar periods counts per period and resets at the period's
    /// real end: a day of 23 hours in spring, one of 25 in autumn, February 29, and a
    /// debt owed into the months after it, each of its own length.
    #[test]
    fn a_calendar_window_resets_at_each_periods_real_end() {
        use crate::algorithm::{charge_on, on_periods};
        use crate::calendar::{Calendar, Period};
        let berlin = |y, m, d, h| {
            jiff::civil::date(y, m, d)
                .at(h, 0, 0, 0)
                .in_tz("Europe/Berlin")
                .unwrap()
                .timestamp()
                .as_microsecond()
        };
        for (period, now, start, end) in [
            // Spring: 2027-03-28 has 23 hours; autumn: 2026-10-25 has 25.
            (
                Period::Day,
                berlin(2027, 3, 28, 12),
                berlin(2027, 3, 28, 0),
                berlin(2027, 3, 29, 0),
            ),
            (
                Period::Day,
                berlin(2026, 10, 25, 1),
                berlin(2026, 10, 25, 0),
                berlin(2026, 10, 26, 0),
            ),
            (
                Period::Month,
                berlin(2028, 2, 29, 23),
                berlin(2028, 2, 1, 0),
                berlin(2028, 3, 1, 0),
            ),
            (
                Period::Year,
                berlin(2026, 12, 31, 23),
                berlin(2026, 1, 1, 0),
                berlin(2027, 1, 1, 0),
            ),
        ] {
            let c = Calendar::new(period, "Europe/Berlin").unwrap();
            let l = limits(2, period.nominal_us(), 2);
            let mut state = None;
            let at = |state: &mut Option<_>, t: i64, op| {
                // The table around each call's instant, as quotad builds it.
                let out = on_periods(Some(&c.periods(t)), t, |pt| {
                    apply(Algorithm::FixedWindow, &l, state.as_ref(), pt, op, "")
                });
                if let Write::Put { state: s, ttl_us } = out.write.clone() {
                    assert!(ttl_us >= end - t, "{period:?}: the key outlives its period");
                    *state = Some(s);
                }
                out.verdict
            };
            let first = at(&mut state, start, check(1));
            assert_eq!(
                first.reset_after_us,
                end - start,
                "{period:?} from its start"
            );
            assert_eq!(
                at(&mut state, now, check(1)).reset_after_us,
                end - now,
                "{period:?}"
            );
            let denied = at(&mut state, end - 1, check(1));
            assert!(!denied.allowed, "{period:?}: two per period");
            assert_eq!(denied.retry_after_us, 1, "{period:?}: a µs before its end");
            let next = at(&mut state, end, check(1));
            assert!(next.allowed, "{period:?}: the next period starts empty");
            assert_eq!(next.remaining, 1);
            let after = c.containing(end);
            assert_eq!(next.reset_after_us, after.end_us - after.start_us);
            // A charge of 5 on a period with 1 counted fills it and owes 4: the next two
            // periods are full of debt, and a check waits for the real start of the third.
            let owed = charge_on(
                Some(&c.periods(end)),
                Algorithm::FixedWindow,
                &l,
                state.as_ref(),
                end,
                5,
            )
            .unwrap();
            state = match owed.write {
                Write::Put { state, .. } => Some(state),
                _ => unreachable!("a charge writes"),
            };
            let v = at(&mut state, end + 1, check(1));
            let paid_from = c.span(after.index + 3).start_us;
            assert_eq!(v.retry_after_us, paid_from - end - 1, "{period:?} debt");
        }
    }
}
