//! White-box doors for quotad's own integration tests: the lease book's scripts, the
//! region's lock, key layouts and script sources, driven against a real redis-server.
//! Compiled only with the `testing` feature, which the workspace's dev-dependencies turn
//! on; the shipped binary has none of it.

use std::sync::Arc;

use crate::config::{GlobalSettings, Settings};
use crate::policy::Policy;

pub use crate::app::layouts;
pub use crate::config::StoreBackend;
pub use crate::layout::{
    Layout, PolicyKeys, PolicyLayout, ReservationId, ScriptShape, slot, ttl_ms,
};

/// The policies `settings` defines, shared as the daemon shares them.
pub fn policies(settings: &Settings) -> Vec<Arc<Policy>> {
    settings.policies.iter().cloned().map(Arc::new).collect()
}

/// The coordinator's settings, when a policy of `settings` is global.
pub fn global(settings: &Settings) -> Option<GlobalSettings> {
    settings.global.clone()
}

/// The region `settings` names.
pub fn region(settings: &Settings) -> &str {
    &settings.region
}

/// The store `settings` names.
pub fn store(settings: &Settings) -> &StoreBackend {
    &settings.store
}

/// The coordinator between processes: its books, lock, clock and signatures.
pub mod federation {
    pub use crate::federation::auth::{
        HEADER_SIGNATURE, Signed, sign_request, verify_reply, wall_ms,
    };
    pub use crate::federation::books::{
        BookWrite, SLOT_FIELDS, decode_default, decode_slot, drop_loans_invocation,
        set_default_invocation, write_books_invocation,
    };
    pub use crate::federation::incarnation::now_ms;
    pub use crate::federation::lease_store::{RedisClock, RedisLeaseStore, global_policies};
    pub use crate::federation::lock::Lock;
    pub use crate::federation::runtime::Coordinated;
}

/// The Redis backend's scripts, connections and janitor.
pub mod redis {
    pub use crate::store::redis::connect::{SyncConn, Target, Topology};
    pub use crate::store::redis::global::{GlobalKey, check_invocation, usage_invocation};
    pub use crate::store::redis::janitor::{
        CLIENT_NAME, ORPHAN_TTL_MS, SCAN_COUNT, SweepReport, sweep,
    };
    pub use crate::store::redis::scripts::{
        BUCKET_SLICE, COMPOSITE, CONCURRENCY, Global, SETTLE, SLICE, frame_args, source, window_arg,
    };
    pub use crate::store::redis::wire::{parse_region_usage, parse_usage, parse_verdict};
}
