//! Envoy's rate-limit service (`envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`)
//! on its own listener, `[server] grpc_listen` (docs/envoy.md). Like the HTTP handlers it
//! only translates: each request descriptor is matched against `[[descriptor]]`
//! (`config::descriptor`), its entries' values joined by [`key::join`] are the quotad
//! key, and the matched descriptors go to the same [`Limiter::check_batch`] as
//! `POST /v1/check` with `checks`: shadow and fail modes, metrics, and a denied request
//! refunding the others come from there.
//!
//! - Unknown domain, or a descriptor that matches nothing: `OK`, not limited (a status
//!   with code `OK` and no `current_limit`).
//! - Cost: the descriptor's `hits_addend` if set (0 = a peek), else the request's
//!   `hits_addend`, where proto3's 0 means "not set" and so 1 (as Envoy and
//!   envoyproxy/ratelimit read it).
//! - A descriptor whose node says `charge = true` (Envoy's response path, the real cost as
//!   its `hits_addend`) is charged whole, into debt where the key lacks it, and answered
//!   `OK`: never denied, never refunded when another descriptor is. Its hits of 0 are a
//!   peek like any other (the request path), denied while the key is in debt.
//! - `overall_code` is `OVER_LIMIT` if any descriptor is: the most restrictive wins.
//! - What a client chooses fails only its own descriptor: a descriptor of a policy whose
//!   value is empty, not UTF-8 or over `server.max_key_bytes`, or whose cost is above the
//!   policy's capacity (a charged one: above what the policy refills in a year), is
//!   `OVER_LIMIT` (counted in
//!   `quotad_grpc_invalid_descriptors_total`), and the others are peeked, not charged.
//! - What Envoy's configuration decides fails the call with `INVALID_ARGUMENT`: no domain,
//!   no descriptors, more than `server.max_batch`; so does a message that is not a
//!   `RateLimitRequest` (`wire.rs`). quotad at capacity is `UNAVAILABLE` (Envoy applies its
//!   `failure_mode_deny`).

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::Status;
use tonic::transport::server::Connected;

pub mod envoy;
mod wire;

use crate::api::key;
use crate::api::ratelimit_headers;
use crate::api::request::Caps;
use crate::limiter::{Check, Decision, Limiter};
use crate::metrics::Metrics;
use crate::policy::Policy;
use crate::reload::{Live, LiveConfig};
use crate::server::{self, Drain, Handed, Handoff, Listener, ListenerMetrics};
use envoy::{Code, DescriptorStatus, HeaderValue, PbDuration, RateLimit, RateLimitResponse, Unit};
use quotad_core::calendar::Period;
use wire::{WireDescriptor, WireRequest};

/// Streams one HTTP/2 connection may carry at once. Envoy multiplexes every request of a
/// worker over few connections, so this is well above what one needs, and bounds what one
/// client can start at once (beyond it the client queues; the store's admission bounds the
/// work itself).
pub(crate) const MAX_CONCURRENT_STREAMS: u32 = 1024;

/// HTTP/2 pings on an idle connection, and how long an answer may take: a peer that went
/// away without a FIN is noticed, and its connection slot given back.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection's lifetime: then GOAWAY, calls in flight finish (within the call timeout)
/// and the client reconnects. No client holds a slot for ever, however it behaves, and
/// after a scale-out Envoy's connections spread over the new instances within this.
pub(crate) const MAX_CONNECTION_AGE: Duration = Duration::from_secs(600);

/// The HTTP/2 client preface (RFC 9113 section 3.4): a connection has until the header
/// timeout to send it whole, so a socket that sends nothing (or dribbles) holds its slot
/// for seconds, as on the HTTP listener.
const PREFACE_BYTES: usize = 24;

/// tonic asks each connection who is at the other end; the service answers from the
/// request alone.
impl Connected for Handed {
    type ConnectInfo = ();

    fn connect_info(&self) {}
}

/// The service: what it needs to turn descriptors into checks.
pub(crate) struct RateLimiter {
    /// Policies, overrides and descriptors: swapped whole by a reload.
    pub(crate) live: Arc<LiveConfig>,
    pub(crate) limiter: Arc<Limiter>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) caps: Caps,
}

/// The gRPC listener's bounds, from `[server]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bounds {
    /// Connections open at once (`server.grpc_max_connections`): beyond it, connects wait
    /// in the kernel's backlog until one closes.
    pub(crate) max_connections: usize,
    /// From accept to the whole HTTP/2 preface (`server.header_timeout`).
    pub(crate) handshake_timeout: Duration,
    /// A request message's size (`server.max_body_bytes`): `RESOURCE_EXHAUSTED` beyond.
    pub(crate) max_message_bytes: usize,
    /// Request headers (`server.max_header_bytes`): HTTP/2's header list size.
    pub(crate) max_header_bytes: usize,
    /// A call answered or cancelled (`DEADLINE_EXCEEDED`) within this
    /// (`server.body_timeout`); a shorter `grpc-timeout` from the client wins.
    pub(crate) timeout: Duration,
}

/// What one request descriptor asks.
enum Slot {
    /// Matches no policy: not limited.
    NotLimited,
    Check(Check),
    /// Counted after the work: charged, never denied ([`Limiter::charge`]).
    Charge(Check),
    /// Matches `policy` but has no usable key (a value empty, not UTF-8, or over
    /// `server.max_key_bytes`) or asks more than the policy's capacity: `OVER_LIMIT`, as a
    /// forward-auth request without its key is denied. The value is the client's to
    /// choose, so it may cost the client its own request, never lift a limit: the other
    /// descriptors are only peeked and nothing is charged.
    Invalid(Arc<Policy>),
}

impl RateLimiter {
    /// One call: each descriptor to a [`Slot`], the checks to the limiter as one batch
    /// (peeks only when a descriptor is invalid), the answers to Envoy's response.
    pub(crate) async fn should_rate_limit(
        &self,
        req: WireRequest,
    ) -> Result<RateLimitResponse, Status> {
        let started = Instant::now();
        let slots = self.slots(&req)?;
        let invalid = slots.iter().any(|s| matches!(s, Slot::Invalid(_)));
        let matched: Vec<Check> = slots
            .iter()
            .filter_map(|s| match s {
                Slot::Check(c) if invalid => Some(Check {
                    cost: 0,
                    ..c.clone()
                }),
                Slot::Check(c) => Some(c.clone()),
                _ => None,
            })
            .collect();
        let decisions = if matched.is_empty() {
            Vec::new()
        } else {
            self.limiter
                .check_batch(&matched)
                .await
                .map_err(|shed| Status::unavailable(shed.to_string()))?
        };
        // The work was done whatever the other descriptors say: each charge stands alone.
        let charges = futures_util::future::join_all(slots.iter().filter_map(|s| match s {
            Slot::Charge(c) => Some(self.limiter.charge(c)),
            _ => None,
        }))
        .await
        .into_iter()
        .collect::<Result<Vec<Decision>, _>>()
        .map_err(|shed| Status::unavailable(shed.to_string()))?;
        for s in &slots {
            if let Slot::Invalid(p) = s {
                self.metrics
                    .grpc_invalid_descriptors
                    .with_label_values(&[p.name.as_str()])
                    .inc();
            }
        }
        let response = respond(&slots, &decisions, &charges);
        self.metrics
            .check_duration
            .grpc
            .observe(started.elapsed().as_secs_f64());
        Ok(response)
    }

    /// One slot per request descriptor. Only what Envoy's configuration decides (the
    /// domain, how many descriptors) can fail the whole call.
    fn slots(&self, req: &WireRequest) -> Result<Vec<Slot>, Status> {
        let Ok(domain) = std::str::from_utf8(&req.domain) else {
            return Err(Status::invalid_argument("domain: not UTF-8"));
        };
        if domain.is_empty() {
            return Err(Status::invalid_argument("domain: must not be empty"));
        }
        if req.descriptors.is_empty() {
            return Err(Status::invalid_argument(
                "descriptors: must hold at least one descriptor",
            ));
        }
        if req.descriptors.len() > self.caps.max_batch {
            return Err(Status::invalid_argument(format!(
                "descriptors: {} given; at most {} (server.max_batch)",
                req.descriptors.len(),
                self.caps.max_batch
            )));
        }
        let live = self.live.get();
        Ok(req
            .descriptors
            .iter()
            .map(|d| self.slot(&live, domain, d, req.hits_addend))
            .collect())
    }

    fn slot(&self, live: &Live, domain: &str, d: &WireDescriptor, request_hits: u32) -> Slot {
        // Matching reads bytes that are not UTF-8 as U+FFFD: the descriptor still finds
        // its policy (and fails as invalid there) instead of escaping every limit.
        let lossy: Vec<(Cow<'_, str>, Cow<'_, str>)> = d
            .entries
            .iter()
            .map(|e| {
                (
                    String::from_utf8_lossy(&e.key),
                    String::from_utf8_lossy(&e.value),
                )
            })
            .collect();
        let entries = lossy.iter().map(|(k, v)| (k.as_ref(), v.as_ref()));
        let Some(matched) = live.descriptors.matched(domain, entries) else {
            return Slot::NotLimited;
        };
        let Some(base) = live.policies.get(matched.policy) else {
            return Slot::NotLimited; // validated at load: cannot happen
        };
        let values: Option<Vec<&str>> = d
            .entries
            .iter()
            .map(|e| std::str::from_utf8(&e.value).ok().filter(|v| !v.is_empty()))
            .collect();
        let Some(values) = values else {
            return Slot::Invalid(base.clone());
        };
        let key = key::join(values);
        if key.len() > self.caps.max_key_bytes {
            return Slot::Invalid(base.clone());
        }
        let policy = live.policies.for_key(base, &key);
        let cost = match &d.hits_addend {
            Some(h) => h.value,
            None if request_hits == 0 => 1,
            None => u64::from(request_hits),
        };
        let charge = matched.charge && cost > 0;
        let most = if charge {
            policy.max_settle_cost()
        } else {
            policy.capacity()
        };
        if cost > most {
            return Slot::Invalid(policy);
        }
        let check = Check {
            policy,
            key,
            cost,
            group: None,
            reserve: false,
        };
        if charge {
            Slot::Charge(check)
        } else {
            Slot::Check(check)
        }
    }
}

/// The response: a status per request descriptor, in order (the decisions are those of
/// the checks, in order), and the RateLimit headers of the decisions.
fn respond(slots: &[Slot], decisions: &[Decision], charges: &[Decision]) -> RateLimitResponse {
    let mut ds = decisions.iter();
    let mut cs = charges.iter();
    let statuses: Vec<DescriptorStatus> = slots
        .iter()
        .map(|s| match s {
            Slot::Check(c) => match ds.next() {
                Some(d) => status(&c.policy, d),
                None => DescriptorStatus::default(),
            },
            Slot::Charge(c) => match cs.next() {
                Some(d) => status(&c.policy, d),
                None => DescriptorStatus::default(),
            },
            Slot::Invalid(p) => DescriptorStatus {
                code: Code::OverLimit as i32,
                current_limit: Some(current_limit(p)),
                ..Default::default()
            },
            Slot::NotLimited => DescriptorStatus {
                code: Code::Ok as i32,
                ..Default::default()
            },
        })
        .collect();
    let over = statuses.iter().any(|s| s.code == Code::OverLimit as i32);
    RateLimitResponse {
        overall_code: if over { Code::OverLimit } else { Code::Ok } as i32,
        statuses,
        response_headers_to_add: ratelimit_headers(decisions)
            .into_iter()
            .map(|(k, v)| HeaderValue {
                key: k.to_owned(),
                value: v,
            })
            .collect(),
    }
}

fn status(policy: &Policy, d: &Decision) -> DescriptorStatus {
    DescriptorStatus {
        code: if d.allowed { Code::Ok } else { Code::OverLimit } as i32,
        current_limit: Some(current_limit(policy)),
        limit_remaining: u32::try_from(d.remaining).unwrap_or(u32::MAX),
        duration_until_reset: Some(pb_duration(Duration::from_millis(d.reset_after_ms))),
    }
}

/// Envoy's units with a fixed length (a month or a year has none).
const UNITS: [(u64, Unit); 5] = [
    (1, Unit::Second),
    (60, Unit::Minute),
    (3_600, Unit::Hour),
    (86_400, Unit::Day),
    (604_800, Unit::Week),
];

/// The policy's limit in Envoy's terms: its calendar period or its window when that is a
/// unit; else the same rate per the next longer unit when the window divides it (10 per
/// 30s = 20 per MINUTE); else the limit per `UNKNOWN` (the window is in `/v1/policies`).
/// `name` is the policy's.
pub(crate) fn current_limit(policy: &Policy) -> RateLimit {
    let limit = policy.limit.get();
    if let Some(c) = &policy.calendar {
        // A calendar period is Envoy's unit of the same name.
        let unit = match c.calendar().period() {
            Period::Day => Unit::Day,
            Period::Week => Unit::Week,
            Period::Month => Unit::Month,
            Period::Year => Unit::Year,
        };
        return RateLimit {
            name: policy.name.clone(),
            requests_per_unit: u32::try_from(limit).unwrap_or(u32::MAX),
            unit: unit as i32,
        };
    }
    let window = policy.window.as_nanos();
    let (per_unit, unit) = UNITS
        .iter()
        .map(|&(secs, unit)| (u128::from(secs) * 1_000_000_000, unit))
        .find(|&(unit_ns, _)| unit_ns >= window)
        .filter(|&(unit_ns, _)| window > 0 && unit_ns % window == 0)
        .map_or((u128::from(limit), Unit::Unknown), |(unit_ns, unit)| {
            (u128::from(limit) * (unit_ns / window), unit)
        });
    RateLimit {
        name: policy.name.clone(),
        requests_per_unit: u32::try_from(per_unit).unwrap_or(u32::MAX),
        unit: unit as i32,
    }
}

fn pb_duration(d: Duration) -> PbDuration {
    PbDuration {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

/// Serves the rate-limit service on `listener` until the drain stops accepting; then
/// in-flight calls finish (HTTP/2 GOAWAY) and connections close. The app's drain deadline
/// bounds the wait.
pub(crate) async fn serve(
    listener: Listener,
    service: RateLimiter,
    bounds: Bounds,
    drain: Drain,
) -> Result<(), tonic::transport::Error> {
    let metrics = ListenerMetrics::new(&service.metrics, "grpc");
    let accept = Handoff {
        max_connections: bounds.max_connections,
        first_bytes: PREFACE_BYTES,
        first_bytes_timeout: bounds.handshake_timeout,
    };
    let svc = wire::Server::new(service, bounds.max_message_bytes);
    tonic::transport::Server::builder()
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
        .http2_max_header_list_size(u32::try_from(bounds.max_header_bytes).unwrap_or(u32::MAX))
        .timeout(bounds.timeout)
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .max_connection_age(MAX_CONNECTION_AGE)
        .max_connection_age_grace(bounds.timeout)
        .add_service(svc)
        .serve_with_incoming_shutdown(server::incoming(listener, accept, metrics), drain.closing())
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{FailMode, PolicySpec};
    use quotad_core::algorithm::Algorithm;

    fn limit(n: u64, window: Duration) -> (u32, Unit) {
        let p = Policy::new(PolicySpec {
            name: "p",
            algorithm: Algorithm::FixedWindow,
            limit: n,
            window,
            burst: None,
            on_store_error: FailMode::Open,
            shadow: false,
            global: None,
        })
        .unwrap();
        let r = current_limit(&p);
        (r.requests_per_unit, Unit::try_from(r.unit).unwrap())
    }

    #[test]
    fn windows_map_to_envoy_units() {
        let s = Duration::from_secs;
        assert_eq!(limit(10, s(1)), (10, Unit::Second));
        assert_eq!(limit(10, s(60)), (10, Unit::Minute));
        assert_eq!(limit(10, s(3600)), (10, Unit::Hour));
        assert_eq!(limit(10, s(86_400)), (10, Unit::Day));
        assert_eq!(limit(10, s(604_800)), (10, Unit::Week));
        assert_eq!(limit(10, s(30)), (20, Unit::Minute), "the same rate");
        assert_eq!(limit(5, Duration::from_millis(100)), (50, Unit::Second));
        assert_eq!(
            limit(10, s(7)),
            (10, Unit::Unknown),
            "7 s does not divide a minute"
        );
        assert_eq!(limit(10, s(2 * 86_400)), (10, Unit::Unknown));
    }
}
