//! One region's store in the simulator: what Redis holds in the daemon (issue 4 moves it
//! there), as plain maps.
//!
//! Per key: the lease book, the token bucket state, the cumulative admitted / rejected
//! counters, and whether the key saw traffic since the coordinator last asked. Decisions
//! run the production token bucket ([`crate::algorithm::token_bucket_at`]) at the rate the
//! book gives on this store's clock, piecewise across the instants where a lease ends, and
//! at capacity B·R/ρ. The store also models replication: a write is durable unless the
//! replica lags, and a failover brings back the last durable version of every book.

use std::collections::BTreeSet;

use crate::algorithm::{self, BucketRate, Op, State, Write};
use crate::clock::Clock;
use crate::coordinator::demand::Counters;
use crate::coordinator::lease::LeaseBook;
use crate::coordinator::node::{LeaseStore, Written};
use crate::coordinator::{GlobalPolicy, LocalUs};

use super::clock::SimClock;

#[derive(Debug, Clone, Default)]
struct Slot {
    book: Option<Box<LeaseBook>>,
    /// The version a failover would bring back.
    durable: Option<Box<LeaseBook>>,
    bucket: Option<State>,
    counters: Counters,
    active: bool,
}

/// In [`RegionStore::take_changed`]: the default escrow changed, so every key may have.
pub const ALL_KEYS: u32 = u32::MAX;

pub struct RegionStore {
    clock: SimClock,
    /// The global rate and capacity (the policy's ρ and B).
    rho: f64,
    burst: f64,
    step_tolerance: i64,
    default_escrow: Option<f64>,
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
}

/// Keys are `k<index>`; anything else is a key this simulation never has traffic for.
pub fn key_name(k: u32) -> String {
    format!("k{k}")
}

pub fn key_index(name: &str) -> Option<u32> {
    name.strip_prefix('k')?.parse().ok()
}

impl RegionStore {
    pub fn new(clock: SimClock, policy: &GlobalPolicy, keys: u32, step_tolerance: i64) -> Self {
        RegionStore {
            clock,
            rho: policy.rho,
            burst: policy.burst,
            step_tolerance,
            default_escrow: None,
            durable_default: None,
            slots: vec![Slot::default(); keys as usize],
            active: Vec::new(),
            changed: BTreeSet::new(),
            lagging: false,
            incarnation: 0,
        }
    }

    pub fn now(&self) -> LocalUs {
        self.clock.now_us()
    }

    /// The rate this store enforces for `key` at its time `now`.
    pub fn rate(&self, key: u32, now: LocalUs) -> f64 {
        match self.slots.get(key as usize).and_then(|s| s.book.as_deref()) {
            Some(book) => book.rate(now, self.step_tolerance),
            None => self.default_escrow.unwrap_or(0.0),
        }
    }

    /// The rate that was in force at `t`, a time the bucket is being settled across.
    fn rate_during(&self, key: u32, t: LocalUs) -> f64 {
        match self.slots.get(key as usize).and_then(|s| s.book.as_deref()) {
            Some(book) => book.rate_during(t),
            None => self.default_escrow.unwrap_or(0.0),
        }
    }

    fn bucket_rate(&self, rate: f64) -> BucketRate {
        let cap = if self.rho > 0.0 {
            self.burst * rate / self.rho
        } else {
            0.0
        };
        BucketRate::per_second(rate, cap)
    }

    /// Brings the bucket to `now` at the rates in force since it was last written,
    /// segment by segment (a lease that ends mid-way changes the rate there).
    fn settle(&mut self, key: u32, now: LocalUs) {
        let slot = &self.slots[key as usize];
        let Some(State::Bucket { ts, .. }) = slot.bucket else {
            return;
        };
        let points = slot
            .book
            .as_deref()
            .map(|b| b.expiries_between(ts, now))
            .unwrap_or_default();
        let mut from = ts;
        for at in points.into_iter().chain(std::iter::once(now)) {
            if at <= from {
                continue;
            }
            let rate = self.bucket_rate(self.rate_during(key, from));
            let slot = &mut self.slots[key as usize];
            let out =
                algorithm::token_bucket_at(&rate, slot.bucket.as_ref(), at, Op::Refund { cost: 0 });
            if let Write::Put { state, .. } = out.write {
                slot.bucket = Some(state);
            }
            from = at;
        }
    }

    /// What the script does on every touch: a backward step beyond the tolerance drops
    /// the key's loans for good, and the bucket keeps only the smaller capacity share.
    fn touch(&mut self, key: u32, now: LocalUs) {
        let tol = self.step_tolerance;
        let lagging = self.lagging;
        let slot = &mut self.slots[key as usize];
        if let Some(book) = slot.book.as_deref_mut()
            && book.observe_time(now, tol)
        {
            // The drop is a write like any other: replicated unless the replica lags.
            if !lagging {
                slot.durable = Some(Box::new(book.clone()));
            }
            self.changed.insert(key);
            self.clamp(key, now);
        }
    }

    /// `n` requests of cost 1 arrive for `key` now: the bucket admits as many as it holds
    /// whole tokens for. Returns the number admitted.
    pub fn admit(&mut self, key: u32, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        let now = self.now();
        self.touch(key, now);
        self.settle(key, now);
        let rate = self.bucket_rate(self.rate(key, now));
        let slot = &mut self.slots[key as usize];
        let peek =
            algorithm::token_bucket_at(&rate, slot.bucket.as_ref(), now, Op::Check { cost: 0 });
        let take = n.min(peek.verdict.remaining);
        if take > 0 {
            let out = algorithm::token_bucket_at(
                &rate,
                slot.bucket.as_ref(),
                now,
                Op::Check { cost: take },
            );
            debug_assert!(out.verdict.allowed);
            if let Write::Put { state, .. } = out.write {
                slot.bucket = Some(state);
            }
        }
        slot.counters.admitted += take;
        slot.counters.rejected += n - take;
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
        self.settle(key, now);
        let rate = self.bucket_rate(self.rate(key, now));
        let slot = &mut self.slots[key as usize];
        let tokens = match slot.bucket {
            Some(State::Bucket { tokens, .. }) => tokens,
            _ => rate.capacity,
        };
        slot.bucket = Some(State::Bucket {
            tokens: tokens - n as f64,
            ts: now,
        });
    }

    /// The book never reserves more than it has (see [`LeaseBook::net_rate`]).
    pub fn check_net_rate(&self, key: u32) -> Result<(), String> {
        let Some(book) = self.book(key) else {
            return Ok(());
        };
        let net = book.net_rate(self.now(), self.step_tolerance);
        if net < -1e-9 {
            return Err(format!("book reserves more than it has: net rate {net:.6}"));
        }
        Ok(())
    }

    /// Invariant S, per bucket: the stored tokens are within the capacity share in force
    /// when they were written. (Every read clamps to the share in force then, so the
    /// tokens a bucket can spend never exceed its share; this checks that the store writes
    /// accordingly, including when a dropped loan or a failover lowers the rate.)
    pub fn check_capacity(&self, key: u32) -> Result<(), String> {
        let Some(State::Bucket { tokens, ts }) = self.slots[key as usize].bucket else {
            return Ok(());
        };
        let cap = self.bucket_rate(self.rate_during(key, ts)).capacity;
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

    /// Store times at which `key`'s rate changes by itself: a lease ends, or (after a
    /// backward step no touch has seen yet) the clock catches up with the high-water mark
    /// and the loans the rate ignored meanwhile count again.
    pub fn expiries(&self, key: u32) -> Vec<LocalUs> {
        match self.slots.get(key as usize).and_then(|s| s.book.as_deref()) {
            Some(b) => {
                let mut out = b.expiries_between(LocalUs::MIN, LocalUs::MAX);
                if !b.borrowed.is_empty() {
                    out.push(b.high_water.saturating_sub(self.step_tolerance));
                }
                out
            }
            None => Vec::new(),
        }
    }

    pub fn book(&self, key: u32) -> Option<&LeaseBook> {
        self.slots.get(key as usize).and_then(|s| s.book.as_deref())
    }

    /// The replica is promoted: every book and the default escrow go back to their last
    /// acknowledged versions, and every loan is dropped (bumping the step epoch, so that
    /// the daemon drops them too): the promoted copy may hold loans the old primary had
    /// already dropped (after a backward step), and dropping a loan is always safe. The
    /// daemon notices a failover (a new replication ID) and does this in Redis.
    /// (Bucket states and counters are kept: this models the loss of lease writes, not of
    /// decisions; see the README.)
    pub fn failover(&mut self) {
        let now = self.now();
        for k in 0..self.slots.len() as u32 {
            let slot = &self.slots[k as usize];
            let loans = slot
                .durable
                .as_deref()
                .is_some_and(|b| !b.borrowed.is_empty());
            if slot.book != slot.durable || loans {
                self.settle(k, now);
                let slot = &mut self.slots[k as usize];
                let mut book = slot.durable.clone();
                if let Some(b) = book.as_deref_mut()
                    && !b.borrowed.is_empty()
                {
                    b.borrowed.clear();
                    b.epoch += 1;
                }
                slot.durable.clone_from(&book);
                slot.book = book;
                self.changed.insert(k);
                self.clamp(k, now);
            }
        }
        if let Some(e) = self.durable_default {
            self.change_default(e, now);
        }
        self.lagging = false;
    }

    /// After a rate change: the bucket holds at most the new capacity share.
    fn clamp(&mut self, key: u32, now: LocalUs) {
        let rate = self.bucket_rate(self.rate(key, now));
        let slot = &mut self.slots[key as usize];
        if slot.bucket.is_some() {
            let out = algorithm::token_bucket_at(
                &rate,
                slot.bucket.as_ref(),
                now,
                Op::Refund { cost: 0 },
            );
            if let Write::Put { state, .. } = out.write {
                slot.bucket = Some(state);
            }
        }
    }

    /// Changes the escrow of every key without a book: their buckets settle at the old
    /// rate first and are clamped to the new capacity share after.
    fn change_default(&mut self, escrow: f64, now: LocalUs) {
        if self.default_escrow == Some(escrow) {
            return;
        }
        let bookless: Vec<u32> = (0..self.slots.len() as u32)
            .filter(|&k| {
                let s = &self.slots[k as usize];
                s.book.is_none() && s.bucket.is_some()
            })
            .collect();
        for &k in &bookless {
            self.settle(k, now);
        }
        self.default_escrow = Some(escrow);
        for &k in &bookless {
            self.clamp(k, now);
        }
        // Every key without a book changed rate: the engine checks them all.
        self.changed.insert(ALL_KEYS);
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
        let now = self.now();
        self.touch(k, now);
        self.settle(k, now);
        let durable = !self.lagging;
        let slot = &mut self.slots[k as usize];
        let new = match slot.book.as_deref() {
            Some(old) => old.merge_write(book.clone()),
            None => book.clone(),
        };
        let epoch = new.epoch;
        if slot.book.as_deref() != Some(&new) {
            self.changed.insert(k);
        }
        if durable {
            slot.durable = Some(Box::new(new.clone()));
        }
        slot.book = Some(Box::new(new));
        self.clamp(k, now);
        Written { durable, epoch }
    }

    fn read_book(&mut self, _policy: &str, key: &str) -> Option<LeaseBook> {
        let k = self.slot_index(key)?;
        self.slots[k as usize].book.as_deref().cloned()
    }

    fn books(&mut self, _policy: &str) -> Vec<(String, LeaseBook)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(k, s)| s.book.as_deref().map(|b| (key_name(k as u32), b.clone())))
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

    fn counters(&mut self, _policy: &str, key: &str) -> Counters {
        self.slot_index(key)
            .map(|k| self.slots[k as usize].counters)
            .unwrap_or_default()
    }

    fn default_escrow(&mut self, _policy: &str) -> Option<f64> {
        self.default_escrow
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
    use crate::coordinator::lease::{Loan, Reservation};
    use crate::coordinator::{Mode, RegionId};
    use crate::sim::clock::RealTime;

    fn store() -> (RealTime, RegionStore) {
        let real = RealTime::new(0);
        let clock = SimClock::new(real.clone(), 0, 0.0);
        let policy =
            GlobalPolicy::from_weights("g", 1, 100.0, 100.0, &[1.0, 1.0], Mode::Proportional);
        let mut s = RegionStore::new(clock, &policy, 1, 50_000);
        s.set_default_escrow("g", 50.0);
        (real, s)
    }

    /// The bucket refills at each rate for exactly as long as it was in force: a loan of
    /// 30/s that ends 1 s into a 2 s gap adds 30 tokens, not 60.
    #[test]
    fn refill_is_piecewise_across_lease_expiries() {
        let (real, mut s) = store();
        assert_eq!(s.admit(0, 1000), 50, "capacity share B·E/ρ = 50");
        let mut book = LeaseBook::new(50.0);
        book.borrowed.push(Loan {
            lender: RegionId(1),
            lender_incarnation: 1,
            seq: 1,
            amount: 30.0,
            until: 1_000_000,
        });
        assert!(s.write_book("g", "k0", &book).durable);
        real.set(2_000_000);
        // 1 s at 80/s (capacity 80) then 1 s at 50/s (capacity 50): clamped to 50.
        assert_eq!(s.admit(0, 1000), 50);
        real.set(2_500_000);
        assert_eq!(s.admit(0, 1000), 25);
        s.check_capacity(0).unwrap();
    }

    /// A reservation lowers the rate and the capacity at once; a failover brings back the
    /// last durable book.
    #[test]
    fn reservations_clamp_and_failover_restores_durable_books() {
        let (real, mut s) = store();
        let mut book = LeaseBook::new(50.0);
        book.reserved.push(Reservation {
            borrower: RegionId(1),
            seq: 1,
            amount: 40.0,
            until: 10_000_000,
        });
        s.lagging = true;
        assert!(!s.write_book("g", "k0", &book).durable, "not acknowledged");
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
