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

/// The decision script's call for one operation; `now_us` only in tests.
pub fn check_invocation<'a>(
    script: &'a Script,
    storage_key: &str,
    user_key: &str,
    keys: &PolicyKeys,
    shape: &ScriptShape,
    op: Op,
    now_us: Option<i64>,
) -> ScriptInvocation<'a> {
    let (mode, cost) = match op {
        Op::Check { cost } => ("check", cost),
        Op::Refund { cost } => ("refund", cost),
    };
    invocation(
        script,
        storage_key,
        user_key,
        keys,
        shape,
        (mode, cost),
        now_us,
    )
}

/// The decision script's `usage` mode for one key: what it holds here, read without a
/// write (`quotad_core::coordinator::bucket::KeySlot::usage`); `now_us` only in tests.
pub fn usage_invocation<'a>(
    script: &'a Script,
    storage_key: &str,
    user_key: &str,
    keys: &PolicyKeys,
    shape: &ScriptShape,
    now_us: Option<i64>,
) -> ScriptInvocation<'a> {
    invocation(
        script,
        storage_key,
        user_key,
        keys,
        shape,
        ("usage", 0),
        now_us,
    )
}

fn invocation<'a>(
    script: &'a Script,
    storage_key: &str,
    user_key: &str,
    keys: &PolicyKeys,
    shape: &ScriptShape,
    (mode, cost): (&str, u64),
    now_us: Option<i64>,
) -> ScriptInvocation<'a> {
    let mut inv = script.prepare_invoke();
    inv.key(storage_key)
        .key(&keys.meta)
        .key(&keys.active)
        .arg(mode)
        .arg(cost);
    shape.push(&mut inv);
    inv.arg(user_key);
    push_now(&mut inv, now_us);
    inv
}
