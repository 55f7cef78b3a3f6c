//! A circuit breaker for the Redis connection.
//!
//! Without one, every request pays the full store timeout while Redis is down
//! (envoyproxy/ratelimit#462, #978 report 10 s per request). After `threshold` consecutive
//! failures the breaker opens: requests fail fast (`StoreError::CircuitOpen`) and take their
//! policy's fallback in microseconds. It closes only when the store's supervisor task has
//! probed Redis successfully (reconnected, PING, scripts loaded) - the half-open probe is that
//! task's, so no client request is spent on finding out.
//!
//! Lock-free: two atomics read on every request.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

#[derive(Debug)]
pub struct Breaker {
    threshold: u32,
    failures: AtomicU32,
    open: AtomicBool,
}

impl Breaker {
    pub fn new(threshold: u32) -> Self {
        Breaker {
            threshold: threshold.max(1),
            failures: AtomicU32::new(0),
            open: AtomicBool::new(false),
        }
    }

    pub fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    pub fn record_success(&self) {
        self.failures.store(0, Ordering::Release);
    }

    /// Counts a failure; returns true when this failure opened the breaker.
    pub fn record_failure(&self) -> bool {
        let n = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        n >= self.threshold && !self.open.swap(true, Ordering::AcqRel)
    }

    /// Opens at once (the connection is known to be gone).
    pub fn trip(&self) -> bool {
        !self.open.swap(true, Ordering::AcqRel)
    }

    /// Closes after a successful probe.
    pub fn close(&self) {
        self.failures.store(0, Ordering::Release);
        self.open.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_threshold_consecutive_failures_only() {
        let b = Breaker::new(3);
        assert!(!b.record_failure());
        assert!(!b.record_failure());
        b.record_success();
        assert!(!b.record_failure());
        assert!(!b.record_failure());
        assert!(!b.is_open());
        assert!(b.record_failure());
        assert!(b.is_open());
        assert!(!b.record_failure(), "only the opening failure reports it");
        b.close();
        assert!(!b.is_open());
    }

    #[test]
    fn trip_opens_immediately() {
        let b = Breaker::new(5);
        assert!(b.trip());
        assert!(b.is_open());
        assert!(!b.trip());
    }
}
