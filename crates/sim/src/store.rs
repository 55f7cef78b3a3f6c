//! One region's store in the simulator: what Redis holds in the daemon (issue 4 moves it
//! there), as plain maps.
//!
//! Per key: the lease book, the token bucket state, the cumulative admitted / rejected
//! counters, and whether the key saw traffic since the coordinator last asked. Decisions
//! run the production token bucket ([`quotad_core::algorithm::token_bucket_at`]) at the rate the
//! book gives on this store's clock, piecewise across the instants where a lease ends, and
//! at capacity B·R/ρ. The store also models replication: a write is durable unless the
//! replica lags, and a failover brings back the last durable version of every book.

use std::collections::BTreeSet;

use quotad_core::algorithm::{Op, State};
use quotad_core::clock::Clock;
use quotad_core::coordinator::bucket::{DefaultEscrow, KeyLimit, KeySlot, Shape};
use quotad_core::coordinator::demand::Counters;
use quotad_core::coordinator::lease::LeaseBook;
use quotad_core::coordinator::node::{LeaseStore, Written};
use quotad_core::coordinator::{GlobalPolicy, LocalUs};

use super::clock::SimClock;

#[derive(Debug, Clone, Default)]
struct Slot {
    /// Book, bucket and counters: the production model of a store key.
    key: KeySlot,
    /// The book a failover would bring back.
    durable: Option<Box<LeaseBook>>,
    active: bool,
}

impl Slot {
    /// The replica acknowledged: the book as it is now is what a failover brings back
    /// (copied into the kept allocation: this runs on every durable write).
    fn keep_durable(&mut self) {
        match (&mut self.durable, &self.key.book) {
            (Some(kept), Some(book)) => kept.as_mut().clone_from(book),
            (kept, book) => *kept = book.clone().map(Box::new),
        }
    }
}

/// In [`RegionStore::take_changed`]: the default escrow changed, so every key may have.
pub const ALL_KEYS: u32 = u32::MAX;

pub struct RegionStore {
    clock: SimClock,
    shape: Shape,
    default_escrow: Option<DefaultEscrow>,
    /// Every default escrow this store applied and since when (its clock): the checker's
    /// record of what was in force when a bucket was written, which the store itself
    /// keeps only as a lower bound (see [`DefaultEscrow`]).
    default_history: Vec<(LocalUs, f64)>,
    durable_default: Option<f64>,
    slots: Vec<Slot>,
    active: Vec<u32>,
    /// Keys whose book was written since the engine last asked (their rates may have
    /// changed: the invariant is checked and their expiries are scheduled).
    changed: BTreeSet<u32>,
    /// While true, the replica does not acknowledge: writes apply but are not durable.
    pub lagging: bool,
    /// The daemon's incarnation counter (kept in the store, so a restart can bump it).
    pub incarnation: u64,
    /// Book writes the coordinator made (in Redis, one script call each).
    pub book_writes: u64,
    /// Every key's own numbers as this region has them (a runtime limit; none: the
    /// policy's): every decision carries them, as the daemon's checks do.
    pub limit: Option<KeyLimit>,
}

/// Keys are `k<index>`; anything else is a key this simulation never has traffic for.
pub fn key_name(k: u32) -> String {
    format!("k{k}")
}

pub fn key_index(name: &str) -> Option<u32> {
    name.strip_prefix('k')?.parse().ok()
}

/// Before the first default is set, keys without a book enforce nothing.
const NO_DEFAULT: DefaultEscrow = DefaultEscrow {
    escrow: 0.0,
    before: 0.0,
    since: LocalUs::MIN,
};

impl RegionStore {
    pub fn new(clock: SimClock, policy: &GlobalPolicy, keys: u32, step_tolerance: i64) -> Self {
        RegionStore {
            clock,
            shape: Shape {
                rho: policy.rho,
                burst: policy.burst,
                step_tolerance,
            },
            default_escrow: None,
            default_history: Vec::new(),
            durable_default: None,
            slots: vec![Slot::default(); keys as usize],
            active: Vec::new(),
            changed: BTreeSet::new(),
            lagging: false,
            incarnation: 0,
            book_writes: 0,
            limit: None,
        }
    }

    /// The factor ρ_K/ρ this region should enforce every key's share at, by the numbers it
    /// has (1: the policy's).
    pub fn scale(&self) -> f64 {
        self.limit.map_or(1.0, |k| k.rate / self.shape.rho)
    }

    /// The rate `key`'s bucket refills at when the region's share is `rate`: what the
    /// stored bucket runs under (its own numbers, as the last decision set them).
    pub fn enforced(&self, key: u32, rate: f64) -> f64 {
        match self.slots.get(key as usize) {
            Some(s) => s.key.bucket_rate(&self.shape, rate).amount,
            None => rate,
        }
    }

    /// Every key's own numbers change in this region: from now on every decision carries
    /// them. Each key is brought to them at once, as by a decision of cost 0 (the daemon
    /// does so at the key's next decision; until then its bucket refills under the old
    /// numbers and is clamped to the new capacity at that decision).
    pub fn set_limit(&mut self, limit: Option<KeyLimit>) {
        self.limit = limit;
        let (d, shape, now, lagging) = (self.default(), self.shape, self.now(), self.lagging);
        for (k, slot) in self.slots.iter_mut().enumerate() {
            if slot.key.touch(&d, &shape, now) {
                if !lagging {
                    slot.keep_durable();
                }
                self.changed.insert(k as u32);
            }
            slot.key.set_limit(&d, &shape, now, limit);
        }
    }

    pub fn now(&self) -> LocalUs {
        self.clock.now_us()
    }

    fn default(&self) -> DefaultEscrow {
        self.default_escrow.unwrap_or(NO_DEFAULT)
    }

    /// The rate this store enforces for `key` at its time `now`.
    pub fn rate(&self, key: u32, now: LocalUs) -> f64 {
        match self.slots.get(key as usize) {
            Some(s) => s.key.rate(&self.default(), &self.shape, now),
            None => self.default().escrow,
        }
    }

    /// `n` requests of cost 1 arrive for `key` now: the bucket admits as many as it holds
    /// whole tokens for. Returns the number admitted.
    pub fn admit(&mut self, key: u32, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        let now = self.now();
        let (d, shape, lagging, limit) = (self.default(), self.shape, self.lagging, self.limit);
        let slot = &mut self.slots[key as usize];
        if slot.key.touch(&d, &shape, now) {
            // The drop is a write like any other: replicated unless the replica lags.
            if !lagging {
                slot.keep_durable();
            }
            self.changed.insert(key);
        }
        let peek = slot
            .key
            .decide(&d, &shape, now, Op::Check { cost: 0 }, limit);
        let take = n.min(peek.remaining);
        if take > 0 {
            let v = slot
                .key
                .decide(&d, &shape, now, Op::Check { cost: take }, limit);
            debug_assert!(v.allowed);
        }
        slot.key.counters.rejected += n - take;
        if !slot.active {
            slot.active = true;
            self.active.push(key);
        }
        take
    }

    /// Count sharing: spend `n` units admitted elsewhere (the bucket may go negative).
    pub fn debit(&mut self, key: u32, n: u64) {
        if key as usize >= self.slots.len() {
            return;
        }
        let now = self.now();
        let (d, shape) = (self.default(), self.shape);
        let slot = &mut self.slots[key as usize].key;
        slot.settle(&d, &shape, now);
        let cap = shape.burst * slot.rate(&d, &shape, now) / shape.rho;
        let tokens = match slot.bucket {
            Some(State::Bucket { tokens, .. }) => tokens,
            _ => cap,
        };
        slot.bucket = Some(State::Bucket {
            tokens: tokens - n as f64,
            ts: now,
            stamp: None,
        });
    }

    /// The book never reserves more than it has (see [`LeaseBook::net_rate`]).
    pub fn check_net_rate(&self, key: u32) -> Result<(), String> {
        let Some(book) = self.book(key) else {
            return Ok(());
        };
        let net = book.net_rate(self.now(), self.shape.step_tolerance);
        if net < -1e-9 {
            return Err(format!("book reserves more than it has: net rate {net:.6}"));
        }
        Ok(())
    }

    /// Invariant S, per bucket: the stored tokens are within the capacity share in force
    /// when they were written. (Every read clamps to the share in force then, so the
    /// tokens a bucket can spend never exceed its share; this checks that the store writes
    /// accordingly, including when a dropped loan or a failover lowers the rate.) For a
    /// key without a book that share is the default escrow of that instant, from the
    /// checker's own history: the store lowers a default lazily, as the smaller of old and
    /// new for the whole stretch since a bucket's last write, so tokens written before a
    /// lowering may exceed the new share until the next read clamps them.
    pub fn check_capacity(&self, key: u32) -> Result<(), String> {
        let slot = &self.slots[key as usize].key;
        let Some(State::Bucket { tokens, ts, .. }) = slot.bucket else {
            return Ok(());
        };
        let rate = match &slot.book {
            Some(book) => book.rate_during(ts),
            None => self
                .default_history
                .iter()
                .rev()
                .find(|(since, _)| *since <= ts)
                .map_or(0.0, |(_, e)| *e),
        };
        // Under the numbers the bucket was written under.
        let cap = slot.bucket_rate(&self.shape, rate).capacity;
        if tokens > cap + 1e-6 * cap.max(1.0) {
            return Err(format!(
                "bucket holds {tokens:.6} tokens, capacity share {cap:.6}"
            ));
        }
        Ok(())
    }

    /// Keys whose books changed since the last call.
    pub fn take_changed(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.changed).into_iter().collect()
    }

    /// The first store time after `after` at which `key`'s rate changes by itself: a
    /// lease ends, or (after a backward step no touch has seen yet) the clock catches up
    /// with the high-water mark and the loans the rate ignored meanwhile count again.
    pub fn next_expiry(&self, key: u32, after: LocalUs) -> Option<LocalUs> {
        let b = self.book(key)?;
        let caught_up = (!b.borrowed.is_empty())
            .then(|| b.high_water.saturating_sub(self.shape.step_tolerance))
            .filter(|&t| t > after);
        match (b.next_expiry(after), caught_up) {
            (Some(a), Some(c)) => Some(a.min(c)),
            (a, c) => a.or(c),
        }
    }

    pub fn book(&self, key: u32) -> Option<&LeaseBook> {
        self.slots
            .get(key as usize)
            .and_then(|s| s.key.book.as_ref())
    }

    /// The replica is promoted: every book and the default escrow go back to their last
    /// acknowledged versions, and every loan is dropped (bumping the step epoch, so that
    /// the daemon drops them too): the promoted copy may hold loans the old primary had
    /// already dropped (after a backward step), and dropping a loan is always safe. The
    /// daemon notices a failover (a new replication ID) and does this in Redis.
    /// (Bucket states and counters are kept: this models the loss of lease writes, not of
    /// decisions; see docs/global-budgets.md.)
    pub fn failover(&mut self) {
        let now = self.now();
        let (d, shape) = (self.default(), self.shape);
        for k in 0..self.slots.len() as u32 {
            let slot = &mut self.slots[k as usize];
            let loans = slot
                .durable
                .as_deref()
                .is_some_and(|b| !b.borrowed.is_empty());
            if slot.key.book.as_ref() != slot.durable.as_deref() || loans {
                slot.key.settle(&d, &shape, now);
                slot.key.book = slot.durable.as_deref().cloned();
                slot.key.drop_loans(&d, &shape, now);
                slot.key.clamp(&d, &shape, now);
                slot.keep_durable();
                self.changed.insert(k);
            }
        }
        if let Some(e) = self.durable_default {
            self.change_default(e, now);
        }
        self.lagging = false;
    }

    /// Changes the escrow of every key without a book (they settle lazily, see
    /// [`DefaultEscrow`]).
    fn change_default(&mut self, escrow: f64, now: LocalUs) {
        let changed = match &mut self.default_escrow {
            Some(d) => d.change(escrow, now),
            None => {
                self.default_escrow = Some(DefaultEscrow::new(escrow));
                true
            }
        };
        if changed {
            self.default_history.push((now, escrow));
            // Every key without a book changed rate: the engine checks them all.
            self.changed.insert(ALL_KEYS);
        }
    }

    fn slot_index(&self, key: &str) -> Option<u32> {
        key_index(key).filter(|&k| (k as usize) < self.slots.len())
    }
}

impl LeaseStore for RegionStore {
    fn write_book(&mut self, _policy: &str, key: &str, book: &LeaseBook) -> Written {
        let Some(k) = self.slot_index(key) else {
            return Written {
                durable: false,
                epoch: book.epoch,
            };
        };
        self.book_writes += 1;
        let now = self.now();
        let (d, shape) = (self.default(), self.shape);
        let durable = !self.lagging;
        let slot = &mut self.slots[k as usize];
        let written = slot.key.write_book(&d, &shape, now, book);
        if written.changed {
            self.changed.insert(k);
        }
        if durable {
            slot.keep_durable();
        }
        Written {
            durable,
            epoch: written.epoch,
        }
    }

    fn read_book(&mut self, _policy: &str, key: &str) -> Option<LeaseBook> {
        let k = self.slot_index(key)?;
        self.slots[k as usize].key.book.clone()
    }

    fn books(&mut self, _policy: &str) -> Vec<(String, LeaseBook)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(k, s)| s.key.book.clone().map(|b| (key_name(k as u32), b)))
            .collect()
    }

    fn take_active(&mut self, _policy: &str) -> Vec<String> {
        let keys = std::mem::take(&mut self.active);
        keys.into_iter()
            .map(|k| {
                self.slots[k as usize].active = false;
                key_name(k)
            })
            .collect()
    }

    /// In policy units, as the daemon reads them (`federation::lease_store`): a key under
    /// its own rate ρ_K offers n·ρ/ρ_K of the policy's units.
    fn counters(&mut self, _policy: &str, key: &str) -> Counters {
        let Some(k) = self.slot_index(key) else {
            return Counters::default();
        };
        let slot = &self.slots[k as usize].key;
        let rho = self.shape.rho;
        let scale = |n: u64| match slot.limit {
            Some(l) if l.rate > 0.0 => (n as f64 * rho / l.rate).round() as u64,
            _ => n,
        };
        Counters {
            admitted: scale(slot.counters.admitted),
            rejected: scale(slot.counters.rejected),
        }
    }

    fn default_escrow(&mut self, _policy: &str) -> Option<f64> {
        self.default_escrow.map(|d| d.escrow)
    }

    fn set_default_escrow(&mut self, _policy: &str, escrow: f64) -> bool {
        let now = self.now();
        self.change_default(escrow, now);
        let durable = !self.lagging;
        if durable {
            self.durable_default = Some(escrow);
        }
        durable
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::RealTime;
    use quotad_core::coordinator::Mode;

    fn store() -> (RealTime, RegionStore) {
        let real = RealTime::new(0);
        let clock = SimClock::new(real.clone(), 0, 0.0);
        let policy =
            GlobalPolicy::from_weights("g", 1, 100.0, 100.0, &[1.0, 1.0], Mode::Proportional);
        let mut s = RegionStore::new(clock, &policy, 1, 50_000);
        s.set_default_escrow("g", 50.0);
        (real, s)
    }

    /// A failover brings back the last durable book (here: none).
    #[test]
    fn failover_restores_durable_books() {
        let (real, mut s) = store();
        s.lagging = true;
        let w = s.write_book("g", "k0", &LeaseBook::new(10.0));
        assert!(!w.durable, "not acknowledged");
        assert_eq!(s.rate(0, 0), 10.0);
        assert_eq!(s.admit(0, 1000), 10);
        s.check_capacity(0).unwrap();
        s.failover();
        assert_eq!(s.rate(0, 0), 50.0);
        assert!(s.book(0).is_none());
        real.set(1_000_000);
        assert_eq!(
            s.admit(0, 1000),
            50,
            "refilled at the restored rate, capped at 50"
        );
    }
}
