//! Concurrency limits over HTTP (docs/api.md#concurrency-limits): `POST /v1/acquire`,
//! `/v1/release`, `/v1/extend`. Handlers parse, hand the lease to the [`Limiter`], and
//! shape its answer: an acquire is a decision (always `200`, with RateLimit headers); a
//! release or extend of a lease the key does not hold is `404 unknown_lease`, and of one
//! a reset of the key gave back: a release is `200` `ended_by_reset` (its units are free),
//! an extend `404 ended_by_reset` (there is nothing to extend).

use axum::Json;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::error::ApiError;
use super::{AppState, json_body, request, with_headers};
use crate::limiter::{Held, LeaseError};
use quotad_core::concurrency::LeaseAnswer;

pub(super) async fn acquire(
    State(state): State<AppState>,
    req: Request,
) -> Result<Response, ApiError> {
    let body = json_body(&state, req).await?;
    let a = request::parse_acquire(&body, &state.live.get().policies, &state.caps)?;
    let acquired = state.limiter.acquire(&a).await?;
    let d = acquired.decision();
    let mut more = json!({"held": acquired.held});
    if let Some(lease) = &acquired.lease {
        more["lease"] = json!(lease.to_string());
        more["units"] = json!(lease.units());
        more["expires_in_ms"] = json!(acquired.hold.as_millis() as u64);
    }
    let body = super::decisions::body_with(&d, more);
    Ok(with_headers(
        Json(body).into_response(),
        std::slice::from_ref(&d),
    ))
}

pub(super) async fn release(
    State(state): State<AppState>,
    req: Request,
) -> Result<Response, ApiError> {
    let body = json_body(&state, req).await?;
    let h = request::parse_held(&body, &state.live.get().policies, &state.caps, false)?;
    let ans = match state.limiter.release(&h).await {
        Ok(a) if a.ended => return Ok(Json(lease_body(&h, &a, "ended_by_reset")).into_response()),
        other => answered(other)?,
    };
    Ok(Json(lease_body(&h, &ans, "released")).into_response())
}

pub(super) async fn extend(
    State(state): State<AppState>,
    req: Request,
) -> Result<Response, ApiError> {
    let body = json_body(&state, req).await?;
    let h = request::parse_held(&body, &state.live.get().policies, &state.caps, true)?;
    let ans = answered(state.limiter.extend(&h).await)?;
    let mut body = lease_body(&h, &ans, "extended");
    body["expires_in_ms"] = json!(h.hold.as_millis() as u64);
    Ok(Json(body).into_response())
}

/// A release's or extend's answer: a lease the key does not hold is a 404.
fn answered(r: Result<LeaseAnswer, LeaseError>) -> Result<LeaseAnswer, ApiError> {
    match r {
        Ok(a) if a.ok => Ok(a),
        Ok(a) if a.ended => Err(ApiError::LeaseEndedByReset),
        Ok(_) => Err(ApiError::UnknownLease),
        Err(LeaseError::Shed(s)) => Err(s.into()),
        Err(LeaseError::Store(e)) => Err(ApiError::unavailable(&e)),
    }
}

fn lease_body(h: &Held, ans: &LeaseAnswer, status: &str) -> serde_json::Value {
    let limit = h.policy.limit.get();
    json!({
        "status": status,
        "policy": h.policy.name,
        "key": h.key,
        "lease": h.lease.to_string(),
        "limit": limit,
        "held": ans.held,
        "remaining": limit.saturating_sub(ans.held),
    })
}
