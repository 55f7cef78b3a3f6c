//! quotad's pure core: what a decision and a global budget *are*, with no I/O.
//!
//! - [`algorithm`]: the five rate-limit algorithms as pure functions over a state and a
//!   time. The daemon's embedded store runs them directly; the Lua scripts the daemon runs
//!   inside Redis are tested against them (they are the reference model).
//! - [`concurrency`]: concurrency limits (units held at once, under leases that end by the
//!   store's clock) as pure functions, the reference model of their Lua script.
//! - [`settlement`]: a check that reserves an estimated cost and its settlement at the real
//!   cost, charged as debt where the key lacks it.
//! - [`coordinator`]: global budgets: demand estimation, allocation, the lease book and the
//!   node state machine that lends and borrows share between regions.
//! - [`calendar`]: calendar periods (a day, week, month or year of a time zone) and their
//!   bounds, for quotas on the calendar.
//! - [`clock`]: time behind a trait, so everything above runs on a fake clock in tests and
//!   on virtual clocks in the simulator.
//!
//! This crate depends on serde and jiff (with its bundled time-zone database) and nothing
//! else at run time: no async runtime, network, file or Redis client. The daemon (`quotad-daemon`) and the simulator (`quotad-sim`) drive it.

#![warn(unreachable_pub)]
#![warn(missing_docs)]

pub mod algorithm;
pub mod calendar;
pub mod clock;
pub mod concurrency;
pub mod coordinator;
pub mod settlement;
