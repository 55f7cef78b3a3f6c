//! One Envoy `ShouldRateLimit` call from a blocking test, through a tonic client built
//! from the same envoy-types as the server.

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};

/// A request descriptor from `(key, value)` entries.
pub fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: (*k).into(),
                value: (*v).into(),
            })
            .collect(),
        ..Default::default()
    }
}

/// Calls the gRPC listener on `port` with one descriptor of `entries` in `domain`: the
/// response, or the call's status code (`Unavailable` when nothing listens).
pub fn should_rate_limit(
    port: u16,
    domain: &str,
    entries: &[(&str, &str)],
) -> Result<RateLimitResponse, tonic::Code> {
    crate::runtime().block_on(async {
        let channel = tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{port}"))
            .expect("uri")
            .connect()
            .await
            .map_err(|_| tonic::Code::Unavailable)?;
        let request = RateLimitRequest {
            domain: domain.into(),
            descriptors: vec![descriptor(entries)],
            hits_addend: 0,
        };
        RateLimitServiceClient::new(channel)
            .should_rate_limit(request)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| s.code())
    })
}
