//! The decision: one check (or a batch) against a policy, through the store, with the
//! policy's shadow mode and store-failure mode applied. Returns [`Decision`] values: a
//! store failure becomes `fail_open`, `fail_closed` or a `local` decision, and every one is
//! counted. The one refusal is [`Shed`]: quotad itself is at capacity (see
//! [`crate::store::redis::admission`]); that is not a decision, and nothing was charged.
//!
//! The limiter owns no state of its own beyond a request-id counter; it holds the store, the
//! in-process fallback store and the metrics handles it was given.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::layout::{GlobalLayout, Layouts, PolicyLayout, ReservationId, ScriptShape};
use crate::metrics::Metrics;
use crate::policy::{FailMode, LimitSource, Policy};
use crate::store::memory::MemoryStore;
use crate::store::{
    Checked, Forget, GlobalCall, Permit, Shed, SliceMark, Source, Store, StoreCall, StoreError,
    UsageReply, takes_slices,
};
use quotad_core::algorithm::{Algorithm, Op, Verdict};

mod lease;
mod reaper;
mod runtime;
mod settle;
pub(crate) use lease::{Acquire, Held, LeaseError, LeaseId};
pub(crate) use runtime::NewLimit;
pub(crate) use settle::SettleError;

/// How a decision was reached: the API's `outcome` and the metrics' label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Allowed,
    Denied,
    Shadow,
    FailOpen,
    FailClosed,
    Local,
}

impl Outcome {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Outcome::Allowed => "allowed",
            Outcome::Denied => "denied",
            Outcome::Shadow => "shadow",
            Outcome::FailOpen => "fail_open",
            Outcome::FailClosed => "fail_closed",
            Outcome::Local => "local",
        }
    }

    /// Whether a store decided (and counted) this request.
    pub(crate) fn is_enforced(self) -> bool {
        matches!(
            self,
            Outcome::Allowed | Outcome::Denied | Outcome::Shadow | Outcome::Local
        )
    }
}

/// One check, validated by the API: the policy exists, the key is within limits, the cost
/// fits the policy's capacity.
#[derive(Debug, Clone)]
pub(crate) struct Check {
    pub(crate) policy: Arc<Policy>,
    pub(crate) key: String,
    pub(crate) cost: u64,
    /// The co-location group (a composite limit): the hash tag of the key's storage key,
    /// so a batch whose checks all name it is decided by one all-or-nothing script.
    pub(crate) group: Option<String>,
    /// Admitted, the cost is a reservation to settle at the real cost later
    /// ([`Limiter::settle`]); single checks of policies with `settle_within` only.
    pub(crate) reserve: bool,
}

/// The answer to one check: a domain value. The API turns it into its JSON body and
/// headers in one place (`api::decisions`, `api::headers`).
#[derive(Debug, Clone)]
pub(crate) struct Decision {
    pub(crate) allowed: bool,
    pub(crate) policy: String,
    pub(crate) key: String,
    pub(crate) outcome: Outcome,
    pub(crate) limit: u64,
    pub(crate) remaining: u64,
    pub(crate) reset_after_ms: u64,
    pub(crate) retry_after_ms: u64,
    /// In a denied batch: this check had been admitted and its units were given back.
    pub(crate) refunded: bool,
    /// The quota `remaining` counts against: the policy's capacity (`burst` for
    /// token_bucket and gcra, else `limit`). The RateLimit-Policy `q`.
    pub(crate) quota: u64,
    /// The time `quota` is allocated over, in whole seconds, when it is a whole number of
    /// them ([`Policy::quota_window_secs`]). The RateLimit-Policy `w`.
    pub(crate) quota_window_secs: Option<u64>,
    /// Where `limit` comes from (the config's policy, or an override of it).
    pub limit_source: LimitSource,
    /// Which store charged this check (to refund it there).
    charged: Option<Charged>,
    /// The reservation a reserving check opened, to settle with `POST /v1/settle`: only
    /// when the store admitted it (a fail mode's answer opens none).
    pub(crate) reservation: Option<ReservationId>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Charged {
    Primary,
    /// From a hot key's slice, spent in memory: given back to that slice while it lasts
    /// (in Redis its units are held by this instance, not in the key's bucket or count).
    Slice(SliceMark),
    Local,
}

impl Decision {
    /// A decision as the limiter would return it, for other modules' unit tests.
    #[cfg(test)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn for_test(
        policy: &str,
        key: &str,
        outcome: Outcome,
        quota: u64,
        quota_window_secs: Option<u64>,
        remaining: u64,
        reset_after_ms: u64,
        retry_after_ms: u64,
    ) -> Decision {
        Decision {
            allowed: !matches!(outcome, Outcome::Denied | Outcome::FailClosed),
            policy: policy.to_owned(),
            key: key.to_owned(),
            outcome,
            limit: quota,
            remaining,
            reset_after_ms,
            retry_after_ms,
            refunded: false,
            quota,
            quota_window_secs,
            limit_source: LimitSource::Config,
            charged: None,
            reservation: None,
        }
    }
}

/// Why a reset changed nothing.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ResetError {
    #[error(transparent)]
    Shed(#[from] Shed),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Why a usage read has no answer (nothing is made up in its place: it is a read, not a
/// decision with a fail mode).
#[derive(Debug, thiserror::Error)]
pub(crate) enum UsageError {
    #[error(transparent)]
    Shed(#[from] Shed),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// How long a `fail_closed` answer tells clients to wait: about the time the store's
/// supervisor needs to notice a recovered Redis (probe interval plus reconnect).
const FAIL_CLOSED_RETRY_MS: u64 = 1000;

pub(crate) struct Limiter {
    store: Arc<Store>,
    /// The embedded store for `on_store_error = "local"` (unused when `store` is memory).
    local: Arc<MemoryStore>,
    /// Where each policy's keys live (the store's layout).
    layouts: Arc<Layouts>,
    metrics: Arc<Metrics>,
    /// Unique request ids for sliding-log entries: a random per-process prefix and a counter,
    /// so ids from several daemons sharing a Redis never collide.
    id_prefix: String,
    next_id: AtomicU64,
    /// Command/reply errors seen, to log them with backoff.
    script_errors: AtomicU64,
    /// Leases acquired here and not seen released, read when they end (`reaper`).
    reaper: reaper::Reaper,
}

/// Microseconds as whole milliseconds, rounded up (0 for none): the API's `*_ms`.
pub(crate) fn ms_ceil(us: i64) -> u64 {
    if us <= 0 {
        0
    } else {
        (us as u64).div_ceil(1000)
    }
}

impl Limiter {
    pub(crate) fn new(
        store: Arc<Store>,
        local: Arc<MemoryStore>,
        layouts: Arc<Layouts>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Limiter {
            store,
            layouts,
            local,
            metrics,
            id_prefix: format!("{:016x}", rand::random::<u64>()),
            next_id: AtomicU64::new(0),
            script_errors: AtomicU64::new(0),
            reaper: reaper::Reaper::default(),
        }
    }

    fn member(&self, algorithm: Algorithm) -> String {
        if algorithm == Algorithm::SlidingLog {
            format!(
                "{}.{}",
                self.id_prefix,
                self.next_id.fetch_add(1, Ordering::Relaxed)
            )
        } else {
            String::new()
        }
    }

    /// Where a check's state lives.
    fn target(&self, check: &Check) -> Target {
        let layout = self.layouts.of(&check.policy);
        Target {
            key: match &check.group {
                Some(group) => layout.grouped_key(group, &check.key),
                None => layout.storage_key(&check.key),
            },
            global: layout
                .global
                .clone()
                .map(|g| (g.shape_for(&check.policy), g)),
        }
    }

    /// Decides one check.
    pub(crate) async fn check(&self, check: &Check) -> Result<Decision, Shed> {
        let key = self.target(check);
        let d = if check.reserve {
            let permit = self.store.admit(1).await?;
            self.decide_reserving(&permit, check, &key).await
        } else {
            let member = self.member(check.policy.algorithm);
            let call = store_call(check, &key, Op::Check { cost: check.cost }, &member);
            let answer = self.store.check(&call, self.hot_rate(check)).await?;
            self.decided(check, &call, answer)
        };
        self.count(&d);
        Ok(d)
    }

    /// The policy's `hot_key_rate` when this check may take part in hot-key slices: its
    /// policy sets one (fixed windows, token buckets and GCRA), it is enforced (a shadow
    /// policy is decided in Redis), it spends (not a peek) and is not part of a
    /// co-location group.
    fn hot_rate(&self, check: &Check) -> Option<u64> {
        let policy = &check.policy;
        let takes = takes_slices(policy.algorithm)
            && policy.global.is_none()
            && !policy.shadow
            && check.cost > 0
            && !check.reserve
            && check.group.is_none();
        takes.then_some(policy.hot_key_rate?.get())
    }

    /// Decides a batch: all checks run concurrently; if any is denied, the others that were
    /// charged are refunded, so a denied batch costs nothing (envoyproxy/ratelimit#1060).
    /// Checks whose denial is remembered are answered from memory; the others still go to
    /// the store (their answers are part of the response).
    pub(crate) async fn check_batch(&self, checks: &[Check]) -> Result<Vec<Decision>, Shed> {
        let keys: Vec<Target> = checks.iter().map(|c| self.target(c)).collect();
        if one_group(checks) {
            return self.check_group(checks, &keys).await;
        }
        let members: Vec<String> = checks
            .iter()
            .map(|c| self.member(c.policy.algorithm))
            .collect();
        let calls: Vec<(StoreCall<'_>, Option<u64>)> = checks
            .iter()
            .zip(&keys)
            .zip(&members)
            .map(|((c, k), m)| {
                let call = store_call(c, k, Op::Check { cost: c.cost }, m);
                (call, self.hot_rate(c))
            })
            .collect();
        // The refunds reuse the batch's permit.
        let (answers, permit) = self.store.check_each(&calls).await?;
        let permit = &permit;
        let mut decisions: Vec<Decision> = checks
            .iter()
            .zip(&calls)
            .zip(answers)
            .map(|((c, (call, _)), answer)| self.decided(c, call, answer))
            .collect();
        if decisions.iter().any(|d| !d.allowed) {
            let refunds = checks
                .iter()
                .zip(&keys)
                .zip(&members)
                .zip(decisions.iter_mut())
                .filter(|(_, d)| d.charged.is_some())
                .map(|(((c, k), m), d)| async move {
                    if self.refund(permit, c, k, m, d.charged).await {
                        d.refunded = true;
                    }
                });
            futures_util::future::join_all(refunds).await;
        }
        for d in &decisions {
            self.count(d);
        }
        Ok(decisions)
    }

    /// A batch whose checks share one co-location group: one all-or-nothing call (see
    /// [`Store::apply_all`]), so no partial charge is ever visible, not even for a moment.
    /// In a denied batch, the checks that alone would have passed are reported `refunded`
    /// (nothing of theirs was spent), as in a batch decided check by check.
    async fn check_group(&self, checks: &[Check], keys: &[Target]) -> Result<Vec<Decision>, Shed> {
        let permit = self.store.admit(1).await?;
        let members: Vec<String> = checks
            .iter()
            .map(|c| self.member(c.policy.algorithm))
            .collect();
        let calls: Vec<StoreCall<'_>> = checks
            .iter()
            .zip(keys)
            .zip(&members)
            .map(|((c, k), m)| store_call(c, k, Op::Check { cost: c.cost }, m))
            .collect();
        let enforced: Vec<bool> = checks.iter().map(|c| !c.policy.shadow).collect();
        let decisions = match self.store.apply_all(&permit, &calls, &enforced).await {
            Ok(verdicts) => group_decisions(checks, &verdicts, Outcome::Allowed, Charged::Primary),
            Err(e) => {
                self.store_failed(&checks[0].policy.name, &e);
                self.group_fallback(checks, &calls, &enforced)
            }
        };
        for d in &decisions {
            self.count(d);
        }
        Ok(decisions)
    }

    /// A group's checks when the store failed: each policy's `on_store_error`; the `local`
    /// ones decided together, all or nothing, in the in-process store.
    fn group_fallback(
        &self,
        checks: &[Check],
        calls: &[StoreCall<'_>],
        enforced: &[bool],
    ) -> Vec<Decision> {
        let local: Vec<usize> = (0..checks.len())
            .filter(|&i| checks[i].policy.on_store_error == FailMode::Local)
            .collect();
        let local_calls: Vec<StoreCall<'_>> = local.iter().map(|&i| calls[i]).collect();
        let local_enforced: Vec<bool> = local.iter().map(|&i| enforced[i]).collect();
        let local_checks: Vec<Check> = local.iter().map(|&i| checks[i].clone()).collect();
        let mut local_decisions = match self.local.apply_all(&local_calls, &local_enforced) {
            Ok(v) => group_decisions(&local_checks, &v, Outcome::Local, Charged::Local),
            Err(full) => {
                self.metrics.store_error(StoreError::Full(full.0).kind());
                local_checks.iter().map(|c| unenforced(c, true)).collect()
            }
        }
        .into_iter();
        checks
            .iter()
            .map(|c| match c.policy.on_store_error {
                FailMode::Open => unenforced(c, true),
                FailMode::Closed => unenforced(c, false),
                FailMode::Local => local_decisions
                    .next()
                    .unwrap_or_else(|| unenforced(c, true)),
            })
            .collect()
    }

    /// What `check`'s key used and holds in this region's store, read without a write
    /// (`check.cost` is not spent: the read is the store's `usage` operation).
    pub(crate) async fn usage(&self, check: &Check) -> Result<UsageReply, UsageError> {
        let key = self.target(check);
        let call = store_call(check, &key, Op::Check { cost: 0 }, "");
        let permit = self.store.admit(1).await?;
        let reply = self.store.usage(&permit, &call).await;
        if let Err(e) = &reply {
            self.metrics.store_error(e.kind());
        }
        Ok(reply?)
    }

    /// Forgets what a key's user spent, in this region's store and in the local fallback:
    /// a local policy's key whole; a global policy's bucket only (its lease book and
    /// counters are the coordinator's: deleting them would let the region lend again what
    /// it already lent).
    pub(crate) async fn reset(
        &self,
        policy: &Policy,
        key: &str,
        group: Option<&str>,
    ) -> Result<(), ResetError> {
        let layout = self.layouts.of(policy);
        let storage_key = match group {
            Some(g) => layout.grouped_key(g, key),
            None => layout.storage_key(key),
        };
        // A global key: what the user spent, never the coordinator's books.
        let forget = match layout.global {
            Some(_) => Forget::Spent,
            None => Forget::All,
        };
        // A settling policy's reset ends the reservations open on the key too.
        let mark = PolicyLayout::reset_mark_key(&storage_key);
        let ends = settle::reset_ends(policy, &mark);
        let permit = self.store.admit(1).await?;
        // The store first: when it fails the caller is told nothing changed, so the local
        // fallback's state must not have changed either.
        self.store
            .reset(&permit, &storage_key, forget, ends)
            .await?;
        self.local.reset(&storage_key, forget, ends);
        Ok(())
    }

    fn count(&self, d: &Decision) {
        self.metrics
            .decisions
            .with_label_values(&[d.policy.as_str(), d.outcome.name()])
            .inc();
    }

    /// A check's decision from the store's answer: counted where memory answered it, the
    /// policy's `on_store_error` where the store failed.
    fn decided(&self, check: &Check, call: &StoreCall<'_>, answer: Checked) -> Decision {
        let (v, from) = match answer {
            Checked::Decided(v, from) => (v, from),
            Checked::Failed(e) => {
                self.store_failed(&check.policy.name, &e);
                return self.fallback(check, call);
            }
        };
        let policy = check.policy.name.as_str();
        let by = match from {
            Source::Slice(mark) => {
                self.metrics.hot_admits.with_label_values(&[policy]).inc();
                Some(Charged::Slice(mark))
            }
            Source::Remembered => {
                self.metrics
                    .deny_cache_hits
                    .with_label_values(&[policy])
                    .inc();
                None
            }
            Source::Call(slice) => Some(slice.map_or(Charged::Primary, Charged::Slice)),
        };
        let outcome = if v.allowed {
            Outcome::Allowed
        } else {
            Outcome::Denied
        };
        let charged = by.filter(|_| v.allowed && check.cost > 0);
        decision(check, &v, outcome, charged)
    }

    /// A check the store could not decide, answered by its policy's `on_store_error`.
    fn fallback(&self, check: &Check, call: &StoreCall<'_>) -> Decision {
        match check.policy.on_store_error {
            FailMode::Open => unenforced(check, true),
            FailMode::Closed => unenforced(check, false),
            FailMode::Local => match self.local.apply(call) {
                Ok(v) => {
                    let charged = (v.allowed && check.cost > 0).then_some(Charged::Local);
                    decision(check, &v, Outcome::Local, charged)
                }
                // The in-process store is at its bound too: nothing can enforce
                // this check, and `local` leans to availability.
                Err(full) => {
                    self.metrics.store_error(StoreError::Full(full.0).kind());
                    unenforced(check, true)
                }
            },
        }
    }

    /// Counts a store error, and logs it: a command or reply error (Redis answered with an
    /// error or a malformed reply: a bug or a broken server, not an outage) loudly, but not
    /// once per request: the 1st, 2nd, 4th, 8th... occurrence.
    /// `policy` names the policy (or concurrency limit) the call was for.
    fn store_failed(&self, policy: &str, e: &StoreError) {
        self.metrics.store_error(e.kind());
        match e {
            StoreError::Command(_) | StoreError::Reply(_) => {
                let n = self.script_errors.fetch_add(1, Ordering::Relaxed) + 1;
                if n.is_power_of_two() {
                    tracing::warn!(policy, error = %e, occurrences = n, "limiter script failed");
                }
            }
            StoreError::CircuitOpen => {}
            _ => tracing::debug!(policy, error = %e, "store call failed"),
        }
    }

    async fn refund(
        &self,
        permit: &Permit<'_>,
        check: &Check,
        key: &Target,
        member: &str,
        charged: Option<Charged>,
    ) -> bool {
        let policy = &check.policy;
        let call = store_call(check, key, Op::Refund { cost: check.cost }, member);
        let given = match charged {
            Some(Charged::Primary) => self.store.apply(permit, &call).await.map(|_| ()),
            Some(Charged::Slice(mark)) => {
                self.store
                    .refund_spent(permit, &call, mark, check.cost)
                    .await
            }
            // A refund only lowers a key the store holds: never refused for room.
            Some(Charged::Local) => return self.local.apply(&call).is_ok(),
            None => return false,
        };
        match given {
            Ok(()) => true,
            Err(e) => {
                self.metrics.store_error(e.kind());
                self.metrics.refund_errors.inc();
                tracing::debug!(policy = %policy.name, error = %e, "refund failed");
                false
            }
        }
    }
}

/// Whether a batch is one co-location group: every check names the same group.
fn one_group(checks: &[Check]) -> bool {
    match checks.first().and_then(|c| c.group.as_deref()) {
        Some(g) => checks.iter().all(|c| c.group.as_deref() == Some(g)),
        None => false,
    }
}

/// A group's decisions from its verdicts: charged (`by`) if the batch passed (no enforced
/// check denied), otherwise nothing was, and the checks that alone would have passed are
/// `refunded`.
fn group_decisions(
    checks: &[Check],
    verdicts: &[Verdict],
    allowed: Outcome,
    by: Charged,
) -> Vec<Decision> {
    let passed = checks
        .iter()
        .zip(verdicts)
        .all(|(c, v)| v.allowed || c.policy.shadow);
    checks
        .iter()
        .zip(verdicts)
        .map(|(c, v)| {
            let outcome = match (v.allowed, allowed) {
                (false, Outcome::Allowed) => Outcome::Denied,
                (_, o) => o,
            };
            let charged = (passed && v.allowed && c.cost > 0).then_some(by);
            let mut d = decision(c, v, outcome, charged);
            d.refunded = !passed && v.allowed && c.cost > 0;
            d
        })
        .collect()
}

/// A check's storage key, and for a global policy its per-policy keys and script numbers:
/// what [`Layouts`] says about it.
struct Target {
    key: String,
    global: Option<(ScriptShape, Arc<GlobalLayout>)>,
}

fn store_call<'a>(check: &'a Check, key: &'a Target, op: Op, member: &'a str) -> StoreCall<'a> {
    StoreCall {
        algorithm: check.policy.algorithm,
        limits: check.policy.limits(),
        key: &key.key,
        op,
        member,
        global: key.global.as_ref().map(|(shape, g)| GlobalCall {
            user_key: &check.key,
            keys: &g.keys,
            shape: *shape,
            limit: check.policy.key_limit(),
        }),
        periods: check.policy.periods(),
    }
}

fn decision(check: &Check, v: &Verdict, outcome: Outcome, charged: Option<Charged>) -> Decision {
    let policy = &check.policy;
    let (allowed, outcome) = match (v.allowed, policy.shadow) {
        (false, true) => (true, Outcome::Shadow),
        (a, _) => (a, outcome),
    };
    Decision {
        allowed,
        policy: policy.name.clone(),
        key: check.key.clone(),
        outcome,
        limit: policy.limit.get(),
        remaining: v.remaining,
        reset_after_ms: ms_ceil(v.reset_after_us),
        retry_after_ms: if v.allowed {
            0
        } else {
            ms_ceil(v.retry_after_us)
        },
        refunded: false,
        quota: policy.capacity(),
        quota_window_secs: policy.quota_window_secs(),
        limit_source: policy.limit_from,
        charged,
        reservation: None,
    }
}

/// A decision the store did not make: allowed unenforced (`fail_open`) or denied
/// (`fail_closed`). `remaining` is 0: nothing is known about the key. A shadow policy
/// never denies: its `fail_closed` is reported as the `shadow` denial it would have made.
fn unenforced(check: &Check, open: bool) -> Decision {
    let outcome = if open {
        Outcome::FailOpen
    } else {
        Outcome::FailClosed
    };
    let nothing_known = Verdict {
        allowed: open,
        remaining: 0,
        reset_after_us: 0,
        retry_after_us: if open {
            0
        } else {
            FAIL_CLOSED_RETRY_MS as i64 * 1000
        },
    };
    decision(check, &nothing_known, outcome, None)
}
