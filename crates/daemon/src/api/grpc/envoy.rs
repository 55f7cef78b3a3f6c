//! The messages of Envoy's rate-limit service that quotad speaks, as prost structs:
//! `envoy.service.ratelimit.v3.RateLimitRequest` and `RateLimitResponse`, with the parts
//! of `envoy.extensions.common.ratelimit.v3`, `envoy.config.core.v3` and the protobuf
//! well-known types they hold. Field numbers and enum values are Envoy's (rls.proto,
//! ratelimit.proto, base.proto); a field quotad neither sets nor reads is left out, and
//! prost skips it when it arrives.
//!
//! The server decodes requests with its own byte-valued copy (`wire.rs`); the request
//! types here are for clients (the tests, the load example).

use prost::{Enumeration, Message};

/// The one method's full path: `RateLimitService/ShouldRateLimit`.
pub const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// `google.protobuf.UInt64Value`.
#[derive(Clone, Copy, PartialEq, Eq, Message)]
pub struct UInt64Value {
    /// The value.
    #[prost(uint64, tag = "1")]
    pub value: u64,
}

/// `google.protobuf.Duration`.
#[derive(Clone, Copy, PartialEq, Eq, Message)]
pub struct PbDuration {
    /// Whole seconds.
    #[prost(int64, tag = "1")]
    pub seconds: i64,
    /// Nanoseconds beyond `seconds`.
    #[prost(int32, tag = "2")]
    pub nanos: i32,
}

/// `envoy.config.core.v3.HeaderValue` (without `raw_value`).
#[derive(Clone, PartialEq, Eq, Message)]
pub struct HeaderValue {
    /// The header's name.
    #[prost(string, tag = "1")]
    pub key: String,
    /// The header's value.
    #[prost(string, tag = "2")]
    pub value: String,
}

/// `envoy.extensions.common.ratelimit.v3.RateLimitDescriptor` (without the `limit`
/// override, which quotad ignores).
#[derive(Clone, PartialEq, Eq, Message)]
pub struct RateLimitDescriptor {
    /// The descriptor's entries, in order: what `[[descriptor]]` config matches.
    #[prost(message, repeated, tag = "1")]
    pub entries: Vec<Entry>,
    /// Units this descriptor spends (`hits_addend` of the request when absent).
    #[prost(message, optional, tag = "3")]
    pub hits_addend: Option<UInt64Value>,
}

/// `RateLimitDescriptor.Entry`.
#[derive(Clone, PartialEq, Eq, Message)]
pub struct Entry {
    /// The entry's key.
    #[prost(string, tag = "1")]
    pub key: String,
    /// The entry's value.
    #[prost(string, tag = "2")]
    pub value: String,
}

/// `envoy.service.ratelimit.v3.RateLimitRequest`.
#[derive(Clone, PartialEq, Eq, Message)]
pub struct RateLimitRequest {
    /// The domain, a `[[descriptor]]` config's `domain`.
    #[prost(string, tag = "1")]
    pub domain: String,
    /// The descriptors to decide, each on its own.
    #[prost(message, repeated, tag = "2")]
    pub descriptors: Vec<RateLimitDescriptor>,
    /// Units each descriptor spends unless it says (0 means 1).
    #[prost(uint32, tag = "3")]
    pub hits_addend: u32,
}

/// `envoy.service.ratelimit.v3.RateLimitResponse` (without the request headers, raw
/// body, dynamic metadata and quota, which quotad does not send).
#[derive(Clone, PartialEq, Eq, Message)]
pub struct RateLimitResponse {
    /// `OVER_LIMIT` if any descriptor is over its limit, else `OK` (a [`Code`]).
    #[prost(enumeration = "Code", tag = "1")]
    pub overall_code: i32,
    /// One status per descriptor, in the request's order.
    #[prost(message, repeated, tag = "2")]
    pub statuses: Vec<DescriptorStatus>,
    /// The RateLimit headers for the client's response.
    #[prost(message, repeated, tag = "3")]
    pub response_headers_to_add: Vec<HeaderValue>,
}

/// `RateLimitResponse.Code`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Enumeration)]
#[repr(i32)]
pub enum Code {
    /// Not decided.
    Unknown = 0,
    /// Within the limit.
    Ok = 1,
    /// Over the limit.
    OverLimit = 2,
}

/// `RateLimitResponse.DescriptorStatus` (without the quota).
#[derive(Clone, PartialEq, Eq, Message)]
pub struct DescriptorStatus {
    /// The descriptor's answer (a [`Code`]).
    #[prost(enumeration = "Code", tag = "1")]
    pub code: i32,
    /// The limit the descriptor matched.
    #[prost(message, optional, tag = "2")]
    pub current_limit: Option<RateLimit>,
    /// Units left in the window.
    #[prost(uint32, tag = "3")]
    pub limit_remaining: u32,
    /// When the window resets.
    #[prost(message, optional, tag = "4")]
    pub duration_until_reset: Option<PbDuration>,
}

/// `RateLimitResponse.RateLimit`.
#[derive(Clone, PartialEq, Eq, Message)]
pub struct RateLimit {
    /// Units per `unit`.
    #[prost(uint32, tag = "1")]
    pub requests_per_unit: u32,
    /// The unit of time (a [`Unit`]).
    #[prost(enumeration = "Unit", tag = "2")]
    pub unit: i32,
    /// The policy's name.
    #[prost(string, tag = "3")]
    pub name: String,
}

/// `RateLimitResponse.RateLimit.Unit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Enumeration)]
#[repr(i32)]
pub enum Unit {
    /// Not set.
    Unknown = 0,
    /// Per second.
    Second = 1,
    /// Per minute.
    Minute = 2,
    /// Per hour.
    Hour = 3,
    /// Per day.
    Day = 4,
    /// Per month.
    Month = 5,
    /// Per year.
    Year = 6,
    /// Per week.
    Week = 7,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_response_is_encoded_with_envoys_field_numbers() {
        let r = RateLimitResponse {
            overall_code: Code::OverLimit as i32,
            statuses: vec![DescriptorStatus {
                code: Code::OverLimit as i32,
                current_limit: Some(RateLimit {
                    requests_per_unit: 3,
                    unit: Unit::Minute as i32,
                    name: String::new(),
                }),
                limit_remaining: 0,
                duration_until_reset: Some(PbDuration {
                    seconds: 20,
                    nanos: 0,
                }),
            }],
            response_headers_to_add: vec![HeaderValue {
                key: "x".into(),
                value: "1".into(),
            }],
        };
        // From rls.proto and base.proto: what Envoy decodes.
        let envoys: &[u8] = &[
            0x08, 2, // 1: overall_code OVER_LIMIT
            0x12, 12, // 2: statuses[0], 12 bytes
            0x08, 2, // 1: code OVER_LIMIT
            0x12, 4, 0x08, 3, 0x10, 2, // 2: current_limit { 1: 3 per, 2: MINUTE }
            0x22, 2, 0x08, 20, // 4: duration_until_reset { 1: 20 s }
            0x1a, 6, 0x0a, 1, b'x', 0x12, 1, b'1', // 3: response_headers_to_add[0]
        ];
        assert_eq!(r.encode_to_vec(), envoys);
        assert_eq!(RateLimitResponse::decode(envoys).unwrap(), r);
    }
}
