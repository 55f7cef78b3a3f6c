//! The embedded store: the five algorithms of [`quotad_core::algorithm`] over an in-process map.
//!
//! It serves three purposes with one implementation: zero-setup mode (`redis = "memory"`,
//! and `quotad serve` without a config), the `local` fallback when Redis is unreachable,
//! and the reference model that the Lua scripts are tested against.
//!
//! State is sharded over several mutexes so concurrent requests for different keys rarely
//! contend; a critical section is one hash lookup and one pure function call, with no
//! await inside, so a std mutex is the right primitive. Expired entries are dropped when
//! touched and by [`MemoryStore::sweep`], which the app runs periodically.
//!
//! Bounded: at most `max_keys` keys (plain and global together). At the bound a check that
//! would create a key fails with [`Full`] and changes nothing: the limiter treats it like a
//! store that cannot answer, so the policy's `on_store_error` decides (for the `local`
//! fallback, which is this store already: `fail_open`), and it is counted as a store error
//! of kind `full`. Keys already held keep working; expired ones free their room at the
//! next sweep. Evicting instead would silently reset some other key's limit.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::layout::{GLOBAL_KEEP_MS, PolicyKeys, PolicyLayout, ScriptShape, ttl_ms};
use crate::store::call::{
    Ends, GlobalCall, KeyUsage, LeaseCall, SettleCall, SettleReply, StoreCall, UsageReply,
};
use quotad_core::algorithm::{self, Algorithm, Limits, Op, Part, State, Verdict, Write};
use quotad_core::clock::Clock;
use quotad_core::concurrency::{self, LeaseAnswer, LeaseWrite, Leases};
use quotad_core::coordinator::bucket::{DefaultEscrow, KeySlot, Shape};
use quotad_core::settlement::{self, Reservation, Settled};

const SHARDS: usize = 32;

struct Entry {
    state: State,
    expires_at_us: i64,
}

/// The store holds its maximum number of keys: a new one is refused, nothing changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the embedded store holds its maximum of {0} keys")]
pub(crate) struct Full(pub usize);

pub(crate) struct MemoryStore {
    shards: Vec<Mutex<HashMap<String, Entry>>>,
    /// Keys held (plain and global), and the bound on them.
    keys: AtomicUsize,
    max_keys: usize,
    hasher: RandomState,
    clock: Arc<dyn Clock>,
    /// Keys of global policies (zero-setup multi-region, `quotad demo` without Redis).
    global: Mutex<GlobalState>,
    /// Reservations awaiting their settlement, by reservation key, with their expiry (µs);
    /// each counts as a key against `max_keys`. Locked only while holding the shard of
    /// the key it charges (that order), so a settlement is atomic with its charge.
    /// Ordered: a reset ends the open reservations of its key, found by their common
    /// prefix (`PolicyLayout::reservation_key`).
    reservations: Mutex<BTreeMap<String, (Reservation, i64)>>,
    /// Concurrency limits' keys, by storage key, with their expiry (µs: the latest lease's
    /// end). One mutex: a lease operation is one short pure function call.
    leases: Mutex<HashMap<String, (Leases, i64)>>,
}

/// Global policies in the embedded store: what `lua/global/` keeps in Redis, under the same
/// key names, run through the same model ([`KeySlot`]). One mutex: global keys are the hot
/// few the coordinator trades, not the long tail.
#[derive(Default)]
pub(crate) struct GlobalState {
    pub(crate) slots: HashMap<String, KeySlot>,
    /// By meta key: the default escrow of keys without a book.
    pub(crate) defaults: HashMap<String, DefaultEscrow>,
    /// By active key: user key → store time of its last check.
    pub(crate) active: HashMap<String, HashMap<String, i64>>,
    /// By books key: keys with a book.
    pub(crate) books: HashMap<String, BTreeSet<String>>,
}

impl GlobalState {
    pub(crate) fn default_for(&self, keys: &PolicyKeys, shape: &ScriptShape) -> DefaultEscrow {
        self.defaults
            .get(&keys.meta)
            .copied()
            .unwrap_or(DefaultEscrow::new(shape.fallback_escrow))
    }
}

/// The model's numbers from a policy's script shape.
pub(crate) fn shape_of(s: &ScriptShape) -> Shape {
    Shape {
        rho: s.rho,
        burst: s.burst,
        step_tolerance: s.step_tolerance_us,
    }
}

/// A key's state unless it has expired (expired state reads as absent).
fn live<'m>(map: &'m HashMap<String, Entry>, key: &str, now: i64) -> Option<&'m State> {
    map.get(key)
        .filter(|e| e.expires_at_us > now)
        .map(|e| &e.state)
}

/// What a key reports without being charged (a peek: a cost-1 check that writes nothing).
fn peek(algorithm: Algorithm, limits: &Limits, state: Option<&State>, now: i64) -> Verdict {
    let check = Op::Check { cost: 0 };
    algorithm::apply(algorithm, limits, state, now, check, "").verdict
}

impl MemoryStore {
    pub(crate) fn new(clock: Arc<dyn Clock>, max_keys: usize) -> Self {
        MemoryStore {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            keys: AtomicUsize::new(0),
            max_keys,
            hasher: RandomState::new(),
            clock,
            global: Mutex::new(GlobalState::default()),
            reservations: Mutex::new(BTreeMap::new()),
            leases: Mutex::new(HashMap::new()),
        }
    }

    pub(crate) fn now_us(&self) -> i64 {
        self.clock.now_us()
    }

    /// The global keys, for the coordinator's store ([`crate::federation`]).
    pub(crate) fn global(&self) -> MutexGuard<'_, GlobalState> {
        self.global.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes room for one more key, or refuses at the bound (the coordinator's book
    /// writes on the embedded store call it for a key without a slot).
    pub(crate) fn reserve(&self) -> Result<(), Full> {
        self.reserve_n(1)
    }

    /// Room for `n` more keys, all or none.
    fn reserve_n(&self, n: usize) -> Result<(), Full> {
        if n == 0 {
            return Ok(());
        }
        let held = self.keys.fetch_add(n, Ordering::AcqRel);
        if held + n > self.max_keys {
            self.keys.fetch_sub(n, Ordering::AcqRel);
            return Err(Full(self.max_keys));
        }
        Ok(())
    }

    fn released(&self, n: usize) {
        if n > 0 {
            self.keys.fetch_sub(n, Ordering::AcqRel);
        }
    }

    /// One decision on a key of a global policy (what `lua/global/check.lua` does).
    pub(crate) fn apply_global(
        &self,
        call: &StoreCall<'_>,
        g: &GlobalCall<'_>,
    ) -> Result<Verdict, Full> {
        let now = self.clock.now_us();
        let mut st = self.global();
        let d = st.default_for(g.keys, &g.shape);
        if !st.slots.contains_key(call.key) {
            self.reserve()?;
        }
        let slot = st.slots.entry(call.key.to_owned()).or_default();
        let v = slot.decide(&d, &shape_of(&g.shape), now, call.op, g.limit);
        if let Op::Check { cost: 1.. } = call.op {
            st.active
                .entry(g.keys.active.clone())
                .or_default()
                .insert(g.user_key.to_owned(), now);
        }
        Ok(v)
    }

    fn shard(&self, key: &str) -> MutexGuard<'_, HashMap<String, Entry>> {
        self.lock_shard(self.shard_index(key))
    }

    fn shard_index(&self, key: &str) -> usize {
        (self.hasher.hash_one(key) as usize) % SHARDS
    }

    fn lock_shard(&self, i: usize) -> MutexGuard<'_, HashMap<String, Entry>> {
        // A poisoned shard only means another thread panicked mid-update of a plain map;
        // the map itself is still consistent (updates are single inserts/removes).
        self.shards[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn apply(&self, call: &StoreCall<'_>) -> Result<Verdict, Full> {
        let now = self.clock.now_us();
        let mut map = self.shard(call.key);
        let state = live(&map, call.key, now);
        let out = algorithm::on_periods(call.periods.as_ref(), now, |t| {
            algorithm::apply(call.algorithm, &call.limits, state, t, call.op, call.member)
        });
        if matches!(out.write, Write::Put { .. }) && !map.contains_key(call.key) {
            self.reserve_n(1)?;
        }
        self.write(&mut map, call.key, out.write, now);
        Ok(out.verdict)
    }

    /// What `call`'s key used and holds, read without a write ([`algorithm::usage`]; a
    /// global policy's key: `KeySlot::usage`).
    pub(crate) fn usage(&self, call: &StoreCall<'_>) -> UsageReply {
        let now = self.clock.now_us();
        let usage = match &call.global {
            Some(g) => {
                let st = self.global();
                let d = st.default_for(g.keys, &g.shape);
                let slot = st.slots.get(call.key).cloned().unwrap_or_default();
                KeyUsage::Region(slot.usage(&d, &shape_of(&g.shape), now, g.limit))
            }
            None => {
                let map = self.shard(call.key);
                let state = live(&map, call.key, now);
                let (periods, alg) = (call.periods.as_ref(), call.algorithm);
                KeyUsage::Local(algorithm::usage(periods, alg, &call.limits, state, now))
            }
        };
        UsageReply { usage, now_us: now }
    }

    /// Spends `cost` units whether or not the key has them ([`algorithm::charge`]): the
    /// key goes into debt where it lacks them. Never denied; `Ok` with a peek's verdict
    /// for an algorithm that cannot hold a debt (config validation keeps those out).
    pub(crate) fn charge(&self, call: &StoreCall<'_>, cost: u64) -> Result<Verdict, Full> {
        let now = self.clock.now_us();
        let mut map = self.shard(call.key);
        let state = live(&map, call.key, now);
        let periods = call.periods.as_ref();
        let Some(out) =
            algorithm::charge_on(periods, call.algorithm, &call.limits, state, now, cost)
        else {
            return Ok(peek(call.algorithm, &call.limits, state, now));
        };
        if matches!(out.write, Write::Put { .. }) && !map.contains_key(call.key) {
            self.reserve_n(1)?;
        }
        self.write(&mut map, call.key, out.write, now);
        Ok(out.verdict)
    }

    /// One operation on a concurrency limit's key (what `lua/concurrency.lua` does).
    pub(crate) fn lease(&self, call: &LeaseCall<'_>) -> Result<LeaseAnswer, Full> {
        let now = self.clock.now_us();
        let mut leases = self.leases();
        let held = leases
            .get(call.key)
            .filter(|(_, until)| *until > now)
            .map(|(l, _)| l);
        let out = concurrency::apply(call.limit, held, now, call.op);
        match out.write {
            LeaseWrite::Keep => {}
            LeaseWrite::Put { leases: l, ttl_us } => {
                if !leases.contains_key(call.key) {
                    self.reserve_n(1)?;
                }
                let until = now.saturating_add(ttl_ms(ttl_us).saturating_mul(1000));
                leases.insert(call.key.to_owned(), (l, until));
            }
            LeaseWrite::Delete => {
                if leases.remove(call.key).is_some() {
                    self.released(1);
                }
            }
        }
        Ok(out.answer)
    }

    fn leases(&self) -> MutexGuard<'_, HashMap<String, (Leases, i64)>> {
        self.leases.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn reservations(&self) -> MutexGuard<'_, BTreeMap<String, (Reservation, i64)>> {
        self.reservations.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A check of `estimate` that, admitted, opens the reservation (what `lua/settle.lua`
    /// does on `reserve`); room for the key and the reservation, or neither.
    pub(crate) fn reserve_units(
        &self,
        call: &SettleCall<'_>,
        estimate: u64,
    ) -> Result<Verdict, Full> {
        let now = self.clock.now_us();
        let mut map = self.shard(call.key);
        let state = live(&map, call.key, now);
        let Some((out, opened)) = settlement::reserve(
            call.algorithm,
            &call.limits,
            state,
            now,
            estimate,
            call.member,
            call.periods.as_ref(),
        ) else {
            return Ok(peek(
                call.algorithm,
                &call.limits,
                live(&map, call.key, now),
                now,
            ));
        };
        let new_key = matches!(out.write, Write::Put { .. }) && !map.contains_key(call.key);
        let mut reservations = self.reservations();
        let new_reservation = opened.is_some() && !reservations.contains_key(call.reservation);
        self.reserve_n(usize::from(new_key) + usize::from(new_reservation))?;
        self.write(&mut map, call.key, out.write, now);
        if let Some(r) = opened {
            let until = now.saturating_add(call.keep_ms.saturating_mul(1000));
            reservations.insert(call.reservation.to_owned(), (r, until));
        }
        Ok(out.verdict)
    }

    /// Settles a reservation at the real `cost` (what `lua/settle.lua` does on `settle`).
    /// Never refused for room: the reservation holds the room of the key it charges...
    /// unless that key had expired, when its debt needs a key again, taken past the
    /// bound rather than lost.
    pub(crate) fn settle(&self, call: &SettleCall<'_>, cost: u64) -> SettleReply {
        let now = self.clock.now_us();
        let mut map = self.shard(call.key);
        let mut reservations = self.reservations();
        let booked = reservations
            .get(call.reservation)
            .filter(|(_, until)| *until > now)
            .map(|(r, _)| *r);
        let state = live(&map, call.key, now);
        let Some(out) = settlement::settle(
            call.algorithm,
            &call.limits,
            state,
            booked.as_ref(),
            None,
            now,
            cost,
            call.member,
            call.periods.as_ref(),
        ) else {
            let v = peek(call.algorithm, &call.limits, live(&map, call.key, now), now);
            return SettleReply {
                settled: Settled::Unknown,
                remaining: v.remaining,
                reset_after_us: v.reset_after_us,
            };
        };
        if matches!(out.write, Write::Put { .. }) && !map.contains_key(call.key) {
            self.keys.fetch_add(1, Ordering::AcqRel);
        }
        self.write(&mut map, call.key, out.write, now);
        if let Some(r) = out.reservation {
            let until = now.saturating_add(call.keep_ms.saturating_mul(1000));
            reservations.insert(call.reservation.to_owned(), (r, until));
        }
        SettleReply {
            settled: out.settled,
            remaining: out.verdict.remaining,
            reset_after_us: out.verdict.reset_after_us,
        }
    }

    /// An all-or-nothing batch (a co-location group; see [`algorithm::apply_all`]): the
    /// shards of every key are held together, in index order, so no other call sees a
    /// partial charge. The keys are distinct (the API refuses a key twice in a group).
    pub(crate) fn apply_all(
        &self,
        calls: &[StoreCall<'_>],
        enforced: &[bool],
    ) -> Result<Vec<Verdict>, Full> {
        let now = self.clock.now_us();
        let shard_of: Vec<usize> = calls.iter().map(|c| self.shard_index(c.key)).collect();
        let mut order = shard_of.clone();
        order.sort_unstable();
        order.dedup();
        let mut maps: HashMap<usize, MutexGuard<'_, HashMap<String, Entry>>> =
            order.into_iter().map(|i| (i, self.lock_shard(i))).collect();
        let (verdicts, writes) = {
            let parts: Vec<Part<'_>> = calls
                .iter()
                .zip(&shard_of)
                .zip(enforced)
                .map(|((c, i), &enforced)| Part {
                    algorithm: c.algorithm,
                    limits: c.limits,
                    state: live(&maps[i], c.key, now),
                    cost: match c.op {
                        Op::Check { cost } => cost,
                        Op::Refund { .. } => 0,
                    },
                    member: c.member,
                    enforced,
                    periods: c.periods.as_ref(),
                })
                .collect();
            algorithm::apply_all(&parts, now)
        };
        if let Some(writes) = writes {
            let new = calls
                .iter()
                .zip(&shard_of)
                .zip(&writes)
                .filter(|((c, i), w)| {
                    matches!(w, Write::Put { .. }) && !maps[i].contains_key(c.key)
                })
                .count();
            self.reserve_n(new)?;
            for ((c, i), w) in calls.iter().zip(&shard_of).zip(writes) {
                if let Some(map) = maps.get_mut(i) {
                    self.write(map, c.key, w, now);
                }
            }
        }
        Ok(verdicts)
    }

    /// Applies one write (room for a new key already reserved).
    fn write(&self, map: &mut HashMap<String, Entry>, key: &str, write: Write, now: i64) {
        match write {
            Write::Keep => {}
            Write::Put { state, ttl_us } => {
                let expires_at_us = now.saturating_add(ttl_ms(ttl_us).saturating_mul(1000));
                map.insert(
                    key.to_owned(),
                    Entry {
                        state,
                        expires_at_us,
                    },
                );
            }
            Write::Delete => {
                if map.remove(key).is_some() {
                    self.released(1);
                }
            }
        }
    }

    /// Forgets what `key`'s user spent: the key (a local policy's), or a global key's
    /// bucket only (its book and counters are the coordinator's).
    pub(crate) fn reset(
        &self,
        key: &str,
        forget: crate::store::call::Forget,
        ends: Option<Ends<'_>>,
    ) {
        if ends.is_some() {
            // The reservations open on the key end with it (as the reset mark ends them in
            // Redis: `lua/settle.lua`).
            let prefix = PolicyLayout::reservation_key_prefix(key);
            let mut reservations = self.reservations();
            for (_, (r, _)) in reservations
                .range_mut(prefix.clone()..)
                .take_while(|(k, _)| k.starts_with(&prefix))
            {
                if let Reservation::Open { .. } = r {
                    *r = Reservation::Ended;
                }
            }
        }
        match forget {
            crate::store::call::Forget::All => self.delete(key),
            crate::store::call::Forget::Spent => {
                if let Some(slot) = self.global().slots.get_mut(key) {
                    slot.bucket = None;
                }
            }
        }
    }

    pub(crate) fn delete(&self, key: &str) {
        if self.shard(key).remove(key).is_some() {
            self.released(1);
        }
    }

    /// Drops every expired entry. O(keys); run it from a background task.
    pub(crate) fn sweep(&self) -> usize {
        let now = self.clock.now_us();
        let mut dropped = self.sweep_global(now);
        {
            let mut reservations = self.reservations();
            let before = reservations.len();
            reservations.retain(|_, (_, until)| *until > now);
            dropped += before - reservations.len();
        }
        {
            let mut leases = self.leases();
            let before = leases.len();
            leases.retain(|_, (_, until)| *until > now);
            dropped += before - leases.len();
        }
        for shard in &self.shards {
            let mut map = shard.lock().unwrap_or_else(|p| p.into_inner());
            let before = map.len();
            map.retain(|_, e| e.expires_at_us > now);
            dropped += before - map.len();
        }
        self.released(dropped);
        dropped
    }

    /// Global keys idle for [`GLOBAL_KEEP_MS`] go, as their Redis keys expire: the last
    /// write of the bucket and the book's high-water mark are both that old, so no lease
    /// in the book still counts (leases are far shorter).
    fn sweep_global(&self, now: i64) -> usize {
        let horizon = now - GLOBAL_KEEP_MS * 1000;
        let mut st = self.global();
        let before = st.slots.len();
        st.slots.retain(|_, slot| {
            let written = match slot.bucket {
                Some(State::Bucket { ts, .. }) => ts,
                _ => i64::MIN,
            };
            let seen = slot.book.as_ref().map_or(i64::MIN, |b| b.high_water);
            written.max(seen) > horizon
        });
        for active in st.active.values_mut() {
            active.retain(|_, t| *t > horizon);
        }
        // (The books index may keep names of swept keys: readers skip keys without a slot.)
        before - st.slots.len()
    }

    /// Keys held, plain and global (expired ones until the next sweep).
    pub(crate) fn len(&self) -> usize {
        self.keys.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::TTL_GRACE_MS;
    use quotad_core::algorithm::{Algorithm, Limits, Op};
    use quotad_core::clock::ManualClock;

    /// A reservation is a key against the bound, read as absent once it expires, and
    /// swept; at the bound a reserving check that would add one is refused whole.
    #[test]
    fn reservations_count_against_the_bound_expire_and_sweep() {
        let clock = Arc::new(ManualClock::new(1_000_000_000));
        let store = MemoryStore::new(clock.clone(), 3);
        let call = |key: &'static str, reservation: &'static str| SettleCall {
            algorithm: Algorithm::TokenBucket,
            limits: Limits {
                limit: 10,
                window_us: 1_000_000,
                burst: 10,
                since: quotad_core::algorithm::Since::ZERO,
            },
            key,
            reservation,
            reset_mark: "",
            keep_ms: 1_000,
            member: "",
            periods: None,
        };
        assert!(store.reserve_units(&call("k", "k:r:1"), 2).unwrap().allowed);
        assert_eq!(store.len(), 2, "the key and its reservation");
        // One room left: a new key with its reservation needs two.
        assert_eq!(store.reserve_units(&call("j", "j:r:1"), 2), Err(Full(3)));
        assert_eq!(store.len(), 2, "nothing taken");
        let settled = store.settle(&call("k", "k:r:1"), 5);
        assert_eq!(
            settled.settled,
            Settled::Now {
                charged: 3,
                refunded: 0
            }
        );
        clock.advance(1_000_001);
        assert_eq!(
            store.settle(&call("k", "k:r:1"), 5).settled,
            Settled::Unknown
        );
        store.sweep();
        assert_eq!(
            store.len(),
            1,
            "the reservation swept; the key in debt kept"
        );
    }

    #[test]
    fn expired_state_reads_as_absent_and_sweeps() {
        let clock = Arc::new(ManualClock::new(1_000_000_000));
        let store = MemoryStore::new(clock.clone(), 1000);
        let call = StoreCall {
            algorithm: Algorithm::FixedWindow,
            limits: Limits {
                limit: 1,
                window_us: 1_000_000,
                burst: 1,
                since: quotad_core::algorithm::Since::ZERO,
            },
            key: "k",
            op: Op::Check { cost: 1 },
            member: "m",
            global: None,
            periods: None,
        };
        assert!(store.apply(&call).unwrap().allowed);
        assert!(!store.apply(&call).unwrap().allowed);
        assert_eq!(store.len(), 1);
        clock.advance(1_000_000 + TTL_GRACE_MS * 1000 + 1000);
        assert_eq!(store.sweep(), 1);
        assert_eq!(store.len(), 0);
        assert!(store.apply(&call).unwrap().allowed);
    }

    #[test]
    fn at_the_bound_a_new_key_is_refused_and_held_keys_keep_working() {
        let clock = Arc::new(ManualClock::new(1_000_000_000));
        let store = MemoryStore::new(clock.clone(), 3);
        let call = |key: &'static str, op: Op| StoreCall {
            algorithm: Algorithm::SlidingLog,
            limits: Limits {
                limit: 2,
                window_us: 1_000_000,
                burst: 2,
                since: quotad_core::algorithm::Since::ZERO,
            },
            key,
            op,
            member: "m",
            global: None,
            periods: None,
        };
        for k in ["a", "b", "c"] {
            assert!(
                store
                    .apply(&call(k, Op::Check { cost: 1 }))
                    .unwrap()
                    .allowed
            );
        }
        assert_eq!(store.apply(&call("d", Op::Check { cost: 1 })), Err(Full(3)));
        // A peek on a new key writes nothing, so it is answered.
        assert!(
            store
                .apply(&call("d", Op::Check { cost: 0 }))
                .unwrap()
                .allowed
        );
        assert!(
            store
                .apply(&call("a", Op::Check { cost: 1 }))
                .unwrap()
                .allowed
        );
        assert!(
            !store
                .apply(&call("a", Op::Check { cost: 1 }))
                .unwrap()
                .allowed
        );
        assert_eq!(store.len(), 3);
        store.delete("b");
        assert!(
            store
                .apply(&call("d", Op::Check { cost: 1 }))
                .unwrap()
                .allowed
        );
        assert_eq!(store.apply(&call("e", Op::Check { cost: 1 })), Err(Full(3)));
        clock.advance(3_000_000);
        assert_eq!(store.sweep(), 3);
        assert!(
            store
                .apply(&call("e", Op::Check { cost: 1 }))
                .unwrap()
                .allowed
        );
    }

    /// A global policy's keys (10/s, burst 10, fallback escrow 5) and a cost-5 check of
    /// user key `k` stored at `key`.
    fn global_check<'a>(keys: &'a PolicyKeys, key: &'a str) -> StoreCall<'a> {
        let global = GlobalCall {
            user_key: "k",
            keys,
            shape: ScriptShape {
                rho: 10.0,
                burst: 10.0,
                step_tolerance_us: 50_000,
                fallback_escrow: 5.0,
                keep_ms: GLOBAL_KEEP_MS,
            },
            limit: None,
        };
        StoreCall {
            algorithm: Algorithm::TokenBucket,
            limits: Limits {
                limit: 10,
                window_us: 1_000_000,
                burst: 10,
                since: quotad_core::algorithm::Since::ZERO,
            },
            key,
            op: Op::Check { cost: 5 },
            member: "",
            global: Some(global),
            periods: None,
        }
    }

    fn policy_keys() -> PolicyKeys {
        PolicyKeys {
            meta: "rl:g:g:meta".into(),
            active: "rl:g:g:active".into(),
            books: "rl:g:g:books".into(),
            fence: "rl:g:g:fence".into(),
            replid: "rl:g:g:replid".into(),
        }
    }

    #[test]
    fn a_reset_of_a_global_key_forgets_its_bucket_and_keeps_its_book() {
        use quotad_core::coordinator::lease::LeaseBook;
        let clock = Arc::new(ManualClock::new(1_000_000_000));
        let store = MemoryStore::new(clock.clone(), 1000);
        let keys = policy_keys();
        let call = global_check(&keys, "g:{k}");
        let global = call.global.unwrap();
        assert!(store.apply_global(&call, &global).unwrap().allowed);
        assert!(
            !store.apply_global(&call, &global).unwrap().allowed,
            "spent"
        );
        let book = LeaseBook::new(3.0);
        store.global().slots.get_mut("g:{k}").unwrap().book = Some(book.clone());
        store.reset("g:{k}", crate::store::call::Forget::Spent, None);
        let slot = store.global().slots.get("g:{k}").cloned().unwrap();
        assert_eq!(slot.book, Some(book), "the coordinator's book stays");
        assert!(slot.bucket.is_none(), "what the user spent is forgotten");
        assert_eq!(
            slot.counters.admitted, 5,
            "and the offered load with it stays"
        );
    }

    #[test]
    fn idle_global_keys_are_swept_like_their_redis_keys_expire() {
        let clock = Arc::new(ManualClock::new(1_000_000_000));
        let store = MemoryStore::new(clock.clone(), 1000);
        let keys = policy_keys();
        let call = global_check(&keys, "rl:g:g:{k}");
        let global = call.global.unwrap();
        assert!(
            store.apply_global(&call, &global).unwrap().allowed,
            "5 of the escrow's 5"
        );
        assert!(!store.apply_global(&call, &global).unwrap().allowed);
        clock.advance(GLOBAL_KEEP_MS * 1000 - 1);
        assert_eq!(store.sweep(), 0, "not idle for the keep time yet");
        assert_eq!(store.global().slots.len(), 1);
        clock.advance(2);
        assert_eq!(store.sweep(), 1);
        assert!(store.global().slots.is_empty());
        assert!(store.global().active.values().all(|a| a.is_empty()));
    }
}
