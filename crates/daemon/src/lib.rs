//! quotad: a quota coordinator daemon. One runs in each region next to the services; a
//! service asks it over local HTTP "may key K spend N units of policy P?" and quotad answers
//! from a Lua limiter that runs atomically inside that region's Redis, on Redis's own clock.
//!
//! # Request flow (one way)
//!
//! HTTP request → `api` (parse + validate, no business logic) → `policy` (the compiled
//! policy) → `limiter` (shadow and fail modes; returns a `Decision` value) → `store`
//! (the key from `layout`; Redis: one Lua script call | memory: the same algorithm in
//! Rust, from `quotad_core::algorithm`) → decision → `metrics` → HTTP response with
//! RateLimit headers.
//!
//! # What it offers
//!
//! The binary's few needs: [`Settings`] (loaded and validated from a file, or built in),
//! [`run`] and [`serve`] (the daemon until a shutdown token fires), [`Endpoint`] and
//! [`Listener`], [`script_source`] and [`REVISION`]; for clients of the Envoy service, its
//! messages ([`envoy`]) and [`partition_key`]. Every module below is private.
//!
//! # Layout
//!
//! - `store`: the storage boundary: Redis (scripts, timeouts, circuit breaker) and memory.
//! - `layout`: the one owner of storage keys, hash tags and how long keys live; every
//!   layer that names a key asks it.
//! - `policy`: policy types that cannot be invalid.
//! - `limiter`: one check or a batch → decisions; fail modes, shadow mode, batch refunds.
//! - `api`: the axum router, request parsing, the error type.
//! - `server`: connections: their bound, per-phase timeouts, eviction and the drain.
//! - `config`: TOML → validated settings, errors naming file, line and field.
//! - `metrics`: the metric catalogue.
//! - `federation`: runs the coordinator between real processes: the region's lock,
//!   Redis as the node's store and clock, signed HTTP exchanges with the peers.
//! - `app`: the composition root and shutdown order.

// Every module is private: what the binary, the test kit and clients need is re-exported
// below, and quotad's own white-box tests reach further through `testing`, a feature only
// the workspace's dev-dependencies turn on. `unreachable_pub` is checked in that build,
// where `testing` is the one extra door: without the feature, what only it re-exports is
// unreachable on purpose.
#![cfg_attr(feature = "testing", warn(unreachable_pub))]
#![warn(missing_docs)]

mod api;
mod app;
mod config;
mod federation;
mod layout;
mod limiter;
mod metrics;
mod policy;
mod reload;
mod runtime_limits;
mod server;
mod store;
#[cfg(feature = "testing")]
#[doc(hidden)]
pub mod testing;

/// The Envoy rate-limit service's messages, as the gRPC API reads and writes them (for
/// clients of it).
pub use api::grpc::envoy;
/// The partition key quotad's RateLimit headers name for a policy and key.
pub use api::headers::partition_key;
pub use app::{AppError, run, serve};
pub use config::{ConfigError, ConfigErrors, LogFormat, Settings};
/// The build's commit, set by the binary before the daemon starts (`quotad_build_info`).
pub use metrics::REVISION;
pub use server::{Endpoint, Listener};
/// The Lua source quotad sends to Redis for an algorithm (`quotad script`).
pub use store::script_source;
