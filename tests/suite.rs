//! The integration tests: one module per concern, compiled as one binary.
//!
//! Each module is a file beside this one and reads as a specification of its concern
//! (`reload.rs`: what a reload changes and what it keeps; `multi_region.rs`: three real
//! regions sharing one budget). They talk to real `redis-server`, nginx, Caddy and
//! Prometheus processes and to real `quotad` processes, all started on free loopback ports
//! by the test kit (`quotad-testkit`) and stopped on drop.
//!
//! Why one binary: forty test binaries meant forty links of the whole daemon and its
//! dependencies, and each instantiated the same generic code again. cargo-nextest (the
//! suite's runner, `scripts/test`) runs every test in a process of its own, so modules
//! share no state through the binary; under plain `cargo test` they share a process, as
//! the tests of one file always did. Three files keep binaries of their own because they
//! bring their own harness (atomicity, cluster, composite: the binary re-runs itself as
//! the load processes).
//!
//! Run one module: `cargo nextest run --all-features reload::` (or
//! `cargo test --all-features --test suite reload::`).

mod acl;
mod article;
mod bad_input;
mod bench_short;
mod bucket_slices;
mod calendar;
mod clock_jump;
mod cluster_faults;
mod cluster_scripts;
mod coalescing;
mod concurrency;
mod config;
mod connections;
mod coordinator_scale;
mod dashboards;
#[cfg(feature = "demo")]
mod demo;
mod deny_cache;
mod differential;
mod exchange_wire;
mod failover;
mod failure;
mod features_meet;
mod forward_auth;
mod fuzz;
mod global_lua;
mod grpc;
mod headers;
mod image;
mod janitor;
mod kubernetes;
mod layering;
mod multi_region;
mod observability;
mod openapi;
mod overload;
mod overrides;
mod peer_auth;
mod prometheus;
mod python_client;
mod redis_store;
mod reload;
mod runtime_limits;
mod sentinel;
mod settlement;
mod shutdown;
mod sim;
mod stateful;
mod tls;
mod topologies;
mod transitions;
mod unix_socket;
mod usage;
