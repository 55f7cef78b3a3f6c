//! The config file's shape as serde reads it, and locating an error offset as line + field.
//!
//! Every value that validation checks is `Spanned`, so its error can name its line. Numbers
//! are read as i64 so that a negative limit is a validation error with a clear message
//! rather than a serde type error.

use serde::Deserialize;
use toml::Spanned;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Config {
    pub(super) region: Option<Spanned<String>>,
    pub(super) server: Option<Server>,
    pub(super) store: Option<Store>,
    pub(super) coordinator: Option<Coordinator>,
    #[serde(default)]
    pub(super) peer: Vec<Peer>,
    #[serde(default)]
    pub(super) policy: Vec<Policy>,
    /// `[[descriptor]]`: Envoy rate-limit descriptors mapped to policies (gRPC).
    #[serde(default)]
    pub(super) descriptor: Vec<Descriptor>,
    pub(super) log: Option<Log>,
    /// `[admin]`: who may change limits.
    pub(super) admin: Option<Admin>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Admin {
    #[serde(default)]
    pub(super) token: Vec<AdminToken>,
    pub(super) allow_without_token: Option<Spanned<bool>>,
}

/// `[[admin.token]]`: a named bearer token, from one of three places (`config::secret`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct AdminToken {
    pub(super) name: Spanned<String>,
    pub(super) token: Option<Spanned<String>>,
    pub(super) token_file: Option<Spanned<String>>,
    pub(super) token_env: Option<Spanned<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Log {
    pub(super) format: Option<Spanned<String>>,
    pub(super) requests: Option<Spanned<f64>>,
}

/// `[[descriptor]]` and its nested `[[descriptor.descriptor]]`: one level of an Envoy
/// descriptor tree (envoyproxy/ratelimit's `descriptors:`). `domain` on the top level only.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Descriptor {
    pub(super) domain: Option<Spanned<String>>,
    pub(super) key: Spanned<String>,
    pub(super) value: Option<Spanned<String>>,
    pub(super) policy: Option<Spanned<String>>,
    /// A descriptor counted on Envoy's response path: charged, never denied.
    pub(super) charge: Option<Spanned<bool>>,
    #[serde(default)]
    pub(super) descriptor: Vec<Descriptor>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Coordinator {
    pub(super) secret: Option<Spanned<String>>,
    pub(super) secret_file: Option<Spanned<String>>,
    pub(super) secret_env: Option<Spanned<String>>,
    pub(super) lock: Option<Spanned<String>>,
    pub(super) margin: Option<Spanned<String>>,
    pub(super) epsilon: Option<Spanned<f64>>,
    pub(super) max_skew: Option<Spanned<String>>,
    pub(super) max_exchange_keys: Option<Spanned<i64>>,
    pub(super) exchange_encoding: Option<Spanned<String>>,
    pub(super) sense: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Peer {
    pub(super) region: Spanned<String>,
    pub(super) url: Option<Spanned<String>>,
    pub(super) urls: Option<Spanned<Vec<String>>>,
    pub(super) secret: Option<Spanned<String>>,
    pub(super) secret_file: Option<Spanned<String>>,
    pub(super) secret_env: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Global {
    pub(super) escrow: Spanned<std::collections::BTreeMap<String, Spanned<f64>>>,
    pub(super) lease: Option<Spanned<String>>,
    pub(super) round: Option<Spanned<String>>,
    pub(super) allocation: Option<Spanned<String>>,
    pub(super) version: Option<Spanned<i64>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Server {
    pub(super) listen: Option<Spanned<String>>,
    pub(super) grpc_listen: Option<Spanned<String>>,
    pub(super) grpc_max_connections: Option<Spanned<i64>>,
    pub(super) drain_timeout: Option<Spanned<String>>,
    pub(super) shutdown_delay: Option<Spanned<String>>,
    pub(super) max_body_bytes: Option<Spanned<i64>>,
    pub(super) max_batch: Option<Spanned<i64>>,
    pub(super) max_key_bytes: Option<Spanned<i64>>,
    pub(super) max_connections: Option<Spanned<i64>>,
    pub(super) max_header_bytes: Option<Spanned<i64>>,
    pub(super) header_timeout: Option<Spanned<String>>,
    pub(super) body_timeout: Option<Spanned<String>>,
    pub(super) idle_timeout: Option<Spanned<String>>,
    pub(super) ready_requires_store: Option<bool>,
    pub(super) max_body_memory: Option<Spanned<i64>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Store {
    pub(super) redis: Option<Spanned<String>>,
    pub(super) redis_cluster: Option<Spanned<Vec<Spanned<String>>>>,
    pub(super) redis_sentinels: Option<Spanned<Vec<Spanned<String>>>>,
    pub(super) redis_sentinel_master: Option<Spanned<String>>,
    pub(super) tls_ca_file: Option<Spanned<String>>,
    pub(super) tls_cert_file: Option<Spanned<String>>,
    pub(super) tls_key_file: Option<Spanned<String>>,
    pub(super) username: Option<Spanned<String>>,
    pub(super) password: Option<Spanned<String>>,
    pub(super) password_file: Option<Spanned<String>>,
    pub(super) password_env: Option<Spanned<String>>,
    pub(super) timeout: Option<Spanned<String>>,
    pub(super) connect_timeout: Option<Spanned<String>>,
    pub(super) key_prefix: Option<Spanned<String>>,
    pub(super) breaker_threshold: Option<Spanned<i64>>,
    pub(super) probe_interval: Option<Spanned<String>>,
    pub(super) max_in_flight: Option<Spanned<i64>>,
    pub(super) max_queued: Option<Spanned<i64>>,
    pub(super) queue_timeout: Option<Spanned<String>>,
    pub(super) deny_cache_keys: Option<Spanned<i64>>,
    pub(super) memory_max_keys: Option<Spanned<i64>>,
    pub(super) janitor_interval: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Policy {
    pub name: Spanned<String>,
    pub algorithm: Spanned<String>,
    pub(super) limit: Spanned<i64>,
    pub(super) window: Spanned<String>,
    /// The IANA time zone of a calendar period's `window` ("day", "week", "month", "year").
    pub(super) time_zone: Option<Spanned<String>>,
    pub burst: Option<Spanned<i64>>,
    pub(super) on_store_error: Option<Spanned<String>>,
    pub(super) shadow: Option<Spanned<bool>>,
    /// Checks per second of one key on one instance from which it takes slices
    /// (`store::redis::hot`); absent: never.
    pub(super) hot_key_rate: Option<Spanned<i64>>,
    /// How long a reservation of this policy may wait for its settlement (`POST
    /// /v1/settle`); absent: checks cannot reserve.
    pub(super) settle_within: Option<Spanned<String>>,
    /// A local policy's state version (see `reload::state_refusal`).
    pub(super) version: Option<Spanned<i64>>,
    pub global: Option<Global>,
    pub(super) forward_auth: Option<ForwardAuth>,
    #[serde(rename = "override", default)]
    pub(super) overrides: Vec<Override>,
    /// `[policy.runtime_limits]`: keys may have their own limit, set at runtime.
    pub(super) runtime_limits: Option<RuntimeLimits>,
}

/// `[policy.runtime_limits]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RuntimeLimits {
    pub(super) max_keys: Spanned<i64>,
    pub(super) max_limit: Option<Spanned<i64>>,
}

/// `[[policy.override]]`: one of `key`, `prefix`, `glob`, and the limits.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Override {
    pub(super) key: Option<Spanned<String>>,
    pub(super) prefix: Option<Spanned<String>>,
    pub(super) glob: Option<Spanned<String>>,
    pub(super) limit: Spanned<i64>,
    pub(super) window: Option<Spanned<String>>,
    pub(super) burst: Option<Spanned<i64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ForwardAuth {
    pub(super) key: Spanned<Vec<Spanned<String>>>,
    pub(super) trusted_hops: Option<Spanned<i64>>,
    pub(super) denied_status: Option<Spanned<i64>>,
    pub(super) on_missing_key: Option<Spanned<String>>,
    /// The cost of each check (0: a peek).
    pub(super) cost: Option<Spanned<i64>>,
}

/// Where an offset falls in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Location {
    /// 1-based line.
    pub(super) line: usize,
    /// The enclosing table as a path, e.g. `policy[1]` (`[[policy]]` headers are counted);
    /// empty at top level.
    pub(super) table: String,
    /// The key on that line (text before `=`), if any.
    pub(super) key: Option<String>,
}

impl Location {
    /// `table.key`, `key` or `table`.
    pub(super) fn field(&self) -> String {
        self.join(self.key.as_deref())
    }

    /// For serde's "missing field `x`" / "unknown field `x`" messages, whose span may cover
    /// a whole table or another key: the field the message names, inside this table.
    pub(super) fn field_for(&self, message: &str) -> String {
        let named = message
            .strip_prefix("missing field `")
            .or_else(|| message.strip_prefix("unknown field `"))
            .and_then(|rest| rest.split('`').next());
        match named {
            Some(name) => self.join(Some(name)),
            None => self.field(),
        }
    }

    fn join(&self, key: Option<&str>) -> String {
        match (self.table.is_empty(), key) {
            (true, Some(k)) => k.to_owned(),
            (false, Some(k)) => format!("{}.{k}", self.table),
            (true, None) => "(top level)".to_owned(),
            (false, None) => self.table.clone(),
        }
    }
}

/// Finds the line, table and key of byte `offset` in `src`.
pub(super) fn locate(src: &str, offset: usize) -> Location {
    let mut offset = offset.min(src.len());
    while !src.is_char_boundary(offset) {
        offset -= 1;
    }
    let line = src[..offset].matches('\n').count() + 1;
    let mut table = String::new();
    let mut counts: Vec<(String, usize)> = Vec::new();
    let mut key = None;
    for (i, text) in src.lines().take(line).enumerate() {
        let t = text.trim();
        if t.starts_with('[') && !header_ok(t) {
            table = "(syntax)".to_owned();
        } else if let Some(name) = t.strip_prefix("[[").and_then(|r| r.split("]]").next()) {
            let name = name.trim().to_owned();
            let n = match counts.iter_mut().find(|(k, _)| *k == name) {
                Some((_, n)) => {
                    *n += 1;
                    *n
                }
                None => {
                    counts.push((name.clone(), 0));
                    0
                }
            };
            table = format!("{name}[{n}]");
        } else if let Some(name) = t.strip_prefix('[').and_then(|r| r.split(']').next()) {
            table = name.trim().to_owned();
        } else if i + 1 == line {
            key = t
                .split_once('=')
                .map(|(k, _)| k.trim().trim_matches('"').to_owned())
                .filter(|k| !k.is_empty() && !k.starts_with('#'));
        }
    }
    Location { line, table, key }
}

/// Whether a `[table]` / `[[array]]` header line is well formed (a plain dotted name).
fn header_ok(t: &str) -> bool {
    let t = t.split('#').next().unwrap_or("").trim();
    let inner = t
        .strip_prefix("[[")
        .and_then(|r| r.strip_suffix("]]"))
        .or_else(|| {
            t.strip_prefix('[')
                .and_then(|r| r.strip_suffix(']'))
                .filter(|r| !r.starts_with('['))
        });
    inner.is_some_and(|n| {
        let n = n.trim();
        !n.is_empty()
            && n.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locates_fields_in_array_tables() {
        let src = "region = \"x\"\n[server]\nlisten = \"a\"\n[[policy]]\nname = \"a\"\n[[policy]]\nname = \"b\"\nlimit = -1\n";
        let at = |needle: &str| {
            let l = locate(src, src.find(needle).unwrap());
            (l.line, l.field())
        };
        assert_eq!(at("limit"), (8, "policy[1].limit".to_owned()));
        assert_eq!(at("listen"), (3, "server.listen".to_owned()));
        assert_eq!(at("region"), (1, "region".to_owned()));
    }

    #[test]
    fn names_the_field_of_table_level_errors() {
        let loc = |table: &str, key: Option<&str>| Location {
            line: 1,
            table: table.into(),
            key: key.map(Into::into),
        };
        assert_eq!(
            loc("policy[0]", None).field_for("missing field `limit`"),
            "policy[0].limit"
        );
        assert_eq!(
            loc("policy[0]", Some("name")).field_for("missing field `window`"),
            "policy[0].window"
        );
        assert_eq!(
            loc("server", None).field_for("unknown field `x`, expected one of"),
            "server.x"
        );
        assert_eq!(
            loc("", Some("colour")).field_for("unknown field `colour`"),
            "colour"
        );
        assert_eq!(
            loc("store", Some("timeout")).field_for("invalid type"),
            "store.timeout"
        );
    }
}
