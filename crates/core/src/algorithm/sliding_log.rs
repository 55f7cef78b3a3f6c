//! The sliding log: an exact sliding window, one entry per admitted unit
//! (`lua/sliding_log.lua`). Its entries are admission times, which mean the same under
//! any numbers: it has no frame ([`super::frame`]), and a reader counts the entries inside
//! its own window against its own limit.

use super::{Limits, Op, Outcome, State, Write, allowed, denied, eval_cost};

pub(super) fn apply(l: &Limits, state: Option<&State>, now: i64, op: Op, member: &str) -> Outcome {
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

#[cfg(test)]
mod tests {
    use crate::algorithm::testing::{SEC, check, limits, run};
    use crate::algorithm::{Algorithm, Op, Write, apply};

    #[test]
    fn sliding_log_article_sequence() {
        // Limit 3 per 60 s; requests at 0, 100, 200, 300, 59 999, 60 001, 60 150 ms.
        let l = limits(3, 60 * SEC, 3);
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
        let l = limits(5, SEC, 5);
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
}
