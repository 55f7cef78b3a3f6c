//! quotad: a quota coordinator daemon. One runs in each region next to the services; a
//! service asks it over local HTTP "may key K spend N units of policy P?" and quotad answers
//! from a Lua limiter that runs atomically inside that region's Redis, on Redis's own clock.
//!
//! # Request flow (one way)
//!
//! HTTP request → [`api`] (parse + validate, no business logic) → [`policy`] (the compiled
//! policy) → [`limiter`] (shadow and fail modes; returns a `Decision` value) → [`store`]
//! (the key from [`layout`]; Redis: one Lua script call | memory: the same algorithm in
//! Rust, from [`quotad_core::algorithm`]) → decision → [`metrics`] → HTTP response with
//! RateLimit headers.
//!
//! # Layout
//!
//! - [`store`]: the storage boundary: Redis (scripts, timeouts, circuit breaker) and memory.
//! - [`layout`]: the one owner of storage keys, hash tags and how long keys live; every
//!   layer that names a key asks it.
//! - [`policy`]: policy types that cannot be invalid.
//! - [`limiter`]: one check or a batch → decisions; fail modes, shadow mode, batch refunds.
//! - [`api`]: the axum router, request parsing, the error type.
//! - [`server`]: connections: their bound, per-phase timeouts, eviction and the drain.
//! - [`config`]: TOML → validated settings, errors naming file, line and field.
//! - [`metrics`]: the metric catalogue.
//! - [`federation`]: runs the coordinator between real processes: the region's lock,
//!   Redis as the node's store and clock, signed HTTP exchanges with the peers.
//! - [`app`]: the composition root and shutdown order.

#![warn(unreachable_pub)]

mod api;
pub mod app;
pub mod config;
pub mod federation;
pub mod layout;
mod limiter;
pub mod metrics;
mod policy;
mod reload;
pub mod server;
pub mod store;

/// The Envoy rate-limit service's messages, as the gRPC API reads and writes them (for
/// clients of it).
pub use api::grpc::envoy;
/// The partition key quotad's RateLimit headers name for a policy and key.
pub use api::headers::partition_key;
