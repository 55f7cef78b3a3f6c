//! `/v1/authz/{policy}`: the forward-auth endpoint for proxies (nginx `auth_request`,
//! Caddy `forward_auth`, Traefik `forwardAuth`). Any method, no body read: the proxy asks
//! about the request it holds, and quotad answers with a status the proxy acts on:
//!
//! - allowed (or `fail_open`, `shadow`): `200`, with the RateLimit headers;
//! - denied (or `fail_closed`): the policy's `denied_status` (429 by default), with
//!   `Retry-After` and the RateLimit headers;
//! - no key in the request: `on_missing_key` (deny, allow, or a fixed key), never a 5xx;
//!   counted in `quotad_forward_auth_missing_key_total{policy,answer}`.
//!
//! The key is built from the original request's headers as `[policy.forward_auth]` says
//! (`config::forward_auth`); the decision is the same limiter's as `POST /v1/check`.

use std::net::IpAddr;

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::json;

use crate::api::error::ApiError;
use crate::api::request_log::{Sampled, Summary};
use crate::api::{AppState, with_headers};
use crate::config::{ForwardAuth, KeySource, MissingKey};
use crate::limiter::Check;

pub(crate) async fn authz(
    State(state): State<AppState>,
    path: Result<Path<String>, PathRejection>,
    sampled: Option<Extension<Sampled>>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let started = std::time::Instant::now();
    // A name that is not UTF-8 once percent-decoded (`/v1/authz/%FF`) names no policy:
    // the API's JSON error, not the extractor's plain text.
    let Path(name) = path.map_err(|_| {
        ApiError::invalid(
            "policy",
            "the policy name in the path is not valid UTF-8 after percent-decoding",
        )
    })?;
    let unknown = || ApiError::UnknownPolicy {
        field: "policy".into(),
        name: name.chars().take(80).collect(),
    };
    let live = state.live.get();
    if live.policies.concurrency(&name).is_some() {
        return Err(ApiError::invalid(
            "policy",
            format!(
                "\"{name}\" is a concurrency limit: a proxy cannot release what it would acquire (docs/proxies.md)"
            ),
        ));
    }
    let policy = live.policies.get(&name).ok_or_else(unknown)?.clone();
    let Some(auth) = live.forward_auth.get(&name) else {
        return Err(ApiError::invalid(
            "policy",
            format!("policy \"{name}\" has no [policy.forward_auth]"),
        ));
    };
    let key = match request_key(&state, &name, auth, &headers) {
        Ok(k) => k,
        Err(status) => return Ok(missing(status, &name)),
    };
    let check = Check {
        policy: live.policies.for_key(&policy, &key),
        key,
        cost: auth.cost,
        group: None,
        reserve: false,
    };
    let d = state.limiter.check(&check).await?;
    state
        .metrics
        .check_duration
        .forward_auth
        .observe(started.elapsed().as_secs_f64());
    let status = if d.allowed {
        StatusCode::OK
    } else {
        denied_status(auth)
    };
    let mut resp = (status, Json(super::decisions::body(&d))).into_response();
    if sampled.is_some()
        && let Some(s) = Summary::of(std::slice::from_ref(&d))
    {
        resp.extensions_mut().insert(s);
    }
    Ok(with_headers(resp, std::slice::from_ref(&d)))
}

/// The key the request names, or the policy's answer to a request without one (a key
/// too long to be one is as good as none): its own key, or the status that allows or
/// denies it outright.
fn request_key(
    state: &AppState,
    name: &str,
    auth: &ForwardAuth,
    headers: &HeaderMap,
) -> Result<String, StatusCode> {
    match key_of(auth, headers) {
        Some(k) if k.len() <= state.caps.max_key_bytes => Ok(k),
        _ => {
            // Counted whatever the answer: deny and allow decide nothing, so no other
            // metric would show a proxy that stopped forwarding the key. The policy is a
            // configured one (looked up by the caller), so the label set stays bounded.
            let answer = &auth.on_missing_key;
            state
                .metrics
                .forward_auth_missing_key
                .with_label_values(&[name, answer.answer()])
                .inc();
            match answer {
                MissingKey::Key(k) => Ok(k.clone()),
                MissingKey::Allow => Err(StatusCode::OK),
                MissingKey::Deny => Err(denied_status(auth)),
            }
        }
    }
}

fn denied_status(auth: &ForwardAuth) -> StatusCode {
    StatusCode::from_u16(auth.denied_status).unwrap_or(StatusCode::TOO_MANY_REQUESTS)
}

/// The answer to a request without its key (`on_missing_key` allow or deny).
fn missing(status: StatusCode, policy: &str) -> Response {
    let body = json!({
        "allowed": status.is_success(),
        "policy": policy,
        "outcome": "missing_key",
    });
    (status, Json(body)).into_response()
}

/// The key the policy's sources give, parts joined by [`crate::api::key::join`] (so no
/// value can pose as two parts); `None` if any is missing.
pub(crate) fn key_of(auth: &ForwardAuth, headers: &HeaderMap) -> Option<String> {
    let parts: Option<Vec<String>> = auth
        .key
        .iter()
        .map(|source| match source {
            KeySource::Header(name) => header(headers, name)
                .map(str::trim)
                .filter(|v| !v.is_empty())
                .map(str::to_owned),
            KeySource::ClientIp => client_ip(headers, auth.trusted_hops).map(|ip| ip.to_string()),
        })
        .collect();
    parts.map(|p| crate::api::key::join(p.iter().map(String::as_str)))
}

fn header<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// The client's address as the outermost trusted proxy saw it: with `hops` trusted
/// proxies appending to `X-Forwarded-For`, the `hops`-th entry from the right (entries
/// further left came from the client and prove nothing). When `X-Forwarded-For` is there,
/// it alone decides: if that entry is missing or not an address, there is no client
/// address (the request has no key); `X-Real-IP`, which a client can send too, is read
/// only when no proxy wrote `X-Forwarded-For` at all. Several `X-Forwarded-For` headers
/// read as one list, in order. An IPv4 address written as IPv6 (`::ffff:1.2.3.4`) is
/// the IPv4 address: one client, one key.
pub(crate) fn client_ip(headers: &HeaderMap, hops: usize) -> Option<IpAddr> {
    let xff: Vec<&str> = headers
        .get_all("x-forwarded-for")
        .iter()
        .map(|v| v.to_str().unwrap_or(""))
        .collect();
    let ip = if xff.is_empty() {
        header(headers, "x-real-ip").and_then(|v| parse_ip(v.trim()))
    } else {
        let entries: Vec<&str> = xff
            .iter()
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .collect();
        entries
            .len()
            .checked_sub(hops)
            .and_then(|i| entries.get(i))
            .and_then(|e| parse_ip(e))
    };
    ip.map(|ip| ip.to_canonical())
}

/// An address as proxies write it: bare, or `[v6]` / `v4:port` forms some add.
fn parse_ip(s: &str) -> Option<IpAddr> {
    if let Ok(ip) = s.parse() {
        return Some(ip);
    }
    let s = s
        .strip_prefix('[')
        .map_or(s, |r| r.split(']').next().unwrap_or(r));
    s.parse()
        .ok()
        .or_else(|| s.rsplit_once(':').and_then(|(h, _)| h.parse().ok()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn the_client_is_the_entry_the_outermost_trusted_proxy_appended() {
        let h = headers(&[("x-forwarded-for", "6.6.6.6, 203.0.113.7")]);
        assert_eq!(
            client_ip(&h, 1),
            "203.0.113.7".parse().ok(),
            "the spoofed entry is ignored"
        );
        assert_eq!(client_ip(&h, 2), "6.6.6.6".parse().ok());
        let h = headers(&[
            ("x-forwarded-for", "1.1.1.1"),
            ("x-forwarded-for", "2.2.2.2"),
        ]);
        assert_eq!(
            client_ip(&h, 1),
            "2.2.2.2".parse().ok(),
            "several headers are one list"
        );
        let h = headers(&[("x-real-ip", "198.51.100.1")]);
        assert_eq!(client_ip(&h, 1), "198.51.100.1".parse().ok());
        let h = headers(&[("x-forwarded-for", "[2001:db8::1]:443, 192.0.2.1:8080")]);
        assert_eq!(client_ip(&h, 1), "192.0.2.1".parse().ok());
        assert_eq!(client_ip(&h, 2), "2001:db8::1".parse().ok());
        assert_eq!(client_ip(&headers(&[("x-forwarded-for", "junk")]), 1), None);
        assert_eq!(client_ip(&HeaderMap::new(), 1), None);
    }

    #[test]
    fn a_client_cannot_choose_its_address_past_a_broken_trusted_entry() {
        // The trusted entry is not an address: no key, not the client's X-Real-IP.
        let h = headers(&[
            ("x-forwarded-for", "unknown"),
            ("x-real-ip", "198.51.100.99"),
        ]);
        assert_eq!(client_ip(&h, 1), None);
        // Too few entries for the trusted hops: no key either.
        let h = headers(&[("x-forwarded-for", "203.0.113.7"), ("x-real-ip", "1.1.1.1")]);
        assert_eq!(client_ip(&h, 2), None);
        // One client, one key, however its address is written.
        let mapped = headers(&[("x-forwarded-for", "::ffff:203.0.113.7")]);
        let plain = headers(&[("x-forwarded-for", "203.0.113.7")]);
        assert_eq!(client_ip(&mapped, 1), client_ip(&plain, 1));
        assert_eq!(client_ip(&mapped, 1), "203.0.113.7".parse().ok());
    }

    #[test]
    fn a_key_needs_every_part() {
        let auth = ForwardAuth {
            key: vec![KeySource::Header("x-api-key".into()), KeySource::ClientIp],
            trusted_hops: 1,
            denied_status: 429,
            on_missing_key: MissingKey::Deny,
            cost: 1,
        };
        let h = headers(&[("x-api-key", " abc "), ("x-forwarded-for", "203.0.113.7")]);
        assert_eq!(key_of(&auth, &h).as_deref(), Some("abc|203.0.113.7"));
        // A value holding the separator cannot pose as two parts.
        let h = headers(&[
            ("x-api-key", "abc|203.0.113.7"),
            ("x-forwarded-for", "10.0.0.1"),
        ]);
        assert_eq!(
            key_of(&auth, &h).as_deref(),
            Some("abc\\|203.0.113.7|10.0.0.1")
        );
        assert_eq!(key_of(&auth, &headers(&[("x-api-key", "abc")])), None);
        assert_eq!(
            key_of(&auth, &headers(&[("x-api-key", " "), ("x-real-ip", "::1")])),
            None
        );
    }
}
