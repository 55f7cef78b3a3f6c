//! The Redis key layout: the one place that turns domain values (a policy, a user key,
//! this region's place among its peers) into storage keys, hash tags and the numbers the
//! global scripts take besides their keys.
//!
//! Config and policy know nothing of it: the app builds a [`Layouts`] from the loaded
//! policies when it assembles the daemon, and the limiter and the coordinator's store ask
//! it for keys. The embedded memory store uses the same keys, so one layout serves both.
//!
//! Every key starts with the configured prefix:
//!
//! - `<prefix>:<policy>:<tag>:{<user key>}`: a key's state. `<tag>` is the algorithm's
//!   (`fw`, `sl`, `sw`, `tb`, `gc`), or `g` for a global policy, whose hash holds a bucket,
//!   a lease book and counters (`lua/global/common.lua`).
//! - `<prefix>:<policy>:g:meta`, `…:g:active`, `…:g:books`: a global policy's default
//!   escrow, recently active keys and keys with a book. User keys always carry a brace,
//!   so none can collide with these.
//! - `<prefix>:coordinator:lock`, `…:fence`, `…:replid`: the region's coordinator lock,
//!   its fencing counter and the replication ID the books were last written under.
//! - `<prefix>:invalidate`: the pub/sub channel of the deny cache.

use std::collections::HashMap;
use std::sync::Arc;

use crate::policy::Policy;
use crate::store::memory::TTL_GRACE_MS;
use quotad_core::coordinator::RegionId;

/// How long every key of a global policy lives after its last touch, in ms: longer than
/// any lease, so a book outlives what it records.
pub const GLOBAL_KEEP_MS: i64 = 3_600_000;

/// The tag of a global policy's keys in place of the algorithm's.
const GLOBAL_TAG: &str = "g";

/// The region's coordinator keys sit under this name where a policy's would. Keys of a
/// policy named "coordinator" read as the coordinator's and are left alone by the janitor:
/// the safe side. (They cannot collide: a policy's keys always end in a `{…}` tag.)
const COORDINATOR: &str = "coordinator";

/// Whose a key is, by its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyOwner<'k> {
    /// A policy's, by name (configured or not).
    Policy(&'k str),
    /// The coordinator's lock, fencing counter or replication ID.
    Coordinator,
    /// Not under this layout's prefix.
    Foreign,
}

/// The key layout under one prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    prefix: String,
}

impl Layout {
    /// `prefix` is validated by the config (`policy::valid_prefix`).
    pub fn new(prefix: &str) -> Self {
        Layout {
            prefix: prefix.to_owned(),
        }
    }

    /// The prefix every key of this layout starts with (then `:`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Everything of a policy up to the user key: `<prefix>:<policy>:<tag>:`.
    fn stem(&self, policy: &Policy) -> String {
        let tag = match policy.global {
            Some(_) => GLOBAL_TAG,
            None => policy.algorithm.key_tag(),
        };
        format!("{}:{}:{tag}:", self.prefix, policy.name)
    }

    /// Where `policy`'s keys live; for a global policy, also its per-policy keys and the
    /// scripts' numbers for the region `region` describes.
    pub fn policy(&self, policy: &Policy, region: Option<&RegionPlace>) -> PolicyLayout {
        let stem = self.stem(policy);
        let global = policy.global_policy().map(|g| {
            Arc::new(GlobalLayout {
                keys: PolicyKeys {
                    meta: format!("{stem}meta"),
                    active: format!("{stem}active"),
                    books: format!("{stem}books"),
                },
                shape: ScriptShape {
                    rho: policy.rate_per_second(),
                    burst: policy.burst.get() as f64,
                    step_tolerance_us: region.map_or(0, |r| r.step_tolerance_us),
                    fallback_escrow: region
                        .and_then(|r| g.escrow.get(r.me.index()).copied())
                        .unwrap_or(0.0),
                    keep_ms: GLOBAL_KEEP_MS,
                },
            })
        });
        let repair_ttl_ms = match policy.global {
            Some(_) => GLOBAL_KEEP_MS,
            None => {
                let longest = policy.limits().longest_ttl_us(policy.algorithm);
                (longest.max(0) as u64).div_ceil(1000) as i64 + TTL_GRACE_MS
            }
        };
        PolicyLayout {
            stem,
            global,
            repair_ttl_ms,
        }
    }

    /// What a key of this layout is, from its name: the inverse of the stems above.
    pub fn owner_of<'k>(&self, key: &'k str) -> KeyOwner<'k> {
        let Some(rest) = key
            .strip_prefix(self.prefix.as_str())
            .and_then(|r| r.strip_prefix(':'))
        else {
            return KeyOwner::Foreign;
        };
        match rest.split_once(':') {
            Some((COORDINATOR, _)) => KeyOwner::Coordinator,
            Some((policy, _)) => KeyOwner::Policy(policy),
            None => KeyOwner::Foreign,
        }
    }

    /// The region's coordinator lock (value: the holder's instance id).
    pub fn lock_key(&self) -> String {
        format!("{}:{COORDINATOR}:lock", self.prefix)
    }

    /// The lock's fencing counter (value: the holder's token; every coordinator write
    /// checks it). It has no TTL on purpose: a token must never be handed out twice.
    pub fn fence_key(&self) -> String {
        format!("{}:{COORDINATOR}:fence", self.prefix)
    }

    /// Which instance sweeps for lost TTLs this interval (value: its id; expires with the
    /// interval). Under the coordinator's name, so the janitor leaves it alone.
    pub fn janitor_key(&self) -> String {
        format!("{}:{COORDINATOR}:janitor", self.prefix)
    }

    /// The replication ID the region's books were last written under (failover detection).
    pub fn replid_key(&self) -> String {
        format!("{}:{COORDINATOR}:replid", self.prefix)
    }

    /// The deny cache's invalidation channel.
    pub fn invalidate_channel(&self) -> String {
        format!("{}:invalidate", self.prefix)
    }
}

/// This region among its peers, as far as the global scripts need it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RegionPlace {
    pub me: RegionId,
    /// `Params::step_tolerance_us`: the clock step the scripts tolerate before they
    /// distrust the bucket's timestamps.
    pub step_tolerance_us: i64,
}

/// Where one policy's state lives.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyLayout {
    stem: String,
    /// Set exactly for global policies (shared: every check of the policy carries it).
    pub global: Option<Arc<GlobalLayout>>,
    /// The TTL a key of this policy found without one may be given without changing any
    /// decision: the longest any write sets, plus the stores' grace.
    pub repair_ttl_ms: i64,
}

/// A global policy's per-policy keys and script numbers.
#[derive(Debug, Clone, PartialEq)]
pub struct GlobalLayout {
    pub keys: PolicyKeys,
    pub shape: ScriptShape,
}

impl PolicyLayout {
    /// The storage key for a user key: `<stem>{<escaped key>}`.
    ///
    /// This is the only place storage keys are built. The user key sits inside a Redis
    /// Cluster hash tag, escaped so it contains no `{` or `}`: no key can move another key's
    /// slot or end the tag early. The escaping (`%` `{` `}` to `%25` `%7B` `%7D`) is
    /// injective and policy names contain no `:`, so distinct (policy, key) pairs never share
    /// a storage key.
    pub fn storage_key(&self, key: &str) -> String {
        let mut out = String::with_capacity(self.stem.len() + key.len() + 2);
        out.push_str(&self.stem);
        out.push('{');
        for c in key.chars() {
            match c {
                '%' => out.push_str("%25"),
                '{' => out.push_str("%7B"),
                '}' => out.push_str("%7D"),
                c => out.push(c),
            }
        }
        out.push('}');
        out
    }
}

/// The per-policy keys of a global policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyKeys {
    pub meta: String,
    pub active: String,
    pub books: String,
}

/// What every script of a global policy needs besides the key.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScriptShape {
    pub rho: f64,
    pub burst: f64,
    pub step_tolerance_us: i64,
    /// The escrow of this region in the running config: applied to keys without a book
    /// while the coordinator has never written a default (a first start).
    pub fallback_escrow: f64,
    /// Lifetime of every key of the policy after its last touch, longer than any lease.
    pub keep_ms: i64,
}

/// The layouts of the loaded policies, by name: built once when the app is assembled.
#[derive(Debug, Clone)]
pub struct Layouts {
    layout: Layout,
    by_name: HashMap<String, PolicyLayout>,
}

impl Layouts {
    pub fn new<'a>(
        layout: Layout,
        policies: impl IntoIterator<Item = &'a Policy>,
        region: Option<&RegionPlace>,
    ) -> Self {
        let by_name = policies
            .into_iter()
            .map(|p| (p.name.clone(), layout.policy(p, region)))
            .collect();
        Layouts { layout, by_name }
    }

    /// The layout of a loaded policy. Every policy the API can name was loaded with the
    /// same snapshot, so the lookup finds it; a policy that was not (none today) is laid
    /// out on the spot, without a region's escrow.
    pub fn of(&self, policy: &Policy) -> std::borrow::Cow<'_, PolicyLayout> {
        match self.by_name.get(&policy.name) {
            Some(l) => std::borrow::Cow::Borrowed(l),
            None => std::borrow::Cow::Owned(self.layout.policy(policy, None)),
        }
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The layout of the loaded policy named `name`.
    pub fn by_name(&self, name: &str) -> Option<&PolicyLayout> {
        self.by_name.get(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{FailMode, GlobalSpec, PolicySpec};
    use quotad_core::algorithm::Algorithm;
    use quotad_core::coordinator::Mode;
    use std::time::Duration;

    fn policy(name: &str, global: Option<GlobalSpec>) -> Policy {
        Policy::new(PolicySpec {
            name,
            algorithm: Algorithm::TokenBucket,
            limit: 10,
            window: Duration::from_secs(1),
            burst: None,
            on_store_error: FailMode::Open,
            shadow: false,
            global,
        })
        .unwrap()
    }

    fn key(policy: &Policy, user_key: &str) -> String {
        Layout::new("rl").policy(policy, None).storage_key(user_key)
    }

    #[test]
    fn storage_keys_cannot_escape_their_hash_tag_or_collide() {
        let p = policy("api", None);
        assert_eq!(key(&p, "alice"), "rl:api:tb:{alice}");
        assert_eq!(key(&p, "a}b{c"), "rl:api:tb:{a%7Db%7Bc}");
        assert_ne!(key(&p, "%7B"), key(&p, "{"));
        assert_ne!(key(&policy("a", None), "x"), key(&policy("b", None), "x"));
        let k = key(&p, "x}y");
        let tag_start = k.find('{').unwrap();
        let tag_end = k[tag_start..].find('}').unwrap() + tag_start;
        assert_eq!(tag_end, k.len() - 1, "the tag spans the whole user key");
    }

    #[test]
    fn global_policies_share_one_stem_for_keys_and_per_policy_state() {
        let spec = GlobalSpec {
            version: 1,
            weights: vec![3.0, 1.0],
            mode: Mode::Proportional,
        };
        let p = policy("g", Some(spec));
        let place = RegionPlace {
            me: RegionId(1),
            step_tolerance_us: 7,
        };
        let l = Layout::new("rl").policy(&p, Some(&place));
        assert_eq!(l.storage_key("k"), "rl:g:g:{k}");
        let g = l.global.expect("a global layout");
        assert_eq!(g.keys.meta, "rl:g:g:meta");
        assert_eq!(g.keys.active, "rl:g:g:active");
        assert_eq!(g.keys.books, "rl:g:g:books");
        assert_eq!(g.shape.rho, 10.0);
        assert_eq!(g.shape.step_tolerance_us, 7);
        assert_eq!(
            g.shape.fallback_escrow, 2.5,
            "region 1 of weights 3:1, ρ 10"
        );
        assert_eq!(g.shape.keep_ms, GLOBAL_KEEP_MS);
    }
}
