//! Keeping this instance's copy of the runtime limits at Redis's version. Messages on the
//! invalidation channel apply each change as it is made (`follow_invalidations`,
//! `RuntimeLimits::on_message`); this task repairs what they cannot: every round (a
//! second), or at once when a message showed a gap, it reads the version of each policy
//! that takes runtime limits, and where it is not the copy's (a message missed, this
//! instance new, a Redis that lost writes, the channel down) it reads the whole set again.
//! Each round it also ends the entries whose expiry has passed, in Redis, so their end
//! reaches every instance as a change.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::RedisStore;
use crate::layout::RuntimeLimitKeys;
use crate::runtime_limits::RuntimeWrite;

/// How often the version is compared with Redis's: the bound on how long a missed message
/// leaves a copy behind.
pub(crate) const ROUND: Duration = Duration::from_secs(1);

impl RedisStore {
    /// Keeps the copy of the policies `in_force` names (asked again each round: a reload
    /// may add or drop one) until `stop`; the first round at once, and every tenth of a
    /// round until a round has read them all (the instance is not ready before it).
    pub(crate) async fn keep_runtime_limits(
        self: Arc<Self>,
        in_force: impl Fn() -> Vec<RuntimeLimitKeys> + Send + 'static,
        stop: CancellationToken,
    ) {
        let runtime = self.runtime.clone();
        loop {
            let mut read = true;
            for keys in in_force() {
                read &= self.keep_one(&keys).await;
            }
            if read {
                runtime.mark_synced();
            }
            let round = if runtime.is_synced() {
                ROUND
            } else {
                ROUND / 10
            };
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(round) => {}
                _ = runtime.behind.notified() => {}
            }
        }
    }

    /// One policy's round: expired entries ended, the version compared, the set read
    /// again when it differs. Whether the copy is at Redis's version now.
    async fn keep_one(&self, keys: &RuntimeLimitKeys) -> bool {
        let copy = self.runtime.of(&keys.policy);
        if let Err(e) = self.runtime_write(keys, &RuntimeWrite::Purge).await {
            tracing::debug!(policy = %keys.policy, error = %e, "runtime limits not purged");
        }
        let at = match self.runtime_version(keys).await {
            Ok(v) if v == copy.version() => true,
            Ok(_) => {
                copy.begin_read();
                match self.runtime_read_all(keys).await {
                    Ok((version, slots)) => {
                        let now = crate::runtime_limits::now_ms();
                        for since_ms in copy.replace(version, slots) {
                            let delay = (now - since_ms).max(0) as f64 / 1000.0;
                            self.metrics.runtime_limit_propagation.observe(delay);
                        }
                        self.metrics.runtime_limit_resyncs.inc();
                        true
                    }
                    Err(e) => {
                        // (What arrived meanwhile waits for the next read.)
                        copy.abandon_read();
                        tracing::warn!(policy = %keys.policy, error = %e, "runtime limits not read");
                        false
                    }
                }
            }
            Err(e) => {
                tracing::debug!(policy = %keys.policy, error = %e, "runtime limits' version not read");
                false
            }
        };
        self.metrics
            .runtime_limits
            .with_label_values(&[&keys.policy])
            .set(copy.len() as i64);
        at
    }
}
