//! The storage boundary's shapes: the call a backend takes for each kind of operation,
//! what a settlement answers, and the error enum every backend returns.

use quotad_core::algorithm::{Algorithm, Limits, Op, Usage};
use quotad_core::calendar::Periods;
use quotad_core::concurrency::LeaseOp;
use quotad_core::coordinator::bucket::RegionUsage;
use quotad_core::settlement::Settled;

use crate::layout;

/// One operation on one key.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StoreCall<'a> {
    pub(crate) algorithm: Algorithm,
    pub(crate) limits: Limits,
    /// The storage key, built by [`layout::PolicyLayout::storage_key`] and nowhere else.
    pub(crate) key: &'a str,
    pub(crate) op: Op,
    /// Unique id of the request (sliding-log entries).
    pub(crate) member: &'a str,
    /// A key of a global policy: the regional bucket script instead of `algorithm`'s.
    pub(crate) global: Option<GlobalCall<'a>>,
    /// A fixed window of calendar periods: the periods around now (the window the script
    /// and the model run in; `quotad_core::calendar::Periods`).
    pub(crate) periods: Option<Periods>,
}

/// A reservation of one key: the key it charges, and where it waits for its settlement
/// (see `quotad_core::settlement`; local policies that can hold a debt only).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SettleCall<'a> {
    pub(crate) algorithm: Algorithm,
    pub(crate) limits: Limits,
    /// The key's storage key ([`layout::PolicyLayout::storage_key`]).
    pub(crate) key: &'a str,
    /// [`layout::PolicyLayout::reservation_key`] of it.
    pub(crate) reservation: &'a str,
    /// [`layout::PolicyLayout::reset_mark_key`] of it: a reservation opened before the
    /// key's last reset is ended.
    pub(crate) reset_mark: &'a str,
    /// How long the reservation is kept, open or settled (the policy's `settle_within`).
    pub(crate) keep_ms: i64,
    pub(crate) member: &'a str,
    /// As [`StoreCall::periods`].
    pub(crate) periods: Option<Periods>,
}

/// What a key used and holds, read without a write, as of the store's clock.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct UsageReply {
    pub(crate) usage: KeyUsage,
    /// The store's clock when it was read, us.
    pub(crate) now_us: i64,
}

/// A local policy's key ([`Usage`]), or what a global policy's key holds in this region
/// ([`RegionUsage`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum KeyUsage {
    Local(Usage),
    Region(RegionUsage),
}

/// What a settlement did, and the key after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SettleReply {
    pub(crate) settled: Settled,
    pub(crate) remaining: u64,
    pub(crate) reset_after_us: i64,
}

/// One operation on a concurrency limit's key (`quotad_core::concurrency`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct LeaseCall<'a> {
    /// The key's storage key ([`layout::PolicyLayout::storage_key`]).
    pub(crate) key: &'a str,
    /// Units that may be held at once.
    pub(crate) limit: u64,
    pub(crate) op: LeaseOp<'a>,
}

/// What a decision on a global policy's key needs beyond [`StoreCall`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct GlobalCall<'a> {
    /// The key as the client sent it: the coordinator's name for it.
    pub(crate) user_key: &'a str,
    pub(crate) keys: &'a layout::PolicyKeys,
    pub(crate) shape: layout::ScriptShape,
    /// The key's own numbers (a runtime limit), as this instance has them.
    pub(crate) limit: Option<quotad_core::coordinator::bucket::KeyLimit>,
}

impl GlobalCall<'_> {
    /// What the decision script is called with for `call`'s key.
    pub(crate) fn script_key<'a>(
        &'a self,
        call: &'a StoreCall<'_>,
    ) -> super::redis::global::GlobalKey<'a> {
        super::redis::global::GlobalKey {
            storage_key: call.key,
            user_key: self.user_key,
            keys: self.keys,
            shape: &self.shape,
            limit: self.limit,
        }
    }
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
    pub(crate) fn kind(&self) -> &'static str {
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
    pub(crate) fn outcome_unknown(&self) -> bool {
        matches!(
            self,
            StoreError::Timeout(_) | StoreError::Connection(_) | StoreError::Reply(_)
        )
    }

    /// The label values of `kind`, for pre-registering metric series.
    pub(crate) const KINDS: [&'static str; 6] = [
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
pub(crate) struct Ends<'a> {
    /// [`layout::PolicyLayout::reset_mark_key`] of the key.
    pub(crate) mark: &'a str,
    pub(crate) keep_ms: i64,
}

/// What a reset forgets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Forget {
    /// The key's whole state (a local policy's key).
    All,
    /// What the user spent: a global policy's bucket, never its lease book or counters,
    /// which are the coordinator's (the region would lend again what it already lent).
    Spent,
}

impl Forget {
    /// The word `lua/reset.lua` takes.
    pub(crate) fn word(self) -> &'static str {
        match self {
            Forget::All => "all",
            Forget::Spent => "spent",
        }
    }
}
