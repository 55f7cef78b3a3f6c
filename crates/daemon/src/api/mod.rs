//! The HTTP API (docs/api.md): routing, request parsing, response shaping.
//! Handlers parse and validate, hand a [`Check`] to the [`Limiter`], and turn its decision
//! into JSON and RateLimit headers. No business logic lives here.

mod admin;
mod answers;
pub(crate) mod body;
mod decisions;
pub(crate) mod error;
pub(crate) mod forward_auth;
pub(crate) mod grpc;
pub(crate) mod headers;
pub(crate) mod key;
mod leases;
mod limits;
pub(crate) mod request;
pub(crate) mod request_log;
mod usage;

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::{Json, Router};
use quotad_core::coordinator::wire;
use serde_json::{Value, json};

use crate::federation::auth::{HEADER_SIGNATURE, Rejection, Signed};
use crate::federation::{Federation, STATUS_KEYS, StatusReport};
use crate::limiter::{Decision, LeaseError, Limiter, ResetError, SettleError};
use crate::metrics::Metrics;
use crate::policy::KeyMatch;
use crate::server::Drain;
use crate::store::{Store, StoreError};
use error::ApiError;
use quotad_core::settlement::Settled;
use request::{Caps, CheckRequest};

/// What the handlers share, read-only (the drain is the server's: readiness reads it).
#[derive(Clone)]
pub(crate) struct AppState {
    /// Policies, overrides and forward-auth settings: swapped whole by a reload.
    pub(crate) live: Arc<crate::reload::LiveConfig>,
    pub(crate) limiter: Arc<Limiter>,
    pub(crate) store: Arc<Store>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) caps: Caps,
    pub(crate) drain: Drain,
    /// `server.ready_requires_store`: readiness follows the store too.
    pub(crate) ready_requires_store: bool,
    /// `server.max_body_memory`: what request bodies being read may hold together.
    pub(crate) body_budget: body::BodyBudget,
    pub(crate) region: Arc<str>,
    /// Present when a policy is global (the coordinator and the peer endpoint).
    pub(crate) federation: Option<Arc<Federation>>,
}

pub(crate) fn router(state: AppState) -> Router {
    let counted = answers::Answers {
        metrics: state.metrics.clone(),
        live: state.live.clone(),
    };
    use answers::{
        ACQUIRE, AUTHZ, CHARGE, CHECK, EXTEND, HEALTHZ, LIMIT, LIMITS, METRICS, POLICIES, READYZ,
        RELEASE, RESET, SETTLE, STATUS, USAGE, USAGE_KEY,
    };
    Router::new()
        .route(CHECK, post(check))
        .route(RESET, post(reset))
        .route(SETTLE, post(settle))
        .route(CHARGE, post(charge))
        .route(ACQUIRE, post(leases::acquire))
        .route(RELEASE, post(leases::release))
        .route(EXTEND, post(leases::extend))
        .route(AUTHZ, any(forward_auth::authz))
        .route(LIMITS, get(limits::list))
        .route(
            LIMIT,
            get(limits::get).put(limits::put).delete(limits::delete),
        )
        .route(USAGE, post(usage::batch))
        .route(USAGE_KEY, get(usage::one))
        .route(POLICIES, get(policies))
        .route(STATUS, get(status))
        .route(crate::federation::peers::EXCHANGE_PATH, post(peer_exchange))
        .route(crate::federation::limits::LIMITS_PATH, post(peer_limits))
        .route(HEALTHZ, get(healthz))
        .route(READYZ, get(readyz))
        .route(METRICS, get(metrics))
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed })
        .fallback(|| async { ApiError::NotFound })
        .with_state(state)
        .layer(axum::middleware::from_fn_with_state(
            counted,
            answers::count,
        ))
}

/// Reads a JSON body: content type first, then the size cap, then the JSON itself.
async fn json_body(state: &AppState, req: Request) -> Result<serde_json::Value, ApiError> {
    let ct = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let essence = ct.split(';').next().unwrap_or("").trim();
    if !essence.eq_ignore_ascii_case("application/json") {
        let got = if ct.is_empty() {
            " (none given)".to_owned()
        } else {
            format!(", got \"{}\"", ct.chars().take(64).collect::<String>())
        };
        return Err(ApiError::UnsupportedMediaType(got));
    }
    let (parts, body) = req.into_parts();
    // The body's share of the memory budget is held until it is parsed.
    let (body, _room) = body::read(
        &parts.headers,
        body,
        state.caps.max_body_bytes,
        state.caps.body_timeout,
        Some(&state.body_budget),
    )
    .await?;
    request::parse_json(&body)
}

async fn check(State(state): State<AppState>, req: Request) -> Result<Response, ApiError> {
    let started = Instant::now();
    let sampled = req.extensions().get::<request_log::Sampled>().is_some();
    let body = json_body(&state, req).await?;
    let parsed = CheckRequest::parse(&body, &state.live.get().policies, &state.caps)?;
    let (mut response, summary) = match parsed {
        CheckRequest::Single(c) => {
            let d = state.limiter.check(&c).await?;
            let ds = std::slice::from_ref(&d);
            let summary = sampled.then(|| request_log::Summary::of(ds)).flatten();
            let body = Json(decisions::body(&d)).into_response();
            (with_headers(body, ds), summary)
        }
        CheckRequest::Batch(checks) => {
            let ds = state.limiter.check_batch(&checks).await?;
            let summary = sampled.then(|| request_log::Summary::of(&ds)).flatten();
            let body = Json(decisions::batch(&ds)).into_response();
            (with_headers(body, &ds), summary)
        }
    };
    if let Some(s) = summary {
        response.extensions_mut().insert(s);
    }
    state
        .metrics
        .check_duration
        .http
        .observe(started.elapsed().as_secs_f64());
    Ok(response)
}

/// Adds the RateLimit headers of `ds` ([`headers::rate_limit_headers`]).
pub(crate) fn with_headers(mut resp: Response, ds: &[Decision]) -> Response {
    headers::rate_limit_headers(resp.headers_mut(), ds);
    resp
}

/// The same headers as (lower-case name, value) pairs: the gRPC service sends them as
/// `response_headers_to_add`.
pub(crate) fn ratelimit_headers(ds: &[Decision]) -> Vec<(String, String)> {
    let mut h = axum::http::HeaderMap::new();
    headers::rate_limit_headers(&mut h, ds);
    h.iter()
        .filter_map(|(k, v)| Some((k.as_str().to_owned(), v.to_str().ok()?.to_owned())))
        .collect()
}

/// `POST /v1/reset`: an admin endpoint (a token of `[admin]` first, then the body); every
/// request is counted, and every one that was authorized is in the audit log.
async fn reset(State(state): State<AppState>, req: Request) -> Result<Response, ApiError> {
    let live = state.live.get();
    let caller = admin::authorize(&live.admin, req.headers(), &state.metrics, "reset")?;
    // A request that names nothing to reset changes nothing: counted, not audited.
    let body = json_body(&state, req).await;
    let target = body.and_then(|b| request::parse_reset(&b, &live.policies, &state.caps));
    let target = target.inspect_err(|_| admin::count(&state.metrics, "reset", "failed"))?;
    let (name, key, answer) = match target {
        request::Reset::Spent(policy, key, group) => {
            let answer = reset_spent(&state, &policy, &key, group.as_deref()).await;
            (policy.name.clone(), key, answer)
        }
        request::Reset::Leases(limit, key) => {
            let answer = match state.limiter.clear_leases(&limit, &key).await {
                Ok(_) => Ok(StatusCode::NO_CONTENT.into_response()),
                Err(LeaseError::Shed(s)) => Err(s.into()),
                Err(LeaseError::Store(e)) => Err(ApiError::unavailable(&e)),
            };
            (limit.name.clone(), key, answer)
        }
    };
    admin::audit(
        &state.metrics,
        &caller,
        "reset",
        &name,
        &key,
        answer.is_ok(),
        None,
    );
    answer
}

/// Forgets what a key spent (the limiter's reset), as an answer.
async fn reset_spent(
    state: &AppState,
    policy: &crate::policy::Policy,
    key: &str,
    group: Option<&str>,
) -> Result<Response, ApiError> {
    match state.limiter.reset(policy, key, group).await {
        Ok(()) => Ok(StatusCode::NO_CONTENT.into_response()),
        Err(ResetError::Shed(s)) => Err(s.into()),
        Err(ResetError::Store(e)) => {
            state.metrics.store_error(e.kind());
            match e {
                StoreError::Command(_) => Err(ApiError::ResetRefused),
                e => Err(ApiError::unavailable(&e)),
            }
        }
    }
}

/// `POST /v1/settle`: a reservation settled at the real cost (docs/api.md, Settlement).
async fn settle(State(state): State<AppState>, req: Request) -> Result<Response, ApiError> {
    let body = json_body(&state, req).await?;
    let (check, id, cost) = request::parse_settle(&body, &state.live.get().policies, &state.caps)?;
    let reply = match state.limiter.settle(&check, &id, cost).await {
        Ok(r) => r,
        Err(SettleError::Shed(s)) => return Err(s.into()),
        Err(SettleError::Store(StoreError::Command(_))) => return Err(ApiError::SettleRefused),
        Err(SettleError::Store(e)) => return Err(ApiError::unavailable(&e)),
    };
    let mut body = json!({
        "policy": check.policy.name,
        "key": check.key,
        "reservation": id.as_str(),
        "limit": check.policy.limit.get(),
        "remaining": reply.remaining,
        "reset_after_ms": crate::limiter::ms_ceil(reply.reset_after_us),
    });
    match reply.settled {
        Settled::Now { charged, refunded } => {
            body["status"] = json!("settled");
            body["cost"] = json!(cost);
            body["charged"] = json!(charged);
            body["refunded"] = json!(refunded);
        }
        // Settled before, perhaps at another cost: that settlement stands.
        Settled::Already => body["status"] = json!("already_settled"),
        // A reset of the key ended it: the reset's fresh start stands, nothing was
        // charged or given back.
        Settled::Ended => body["status"] = json!("ended_by_reset"),
        Settled::Unknown => return Err(ApiError::UnknownReservation),
    }
    Ok(Json(body).into_response())
}

/// `POST /v1/charge`: a cost counted after the work, without a reservation (docs/api.md,
/// Settlement): charged whole, into debt where the key lacks it, never denied.
async fn charge(State(state): State<AppState>, req: Request) -> Result<Response, ApiError> {
    let body = json_body(&state, req).await?;
    let check = request::parse_charge(&body, &state.live.get().policies, &state.caps)?;
    let d = state.limiter.charge(&check).await?;
    let charged = if d.outcome.is_enforced() {
        check.cost
    } else {
        0
    };
    let body = decisions::body_with(&d, json!({"charged": charged}));
    Ok(Json(body).into_response())
}

async fn policies(State(state): State<AppState>) -> Response {
    let live = state.live.get();
    let list: Vec<_> = live
        .policies
        .iter()
        .map(|p| {
            json!({
                "name": p.name,
                "algorithm": p.algorithm.name(),
                "limit": p.limit.get(),
                "window_ms": p.window.as_millis() as u64,
                "period": p.calendar.as_ref().map(|c| c.calendar().period().name()),
                "time_zone": p.calendar.as_ref().map(|c| c.calendar().zone()),
                "burst": p.burst.get(),
                "on_store_error": p.on_store_error.name(),
                "shadow": p.shadow,
                "settle_within_ms": p.settle_within.map(|d| d.as_millis() as u64),
                // The limit this region enforces (global shares arrive with multi-region).
                "effective_limit": p.limit.get(),
                "overrides": live.policies.overrides(&p.name).iter().map(|o| {
                    // An exact key may be a customer's API key: any caller of this
                    // endpoint gets its SHA-256 (hex), enough to tell which override is
                    // which, never the key. Prefixes and globs are patterns, shown as set.
                    let (kind, pattern) = match &o.keys {
                        KeyMatch::Exact(k) => ("key_sha256", crate::reload::hash(k.as_bytes())),
                        KeyMatch::Prefix(k) => ("prefix", k.clone()),
                        KeyMatch::Glob(k) => ("glob", k.clone()),
                    };
                    json!({
                        kind: pattern,
                        "limit": o.policy.limit.get(),
                        "window_ms": o.policy.window.as_millis() as u64,
                        "burst": o.policy.burst.get(),
                    })
                }).collect::<Vec<_>>(),
            })
        })
        .collect();
    // Concurrency limits: `limit` units held at once, a lease of `window_ms` at most.
    let limits = live.policies.concurrency_limits().map(|c| {
        json!({
            "name": c.name,
            "algorithm": "concurrency",
            "limit": c.limit.get(),
            "window_ms": c.lease.as_millis() as u64,
            "burst": c.limit.get(),
            "on_store_error": c.on_store_error.name(),
            "shadow": false,
            "settle_within_ms": null,
            "effective_limit": c.limit.get(),
            "overrides": [],
        })
    });
    let list: Vec<Value> = list.into_iter().chain(limits).collect();
    let mut body =
        json!({"store": state.store.describe(), "config_hash": live.hash, "policies": list});
    if !live.kept.is_empty() {
        // Parts of the file a reload did not apply (they need a restart), by reason.
        body["config_not_applied"] = json!(live.kept);
    }
    Json(body).into_response()
}

/// Global budgets as this instance sees them: regions, peers (link, RTT), and per tracked
/// key of each global policy its escrow, enforced rate, loans and demand.
async fn status(State(state): State<AppState>) -> Response {
    match &state.federation {
        Some(f) => Json(status_json(&state.region, f.report())).into_response(),
        None => Json(json!({
            "region": &*state.region,
            "regions": [&*state.region],
            "coordinator": {"leader": false},
            "peers": [],
            "policies": [],
        }))
        .into_response(),
    }
}

/// A peer region's exchange: what the headers settle is checked before a byte of the
/// body is read (a stranger, a stale or replayed request, a body over what a round can
/// carry, a peer with too much in flight); the body is then read within the body timeout
/// and verified. Every refusal is counted and none reaches the coordinator.
async fn peer_exchange(State(state): State<AppState>, req: Request) -> Response {
    let Some(f) = &state.federation else {
        return ApiError::NotFound.into_response();
    };
    let (admitted, body) = match admitted_body(f, &state, req).await {
        Ok(a) => a,
        Err(resp) => return resp,
    };
    match f.exchange(admitted, &body).await {
        Ok(reply) => {
            let content_type = if reply.binary {
                wire::CONTENT_TYPE
            } else {
                "application/json"
            };
            peer_body(
                StatusCode::OK,
                content_type,
                reply.body,
                Some(&reply.signature),
            )
        }
        Err(r) => rejection(f, r),
    }
}

/// A peer region's pull of this region's runtime-limit changes (global policies): admitted
/// as an exchange is (signed, fresh, a known peer, this instance coordinates, a body
/// within bounds), answered from the store, the reply signed for the request.
async fn peer_limits(State(state): State<AppState>, req: Request) -> Response {
    let Some(f) = &state.federation else {
        return ApiError::NotFound.into_response();
    };
    let (admitted, body) = match admitted_body(f, &state, req).await {
        Ok(a) => a,
        Err(resp) => return resp,
    };
    let asked = match f.limits_request(&admitted, &body) {
        Ok(r) => r,
        Err(r) => return rejection(f, r),
    };
    let reply = crate::federation::limits::answer(f, &state.limiter, &state.live, &asked).await;
    let (body, signature) = f.sign_limits_reply(&admitted, &reply);
    peer_body(StatusCode::OK, "application/json", body, Some(&signature))
}

/// A peer's request admitted on its headers (signed form, known peer, fresh, this
/// instance coordinates, a length within bounds), then its body read within the body
/// timeout; a refusal is the answer to send.
async fn admitted_body(
    f: &Federation,
    state: &AppState,
    req: Request,
) -> Result<(crate::federation::Admitted, axum::body::Bytes), Response> {
    let (parts, body) = req.into_parts();
    let header = |name: &str| parts.headers.get(name).and_then(|v| v.to_str().ok());
    let declared = header("content-length").and_then(|v| v.parse::<u64>().ok());
    let admitted = Signed::from_headers(header)
        .and_then(|s| f.admit(s, declared))
        .map_err(|r| rejection(f, r))?;
    let max = admitted.max_bytes;
    match body::read(&parts.headers, body, max, state.caps.body_timeout, None).await {
        Ok((b, _)) => Ok((admitted, b)),
        Err(e) => Err(e.into_response()),
    }
}

/// A refused peer request: counted, and answered with its reason.
fn rejection(f: &Federation, r: Rejection) -> Response {
    f.count_rejection(r);
    let status = match r {
        Rejection::Malformed | Rejection::Invalid => StatusCode::BAD_REQUEST,
        Rejection::NotCoordinator | Rejection::Busy => StatusCode::SERVICE_UNAVAILABLE,
        Rejection::LengthRequired => StatusCode::LENGTH_REQUIRED,
        Rejection::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        Rejection::UnknownKeys => StatusCode::CONFLICT,
        _ => StatusCode::UNAUTHORIZED,
    };
    let body = json!({"error": {"code": r.reason(), "message": r.to_string()}});
    let body = serde_json::to_vec(&body).unwrap_or_default();
    peer_body(status, "application/json", body, None)
}

fn peer_body(
    status: StatusCode,
    content_type: &'static str,
    body: Vec<u8>,
    signature: Option<&str>,
) -> Response {
    let mut resp = (status, body).into_response();
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    if let Some(sig) = signature
        && let Ok(v) = HeaderValue::from_str(sig)
    {
        h.insert(HEADER_SIGNATURE, v);
    }
    resp
}

/// `/v1/status` of an instance with global policies.
fn status_json(region: &str, r: StatusReport) -> Value {
    let st = &r.status;
    let policies: Vec<Value> = r
        .policies
        .iter()
        .map(|g| {
            let keys = st.keys.iter().filter(|k| k.policy == g.name);
            let escrow: serde_json::Map<String, Value> = r
                .regions
                .iter()
                .zip(&g.escrow)
                .map(|(r, e)| (r.clone(), json!(e)))
                .collect();
            // What the coordinator runs (only while this instance leads): the version
            // installed, the one applied, this region's escrow now, and the versions the
            // regions reported applied: a re-split's rollout, region by region.
            let in_force = st.policies.iter().find(|p| p.policy == g.name).map(|p| {
                let applied: serde_json::Map<String, Value> = r
                    .regions
                    .iter()
                    .zip(&p.peers_applied)
                    .map(|(r, v)| (r.clone(), json!(v)))
                    .collect();
                json!({
                    "version": p.version,
                    "applied": p.applied,
                    "escrow": p.escrow_in_force,
                    "resplit_pending": p.resplit_pending,
                    "regions_applied": applied,
                })
            });
            json!({
                "name": g.name,
                "version": g.version,
                "rho": g.rho,
                "burst": g.burst,
                "escrow": escrow,
                "in_force": in_force,
                "keys": keys.map(|k| json!({
                    "key": k.key,
                    "escrow": k.escrow,
                    "enforced": k.enforced,
                    "lent": k.lent,
                    "borrowed": k.borrowed,
                    "demand": k.demand,
                    "target": k.target,
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({
        "region": region,
        "regions": r.regions,
        "instance": r.instance,
        "coordinator": {
            "leader": r.leader,
            "token": r.token,
            "rounds": st.stats.rounds,
            "stats": st.stats,
            "keys_tracked": st.keys_total,
            "keys_listed_max": STATUS_KEYS,
            "as_of_us": st.as_of_us,
        },
        "peers": st.peers,
        "policies": policies,
    })
}

async fn healthz() -> Response {
    Json(json!({"status": "ok"})).into_response()
}

/// Ready = this instance answers per its policies: it fails while draining. A store that
/// is down does not fail it (each policy's `on_store_error` answers for it, and taking
/// every replica out of a Service would deliver none of those answers), unless the
/// operator opted in with `server.ready_requires_store`.
async fn readyz(State(state): State<AppState>) -> Response {
    let draining = state.drain.is_draining();
    let store_ready = state.store.is_ready();
    // A new instance answers with keys' runtime limits only once it has read them: while
    // the store is up, not before (while it is down, the fail modes answer anyway).
    let live = state.live.get();
    let synced =
        state.live.runtime().is_synced() || !live.policies.iter().any(|p| p.runtime.is_some());
    let ready =
        !draining && (store_ready || !state.ready_requires_store) && (synced || !store_ready);
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(json!({"ready": ready, "draining": draining, "store": state.store.describe(), "store_ready": store_ready, "runtime_limits_synced": synced})),
    )
        .into_response()
}

async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        Body::from(state.metrics.render()),
    )
        .into_response()
}
