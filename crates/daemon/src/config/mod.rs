//! Configuration: the TOML file, its validation, and the settings and policies it yields.
//!
//! Parsing and validation are separate passes. serde (with `deny_unknown_fields`) rejects
//! unknown keys and wrong types; every value that needs a semantic check is read as
//! `Spanned<T>`, so validation can name the line of each bad field. Validation collects
//! every error it finds, so `quotad validate` lists them all at once. Nothing here performs
//! I/O beyond reading the file: building stores and listeners is the app's job.

mod raw;

use std::collections::BTreeSet;
use std::fmt;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use toml::Spanned;

use crate::policy::{self, FailMode, GlobalSpec, Policy, PolicySpec};
use crate::store::admission::AdmissionSettings;
use crate::store::layout::GLOBAL_KEEP_MS;
use crate::store::redis::RedisSettings;
use quotad_core::algorithm::Algorithm;
use quotad_core::coordinator::{Mode, Params, RegionId};

/// One problem in a config file: `file:line: field: message`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: String,
    pub line: usize,
    pub field: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}: {}: {}",
            self.file, self.line, self.field, self.message
        )
    }
}

/// Every problem found in a config file, in file order.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
pub enum StoreBackend {
    Memory,
    Redis(RedisSettings),
}

#[derive(Debug, Clone)]
pub struct ServerSettings {
    pub listen: SocketAddr,
    pub drain_timeout: Duration,
    /// Time between readiness turning 503 and the listener closing.
    pub shutdown_delay: Duration,
    pub max_body_bytes: usize,
    pub max_batch: usize,
    pub max_key_bytes: usize,
    /// `None`: sized at start-up from the open-files limit
    /// ([`crate::server::default_max_connections`]).
    pub max_connections: Option<usize>,
    pub max_header_bytes: usize,
    /// From accept (or a request's first byte) to the end of its headers.
    pub header_timeout: Duration,
    /// From the end of the headers to the end of the body.
    pub body_timeout: Duration,
    /// A keep-alive connection with no request in progress.
    pub idle_timeout: Duration,
    /// `/readyz` also fails while the store is unusable (default: only while draining).
    pub ready_requires_store: bool,
    /// Bytes that request bodies being read may hold together (503 beyond).
    pub max_body_memory: usize,
}

impl ServerSettings {
    /// The defaults of `[server]`.
    pub fn defaults() -> Self {
        ServerSettings {
            listen: DEFAULT_LISTEN.parse().expect("valid default address"),
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
            shutdown_delay: default_shutdown_delay(DEFAULT_DRAIN_TIMEOUT),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES as usize,
            max_batch: DEFAULT_MAX_BATCH as usize,
            max_key_bytes: DEFAULT_MAX_KEY_BYTES as usize,
            max_connections: None,
            max_header_bytes: DEFAULT_MAX_HEADER_BYTES as usize,
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            ready_requires_store: false,
            max_body_memory: DEFAULT_MAX_BODY_MEMORY as usize,
        }
    }
}

/// `shutdown_delay` when the file does not set it: 5 s (time for load balancers and
/// kube-proxy to drop the instance after readiness fails), at most half the drain timeout.
pub fn default_shutdown_delay(drain_timeout: Duration) -> Duration {
    DEFAULT_SHUTDOWN_DELAY.min(drain_timeout / 2)
}

/// A shared secret; never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub Vec<u8>);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// A peer region: where its quotad instances answer exchanges, and the secret both sides
/// sign them with.
#[derive(Debug, Clone)]
pub struct PeerSettings {
    pub region: String,
    pub id: RegionId,
    /// Tried in order until one answers as its region's coordinator (a region may run
    /// several instances; only the lock holder coordinates).
    pub urls: Vec<String>,
    pub secret: Secret,
}

/// Global budgets: this region among the others, and the protocol's timings.
#[derive(Debug, Clone)]
pub struct GlobalSettings {
    /// Every region, sorted by name: a region's index here is its id in messages.
    pub regions: Vec<String>,
    pub me: RegionId,
    pub peers: Vec<PeerSettings>,
    pub params: Params,
    /// The coordinator lock's period: a dead holder is replaced within it.
    pub lock: Duration,
    /// Signed exchanges whose timestamp is further than this from our clock are refused
    /// (and nonces are remembered this long: the replay window).
    pub max_skew: Duration,
    /// Largest exchange body accepted (and reply read): what `max_exchange_keys` keys of
    /// `server.max_key_bytes` take at worst (every byte escaped), with room for the
    /// envelope. Only a peer that holds the secret gets a body read at all.
    pub max_exchange_bytes: usize,
    /// `server.max_key_bytes`: a peer's key longer than this is refused like a client's.
    pub max_key_bytes: usize,
}

/// Bytes an exchange may spend per key besides the key itself (fields, quoting, escapes
/// of a few characters), and on its envelope.
pub const EXCHANGE_BYTES_PER_KEY: usize = 128;
pub const EXCHANGE_ENVELOPE_BYTES: usize = 64 * 1024;

/// Everything the daemon needs, validated.
#[derive(Debug, Clone)]
pub struct Settings {
    pub region: String,
    pub server: ServerSettings,
    pub store: StoreBackend,
    pub key_prefix: String,
    /// Keys the embedded store (the primary in memory mode, and the `local` fallback)
    /// holds at most.
    pub memory_max_keys: usize,
    pub policies: Vec<Policy>,
    /// Present when at least one policy is global.
    pub global: Option<GlobalSettings>,
}

pub const DEFAULT_LISTEN: &str = "127.0.0.1:8686";
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
pub const DEFAULT_MAX_BODY_BYTES: i64 = 64 * 1024;
pub const DEFAULT_MAX_BATCH: i64 = 64;
pub const DEFAULT_MAX_KEY_BYTES: i64 = 512;
pub const DEFAULT_SHUTDOWN_DELAY: Duration = Duration::from_secs(5);
/// Request headers (request line included): 431 beyond. nginx holds 8 KiB per line;
/// quotad's requests carry a few hundred bytes, and a connection dribbling headers holds a
/// read buffer of this size.
pub const DEFAULT_MAX_HEADER_BYTES: i64 = 8 * 1024;
/// Request bodies being read, together: 1,024 full 64 KiB bodies. Normal checks carry a few
/// hundred bytes; this is what slow or hostile senders can pin.
pub const DEFAULT_MAX_BODY_MEMORY: i64 = 64 << 20;
/// Long enough for any client on a slow link to send a few hundred bytes of headers; short
/// enough that a slowloris holds a connection for seconds, not forever.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(10);
/// Above the idle timeouts of common client pools and load balancers (AWS ALB 60 s), so
/// that it is they who close an idle connection, never quotad under a request in flight.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(75);
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
pub const DEFAULT_LOCK: Duration = Duration::from_secs(3);
pub const DEFAULT_MAX_SKEW: Duration = Duration::from_secs(30);
/// Leases longer than this would outlive the keep time of global keys in Redis.
pub const MAX_LEASE: Duration = Duration::from_secs(600);
pub const MIN_SECRET_BYTES: usize = 16;
// Every Redis key of a global policy lives `GLOBAL_KEEP_MS` after its last touch: a lease
// must end well before, so a book never expires while it still counts.
const _: () = assert!(MAX_LEASE.as_millis() * 2 < GLOBAL_KEEP_MS as u128);
/// A sliding log stores one entry per admission (about 100 KB per key at limit 1,000, and a
/// cost-N check writes N entries inside one script): above this, the sliding_window counter
/// is the right tool.
pub const MAX_SLIDING_LOG_LIMIT: i64 = policy::MAX_SLIDING_LOG_LIMIT as i64;

impl Settings {
    /// `quotad serve` without `--config`: the embedded store on loopback, with one policy
    /// (`default`, token bucket, 100 per minute) so a first request works with zero setup.
    pub fn builtin() -> Settings {
        let policy = Policy::new(PolicySpec {
            name: "default",
            algorithm: Algorithm::TokenBucket,
            limit: 100,
            window: Duration::from_secs(60),
            burst: None,
            on_store_error: FailMode::Open,
            shadow: false,
            global: None,
        })
        .expect("the built-in policy is valid");
        Settings {
            region: "local".into(),
            server: ServerSettings::defaults(),
            store: StoreBackend::Memory,
            key_prefix: DEFAULT_KEY_PREFIX.into(),
            memory_max_keys: DEFAULT_MEMORY_MAX_KEYS as usize,
            policies: vec![policy],
            global: None,
        }
    }

    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Settings, ConfigErrors> {
        let file = path.display().to_string();
        let src = std::fs::read_to_string(path).map_err(|e| {
            ConfigErrors(vec![ConfigError {
                file: file.clone(),
                line: 0,
                field: "(file)".into(),
                message: format!("cannot read: {e}"),
            }])
        })?;
        Settings::parse(&file, &src)
    }

    /// Validates config text; `file` is only used in messages.
    pub fn parse(file: &str, src: &str) -> Result<Settings, ConfigErrors> {
        let mut v = Validator {
            file,
            src,
            errors: Vec::new(),
        };
        let raw: raw::Config = match toml::from_str(src) {
            Ok(raw) => raw,
            Err(e) => {
                let (line, field) = match e.span() {
                    Some(span) => {
                        let at = raw::locate(src, span.start);
                        (at.line, at.field_for(e.message()))
                    }
                    None => (0, "(file)".to_owned()),
                };
                v.errors.push(ConfigError {
                    file: file.to_owned(),
                    line,
                    field,
                    message: e
                        .message()
                        .trim()
                        .replace("expected i64", "expected an integer")
                        .replace("expected a boolean", "expected true or false"),
                });
                return Err(ConfigErrors(v.errors));
            }
        };
        let settings = v.settings(raw);
        if v.errors.is_empty() {
            Ok(settings)
        } else {
            v.errors.sort_by_key(|e| e.line);
            Err(ConfigErrors(v.errors))
        }
    }
}

struct Validator<'a> {
    file: &'a str,
    src: &'a str,
    errors: Vec<ConfigError>,
}

impl Validator<'_> {
    fn error_at(&mut self, offset: usize, field: &str, message: impl Into<String>) {
        let line = raw::locate(self.src, offset).line;
        self.errors.push(ConfigError {
            file: self.file.to_owned(),
            line,
            field: field.to_owned(),
            message: message.into(),
        });
    }

    fn error<T>(&mut self, value: &Spanned<T>, field: &str, message: impl Into<String>) {
        self.error_at(value.span().start, field, message);
    }

    fn duration(
        &mut self,
        value: Option<&Spanned<String>>,
        field: &str,
        default: Duration,
        min: Duration,
        max: Duration,
    ) -> Duration {
        let Some(value) = value else { return default };
        match humantime::parse_duration(value.get_ref()) {
            Ok(d) if (min..=max).contains(&d) => d,
            Ok(_) => {
                self.error(
                    value,
                    field,
                    format!(
                        "must be between {} and {}",
                        humantime::format_duration(min),
                        humantime::format_duration(max)
                    ),
                );
                default
            }
            Err(e) => {
                self.error(
                    value,
                    field,
                    format!("not a duration ({e}); use e.g. \"250ms\", \"15m\", \"1h\""),
                );
                default
            }
        }
    }

    fn integer(
        &mut self,
        value: Option<&Spanned<i64>>,
        field: &str,
        default: i64,
        min: i64,
        max: i64,
    ) -> i64 {
        let Some(value) = value else { return default };
        let n = *value.get_ref();
        if (min..=max).contains(&n) {
            n
        } else {
            self.error(
                value,
                field,
                format!("must be between {min} and {max}, got {n}"),
            );
            default
        }
    }

    fn settings(&mut self, raw: raw::Config) -> Settings {
        let region = match &raw.region {
            Some(r) if policy::valid_name(r.get_ref()) => r.get_ref().clone(),
            Some(r) => {
                self.error(r, "region", "must be 1-64 characters of A-Z a-z 0-9 _ - .");
                String::new()
            }
            None => "local".to_owned(),
        };
        let server = self.server(raw.server.unwrap_or_default());
        let raw_store = raw.store.unwrap_or_default();
        let memory_max_keys = self.integer(
            raw_store.memory_max_keys.as_ref(),
            "store.memory_max_keys",
            DEFAULT_MEMORY_MAX_KEYS,
            1_000,
            100_000_000,
        ) as usize;
        let (store, key_prefix) = self.store(raw_store);
        let coordinator = raw.coordinator.unwrap_or_default();
        let peers = self.peers(&region, &raw.peer, &coordinator);
        let mut regions: Vec<String> = peers.iter().map(|p| p.region.clone()).collect();
        regions.push(region.clone());
        regions.sort();
        let mut timing: Option<(Duration, Duration, usize)> = None;
        let mut policies = Vec::new();
        let mut names = BTreeSet::new();
        if raw.policy.is_empty() {
            self.errors.push(ConfigError {
                file: self.file.to_owned(),
                line: 1,
                field: "policy".into(),
                message: "no [[policy]] is defined; quotad needs at least one".into(),
            });
        }
        for (i, p) in raw.policy.iter().enumerate() {
            let global = p.global.as_ref().and_then(|g| {
                self.global_policy(i, p, g, &regions, !raw.peer.is_empty(), &mut timing)
            });
            if let Some(policy) = self.policy(i, p, global) {
                if !names.insert(policy.name.clone()) {
                    self.error(
                        &p.name,
                        &format!("policy[{i}].name"),
                        format!("duplicate policy name \"{}\"", policy.name),
                    );
                } else {
                    policies.push(policy);
                }
            }
        }
        let global = timing.map(|(lease, round, _)| {
            let mut settings = self.coordinator(&coordinator, lease, round);
            settings.me = RegionId(regions.iter().position(|r| *r == region).unwrap_or(0) as u16);
            // JSON escapes a control character in a key as six bytes (\u00XX).
            settings.max_exchange_bytes = settings.params.max_exchange_keys
                * (6 * server.max_key_bytes + EXCHANGE_BYTES_PER_KEY)
                + EXCHANGE_ENVELOPE_BYTES;
            settings.max_key_bytes = server.max_key_bytes;
            settings.regions = regions.clone();
            settings.peers = peers
                .into_iter()
                .map(|mut p| {
                    p.id =
                        RegionId(regions.iter().position(|r| *r == p.region).unwrap_or(0) as u16);
                    p
                })
                .collect();
            settings
        });
        Settings {
            region,
            server,
            store,
            key_prefix,
            memory_max_keys,
            policies,
            global,
        }
    }

    /// The `[[peer]]` entries: unique regions other than ours, http URLs, a secret each.
    fn peers(
        &mut self,
        region: &str,
        raw: &[raw::Peer],
        coordinator: &raw::Coordinator,
    ) -> Vec<PeerSettings> {
        let mut out: Vec<PeerSettings> = Vec::new();
        for (i, p) in raw.iter().enumerate() {
            let f = |name: &str| format!("peer[{i}].{name}");
            let name = p.region.get_ref();
            if !policy::valid_name(name) {
                self.error(
                    &p.region,
                    &f("region"),
                    "must be 1-64 characters of A-Z a-z 0-9 _ - .",
                );
                continue;
            }
            if name == region {
                self.error(
                    &p.region,
                    &f("region"),
                    format!("\"{name}\" is this daemon's own region"),
                );
                continue;
            }
            if out.iter().any(|o| o.region == *name) {
                self.error(
                    &p.region,
                    &f("region"),
                    format!("duplicate peer region \"{name}\""),
                );
                continue;
            }
            let mut urls = Vec::new();
            match (&p.url, &p.urls) {
                (Some(u), None) => urls.push((u.span().start, u.get_ref().clone())),
                (None, Some(list)) if !list.get_ref().is_empty() => urls.extend(
                    list.get_ref()
                        .iter()
                        .map(|u| (list.span().start, u.clone())),
                ),
                (Some(u), Some(_)) => {
                    self.error(u, &f("url"), "give url or urls, not both");
                }
                _ => self.error(
                    &p.region,
                    &f("url"),
                    "a peer needs url = \"http://HOST:PORT\" (or urls = [...])",
                ),
            }
            for (at, u) in &urls {
                let ok = u
                    .strip_prefix("http://")
                    .is_some_and(|rest| !rest.is_empty() && !rest.contains(char::is_whitespace));
                if !ok {
                    self.error_at(*at, &f("url"), format!("{u:?}: must be http://HOST:PORT (peers authenticate every exchange with HMAC; put TLS in front if the network is untrusted)"));
                }
            }
            let secret = match (&p.secret, &coordinator.secret) {
                (Some(s), _) | (None, Some(s)) => {
                    if s.get_ref().len() < MIN_SECRET_BYTES {
                        let field = if p.secret.is_some() {
                            f("secret")
                        } else {
                            "coordinator.secret".to_owned()
                        };
                        self.error(
                            s,
                            &field,
                            format!("must be at least {MIN_SECRET_BYTES} bytes"),
                        );
                    }
                    Secret(s.get_ref().as_bytes().to_vec())
                }
                (None, None) => {
                    self.error(&p.region, &f("secret"), "a peer needs a shared secret (here or in [coordinator] secret): exchanges move budget and are signed");
                    Secret(Vec::new())
                }
            };
            out.push(PeerSettings {
                region: name.clone(),
                id: RegionId(0),
                urls: urls
                    .into_iter()
                    .map(|(_, u)| u.trim_end_matches('/').to_owned())
                    .collect(),
                secret,
            });
        }
        out
    }

    /// `[policy.global]`: the escrow names exactly this region and its peers, the lease is
    /// longer than the round, and every global policy shares one lease and round.
    fn global_policy(
        &mut self,
        i: usize,
        p: &raw::Policy,
        g: &raw::Global,
        regions: &[String],
        has_peers: bool,
        timing: &mut Option<(Duration, Duration, usize)>,
    ) -> Option<GlobalSpec> {
        let f = |name: &str| format!("policy[{i}].global.{name}");
        let before = self.errors.len();
        match p.algorithm.get_ref().as_str() {
            "token_bucket" | "gcra" => {}
            "fixed_window" | "sliding_log" | "sliding_window" => self.error(
                &p.algorithm,
                &format!("policy[{i}].algorithm"),
                "a global policy must be token_bucket or gcra: budget moves between regions as rates (leases); window algorithms would need per-window loans, which quotad does not implement (see docs/global-budgets.md)",
            ),
            _ => {}
        }
        if let Some(mode) = &p.on_store_error {
            if mode.get_ref() == "local" {
                self.error(mode, &format!("policy[{i}].on_store_error"), "\"local\" cannot keep a global budget (the region's lease state is in Redis): use \"closed\" to keep the bound or \"open\"");
            }
        }
        if !has_peers {
            self.error(
                &g.escrow,
                &f("escrow"),
                "a global policy needs at least one [[peer]] region",
            );
        }
        let names = g.escrow.get_ref();
        for (name, w) in names {
            if !regions.contains(name) {
                self.error(
                    w,
                    &f("escrow"),
                    format!("\"{name}\" is neither this region nor a [[peer]]"),
                );
            } else if !(w.get_ref().is_finite() && *w.get_ref() >= 0.0) {
                self.error(
                    w,
                    &f("escrow"),
                    format!("weight of \"{name}\" must be a number >= 0"),
                );
            }
        }
        for r in regions {
            if has_peers && !names.contains_key(r) {
                self.error(
                    &g.escrow,
                    &f("escrow"),
                    format!("no weight for region \"{r}\" (every region needs one, 0 allowed)"),
                );
            }
        }
        let weights: Vec<f64> = regions
            .iter()
            .map(|r| names.get(r).map_or(0.0, |w| *w.get_ref()))
            .collect();
        if has_peers && self.errors.len() == before && weights.iter().sum::<f64>() <= 0.0 {
            self.error(&g.escrow, &f("escrow"), "the weights must not all be 0");
        }
        let round = self.duration(
            g.round.as_ref(),
            &f("round"),
            Duration::from_secs(1),
            Duration::from_millis(100),
            Duration::from_secs(60),
        );
        let lease = self.duration(
            g.lease.as_ref(),
            &f("lease"),
            Duration::from_secs(10),
            Duration::from_millis(200),
            MAX_LEASE,
        );
        if lease <= round {
            let at = g
                .lease
                .as_ref()
                .map_or(g.escrow.span().start, |l| l.span().start);
            self.error_at(
                at,
                &f("lease"),
                format!(
                    "must be longer than round ({})",
                    humantime::format_duration(round)
                ),
            );
        }
        match timing {
            Some((l, r, first)) if (*l, *r) != (lease, round) => {
                let at = g
                    .lease
                    .as_ref()
                    .or(g.round.as_ref())
                    .map_or(g.escrow.span().start, |x| x.span().start);
                let msg = format!(
                    "every global policy must use the same lease and round (one coordinator per daemon); policy[{first}] uses lease {} and round {}",
                    humantime::format_duration(*l),
                    humantime::format_duration(*r)
                );
                self.error_at(at, &f("lease"), msg);
            }
            Some(_) => {}
            None => *timing = Some((lease, round, i)),
        }
        let mode = match g.allocation.as_ref() {
            None => Mode::Proportional,
            Some(a) => match Mode::ALL.into_iter().find(|m| m.name() == a.get_ref()) {
                Some(m) => m,
                None => {
                    self.error(a, &f("allocation"), format!("unknown allocation \"{}\"; expected proportional, maxmin or owner_first", a.get_ref()));
                    Mode::Proportional
                }
            },
        };
        let version = self.integer(g.version.as_ref(), &f("version"), 1, 1, i64::MAX) as u64;
        (self.errors.len() == before).then_some(GlobalSpec {
            version,
            weights,
            mode,
        })
    }

    /// `[coordinator]`: protocol timings shared by every region (the safety argument
    /// compares them), the lock period, the replay window.
    fn coordinator(
        &mut self,
        c: &raw::Coordinator,
        lease: Duration,
        round: Duration,
    ) -> GlobalSettings {
        let defaults = Params::default();
        let margin = self.duration(
            c.margin.as_ref(),
            "coordinator.margin",
            Duration::from_micros(defaults.margin_us as u64),
            Duration::from_millis(1),
            Duration::from_secs(10),
        );
        let epsilon = match &c.epsilon {
            None => defaults.epsilon,
            Some(e) if (0.0..0.1).contains(e.get_ref()) => *e.get_ref(),
            Some(e) => {
                self.error(
                    e,
                    "coordinator.epsilon",
                    "must be in [0, 0.1): the bound on any clock's rate error",
                );
                defaults.epsilon
            }
        };
        let lock = self.duration(
            c.lock.as_ref(),
            "coordinator.lock",
            DEFAULT_LOCK,
            Duration::from_millis(300),
            Duration::from_secs(300),
        );
        let max_skew = self.duration(
            c.max_skew.as_ref(),
            "coordinator.max_skew",
            DEFAULT_MAX_SKEW,
            Duration::from_secs(1),
            Duration::from_secs(3600),
        );
        let max_exchange_keys = self.integer(
            c.max_exchange_keys.as_ref(),
            "coordinator.max_exchange_keys",
            defaults.max_exchange_keys as i64,
            100,
            1_000_000,
        ) as usize;
        let params = Params {
            round_us: round.as_micros() as i64,
            lease_us: lease.as_micros() as i64,
            epsilon,
            margin_us: margin.as_micros() as i64,
            max_exchange_keys,
            ..defaults
        };
        GlobalSettings {
            regions: Vec::new(),
            me: RegionId(0),
            peers: Vec::new(),
            params,
            lock,
            max_skew,
            max_exchange_bytes: 0,
            max_key_bytes: 0,
        }
    }

    fn server(&mut self, s: raw::Server) -> ServerSettings {
        let listen = match &s.listen {
            None => DEFAULT_LISTEN.parse().expect("valid default address"),
            Some(l) => match l.get_ref().parse::<SocketAddr>() {
                Ok(a) => a,
                Err(_) => {
                    self.error(
                        l,
                        "server.listen",
                        "must be an IP address and port, e.g. \"127.0.0.1:8686\"",
                    );
                    DEFAULT_LISTEN.parse().expect("valid default address")
                }
            },
        };
        let drain_timeout = self.duration(
            s.drain_timeout.as_ref(),
            "server.drain_timeout",
            DEFAULT_DRAIN_TIMEOUT,
            Duration::from_millis(1),
            Duration::from_secs(600),
        );
        let timeout = |v: &mut Self, value: Option<&Spanned<String>>, field: &str, default| {
            v.duration(
                value,
                field,
                default,
                Duration::from_millis(10),
                Duration::from_secs(3600),
            )
        };
        let settings = ServerSettings {
            listen,
            drain_timeout,
            shutdown_delay: self.duration(
                s.shutdown_delay.as_ref(),
                "server.shutdown_delay",
                default_shutdown_delay(drain_timeout),
                Duration::ZERO,
                Duration::from_secs(600),
            ),
            max_body_bytes: self.integer(
                s.max_body_bytes.as_ref(),
                "server.max_body_bytes",
                DEFAULT_MAX_BODY_BYTES,
                256,
                16 << 20,
            ) as usize,
            max_batch: self.integer(
                s.max_batch.as_ref(),
                "server.max_batch",
                DEFAULT_MAX_BATCH,
                1,
                1024,
            ) as usize,
            max_key_bytes: self.integer(
                s.max_key_bytes.as_ref(),
                "server.max_key_bytes",
                DEFAULT_MAX_KEY_BYTES,
                1,
                8192,
            ) as usize,
            max_connections: s.max_connections.as_ref().map(|m| {
                self.integer(Some(m), "server.max_connections", 10_000, 1, 1_000_000) as usize
            }),
            max_header_bytes: self.integer(
                s.max_header_bytes.as_ref(),
                "server.max_header_bytes",
                DEFAULT_MAX_HEADER_BYTES,
                1024,
                1 << 20,
            ) as usize,
            header_timeout: timeout(
                self,
                s.header_timeout.as_ref(),
                "server.header_timeout",
                DEFAULT_HEADER_TIMEOUT,
            ),
            body_timeout: timeout(
                self,
                s.body_timeout.as_ref(),
                "server.body_timeout",
                DEFAULT_BODY_TIMEOUT,
            ),
            idle_timeout: timeout(
                self,
                s.idle_timeout.as_ref(),
                "server.idle_timeout",
                DEFAULT_IDLE_TIMEOUT,
            ),
            ready_requires_store: s.ready_requires_store.unwrap_or(false),
            max_body_memory: self.integer(
                s.max_body_memory.as_ref(),
                "server.max_body_memory",
                DEFAULT_MAX_BODY_MEMORY,
                64 * 1024,
                1 << 34,
            ) as usize,
        };
        // The drain deadline counts from the signal: a delay as long leaves no time to drain.
        if let Some(d) = &s.shutdown_delay {
            if settings.shutdown_delay >= settings.drain_timeout {
                self.error(
                    d,
                    "server.shutdown_delay",
                    format!(
                        "must be shorter than server.drain_timeout ({}), which counts from the signal",
                        humantime::format_duration(settings.drain_timeout)
                    ),
                );
            }
        }
        settings
    }

    fn store(&mut self, s: raw::Store) -> (StoreBackend, String) {
        let key_prefix = match &s.key_prefix {
            None => DEFAULT_KEY_PREFIX.to_owned(),
            Some(p) if policy::valid_prefix(p.get_ref()) => p.get_ref().clone(),
            Some(p) => {
                self.error(
                    p,
                    "store.key_prefix",
                    "must be 1-64 characters of A-Z a-z 0-9 _ - .",
                );
                DEFAULT_KEY_PREFIX.to_owned()
            }
        };
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
        let admission = AdmissionSettings {
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
        };
        let backend = match &s.redis {
            None => StoreBackend::Memory,
            Some(url) if url.get_ref() == "memory" => StoreBackend::Memory,
            Some(url) => {
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
                StoreBackend::Redis(RedisSettings {
                    url: u.clone(),
                    timeout,
                    connect_timeout,
                    breaker_threshold,
                    probe_interval,
                    admission,
                    deny_cache_keys: self.integer(
                        s.deny_cache_keys.as_ref(),
                        "store.deny_cache_keys",
                        DEFAULT_DENY_CACHE_KEYS,
                        0,
                        10_000_000,
                    ) as usize,
                })
            }
        };
        (backend, key_prefix)
    }

    fn policy(&mut self, i: usize, p: &raw::Policy, global: Option<GlobalSpec>) -> Option<Policy> {
        let f = |name: &str| format!("policy[{i}].{name}");
        let errors_before = self.errors.len();
        let name = p.name.get_ref();
        if !policy::valid_name(name) {
            self.error(
                &p.name,
                &f("name"),
                "must be 1-64 characters of A-Z a-z 0-9 _ - .",
            );
        }
        let algorithm = match p.algorithm.get_ref().as_str() {
            "fixed_window" => Some(Algorithm::FixedWindow),
            "sliding_log" => Some(Algorithm::SlidingLog),
            "sliding_window" => Some(Algorithm::SlidingWindow),
            "token_bucket" => Some(Algorithm::TokenBucket),
            "gcra" => Some(Algorithm::Gcra),
            other => {
                self.error(
                    &p.algorithm,
                    &f("algorithm"),
                    format!("unknown algorithm \"{other}\"; expected one of fixed_window, sliding_log, sliding_window, token_bucket, gcra"),
                );
                None
            }
        };
        let limit = self.integer(Some(&p.limit), &f("limit"), 1, 1, policy::MAX_LIMIT as i64);
        if algorithm == Some(Algorithm::SlidingLog) && limit > MAX_SLIDING_LOG_LIMIT {
            self.error(
                &p.limit,
                &f("limit"),
                format!("sliding_log keeps one entry per admission; limits above {MAX_SLIDING_LOG_LIMIT} cost a megabyte per key and stall Redis on large costs: use sliding_window"),
            );
        }
        let window = self.duration(
            Some(&p.window),
            &f("window"),
            Duration::from_secs(1),
            policy::MIN_WINDOW,
            policy::MAX_WINDOW,
        );
        let burst = match (&p.burst, algorithm) {
            (Some(b), Some(a)) if !a.has_burst() => {
                self.error(
                    b,
                    &f("burst"),
                    format!(
                        "burst applies only to token_bucket and gcra, not {}",
                        a.name()
                    ),
                );
                None
            }
            (Some(b), _) => {
                let n = self.integer(Some(b), &f("burst"), 1, 1, policy::MAX_LIMIT as i64);
                Some(n as u64)
            }
            (None, _) => None,
        };
        let on_store_error = match p.on_store_error.as_ref().map(|s| (s, s.get_ref().as_str())) {
            None => FailMode::Open,
            Some((_, "open")) => FailMode::Open,
            Some((_, "closed")) => FailMode::Closed,
            Some((_, "local")) => FailMode::Local,
            Some((s, other)) => {
                self.error(
                    s,
                    &f("on_store_error"),
                    format!("unknown mode \"{other}\"; expected open, closed or local"),
                );
                FailMode::Open
            }
        };
        if self.errors.len() == errors_before {
            if let Some(a) = algorithm {
                if let Err(why) =
                    policy::check_rates(a, limit as u64, window, burst.unwrap_or(limit as u64))
                {
                    self.error(&p.limit, &f("limit"), why);
                }
            }
        }
        if self.errors.len() > errors_before {
            return None;
        }
        let policy = Policy::new(PolicySpec {
            name,
            algorithm: algorithm?,
            limit: limit as u64,
            window,
            burst,
            on_store_error,
            shadow: p.shadow.unwrap_or(false),
            global,
        });
        if policy.is_none() {
            self.error(&p.name, &f("name"), "policy is invalid");
        }
        policy
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_is_memory_with_a_default_policy() {
        let s = Settings::builtin();
        assert!(matches!(s.store, StoreBackend::Memory));
        assert_eq!(s.policies[0].name, "default");
    }

    #[test]
    fn collects_every_semantic_error_with_lines() {
        let src = "region = \"us-east\"\n[[policy]]\nname = \"a\"\nalgorithm = \"nope\"\nlimit = 0\nwindow = \"1x\"\n";
        let e = Settings::parse("t.toml", src).unwrap_err();
        let lines: Vec<String> = e.0.iter().map(|e| e.to_string()).collect();
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert!(
            lines[0].starts_with("t.toml:4: policy[0].algorithm: unknown algorithm \"nope\""),
            "{lines:?}"
        );
        assert!(
            lines[1].starts_with("t.toml:5: policy[0].limit: must be between 1 and"),
            "{lines:?}"
        );
        assert!(
            lines[2].starts_with("t.toml:6: policy[0].window: not a duration"),
            "{lines:?}"
        );
    }

    #[test]
    fn global_policies_number_regions_by_name() {
        let s = Settings::load(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config/examples/global.toml"),
        )
        .unwrap();
        let g = s.global.expect("a global policy");
        assert_eq!(g.regions, ["ap-south", "eu-west", "us-east"]);
        assert_eq!(g.me, RegionId(1));
        let ids: Vec<(&str, RegionId)> =
            g.peers.iter().map(|p| (p.region.as_str(), p.id)).collect();
        assert_eq!(ids, [("us-east", RegionId(2)), ("ap-south", RegionId(0))]);
        assert_eq!(g.peers[1].urls.len(), 2);
        assert_eq!(
            (g.params.lease_us, g.params.round_us),
            (10_000_000, 1_000_000)
        );
        let p = s.policies[0].global_policy().unwrap();
        let rho = 10_000.0 / 60.0;
        assert_eq!(p.rho, rho);
        assert_eq!(p.burst, 2000.0);
        for (got, w) in p.escrow.iter().zip([1.0, 3.0, 6.0]) {
            assert!((got - rho * w / 10.0).abs() < 1e-9, "{:?}", p.escrow);
        }
        assert_eq!(s.key_prefix, "rl");
        assert!(format!("{:?}", g.peers[0].secret).contains("***"));
    }

    #[test]
    fn parse_errors_name_the_line_and_field() {
        let src = "[[policy]]\nname = \"a\"\nalgorithm = \"gcra\"\nlimit = 1\nwindow = \"1s\"\ncolour = 3\n";
        let e = Settings::parse("t.toml", src).unwrap_err();
        let s = e.to_string();
        assert!(
            s.starts_with("t.toml:6: policy[0].colour: unknown field `colour`"),
            "{s}"
        );
    }
}
