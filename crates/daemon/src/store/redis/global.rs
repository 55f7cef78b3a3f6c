//! Global policies in a region's Redis: how a check calls `lua/global/check.lua`, and the
//! arguments every script of `lua/global/` shares. The coordinator's own scripts (writing
//! books, dropping loans, the default escrow) and the reading of a key's hash back as a
//! `KeySlot` are the lease book's: `federation::books`.
//!
//! Per user key, one hash holds the bucket, the lease book and the counters (see
//! `lua/global/common.lua`). Per policy: a meta hash with the default escrow, a sorted set
//! of recently active keys (score: Redis time of the last check), and the set of keys with
//! a book (recovery after a coordinator restart), and the fencing token of the coordinator
//! that may write them. Their names are [`crate::layout`]'s: all in one hash slot, so every
//! script below runs on a cluster too.

use redis::{Script, ScriptInvocation};

use crate::layout::{PolicyKeys, ScriptShape};

use quotad_core::algorithm::Op;
use quotad_core::coordinator::bucket::KeyLimit;

impl ScriptShape {
    /// The five numbers, in the order `shape_args` in `lua/global/common.lua` reads them.
    pub(crate) fn push(&self, inv: &mut ScriptInvocation<'_>) {
        inv.arg(self.rho)
            .arg(self.burst)
            .arg(self.step_tolerance_us)
            .arg(self.fallback_escrow)
            .arg(self.keep_ms);
    }
}

/// The optional last argument of every script: the time, in tests only.
pub(crate) fn push_now(inv: &mut ScriptInvocation<'_>, now_us: Option<i64>) {
    if let Some(now) = now_us {
        inv.arg(now);
    }
}

/// One key of a global policy as the decision script is called for it.
#[derive(Debug, Clone, Copy)]
pub struct GlobalKey<'a> {
    /// The key's hash.
    pub storage_key: &'a str,
    /// The key as the client sent it (the active set's member).
    pub user_key: &'a str,
    /// The policy's keys (meta hash, active set).
    pub keys: &'a PolicyKeys,
    /// The policy's numbers.
    pub shape: &'a ScriptShape,
    /// The key's own numbers as this instance has them (none: the policy's).
    pub limit: Option<KeyLimit>,
}

/// The decision script's call for one operation; `now_us` only in tests.
pub fn check_invocation<'a>(
    script: &'a Script,
    key: &GlobalKey<'_>,
    op: Op,
    now_us: Option<i64>,
) -> ScriptInvocation<'a> {
    let mode = match op {
        Op::Check { cost } => ("check", cost),
        Op::Refund { cost } => ("refund", cost),
    };
    invocation(script, key, mode, now_us)
}

/// The decision script's `usage` mode for one key: what it holds here, read without a
/// write (`quotad_core::coordinator::bucket::KeySlot::usage`); `now_us` only in tests.
pub fn usage_invocation<'a>(
    script: &'a Script,
    key: &GlobalKey<'_>,
    now_us: Option<i64>,
) -> ScriptInvocation<'a> {
    invocation(script, key, ("usage", 0), now_us)
}

fn invocation<'a>(
    script: &'a Script,
    key: &GlobalKey<'_>,
    (mode, cost): (&str, u64),
    now_us: Option<i64>,
) -> ScriptInvocation<'a> {
    let mut inv = script.prepare_invoke();
    inv.key(key.storage_key)
        .key(&key.keys.meta)
        .key(&key.keys.active)
        .arg(mode)
        .arg(cost);
    key.shape.push(&mut inv);
    inv.arg(key.user_key);
    // 0 0: the policy's numbers.
    let own = key.limit.map_or((0.0, 0.0), |k| (k.rate, k.burst));
    inv.arg(own.0).arg(own.1);
    push_now(&mut inv, now_us);
    inv
}
