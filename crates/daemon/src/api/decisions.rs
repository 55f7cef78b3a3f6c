//! The one place a [`Decision`] becomes the JSON the API answers with: `POST /v1/check`
//! (one, or a batch's `results`), forward-auth's body, and the answers to an acquire and a
//! charge, which add their own fields to it. The headers of the same decisions are
//! `api::headers`'.

use serde::Serialize;

use crate::limiter::Decision;

/// `{"allowed", "policy", "key", "outcome", "limit", "limit_source", "remaining",
/// "reset_after_ms", "retry_after_ms"}`, with `"refunded": true` for a check a denied batch gave back and
/// `"reservation"` for one that opened a reservation (docs/api.md). Borrowed from the
/// decision and serialized straight into the response: nothing is built in between on
/// the check's path.
#[derive(Serialize)]
pub(super) struct Body<'a> {
    allowed: bool,
    policy: &'a str,
    key: &'a str,
    outcome: &'static str,
    limit: u64,
    limit_source: &'static str,
    remaining: u64,
    reset_after_ms: u64,
    retry_after_ms: u64,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    refunded: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    reservation: Option<&'a str>,
}

pub(super) fn body(d: &Decision) -> Body<'_> {
    Body {
        allowed: d.allowed,
        policy: &d.policy,
        key: &d.key,
        outcome: d.outcome.name(),
        limit: d.limit,
        limit_source: d.limit_source.name(),
        remaining: d.remaining,
        reset_after_ms: d.reset_after_ms,
        retry_after_ms: d.retry_after_ms,
        refunded: d.refunded,
        reservation: d.reservation.as_ref().map(|r| r.as_str()),
    }
}

/// The body with more fields beside the decision's (an acquire's lease, a charge's units).
pub(super) fn body_with(d: &Decision, more: serde_json::Value) -> serde_json::Value {
    let mut v = serde_json::to_value(body(d)).unwrap_or_default();
    if let (Some(v), serde_json::Value::Object(more)) = (v.as_object_mut(), more) {
        v.extend(more);
    }
    v
}

/// A batch's answer: `{"allowed": <every check allowed>, "results": [decision, ...]}`.
#[derive(Serialize)]
pub(super) struct Batch<'a> {
    allowed: bool,
    results: Vec<Body<'a>>,
}

pub(super) fn batch(ds: &[Decision]) -> Batch<'_> {
    Batch {
        allowed: ds.iter().all(|d| d.allowed),
        results: ds.iter().map(body).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Outcome;

    #[test]
    fn a_decision_is_its_documented_fields_and_no_more() {
        let d = Decision::for_test("api", "k", Outcome::FailOpen, 10, Some(1), 0, 0, 0);
        let v = serde_json::to_value(body(&d)).unwrap();
        let mut fields: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        fields.sort_unstable();
        assert_eq!(
            fields,
            [
                "allowed",
                "key",
                "limit",
                "limit_source",
                "outcome",
                "policy",
                "remaining",
                "reset_after_ms",
                "retry_after_ms"
            ]
        );
        assert_eq!(v["outcome"], "fail_open");
        assert_eq!(v["limit_source"], "config");
        assert_eq!(serde_json::to_value(batch(&[d])).unwrap()["allowed"], true);
    }
}
