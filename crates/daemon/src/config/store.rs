//! `[store]`: where counters live (the embedded store or Redis), how calls to Redis are
//! bounded, and how many may wait for it.

use std::time::Duration;

use toml::Spanned;

use super::{NAME_RULE, Validator, raw};
use crate::policy;
use crate::store::admission::AdmissionSettings;
use crate::store::redis::RedisSettings;

#[derive(Debug, Clone)]
pub enum StoreBackend {
    Memory,
    Redis(RedisSettings),
}

pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(50);
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
pub const DEFAULT_BREAKER_THRESHOLD: i64 = 3;
pub const DEFAULT_PROBE_INTERVAL: Duration = Duration::from_millis(100);
/// Redis calls in flight: enough to keep Redis's pipeline full (its -P 32 ceiling with 50
/// clients was reached at a few hundred), few enough that a call's wait inside Redis stays
/// a few ms (256 scripts at ~20 us each).
pub const DEFAULT_MAX_IN_FLIGHT: i64 = 256;
/// Requests waiting for Redis: about 100 ms of work at the ~40k decisions/s of a 2-core
/// machine. Beyond it a request would wait longer than any client's timeout allows.
pub const DEFAULT_MAX_QUEUED: i64 = 4096;
pub const DEFAULT_QUEUE_TIMEOUT: Duration = Duration::from_millis(100);
/// Denials remembered (about 100 bytes each): enough for every key a flood can be hitting.
pub const DEFAULT_DENY_CACHE_KEYS: i64 = 100_000;
/// A million keys: about 100 MB for counters and buckets, about 400 MB for sliding logs at a
/// limit of 5 (measured: 394 MB for 1.1 M keys).
pub const DEFAULT_MEMORY_MAX_KEYS: i64 = 1_000_000;
pub const DEFAULT_KEY_PREFIX: &str = "rl";
/// A sweep of a million keys takes 10,000 paced SCAN steps: a few minutes between sweeps
/// keeps the janitor's share of Redis negligible and a lost TTL short-lived.
pub const DEFAULT_JANITOR_INTERVAL: Duration = Duration::from_secs(300);

/// How each call to Redis is bounded, and when the breaker opens and probes.
struct RedisCalls {
    timeout: Duration,
    connect_timeout: Duration,
    probe_interval: Duration,
    breaker_threshold: u32,
}

impl Validator<'_> {
    /// `[store]` (but `memory_max_keys`): the backend and the key prefix. The call bounds and
    /// admission are checked whatever the backend; `deny_cache_keys` only with Redis.
    pub(super) fn store(&mut self, s: raw::Store) -> (StoreBackend, String) {
        let key_prefix = self.key_prefix(s.key_prefix.as_ref());
        let calls = self.redis_calls(&s);
        let admission = self.admission(&s);
        let backend = match &s.redis {
            None => StoreBackend::Memory,
            Some(url) if url.get_ref() == "memory" => StoreBackend::Memory,
            Some(url) => {
                self.redis_url(url);
                StoreBackend::Redis(RedisSettings {
                    url: url.get_ref().clone(),
                    timeout: calls.timeout,
                    connect_timeout: calls.connect_timeout,
                    breaker_threshold: calls.breaker_threshold,
                    probe_interval: calls.probe_interval,
                    admission,
                    deny_cache_keys: self.integer(
                        s.deny_cache_keys.as_ref(),
                        "store.deny_cache_keys",
                        DEFAULT_DENY_CACHE_KEYS,
                        0,
                        10_000_000,
                    ) as usize,
                    janitor_interval: self.duration(
                        s.janitor_interval.as_ref(),
                        "store.janitor_interval",
                        DEFAULT_JANITOR_INTERVAL,
                        Duration::from_secs(1),
                        Duration::from_secs(86_400),
                    ),
                })
            }
        };
        (backend, key_prefix)
    }

    /// `key_prefix`: it starts every Redis key, so it keeps to characters safe in one.
    fn key_prefix(&mut self, prefix: Option<&Spanned<String>>) -> String {
        match prefix {
            None => DEFAULT_KEY_PREFIX.to_owned(),
            Some(p) if policy::valid_prefix(p.get_ref()) => p.get_ref().clone(),
            Some(p) => {
                self.error(p, "store.key_prefix", NAME_RULE);
                DEFAULT_KEY_PREFIX.to_owned()
            }
        }
    }

    /// The timeouts of one call and of connecting, and the breaker's threshold and probes.
    fn redis_calls(&mut self, s: &raw::Store) -> RedisCalls {
        let timeout = self.duration(
            s.timeout.as_ref(),
            "store.timeout",
            DEFAULT_TIMEOUT,
            Duration::from_millis(1),
            Duration::from_secs(10),
        );
        let connect_timeout = self.duration(
            s.connect_timeout.as_ref(),
            "store.connect_timeout",
            DEFAULT_CONNECT_TIMEOUT,
            Duration::from_millis(1),
            Duration::from_secs(60),
        );
        let probe_interval = self.duration(
            s.probe_interval.as_ref(),
            "store.probe_interval",
            DEFAULT_PROBE_INTERVAL,
            Duration::from_millis(10),
            Duration::from_secs(60),
        );
        let breaker_threshold = self.integer(
            s.breaker_threshold.as_ref(),
            "store.breaker_threshold",
            DEFAULT_BREAKER_THRESHOLD,
            1,
            1000,
        ) as u32;
        RedisCalls {
            timeout,
            connect_timeout,
            probe_interval,
            breaker_threshold,
        }
    }

    /// Admission in front of Redis: calls in flight, requests queued, and how long they wait.
    fn admission(&mut self, s: &raw::Store) -> AdmissionSettings {
        AdmissionSettings {
            max_in_flight: self.integer(
                s.max_in_flight.as_ref(),
                "store.max_in_flight",
                DEFAULT_MAX_IN_FLIGHT,
                1,
                100_000,
            ) as usize,
            max_queued: self.integer(
                s.max_queued.as_ref(),
                "store.max_queued",
                DEFAULT_MAX_QUEUED,
                0,
                1_000_000,
            ) as usize,
            queue_timeout: self.duration(
                s.queue_timeout.as_ref(),
                "store.queue_timeout",
                DEFAULT_QUEUE_TIMEOUT,
                Duration::from_millis(1),
                Duration::from_secs(10),
            ),
        }
    }

    /// The `redis` URL: plain TCP or a Unix socket, and one the client accepts, so that a bad
    /// URL fails validation rather than the first connection.
    fn redis_url(&mut self, url: &Spanned<String>) {
        let u = url.get_ref();
        if u.starts_with("rediss://") {
            self.error(url, "store.redis", "TLS (rediss://) is not supported by this build yet; use redis:// on a trusted network or a local TLS proxy");
        } else if !(u.starts_with("redis://") || u.starts_with("unix://")) {
            self.error(
                url,
                "store.redis",
                "must be \"memory\", redis://HOST:PORT[/DB] or unix:///PATH",
            );
        } else if let Err(e) = redis::Client::open(u.as_str()) {
            self.error(url, "store.redis", format!("invalid Redis URL: {e}"));
        }
    }
}
