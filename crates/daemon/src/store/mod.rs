//! Where limiter state lives: a Redis server (one Lua script per decision) or the embedded
//! in-process map (the same algorithms in Rust).
//!
//! This module owns the storage boundary: the call shape, the error enum, and dispatch to
//! a backend. It knows nothing of policies, fail modes or HTTP; the limiter decides what an
//! error means for a request.

mod call;
pub(crate) mod memory;
// The Redis backend is the store's own: the rest of the daemon gets what it needs of it
// from the re-exports below. Only the tests' doors (src/testing.rs) see into it.
#[cfg(not(feature = "testing"))]
mod redis;
#[cfg(feature = "testing")]
pub(crate) mod redis;

pub(crate) use call::{
    Ends, Forget, GlobalCall, KeyUsage, LeaseCall, SettleCall, SettleReply, StoreCall, StoreError,
    UsageReply,
};
pub(crate) use redis::admission::Shed;
pub(crate) use redis::hot::Mark as SliceMark;
// The backend's settings (config), the client and its janitor (app), the coordinator's
// connection and scripts (federation), and the script a `quotad script` prints.
pub(crate) use redis::admission::AdmissionSettings;
pub(crate) use redis::connect::{SharedTarget, SyncConn, Target, TlsFiles, Topology};
pub(crate) use redis::global::push_now;
pub(crate) use redis::scripts::Global as GlobalScript;
pub use redis::scripts::source as script_source;
pub(crate) use redis::{RedisSettings, RedisStore, janitor};

use std::time::Instant;

use crate::layout::RuntimeLimitKeys;
use crate::runtime_limits::{Entry, RuntimeLimits, RuntimeWrite, RuntimeWritten, Slot};

use quotad_core::algorithm::{Algorithm, Op, Verdict};
use quotad_core::concurrency::LeaseAnswer;
use redis::{admission, hot};

/// Whether keys of `algorithm` can take hot-key slices (fixed windows, token buckets and
/// GCRA; see [`hot`]).
pub(crate) fn takes_slices(algorithm: Algorithm) -> bool {
    hot::Taker::of(algorithm).is_some()
}

/// Leave to call the store, from [`Store::admit`]: Redis admission's permits for the
/// calls a request makes (none in memory, with the breaker open, or for no call). Every
/// call on the [`Store`] takes one by reference, so a call cannot be made without
/// admission; the permits go back when it is dropped.
pub(crate) struct Permit<'a> {
    _held: Option<admission::Admitted<'a>>,
}

impl Permit<'_> {
    /// For quotad's own background reads, bounded by the task that makes them (the lease
    /// reaper's reads of ended leases), never for a request.
    pub(crate) fn background() -> Permit<'static> {
        Permit { _held: None }
    }
}

/// A check's answer from the store.
#[derive(Debug)]
pub(crate) enum Checked {
    /// The store's verdict, and where it came from.
    Decided(Verdict, Source),
    /// No decision: the store failed (the policy's `on_store_error` answers).
    Failed(StoreError),
}

/// Where a check's verdict came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// Spent from this instance's slice of a hot key, in memory: no store call.
    Slice(SliceMark),
    /// A denial the store gave the key that still holds: no store call.
    Remembered,
    /// A store call; for a hot key, the slice its units came from (a refund goes back
    /// to it).
    Call(Option<SliceMark>),
}

/// The units a check asks for (0 for any other operation).
fn checked_cost(call: &StoreCall<'_>) -> u64 {
    match call.op {
        Op::Check { cost } => cost,
        _ => 0,
    }
}

/// The configured backend. An enum rather than a trait object: there are exactly two, and
/// static dispatch keeps the request path free of boxing.
pub(crate) enum Store {
    Redis(std::sync::Arc<redis::RedisStore>),
    Memory(std::sync::Arc<memory::MemoryStore>),
}

impl Store {
    /// Admission for a request that will make `calls` store calls: Redis permits (see
    /// [`admission`]), or nothing to wait for in memory or for no call. Every call below
    /// takes the [`Permit`], so none can skip admission; hold it until the calls, refunds
    /// included, are done.
    pub(crate) async fn admit(&self, calls: usize) -> Result<Permit<'_>, admission::Shed> {
        let held = match self {
            Store::Redis(r) if calls > 0 => r.admit(calls).await?,
            _ => None,
        };
        Ok(Permit { _held: held })
    }

    /// Decides one check (`call.op` is a check): from memory when it can (a hot key's
    /// slice, then a remembered denial: no Redis call and no permit), else under a permit
    /// taken and given back here. `hot_rate` (the policy's `hot_key_rate`, for a check
    /// that may take part in hot-key slices) counts the check towards its key's heat.
    pub(crate) async fn check(
        &self,
        call: &StoreCall<'_>,
        hot_rate: Option<u64>,
    ) -> Result<Checked, admission::Shed> {
        if let Some(known) = self.answer_in_memory(call, hot_rate) {
            return Ok(known);
        }
        let permit = self.admit(1).await?;
        Ok(self.decide(&permit, call, hot_rate).await)
    }

    /// Decides a batch of checks, each as [`Store::check`] would, concurrently; one
    /// permit per store call the batch makes. The permit comes back with the answers, for
    /// the refunds of a denied batch.
    pub(crate) async fn check_each<'s>(
        &'s self,
        calls: &[(StoreCall<'_>, Option<u64>)],
    ) -> Result<(Vec<Checked>, Permit<'s>), admission::Shed> {
        let known: Vec<Option<Checked>> = calls
            .iter()
            .map(|(call, hot_rate)| self.answer_in_memory(call, *hot_rate))
            .collect();
        let asked = known.iter().filter(|k| k.is_none()).count();
        let permit = self.admit(asked).await?;
        let held = &permit;
        let answers = futures_util::future::join_all(calls.iter().zip(known).map(
            |((call, hot_rate), known)| async move {
                match known {
                    Some(answer) => answer,
                    None => self.decide(held, call, *hot_rate).await,
                }
            },
        ))
        .await;
        Ok((answers, permit))
    }

    /// An answer without a Redis call or a permit (Redis only; the embedded store is in
    /// memory already). The slice first: units this instance holds were taken for it in
    /// Redis and are its to spend whatever it was denied since (a hot key's usual case:
    /// one lookup); then a denial the store gave this key that still holds (see
    /// [`redis::deny_cache`]).
    fn answer_in_memory(&self, call: &StoreCall<'_>, hot_rate: Option<u64>) -> Option<Checked> {
        let Store::Redis(r) = self else {
            return None;
        };
        let cost = checked_cost(call);
        if hot_rate.is_some()
            && let Some((v, mark)) = r
                .hot()
                .spend_from(call.key, call.limits, cost, Instant::now())
        {
            return Some(Checked::Decided(v, Source::Slice(mark)));
        }
        r.cached_denial(call)
            .map(|v| Checked::Decided(v, Source::Remembered))
    }

    /// A store call for a check; one that may take part in hot-key slices (`hot_rate`)
    /// counts towards its key's heat and, the key hot, is decided through a slice (see
    /// [`hot`]).
    async fn decide(
        &self,
        permit: &Permit<'_>,
        call: &StoreCall<'_>,
        hot_rate: Option<u64>,
    ) -> Checked {
        let hot = match (self, hot_rate) {
            (Store::Redis(r), Some(rate)) => r.heat(call.key, rate),
            _ => false,
        };
        let answer = if hot {
            self.apply_hot(permit, call, checked_cost(call)).await
        } else {
            self.apply(permit, call).await.map(|v| (v, None))
        };
        match answer {
            Ok((v, slice)) => Checked::Decided(v, Source::Call(slice)),
            Err(e) => Checked::Failed(e),
        }
    }

    /// Gives back `cost` units a hot key's slice `mark` spent (see
    /// [`redis::RedisStore::refund_spent`]); slices are Redis's only.
    pub(crate) async fn refund_spent(
        &self,
        _permit: &Permit<'_>,
        call: &StoreCall<'_>,
        mark: hot::Mark,
        cost: u64,
    ) -> Result<(), StoreError> {
        match self {
            Store::Redis(r) => r.refund_spent(call, mark, cost).await,
            Store::Memory(_) => self.apply(_permit, call).await.map(|_| ()),
        }
    }

    /// A check of a hot key that its slice could not answer (see [`hot`]), with the
    /// slice its units came from; `apply` on the embedded store, and for an algorithm
    /// that takes no slices.
    async fn apply_hot(
        &self,
        _permit: &Permit<'_>,
        call: &StoreCall<'_>,
        cost: u64,
    ) -> Result<(Verdict, Option<hot::Mark>), StoreError> {
        match (self, hot::Taker::of(call.algorithm)) {
            (Store::Redis(r), Some(taker)) => r.apply_hot(call, taker, cost).await,
            _ => self.apply(_permit, call).await.map(|v| (v, None)),
        }
    }

    pub(crate) async fn apply(
        &self,
        _permit: &Permit<'_>,
        call: &StoreCall<'_>,
    ) -> Result<Verdict, StoreError> {
        match self {
            Store::Redis(r) => r.apply(call).await,
            Store::Memory(m) => match &call.global {
                Some(g) => m.apply_global(call, g),
                None => m.apply(call),
            }
            .map_err(|e| StoreError::Full(e.0)),
        }
    }

    /// What `call`'s key used and holds, read in the store without a write (never from
    /// a slice or a remembered denial: the store's own count).
    pub(crate) async fn usage(
        &self,
        _permit: &Permit<'_>,
        call: &StoreCall<'_>,
    ) -> Result<UsageReply, StoreError> {
        match self {
            Store::Redis(r) => r.usage(call).await,
            Store::Memory(m) => Ok(m.usage(call)),
        }
    }

    /// Spends `cost` units whether or not the key has them (a cost counted after the
    /// work: debt where it lacks them). Never denied. Local policies that can hold a debt.
    pub(crate) async fn charge(
        &self,
        _permit: &Permit<'_>,
        call: &StoreCall<'_>,
        cost: u64,
    ) -> Result<Verdict, StoreError> {
        match self {
            Store::Redis(r) => r.charge(call, cost).await,
            Store::Memory(m) => m.charge(call, cost).map_err(|e| StoreError::Full(e.0)),
        }
    }

    /// A check of `estimate` units that, admitted, opens the reservation.
    pub(crate) async fn reserve(
        &self,
        _permit: &Permit<'_>,
        call: &SettleCall<'_>,
        estimate: u64,
    ) -> Result<Verdict, StoreError> {
        match self {
            Store::Redis(r) => r.reserve(call, estimate).await,
            Store::Memory(m) => m
                .reserve_units(call, estimate)
                .map_err(|e| StoreError::Full(e.0)),
        }
    }

    /// Settles a reservation at the real `cost`: the difference charged (as debt where
    /// the key lacks it) or given back; once.
    pub(crate) async fn settle(
        &self,
        _permit: &Permit<'_>,
        call: &SettleCall<'_>,
        cost: u64,
    ) -> Result<SettleReply, StoreError> {
        match self {
            Store::Redis(r) => r.settle(call, cost).await,
            Store::Memory(m) => Ok(m.settle(call, cost)),
        }
    }

    /// One operation on a concurrency limit's key: acquire, release, extend or peek.
    pub(crate) async fn lease(
        &self,
        _permit: &Permit<'_>,
        call: &LeaseCall<'_>,
    ) -> Result<LeaseAnswer, StoreError> {
        match self {
            Store::Redis(r) => r.lease(call).await,
            Store::Memory(m) => m.lease(call).map_err(|e| StoreError::Full(e.0)),
        }
    }

    /// An all-or-nothing batch of checks whose keys share a hash slot (a co-location
    /// group): one script on Redis, the shards held together in memory. Nothing is charged
    /// unless every `enforced` check is allowed ([`quotad_core::algorithm::apply_all`]).
    /// Never for keys of global policies.
    pub(crate) async fn apply_all(
        &self,
        _permit: &Permit<'_>,
        calls: &[StoreCall<'_>],
        enforced: &[bool],
    ) -> Result<Vec<Verdict>, StoreError> {
        match self {
            Store::Redis(r) => r.apply_all(calls, enforced).await,
            Store::Memory(m) => m
                .apply_all(calls, enforced)
                .map_err(|e| StoreError::Full(e.0)),
        }
    }

    /// Forgets what a key's user spent, ends what `ends` names, and (Redis) tells every
    /// instance in the same script, so no remembered denial outlives a reset reported
    /// done.
    pub(crate) async fn reset(
        &self,
        _permit: &Permit<'_>,
        key: &str,
        forget: Forget,
        ends: Option<Ends<'_>>,
    ) -> Result<(), StoreError> {
        match self {
            Store::Redis(r) => r.reset(key, forget, ends).await,
            Store::Memory(m) => {
                m.reset(key, forget, ends);
                Ok(())
            }
        }
    }

    /// A change of a policy's runtime limits: in Redis (and from there to every
    /// instance), or on the embedded store in `runtime`, this instance's copy, which is
    /// then the store.
    pub(crate) async fn runtime_write(
        &self,
        _permit: &Permit<'_>,
        runtime: &RuntimeLimits,
        keys: &RuntimeLimitKeys,
        write: &RuntimeWrite<'_>,
    ) -> Result<RuntimeWritten, StoreError> {
        match self {
            Store::Redis(r) => r.runtime_write(keys, write).await,
            Store::Memory(_) => Ok(runtime.write_local(&keys.policy, write)),
        }
    }

    /// `key`'s runtime limit in `keys`' policy as the store has it now (an expired one
    /// reads as none).
    pub(crate) async fn runtime_get(
        &self,
        _permit: &Permit<'_>,
        runtime: &RuntimeLimits,
        keys: &RuntimeLimitKeys,
        key: &str,
    ) -> Result<Option<Entry>, StoreError> {
        let entry = match self {
            Store::Redis(r) => r.runtime_get(keys, key).await?,
            Store::Memory(_) => match runtime.of(&keys.policy).get(key) {
                Some(Slot::Set(e)) => Some(e),
                _ => None,
            },
        };
        Ok(entry.filter(|e| e.live_at(crate::runtime_limits::now_ms())))
    }

    /// A page of `keys`' policy's runtime limits from `cursor` (0: the first): the next
    /// cursor (0: the last page) and up to about `count` entries (expired ones left out).
    /// Redis's cursor is HSCAN's: a key set while paging may be listed twice or not at all.
    pub(crate) async fn runtime_page(
        &self,
        _permit: &Permit<'_>,
        runtime: &RuntimeLimits,
        keys: &RuntimeLimitKeys,
        cursor: u64,
        count: usize,
    ) -> Result<(u64, Vec<(String, Entry)>), StoreError> {
        let now = crate::runtime_limits::now_ms();
        let (next, mut page) = match self {
            Store::Redis(r) => r.runtime_page(keys, cursor, count).await?,
            Store::Memory(_) => runtime.of(&keys.policy).page(cursor, count),
        };
        page.retain(|(_, e)| e.live_at(now));
        Ok((next, page))
    }

    /// The changes of `keys`' policy's runtime limits after version `after` (at most
    /// `count`) and the set's version: what a peer region pulls. The embedded store
    /// spreads nothing (the config refuses runtime limits of global policies on it).
    pub(crate) async fn runtime_changes(
        &self,
        _permit: &Permit<'_>,
        keys: &RuntimeLimitKeys,
        after: u64,
        count: usize,
    ) -> Result<(u64, Vec<crate::runtime_limits::PeerChange>), StoreError> {
        match self {
            Store::Redis(r) => r.runtime_changes(keys, after, count).await,
            Store::Memory(_) => Ok((0, Vec::new())),
        }
    }

    /// Whether the store can take decisions now (readiness).
    pub(crate) fn is_ready(&self) -> bool {
        match self {
            Store::Redis(r) => r.is_ready(),
            Store::Memory(_) => true,
        }
    }

    /// The embedded store, when that is the backend.
    pub(crate) fn memory(&self) -> Option<std::sync::Arc<memory::MemoryStore>> {
        match self {
            Store::Memory(m) => Some(m.clone()),
            Store::Redis(_) => None,
        }
    }

    pub(crate) fn describe(&self) -> &'static str {
        match self {
            Store::Redis(_) => "redis",
            Store::Memory(_) => "memory",
        }
    }
}
