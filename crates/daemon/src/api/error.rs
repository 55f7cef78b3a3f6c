//! The API's one error type. Every 4xx/5xx body has the same shape:
//! `{"error": {"code": "<snake_case>", "message": "<what and which field>", "field": "..."}}`.
//! Internal details (store errors, addresses) are never put in a message.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::store::Shed;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ApiError {
    /// The body is not JSON.
    #[error("malformed JSON: {0}")]
    InvalidJson(String),
    /// JSON, but not a valid request; `field` names the offending field (e.g. `checks[1].cost`).
    #[error("{field}: {message}")]
    InvalidRequest { field: String, message: String },
    #[error("{field}: unknown policy \"{name}\"")]
    UnknownPolicy { field: String, name: String },
    #[error("checks: a batch holds at most {max} checks, got {got}")]
    BatchTooLarge { max: usize, got: usize },
    #[error("request body is larger than {max} bytes")]
    PayloadTooLarge { max: usize },
    /// The body's framing is broken (a bad chunk size, a body shorter than declared).
    #[error("malformed request body: {0}")]
    InvalidBody(String),
    #[error("the request body did not arrive within {0:?}")]
    BodyTimeout(std::time::Duration),
    #[error("content type must be application/json{0}")]
    UnsupportedMediaType(String),
    /// An admin endpoint without a token of `[admin]` (none, a wrong one, another scheme).
    #[error(
        "this endpoint changes limits: send Authorization: Bearer with a token of [admin] (docs/operations.md); nothing was changed"
    )]
    Unauthenticated,
    #[error("no such endpoint")]
    NotFound,
    #[error("method not allowed for this endpoint")]
    MethodNotAllowed,
    #[error("the store is unreachable; nothing was changed")]
    StoreUnavailable,
    /// The store was sent the call and did not answer in time (or the connection was lost
    /// under it): it may have run it, and may still. Every call this is answered for is
    /// safe to retry: a settlement done answers `already_settled`, a release
    /// `unknown_lease`, and a reset or an extend done twice is done once.
    #[error(
        "the store did not answer in time and may have done it (or may still): retrying is safe (a settlement done answers already_settled, a release done answers unknown_lease, a reset or an extend is done again)"
    )]
    OutcomeUnknown,
    /// Redis answered the reset with an error (an ACL without PUBLISH, most likely): the
    /// reset and its invalidation are one script, so neither happened.
    #[error(
        "the reset was refused by the store (quotad's Redis user needs PUBLISH on the invalidation channel: docs/operations.md); nothing was changed"
    )]
    ResetRefused,
    /// Redis refused a settlement that gives units back (an ACL without PUBLISH): its
    /// invalidation and the settlement are one script, so neither happened.
    #[error(
        "the settlement was refused by the store (quotad's Redis user needs PUBLISH on the invalidation channel: docs/operations.md); nothing was changed"
    )]
    SettleRefused,
    /// `POST /v1/settle` of a reservation the store does not hold (never made, denied,
    /// or kept longer than the policy's `settle_within`): nothing was charged.
    #[error(
        "reservation: no such reservation of this policy and key (never made, denied, or older than the policy's settle_within); nothing was charged, the estimate stands"
    )]
    UnknownReservation,
    /// `POST /v1/release` or `/v1/extend` of a lease the key does not hold (never
    /// acquired, released already, or ended by expiry): nothing changed.
    #[error(
        "lease: the key holds no such lease (never acquired, released already, or ended by its expiry); nothing changed"
    )]
    UnknownLease,
    /// `POST /v1/extend` of a lease a reset of the key gave back before its end: there is
    /// nothing to extend, nothing changed.
    #[error(
        "lease: a reset of the key gave this lease back before its end; nothing to extend, nothing changed"
    )]
    LeaseEndedByReset,
    /// A runtime limit for a new key of a policy that holds its `max_keys` of them.
    #[error(
        "key: policy \"{policy}\" holds its maximum of {max} runtime limits (runtime_limits.max_keys); nothing was changed"
    )]
    RuntimeLimitsFull { policy: String, max: u64 },
    /// A read or delete of a key that has no runtime limit.
    #[error("key: has no runtime limit in this policy; nothing was changed")]
    NoRuntimeLimit,
    /// Shed by admission control (see `store::redis::admission`): quotad is at its Redis
    /// concurrency limit. Not a decision; nothing was charged. 503 with `Retry-After`.
    #[error("overloaded ({0}): nothing was charged; retry after the Retry-After delay")]
    Overloaded(#[from] Shed),
}

impl ApiError {
    /// What a store error means to a client of a call that changes state (a reset, a
    /// settlement, a release, an extend): nothing done, or perhaps done.
    pub(crate) fn unavailable(e: &crate::store::StoreError) -> Self {
        if e.outcome_unknown() {
            ApiError::OutcomeUnknown
        } else {
            ApiError::StoreUnavailable
        }
    }

    pub(crate) fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::InvalidRequest {
            field: field.into(),
            message: message.into(),
        }
    }

    fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidJson(_)
            | ApiError::InvalidRequest { .. }
            | ApiError::InvalidBody(_)
            | ApiError::BatchTooLarge { .. } => StatusCode::BAD_REQUEST,
            ApiError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::Unauthenticated => StatusCode::UNAUTHORIZED,
            ApiError::UnknownPolicy { .. }
            | ApiError::UnknownReservation
            | ApiError::UnknownLease
            | ApiError::LeaseEndedByReset
            | ApiError::NoRuntimeLimit
            | ApiError::NotFound => StatusCode::NOT_FOUND,
            ApiError::RuntimeLimitsFull { .. } => StatusCode::CONFLICT,
            ApiError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::StoreUnavailable
            | ApiError::OutcomeUnknown
            | ApiError::ResetRefused
            | ApiError::SettleRefused
            | ApiError::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    pub(crate) fn code(&self) -> &'static str {
        match self {
            ApiError::InvalidJson(_) => "invalid_json",
            ApiError::InvalidRequest { .. } => "invalid_request",
            ApiError::UnknownPolicy { .. } => "unknown_policy",
            ApiError::UnknownReservation => "unknown_reservation",
            ApiError::UnknownLease => "unknown_lease",
            ApiError::LeaseEndedByReset => "ended_by_reset",
            ApiError::BatchTooLarge { .. } => "batch_too_large",
            ApiError::PayloadTooLarge { .. } => "payload_too_large",
            ApiError::InvalidBody(_) => "invalid_body",
            ApiError::BodyTimeout(_) => "request_timeout",
            ApiError::UnsupportedMediaType(_) => "unsupported_media_type",
            ApiError::Unauthenticated => "unauthenticated",
            ApiError::NotFound => "not_found",
            ApiError::MethodNotAllowed => "method_not_allowed",
            ApiError::StoreUnavailable => "store_unavailable",
            ApiError::OutcomeUnknown => "outcome_unknown",
            ApiError::ResetRefused => "reset_refused",
            ApiError::SettleRefused => "settle_refused",
            ApiError::Overloaded(_) => "overloaded",
            ApiError::RuntimeLimitsFull { .. } => "runtime_limits_full",
            ApiError::NoRuntimeLimit => "no_runtime_limit",
        }
    }

    fn field(&self) -> Option<&str> {
        match self {
            ApiError::InvalidRequest { field, .. } | ApiError::UnknownPolicy { field, .. } => {
                Some(field)
            }
            ApiError::BatchTooLarge { .. } => Some("checks"),
            ApiError::UnknownReservation => Some("reservation"),
            ApiError::UnknownLease | ApiError::LeaseEndedByReset => Some("lease"),
            ApiError::RuntimeLimitsFull { .. } | ApiError::NoRuntimeLimit => Some("key"),
            _ => None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut error = json!({"code": self.code(), "message": self.to_string()});
        if let Some(f) = self.field() {
            error["field"] = json!(f);
        }
        let mut resp = (self.status(), Json(json!({ "error": error }))).into_response();
        let h = resp.headers_mut();
        match self {
            // Whole seconds only (RFC 9110); a second is long against a queue timeout of
            // 100 ms, which is the point: a shed client should back off, not hammer.
            ApiError::Overloaded(_) => {
                h.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            ApiError::Unauthenticated => {
                let challenge = HeaderValue::from_static("Bearer realm=\"quotad admin\"");
                h.insert(header::WWW_AUTHENTICATE, challenge);
            }
            // What is left of the body on the connection is unknown: do not reuse it.
            ApiError::PayloadTooLarge { .. }
            | ApiError::InvalidBody(_)
            | ApiError::BodyTimeout(_) => {
                h.insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            _ => {}
        }
        resp
    }
}
