//! The one place a [`Decision`] becomes the JSON the API answers with: `POST /v1/check`
//! (one, or a batch's `results`), forward-auth's body, and the answers to an acquire and a
//! charge, which add their own fields to it. The headers of the same decisions are
//! `api::headers`'.

use serde_json::{Value, json};

use crate::limiter::Decision;

/// `{"allowed", "policy", "key", "outcome", "limit", "remaining", "reset_after_ms",
/// "retry_after_ms"}`, with `"refunded": true` for a check a denied batch gave back and
/// `"reservation"` for one that opened a reservation (docs/api.md).
pub fn body(d: &Decision) -> Value {
    let mut v = json!({
        "allowed": d.allowed,
        "policy": d.policy,
        "key": d.key,
        "outcome": d.outcome.name(),
        "limit": d.limit,
        "remaining": d.remaining,
        "reset_after_ms": d.reset_after_ms,
        "retry_after_ms": d.retry_after_ms,
    });
    if d.refunded {
        v["refunded"] = json!(true);
    }
    if let Some(r) = &d.reservation {
        v["reservation"] = json!(r.as_str());
    }
    v
}

/// A batch's answer: `{"allowed": <every check allowed>, "results": [decision, ...]}`.
pub fn batch(ds: &[Decision]) -> Value {
    json!({
        "allowed": ds.iter().all(|d| d.allowed),
        "results": ds.iter().map(body).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Outcome;

    #[test]
    fn a_decision_is_its_documented_fields_and_no_more() {
        let d = Decision::for_test("api", "k", Outcome::FailOpen, 10, Some(1), 0, 0, 0);
        let v = body(&d);
        let mut fields: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        fields.sort_unstable();
        assert_eq!(
            fields,
            [
                "allowed",
                "key",
                "limit",
                "outcome",
                "policy",
                "remaining",
                "reset_after_ms",
                "retry_after_ms"
            ]
        );
        assert_eq!(v["outcome"], "fail_open");
        assert_eq!(batch(&[d])["allowed"], true);
    }
}
