//! Concurrency limits (`quotad_core::concurrency`): leases acquired, released and extended
//! on a key of a [`ConcurrencyPolicy`], one Lua script call each, ending by the store's
//! clock when nobody releases them (a crashed client cannot leak a slot).
//!
//! An acquire is a decision like a check's, with the same outcomes and fail modes: the
//! store admits or denies; when it cannot answer, `open` admits without a lease (nothing
//! holds a slot, nothing is to be released), `closed` denies, and `local` acquires in the
//! in-process store, whose lease ids say so (`local-…`), so their release goes there.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::limiter::reaper::Due;
use crate::limiter::{Decision, Limiter, Outcome};
use crate::policy::{ConcurrencyPolicy, FailMode};
use crate::store::{LeaseCall, Permit, Shed, StoreError};
use quotad_core::concurrency::{LeaseAnswer, LeaseOp};

/// A lease as its holder names it: `<32 hex digits>-<units>`, or `local-…` for one the
/// in-process store holds. The hex digits are 128 random bits: a lease cannot be guessed,
/// and no text of a client's reaches a sorted-set member but these digits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LeaseId {
    hex: String,
    units: u64,
    local: bool,
}

const LOCAL: &str = "local-";
const HEX: usize = 32;

impl LeaseId {
    fn random(units: u64, local: bool) -> Self {
        LeaseId {
            hex: format!("{:032x}", rand::random::<u128>()),
            units,
            local,
        }
    }

    /// A client's text, if it is a lease's shape with 1 ..= `limit` units.
    pub(crate) fn parse(text: &str, limit: u64) -> Option<Self> {
        let (local, rest) = match text.strip_prefix(LOCAL) {
            Some(rest) => (true, rest),
            None => (false, text),
        };
        let (hex, text) = rest.split_once('-')?;
        let hex_ok =
            hex.len() == HEX && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        // Only the digits quotad writes: no sign, no leading zero.
        let units: u64 = text.parse().ok().filter(|u| (1..=limit).contains(u))?;
        (hex_ok && text == units.to_string()).then(|| LeaseId {
            hex: hex.to_owned(),
            units,
            local,
        })
    }

    pub(crate) fn units(&self) -> u64 {
        self.units
    }
}

impl std::fmt::Display for LeaseId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let local = if self.local { LOCAL } else { "" };
        write!(f, "{local}{}-{}", self.hex, self.units)
    }
}

/// An acquire, validated by the API: 1 ..= limit units, a hold within the policy's lease.
#[derive(Debug, Clone)]
pub(crate) struct Acquire {
    pub(crate) policy: Arc<ConcurrencyPolicy>,
    pub(crate) key: String,
    pub(crate) units: u64,
    pub(crate) hold: Duration,
}

/// A release or an extend of a lease the client holds (`hold`: the extend's).
#[derive(Debug, Clone)]
pub(crate) struct Held {
    pub(crate) policy: Arc<ConcurrencyPolicy>,
    pub(crate) key: String,
    pub(crate) lease: LeaseId,
    pub(crate) hold: Duration,
}

/// The answer to an acquire.
#[derive(Debug, Clone)]
pub(crate) struct Acquired {
    pub(crate) policy: Arc<ConcurrencyPolicy>,
    pub(crate) key: String,
    pub(crate) allowed: bool,
    pub(crate) outcome: Outcome,
    /// The lease to release (an admitted acquire a store holds).
    pub(crate) lease: Option<LeaseId>,
    /// How long the lease lasts unless extended.
    pub(crate) hold: Duration,
    /// Units held under the key after the acquire (0 when no store answered).
    pub(crate) held: u64,
    /// Until the earliest lease ends by expiry (0: nothing held).
    pub(crate) reset_after_us: i64,
    /// A denied acquire: until enough leases end by expiry for it to fit.
    pub(crate) retry_after_us: i64,
}

impl Acquired {
    /// The acquire as a decision, for the answer and its RateLimit headers: the quota is
    /// the limit (held at once, over no window), `remaining` what is not held, `reset`
    /// until the earliest lease ends by expiry.
    pub(crate) fn decision(&self) -> Decision {
        let limit = self.policy.limit.get();
        let ms = |us: i64| super::ms_ceil(us);
        Decision {
            allowed: self.allowed,
            policy: self.policy.name.clone(),
            key: self.key.clone(),
            outcome: self.outcome,
            limit,
            remaining: limit.saturating_sub(self.held),
            reset_after_ms: ms(self.reset_after_us),
            retry_after_ms: ms(self.retry_after_us),
            refunded: false,
            quota: limit,
            quota_window_secs: None,
            limit_source: crate::policy::LimitSource::Config,
            charged: None,
            reservation: None,
        }
    }
}

/// Why a release or an extend changed nothing.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LeaseError {
    #[error(transparent)]
    Shed(#[from] Shed),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// How often the keys of ended leases are read.
const REAP_EVERY: Duration = Duration::from_millis(100);

/// How long a `fail_closed` acquire tells the client to wait (as a check's).
const FAIL_CLOSED_RETRY_US: i64 = super::FAIL_CLOSED_RETRY_MS as i64 * 1000;

impl Limiter {
    fn lease_key(&self, policy: &ConcurrencyPolicy, key: &str) -> String {
        self.layouts.of_concurrency(policy).storage_key(key)
    }

    /// Acquires `a.units` of `a.key` for `a.hold`, if they fit under the limit. Counted in
    /// `quotad_decisions_total` and `quotad_lease_units_total`.
    pub(crate) async fn acquire(&self, a: &Acquire) -> Result<Acquired, Shed> {
        let key = self.lease_key(&a.policy, &a.key);
        let hold_us = a.hold.as_micros() as i64;
        let lease = LeaseId::random(a.units, false);
        let call = LeaseCall {
            key: &key,
            limit: a.policy.limit.get(),
            op: LeaseOp::Acquire {
                id: &lease.hex,
                units: a.units,
                hold_us,
            },
        };
        let answer = {
            let permit = self.store.admit(1).await?;
            self.store.lease(&permit, &call).await
        };
        let acquired = match answer {
            Ok(ans) => self.acquired(a, ans, lease, Outcome::Allowed),
            Err(e) => {
                self.store_failed(&a.policy.name, &e);
                match a.policy.on_store_error {
                    FailMode::Open => self.unheld(a, true),
                    FailMode::Closed => self.unheld(a, false),
                    FailMode::Local => {
                        let lease = LeaseId::random(a.units, true);
                        let call = LeaseCall {
                            op: LeaseOp::Acquire {
                                id: &lease.hex,
                                units: a.units,
                                hold_us,
                            },
                            ..call
                        };
                        match self.local.lease(&call) {
                            Ok(ans) => self.acquired(a, ans, lease, Outcome::Local),
                            Err(full) => {
                                self.metrics.store_error(StoreError::Full(full.0).kind());
                                self.unheld(a, true)
                            }
                        }
                    }
                }
            }
        };
        self.metrics
            .decisions
            .with_label_values(&[a.policy.name.as_str(), acquired.outcome.name()])
            .inc();
        if let Some(lease) = &acquired.lease {
            self.count_lease_units(&a.policy.name, "acquired", a.units);
            let due = Due {
                key,
                policy: a.policy.clone(),
                local: lease.local,
            };
            if !self.reaper.track(&lease.hex, Instant::now() + a.hold, due) {
                self.metrics.leases_untracked.inc();
            }
        }
        Ok(acquired)
    }

    fn acquired(&self, a: &Acquire, ans: LeaseAnswer, lease: LeaseId, by: Outcome) -> Acquired {
        self.count_lease_units(&a.policy.name, "expired", ans.expired);
        Acquired {
            policy: a.policy.clone(),
            key: a.key.clone(),
            allowed: ans.ok,
            outcome: if ans.ok { by } else { Outcome::Denied },
            lease: ans.ok.then_some(lease),
            hold: a.hold,
            held: ans.held,
            reset_after_us: ans.reset_after_us,
            retry_after_us: ans.retry_after_us,
        }
    }

    /// An acquire no store answered: admitted unheld (`fail_open`) or denied.
    fn unheld(&self, a: &Acquire, open: bool) -> Acquired {
        Acquired {
            policy: a.policy.clone(),
            key: a.key.clone(),
            allowed: open,
            outcome: if open {
                Outcome::FailOpen
            } else {
                Outcome::FailClosed
            },
            lease: None,
            hold: a.hold,
            held: 0,
            reset_after_us: 0,
            retry_after_us: if open { 0 } else { FAIL_CLOSED_RETRY_US },
        }
    }

    /// Gives a lease back. `ok: false`: the key holds no such lease (never acquired,
    /// released already, or ended by expiry), and nothing changed.
    pub(crate) async fn release(&self, h: &Held) -> Result<LeaseAnswer, LeaseError> {
        let op = LeaseOp::Release {
            id: &h.lease.hex,
            units: h.lease.units,
        };
        let ans = self.lease_op(h, op).await?;
        // What the script removed: a lease named with more units than it holds frees
        // (and counts) only those it holds.
        self.count_lease_units(&h.policy.name, "released", ans.released);
        // Released now or before, or ended: nothing to read at its end.
        self.reaper.forget(&h.lease.hex);
        Ok(ans)
    }

    /// Gives back every lease of `key` (a reset): in the store and in the in-process one
    /// (`local` leases). The units are counted `released`; returns how many.
    pub(crate) async fn clear_leases(
        &self,
        policy: &ConcurrencyPolicy,
        key: &str,
    ) -> Result<u64, LeaseError> {
        let key = self.lease_key(policy, key);
        let call = LeaseCall {
            key: &key,
            limit: policy.limit.get(),
            op: LeaseOp::Clear,
        };
        let ans = {
            let permit = self.store.admit(1).await?;
            self.store
                .lease(&permit, &call)
                .await
                .inspect_err(|e| self.store_failed(&policy.name, e))?
        };
        // The in-process store never refuses a clear for room (it only removes).
        let local = self.local.lease(&call).map_or(0, |a| a.released);
        let released = ans.released + local;
        self.count_lease_units(&policy.name, "expired", ans.expired);
        self.count_lease_units(&policy.name, "released", released);
        Ok(released)
    }

    /// Moves a live lease's end to `h.hold` from now. `ok: false`: no such live lease.
    pub(crate) async fn extend(&self, h: &Held) -> Result<LeaseAnswer, LeaseError> {
        let op = LeaseOp::Extend {
            id: &h.lease.hex,
            units: h.lease.units,
            hold_us: h.hold.as_micros() as i64,
        };
        let ans = self.lease_op(h, op).await?;
        if ans.ok {
            self.count_lease_units(&h.policy.name, "extended", h.lease.units);
            let due = Due {
                key: self.lease_key(&h.policy, &h.key),
                policy: h.policy.clone(),
                local: h.lease.local,
            };
            if !self
                .reaper
                .moved(&h.lease.hex, Instant::now() + h.hold, due)
            {
                self.metrics.leases_untracked.inc();
            }
        }
        Ok(ans)
    }

    /// A release or extend where the lease lives: the in-process store for a `local-`
    /// lease, else the store. Not a decision: a store that cannot answer is an error.
    async fn lease_op(&self, h: &Held, op: LeaseOp<'_>) -> Result<LeaseAnswer, LeaseError> {
        let key = self.lease_key(&h.policy, &h.key);
        let call = LeaseCall {
            key: &key,
            limit: h.policy.limit.get(),
            op,
        };
        let ans = if h.lease.local {
            self.local
                .lease(&call)
                .map_err(|full| StoreError::Full(full.0))?
        } else {
            let permit = self.store.admit(1).await?;
            match self.store.lease(&permit, &call).await {
                Ok(a) => a,
                Err(e) => {
                    self.store_failed(&h.policy.name, &e);
                    return Err(e.into());
                }
            }
        };
        self.count_lease_units(&h.policy.name, "expired", ans.expired);
        Ok(ans)
    }

    /// Every 100 ms until `stop`: reads the keys of the leases acquired here whose end has
    /// passed, so what ended unreleased is dropped and counted `expired` then, not at the
    /// key's next operation (see [`reaper`](super::reaper)).
    pub(crate) async fn reap_until(self: Arc<Self>, stop: tokio_util::sync::CancellationToken) {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(REAP_EVERY) => {}
            }
            let ended = self.reaper.ended(Instant::now());
            let peeks = ended.iter().map(|due| self.peek_ended(due));
            futures_util::future::join_all(peeks).await;
            self.metrics.leases_tracked.set(self.reaper.len() as i64);
        }
    }

    /// One read of an ended lease's key: the store drops what has ended and says how
    /// many units (counted `expired`; 0 when released meanwhile or found by another
    /// operation first). A store that cannot answer loses only the count.
    async fn peek_ended(&self, due: &Due) {
        let call = LeaseCall {
            key: &due.key,
            limit: due.policy.limit.get(),
            op: LeaseOp::Peek,
        };
        let answer = if due.local {
            self.local
                .lease(&call)
                .map_err(|full| StoreError::Full(full.0))
        } else {
            self.store.lease(&Permit::background(), &call).await
        };
        match answer {
            Ok(ans) => self.count_lease_units(&due.policy.name, "expired", ans.expired),
            Err(e) => self.store_failed(&due.policy.name, &e),
        }
    }

    fn count_lease_units(&self, policy: &str, event: &str, units: u64) {
        if units > 0 {
            self.metrics
                .lease_units
                .with_label_values(&[policy, event])
                .inc_by(units);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_id_round_trips_and_nothing_else_parses() {
        let id = LeaseId::random(3, false);
        assert_eq!(LeaseId::parse(&id.to_string(), 10), Some(id.clone()));
        let local = LeaseId::random(2, true);
        assert!(local.to_string().starts_with("local-"));
        assert_eq!(LeaseId::parse(&local.to_string(), 10), Some(local));
        let hex = "0123456789abcdef0123456789abcdef";
        for bad in [
            String::new(),
            hex.to_owned(),
            format!("{hex}-0"),
            format!("{hex}-11"),
            format!("{hex}-+1"),
            format!("{hex}-01"),
            format!("{hex}-1-1"),
            format!("{}-1", hex.to_uppercase()),
            format!("{}-1", &hex[1..]),
            format!("{hex}0-1"),
            format!("{}:-1", &hex[1..]),
            format!("remote-{hex}-1"),
        ] {
            assert_eq!(LeaseId::parse(&bad, 10), None, "{bad:?}");
        }
    }
}
