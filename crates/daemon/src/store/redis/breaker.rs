//! A circuit breaker for the Redis connection.
//!
//! Without one, every request pays the full store timeout while Redis is down
//! (envoyproxy/ratelimit#462, #978 report 10 s per request). While it is open, requests
//! fail fast (`StoreError::CircuitOpen`) and take their policy's fallback in microseconds.
//!
//! It opens only on evidence that Redis itself is failing, because opening switches
//! enforcement off for every `open` policy:
//! - a lost or refused connection opens it at once ([`Breaker::trip`]);
//! - `threshold` consecutive timed-out calls only make it *suspect* Redis: the store's
//!   supervisor then PINGs Redis with a longer deadline, and opens it ([`Breaker::trip`])
//!   only if that goes unanswered; an answer clears the suspicion ([`Breaker::cleared`]).
//!   Calls are timed from the moment they are sent (admission keeps quotad's own queue out
//!   of that time), so timeouts already point at Redis; the PING rules out a burst of
//!   them caused by quotad itself being starved of CPU.
//!
//! It closes only when the supervisor has probed Redis successfully (reconnected, PING,
//! scripts loaded): the half-open probe is that task's, so no client request is spent on
//! finding out. Lock-free: atomics read on every request.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

#[derive(Debug)]
pub(crate) struct Breaker {
    threshold: u32,
    failures: AtomicU32,
    open: AtomicBool,
    /// A verification PING is under way (at most one).
    suspect: AtomicBool,
}

impl Breaker {
    pub(crate) fn new(threshold: u32) -> Self {
        Breaker {
            threshold: threshold.max(1),
            failures: AtomicU32::new(0),
            open: AtomicBool::new(false),
            suspect: AtomicBool::new(false),
        }
    }

    pub(crate) fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    /// Timeouts in a row await the supervisor's verification.
    pub(crate) fn is_suspect(&self) -> bool {
        self.suspect.load(Ordering::Acquire)
    }

    pub(crate) fn record_success(&self) {
        self.failures.store(0, Ordering::Release);
    }

    /// Counts a failed call; returns true when this failure makes Redis suspect (the
    /// caller starts the one verification).
    pub(crate) fn record_failure(&self) -> bool {
        let n = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        n >= self.threshold && !self.is_open() && !self.suspect.swap(true, Ordering::AcqRel)
    }

    /// The verification got an answer: Redis is alive, the failures were not its doing.
    pub(crate) fn cleared(&self) {
        self.failures.store(0, Ordering::Release);
        self.suspect.store(false, Ordering::Release);
    }

    /// Opens at once (the connection is gone, or a verification went unanswered); true
    /// when this call opened it.
    pub(crate) fn trip(&self) -> bool {
        self.suspect.store(false, Ordering::Release);
        !self.open.swap(true, Ordering::AcqRel)
    }

    /// Closes after a successful probe.
    pub(crate) fn close(&self) {
        self.failures.store(0, Ordering::Release);
        self.suspect.store(false, Ordering::Release);
        self.open.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threshold_consecutive_failures_make_redis_suspect_but_do_not_open() {
        let b = Breaker::new(3);
        assert!(!b.record_failure());
        assert!(!b.record_failure());
        b.record_success();
        assert!(!b.record_failure());
        assert!(!b.record_failure());
        assert!(
            b.record_failure(),
            "the third in a row starts a verification"
        );
        assert!(!b.is_open(), "suspicion alone does not open");
        assert!(!b.record_failure(), "one verification at a time");
        // Redis answered the verification: back to counting from zero.
        b.cleared();
        assert!(!b.record_failure());
        assert!(!b.record_failure());
        assert!(b.record_failure());
        // This time it did not answer.
        assert!(b.trip());
        assert!(b.is_open());
        assert!(!b.record_failure(), "nothing to verify while open");
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
