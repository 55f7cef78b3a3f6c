//! The lease book in a region's Redis: how the coordinator calls the scripts of
//! `lua/global/` that write books, drop loans and set the default escrow, and how a key's
//! hash reads back as the model's [`KeySlot`] (what the scripts are tested against).
//!
//! Per user key, one hash holds the bucket, the lease book and the counters (see
//! `lua/global/common.lua`); per policy, a meta hash with the default escrow. Their names
//! are [`crate::layout`]'s; a check's call is the store's (`store::redis::global`).

use redis::{Script, ScriptInvocation};

use crate::layout::{PolicyKeys, ScriptShape};
use crate::store::push_now;

use quotad_core::algorithm::State;
use quotad_core::coordinator::bucket::{DefaultEscrow, KeyLimit, KeySlot};
use quotad_core::coordinator::demand::Counters;
use quotad_core::coordinator::lease::{LeaseBook, Loan, Reservation};
use quotad_core::coordinator::{LocalUs, RegionId};

/// One book to write: the key's hash, the user key and the book.
pub struct BookWrite<'a> {
    /// The key's hash in Redis.
    pub storage_key: &'a str,
    /// The key as clients send it.
    pub user_key: &'a str,
    /// The book to write.
    pub book: &'a LeaseBook,
}

/// Books the book-write script takes per call: enough that the per-call work (the fence,
/// the default, the time, the call itself) is spread thin, few enough that one call holds
/// Redis for well under a millisecond.
pub(crate) const BOOKS_PER_CALL: usize = 64;

/// The book-write script's call for `books` (at most [`BOOKS_PER_CALL`] of one policy),
/// fenced by `token` (checked against `keys.fence`). The reply is each book's epoch.
pub fn write_books_invocation<'a>(
    script: &'a Script,
    keys: &PolicyKeys,
    token: u64,
    shape: &ScriptShape,
    books: &[BookWrite<'_>],
    now_us: Option<i64>,
) -> ScriptInvocation<'a> {
    let mut inv = script.prepare_invoke();
    inv.key(&keys.meta).key(&keys.fence).key(&keys.books);
    for b in books {
        inv.key(b.storage_key);
    }
    inv.arg(token);
    shape.push(&mut inv);
    for b in books {
        let book = b.book;
        inv.arg(b.user_key)
            .arg(book.escrow)
            .arg(reservations_arg(&book.reserved))
            .arg(loans_arg(&book.borrowed))
            .arg(if book.high_water == LocalUs::MIN {
                String::new()
            } else {
                book.high_water.to_string()
            })
            .arg(book.epoch);
    }
    push_now(&mut inv, now_us);
    inv
}

/// The failover script's call: drops the key's loans, fenced by `token`.
pub fn drop_loans_invocation<'a>(
    script: &'a Script,
    storage_key: &str,
    keys: &PolicyKeys,
    token: u64,
    shape: &ScriptShape,
    now_us: Option<i64>,
) -> ScriptInvocation<'a> {
    let mut inv = script.prepare_invoke();
    inv.key(storage_key)
        .key(&keys.meta)
        .key(&keys.fence)
        .arg(token);
    shape.push(&mut inv);
    push_now(&mut inv, now_us);
    inv
}

/// The default-escrow script's call, fenced by `token`.
pub fn set_default_invocation<'a>(
    script: &'a Script,
    keys: &PolicyKeys,
    token: u64,
    escrow: f64,
    keep_ms: i64,
    now_us: Option<i64>,
) -> ScriptInvocation<'a> {
    let mut inv = script.prepare_invoke();
    inv.key(&keys.meta)
        .key(&keys.fence)
        .arg(token)
        .arg(escrow)
        .arg(keep_ms);
    push_now(&mut inv, now_us);
    inv
}

pub(crate) fn reservations_arg(reserved: &[Reservation]) -> String {
    words(
        reserved
            .iter()
            .map(|r| format!("{} {} {} {}", r.borrower.0, r.seq, r.amount, r.until)),
    )
}

pub(crate) fn loans_arg(loans: &[Loan]) -> String {
    words(loans.iter().map(|l| {
        format!(
            "{} {} {} {} {}",
            l.lender.0, l.lender_incarnation, l.seq, l.amount, l.until
        )
    }))
}

fn words(groups: impl Iterator<Item = String>) -> String {
    groups.collect::<Vec<_>>().join(" ")
}

/// A global key's hash, or its policy's meta hash, that does not read as the model's
/// values (named by the hash field at fault).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("expected {expected} fields, got {got}")]
    Fields { expected: usize, got: usize },
    #[error("{field}: {words} words, not groups of {width}")]
    Groups {
        field: &'static str,
        words: usize,
        width: usize,
    },
    #[error("{field}: not a number: {value:?}")]
    NotANumber { field: &'static str, value: String },
    #[error("{field}: not an integer: {value:?}")]
    NotAnInteger { field: &'static str, value: String },
    #[error("{field}: out of range: {value:?}")]
    OutOfRange { field: &'static str, value: String },
}

/// The hash fields [`decode_slot`] reads, in its order.
pub const SLOT_FIELDS: [&str; 11] = ["t", "ts", "e", "r", "l", "hw", "ep", "a", "x", "kr", "kb"];

/// A key's hash (the values of [`SLOT_FIELDS`]) as the model's [`KeySlot`].
pub fn decode_slot(v: &[Option<String>]) -> Result<KeySlot, DecodeError> {
    if v.len() != SLOT_FIELDS.len() {
        return Err(DecodeError::Fields {
            expected: SLOT_FIELDS.len(),
            got: v.len(),
        });
    }
    let field = |i: usize| v[i].as_deref();
    let bucket = match (field(0), field(1)) {
        (Some(t), Some(ts)) => Some(State::Bucket {
            tokens: parse(t, "t")?,
            ts: parse_int(ts, "ts")?,
            stamp: None,
        }),
        _ => None,
    };
    let book = match field(2) {
        None => None,
        Some(e) => Some(LeaseBook {
            escrow: parse(e, "e")?,
            reserved: groups(field(3).unwrap_or(""), 4, "r")?
                .into_iter()
                .map(|g| {
                    Ok(Reservation {
                        borrower: RegionId(parse_int(g[0], "r")?),
                        seq: parse_int(g[1], "r")?,
                        amount: parse(g[2], "r")?,
                        until: parse_int(g[3], "r")?,
                    })
                })
                .collect::<Result<_, DecodeError>>()?,
            borrowed: groups(field(4).unwrap_or(""), 5, "l")?
                .into_iter()
                .map(|g| {
                    Ok(Loan {
                        lender: RegionId(parse_int(g[0], "l")?),
                        lender_incarnation: parse_int(g[1], "l")?,
                        seq: parse_int(g[2], "l")?,
                        amount: parse(g[3], "l")?,
                        until: parse_int(g[4], "l")?,
                    })
                })
                .collect::<Result<_, DecodeError>>()?,
            high_water: match field(5) {
                Some(hw) => parse_int(hw, "hw")?,
                None => LocalUs::MIN,
            },
            epoch: field(6).map_or(Ok(0), |e| parse_int(e, "ep"))?,
        }),
    };
    let counters = Counters {
        admitted: field(7).map_or(Ok(0), |a| parse_int(a, "a"))?,
        rejected: field(8).map_or(Ok(0), |x| parse_int(x, "x"))?,
    };
    let limit = match (field(9), field(10)) {
        (Some(kr), Some(kb)) => Some(KeyLimit {
            rate: parse(kr, "kr")?,
            burst: parse(kb, "kb")?,
        }),
        _ => None,
    };
    Ok(KeySlot {
        book,
        bucket,
        counters,
        limit,
    })
}

/// The meta hash's `d`, `dp`, `dt`; `None` when no default was ever written.
pub fn decode_default(v: &[Option<String>]) -> Result<Option<DefaultEscrow>, DecodeError> {
    let Some(d) = v.first().and_then(|d| d.as_deref()) else {
        return Ok(None);
    };
    let escrow = parse(d, "d")?;
    Ok(Some(DefaultEscrow {
        escrow,
        before: match v.get(1).and_then(|x| x.as_deref()) {
            Some(dp) => parse(dp, "dp")?,
            None => escrow,
        },
        since: match v.get(2).and_then(|x| x.as_deref()) {
            Some(dt) => parse_int(dt, "dt")?,
            None => LocalUs::MIN,
        },
    }))
}

fn groups<'s>(
    s: &'s str,
    width: usize,
    field: &'static str,
) -> Result<Vec<Vec<&'s str>>, DecodeError> {
    let words: Vec<&str> = s.split_ascii_whitespace().collect();
    if words.len() % width != 0 {
        return Err(DecodeError::Groups {
            field,
            words: words.len(),
            width,
        });
    }
    Ok(words.chunks(width).map(|c| c.to_vec()).collect())
}

fn parse(s: &str, field: &'static str) -> Result<f64, DecodeError> {
    s.parse::<f64>()
        .ok()
        .filter(|x| x.is_finite())
        .ok_or_else(|| DecodeError::NotANumber {
            field,
            value: s.to_owned(),
        })
}

/// Integers the scripts wrote with `%d` (or a double that holds an integer).
fn parse_int<T: TryFrom<i64>>(s: &str, field: &'static str) -> Result<T, DecodeError> {
    let n = match s.parse::<i64>() {
        Ok(n) => n,
        Err(_) => {
            let x = parse(s, field)?;
            if x.fract() != 0.0 || x.abs() > 9.0e15 {
                return Err(DecodeError::NotAnInteger {
                    field,
                    value: s.to_owned(),
                });
            }
            x as i64
        }
    };
    T::try_from(n).map_err(|_| DecodeError::OutOfRange {
        field,
        value: s.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_book_round_trips_through_the_hash_encoding() {
        let book = LeaseBook {
            escrow: 333.3333333333333,
            reserved: vec![Reservation {
                borrower: RegionId(2),
                seq: 7,
                amount: 0.1 + 0.2,
                until: 1_764_000_000_123_456,
            }],
            borrowed: vec![Loan {
                lender: RegionId(0),
                lender_incarnation: 12,
                seq: 3,
                amount: 1e-7,
                until: 1_764_000_000_999_999,
            }],
            high_water: 1_764_000_000_000_001,
            epoch: 4,
        };
        let v = vec![
            Some("1.5".to_owned()),
            Some("1764000000000000".to_owned()),
            Some(book.escrow.to_string()),
            Some(reservations_arg(&book.reserved)),
            Some(loans_arg(&book.borrowed)),
            Some(book.high_water.to_string()),
            Some("4".to_owned()),
            Some("10".to_owned()),
            None,
            Some("2.5".to_owned()),
            Some("7".to_owned()),
        ];
        let slot = decode_slot(&v).unwrap();
        assert_eq!(slot.book, Some(book));
        assert_eq!(slot.counters.admitted, 10);
        assert_eq!(
            slot.limit,
            Some(KeyLimit {
                rate: 2.5,
                burst: 7.0
            }),
            "the key's own numbers"
        );
        assert!(decode_slot(&[const { None }; 8]).is_err());
        let mut bad = v.clone();
        bad[3] = Some("1 2 3".to_owned());
        assert!(decode_slot(&bad).is_err());
    }
}
