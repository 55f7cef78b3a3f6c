//! The runtime-limit endpoints (`/v1/limits/{policy}` and `/v1/limits/{policy}/{key}`): a
//! key's own limit in a policy, set, read, listed and deleted by an admin (a billing
//! system). Every request needs a token of `[admin]` first; every change is counted and
//! in the audit log with the old and the new numbers.

use axum::Json;
use axum::extract::{Path, Query, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::error::ApiError;
use super::{AppState, admin, json_body};
use crate::limiter::{NewLimit, ResetError};
use crate::policy::Policy;
use crate::runtime_limits::{Entry, RuntimeWritten};

/// Entries per page of a listing, by default and at most.
const PAGE: usize = 100;
const MAX_PAGE: usize = 1000;

/// The policy named in the path, which must take runtime limits; and the key, within the
/// daemon's bound on keys.
fn target(
    state: &AppState,
    policy: &str,
    key: Option<&str>,
) -> Result<std::sync::Arc<Policy>, ApiError> {
    let live = state.live.get();
    let Some(p) = live.policies.get(policy) else {
        return Err(ApiError::UnknownPolicy {
            field: "policy".into(),
            name: policy.chars().take(64).collect(),
        });
    };
    if p.runtime.is_none() {
        return Err(ApiError::invalid(
            "policy",
            format!(
                "policy \"{}\" takes no runtime limits (its config has no [policy.runtime_limits])",
                p.name
            ),
        ));
    }
    if let Some(key) = key {
        if key.is_empty() {
            return Err(ApiError::invalid("key", "must not be empty"));
        }
        if key.len() > state.caps.max_key_bytes {
            return Err(ApiError::invalid(
                "key",
                format!(
                    "is {} bytes; at most {} allowed",
                    key.len(),
                    state.caps.max_key_bytes
                ),
            ));
        }
    }
    Ok(p.clone())
}

/// A positive whole number of `field`, at most `max`.
fn whole(obj: &Map<String, Value>, field: &str, max: u64) -> Result<Option<u64>, ApiError> {
    let Some(v) = obj.get(field) else {
        return Ok(None);
    };
    match v.as_u64() {
        Some(n) if (1..=max).contains(&n) => Ok(Some(n)),
        Some(0) => Err(ApiError::invalid(field, "must be at least 1")),
        Some(n) => Err(ApiError::invalid(
            field,
            format!(
                "is {n}; this policy's runtime limits are at most {max} (runtime_limits.max_limit)"
            ),
        )),
        None => Err(ApiError::invalid(
            field,
            "must be a whole number of at least 1",
        )),
    }
}

/// The numbers of a `PUT` body: `limit`, optional `burst` (algorithms with one) and
/// `expires_at` (RFC 3339, in the future), checked against what the config gives the key
/// (its window: `check_rates`).
fn new_limit(body: &Value, configured: &Policy) -> Result<NewLimit, ApiError> {
    let obj = body
        .as_object()
        .ok_or_else(|| ApiError::invalid("body", "must be a JSON object"))?;
    if let Some(unknown) = obj
        .keys()
        .find(|k| !["limit", "burst", "expires_at"].contains(&k.as_str()))
    {
        return Err(ApiError::invalid(
            unknown.clone(),
            "unknown field; expected limit, burst, expires_at",
        ));
    }
    let max = configured.runtime.map_or(0, |r| r.max_limit);
    let limit =
        whole(obj, "limit", max)?.ok_or_else(|| ApiError::invalid("limit", "is required"))?;
    let burst = whole(obj, "burst", max)?;
    if burst.is_some() && !configured.algorithm.has_burst() {
        return Err(ApiError::invalid(
            "burst",
            format!(
                "{} has no burst: its capacity is the limit",
                configured.algorithm.name()
            ),
        ));
    }
    let expires_ms = match obj.get("expires_at") {
        None | Some(Value::Null) => 0,
        Some(Value::String(s)) => {
            let at: jiff::Timestamp = s.parse().map_err(|_| {
                ApiError::invalid(
                    "expires_at",
                    "must be an RFC 3339 time, e.g. 2027-01-31T00:00:00Z",
                )
            })?;
            let ms = at.as_millisecond();
            if ms <= crate::runtime_limits::now_ms() {
                return Err(ApiError::invalid("expires_at", "is not in the future"));
            }
            ms
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "expires_at",
                "must be an RFC 3339 time as a string",
            ));
        }
    };
    let mut trial = configured.clone();
    if !trial.set_numbers(limit, burst.unwrap_or(0)) {
        return Err(ApiError::invalid(
            "limit",
            format!(
                "{limit}{} per {:?} is beyond what {} can enforce exactly (docs/api.md#configuration)",
                burst.map(|b| format!(" (burst {b})")).unwrap_or_default(),
                configured.window,
                configured.algorithm.name()
            ),
        ));
    }
    Ok(NewLimit {
        limit,
        burst: burst.unwrap_or(0),
        expires_ms,
    })
}

/// An entry as the API shows it.
fn shown(policy: &Policy, key: &str, e: &Entry) -> Value {
    let limit = e.limit;
    let burst = if e.burst == 0 || !policy.algorithm.has_burst() {
        limit
    } else {
        e.burst
    };
    json!({
        "policy": policy.name,
        "key": key,
        "limit": limit,
        "burst": burst,
        "expires_at": time(e.expires_ms),
        "since": time(e.since_ms),
    })
}

/// An instant as RFC 3339 (UTC), `null` for 0.
fn time(ms: i64) -> Value {
    match (ms != 0)
        .then(|| jiff::Timestamp::from_millisecond(ms).ok())
        .flatten()
    {
        Some(t) => json!(t.to_string()),
        None => Value::Null,
    }
}

fn numbers(e: Option<&Entry>) -> String {
    e.map_or_else(
        || "none".to_owned(),
        |e| {
            format!(
                "limit={} burst={} expires_ms={}",
                e.limit, e.burst, e.expires_ms
            )
        },
    )
}

fn store_error(state: &AppState, e: ResetError) -> ApiError {
    match e {
        ResetError::Shed(s) => s.into(),
        ResetError::Store(e) => {
            state.metrics.store_error(e.kind());
            ApiError::unavailable(&e)
        }
    }
}

/// Who makes a change of `key`'s runtime limit in `policy`, and the policy: a token of
/// `[admin]` first (401, counted), then a policy that takes runtime limits and a key within
/// bounds (4xx, counted as failed: it names nothing to audit).
fn admin_target<'a>(
    state: &AppState,
    live: &'a crate::reload::Live,
    headers: &axum::http::HeaderMap,
    action: &str,
    policy: &str,
    key: &str,
) -> Result<(crate::config::Caller<'a>, std::sync::Arc<Policy>), ApiError> {
    let caller = admin::authorize(&live.admin, headers, &state.metrics, action)?;
    let base = target(state, policy, Some(key))
        .inspect_err(|_| admin::count(&state.metrics, action, "failed"))?;
    Ok((caller, base))
}

/// `e`, the end of a change of `key` in `policy` that was refused or failed, audited.
fn audit_failed(
    state: &AppState,
    caller: &crate::config::Caller<'_>,
    action: &str,
    policy: &Policy,
    key: &str,
    e: ApiError,
) -> ApiError {
    admin::audit(
        &state.metrics,
        caller,
        action,
        &policy.name,
        key,
        false,
        None,
    );
    e
}

/// `PUT /v1/limits/{policy}/{key}`: sets the key's own limit.
pub(super) async fn put(
    State(state): State<AppState>,
    Path((policy, key)): Path<(String, String)>,
    req: Request,
) -> Result<Response, ApiError> {
    const ACTION: &str = "limit_set";
    let live = state.live.get();
    let (caller, base) = admin_target(&state, &live, req.headers(), ACTION, &policy, &key)?;
    // The request names a policy and a key: a failure is audited too.
    let failed = |e| audit_failed(&state, &caller, ACTION, &base, &key, e);
    let body = json_body(&state, req).await.map_err(failed)?;
    let configured = live.policies.configured_for_key(&base, &key);
    let new = new_limit(&body, &configured).map_err(failed)?;
    let runtime = state.live.runtime();
    let written = state
        .limiter
        .set_runtime_limit(runtime, &base, &key, new)
        .await
        .map_err(|e| failed(store_error(&state, e)))?;
    let answer = match written {
        RuntimeWritten::Done { old, at_ms, .. } => {
            // As the store has it: in force since its clock's instant of the write.
            let entry = Entry {
                limit: new.limit,
                burst: new.burst,
                expires_ms: new.expires_ms,
                since_ms: at_ms,
            };
            let change = (numbers(old.as_ref()), numbers(Some(&entry)));
            let change = Some((change.0.as_str(), change.1.as_str()));
            admin::audit(
                &state.metrics,
                &caller,
                ACTION,
                &base.name,
                &key,
                true,
                change,
            );
            let mut body = shown(&configured, &key, &entry);
            body["previous"] = old.map_or(Value::Null, |o| shown(&configured, &key, &o));
            return Ok(Json(body).into_response());
        }
        RuntimeWritten::Full => ApiError::RuntimeLimitsFull {
            policy: base.name.clone(),
            max: base.runtime.map_or(0, |r| r.max_keys),
        },
        RuntimeWritten::ExpiryPassed => ApiError::invalid("expires_at", "is not in the future"),
        RuntimeWritten::NotFound => ApiError::NoRuntimeLimit,
    };
    Err(failed(answer))
}

/// `DELETE /v1/limits/{policy}/{key}`: the key's config numbers apply again.
pub(super) async fn delete(
    State(state): State<AppState>,
    Path((policy, key)): Path<(String, String)>,
    req: Request,
) -> Result<Response, ApiError> {
    const ACTION: &str = "limit_delete";
    let live = state.live.get();
    let (caller, base) = admin_target(&state, &live, req.headers(), ACTION, &policy, &key)?;
    let failed = |e| audit_failed(&state, &caller, ACTION, &base, &key, e);
    let written = state
        .limiter
        .delete_runtime_limit(state.live.runtime(), &base, &key)
        .await
        .map_err(|e| failed(store_error(&state, e)))?;
    match written {
        RuntimeWritten::Done { old, .. } => {
            let before = numbers(old.as_ref());
            let change = Some((before.as_str(), "none"));
            admin::audit(
                &state.metrics,
                &caller,
                ACTION,
                &base.name,
                &key,
                true,
                change,
            );
            let configured = live.policies.configured_for_key(&base, &key);
            let previous = old.map_or(Value::Null, |o| shown(&configured, &key, &o));
            Ok(Json(
                json!({"policy": base.name, "key": key, "deleted": true, "previous": previous}),
            )
            .into_response())
        }
        _ => Err(failed(ApiError::NoRuntimeLimit)),
    }
}

/// `GET /v1/limits/{policy}/{key}`: the key's own limit, as Redis has it.
pub(super) async fn get(
    State(state): State<AppState>,
    Path((policy, key)): Path<(String, String)>,
    req: Request,
) -> Result<Response, ApiError> {
    const ACTION: &str = "limit_read";
    let live = state.live.get();
    admin::authorize(&live.admin, req.headers(), &state.metrics, ACTION)?;
    let base = target(&state, &policy, Some(&key))?;
    let entry = state
        .limiter
        .runtime_limit(state.live.runtime(), &base, &key)
        .await
        .map_err(|e| store_error(&state, e))?;
    admin::count(&state.metrics, ACTION, "done");
    let configured = live.policies.configured_for_key(&base, &key);
    match entry {
        Some(e) => Ok(Json(shown(&configured, &key, &e)).into_response()),
        None => Err(ApiError::NoRuntimeLimit),
    }
}

/// `?cursor=&count=` of a listing.
#[derive(Debug, Deserialize)]
pub(super) struct PageQuery {
    cursor: Option<String>,
    count: Option<String>,
}

/// `GET /v1/limits/{policy}?cursor=&count=`: a page of the policy's runtime limits, and
/// the cursor of the next (`null` after the last).
pub(super) async fn list(
    State(state): State<AppState>,
    Path(policy): Path<String>,
    Query(q): Query<PageQuery>,
    req: Request,
) -> Result<Response, ApiError> {
    const ACTION: &str = "limit_read";
    let live = state.live.get();
    admin::authorize(&live.admin, req.headers(), &state.metrics, ACTION)?;
    let base = target(&state, &policy, None)?;
    let cursor = match q.cursor.as_deref() {
        None | Some("") => 0,
        Some(c) => c
            .parse::<u64>()
            .map_err(|_| ApiError::invalid("cursor", "must be a cursor this endpoint gave"))?,
    };
    let count = match q.count.as_deref() {
        None => PAGE,
        Some(c) => match c.parse::<usize>() {
            Ok(n) if (1..=MAX_PAGE).contains(&n) => n,
            _ => {
                return Err(ApiError::invalid(
                    "count",
                    format!("must be a whole number from 1 to {MAX_PAGE}"),
                ));
            }
        },
    };
    let (next, page) = state
        .limiter
        .runtime_limits_page(state.live.runtime(), &base, cursor, count)
        .await
        .map_err(|e| store_error(&state, e))?;
    admin::count(&state.metrics, ACTION, "done");
    let limits: Vec<Value> = page
        .iter()
        .map(|(k, e)| shown(&live.policies.configured_for_key(&base, k), k, e))
        .collect();
    let next = (next != 0).then(|| next.to_string());
    Ok((
        StatusCode::OK,
        Json(json!({"limits": limits, "next_cursor": next})),
    )
        .into_response())
}
