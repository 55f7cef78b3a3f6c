//! Where limiter state lives: a Redis server (one Lua script per decision) or the embedded
//! in-process map (the same algorithms in Rust).
//!
//! This module owns the storage boundary: the call shape, the error enum, and dispatch to
//! a backend. It knows nothing of policies, fail modes or HTTP; the limiter decides what an
//! error means for a request.

mod call;
pub mod memory;
pub mod redis;

pub use call::{
    Ends, Forget, GlobalCall, LeaseCall, SettleCall, SettleReply, StoreCall, StoreError,
};
pub use redis::admission::Shed;
pub use redis::hot::Mark as SliceMark;

use std::time::Instant;

use quotad_core::algorithm::{Algorithm, Verdict};
use quotad_core::concurrency::LeaseAnswer;
use redis::{admission, hot};

/// Whether keys of `algorithm` can take hot-key slices (fixed windows, token buckets and
/// GCRA; see [`hot`]).
pub fn takes_slices(algorithm: Algorithm) -> bool {
    hot::Taker::of(algorithm).is_some()
}

/// Leave to call the store, from [`Store::admit`]: Redis admission's permits for the
/// calls a request makes (none in memory, with the breaker open, or for no call). Every
/// call on the [`Store`] takes one by reference, so a call cannot be made without
/// admission; the permits go back when it is dropped.
pub struct Permit<'a> {
    _held: Option<admission::Admitted<'a>>,
}

impl Permit<'_> {
    /// For quotad's own background reads, bounded by the task that makes them (the lease
    /// reaper's reads of ended leases), never for a request.
    pub(crate) fn background() -> Permit<'static> {
        Permit { _held: None }
    }
}

/// The configured backend. An enum rather than a trait object: there are exactly two, and
/// static dispatch keeps the request path free of boxing.
pub enum Store {
    Redis(std::sync::Arc<redis::RedisStore>),
    Memory(std::sync::Arc<memory::MemoryStore>),
}

impl Store {
    /// Admission for a request that will make `calls` store calls: Redis permits (see
    /// [`admission`]), or nothing to wait for in memory or for no call. Every call below
    /// takes the [`Permit`], so none can skip admission; hold it until the calls, refunds
    /// included, are done.
    pub async fn admit(&self, calls: usize) -> Result<Permit<'_>, admission::Shed> {
        let held = match self {
            Store::Redis(r) if calls > 0 => r.admit(calls).await?,
            _ => None,
        };
        Ok(Permit { _held: held })
    }

    /// A denial of this call remembered from the store and still in force: answering it
    /// costs no Redis call (see [`deny_cache`]). Never for the embedded store.
    pub fn cached_denial(&self, call: &StoreCall<'_>) -> Option<Verdict> {
        match self {
            Store::Redis(r) => r.cached_denial(call),
            Store::Memory(_) => None,
        }
    }

    /// Spends `cost` from this instance's slice of a hot key when it holds enough (see
    /// [`hot`]): no Redis call and no permit. Redis only (the embedded store is in memory
    /// already). With the verdict, the slice a refund gives the units back to.
    pub fn spend_from_slice(
        &self,
        call: &StoreCall<'_>,
        cost: u64,
    ) -> Option<(Verdict, SliceMark)> {
        match self {
            Store::Redis(r) => r
                .hot()
                .spend_from(call.key, call.limits, cost, Instant::now()),
            Store::Memory(_) => None,
        }
    }

    /// A check of `cost`; one that may take part in hot-key slices (`hot_rate`: its
    /// policy's `hot_key_rate`) counts towards its key's heat and, the key hot, is decided
    /// through a slice (see [`hot`]). With the verdict, the slice its units came from.
    pub async fn decide(
        &self,
        permit: &Permit<'_>,
        call: &StoreCall<'_>,
        cost: u64,
        hot_rate: Option<u64>,
    ) -> Result<(Verdict, Option<SliceMark>), StoreError> {
        let hot = match (self, hot_rate) {
            (Store::Redis(r), Some(rate)) => r.heat(call.key, rate),
            _ => false,
        };
        if hot {
            self.apply_hot(permit, call, cost).await
        } else {
            self.apply(permit, call).await.map(|v| (v, None))
        }
    }

    /// Gives back `cost` units a hot key's slice `mark` spent (see
    /// [`redis::RedisStore::refund_spent`]); slices are Redis's only.
    pub async fn refund_spent(
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

    pub async fn apply(
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

    /// Spends `cost` units whether or not the key has them (a cost counted after the
    /// work: debt where it lacks them). Never denied. Local policies that can hold a debt.
    pub async fn charge(
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
    pub async fn reserve(
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
    pub async fn settle(
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
    pub async fn lease(
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
    pub async fn apply_all(
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
    pub async fn reset(
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

    /// Whether the store can take decisions now (readiness).
    pub fn is_ready(&self) -> bool {
        match self {
            Store::Redis(r) => r.is_ready(),
            Store::Memory(_) => true,
        }
    }

    /// The embedded store, when that is the backend.
    pub fn memory(&self) -> Option<std::sync::Arc<memory::MemoryStore>> {
        match self {
            Store::Memory(m) => Some(m.clone()),
            Store::Redis(_) => None,
        }
    }

    pub fn describe(&self) -> &'static str {
        match self {
            Store::Redis(_) => "redis",
            Store::Memory(_) => "memory",
        }
    }
}
