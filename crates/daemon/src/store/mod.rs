//! Where limiter state lives: a Redis server (one Lua script per decision) or the embedded
//! in-process map (the same algorithms in Rust).
//!
//! This module owns the storage boundary: the call shape, the error enum, and dispatch to
//! a backend. It knows nothing of policies, fail modes or HTTP; the limiter decides what an
//! error means for a request.

pub mod admission;
pub mod breaker;
pub mod cluster;
pub mod coalesce;
pub mod connect;
pub mod deadline;
pub mod deny_cache;
pub mod global;
pub mod hot;
pub mod janitor;
pub mod memory;
pub mod redis;
pub mod scripts;

use crate::layout;
use quotad_core::algorithm::{Algorithm, Limits, Op, Verdict};
use quotad_core::concurrency::{LeaseAnswer, LeaseOp};
use quotad_core::settlement::Settled;

/// One operation on one key.
#[derive(Debug, Clone, Copy)]
pub struct StoreCall<'a> {
    pub algorithm: Algorithm,
    pub limits: Limits,
    /// The storage key, built by [`layout::PolicyLayout::storage_key`] and nowhere else.
    pub key: &'a str,
    pub op: Op,
    /// Unique id of the request (sliding-log entries).
    pub member: &'a str,
    /// A key of a global policy: the regional bucket script instead of `algorithm`'s.
    pub global: Option<GlobalCall<'a>>,
}

/// A reservation of one key: the key it charges, and where it waits for its settlement
/// (see `quotad_core::settlement`; local policies that can hold a debt only).
#[derive(Debug, Clone, Copy)]
pub struct SettleCall<'a> {
    pub algorithm: Algorithm,
    pub limits: Limits,
    /// The key's storage key ([`layout::PolicyLayout::storage_key`]).
    pub key: &'a str,
    /// [`layout::PolicyLayout::reservation_key`] of it.
    pub reservation: &'a str,
    /// [`layout::PolicyLayout::reset_mark_key`] of it: a reservation opened before the
    /// key's last reset is ended.
    pub reset_mark: &'a str,
    /// How long the reservation is kept, open or settled (the policy's `settle_within`).
    pub keep_ms: i64,
    pub member: &'a str,
}

/// What a settlement did, and the key after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SettleReply {
    pub settled: Settled,
    pub remaining: u64,
    pub reset_after_us: i64,
}

impl SettleReply {
    /// `lua/settle.lua`'s reply to a settlement: `{code, remaining, reset_after_us,
    /// charged, refunded}`.
    pub fn parse(reply: &[i64]) -> Result<SettleReply, StoreError> {
        let settled = match reply {
            [1, _, _, charged, refunded] if *charged >= 0 && *refunded >= 0 => Settled::Now {
                charged: *charged as u64,
                refunded: *refunded as u64,
            },
            [2, _, _, 0, 0] => Settled::Already,
            [0, _, _, 0, 0] => Settled::Unknown,
            [3, _, _, 0, 0] => Settled::Ended,
            other => return Err(StoreError::Reply(format!("{other:?}"))),
        };
        match reply[1] {
            remaining @ 0.. => Ok(SettleReply {
                settled,
                remaining: remaining as u64,
                reset_after_us: reply[2],
            }),
            _ => Err(StoreError::Reply(format!("{reply:?}"))),
        }
    }
}

/// One operation on a concurrency limit's key (`quotad_core::concurrency`).
#[derive(Debug, Clone, Copy)]
pub struct LeaseCall<'a> {
    /// The key's storage key ([`layout::PolicyLayout::storage_key`]).
    pub key: &'a str,
    /// Units that may be held at once.
    pub limit: u64,
    pub op: LeaseOp<'a>,
}

impl LeaseCall<'_> {
    /// The concurrency script's arguments after the key: mode, limit, id, units, hold.
    fn args(&self) -> (&'static str, &str, u64, i64) {
        match self.op {
            LeaseOp::Acquire { id, units, hold_us } => ("acquire", id, units, hold_us),
            LeaseOp::Release { id, units } => ("release", id, units, 0),
            LeaseOp::Extend { id, units, hold_us } => ("extend", id, units, hold_us),
            LeaseOp::Peek => ("peek", "", 0, 0),
            LeaseOp::Clear => ("clear", "", 0, 0),
        }
    }
}

/// `lua/concurrency.lua`'s reply: `{ok (0, 1, or 2: a lease a reset ended), held,
/// reset_after_us, retry_after_us, expired, released}`.
pub fn parse_lease(reply: &[i64]) -> Result<LeaseAnswer, StoreError> {
    match reply {
        [ok @ (0..=2), held, reset, retry, expired, released]
            if [*held, *reset, *retry, *expired, *released]
                .iter()
                .all(|n| *n >= 0) =>
        {
            Ok(LeaseAnswer {
                ok: *ok == 1,
                held: *held as u64,
                reset_after_us: *reset,
                retry_after_us: *retry,
                expired: *expired as u64,
                released: *released as u64,
                ended: *ok == 2,
            })
        }
        other => Err(StoreError::Reply(format!("{other:?}"))),
    }
}

/// What a decision on a global policy's key needs beyond [`StoreCall`].
#[derive(Debug, Clone, Copy)]
pub struct GlobalCall<'a> {
    /// The key as the client sent it: the coordinator's name for it.
    pub user_key: &'a str,
    pub keys: &'a layout::PolicyKeys,
    pub shape: layout::ScriptShape,
}

/// Why a store could not answer. Every variant means "no decision was made"; none is a
/// denial. The `kind` is the `quotad_store_errors_total` label.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store call timed out after {0:?}")]
    Timeout(std::time::Duration),
    #[error("store unreachable: {0}")]
    Connection(String),
    #[error("circuit open: store recently failed, not tried")]
    CircuitOpen,
    #[error("store answered with an error: {0}")]
    Command(String),
    #[error("unexpected reply from the limiter script: {0}")]
    Reply(String),
    /// The embedded store holds its maximum of keys and this check would add one.
    #[error("the embedded store is full ({0} keys)")]
    Full(usize),
}

impl StoreError {
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Timeout(_) => "timeout",
            StoreError::Connection(_) => "connection",
            StoreError::CircuitOpen => "circuit_open",
            StoreError::Command(_) => "command",
            StoreError::Reply(_) => "reply",
            StoreError::Full(_) => "full",
        }
    }

    /// Whether the store may have run the call all the same: it was sent and no answer
    /// came back (a timeout, a connection lost under it) or the answer was not one of
    /// the script's. Otherwise nothing was run: the call was never sent (the breaker was
    /// open, the embedded store was full) or the script refused it before any write.
    pub fn outcome_unknown(&self) -> bool {
        matches!(
            self,
            StoreError::Timeout(_) | StoreError::Connection(_) | StoreError::Reply(_)
        )
    }

    /// The label values of `kind`, for pre-registering metric series.
    pub const KINDS: [&'static str; 6] = [
        "timeout",
        "connection",
        "circuit_open",
        "command",
        "reply",
        "full",
    ];
}

/// What a reset ends beside the key's state: the reservations open on a settling
/// policy's key, through the key's reset mark, kept as long as a reservation may wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ends<'a> {
    /// [`layout::PolicyLayout::reset_mark_key`] of the key.
    pub mark: &'a str,
    pub keep_ms: i64,
}

/// What a reset forgets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forget {
    /// The key's whole state (a local policy's key).
    All,
    /// What the user spent: a global policy's bucket, never its lease book or counters,
    /// which are the coordinator's (the region would lend again what it already lent).
    Spent,
}

impl Forget {
    /// The word `lua/reset.lua` takes.
    pub fn word(self) -> &'static str {
        match self {
            Forget::All => "all",
            Forget::Spent => "spent",
        }
    }
}

/// A script's reply past 2^53 microseconds means "never" (a global key at a zero rate).
pub const NEVER_US: i64 = 1 << 53;

/// Every limiter script replies `{allowed, remaining, reset_after_us, retry_after_us}`.
pub fn parse_verdict(reply: &[i64]) -> Result<Verdict, StoreError> {
    let wait = |v: i64| if v >= NEVER_US { i64::MAX } else { v };
    match reply {
        [allowed, remaining, reset, retry]
            if (*allowed == 0 || *allowed == 1) && *remaining >= 0 =>
        {
            Ok(Verdict {
                allowed: *allowed == 1,
                remaining: *remaining as u64,
                reset_after_us: wait(*reset),
                retry_after_us: wait(*retry),
            })
        }
        other => Err(StoreError::Reply(format!("{other:?}"))),
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
    /// [`admission`]), or nothing to wait for in memory. Hold the result until the calls,
    /// refunds included, are done.
    pub async fn admit(
        &self,
        calls: usize,
    ) -> Result<Option<admission::Admitted<'_>>, admission::Shed> {
        match self {
            Store::Redis(r) => r.admit(calls).await,
            Store::Memory(_) => Ok(None),
        }
    }

    /// A denial of this call remembered from the store and still in force: answering it
    /// costs no Redis call (see [`deny_cache`]). Never for the embedded store.
    pub fn cached_denial(&self, call: &StoreCall<'_>) -> Option<Verdict> {
        match self {
            Store::Redis(r) => r.cached_denial(call),
            Store::Memory(_) => None,
        }
    }

    /// Hot-key slices: Redis only (the embedded store is in memory already).
    pub fn hot(&self) -> Option<&hot::HotKeys> {
        match self {
            Store::Redis(r) => Some(r.hot()),
            Store::Memory(_) => None,
        }
    }

    /// Gives back `cost` units a hot key's slice `mark` spent (see
    /// [`redis::RedisStore::refund_spent`]); slices are Redis's only.
    pub async fn refund_spent(
        &self,
        call: &StoreCall<'_>,
        mark: hot::Mark,
        cost: u64,
    ) -> Result<(), StoreError> {
        match self {
            Store::Redis(r) => r.refund_spent(call, mark, cost).await,
            Store::Memory(_) => self.apply(call).await.map(|_| ()),
        }
    }

    /// A check of a hot key that its slice could not answer (see [`hot`]), with the
    /// slice its units came from; `apply` on the embedded store, and for an algorithm
    /// that takes no slices.
    pub async fn apply_hot(
        &self,
        call: &StoreCall<'_>,
        cost: u64,
    ) -> Result<(Verdict, Option<hot::Mark>), StoreError> {
        match (self, hot::Taker::of(call.algorithm)) {
            (Store::Redis(r), Some(taker)) => r.apply_hot(call, taker, cost).await,
            _ => self.apply(call).await.map(|v| (v, None)),
        }
    }

    pub async fn apply(&self, call: &StoreCall<'_>) -> Result<Verdict, StoreError> {
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
    pub async fn charge(&self, call: &StoreCall<'_>, cost: u64) -> Result<Verdict, StoreError> {
        match self {
            Store::Redis(r) => r.charge(call, cost).await,
            Store::Memory(m) => m.charge(call, cost).map_err(|e| StoreError::Full(e.0)),
        }
    }

    /// A check of `estimate` units that, admitted, opens the reservation.
    pub async fn reserve(
        &self,
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
        call: &SettleCall<'_>,
        cost: u64,
    ) -> Result<SettleReply, StoreError> {
        match self {
            Store::Redis(r) => r.settle(call, cost).await,
            Store::Memory(m) => Ok(m.settle(call, cost)),
        }
    }

    /// One operation on a concurrency limit's key: acquire, release, extend or peek.
    pub async fn lease(&self, call: &LeaseCall<'_>) -> Result<LeaseAnswer, StoreError> {
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
