//! Redis's side of the call shapes: the arguments a call becomes and the replies the
//! scripts give, read back as domain values (a malformed reply is a [`StoreError::Reply`]).

use quotad_core::algorithm::{Usage, Verdict};
use quotad_core::concurrency::{LeaseAnswer, LeaseOp};
use quotad_core::coordinator::bucket::RegionUsage;
use quotad_core::settlement::Settled;

use crate::store::call::{LeaseCall, SettleReply, StoreError};
use crate::store::redis::hot::{Grant, Mark, Taker};

impl SettleReply {
    /// `lua/settle.lua`'s reply to a settlement: `{code, remaining, reset_after_us,
    /// charged, refunded}`.
    pub(crate) fn parse(reply: &[i64]) -> Result<SettleReply, StoreError> {
        let settled = match reply {
            [1, _, _, charged, refunded] if *charged >= 0 && *refunded >= 0 => Settled::Now {
                charged: *charged as u64,
                refunded: *refunded as u64,
            },
            [2, _, _, 0, 0] => Settled::Already,
            [0, _, _, 0, 0] => Settled::Unknown,
            [3, _, _, 0, 0] => Settled::Ended,
            other => return Err(StoreError::Reply(format!("{other:?}"))),
        };
        match reply[1] {
            remaining @ 0.. => Ok(SettleReply {
                settled,
                remaining: remaining as u64,
                reset_after_us: reply[2],
            }),
            _ => Err(StoreError::Reply(format!("{reply:?}"))),
        }
    }
}

impl LeaseCall<'_> {
    /// The concurrency script's arguments after the key: mode, limit, id, units, hold.
    pub(super) fn args(&self) -> (&'static str, &str, u64, i64) {
        match self.op {
            LeaseOp::Acquire { id, units, hold_us } => ("acquire", id, units, hold_us),
            LeaseOp::Release { id, units } => ("release", id, units, 0),
            LeaseOp::Extend { id, units, hold_us } => ("extend", id, units, hold_us),
            LeaseOp::Peek => ("peek", "", 0, 0),
            LeaseOp::Clear => ("clear", "", 0, 0),
        }
    }
}

/// `lua/concurrency.lua`'s reply: `{ok (0, 1, or 2: a lease a reset ended), held,
/// reset_after_us, retry_after_us, expired, released}`.
pub(crate) fn parse_lease(reply: &[i64]) -> Result<LeaseAnswer, StoreError> {
    match reply {
        [ok @ (0..=2), held, reset, retry, expired, released]
            if [*held, *reset, *retry, *expired, *released]
                .iter()
                .all(|n| *n >= 0) =>
        {
            Ok(LeaseAnswer {
                ok: *ok == 1,
                held: *held as u64,
                reset_after_us: *reset,
                retry_after_us: *retry,
                expired: *expired as u64,
                released: *released as u64,
                ended: *ok == 2,
            })
        }
        other => Err(StoreError::Reply(format!("{other:?}"))),
    }
}

/// A script's reply past 2^53 microseconds means "never" (a global key at a zero rate).
pub(crate) const NEVER_US: i64 = 1 << 53;

/// Every limiter script replies `{allowed, remaining, reset_after_us, retry_after_us}`.
pub fn parse_verdict(reply: &[i64]) -> Result<Verdict, StoreError> {
    let wait = |v: i64| if v >= NEVER_US { i64::MAX } else { v };
    match reply {
        [allowed, remaining, reset, retry]
            if (*allowed == 0 || *allowed == 1) && *remaining >= 0 =>
        {
            Ok(Verdict {
                allowed: *allowed == 1,
                remaining: *remaining as u64,
                reset_after_us: wait(*reset),
                retry_after_us: wait(*retry),
            })
        }
        other => Err(StoreError::Reply(format!("{other:?}"))),
    }
}

/// The `usage` operation's reply (`lua/helpers.lua`): the verdict's four, then `used`,
/// `debt` and the store's clock.
pub fn parse_usage(reply: &[i64]) -> Result<(Usage, i64), StoreError> {
    match reply {
        [head @ .., used, debt, now] if head.len() == 4 && *used >= 0 && *debt >= 0 => Ok((
            Usage {
                verdict: parse_verdict(head)?,
                used: *used as u64,
                debt: *debt as u64,
            },
            *now,
        )),
        other => Err(StoreError::Reply(format!("usage: {other:?}"))),
    }
}

/// `lua/global/check.lua`'s `usage` reply: the verdict's four, the store's clock, then
/// the rate, escrow, lent, borrowed and capacity in thousandths.
pub fn parse_region_usage(reply: &[i64]) -> Result<(RegionUsage, i64), StoreError> {
    let milli = |v: i64| v as f64 / 1000.0;
    match reply {
        [head @ .., now, rate, escrow, lent, borrowed, capacity] if head.len() == 4 => Ok((
            RegionUsage {
                verdict: parse_verdict(head)?,
                rate: milli(*rate),
                escrow: milli(*escrow),
                lent: milli(*lent),
                borrowed: milli(*borrowed),
                capacity: milli(*capacity),
            },
            *now,
        )),
        other => Err(StoreError::Reply(format!("usage: {other:?}"))),
    }
}

/// A slice take's reply (`lua/slice.lua`, `lua/bucket_slice.lua`) as its grant, with the
/// units a bucket's slice that the take ended gave back.
pub(super) fn grant(taker: Taker, reply: &[i64]) -> Result<(Grant, u64), StoreError> {
    match (taker, reply) {
        (Taker::Window, &[granted, left, reset_after_us, slot, ledger, retry])
            if granted >= 0 && left >= 0 =>
        {
            let grant = Grant {
                granted: granted as u64,
                left: left as u64,
                reset_after_us,
                // (A take of a key in other numbers answers the check alone, with its own
                // retry; otherwise the window's end.)
                retry_after_us: if retry > 0 { retry } else { reset_after_us },
                ends_after_us: reset_after_us,
                mark: (ledger > 0).then_some(Mark::Window { slot, ledger }),
            };
            Ok((grant, 0))
        }
        (
            Taker::Bucket { gcra },
            &[
                granted,
                left,
                reset_after_us,
                retry_after_us,
                id,
                ends_after_us,
                back,
            ],
        ) if granted >= 0 && left >= 0 => {
            let grant = Grant {
                granted: granted as u64,
                left: left as u64,
                reset_after_us,
                retry_after_us,
                ends_after_us,
                mark: (id > 0).then_some(Mark::Bucket { id, gcra }),
            };
            Ok((grant, back.max(0) as u64))
        }
        _ => Err(StoreError::Reply(format!("slice take: {reply:?}"))),
    }
}
