//! A typed builder for quotad config files, so tests and the demo say what they configure
//! instead of formatting TOML by hand. It writes the documented format (`docs/api.md`);
//! tests of the format itself (errors naming file, line and field) keep their literal
//! TOML, since the text is what they test.
//!
//! ```
//! use quotad_testkit::{Config, Policy};
//! let toml = Config::redis("redis://127.0.0.1:6379")
//!     .policy(Policy::new("api", "token_bucket", 100, "1s").burst(20))
//!     .to_toml();
//! assert!(toml.contains("burst = 20"));
//! ```

use std::collections::BTreeMap;

use serde::Serialize;

/// A whole config file. `[server] listen` is the kit's to add (a free port).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Config {
    #[serde(skip_serializing_if = "Option::is_none")]
    region: Option<String>,
    store: BTreeMap<String, toml::Value>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    coordinator: BTreeMap<String, toml::Value>,
    #[serde(rename = "peer", skip_serializing_if = "Vec::is_empty")]
    peers: Vec<Peer>,
    #[serde(rename = "policy")]
    policies: Vec<Policy>,
    #[serde(rename = "descriptor", skip_serializing_if = "Vec::is_empty")]
    descriptors: Vec<Descriptor>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    log: BTreeMap<String, toml::Value>,
    /// `[admin]`: the tests' token ([`ADMIN_TOKEN`]), which [`crate::Quotad::post`] sends
    /// to the admin endpoints.
    admin: Admin,
}

/// The bearer token every config built here accepts on the admin endpoints.
pub const ADMIN_TOKEN: &str = "tests-admin-token-0123456789";

/// `[admin]` with one token, named `tests`.
#[derive(Debug, Clone, Serialize)]
struct Admin {
    token: Vec<BTreeMap<&'static str, &'static str>>,
}

impl Default for Admin {
    fn default() -> Self {
        Admin {
            token: vec![BTreeMap::from([("name", "tests"), ("token", ADMIN_TOKEN)])],
        }
    }
}

impl Config {
    /// A config on the Redis at `url` (`redis://…`), or `"memory"` for the embedded store.
    pub fn redis(url: &str) -> Self {
        let mut c = Config::default();
        c.store.insert("redis".into(), url.into());
        c
    }

    /// A config with an empty `[store]`: set the topology with [`Config::store`], e.g.
    /// `redis_sentinels` and `redis_sentinel_master`, or `redis_cluster`.
    pub fn new() -> Self {
        Config::default()
    }

    /// A config on the master the sentinels at `urls` (`redis://…`) name `master`.
    pub fn sentinel(urls: &[String], master: &str) -> Self {
        Config::new()
            .store("redis_sentinels", urls.to_vec())
            .store("redis_sentinel_master", master)
    }

    /// A config on the Redis Cluster reached through these seed nodes (`redis://…`).
    pub fn cluster(seeds: &[String]) -> Self {
        Config::new().store("redis_cluster", seeds.to_vec())
    }

    /// This region's name (global policies).
    pub fn region(mut self, name: &str) -> Self {
        self.region = Some(name.into());
        self
    }

    /// Any other `[store]` setting, e.g. `.store("timeout", "50ms")`.
    pub fn store(mut self, key: &str, value: impl Into<toml::Value>) -> Self {
        self.store.insert(key.into(), value.into());
        self
    }

    /// A `[coordinator]` setting, e.g. `.coordinator("secret", "…")`.
    pub fn coordinator(mut self, key: &str, value: impl Into<toml::Value>) -> Self {
        self.coordinator.insert(key.into(), value.into());
        self
    }

    /// A `[log]` setting, e.g. `.log("format", "json")`.
    pub fn log(mut self, key: &str, value: impl Into<toml::Value>) -> Self {
        self.log.insert(key.into(), value.into());
        self
    }

    pub fn peer(mut self, peer: Peer) -> Self {
        self.peers.push(peer);
        self
    }

    pub fn policy(mut self, policy: Policy) -> Self {
        self.policies.push(policy);
        self
    }

    /// A top-level `[[descriptor]]` (Envoy's rate-limit service; its `domain` set).
    pub fn descriptor(mut self, domain: &str, descriptor: Descriptor) -> Self {
        self.descriptors.push(Descriptor {
            domain: Some(domain.into()),
            ..descriptor
        });
        self
    }

    /// The TOML text.
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("a config serializes")
    }
}

/// A `[[peer]]` entry: another region and how to reach it.
#[derive(Debug, Clone, Serialize)]
pub struct Peer {
    region: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    url: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    urls: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    secret: Option<String>,
}

impl Peer {
    /// A peer reached at one URL.
    pub fn new(region: &str, url: &str) -> Self {
        Peer {
            region: region.into(),
            url: Some(url.into()),
            urls: Vec::new(),
            secret: None,
        }
    }

    /// A peer region with several instances, tried in order.
    pub fn with_urls(region: &str, urls: &[String]) -> Self {
        Peer {
            region: region.into(),
            url: None,
            urls: urls.to_vec(),
            secret: None,
        }
    }

    /// The secret shared with this peer (else `[coordinator] secret`).
    pub fn secret(mut self, secret: &str) -> Self {
        self.secret = Some(secret.into());
        self
    }
}

/// A `[[descriptor]]` node: `key`, optional `value` and `policy`, nested descriptors.
#[derive(Debug, Clone, Serialize)]
pub struct Descriptor {
    #[serde(skip_serializing_if = "Option::is_none")]
    domain: Option<String>,
    key: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    value: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    policy: Option<String>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    charge: bool,
    #[serde(rename = "descriptor", skip_serializing_if = "Vec::is_empty")]
    children: Vec<Descriptor>,
}

impl Descriptor {
    /// A descriptor entry with this key and any value.
    pub fn new(key: &str) -> Self {
        Descriptor {
            domain: None,
            key: key.into(),
            value: None,
            policy: None,
            charge: false,
            children: Vec::new(),
        }
    }

    /// Counted on Envoy's response path: charged, never denied (`charge = true`).
    pub fn charge(mut self) -> Self {
        self.charge = true;
        self
    }

    /// Only this value.
    pub fn value(mut self, value: &str) -> Self {
        self.value = Some(value.into());
        self
    }

    /// The policy a request descriptor ending here is limited by.
    pub fn policy(mut self, policy: &str) -> Self {
        self.policy = Some(policy.into());
        self
    }

    /// A nested descriptor (the request descriptor's next entry).
    pub fn child(mut self, child: Descriptor) -> Self {
        self.children.push(child);
        self
    }
}

/// A `[[policy]]` entry.
#[derive(Debug, Clone, Serialize)]
pub struct Policy {
    name: String,
    algorithm: String,
    limit: u64,
    window: String,
    #[serde(skip_serializing_if = "BTreeMap::is_empty", flatten)]
    extra: BTreeMap<String, toml::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    global: Option<Global>,
}

impl Policy {
    /// `limit` per `window` (a humantime duration such as `"1s"` or `"15m"`).
    pub fn new(name: &str, algorithm: &str, limit: u64, window: &str) -> Self {
        Policy {
            name: name.into(),
            algorithm: algorithm.into(),
            limit,
            window: window.into(),
            extra: BTreeMap::new(),
            global: None,
        }
    }

    /// `[policy.runtime_limits]`: up to `max_keys` keys with their own limit.
    pub fn runtime_limits(self, max_keys: u64) -> Self {
        let mut t = toml::map::Map::new();
        t.insert("max_keys".into(), (max_keys as i64).into());
        self.set("runtime_limits", toml::Value::Table(t))
    }

    pub fn burst(self, burst: u64) -> Self {
        self.set("burst", burst as i64)
    }

    /// `on_store_error`: `"open"`, `"closed"` or `"local"`.
    pub fn on_store_error(self, mode: &str) -> Self {
        self.set("on_store_error", mode)
    }

    pub fn shadow(self) -> Self {
        self.set("shadow", true)
    }

    /// Any other policy setting.
    pub fn set(mut self, key: &str, value: impl Into<toml::Value>) -> Self {
        self.extra.insert(key.into(), value.into());
        self
    }

    /// `[policy.forward_auth]`: the key's sources (`"header:x-api-key"`, `"client_ip"`),
    /// `on_missing_key` (`"deny"`, `"allow"`, `"key:<k>"`) and `denied_status`.
    pub fn forward_auth(self, key: &[&str], on_missing_key: &str, denied_status: u16) -> Self {
        let mut t = toml::Table::new();
        let key: Vec<toml::Value> = key.iter().map(|k| (*k).into()).collect();
        t.insert("key".into(), key.into());
        t.insert("on_missing_key".into(), on_missing_key.into());
        t.insert("denied_status".into(), i64::from(denied_status).into());
        self.set("forward_auth", t)
    }

    /// The cost of each forward-auth check (after [`Policy::forward_auth`]; 0: a peek).
    pub fn forward_auth_cost(mut self, cost: u64) -> Self {
        if let Some(toml::Value::Table(t)) = self.extra.get_mut("forward_auth") {
            t.insert("cost".into(), (cost as i64).into());
        }
        self
    }

    /// A `[[policy.override]]`: `kind` is `"key"`, `"prefix"` or `"glob"`.
    pub fn with_override(mut self, kind: &str, pattern: &str, limit: u64) -> Self {
        let mut t = toml::Table::new();
        t.insert(kind.into(), pattern.into());
        t.insert("limit".into(), (limit as i64).into());
        let list = self
            .extra
            .entry("override".into())
            .or_insert_with(|| toml::Value::Array(Vec::new()));
        if let toml::Value::Array(a) = list {
            a.push(t.into());
        }
        self
    }

    /// Makes it a global policy.
    pub fn global(mut self, global: Global) -> Self {
        self.global = Some(global);
        self
    }
}

/// `[policy.global]`: the escrow weights by region, and any other setting.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Global {
    escrow: BTreeMap<String, toml::Value>,
    #[serde(flatten)]
    extra: BTreeMap<String, toml::Value>,
}

impl Global {
    /// Escrow weights, e.g. `&[("us", 6), ("eu", 3), ("ap", 1)]`.
    pub fn escrow(weights: &[(&str, u32)]) -> Self {
        Global {
            escrow: weights
                .iter()
                .map(|(r, w)| (r.to_string(), i64::from(*w).into()))
                .collect(),
            extra: BTreeMap::new(),
        }
    }

    /// Any other setting, e.g. `.set("lease", "4s")`.
    pub fn set(mut self, key: &str, value: impl Into<toml::Value>) -> Self {
        self.extra.insert(key.into(), value.into());
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_built_config_is_one_the_daemon_accepts() {
        let text = Config::redis("redis://127.0.0.1:1")
            .region("eu")
            .coordinator("secret", "0123456789abcdef0123")
            .peer(Peer::new("us", "http://127.0.0.1:2"))
            .policy(
                Policy::new("a", "gcra", 10, "1s")
                    .burst(5)
                    .on_store_error("closed"),
            )
            .policy(
                Policy::new("g", "token_bucket", 100, "1s")
                    .global(Global::escrow(&[("eu", 1), ("us", 3)]).set("version", 2)),
            )
            .to_toml();
        let s = quotad_daemon::Settings::parse("built.toml", &text)
            .unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert_eq!(quotad_daemon::testing::region(&s), "eu");
        let policies = quotad_daemon::testing::policies(&s);
        assert_eq!(policies.len(), 2);
        assert_eq!(policies[0].burst.get(), 5);
        let g = quotad_daemon::testing::global(&s).expect("a global policy");
        assert_eq!(g.regions, ["eu", "us"]);
        assert_eq!(policies[1].global.as_ref().unwrap().version, 2);
    }

    #[test]
    fn a_cluster_config_names_its_seeds() {
        let seeds = [
            "redis://127.0.0.1:1".to_owned(),
            "redis://127.0.0.1:2".to_owned(),
        ];
        let text = Config::cluster(&seeds)
            .policy(Policy::new("a", "gcra", 10, "1s"))
            .to_toml();
        let s = quotad_daemon::Settings::parse("cluster.toml", &text)
            .unwrap_or_else(|e| panic!("{e}\n{text}"));
        let quotad_daemon::testing::StoreBackend::Redis(r) = quotad_daemon::testing::store(&s)
        else {
            panic!("not a Redis store: {text}");
        };
        assert_eq!(
            r.target.topology,
            quotad_daemon::testing::redis::Topology::Cluster(seeds.to_vec())
        );
    }
}
