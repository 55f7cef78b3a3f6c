//! The embedded store as the coordinator's backend: one quotad per region, no Redis
//! (zero-setup mode and `quotad demo` on a machine without redis-server). The same model
//! ([`quotad_core::coordinator::bucket::KeySlot`]) on the same keys as `lua/global/`, so a region
//! behaves alike on either store; what it cannot give is sharing or durability: the
//! region's state lives and dies with the process (its incarnation is drawn from the wall
//! clock at every takeover, as on Redis, so a restart is a new life to the peers). A
//! restart also forgets the reservations for loans this region granted, so for up to one
//! lease it can admit what its borrowers still count: the bound holds across restarts only
//! with Redis.

use std::collections::HashMap;
use std::sync::Arc;

use super::Shared;
use super::incarnation;
use super::lease_store::{PolicyEntry, global_policies};
use super::lock::Takeover;
use super::runtime::{Backend, Coordinated, StoreFault};
use crate::store::memory::{MemoryStore, shape_of};
use quotad_core::clock::SystemClock;
use quotad_core::coordinator::bucket::{DefaultEscrow, KeySlot};
use quotad_core::coordinator::demand::Counters;
use quotad_core::coordinator::lease::LeaseBook;
use quotad_core::coordinator::node::{LeaseStore, Written};

pub(crate) struct MemoryBackend {
    pub(crate) store: Arc<MemoryStore>,
    /// The incarnation of this process's last takeover, if it took over yet (it takes
    /// over again only after stepping down: a panic, or a clock that went back).
    pub(crate) last: Option<u64>,
}

impl Backend for MemoryBackend {
    type Clock = SystemClock;
    type Store = MemoryLeaseStore;

    fn try_lead(&mut self, shared: &Shared) -> Option<(MemoryLeaseStore, SystemClock, Takeover)> {
        if self.last.is_none() {
            tracing::warn!(
                "global policies on the embedded store: what this region lends lives in this process; a restart forgets it and can over-admit by it for one lease (use Redis outside demos)"
            );
        }
        let max_skew_ms = shared.settings.max_skew.as_millis() as u64;
        let drawn = incarnation::next(self.last, incarnation::now_ms(), max_skew_ms);
        self.last = Some(drawn.incarnation);
        // No other instance to fence off: the incarnation serves as the token.
        let taken = Takeover {
            token: drawn.incarnation,
            drawn,
        };
        let store = MemoryLeaseStore {
            store: self.store.clone(),
            policies: global_policies(&shared.policies(), &shared.layouts),
            active_since: HashMap::new(),
        };
        Some((store, SystemClock, taken))
    }
}

pub(crate) struct MemoryLeaseStore {
    store: Arc<MemoryStore>,
    policies: HashMap<String, PolicyEntry>,
    active_since: HashMap<String, i64>,
}

impl Coordinated for MemoryLeaseStore {
    fn begin(&mut self, _round: bool) -> Result<(), StoreFault> {
        Ok(())
    }
    fn failure(&self) -> Option<&str> {
        None
    }
    fn fenced(&self) -> bool {
        false
    }
    fn renew(&mut self) -> Result<bool, StoreFault> {
        Ok(true)
    }
    fn release(&mut self) {}
}

impl LeaseStore for MemoryLeaseStore {
    fn write_book(&mut self, policy: &str, key: &str, book: &LeaseBook) -> Written {
        let Some(p) = self.policies.get(policy) else {
            return Written {
                durable: false,
                epoch: book.epoch,
            };
        };
        let now = self.store.now_us();
        let mut st = self.store.global();
        let d = st.default_for(&p.global.keys, &p.global.shape);
        let storage = p.layout.storage_key(key);
        // At the store's bound a new key's book is not written: reported not durable, so
        // no grant leaves for it (the safe answer).
        if !st.slots.contains_key(&storage) && self.store.reserve().is_err() {
            return Written {
                durable: false,
                epoch: book.epoch,
            };
        }
        let epoch = st
            .slots
            .entry(storage)
            .or_default()
            .write_book(&d, &shape_of(&p.global.shape), now, book)
            .epoch;
        st.books
            .entry(p.global.keys.books.clone())
            .or_default()
            .insert(key.to_owned());
        Written {
            durable: true,
            epoch,
        }
    }

    fn read_book(&mut self, policy: &str, key: &str) -> Option<LeaseBook> {
        let p = self.policies.get(policy)?;
        let st = self.store.global();
        st.slots.get(&p.layout.storage_key(key))?.book.clone()
    }

    fn books(&mut self, policy: &str) -> Vec<(String, LeaseBook)> {
        let Some(p) = self.policies.get(policy) else {
            return Vec::new();
        };
        let st = self.store.global();
        let Some(keys) = st.books.get(&p.global.keys.books) else {
            return Vec::new();
        };
        keys.iter()
            .filter_map(|k| {
                let book = st.slots.get(&p.layout.storage_key(k))?.book.clone()?;
                Some((k.clone(), book))
            })
            .collect()
    }

    fn take_active(&mut self, policy: &str) -> Vec<String> {
        let Some(p) = self.policies.get(policy) else {
            return Vec::new();
        };
        let now = self.store.now_us();
        let since = self
            .active_since
            .insert(policy.to_owned(), now)
            .unwrap_or(i64::MIN);
        let keep_us = p.global.shape.keep_ms * 1000;
        let mut st = self.store.global();
        let Some(active) = st.active.get_mut(&p.global.keys.active) else {
            return Vec::new();
        };
        active.retain(|_, t| *t > now - keep_us);
        active
            .iter()
            .filter(|(_, t)| **t >= since)
            .map(|(k, _)| k.clone())
            .collect()
    }

    fn counters(&mut self, policy: &str, key: &str) -> Counters {
        let Some(p) = self.policies.get(policy) else {
            return Counters::default();
        };
        let st = self.store.global();
        st.slots
            .get(&p.layout.storage_key(key))
            .map(|s: &KeySlot| s.counters)
            .unwrap_or_default()
    }

    fn default_escrow(&mut self, policy: &str) -> Option<f64> {
        let p = self.policies.get(policy)?;
        self.store
            .global()
            .defaults
            .get(&p.global.keys.meta)
            .map(|d| d.escrow)
    }

    fn set_default_escrow(&mut self, policy: &str, escrow: f64) -> bool {
        let Some(p) = self.policies.get(policy) else {
            return false;
        };
        let now = self.store.now_us();
        let mut st = self.store.global();
        st.defaults
            .entry(p.global.keys.meta.clone())
            .and_modify(|d| {
                d.change(escrow, now);
            })
            .or_insert(DefaultEscrow::new(escrow));
        true
    }
}
