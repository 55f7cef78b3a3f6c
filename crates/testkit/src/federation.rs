//! Federations for tests. The smallest a config can name: this daemon is region `eu`, and
//! its one peer, `us`, never answers. That is enough for a global policy to be valid and
//! for `eu` to coordinate on its own; tests of the peer endpoint play `us` themselves, by
//! signing requests with the shared secret. And [`TwoRegions`]: both regions real.

use std::sync::{Arc, Mutex};

use crate::config::{Config, Global, Peer};
use crate::proxy::{Leg, LegHandle, Proxy};
use crate::{Quotad, RedisServer};

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

/// Two real regions, `eu` (0) and `us` (1): a redis-server and a daemon each, each calling
/// the other through a loopback [`Proxy`] (so a restarted daemon, which keeps its port, is
/// reached again, and a test can cut or delay a leg).
pub struct TwoRegions {
    pub redis: [RedisServer; 2],
    pub daemons: Vec<Quotad>,
    /// `proxies[a]`: region a calling the other.
    pub proxies: Vec<Proxy>,
}

/// The regions' names, in id order.
pub const TWO_REGIONS: [&str; 2] = ["eu", "us"];

impl TwoRegions {
    /// Starts both regions: `before` runs on the two Redis servers first, then region `me`
    /// runs the config `config(me, its redis URL, the URL it reaches the other one at)`.
    pub fn start(
        before: impl FnOnce(&[RedisServer; 2]),
        config: impl Fn(usize, &str, &str) -> String,
    ) -> TwoRegions {
        let redis = [RedisServer::start(), RedisServer::start()];
        before(&redis);
        let leg = || -> LegHandle { Arc::new(Mutex::new(Leg::default())) };
        let proxies: Vec<Proxy> = (0..2).map(|_| Proxy::start(leg(), leg())).collect();
        let daemons: Vec<Quotad> = (0..2)
            .map(|me| Quotad::start(&config(me, &redis[me].url(), &proxies[me].url())))
            .collect();
        for (a, p) in proxies.iter().enumerate() {
            p.set_target(daemons[1 - a].port);
        }
        TwoRegions {
            redis,
            daemons,
            proxies,
        }
    }

    pub fn eu(&self) -> &Quotad {
        &self.daemons[0]
    }

    pub fn us(&self) -> &Quotad {
        &self.daemons[1]
    }
}
