//! The smallest federation a config can name: this daemon is region `eu`, and its one peer,
//! `us`, never answers. That is enough for a global policy to be valid and for `eu` to
//! coordinate on its own; tests of the peer endpoint play `us` themselves, by signing
//! requests with the shared secret.

use crate::config::{Config, Global, Peer};

/// Nothing listens on loopback's port 9 (discard): a peer there never answers.
pub const SILENT_PEER_URL: &str = "http://127.0.0.1:9";

/// Region `eu` on the Redis at `redis`, with the peer region `us` at [`SILENT_PEER_URL`],
/// sharing `secret` with it.
pub fn eu_with_silent_us(redis: &str, secret: &str) -> Config {
    Config::redis(redis)
        .region("eu")
        .peer(Peer::new("us", SILENT_PEER_URL).secret(secret))
}

/// A global policy's escrow split evenly between `eu` and `us`.
pub fn even_escrow() -> Global {
    Global::escrow(&[("eu", 1), ("us", 1)])
}
