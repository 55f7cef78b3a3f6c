//! The request log (`[log] requests`, off by default): one line for every Nth request, at
//! info level with target `quotad::request`, from HTTP and gRPC alike. It says which entry
//! point, route or method, status or code, how long the answer took, the trace id the
//! caller sent (W3C `traceparent`, else `x-request-id`), and for a decision its policy,
//! outcome and key hash. A key is never written: an API key or a user's address is the
//! caller's secret, so the line carries the first 12 hex digits of its SHA-256 (enough to
//! see one key recur; not a protection for keys from a small space, such as addresses).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::http::HeaderMap;
use sha2::{Digest, Sha256};

use crate::limiter::Decision;

/// Requests seen since start, for the sample.
static SEEN: AtomicU64 = AtomicU64::new(0);

/// Whether this request is one of the sample: every `every`th (0: none).
pub(crate) fn sampled(every: u64) -> bool {
    every != 0 && SEEN.fetch_add(1, Ordering::Relaxed) % every == 0
}

/// Marks a request of the sample: handlers that decide put a [`Summary`] on its response.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sampled;

/// What a decision adds to its request's line.
#[derive(Debug, Clone)]
pub(crate) struct Summary {
    pub(crate) policy: String,
    pub(crate) outcome: &'static str,
    pub(crate) key_hash: String,
    /// Checks in the request (a batch's size; 1 otherwise).
    pub(crate) checks: usize,
}

impl Summary {
    /// Of a request's decisions: the first denied one's (else the first's), and how many.
    pub(crate) fn of(ds: &[Decision]) -> Option<Summary> {
        let d = ds.iter().find(|d| !d.allowed).or_else(|| ds.first())?;
        Some(Summary {
            policy: d.policy.clone(),
            outcome: d.outcome.name(),
            key_hash: key_hash(&d.key),
            checks: ds.len(),
        })
    }
}

/// The first 12 hex digits of the key's SHA-256.
pub(crate) fn key_hash(key: &str) -> String {
    let digest = Sha256::digest(key.as_bytes());
    hex::encode(&digest[..6])
}

/// The trace id the caller sent: a `traceparent`'s trace-id, else `x-request-id` (at
/// most 128 visible ASCII characters); none otherwise.
pub(crate) fn trace_id(headers: &HeaderMap) -> Option<String> {
    let visible = |s: &str| s.len() <= 128 && s.bytes().all(|b| b.is_ascii_graphic());
    headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split('-').nth(1))
        .filter(|id| id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()))
        .or_else(|| {
            headers
                .get("x-request-id")
                .and_then(|v| v.to_str().ok())
                .filter(|v| visible(v))
        })
        .map(str::to_owned)
}

/// One request's line.
pub(crate) struct Line<'a> {
    pub(crate) entry: &'static str,
    /// The route's template (HTTP) or the method (gRPC).
    pub(crate) route: &'a str,
    /// The HTTP status or the gRPC code's name.
    pub(crate) status: &'a str,
    pub(crate) took: Duration,
    pub(crate) trace_id: Option<String>,
    pub(crate) summary: Option<&'a Summary>,
}

impl Line<'_> {
    pub(crate) fn write(&self) {
        let s = self.summary;
        tracing::info!(
            target: "quotad::request",
            entry = self.entry,
            route = self.route,
            status = self.status,
            duration_us = self.took.as_micros() as u64,
            trace_id = self.trace_id.as_deref(),
            policy = s.map(|s| s.policy.as_str()),
            outcome = s.map(|s| s.outcome),
            key_sha256 = s.map(|s| s.key_hash.as_str()),
            checks = s.map(|s| s.checks),
            "request"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trace_id_is_the_callers_when_well_formed() {
        let mut h = HeaderMap::new();
        assert_eq!(trace_id(&h), None);
        h.insert("x-request-id", "req-7".parse().unwrap());
        assert_eq!(trace_id(&h).as_deref(), Some("req-7"));
        h.insert(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
                .parse()
                .unwrap(),
        );
        assert_eq!(
            trace_id(&h).as_deref(),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        h.insert("traceparent", "garbage".parse().unwrap());
        assert_eq!(trace_id(&h).as_deref(), Some("req-7"));
        h.insert("x-request-id", "has space".parse().unwrap());
        assert_eq!(trace_id(&h), None);
    }

    #[test]
    fn a_key_is_logged_as_its_hash_only() {
        let h = key_hash("sk_live_secret");
        assert_eq!(h.len(), 12);
        assert!(!h.contains("secret"));
        assert_eq!(h, key_hash("sk_live_secret"));
    }

    #[test]
    fn one_in_every_n_is_sampled_and_none_at_zero() {
        assert!((0..100).all(|_| !sampled(0)));
        let n = (0..300).filter(|_| sampled(3)).count();
        assert_eq!(n, 100);
    }
}
