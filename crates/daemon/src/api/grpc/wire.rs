//! `ShouldRateLimit` as it arrives on the wire: the request decoded with `bytes` where
//! Envoy's `RateLimitRequest` has `string` (the two are the same on the wire), the codec,
//! and the tonic service that routes the one method to [`super::RateLimiter`].
//!
//! Why not the generated `RateLimitServiceServer`: prost refuses a whole message when one
//! string field is not UTF-8, and tonic answers a decode error `INTERNAL`. A header value
//! is the client's to choose, so one bad byte would fail every descriptor of the call, and
//! Envoy with `failure_mode_deny: false` lets such a request through unlimited. Here a
//! value that is not UTF-8 fails only its own descriptor (`super::Slot::Invalid`), and a
//! message that is not protobuf at all is `INVALID_ARGUMENT`.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use prost::Message;
use tonic::Status;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::{Body, BoxFuture, StdError, http};
use tonic::server::{Grpc, NamedService, UnaryService};

use super::RateLimiter;
use super::envoy::{RateLimitResponse, SHOULD_RATE_LIMIT, UInt64Value};
use crate::api::request_log::{self, Line};

/// `envoy.service.ratelimit.v3.RateLimitRequest`, strings as bytes.
#[derive(Clone, PartialEq, Message)]
pub(crate) struct WireRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub(crate) domain: Vec<u8>,
    #[prost(message, repeated, tag = "2")]
    pub(crate) descriptors: Vec<WireDescriptor>,
    #[prost(uint32, tag = "3")]
    pub(crate) hits_addend: u32,
}

/// `envoy.extensions.common.ratelimit.v3.RateLimitDescriptor`, without the `limit`
/// override (tag 2), which quotad ignores (docs/envoy.md) and prost skips.
#[derive(Clone, PartialEq, Message)]
pub(crate) struct WireDescriptor {
    #[prost(message, repeated, tag = "1")]
    pub(crate) entries: Vec<WireEntry>,
    #[prost(message, optional, tag = "3")]
    pub(crate) hits_addend: Option<UInt64Value>,
}

/// One descriptor entry: `key` and `value` as sent.
#[derive(Clone, PartialEq, Message)]
pub(crate) struct WireEntry {
    #[prost(bytes = "vec", tag = "1")]
    pub(crate) key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub(crate) value: Vec<u8>,
}

/// Decodes [`WireRequest`] (a decode error is the client's: `INVALID_ARGUMENT`), encodes
/// Envoy's response.
#[derive(Debug, Clone, Copy, Default)]
struct WireCodec;

struct WireDecoder;
struct WireEncoder;

impl Codec for WireCodec {
    type Encode = RateLimitResponse;
    type Decode = WireRequest;
    type Encoder = WireEncoder;
    type Decoder = WireDecoder;

    fn encoder(&mut self) -> WireEncoder {
        WireEncoder
    }

    fn decoder(&mut self) -> WireDecoder {
        WireDecoder
    }
}

impl Encoder for WireEncoder {
    type Item = RateLimitResponse;
    type Error = Status;

    fn encode(&mut self, item: RateLimitResponse, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        item.encode(buf)
            .map_err(|e| Status::internal(format!("cannot encode the response: {e}")))
    }
}

impl Decoder for WireDecoder {
    type Item = WireRequest;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<WireRequest>, Status> {
        WireRequest::decode(buf)
            .map(Some)
            .map_err(|e| Status::invalid_argument(format!("not a RateLimitRequest: {e}")))
    }
}

/// The rate-limit service as tonic serves it.
#[derive(Clone)]
pub(super) struct Server {
    inner: Arc<RateLimiter>,
    max_message_bytes: usize,
}

impl Server {
    pub(super) fn new(inner: RateLimiter, max_message_bytes: usize) -> Self {
        Server {
            inner: Arc::new(inner),
            max_message_bytes,
        }
    }
}

impl NamedService for Server {
    const NAME: &'static str = "envoy.service.ratelimit.v3.RateLimitService";
}

/// One `ShouldRateLimit` call.
struct Method(Arc<RateLimiter>);

impl UnaryService<WireRequest> for Method {
    type Response = RateLimitResponse;
    type Future = BoxFuture<tonic::Response<RateLimitResponse>, Status>;

    fn call(&mut self, request: tonic::Request<WireRequest>) -> Self::Future {
        let inner = self.0.clone();
        Box::pin(async move {
            inner
                .should_rate_limit(request.into_inner())
                .await
                .map(tonic::Response::new)
        })
    }
}

impl<B> tower_service::Service<http::Request<B>> for Server
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let inner = self.inner.clone();
        if req.uri().path() != SHOULD_RATE_LIMIT {
            return Box::pin(async move {
                let resp = Status::unimplemented("only ShouldRateLimit is served").into_http();
                count(&inner, &resp);
                Ok(resp)
            });
        }
        let max = self.max_message_bytes;
        let sampled = request_log::sampled(inner.live.request_every())
            .then(|| (Instant::now(), request_log::trace_id(req.headers())));
        Box::pin(async move {
            let mut grpc = Grpc::new(WireCodec).apply_max_message_size_config(Some(max), None);
            let resp = grpc.unary(Method(inner.clone()), req).await;
            let code = count(&inner, &resp);
            if let Some((started, trace_id)) = sampled {
                Line {
                    entry: "grpc",
                    route: SHOULD_RATE_LIMIT,
                    status: code_name(code),
                    took: started.elapsed(),
                    trace_id,
                    summary: None,
                }
                .write();
            }
            Ok(resp)
        })
    }
}

/// Counts a call's answer by its status code (`quotad_grpc_responses_total{code}`): an
/// error's `grpc-status` travels in the headers (a trailers-only answer); a response
/// without one is `OK` (its status follows the message, in the trailers).
fn count<T>(inner: &RateLimiter, resp: &http::Response<T>) -> tonic::Code {
    let code = resp
        .headers()
        .get("grpc-status")
        .map_or(tonic::Code::Ok, |v| tonic::Code::from_bytes(v.as_bytes()));
    inner
        .metrics
        .grpc_responses
        .with_label_values(&[code_name(code)])
        .inc();
    code
}

/// A status code's name as gRPC writes it (`INVALID_ARGUMENT`).
pub(super) fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::grpc::envoy::{Entry, RateLimitDescriptor, RateLimitRequest};

    /// `RateLimitRequest { domain: "edge", descriptors: [{ entries: [user=ann],
    /// hits_addend: 3 }], hits_addend: 2 }` as Envoy sends it, byte by byte from rls.proto's
    /// and ratelimit.proto's field numbers.
    const ENVOYS_REQUEST: &[u8] = &[
        0x0a, 4, b'e', b'd', b'g', b'e', // 1: domain
        0x12, 17, // 2: descriptors[0], 17 bytes
        0x0a, 11, // 1: entries[0], 11 bytes
        0x0a, 4, b'u', b's', b'e', b'r', // 1: key
        0x12, 3, b'a', b'n', b'n', // 2: value
        0x1a, 2, 0x08, 3, // 3: hits_addend { 1: value }
        0x18, 2, // 3: hits_addend
    ];

    #[test]
    fn envoys_request_decodes_as_the_wire_request() {
        let got = WireRequest::decode(ENVOYS_REQUEST).unwrap();
        assert_eq!(got.domain, b"edge");
        assert_eq!(got.hits_addend, 2);
        let d = &got.descriptors[0];
        assert_eq!(
            (&d.entries[0].key[..], &d.entries[0].value[..]),
            (&b"user"[..], &b"ann"[..])
        );
        assert_eq!(d.hits_addend, Some(UInt64Value { value: 3 }));
    }

    #[test]
    fn the_clients_request_is_envoys() {
        let sent = RateLimitRequest {
            domain: "edge".into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: "user".into(),
                    value: "ann".into(),
                }],
                hits_addend: Some(UInt64Value { value: 3 }),
            }],
            hits_addend: 2,
        };
        assert_eq!(sent.encode_to_vec(), ENVOYS_REQUEST);
    }
}
