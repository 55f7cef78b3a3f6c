//! Concurrency limits as pure functions: the reference model of `lua/concurrency.lua`.
//!
//! A concurrency limit bounds how many units of a key are *held at once* (streams open,
//! model calls running, jobs in flight), where a rate limit bounds how many are spent per
//! unit of time. A holder acquires a lease of some units, and gives it back by releasing
//! it; a lease it never releases (its client crashed) ends at its expiry, by the store's
//! clock, so a crash cannot leak a slot. A holder that needs longer extends its lease
//! before it ends.
//!
//! The state mirrors a Redis sorted set: one entry per unit held, scored by the lease's
//! expiry (µs, the store's clock) and named `id:1 ..= id:units`, where `id` names the
//! lease. Entries are ordered by (expiry, name), as the sorted set orders them. Every
//! operation first drops the entries whose expiry has passed, so an expired lease holds
//! nothing whether or not the key was touched since; the key's TTL is the latest expiry,
//! so a key that expires holds nothing either.
//!
//! As in [`crate::algorithm`], the Lua script does the same arithmetic in the same order,
//! and the differential test (`tests/differential.rs`) requires identical answers.

/// The units held under one key: `(expiry_us, entry)`, sorted by expiry, then by name.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Leases {
    /// `(expiry_us, lease id)` per held lease, sorted by expiry, then by id.
    pub entries: Vec<(i64, String)>,
    /// The leases a reset ([`LeaseOp::Clear`]) gave back before their end, by id, with
    /// the end they had: until then, a release or an extend of one is told so. Kept
    /// beside the key (`<key>:e` in Redis), sorted by id.
    pub ended: Vec<(String, i64)>,
}

/// What a holder asks of a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseOp<'a> {
    /// Hold `units` more under lease `id` until now + `hold_us`, if they fit under the limit.
    Acquire {
        /// The lease's id.
        id: &'a str,
        /// Units it holds.
        units: u64,
        /// How long it holds them, µs.
        hold_us: i64,
    },
    /// Give lease `id` (of `units`) back; a lease of another unit count is not the key's.
    Release {
        /// The lease's id.
        id: &'a str,
        /// Units it holds.
        units: u64,
    },
    /// Move the expiry of a live lease `id` (of `units`; as for a release) to now +
    /// `hold_us`.
    Extend {
        /// The lease's id.
        id: &'a str,
        /// Units it holds.
        units: u64,
        /// How long from now it holds them, µs.
        hold_us: i64,
    },
    /// Only read: what is held now.
    Peek,
    /// Give back every lease of the key (an operator's reset: slots a holder will never
    /// release, freed before their leases end).
    Clear,
}

/// The answer to one operation, as the script returns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseAnswer {
    /// Acquire: the units fit and are held. Release and extend: the lease was live (an
    /// unknown, released or expired lease is `false`, and nothing changed). Peek: true.
    pub ok: bool,
    /// Units held under the key after the operation.
    pub held: u64,
    /// Time until the earliest lease ends by expiry (0: nothing is held).
    pub reset_after_us: i64,
    /// A denied acquire: time until enough leases have ended by expiry for it to fit (a
    /// release may free them sooner). 0 otherwise.
    pub retry_after_us: i64,
    /// Units whose leases had expired, dropped by this operation (crashed holders).
    pub expired: u64,
    /// Units a release or a clear gave back (0 for the others).
    pub released: u64,
    /// A release or an extend of a lease a reset of the key ended (`ok` is false).
    pub ended: bool,
}

/// What to do with the stored state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseWrite {
    /// Leave the stored state (and its TTL) as it was.
    Keep,
    /// Store these entries; the key may be dropped after `ttl_us` (the latest expiry, of
    /// a held unit or of an ended lease).
    Put {
        /// The leases to store.
        leases: Leases,
        /// When the key may be dropped, µs from now.
        ttl_us: i64,
    },
    /// Nothing is held: remove the key.
    Delete,
}

/// What one lease operation answered, and what to store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseOutcome {
    /// The answer.
    pub answer: LeaseAnswer,
    /// What to do with the stored state.
    pub write: LeaseWrite,
}

/// The entry name of unit `i` of lease `id`.
pub fn entry(id: &str, i: u64) -> String {
    format!("{id}:{i}")
}

/// Whether lease `id` is live with exactly `units` units: a lease is only ever held
/// whole (its units are acquired, extended, released and expire together), so a name
/// with another unit count than it was issued with is no lease of the key's.
fn holds(entries: &[(i64, String)], id: &str, units: u64) -> bool {
    let has = |i: u64| entries.iter().any(|(_, m)| *m == entry(id, i));
    units >= 1 && has(units) && !has(units + 1)
}

/// Runs one operation on a key with at most `limit` units held at once, at store time
/// `now_us`. Callers keep `units` within `1 ..= limit` and `hold_us` positive.
pub fn apply(limit: u64, state: Option<&Leases>, now_us: i64, op: LeaseOp<'_>) -> LeaseOutcome {
    let stored = state.map_or(0, |s| s.entries.len());
    // Expiry at or before now has passed (ZREMRANGEBYSCORE -inf now).
    let mut entries: Vec<(i64, String)> = state
        .map(|s| {
            s.entries
                .iter()
                .filter(|(t, _)| *t > now_us)
                .cloned()
                .collect()
        })
        .unwrap_or_default();
    let expired = (stored - entries.len()) as u64;
    let live = entries.len() as u64;
    let mut ended: Vec<(String, i64)> = state
        .map(|s| {
            s.ended
                .iter()
                .filter(|(_, t)| *t > now_us)
                .cloned()
                .collect()
        })
        .unwrap_or_default();
    let was_ended = |id: &str| ended.iter().any(|(e, _)| e == id);
    let mut by_reset = false;
    let (ok, retry, changed) = match op {
        LeaseOp::Peek => (true, 0, false),
        LeaseOp::Clear => {
            clear(&mut entries, &mut ended);
            (true, 0, live > 0)
        }
        LeaseOp::Acquire { id, units, hold_us } => {
            acquire(&mut entries, limit, now_us, id, units, hold_us)
        }
        LeaseOp::Release { id, units } => {
            let held = holds(&entries, id, units);
            if held {
                for i in 1..=units {
                    let name = entry(id, i);
                    entries.retain(|(_, m)| *m != name);
                }
            }
            by_reset = !held && was_ended(id);
            (held, 0, held)
        }
        LeaseOp::Extend { id, units, hold_us } => {
            let live = holds(&entries, id, units);
            by_reset = !live && was_ended(id);
            if live {
                extend(&mut entries, now_us + hold_us, id, units);
            }
            (live, 0, live)
        }
    };
    let released = match op {
        LeaseOp::Release { .. } | LeaseOp::Clear => live - entries.len() as u64,
        _ => 0,
    };
    let answer = LeaseAnswer {
        ok,
        released,
        held: entries.len() as u64,
        reset_after_us: entries.first().map_or(0, |(t, _)| t - now_us),
        retry_after_us: if ok { 0 } else { retry.max(0) },
        expired,
        ended: by_reset,
    };
    let write = if !changed && expired == 0 {
        LeaseWrite::Keep
    } else {
        written(entries, ended, now_us)
    };
    LeaseOutcome { answer, write }
}

/// Ends every live lease (a reset): each id is remembered as ended until its lease would
/// have ended, so its release or extend says so.
fn clear(entries: &mut Vec<(i64, String)>, ended: &mut Vec<(String, i64)>) {
    for (t, name) in entries.drain(..) {
        let id = name.rsplit_once(':').map_or(name.as_str(), |(id, _)| id);
        match ended.iter_mut().find(|(e, _)| e == id) {
            Some((_, until)) => *until = (*until).max(t),
            None => ended.push((id.to_owned(), t)),
        }
    }
    ended.sort();
}

/// Acquires `units` for lease `id` until `now_us + hold_us` if they fit under `limit`:
/// (acquired, retry after, changed).
fn acquire(
    entries: &mut Vec<(i64, String)>,
    limit: u64,
    now_us: i64,
    id: &str,
    units: u64,
    hold_us: i64,
) -> (bool, i64, bool) {
    let held = entries.len() as u64;
    if held + units <= limit {
        let until = now_us + hold_us;
        for i in 1..=units {
            insert(entries, until, entry(id, i));
        }
        return (true, 0, true);
    }
    // Fits once the earliest (held + units - limit) entries have ended.
    let k = held + units - limit;
    let retry = match k.checked_sub(1).and_then(|i| entries.get(i as usize)) {
        Some((t, _)) => t - now_us,
        None => 0, // more than the limit could ever hold: never
    };
    (false, retry, false)
}

/// Moves the `units` entries of live lease `id` to end at `until`.
fn extend(entries: &mut Vec<(i64, String)>, until: i64, id: &str, units: u64) {
    for i in 1..=units {
        let name = entry(id, i);
        if let Some(at) = entries.iter().position(|(_, m)| *m == name) {
            entries.remove(at);
            insert(entries, until, name);
        }
    }
}

/// The write of a changed key: gone when nothing is held or remembered, else kept until
/// its last lease or remembered end.
fn written(entries: Vec<(i64, String)>, ended: Vec<(String, i64)>, now_us: i64) -> LeaseWrite {
    if entries.is_empty() && ended.is_empty() {
        return LeaseWrite::Delete;
    }
    let last = entries.iter().map(|(t, _)| *t);
    let ttl_us = last
        .chain(ended.iter().map(|(_, t)| *t))
        .max()
        .unwrap_or(now_us)
        - now_us;
    LeaseWrite::Put {
        leases: Leases { entries, ended },
        ttl_us,
    }
}

/// Inserts in sorted-set order: by expiry, then by name.
fn insert(entries: &mut Vec<(i64, String)>, at: i64, name: String) {
    let pos = entries.partition_point(|(t, m)| (*t, m.as_str()) < (at, name.as_str()));
    entries.insert(pos, (at, name));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(state: &mut Option<Leases>, limit: u64, now: i64, op: LeaseOp) -> LeaseAnswer {
        let out = apply(limit, state.as_ref(), now, op);
        match out.write {
            LeaseWrite::Keep => {}
            LeaseWrite::Put { leases, .. } => *state = Some(leases),
            LeaseWrite::Delete => *state = None,
        }
        out.answer
    }

    fn acquire(id: &str, units: u64) -> LeaseOp<'_> {
        LeaseOp::Acquire {
            id,
            units,
            hold_us: 1_000,
        }
    }

    /// A clear gives back every live lease (counted `released`), drops the ended ones
    /// (counted `expired`), and leaves the key empty.
    #[test]
    fn a_clear_gives_every_lease_back() {
        let mut s = None;
        assert!(run(&mut s, 5, 0, acquire("a", 2)).ok);
        let b = LeaseOp::Acquire {
            id: "b",
            units: 1,
            hold_us: 5_000,
        };
        assert!(run(&mut s, 5, 0, b).ok);
        let cleared = run(&mut s, 5, 2_000, LeaseOp::Clear);
        assert_eq!(
            (cleared.ok, cleared.held, cleared.released, cleared.expired),
            (true, 0, 1, 2)
        );
        // Nothing held; `b`, given back before its end, is remembered until then.
        let state = s.clone().unwrap_or_default();
        assert_eq!(
            (state.entries.len(), state.ended),
            (0, vec![("b".into(), 5_000)])
        );
        assert!(run(&mut s, 5, 2_000, acquire("c", 5)).ok, "all free");
    }

    /// A release or an extend of a lease a reset gave back is told so until the lease
    /// would have ended, and changes nothing; after that it is an unknown lease.
    #[test]
    fn a_lease_a_reset_gave_back_is_told_so() {
        let mut s = None;
        assert!(run(&mut s, 5, 0, acquire("a", 2)).ok);
        run(&mut s, 5, 100, LeaseOp::Clear);
        let release = LeaseOp::Release { id: "a", units: 2 };
        let extend = LeaseOp::Extend {
            id: "a",
            units: 2,
            hold_us: 1_000,
        };
        for op in [release, extend] {
            let ans = run(&mut s, 5, 500, op);
            assert_eq!(
                (ans.ok, ans.ended, ans.held, ans.released),
                (false, true, 0, 0)
            );
        }
        let late = run(&mut s, 5, 1_000, release);
        assert_eq!((late.ok, late.ended), (false, false), "past its end");
    }

    #[test]
    fn at_most_the_limit_is_held_and_a_release_frees_its_units() {
        let mut s = None;
        assert!(run(&mut s, 3, 0, acquire("a", 2)).ok);
        let denied = run(&mut s, 3, 10, acquire("b", 2));
        assert!(!denied.ok);
        assert_eq!((denied.held, denied.retry_after_us), (2, 990));
        assert!(run(&mut s, 3, 20, acquire("c", 1)).ok);
        let released = run(&mut s, 3, 30, LeaseOp::Release { id: "a", units: 2 });
        assert_eq!((released.ok, released.held), (true, 1));
        assert!(run(&mut s, 3, 40, acquire("b", 2)).ok);
    }

    #[test]
    fn a_lease_never_released_ends_at_its_expiry_and_is_counted_as_expired() {
        let mut s = None;
        assert!(run(&mut s, 2, 0, acquire("a", 2)).ok);
        assert!(!run(&mut s, 2, 999, acquire("b", 1)).ok);
        // At its expiry the lease holds nothing: the slot is back.
        let after = run(&mut s, 2, 1_000, acquire("b", 1));
        assert_eq!((after.ok, after.held, after.expired), (true, 1, 2));
    }

    #[test]
    fn releasing_or_extending_an_unknown_or_ended_lease_changes_nothing() {
        let mut s = None;
        run(&mut s, 2, 0, acquire("a", 1));
        let before = s.clone();
        let out = apply(2, s.as_ref(), 10, LeaseOp::Release { id: "x", units: 1 });
        assert!(!out.answer.ok);
        assert_eq!(out.write, LeaseWrite::Keep);
        let out = apply(
            2,
            s.as_ref(),
            10,
            LeaseOp::Extend {
                id: "x",
                units: 1,
                hold_us: 5,
            },
        );
        assert!(!out.answer.ok);
        assert_eq!((out.write, &s), (LeaseWrite::Keep, &before));
        // Released twice: the second finds nothing.
        assert!(run(&mut s, 2, 20, LeaseOp::Release { id: "a", units: 1 }).ok);
        assert!(!run(&mut s, 2, 30, LeaseOp::Release { id: "a", units: 1 }).ok);
        assert_eq!(s, None);
    }

    #[test]
    fn an_extended_lease_outlives_its_first_expiry() {
        let mut s = None;
        run(&mut s, 1, 0, acquire("a", 1));
        let ext = LeaseOp::Extend {
            id: "a",
            units: 1,
            hold_us: 1_000,
        };
        assert!(run(&mut s, 1, 900, ext).ok);
        assert!(!run(&mut s, 1, 1_500, acquire("b", 1)).ok);
        assert!(run(&mut s, 1, 1_900, acquire("b", 1)).ok);
        // Too late to extend once it ended.
        assert!(!run(&mut s, 1, 3_000, ext).ok);
    }

    #[test]
    fn the_key_lives_until_its_latest_expiry() {
        let out = apply(5, None, 100, acquire("a", 1));
        let LeaseWrite::Put { leases, ttl_us } = out.write else {
            panic!("{:?}", out.write)
        };
        assert_eq!(ttl_us, 1_000);
        let out = apply(
            5,
            Some(&leases),
            600,
            LeaseOp::Acquire {
                id: "b",
                units: 1,
                hold_us: 2_000,
            },
        );
        assert!(matches!(out.write, LeaseWrite::Put { ttl_us: 2_000, .. }));
        assert_eq!(out.answer.reset_after_us, 500);
    }
}
