//! One Envoy `ShouldRateLimit` call from a blocking test, and the client behind it: a
//! tonic client of the same messages the daemon serves (`api::grpc::envoy`).

use quotad_daemon::envoy::{
    Entry, RateLimitDescriptor, RateLimitRequest, RateLimitResponse, SHOULD_RATE_LIMIT,
};
use tonic::transport::Channel;

/// A client of `envoy.service.ratelimit.v3.RateLimitService`, as Envoy calls it.
#[derive(Debug, Clone)]
pub struct RateLimitServiceClient {
    inner: tonic::client::Grpc<Channel>,
}

impl RateLimitServiceClient {
    pub fn new(channel: Channel) -> Self {
        RateLimitServiceClient {
            inner: tonic::client::Grpc::new(channel),
        }
    }

    /// Connects to `dst` (`http://host:port`; a test's own address, so not one is
    /// malformed).
    pub async fn connect(dst: String) -> Result<Self, tonic::transport::Error> {
        let endpoint = Channel::from_shared(dst).expect("a URI");
        endpoint.connect().await.map(Self::new)
    }

    /// One `ShouldRateLimit` call.
    pub async fn should_rate_limit(
        &mut self,
        request: RateLimitRequest,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        self.inner
            .ready()
            .await
            .map_err(|e| tonic::Status::unavailable(format!("not ready: {e}")))?;
        let path = tonic::codegen::http::uri::PathAndQuery::from_static(SHOULD_RATE_LIMIT);
        let codec = tonic_prost::ProstCodec::<RateLimitRequest, RateLimitResponse>::default();
        self.inner
            .unary(tonic::Request::new(request), path, codec)
            .await
    }
}

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

/// Envoy's response-path call: one descriptor `("api_key", key)` of `domain` with
/// `hits` as its own `hits_addend`; `Ok` when answered `OK`.
pub fn charge(port: u16, domain: &str, key: &str, hits: u64) -> Result<(), String> {
    crate::runtime().block_on(async {
        let mut client = RateLimitServiceClient::connect(format!("http://127.0.0.1:{port}"))
            .await
            .map_err(|e| e.to_string())?;
        let request = RateLimitRequest {
            domain: domain.into(),
            descriptors: vec![RateLimitDescriptor {
                hits_addend: Some(quotad_daemon::envoy::UInt64Value { value: hits }),
                ..descriptor(&[("api_key", key)])
            }],
            hits_addend: 0,
        };
        let r = client
            .should_rate_limit(request)
            .await
            .map_err(|s| s.to_string())?
            .into_inner();
        match r.overall_code {
            1 => Ok(()),
            code => Err(format!("overall code {code}: {r:?}")),
        }
    })
}
