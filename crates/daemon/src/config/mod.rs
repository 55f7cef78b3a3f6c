//! Configuration: the TOML file, its validation, and the settings and policies it yields.
//!
//! Parsing and validation are separate passes. serde (with `deny_unknown_fields`) rejects
//! unknown keys and wrong types; every value that needs a semantic check is read as
//! `Spanned<T>`, so validation can name the line of each bad field. Validation collects
//! every error it finds, so `quotad validate` lists them all at once. Nothing here performs
//! I/O beyond reading the file: building stores and listeners is the app's job.
//!
//! This module holds what every table shares (the errors, [`Settings`], the validator and
//! its typed checks); each table's settings, defaults and checks live in a submodule:
//! `server` (`[server]`), `store` (`[store]`), `coordinator` (`[coordinator]`, `[[peer]]`)
//! and `policy` (`[[policy]]`, `[policy.global]`).

mod admin;
mod concurrency;
mod coordinator;
mod descriptor;
mod forward_auth;
mod log;
mod policy;
mod raw;
mod secret;
mod server;
mod store;

use std::fmt;
use std::path::Path;
use std::time::Duration;

use toml::Spanned;

use crate::policy::{ConcurrencyPolicy, FailMode, Policy, PolicySpec};
use crate::server::Endpoint;
use quotad_core::algorithm::Algorithm;

pub(crate) use admin::{AdminSettings, Caller};
pub(crate) use coordinator::{Encoding, GlobalSettings, Secret};
pub(crate) use descriptor::Descriptors;
pub(crate) use forward_auth::{ForwardAuth, ForwardAuths, KeySource, MissingKey};
pub use log::LogFormat;
pub(crate) use log::{LogSettings, sample_every};
pub(crate) use policy::Overrides;
pub(crate) use server::ServerSettings;
pub use store::StoreBackend;
pub(crate) use store::{DEFAULT_KEY_PREFIX, DEFAULT_MEMORY_MAX_KEYS};

/// The rule for names and prefixes (region, peer, policy, key prefix), as errors state it.
const NAME_RULE: &str = "must be 1-64 characters of A-Z a-z 0-9 _ - .";

/// One problem in a config file: `file:line: field: message`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub(crate) file: String,
    pub(crate) line: usize,
    pub(crate) field: String,
    pub(crate) message: String,
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

/// Everything the daemon needs, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub(crate) region: String,
    pub(crate) server: ServerSettings,
    pub(crate) store: StoreBackend,
    pub(crate) key_prefix: String,
    /// Keys the embedded store (the primary in memory mode, and the `local` fallback)
    /// holds at most.
    pub(crate) memory_max_keys: usize,
    pub(crate) policies: Vec<Policy>,
    /// `[[policy]]` with `algorithm = "concurrency"`: concurrency limits.
    pub concurrency: Vec<ConcurrencyPolicy>,
    /// Present when at least one policy is global.
    pub(crate) global: Option<GlobalSettings>,
    /// `[policy.forward_auth]` of the policies that have one, by policy name.
    pub(crate) forward_auth: ForwardAuths,
    /// `[[policy.override]]`: per-key limits, by policy name.
    pub(crate) overrides: Overrides,
    /// `policy.version` of each local policy (1 when not set): raised by the operator to
    /// let a reload change what the stored state of the policy's keys means (its
    /// algorithm, a window). Global policies have `policy.global.version` instead.
    pub(crate) versions: std::collections::BTreeMap<String, u64>,
    /// The file these settings were loaded from (hot reload watches it).
    pub(crate) source: Option<std::path::PathBuf>,
    /// The files secrets were read from (`store.password_file`, `secret_file`): hot
    /// reload watches them too, and reads them again with the config.
    pub(crate) secret_files: Vec<std::path::PathBuf>,
    /// `[[descriptor]]`: Envoy descriptors by domain (the gRPC rate-limit service).
    pub(crate) descriptors: Descriptors,
    /// `[log]`: the log's format and the request log's sample.
    pub(crate) log: LogSettings,
    /// `[admin]`: the tokens the admin endpoints accept.
    pub(crate) admin: AdminSettings,
}

impl Settings {
    /// Where the HTTP API listens (`server.listen`).
    pub fn listen(&self) -> &Endpoint {
        &self.server.listen
    }

    /// Where the Envoy rate-limit service listens, when it does (`server.grpc_listen`).
    pub fn grpc_listen(&self) -> Option<&Endpoint> {
        self.server.grpc_listen.as_ref()
    }

    /// The longest a stop takes from the signal to the exit: the wait while load
    /// balancers notice (`server.shutdown_delay`), then the drain (`server.drain_timeout`).
    pub fn longest_stop(&self) -> Duration {
        self.server.shutdown_delay + self.server.drain_timeout
    }

    /// Stops without the wait for load balancers (`server.shutdown_delay = 0`): for a
    /// daemon no balancer sends to (in-process tests, demos).
    pub fn without_shutdown_delay(mut self) -> Settings {
        self.server.shutdown_delay = Duration::ZERO;
        self
    }

    /// The log's format (`log.format`).
    pub fn log_format(&self) -> LogFormat {
        self.log.format
    }

    /// The policies and concurrency limits the file defines.
    pub fn policy_count(&self) -> usize {
        self.policies.len() + self.concurrency.len()
    }

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
            concurrency: Vec::new(),
            global: None,
            forward_auth: ForwardAuths::new(),
            overrides: Overrides::new(),
            versions: Default::default(),
            source: None,
            secret_files: Vec::new(),
            descriptors: Descriptors::default(),
            log: LogSettings::default(),
            // No token: the admin endpoints refuse every request.
            admin: AdminSettings::default(),
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
        let mut settings = Settings::parse(&file, &src)?;
        settings.source = Some(path.to_owned());
        Ok(settings)
    }

    /// Validates config text; `file` is only used in messages.
    pub fn parse(file: &str, src: &str) -> Result<Settings, ConfigErrors> {
        let mut v = Validator {
            file,
            src,
            errors: Vec::new(),
            secret_files: Vec::new(),
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
        let mut settings = v.settings(raw);
        settings.secret_files = std::mem::take(&mut v.secret_files);
        if v.errors.is_empty() {
            Ok(settings)
        } else {
            v.errors.sort_by_key(|e| e.line);
            Err(ConfigErrors(v.errors))
        }
    }
}

/// Checks the parsed file table by table and collects every error it finds. `parse` sorts
/// them by line (a stable sort: errors on one line keep the order they were found in).
struct Validator<'a> {
    file: &'a str,
    src: &'a str,
    errors: Vec<ConfigError>,
    /// The `*_file` secrets read (`Settings::secret_files`).
    secret_files: Vec<std::path::PathBuf>,
}

impl Validator<'_> {
    /// Records an error at byte `offset` of the file (for values that are not `Spanned`).
    fn error_at(&mut self, offset: usize, field: &str, message: impl ToString) {
        let line = raw::locate(self.src, offset).line;
        self.errors.push(ConfigError {
            file: self.file.to_owned(),
            line,
            field: field.to_owned(),
            message: message.to_string(),
        });
    }

    /// Records an error on the line of `value`.
    fn error<T>(&mut self, value: &Spanned<T>, field: &str, message: impl ToString) {
        self.error_at(value.span().start, field, message);
    }

    /// An optional duration within `[min, max]`: `default` when absent or wrong.
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

    /// An optional integer within `[min, max]`: `default` when absent or wrong.
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

    /// `policy.version` of policy `i`: at least 1; a global policy's is in `[policy.global]`.
    fn version(&mut self, i: usize, p: &raw::Policy) -> u64 {
        let field = format!("policy[{i}].version");
        if let (Some(v), Some(_)) = (&p.version, &p.global) {
            let why = "a global policy's version is policy.global.version";
            self.error(v, &field, why);
        }
        self.integer(p.version.as_ref(), &field, 1, 1, i64::MAX) as u64
    }

    /// The whole file, table by table; peers come before policies because a global policy's
    /// escrow must name exactly the regions they define.
    fn settings(&mut self, raw: raw::Config) -> Settings {
        let region = match &raw.region {
            Some(r) if crate::policy::valid_name(r.get_ref()) => r.get_ref().clone(),
            Some(r) => {
                self.error(r, "region", NAME_RULE);
                String::new()
            }
            None => "local".to_owned(),
        };
        let server = self.server(raw.server.unwrap_or_default());
        let log = self.log(&raw.log.unwrap_or_default());
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
        let admin = self.admin(&raw.admin.unwrap_or_default(), &server.listen, &peers);
        let regions = coordinator::regions(&region, &peers);
        let policy::Compiled {
            policies,
            concurrency,
            timing,
            overrides,
        } = self.policies(&raw.policy, &regions, !raw.peer.is_empty());
        if matches!(store, StoreBackend::Memory) {
            // The regions spread a global policy's runtime limits through Redis.
            for (i, p) in raw.policy.iter().enumerate() {
                if let (Some(_), Some(r)) = (&p.global, &p.runtime_limits) {
                    self.error(
                        &r.max_keys,
                        &format!("policy[{i}].runtime_limits.max_keys"),
                        "runtime limits of a global policy need the Redis store: the regions spread them through it (docs/global-budgets.md)",
                    );
                }
            }
        }
        let forward_auth = self.forward_auths(&raw.policy, &policies, &overrides);
        let versions = raw
            .policy
            .iter()
            .enumerate()
            .map(|(i, p)| (p.name.get_ref().clone(), self.version(i, p)))
            .collect();
        let names: Vec<&str> = raw
            .policy
            .iter()
            .map(|p| p.name.get_ref().as_str())
            .collect();
        // The policies a response-path descriptor may charge: those that take settlements.
        let settling: Vec<&str> = policies
            .iter()
            .filter(|p| p.settle_within.is_some())
            .map(|p| p.name.as_str())
            .collect();
        let limits: Vec<&str> = concurrency.iter().map(|c| c.name.as_str()).collect();
        let descriptors = self.descriptors(&raw.descriptor, &names, &settling, &limits);
        let global = timing.map(|timing| {
            self.global(
                &coordinator,
                timing,
                &region,
                regions,
                peers,
                server.max_key_bytes,
            )
        });
        Settings {
            region,
            server,
            store,
            key_prefix,
            memory_max_keys,
            policies,
            concurrency,
            global,
            forward_auth,
            overrides,
            versions,
            source: None,
            secret_files: Vec::new(),
            descriptors,
            log,
            admin,
        }
    }

    /// Every policy's `[policy.forward_auth]`. The smallest capacity of the policy and its
    /// overrides bounds the cost of a forward-auth check: a larger one could never pass
    /// for some keys.
    fn forward_auths(
        &mut self,
        raw: &[raw::Policy],
        policies: &[Policy],
        overrides: &Overrides,
    ) -> ForwardAuths {
        raw.iter()
            .enumerate()
            .filter(|(_, p)| !policy::is_concurrency(p))
            .filter_map(|(i, p)| {
                let name = p.name.get_ref();
                let overridden = overrides.get(name).into_iter().flatten();
                let capacity = policies
                    .iter()
                    .find(|c| c.name == *name)
                    .map(Policy::capacity)
                    .map(|c| overridden.map(|o| o.policy.capacity()).fold(c, u64::min));
                let f = self.forward_auth(i, p.forward_auth.as_ref()?, capacity)?;
                Some((p.name.get_ref().clone(), f))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use quotad_core::coordinator::RegionId;

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
