//! `[store]`: where counters live (the embedded store or Redis), how calls to Redis are
//! bounded, and how many may wait for it.

use std::time::Duration;

use toml::Spanned;

use super::secret::Sources;
use super::{NAME_RULE, Validator, raw};
use crate::policy;
use crate::store::{AdmissionSettings, RedisSettings, Target, TlsFiles, Topology};

/// Where limiter state lives (`[store]`).
#[derive(Debug, Clone, PartialEq)]
#[allow(clippy::large_enum_variant)] // built once, at start-up
pub enum StoreBackend {
    /// The embedded store (`backend = "memory"`).
    Memory,
    /// A Redis server, Sentinel set or Cluster.
    Redis(RedisSettings),
}

pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_millis(50);
pub(crate) const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
pub(crate) const DEFAULT_BREAKER_THRESHOLD: i64 = 3;
pub(crate) const DEFAULT_PROBE_INTERVAL: Duration = Duration::from_millis(100);
/// Redis calls in flight: enough to keep Redis's pipeline full (its -P 32 ceiling with 50
/// clients was reached at a few hundred), few enough that a call's wait inside Redis stays
/// a few ms (256 scripts at ~20 us each).
pub(crate) const DEFAULT_MAX_IN_FLIGHT: i64 = 256;
/// Requests waiting for Redis: about 100 ms of work at the ~40k decisions/s of a 2-core
/// machine. Beyond it a request would wait longer than any client's timeout allows.
pub(crate) const DEFAULT_MAX_QUEUED: i64 = 4096;
pub(crate) const DEFAULT_QUEUE_TIMEOUT: Duration = Duration::from_millis(100);
/// Denials remembered (about 100 bytes each): enough for every key a flood can be hitting.
pub(crate) const DEFAULT_DENY_CACHE_KEYS: i64 = 100_000;
/// A million keys: about 100 MB for counters and buckets, about 400 MB for sliding logs at a
/// limit of 5 (measured: 394 MB for 1.1 M keys).
pub(crate) const DEFAULT_MEMORY_MAX_KEYS: i64 = 1_000_000;
pub(crate) const DEFAULT_KEY_PREFIX: &str = "rl";
/// A sweep of a million keys takes 10,000 paced SCAN steps: a few minutes between sweeps
/// keeps the janitor's share of Redis negligible and a lost TTL short-lived.
pub(super) const DEFAULT_JANITOR_INTERVAL: Duration = Duration::from_secs(300);

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
        let backend = match self.target(&s) {
            None => StoreBackend::Memory,
            Some(target) => StoreBackend::Redis(RedisSettings {
                target,
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
            }),
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

    /// The Redis deployment: exactly one of `redis` (a URL, or "memory"), `redis_cluster`
    /// (seed nodes) and `redis_sentinels` (with `redis_sentinel_master`), with the TLS files
    /// and credentials. `None`: the embedded store.
    fn target(&mut self, s: &raw::Store) -> Option<Target> {
        let standalone = s.redis.as_ref().filter(|u| u.get_ref() != "memory");
        let span = |v: Option<usize>, field: &'static str| v.map(|at| (at, field));
        let chosen: Vec<(usize, &str)> = [
            span(standalone.map(|u| u.span().start), "store.redis"),
            span(
                s.redis_cluster.as_ref().map(|v| v.span().start),
                "store.redis_cluster",
            ),
            span(
                s.redis_sentinels.as_ref().map(|v| v.span().start),
                "store.redis_sentinels",
            ),
        ]
        .into_iter()
        .flatten()
        .collect();
        if let [(_, first), (at, second), ..] = chosen.as_slice() {
            let msg = format!("choose one topology: {first} and {second} are both set");
            self.error_at(*at, second, msg);
            return None;
        }
        if let (Some(m), None) = (&s.redis_sentinel_master, &s.redis_sentinels) {
            self.error(
                m,
                "store.redis_sentinel_master",
                "needs store.redis_sentinels",
            );
        }
        let errors_before = self.errors.len();
        let topology = if let Some(url) = standalone {
            self.url(url, "store.redis", true);
            Topology::Standalone(url.get_ref().clone())
        } else if let Some(seeds) = &s.redis_cluster {
            Topology::Cluster(self.urls(seeds, "store.redis_cluster"))
        } else if let Some(sentinels) = &s.redis_sentinels {
            self.sentinel(sentinels, s.redis_sentinel_master.as_ref())
        } else {
            let why = "only with a Redis store (store.redis, store.redis_cluster or store.redis_sentinels)";
            self.unused(&tls_keys(s), why);
            self.unused(&credential_keys(s), why);
            return None;
        };
        let mut target = Target {
            topology,
            tls: TlsFiles::default(),
            username: s.username.as_ref().map(|u| u.get_ref().clone()),
            password: self.secret_text("store.password", &password_sources(s)),
        };
        if target.uses_tls() {
            target.tls = self.tls_files(s);
        } else {
            self.unused(&tls_keys(s), "TLS files are set but no URL is rediss://");
        }
        // Only a target without errors of its own is worth building (one error per mistake).
        if self.errors.len() > errors_before {
            return Some(target);
        }
        if let (Err(e), Some((at, field))) = (target.check(), chosen.first()) {
            self.error_at(*at, field, format!("cannot build a Redis client: {e}"));
        }
        Some(target)
    }

    /// Sentinel: the sentinels' URLs and the master's name.
    fn sentinel(
        &mut self,
        sentinels: &Spanned<Vec<Spanned<String>>>,
        master: Option<&Spanned<String>>,
    ) -> Topology {
        let urls = self.urls(sentinels, "store.redis_sentinels");
        let field = "store.redis_sentinel_master";
        let master = match master {
            Some(m) if policy::valid_name(m.get_ref()) => m.get_ref().clone(),
            Some(m) => {
                self.error(m, field, NAME_RULE);
                String::new()
            }
            None => {
                let why = "required with store.redis_sentinels: the master's name in the sentinels' config";
                self.error(sentinels, field, why);
                String::new()
            }
        };
        Topology::Sentinel {
            sentinels: urls,
            master,
        }
    }

    /// An error on each of `keys` that is set, where it cannot apply.
    fn unused(&mut self, keys: &[(Option<&Spanned<String>>, &str)], why: &str) {
        for (v, field) in keys {
            if let Some(v) = v {
                self.error(v, field, why);
            }
        }
    }

    /// A non-empty list of server URLs.
    fn urls(&mut self, list: &Spanned<Vec<Spanned<String>>>, field: &str) -> Vec<String> {
        if list.get_ref().is_empty() {
            self.error(list, field, "needs at least one redis:// or rediss:// URL");
        }
        list.get_ref()
            .iter()
            .map(|u| {
                self.url(u, field, false);
                u.get_ref().clone()
            })
            .collect()
    }

    /// A URL the client accepts (so that a bad one fails validation rather than the first
    /// connection): `redis://`, `rediss://` (TLS), and `unix://` where `unix` allows.
    fn url(&mut self, url: &Spanned<String>, field: &str, unix: bool) {
        let u = url.get_ref();
        let scheme_ok = u.starts_with("redis://")
            || u.starts_with("rediss://")
            || (unix && u.starts_with("unix://"));
        if !scheme_ok {
            let forms = if unix {
                "must be \"memory\", redis://[USER:PASSWORD@]HOST:PORT[/DB], rediss://... (TLS) or unix:///PATH"
            } else {
                "must be redis://[USER:PASSWORD@]HOST:PORT or rediss://... (TLS)"
            };
            self.error(url, field, forms);
        } else if let Err(e) = redis::Client::open(u.as_str()) {
            self.error(url, field, format!("invalid Redis URL: {e}"));
        }
    }

    /// The PEM files, read now: a missing or unreadable file is a config error, not a
    /// failed connection later. Relative paths are relative to the config file.
    fn tls_files(&mut self, s: &raw::Store) -> TlsFiles {
        let ca = s
            .tls_ca_file
            .as_ref()
            .and_then(|f| self.pem(f, "store.tls_ca_file"));
        let cert = s
            .tls_cert_file
            .as_ref()
            .and_then(|f| self.pem(f, "store.tls_cert_file"));
        let key = s
            .tls_key_file
            .as_ref()
            .and_then(|f| self.pem(f, "store.tls_key_file"));
        let client = match (&s.tls_cert_file, &s.tls_key_file) {
            (Some(_), Some(_)) => cert.zip(key),
            (Some(f), None) => {
                self.error(f, "store.tls_key_file", "required with store.tls_cert_file");
                None
            }
            (None, Some(f)) => {
                self.error(f, "store.tls_cert_file", "required with store.tls_key_file");
                None
            }
            (None, None) => None,
        };
        TlsFiles { ca, client }
    }

    fn pem(&mut self, file: &Spanned<String>, field: &str) -> Option<Vec<u8>> {
        let path = std::path::Path::new(self.file)
            .parent()
            .unwrap_or(std::path::Path::new("."))
            .join(file.get_ref());
        match std::fs::read(&path) {
            Ok(b) if b.windows(11).any(|w| w == b"-----BEGIN ") => Some(b),
            Ok(_) => {
                self.error(file, field, format!("{} is not a PEM file", path.display()));
                None
            }
            Err(e) => {
                self.error(file, field, format!("cannot read {}: {e}", path.display()));
                None
            }
        }
    }
}

/// The TLS files of `[store]`, with their fields' names.
fn tls_keys(s: &raw::Store) -> [(Option<&Spanned<String>>, &'static str); 3] {
    [
        (s.tls_ca_file.as_ref(), "store.tls_ca_file"),
        (s.tls_cert_file.as_ref(), "store.tls_cert_file"),
        (s.tls_key_file.as_ref(), "store.tls_key_file"),
    ]
}

/// The ACL credentials of `[store]`, with their fields' names.
fn credential_keys(s: &raw::Store) -> [(Option<&Spanned<String>>, &'static str); 4] {
    [
        (s.username.as_ref(), "store.username"),
        (s.password.as_ref(), "store.password"),
        (s.password_file.as_ref(), "store.password_file"),
        (s.password_env.as_ref(), "store.password_env"),
    ]
}

/// Where `store.password` may come from (`config::secret`).
fn password_sources(s: &raw::Store) -> Sources<'_> {
    Sources {
        inline: s.password.as_ref(),
        file: s.password_file.as_ref(),
        env: s.password_env.as_ref(),
    }
}
