//! The admin endpoints' door (`POST /v1/reset`, `/v1/limits/...`): a bearer token of `[admin]`
//! (`config::admin`), an audit line naming who changed what, and a count of every request.

use axum::http::{HeaderMap, header};
use sha2::{Digest, Sha256};

use super::error::ApiError;
use crate::config::{AdminSettings, Caller};
use crate::metrics::Metrics;

/// Who may make this request: the caller its `Authorization: Bearer` token names, or a
/// 401 (counted) when it names none.
pub(super) fn authorize<'a>(
    admin: &'a AdminSettings,
    headers: &HeaderMap,
    metrics: &Metrics,
    action: &str,
) -> Result<Caller<'a>, ApiError> {
    admin.caller(bearer(headers)).ok_or_else(|| {
        count(metrics, action, "unauthenticated");
        ApiError::Unauthenticated
    })
}

/// Counts an admin request's end (`quotad_admin_requests_total{action,result}`).
pub(super) fn count(metrics: &Metrics, action: &str, result: &str) {
    metrics
        .admin_requests
        .with_label_values(&[action, result])
        .inc();
}

/// The token of an `Authorization: Bearer <token>` header (the scheme in any case).
fn bearer(headers: &HeaderMap) -> Option<&[u8]> {
    let value = headers.get(header::AUTHORIZATION)?.as_bytes();
    let (scheme, token) = value.split_at_checked(7)?;
    scheme
        .eq_ignore_ascii_case(b"bearer ")
        .then_some(token.trim_ascii())
}

/// Logs and counts the end of an admin request that named its target: who, what, on which
/// policy and key (the key as the first 16 hex digits of its SHA-256: keys are often
/// customers' API keys), and for a change done the numbers before and after it.
pub(super) fn audit(
    metrics: &Metrics,
    caller: &Caller<'_>,
    action: &str,
    policy: &str,
    key: &str,
    done: bool,
    change: Option<(&str, &str)>,
) {
    let result = if done { "done" } else { "failed" };
    count(metrics, action, result);
    let key_sha256 = &hex::encode(Sha256::digest(key.as_bytes()))[..16];
    let (old, new) = change.unwrap_or_default();
    tracing::info!(
        target: "quotad::audit",
        token = %caller,
        action,
        policy,
        key_sha256,
        old,
        new,
        result,
        "admin request"
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn with(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_str(value).unwrap());
        h
    }

    #[test]
    fn only_a_bearer_token_is_read() {
        assert_eq!(bearer(&with("Bearer abc")), Some(&b"abc"[..]));
        assert_eq!(bearer(&with("bearer  abc ")), Some(&b"abc"[..]));
        assert_eq!(bearer(&with("Basic YWJjOmRlZg==")), None);
        assert_eq!(bearer(&with("Bearer")), None);
        assert_eq!(bearer(&HeaderMap::new()), None);
    }
}
