//! The leases this instance acquired and has not seen released, by when they end: at
//! each end the instance reads the key once (a peek), which drops the ended units in
//! Redis and counts them `expired`. Without it, a lease nobody released would be counted
//! only when some operation next touched its key, and not at all if the key's TTL took
//! it first: `acquired − released − expired` would drift above what is held.
//!
//! Bounded: at most [`MAX_TRACKED`] leases; one acquired beyond is not tracked (counted in
//! `quotad_leases_untracked_total`), its end counted only if its key is touched again.
//! A lease acquired through an instance that stops before the lease ends is likewise
//! counted only on its key's next operation.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::policy::ConcurrencyPolicy;

/// Leases tracked at most per instance.
pub(super) const MAX_TRACKED: usize = 100_000;

/// How long after a lease's end (by this instance's clock) its key is read: the reply of
/// the acquire, the Redis clock's lead and a scheduler turn.
pub(super) const MARGIN: Duration = Duration::from_millis(50);

/// Keys read per pass at most (the rest wait for the next pass, 100 ms later).
pub(super) const PER_PASS: usize = 512;

/// A lease to read at its end.
#[derive(Debug, Clone)]
pub(super) struct Due {
    /// The key's storage key.
    pub(super) key: String,
    pub(super) policy: Arc<ConcurrencyPolicy>,
    /// Held in the in-process store (a `local` lease).
    pub(super) local: bool,
}

#[derive(Default)]
struct Book {
    /// By (end, sequence): the sequence keeps two ends at one instant apart.
    by_end: BTreeMap<(Instant, u64), (String, Due)>,
    /// Lease id → its place in `by_end`.
    by_lease: HashMap<String, (Instant, u64)>,
    next: u64,
}

#[derive(Default)]
pub(super) struct Reaper {
    book: Mutex<Book>,
}

impl Reaper {
    fn book(&self) -> std::sync::MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Tracks lease `id` ending at `end`; false (not tracked) at the bound.
    pub(super) fn track(&self, id: &str, end: Instant, due: Due) -> bool {
        let mut b = self.book();
        if b.by_lease.len() >= MAX_TRACKED {
            return false;
        }
        let seq = b.next;
        b.next += 1;
        b.by_end.insert((end, seq), (id.to_owned(), due));
        b.by_lease.insert(id.to_owned(), (end, seq));
        true
    }

    /// The lease was released: nothing to read at its end.
    pub(super) fn forget(&self, id: &str) {
        let mut b = self.book();
        if let Some(place) = b.by_lease.remove(id) {
            b.by_end.remove(&place);
        }
    }

    /// The lease was extended (through this instance): read its key at the new end
    /// instead; a lease acquired through another instance is tracked from now (that one
    /// reads the key at the old end, finding nothing ended). False at the bound.
    pub(super) fn moved(&self, id: &str, end: Instant, due: Due) -> bool {
        {
            let mut b = self.book();
            if let Some(place) = b.by_lease.get(id).copied()
                && let Some(entry) = b.by_end.remove(&place)
            {
                let seq = b.next;
                b.next += 1;
                b.by_end.insert((end, seq), entry);
                b.by_lease.insert(id.to_owned(), (end, seq));
                return true;
            }
        }
        self.track(id, end, due)
    }

    /// The leases whose end (plus [`MARGIN`]) has passed at `now`, at most
    /// [`PER_PASS`], no longer tracked.
    pub(super) fn ended(&self, now: Instant) -> Vec<Due> {
        let mut b = self.book();
        let mut out = Vec::new();
        while out.len() < PER_PASS {
            let Some(entry) = b.by_end.first_entry() else {
                break;
            };
            if entry.key().0 + MARGIN > now {
                break;
            }
            let (id, due) = entry.remove();
            b.by_lease.remove(&id);
            out.push(due);
        }
        out
    }

    pub(super) fn len(&self) -> usize {
        self.book().by_lease.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn due() -> Due {
        Due {
            key: "k".into(),
            policy: Arc::new(ConcurrencyPolicy {
                name: "p".into(),
                limit: std::num::NonZeroU64::new(3).unwrap(),
                lease: Duration::from_secs(1),
                on_store_error: crate::policy::FailMode::Open,
            }),
            local: false,
        }
    }

    #[test]
    fn a_lease_is_read_once_after_its_end_unless_released_or_moved() {
        let r = Reaper::default();
        let t0 = Instant::now();
        let s = Duration::from_secs;
        assert!(r.track("a", t0 + s(1), due()));
        assert!(r.track("b", t0 + s(1), due()));
        assert!(r.track("c", t0 + s(2), due()));
        r.forget("a");
        assert!(r.moved("c", t0 + s(5), due()));
        assert!(
            r.moved("d", t0 + s(5), due()),
            "extended here, acquired elsewhere"
        );
        assert!(r.ended(t0 + s(1)).is_empty(), "not before the margin");
        assert_eq!(r.ended(t0 + s(1) + MARGIN).len(), 1, "b alone");
        assert!(r.ended(t0 + s(3)).is_empty(), "c was moved");
        assert_eq!(r.ended(t0 + s(6)).len(), 2);
        assert_eq!(r.len(), 0);
        assert!(r.ended(t0 + s(60)).is_empty(), "each once");
    }
}
