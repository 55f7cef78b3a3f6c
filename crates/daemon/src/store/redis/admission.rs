//! Admission to Redis: a bound on the calls in flight, a bounded queue in front of it with
//! its own deadline, and explicit shedding beyond.
//!
//! Why: Redis runs scripts one at a time, so everything a spike puts in flight waits in a
//! queue somewhere. Without a bound that queue is inside the one multiplexed connection,
//! and the store timeout (meant to judge Redis) times the wait too: a spike then looks like
//! a Redis failure, calls time out, the breaker opens and every policy takes its fail mode
//! (`fail_open` stops enforcing exactly when it matters). With the bound, at most
//! `max_in_flight` calls are sent and the store timeout starts when a call is sent; work
//! beyond that waits here, at most `max_queued` requests for at most `queue_timeout`, and
//! is otherwise shed: the client gets a 503 `overloaded` with `Retry-After`, nothing is
//! charged, and `quotad_shed_total{reason}` counts it. A shed request is not a decision.
//!
//! A request takes all the permits it needs at once (one per check of a batch, refunds
//! included), so a batch is either admitted whole or shed before it touches Redis.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{Semaphore, SemaphorePermit};

use crate::metrics::Metrics;

/// Settings from `[store]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AdmissionSettings {
    /// Calls sent to Redis and not yet answered, at most.
    pub(crate) max_in_flight: usize,
    /// Requests waiting for a permit, at most; beyond, shed at once.
    pub(crate) max_queued: usize,
    /// Longest wait for a permit; beyond, shed.
    pub(crate) queue_timeout: Duration,
}

/// Why a request was shed: the `reason` label of `quotad_shed_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Shed {
    #[error("the queue for Redis is full")]
    QueueFull,
    #[error("no Redis capacity freed up within the queue timeout")]
    QueueTimeout,
    /// The bodies being read already hold `server.max_body_memory` (see `api::body`).
    #[error("request bodies being read hold all the memory allowed for them")]
    BodyMemory,
}

impl Shed {
    pub(crate) fn reason(self) -> &'static str {
        match self {
            Shed::QueueFull => "queue_full",
            Shed::QueueTimeout => "queue_timeout",
            Shed::BodyMemory => "body_memory",
        }
    }

    /// The reasons of Redis admission (`body_memory` is registered by the API).
    pub(crate) const REASONS: [&'static str; 2] = ["queue_full", "queue_timeout"];
}

pub(crate) struct Admission {
    settings: AdmissionSettings,
    permits: Semaphore,
    queued: AtomicUsize,
    /// Permits held (the gauge `quotad_store_in_flight`).
    in_flight: AtomicUsize,
    metrics: Arc<Metrics>,
}

/// Held while a request's calls are in flight; the permits return when it drops.
pub(crate) struct Admitted<'a> {
    _permit: SemaphorePermit<'a>,
    admission: &'a Admission,
    n: usize,
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        let a = self.admission;
        let left = a.in_flight.fetch_sub(self.n, Ordering::AcqRel) - self.n;
        a.metrics.store_in_flight.set(left as i64);
    }
}

impl Admission {
    pub(crate) fn new(settings: AdmissionSettings, metrics: Arc<Metrics>) -> Self {
        let settings = AdmissionSettings {
            max_in_flight: settings.max_in_flight.max(1),
            ..settings
        };
        for r in Shed::REASONS {
            metrics.shed.with_label_values(&[r]);
        }
        Admission {
            permits: Semaphore::new(settings.max_in_flight),
            settings,
            queued: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            metrics,
        }
    }

    /// Waits (FIFO, bounded) for `calls` permits; more than `max_in_flight` counts as all.
    pub(crate) async fn admit(&self, calls: usize) -> Result<Admitted<'_>, Shed> {
        let n = calls.clamp(1, self.settings.max_in_flight) as u32;
        let permit = match self.permits.try_acquire_many(n) {
            Ok(p) => p,
            Err(_) => {
                let waiting = self.queued.fetch_add(1, Ordering::AcqRel);
                let _leave = Leave(self);
                if waiting >= self.settings.max_queued {
                    return Err(self.shed(Shed::QueueFull));
                }
                self.metrics.store_queued.set(waiting as i64 + 1);
                match tokio::time::timeout(
                    self.settings.queue_timeout,
                    self.permits.acquire_many(n),
                )
                .await
                {
                    Ok(Ok(p)) => p,
                    // The semaphore is never closed; treat it like a timeout anyway.
                    Ok(Err(_)) | Err(_) => return Err(self.shed(Shed::QueueTimeout)),
                }
            }
        };
        let n = n as usize;
        let used = self.in_flight.fetch_add(n, Ordering::AcqRel) + n;
        self.metrics.store_in_flight.set(used as i64);
        Ok(Admitted {
            _permit: permit,
            admission: self,
            n,
        })
    }

    fn shed(&self, why: Shed) -> Shed {
        self.metrics.shed.with_label_values(&[why.reason()]).inc();
        why
    }
}

/// Leaves the queue (on every path out of the wait, cancellation included).
struct Leave<'a>(&'a Admission);

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        let left = self.0.queued.fetch_sub(1, Ordering::AcqRel) - 1;
        self.0.metrics.store_queued.set(left as i64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(max_in_flight: usize, max_queued: usize, ms: u64) -> Admission {
        Admission::new(
            AdmissionSettings {
                max_in_flight,
                max_queued,
                queue_timeout: Duration::from_millis(ms),
            },
            Arc::new(Metrics::new(["p"], &[])),
        )
    }

    #[tokio::test]
    async fn a_full_queue_sheds_at_once_and_a_slow_one_after_its_deadline() {
        let a = admission(2, 1, 50);
        let held = a.admit(2).await.unwrap();
        // One may wait; the next is shed without waiting.
        let waiter = a.admit(1);
        tokio::pin!(waiter);
        assert!(
            tokio::time::timeout(Duration::from_millis(5), &mut waiter)
                .await
                .is_err(),
            "the first waiter waits"
        );
        assert_eq!(a.admit(1).await.err(), Some(Shed::QueueFull));
        // Nothing frees up within the deadline: the waiter is shed.
        assert_eq!(waiter.await.err(), Some(Shed::QueueTimeout));
        assert_eq!(a.metrics.shed.with_label_values(&["queue_full"]).get(), 1);
        assert_eq!(
            a.metrics.shed.with_label_values(&["queue_timeout"]).get(),
            1
        );
        assert_eq!(a.metrics.store_queued.get(), 0);
        assert_eq!(a.metrics.store_in_flight.get(), 2);
        drop(held);
        assert_eq!(a.metrics.store_in_flight.get(), 0);
        // Capacity back: admitted at once.
        let again = a.admit(1).await.unwrap();
        assert_eq!(a.metrics.store_in_flight.get(), 1);
        drop(again);
    }

    #[tokio::test]
    async fn a_waiter_is_admitted_when_permits_return_and_batches_take_all_or_nothing() {
        let a = Arc::new(admission(4, 8, 1000));
        let held = a.admit(3).await.unwrap();
        let a2 = a.clone();
        // Needs 2 of the 1 left: waits until the 3 return, then takes 2 at once.
        let batch = tokio::spawn(async move { a2.admit(2).await.map(|_| ()) });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!batch.is_finished());
        drop(held);
        assert_eq!(batch.await.unwrap(), Ok(()));
        // A batch larger than the bound takes every permit rather than never fitting.
        let all = a.admit(100).await.unwrap();
        assert_eq!(a.permits.available_permits(), 0);
        drop(all);
        assert_eq!(a.permits.available_permits(), 4);
    }
}
