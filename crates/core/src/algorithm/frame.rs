//! The transition rule: what a key's stored state means when it is read under other
//! numbers than it was written with (a lowered or raised limit, another window or burst,
//! an override, and an instance still on the old config while a change rolls out).
//!
//! Every state of a fixed window, sliding window, token bucket or GCRA key carries its
//! *frame*: the [`Limits`] it was written under, with [`super::Since`] when those came into
//! force (the scripts keep them in fields `f` and `v` of the key's hash, or in a GCRA
//! key's value). A reader whose numbers are the frame's reads the state as it always did.
//! Otherwise (`Reading`):
//!
//! - **A reader with newer numbers takes the state over.** What was used carries over as
//!   usage as of the state's last write: a window's count (and debt) into the reader's
//!   window that holds the end of the window it was counted in; a bucket's used tokens
//!   against the reader's burst, at most all of it, a debt whole (`carry_tokens`). The
//!   time since that write refills at the reader's rate. Its first write puts the key in
//!   its frame. So a lowered limit leaves what was spent spent (never forgiven by the
//!   lower rate), a raised one keeps what was used (never lost to the higher one), and a
//!   key full under the old numbers is full under the new.
//! - **A reader with older numbers** (an instance the change has not reached yet) leaves
//!   the state in the newer frame, windows and refill included, and is held to both
//!   configs: it admits against the smaller of the two limits (bursts). It writes in the
//!   newer frame.
//!
//! A state at rest in its own frame (nothing used and nothing owed: where its TTL ends)
//! reads as no state under any numbers, as Redis's expiry makes it; so a reader whose
//! view of it is not at rest yet (a slower rate taking it over, a smaller capacity) is
//! answered "retry" no later than that.
//!
//! Newer is [`super::Since`]'s order: a higher `policy.version`, then the later instant the
//! numbers came into force on the instance that wrote them. So instances on two configs
//! taking turns never start a key over and never hand each other back what one of them
//! clamped: the key is held within the envelope of the two (the larger limit or burst,
//! refilled at the faster rate), and by the new numbers alone once every instance has
//! them. A state without a frame (written before frames) reads as the reader's own.
//!
//! A sliding log stores admission times, which mean the same under any numbers: it has no
//! frame, and a reader counts the entries inside its own window against its own limit.

use super::{Algorithm, Hold, Limits, Stamp};

/// Whose numbers a key's state is read under, and against what capacity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Reading {
    algorithm: Algorithm,
    /// The reader's own numbers.
    reader: Limits,
    /// The numbers the state evolves under (windows, refill) and is written with.
    pub numbers: Limits,
    /// The most the reader admits: the limit (windows) or burst (buckets) it decides
    /// against, never above the frame's own.
    pub cap: u64,
    /// Whether the stored state is taken over into the reader's numbers first.
    pub take_over: Option<Limits>,
}

impl Reading {
    /// The frame a state stamped `stamp` is in: its stamp's, or (no state, or one from
    /// before frames) the reader's own numbers.
    pub(crate) fn frame(l: &Limits, stamp: Option<&Stamp>) -> Limits {
        stamp.map_or(*l, |s| s.frame)
    }

    /// How reader `l` reads a state stamped `stamp` (`None`: no state, or one from before
    /// frames: the reader's own).
    pub(crate) fn of(algorithm: Algorithm, l: &Limits, stamp: Option<&Stamp>) -> Reading {
        let own = Reading {
            algorithm,
            reader: *l,
            numbers: *l,
            cap: l.capacity(algorithm),
            take_over: None,
        };
        match stamp.map(|s| s.frame) {
            None => own,
            Some(f) if f.same_numbers(l) => own,
            Some(f) if l.since > f.since => Reading {
                take_over: Some(f),
                ..own
            },
            Some(f) => Reading {
                numbers: f,
                cap: f.capacity(algorithm).min(l.capacity(algorithm)),
                ..own
            },
        }
    }

    /// The stamp of a write at `now` that spends `spent` units (a refund: gives them
    /// back), over a stored stamp `stored` of a state that is not at rest for `rest_us`
    /// more: the reading's numbers, and the hold ([`Hold`]): started by a take-over at
    /// the rest of the state taken over, or by a reader held to both at its own numbers;
    /// moved by what is spent while it lasts.
    pub(crate) fn stamp(
        &self,
        stored: Option<&Stamp>,
        rest_us: i64,
        spent: i64,
        now: i64,
    ) -> Stamp {
        let mut hold = stored.and_then(|s| s.hold).filter(|h| h.until_us > now);
        if let Some(f) = self.take_over {
            let until_us = hold
                .map_or(0, |h| h.until_us)
                .max(now.saturating_add(rest_us));
            hold = Some(Hold::of(self.algorithm, &f, until_us));
        } else if self.held() && spent > 0 {
            let until_us = hold.map_or(now, |h| h.until_us);
            hold = Some(Hold::of(self.algorithm, &self.reader, until_us));
        }
        let hold = hold.and_then(|h| h.after(self.algorithm, spent, now));
        Stamp {
            frame: self.numbers,
            hold,
        }
    }

    /// The reader's own numbers.
    pub(crate) fn reader(&self) -> Limits {
        self.reader
    }

    /// Whether the reader is held to both configs: its numbers are older than the
    /// state's.
    pub(crate) fn held(&self) -> bool {
        !self.numbers.same_numbers(&self.reader)
    }

    /// A bucket reader held to both: what its own numbers leave it of everything spent
    /// on the key, the hold read as its own bucket (`None`: no hold at its numbers' pace;
    /// its own bucket is full).
    pub(crate) fn own_tokens(&self, stamp: Option<&Stamp>, now: i64) -> Option<f64> {
        let hold = stamp.and_then(|s| s.hold)?;
        let mine = Hold::of(self.algorithm, &self.reader, 0);
        if !self.held() || hold.unit_us != mine.unit_us || hold.full_us != mine.full_us {
            return None;
        }
        let behind = (hold.until_us - now).max(0) as f64;
        Some(self.reader.burst as f64 - behind / hold.unit_us)
    }
}

impl Hold {
    /// A hold until `until_us` at the pace of `l`.
    fn of(algorithm: Algorithm, l: &Limits, until_us: i64) -> Hold {
        let (unit_us, full_us) = match algorithm.has_burst() {
            true => {
                let unit = l.window_us as f64 / l.limit as f64;
                (unit, unit * l.burst as f64)
            }
            false => (l.window_us as f64, l.window_us as f64),
        };
        Hold {
            until_us,
            unit_us,
            full_us,
        }
    }

    /// The hold after `spent` units at `now` (a refund: given back): a bucket's rest moves
    /// by their refill, no further than a full bucket's from now unless it already was;
    /// a window's to the end of the window they are counted in. `None` once it has
    /// passed.
    fn after(self, algorithm: Algorithm, spent: i64, now: i64) -> Option<Hold> {
        let until_us = match algorithm.has_burst() {
            true => {
                let from = self.until_us.max(now) as f64;
                let most = from.max(now as f64 + self.full_us);
                ceil((from + spent as f64 * self.unit_us).min(most)).max(now)
            }
            false if spent > 0 => {
                let w = self.unit_us as i64;
                self.until_us.max((now.div_euclid(w) + 1) * w)
            }
            false => self.until_us,
        };
        (until_us > now).then_some(Hold { until_us, ..self })
    }
}

fn ceil(x: f64) -> i64 {
    x.ceil() as i64
}

/// Until when (us from `now`) a stored state is not at rest: until it is at rest in its
/// frame (`frame_rest_us`, 0 or less: it is) and its hold has passed. `None`: at rest,
/// it reads as no state.
pub(crate) fn rest_after(stamp: Option<&Stamp>, frame_rest_us: i64, now: i64) -> Option<i64> {
    let held = stamp.and_then(|s| s.hold).map_or(0, |h| h.until_us - now);
    let rest = frame_rest_us.max(held);
    (rest > 0).then_some(rest)
}

/// The TTL of a state written with `stamp`: its own, and never before its hold ends.
pub(crate) fn ttl(stamp: &Stamp, ttl_us: i64, now: i64) -> i64 {
    stamp.hold.map_or(ttl_us, |h| ttl_us.max(h.until_us - now))
}

/// A bucket's `tokens` under capacity `from`, read under capacity `to`: what was used
/// carries (a raise adds the difference; a lowering takes it, down to empty), and a debt
/// (tokens below zero) carries whole. `lua/helpers.lua`'s `carry_tokens` is the same.
pub(crate) fn carry_tokens(tokens: f64, from: u64, to: u64) -> f64 {
    if tokens < 0.0 || from == to {
        return tokens;
    }
    let t = tokens + (to as f64 - from as f64);
    if t > 0.0 { t } else { 0.0 }
}

/// Where a count of window `slot` (length `from_us`), last written at `ts`, carries to:
/// the window of length `to_us` that holds the last instant it can have been counted at
/// (the window's last, or the write if that was earlier).
pub(crate) fn carry_slot(slot: i64, from_us: i64, to_us: i64, ts: i64) -> i64 {
    if from_us == to_us {
        return slot;
    }
    ((slot + 1) * from_us - 1).min(ts).div_euclid(to_us)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Since;

    #[test]
    fn tokens_carry_usage_and_debt() {
        // 20 of 2000 left: lowered to 20, nothing left; 1990 left: 10 used of 20.
        assert_eq!(carry_tokens(20.0, 2000, 20), 0.0);
        assert_eq!(carry_tokens(1990.0, 2000, 20), 10.0);
        // 0 of 20 left: raised to 2000, 1980 left (20 used).
        assert_eq!(carry_tokens(0.0, 20, 2000), 1980.0);
        // A debt of 5 stays 5 either way.
        assert_eq!(carry_tokens(-5.0, 20, 2000), -5.0);
        assert_eq!(carry_tokens(-5.0, 2000, 20), -5.0);
    }

    #[test]
    fn a_count_carries_to_the_window_holding_its_windows_end() {
        let h = 3_600;
        let late = 100 * h;
        // An hour's window 5 (05:00-06:00) ends in the two-hour window 2 (04:00-06:00).
        assert_eq!(carry_slot(5, h, 2 * h, late), 2);
        // Window 2 of two hours ends at 05:59:59, in hour 5; written at 04:30, in hour 4.
        assert_eq!(carry_slot(2, 2 * h, h, late), 5);
        assert_eq!(carry_slot(2, 2 * h, h, 4 * h + h / 2), 4);
        assert_eq!(carry_slot(7, h, h, late), 7);
    }

    #[test]
    fn newer_numbers_take_a_state_over_and_older_ones_are_held_to_both() {
        let at = |version, at_ms| Since { version, at_ms };
        let old = Limits {
            limit: 2000,
            window_us: 2000,
            burst: 2000,
            since: at(1, 100),
        };
        let new = Limits {
            limit: 20,
            burst: 20,
            since: at(1, 200),
            ..old
        };
        let tb = Algorithm::TokenBucket;
        let stamp = |frame| Stamp { frame, hold: None };
        let r = Reading::of(tb, &new, Some(&stamp(old)));
        assert_eq!((r.numbers, r.cap, r.take_over), (new, 20, Some(old)));
        let r = Reading::of(tb, &old, Some(&stamp(new)));
        assert_eq!((r.numbers, r.cap, r.take_over), (new, 20, None));
        // The same numbers, whenever they came into force: one frame.
        let again = Limits {
            since: at(1, 300),
            ..old
        };
        assert_eq!(Reading::of(tb, &again, Some(&stamp(old))).numbers, again);
        // A higher version is newer, whatever the instants.
        let bumped = Limits {
            since: at(2, 50),
            ..new
        };
        let r = Reading::of(tb, &bumped, Some(&stamp(old)));
        assert_eq!(r.take_over, Some(old));
        // A take-over holds the key until the state it took over would have rested, moved
        // by what it spends at the old pace (here 1 us a unit).
        let held = r.stamp(Some(&stamp(old)), 700, 2, 1_000).hold;
        assert_eq!(held.map(|h| h.until_us), Some(1_702));
        assert_eq!(
            Reading::of(tb, &old, None).stamp(None, 700, 2, 1_000).hold,
            None
        );
    }
}
