//! `[[policy]]` with `algorithm = "concurrency"`: a concurrency limit. `limit` is the
//! units a key may hold at once, `window` the longest a lease lasts without an extend.
//! What a rate policy may have and a concurrency limit cannot is refused, each with its
//! reason.

use std::num::NonZeroU64;

use super::{NAME_RULE, Validator, raw};
use crate::policy::{self, ConcurrencyPolicy};

fn field(i: usize, name: &str) -> String {
    format!("policy[{i}].{name}")
}

impl Validator<'_> {
    /// A concurrency limit from `[[policy]]` `i`; `None` (with the errors recorded) if
    /// anything is wrong with it.
    pub(super) fn concurrency_policy(
        &mut self,
        i: usize,
        p: &raw::Policy,
    ) -> Option<ConcurrencyPolicy> {
        let before = self.errors.len();
        let name = p.name.get_ref();
        if !policy::valid_name(name) {
            self.error(&p.name, &field(i, "name"), NAME_RULE);
        } else if let Some(why) = crate::layout::reserved_name(name) {
            self.error(&p.name, &field(i, "name"), why);
        }
        let limit = self.integer(
            Some(&p.limit),
            &field(i, "limit"),
            1,
            1,
            policy::MAX_CONCURRENCY as i64,
        );
        let lease = self.duration(
            Some(&p.window),
            &field(i, "window"),
            policy::MIN_LEASE,
            policy::MIN_LEASE,
            policy::MAX_LEASE,
        );
        let on_store_error = self.on_store_error(i, p.on_store_error.as_ref());
        let not_here: [(Option<std::ops::Range<usize>>, &str, &str); 7] = [
            (
                p.burst.as_ref().map(|b| b.span()),
                "burst",
                "a concurrency limit has no burst: limit is the units held at once",
            ),
            (
                p.hot_key_rate.as_ref().map(|h| h.span()),
                "hot_key_rate",
                "hot-key slices are units of a rate taken ahead: a lease must be held in Redis to be released",
            ),
            (
                p.settle_within.as_ref().map(|s| s.span()),
                "settle_within",
                "a lease is released, not settled: settlement is for rates (token_bucket, gcra, fixed_window)",
            ),
            (
                p.global.as_ref().map(|g| g.escrow.span()),
                "global.escrow",
                "a concurrency limit cannot be global: a slot is held in one region's Redis until it is released there, and regions cannot lend what they do not know is free; give each region its own limit",
            ),
            (
                p.forward_auth.as_ref().map(|f| f.key.span()),
                "forward_auth.key",
                "a proxy's auth subrequest cannot release what it acquired (nginx, Caddy and Traefik never call back when the request ends): a lease that only expires is a rate limit; use sliding_log, or acquire and release from the service (docs/proxies.md)",
            ),
            (
                p.overrides.first().map(|o| o.limit.span()),
                "override[0].limit",
                "per-key overrides are not supported for concurrency limits: use a separate policy for the keys that need another limit",
            ),
            (
                p.shadow.as_ref().filter(|s| *s.get_ref()).map(|s| s.span()),
                "shadow",
                "a concurrency limit cannot be in shadow mode: an acquire past the limit would hold no slot to release",
            ),
        ];
        for (span, name, why) in not_here {
            if let Some(span) = span {
                self.error_at(span.start, &field(i, name), why);
            }
        }
        if self.errors.len() > before {
            return None;
        }
        Some(ConcurrencyPolicy {
            name: name.clone(),
            limit: NonZeroU64::new(limit as u64)?,
            lease,
            on_store_error,
        })
    }
}
