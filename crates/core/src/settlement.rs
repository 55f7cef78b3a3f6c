//! Settlement: a check that reserves an estimated cost, and its settlement at the real
//! cost once the work is done. The reference model of `lua/settle.lua`.
//!
//! A reservation is admitted like any check of its estimate. Its settlement charges what
//! the real cost is above the estimate, as debt where the key lacks it
//! ([`crate::algorithm::charge`]), or gives back what it is below (a refund, as much as
//! the key can take back: a fixed window only within the window the estimate was counted
//! in). A reservation is settled once: settling it again charges nothing. So however the
//! estimates miss, what a key is charged in the end is the sum of the real costs, and what
//! it owes is waited out before any check passes again.
//!
//! A reset of the key ends the reservations open on it: the reset gave the key a fresh
//! start, estimates included, so a settlement of one opened before it charges and gives
//! back nothing ([`Settled::Ended`]), and says so. Otherwise a settlement below its
//! estimate would credit the state after the reset with units spent before it.
//!
//! Only the algorithms that can hold a debt settle ([`Algorithm::holds_debt`]); the
//! others answer `None`.

use crate::algorithm::{self, Algorithm, Limits, Op, Outcome, State, Verdict, Write};
use crate::calendar::Periods;

/// A reservation as stored beside its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reservation {
    /// Admitted at `estimate` at store time `opened_us`, not settled yet.
    Open {
        /// Units admitted.
        estimate: u64,
        /// Store time it was opened, µs.
        opened_us: i64,
    },
    /// Settled at `cost`.
    Settled {
        /// The real cost.
        cost: u64,
    },
    /// Ended by a reset of its key before it was settled.
    Ended,
}

/// What a settlement did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// Settled now: `charged` above the estimate, or `refunded` below it.
    Now {
        /// Units charged above the estimate.
        charged: u64,
        /// Units given back below it.
        refunded: u64,
    },
    /// Settled before: nothing charged again.
    Already,
    /// No such reservation (never made, denied, or kept no longer): nothing charged.
    Unknown,
    /// A reset of the key ended the reservation before it was settled: nothing charged
    /// or given back.
    Ended,
}

/// What a settlement did, the key after it, and what to store.
#[derive(Debug, Clone, PartialEq)]
pub struct SettleOutcome {
    /// What the settlement did.
    pub settled: Settled,
    /// The key after the settlement (as a peek reports it when nothing was charged).
    pub verdict: Verdict,
    /// What to do with the key's stored state.
    pub write: Write,
    /// The reservation to store (`None`: leave it as it is).
    pub reservation: Option<Reservation>,
}

/// A check of `estimate` units (at least 1) that, if admitted, opens a reservation.
/// `None` for an algorithm that cannot settle.
pub fn reserve(
    algorithm: Algorithm,
    limits: &Limits,
    state: Option<&State>,
    now_us: i64,
    estimate: u64,
    member: &str,
    periods: Option<&Periods>,
) -> Option<(Outcome, Option<Reservation>)> {
    if !algorithm.holds_debt() {
        return None;
    }
    let op = Op::Check { cost: estimate };
    let out = algorithm::on_periods(periods, now_us, |t| {
        algorithm::apply(algorithm, limits, state, t, op, member)
    });
    let opened = out.verdict.allowed.then_some(Reservation::Open {
        estimate,
        opened_us: now_us,
    });
    Some((out, opened))
}

/// Settles `reservation` at the real `cost`; `reset_us`: when the key was last reset, if
/// it was while a reservation could still be open. `None` for an algorithm that cannot
/// settle.
#[allow(clippy::too_many_arguments)]
pub fn settle(
    algorithm: Algorithm,
    limits: &Limits,
    state: Option<&State>,
    reservation: Option<&Reservation>,
    reset_us: Option<i64>,
    now_us: i64,
    cost: u64,
    member: &str,
    periods: Option<&Periods>,
) -> Option<SettleOutcome> {
    if !algorithm.holds_debt() {
        return None;
    }
    // What a peek reports: the outcome when nothing is charged or given back.
    let unchanged = || Outcome {
        verdict: algorithm::on_periods(periods, now_us, |t| {
            algorithm::apply(algorithm, limits, state, t, Op::Check { cost: 0 }, member)
        })
        .verdict,
        write: Write::Keep,
    };
    let peek = |settled| SettleOutcome {
        settled,
        verdict: unchanged().verdict,
        write: Write::Keep,
        reservation: None,
    };
    let estimate = match reservation {
        None => return Some(peek(Settled::Unknown)),
        Some(Reservation::Settled { .. }) => return Some(peek(Settled::Already)),
        Some(Reservation::Ended) => return Some(peek(Settled::Ended)),
        Some(Reservation::Open { opened_us, .. }) if reset_us.is_some_and(|r| r >= *opened_us) => {
            return Some(SettleOutcome {
                reservation: Some(Reservation::Ended),
                ..peek(Settled::Ended)
            });
        }
        Some(Reservation::Open { estimate, .. }) => *estimate,
    };
    let (out, settled) = if cost > estimate {
        let more = cost - estimate;
        let out = algorithm::charge_on(periods, algorithm, limits, state, now_us, more)?;
        (
            out,
            Settled::Now {
                charged: more,
                refunded: 0,
            },
        )
    } else if cost < estimate {
        let back = estimate - cost;
        let op = Op::Refund { cost: back };
        let out = algorithm::on_periods(periods, now_us, |t| {
            algorithm::apply(algorithm, limits, state, t, op, member)
        });
        (
            out,
            Settled::Now {
                charged: 0,
                refunded: back,
            },
        )
    } else {
        let settled = Settled::Now {
            charged: 0,
            refunded: 0,
        };
        (unchanged(), settled)
    };
    Some(SettleOutcome {
        settled,
        verdict: out.verdict,
        write: out.write,
        reservation: Some(Reservation::Settled { cost }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: i64 = 1_000_000;

    /// 10 a second, at most 10 at once.
    const TEN: Limits = Limits {
        limit: 10,
        window_us: SEC,
        burst: 10,
        since: crate::algorithm::Since::ZERO,
    };

    /// Whatever the estimates, a key is charged the sum of the real costs: here 10 a
    /// second, reserved at 3 and settled at 7, then reserved at 6 and settled at 1.
    #[test]
    fn a_key_is_charged_the_real_costs_whatever_was_estimated() {
        let (l, t0) = (TEN, 100 * SEC);
        for alg in [
            Algorithm::FixedWindow,
            Algorithm::TokenBucket,
            Algorithm::Gcra,
        ] {
            let mut state = None;
            let (out, r1) = reserve(alg, &l, state.as_ref(), t0, 3, "a", None).unwrap();
            out.write.apply_to(&mut state);
            let (out, r2) = reserve(alg, &l, state.as_ref(), t0, 6, "b", None).unwrap();
            out.write.apply_to(&mut state);
            // (charged, refunded) of a settlement made now.
            let now = |s: &SettleOutcome| match s.settled {
                Settled::Now { charged, refunded } => Some((charged, refunded)),
                _ => None,
            };
            let s1 = settle(alg, &l, state.as_ref(), r1.as_ref(), None, t0, 7, "a", None).unwrap();
            assert_eq!(now(&s1), Some((4, 0)));
            s1.write.apply_to(&mut state);
            let s2 = settle(alg, &l, state.as_ref(), r2.as_ref(), None, t0, 1, "b", None).unwrap();
            assert_eq!(now(&s2), Some((0, 5)));
            s2.write.apply_to(&mut state);
            // 8 spent of 10: exactly 2 left.
            assert_eq!(s2.verdict.remaining, 2, "{alg:?}");
            // Settling again charges nothing.
            let again = settle(
                alg,
                &l,
                state.as_ref(),
                s1.reservation.as_ref(),
                None,
                t0,
                7,
                "a",
                None,
            );
            let again = again.unwrap();
            assert_eq!(
                (again.settled, &again.write),
                (Settled::Already, &Write::Keep)
            );
            assert_eq!(again.verdict.remaining, 2);
            let unknown = settle(alg, &l, state.as_ref(), None, None, t0, 7, "c", None).unwrap();
            assert_eq!(unknown.settled, Settled::Unknown);
        }
    }

    /// A reset ends the reservations open on its key: settled afterwards, one gives back
    /// nothing (the state after the reset never gets units spent before it) and charges
    /// nothing, and says so; settling it again says so again. A reservation opened after
    /// the reset settles as any other.
    #[test]
    fn a_reset_ends_the_reservations_open_on_its_key() {
        let (l, t0) = (TEN, 100 * SEC);
        for alg in [
            Algorithm::FixedWindow,
            Algorithm::TokenBucket,
            Algorithm::Gcra,
        ] {
            let (_, before) = reserve(alg, &l, None, t0, 10, "a", None).unwrap();
            // The reset: the key is gone, at t0 + 1.
            let reset = Some(t0 + 1);
            let s = settle(alg, &l, None, before.as_ref(), reset, t0 + 2, 1, "a", None).unwrap();
            assert_eq!(
                (s.settled, &s.write),
                (Settled::Ended, &Write::Keep),
                "{alg:?}"
            );
            assert_eq!(s.reservation, Some(Reservation::Ended));
            assert_eq!(s.verdict.remaining, 10, "{alg:?}: the fresh start, once");
            let again = settle(
                alg,
                &l,
                None,
                s.reservation.as_ref(),
                reset,
                t0 + 3,
                1,
                "a",
                None,
            );
            assert_eq!(again.unwrap().settled, Settled::Ended);
            let (out, after) = reserve(alg, &l, None, t0 + 4, 3, "b", None).unwrap();
            let state = match out.write {
                Write::Put { state, .. } => Some(state),
                _ => None,
            };
            let s = settle(
                alg,
                &l,
                state.as_ref(),
                after.as_ref(),
                reset,
                t0 + 5,
                1,
                "b",
                None,
            );
            let s = s.unwrap();
            assert_eq!(
                s.settled,
                Settled::Now {
                    charged: 0,
                    refunded: 2
                },
                "{alg:?}"
            );
        }
    }

    #[test]
    fn only_the_algorithms_that_hold_a_debt_settle() {
        let l = TEN;
        for alg in [Algorithm::SlidingLog, Algorithm::SlidingWindow] {
            assert!(reserve(alg, &l, None, 0, 1, "a", None).is_none());
            assert!(settle(alg, &l, None, None, None, 0, 1, "a", None).is_none());
        }
    }
}
