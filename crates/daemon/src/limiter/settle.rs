//! Costs counted after the work (`quotad_core::settlement`): a check that reserves an
//! estimate, its settlement at the real cost, and a charge that is never denied (Envoy's
//! response path). Policies with `settle_within` only: token buckets, GCRA and fixed
//! windows of local policies (config validation).
//!
//! A reservation is opened only by the store's own admission. A fail mode's answer
//! (`fail_open`, `fail_closed`, `local`) opens none: there is nothing to settle, and the
//! estimate is what the key was charged (`local`: in the fallback store).

use crate::layout::{PolicyLayout, ReservationId};
use crate::limiter::{Charged, Check, Decision, Limiter, Outcome, Target, decision, store_call};
use crate::policy::{FailMode, Policy};
use crate::store::{Ends, Permit, SettleCall, SettleReply, Shed, StoreCall, StoreError};
use quotad_core::algorithm::Op;
use quotad_core::settlement::Settled;

/// Why a settlement changed nothing.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SettleError {
    #[error(transparent)]
    Shed(#[from] Shed),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// How long `policy` keeps a reservation, in ms (0 for a policy without settlement).
fn keep_ms(policy: &Policy) -> i64 {
    policy.settle_within.map_or(0, |d| d.as_millis() as i64)
}

fn settle_call<'a>(
    check: &'a Check,
    key: &'a str,
    reservation: &'a str,
    reset_mark: &'a str,
) -> SettleCall<'a> {
    SettleCall {
        algorithm: check.policy.algorithm,
        limits: check.policy.limits(),
        key,
        reservation,
        reset_mark,
        keep_ms: keep_ms(&check.policy),
        member: "",
        periods: check.policy.periods(),
    }
}

/// What a reset of a key of `policy` stored at `key` ends beside its state: the
/// reservations open on it, for a policy that takes settlements (`mark`: the key's
/// [`PolicyLayout::reset_mark_key`]).
pub(super) fn reset_ends<'a>(policy: &Policy, mark: &'a str) -> Option<Ends<'a>> {
    policy.settle_within.map(|_| Ends {
        mark,
        keep_ms: keep_ms(policy),
    })
}

impl Limiter {
    /// A reserving check (`key` its target): the store admits the estimate and opens the
    /// reservation in one script; its id goes back with the decision.
    pub(super) async fn decide_reserving(
        &self,
        permit: &Permit<'_>,
        check: &Check,
        key: &Target,
    ) -> Decision {
        let id = ReservationId::random();
        let reservation = PolicyLayout::reservation_key(&key.key, &id);
        let mark = PolicyLayout::reset_mark_key(&key.key);
        match self
            .store
            .reserve(
                permit,
                &settle_call(check, &key.key, &reservation, &mark),
                check.cost,
            )
            .await
        {
            Ok(v) => {
                let outcome = if v.allowed {
                    Outcome::Allowed
                } else {
                    Outcome::Denied
                };
                let charged = (v.allowed && check.cost > 0).then_some(Charged::Primary);
                let mut d = decision(check, &v, outcome, charged);
                if v.allowed {
                    d.reservation = Some(id);
                }
                d
            }
            Err(e) => {
                self.store_failed(&check.policy.name, &e);
                let call = store_call(check, key, Op::Check { cost: check.cost }, "");
                self.fallback(check, &call)
            }
        }
    }

    /// Settles reservation `id` of `check`'s key (its policy, key and group; the cost is
    /// ignored) at the real `cost`: what it is above the estimate is charged, as debt
    /// where the key lacks it, what it is below is given back. Settling again charges
    /// nothing; an unknown or expired reservation charges nothing and is answered
    /// [`Settled::Unknown`]. Counted in `quotad_settlements_total`.
    pub(crate) async fn settle(
        &self,
        check: &Check,
        id: &ReservationId,
        cost: u64,
    ) -> Result<SettleReply, SettleError> {
        let key = self.target(check);
        let reservation = PolicyLayout::reservation_key(&key.key, id);
        let mark = PolicyLayout::reset_mark_key(&key.key);
        let call = settle_call(check, &key.key, &reservation, &mark);
        let name = check.policy.name.as_str();
        let permit = self.store.admit(1).await?;
        let reply = match self.store.settle(&permit, &call, cost).await {
            Ok(r) => r,
            Err(e) => {
                self.store_failed(&check.policy.name, &e);
                self.count_settlement(name, "failed");
                return Err(e.into());
            }
        };
        match reply.settled {
            Settled::Now { charged, refunded } => {
                self.count_settlement(name, "settled");
                self.count_units(name, "charged", charged);
                self.count_units(name, "refunded", refunded);
            }
            Settled::Already => self.count_settlement(name, "already_settled"),
            Settled::Unknown => self.count_settlement(name, "unknown"),
            Settled::Ended => self.count_settlement(name, "ended_by_reset"),
        }
        Ok(reply)
    }

    /// Charges `check`'s cost whether or not the key has it (a cost counted after the
    /// work, on Envoy's response path): never denied. A store that cannot answer loses
    /// the charge (`fail_open`, counted `failed`), except under `local`, where the
    /// fallback store takes it.
    pub(crate) async fn charge(&self, check: &Check) -> Result<Decision, Shed> {
        let key = self.target(check);
        let call = store_call(check, &key, Op::Check { cost: check.cost }, "");
        let name = check.policy.name.as_str();
        let permit = self.store.admit(1).await?;
        let d = match self.store.charge(&permit, &call, check.cost).await {
            Ok(v) => decision(check, &v, Outcome::Allowed, Some(Charged::Primary)),
            Err(e) => {
                self.store_failed(&check.policy.name, &e);
                match check.policy.on_store_error {
                    FailMode::Local => self.charge_locally(check, &call),
                    _ => None,
                }
                .unwrap_or_else(|| {
                    self.count_settlement(name, "failed");
                    super::unenforced(check, true)
                })
            }
        };
        if d.charged.is_some() {
            self.count_settlement(name, "charged");
            self.count_units(name, "charged", check.cost);
        }
        Ok(d)
    }

    fn charge_locally(&self, check: &Check, call: &StoreCall<'_>) -> Option<Decision> {
        match self.local.charge(call, check.cost) {
            Ok(v) => Some(decision(check, &v, Outcome::Local, Some(Charged::Local))),
            Err(full) => {
                self.metrics.store_error(StoreError::Full(full.0).kind());
                None
            }
        }
    }

    fn count_settlement(&self, policy: &str, result: &str) {
        self.metrics
            .settlements
            .with_label_values(&[policy, result])
            .inc();
    }

    fn count_units(&self, policy: &str, direction: &str, units: u64) {
        if units > 0 {
            self.metrics
                .settled_units
                .with_label_values(&[policy, direction])
                .inc_by(units);
        }
    }
}
