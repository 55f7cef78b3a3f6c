//! Time for the embedded store, behind a trait so tests can drive it by hand.
//!
//! Redis-backed decisions never use this: the scripts read Redis's own clock (`TIME`), so
//! daemons with skewed clocks still agree. Only the in-process store (zero-setup mode and the
//! `local` fallback) needs a clock of its own.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// A source of the time, in µs since the Unix epoch: the store's clock in production, a
/// manual one in tests.
pub trait Clock: Send + Sync + 'static {
    /// Microseconds since the Unix epoch (the same unit the Lua scripts use).
    fn now_us(&self) -> i64;
}

/// The wall clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_us(&self) -> i64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_micros() as i64)
            .unwrap_or(0)
    }
}

/// A clock that moves only when told to; for deterministic tests.
#[derive(Debug, Default)]
pub struct ManualClock(AtomicI64);

impl ManualClock {
    /// A clock stopped at `now_us`.
    pub fn new(now_us: i64) -> Self {
        ManualClock(AtomicI64::new(now_us))
    }
    /// Moves the clock to `now_us` (backwards too: a clock step).
    pub fn set(&self, now_us: i64) {
        self.0.store(now_us, Ordering::SeqCst);
    }
    /// Moves the clock forward by `us`.
    pub fn advance(&self, us: i64) {
        self.0.fetch_add(us, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_us(&self) -> i64 {
        self.0.load(Ordering::SeqCst)
    }
}
