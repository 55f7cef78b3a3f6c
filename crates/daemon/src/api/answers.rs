//! Every HTTP answer counted by its route and status
//! (`quotad_http_responses_total{route,status}`), in one layer around the router; the same
//! layer writes the request log's sample (`api::request_log`) of the `/v1/` routes and of
//! requests no route matched. The route label is the route's template
//! (`/v1/authz/{policy}`, never the path a client sent), `other` for a path no route
//! serves: both label sets are bounded, the routes being ours and the statuses the ones
//! we send. The router and the label read the paths from the constants here.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;

use super::request_log::{self, Line, Sampled, Summary};
use crate::federation::limits::LIMITS_PATH;
use crate::federation::peers::EXCHANGE_PATH;
use crate::metrics::Metrics;
use crate::reload::LiveConfig;

pub(super) const CHECK: &str = "/v1/check";
pub(super) const RESET: &str = "/v1/reset";
pub(super) const SETTLE: &str = "/v1/settle";
pub(super) const CHARGE: &str = "/v1/charge";
pub(super) const ACQUIRE: &str = "/v1/acquire";
pub(super) const RELEASE: &str = "/v1/release";
pub(super) const EXTEND: &str = "/v1/extend";
pub(super) const AUTHZ: &str = "/v1/authz/{policy}";
pub(super) const LIMITS: &str = "/v1/limits/{policy}";
pub(super) const LIMIT: &str = "/v1/limits/{policy}/{key}";
pub(super) const USAGE: &str = "/v1/usage";
pub(super) const USAGE_KEY: &str = "/v1/usage/{policy}/{key}";
pub(super) const POLICIES: &str = "/v1/policies";
pub(super) const STATUS: &str = "/v1/status";
pub(super) const HEALTHZ: &str = "/healthz";
pub(super) const READYZ: &str = "/readyz";
pub(super) const METRICS: &str = "/metrics";

/// Every route without a path parameter.
const FIXED: [&str; 15] = [
    CHECK,
    USAGE,
    RESET,
    SETTLE,
    CHARGE,
    ACQUIRE,
    RELEASE,
    EXTEND,
    POLICIES,
    STATUS,
    EXCHANGE_PATH,
    LIMITS_PATH,
    HEALTHZ,
    READYZ,
    METRICS,
];

/// The route label of a path no route serves.
pub(super) const NO_ROUTE: &str = "other";

/// The route that serves `path`, as its template; [`NO_ROUTE`] for none. Computed from
/// the path rather than taken from the router's match, which would cost every request an
/// extensions map on the request and one on the response.
pub(super) fn route_of(path: &str) -> &'static str {
    let authz = AUTHZ.trim_end_matches("{policy}");
    let limits = LIMITS.trim_end_matches("{policy}");
    let usage = USAGE_KEY.trim_end_matches("{policy}/{key}");
    let policy_and_key = |rest: &str| match rest.split_once('/') {
        Some((policy, key)) => !policy.is_empty() && !key.is_empty() && !key.contains('/'),
        None => false,
    };
    if let Some(rest) = path.strip_prefix(limits) {
        return match rest.split_once('/') {
            None if !rest.is_empty() => LIMITS,
            Some(_) if policy_and_key(rest) => LIMIT,
            _ => NO_ROUTE,
        };
    }
    if let Some(rest) = path.strip_prefix(usage) {
        return if policy_and_key(rest) {
            USAGE_KEY
        } else {
            NO_ROUTE
        };
    }
    match path.strip_prefix(authz) {
        Some(name) if !name.is_empty() && !name.contains('/') => AUTHZ,
        _ => FIXED.into_iter().find(|r| *r == path).unwrap_or(NO_ROUTE),
    }
}

/// What the layer needs.
#[derive(Clone)]
pub(super) struct Answers {
    pub(super) metrics: Arc<Metrics>,
    pub(super) live: Arc<LiveConfig>,
}

/// Counts the answer, and logs it when it is one of the sample.
pub(super) async fn count(State(a): State<Answers>, mut req: Request, next: Next) -> Response {
    let route = route_of(req.uri().path());
    let sampled = request_log::sampled(a.live.request_every()).then(|| {
        req.extensions_mut().insert(Sampled);
        (Instant::now(), request_log::trace_id(req.headers()))
    });
    let resp = next.run(req).await;
    a.metrics
        .http_responses
        .with_label_values(&[route, resp.status().as_str()])
        .inc();
    // Probes and scrapes are counted, not logged: they would drown the sample.
    let logged = route.starts_with("/v1/") || route == NO_ROUTE;
    if let Some((started, trace_id)) = sampled.filter(|_| logged) {
        Line {
            entry: if route == AUTHZ {
                "forward_auth"
            } else {
                "http"
            },
            route,
            status: resp.status().as_str(),
            took: started.elapsed(),
            trace_id,
            summary: resp.extensions().get::<Summary>(),
        }
        .write();
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_is_labelled_with_its_routes_template() {
        assert_eq!(route_of("/v1/check"), CHECK);
        assert_eq!(route_of("/v1/authz/login"), AUTHZ);
        assert_eq!(route_of("/v1/authz/"), NO_ROUTE);
        assert_eq!(route_of("/v1/authz/a/b"), NO_ROUTE);
        assert_eq!(route_of("/v1/limits/plan"), LIMITS);
        assert_eq!(route_of("/v1/limits/plan/customer%2F42"), LIMIT);
        assert_eq!(route_of("/v1/limits/plan/a/b"), NO_ROUTE);
        assert_eq!(route_of("/v1/limits/"), NO_ROUTE);
        assert_eq!(route_of("/v1/usage"), USAGE);
        assert_eq!(route_of("/v1/usage/plan/customer%2F42"), USAGE_KEY);
        assert_eq!(route_of("/v1/usage/plan"), NO_ROUTE);
        assert_eq!(route_of("/v1/usage/plan/a/b"), NO_ROUTE);
        assert_eq!(route_of("/v1/peer/exchange"), EXCHANGE_PATH);
        assert_eq!(route_of("/v1/check/"), NO_ROUTE);
        assert_eq!(route_of("/wp-admin.php"), NO_ROUTE);
    }
}
