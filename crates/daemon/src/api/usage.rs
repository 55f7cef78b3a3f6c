//! Usage a customer can see (docs/api.md#usage): `GET /v1/usage/{policy}/{key}` and the
//! batch `POST /v1/usage`. Each reads what a key used, what remains, its limit and where
//! that comes from, the period it counts in, and its debt, from the region's store without
//! a write (the scripts' `usage` operation): a read spends nothing, opens nothing and
//! moves no expiry. A global policy's key also shows what this region holds of its budget
//! and, from the instance that coordinates the region, its demand in every region as last
//! heard. Readable by anyone who may check (a check of cost 0 already tells what remains);
//! changing a limit is the admin's (`api::limits`).

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, Query, Request, State};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::error::ApiError;
use super::{AppState, json_body, request};
use crate::limiter::{Check, UsageError, ms_ceil};
use crate::policy::Policy;
use crate::store::{KeyUsage, UsageReply};
use quotad_core::algorithm::Algorithm;

#[derive(Deserialize)]
pub(super) struct One {
    group: Option<String>,
}

/// `GET /v1/usage/{policy}/{key}` (`?group=` for a key of a co-location group).
pub(super) async fn one(
    State(state): State<AppState>,
    Path((policy, key)): Path<(String, String)>,
    Query(q): Query<One>,
) -> Result<Response, ApiError> {
    let mut target = json!({"policy": policy, "key": key});
    if let Some(g) = q.group {
        target["group"] = json!(g);
    }
    let check = request::parse_usage(&target, "", &state.live.get().policies, &state.caps)?;
    Ok(Json(read(&state, &check).await?).into_response())
}

/// `POST /v1/usage` with `{"keys": [{"policy", "key", "group"?}, ...]}`: every key's
/// usage, in order (at most `server.max_batch` keys). One key the store cannot read fails
/// the whole request: nothing is guessed.
pub(super) async fn batch(
    State(state): State<AppState>,
    req: Request,
) -> Result<Response, ApiError> {
    let body = json_body(&state, req).await?;
    let checks = request::parse_usage_batch(&body, &state.live.get().policies, &state.caps)?;
    let reads = checks.iter().map(|c| read(&state, c));
    let results = futures_util::future::try_join_all(reads).await?;
    Ok(Json(json!({ "results": results })).into_response())
}

/// One key's usage as its JSON answer.
async fn read(state: &AppState, check: &Check) -> Result<Value, ApiError> {
    let reply = state.limiter.usage(check).await.map_err(|e| match e {
        UsageError::Shed(s) => ApiError::from(s),
        // A read changes nothing, whatever became of it.
        UsageError::Store(_) => ApiError::StoreUnavailable,
    })?;
    let mut body = local_body(check, &reply);
    if let KeyUsage::Region(r) = reply.usage {
        let mut global = json!({
            "region": state.region.as_ref(),
            "rate": r.rate,
            "escrow": r.escrow,
            "lent": r.lent,
            "borrowed": r.borrowed,
            "capacity": r.capacity,
            "regions": null,
        });
        if let Some(f) = &state.federation {
            if let Some(view) = f.key_view(&check.policy.name, &check.key).await {
                let names = &f.shared.settings.regions;
                global["regions"] = json!(
                    view.iter()
                        .zip(names)
                        .map(|(v, name)| json!({
                            "region": name,
                            "demand": v.map(|(d, _)| d),
                            "age_ms": v.map(|(_, age)| ms_ceil(age)),
                        }))
                        .collect::<Vec<_>>()
                );
            }
        }
        body["global"] = global;
    }
    Ok(body)
}

/// The fields every key's usage has: the key and its numbers, what the store read, and
/// the period that counts it.
fn local_body(check: &Check, reply: &UsageReply) -> Value {
    let p = &check.policy;
    let (verdict, used, debt) = match reply.usage {
        KeyUsage::Local(u) => (u.verdict, u.used, u.debt),
        KeyUsage::Region(r) => {
            let cap = r.capacity.floor().max(0.0) as u64;
            (r.verdict, cap.saturating_sub(r.verdict.remaining), 0)
        }
    };
    json!({
        "policy": p.name,
        "key": check.key,
        "algorithm": p.algorithm.name(),
        "limit": p.limit.get(),
        "burst": p.burst.get(),
        "limit_source": p.limit_from.name(),
        "used": used,
        "remaining": verdict.remaining,
        "debt": debt,
        "reset_after_ms": ms_ceil(verdict.reset_after_us),
        "window_ms": p.window.as_millis() as u64,
        "period": period(p, reply.now_us),
        "read_at": rfc3339(reply.now_us, None),
    })
}

/// The period a fixed window counts in at the store's `now_us` (a calendar period in its
/// zone, or the window's slot in UTC); none for the other algorithms, whose count slides.
fn period(p: &Arc<Policy>, now_us: i64) -> Value {
    if p.algorithm != Algorithm::FixedWindow {
        return Value::Null;
    }
    let (start, end, zone) = match &p.calendar {
        Some(c) => {
            let span = c.calendar().containing(now_us);
            (span.start_us, span.end_us, Some(c.calendar().zone()))
        }
        None => {
            let w = p.window.as_micros() as i64;
            let start = now_us.div_euclid(w) * w;
            (start, start + w, None)
        }
    };
    json!({
        "start": rfc3339(start, zone),
        "end": rfc3339(end, zone),
        "time_zone": zone,
    })
}

/// `us` since the epoch as RFC 3339, in `zone`'s offset (UTC without one).
fn rfc3339(us: i64, zone: Option<&str>) -> Value {
    let Ok(t) = jiff::Timestamp::from_microsecond(us) else {
        return Value::Null;
    };
    match zone.and_then(|z| t.in_tz(z).ok()) {
        Some(zoned) => json!(
            zoned
                .timestamp()
                .display_with_offset(zoned.offset())
                .to_string()
        ),
        None => json!(t.to_string()),
    }
}
