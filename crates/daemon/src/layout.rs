//! The Redis key layout: the one place that turns domain values (a policy, a user key,
//! this region's place among its peers) into storage keys, hash tags and the numbers the
//! global scripts take besides their keys.
//!
//! Config and policy know nothing of it: the app builds a [`Layouts`] from the loaded
//! policies when it assembles the daemon, and the limiter and the coordinator's store ask
//! it for keys. The embedded memory store uses the same keys, so one layout serves both.
//!
//! Every script's keys share one Redis Cluster hash slot, whatever the topology (a
//! cluster refuses anything else with CROSSSLOT), and no user input chooses a slot by
//! itself. Every key starts with the configured prefix:
//!
//! - `<prefix>:<policy>:<tag>:{<user key>}`: a key's state. `<tag>` is the algorithm's
//!   (`fw`, `sl`, `sw`, `tb`, `gc`); the escaped user key is the hash tag, so keys spread
//!   over the cluster's masters.
//! - `<prefix>:<policy>:cc:{<user key>}`: a concurrency limit's key, a sorted set of the
//!   units held (`lua/concurrency.lua`); `…:e` beside it, the leases a reset gave back
//!   before their end.
//! - `<prefix>:<policy>:<tag>:{<user key>}:r:<id>`: a reservation of that key awaiting its
//!   settlement (`lua/settle.lua`), in the key's slot; `<id>` is quotad's, 32 hex digits.
//!   No other key has `:r:` after its closing brace.
//! - `<prefix>:<policy>:<tag>:{<user key>}:z`: when that key was last reset (a settling
//!   policy's), in its slot: the reservations opened before it are ended.
//! - `<prefix>:<policy>:g:{<prefix>:<policy>}:{<user key>}`: a key of a global policy,
//!   whose hash holds a bucket, a lease book and counters (`lua/global/common.lua`). The
//!   hash tag is the policy's: its scripts also read and write the policy's default
//!   escrow, active keys and fencing token, and the coordinator's writes must be fenced
//!   atomically, so a global policy's keys live in one slot (one master; see
//!   docs/global-budgets.md, Redis Cluster).
//! - `<prefix>:<policy>:g:{<prefix>:<policy>}:meta`, `…:active`, `…:books`, `…:fence`,
//!   `…:replid`: a global policy's default escrow, recently active keys, keys with a book,
//!   the coordinator's fencing token as seen by this policy's slot, and the replication ID
//!   its books were last written under (failover detection on that slot's master). User
//!   keys always end in a brace, so none can collide with these.
//! - `<prefix>:coordinator:lock`, `…:fence`: the region's coordinator lock and the counter
//!   its tokens are drawn from (each command touches one key: any slot will do).
//! - `<prefix>:invalidate`: the pub/sub channel of the deny cache.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crate::policy::{ConcurrencyPolicy, Policy};
use quotad_core::coordinator::{RegionId, escrow_share};

/// Grace added to every key's TTL, in ms (why: `ttl_ms` in lua/helpers.lua).
pub(crate) const TTL_GRACE_MS: i64 = 1000;

/// The TTL the Lua scripts set for a state that is equivalent to absent after `us`:
/// whole milliseconds rounded up, plus [`TTL_GRACE_MS`] (see `ttl_ms` in lua/helpers.lua).
pub fn ttl_ms(us: i64) -> i64 {
    ((us.max(0) as u64).div_ceil(1000) as i64).saturating_add(TTL_GRACE_MS)
}

/// Redis Cluster's hash slot of `key` (the rule the hash tags above are for): CRC16 of its hash tag (the part between the first
/// `{` and the next `}`, when not empty) or of the whole key, modulo 16384.
pub fn slot(key: &str) -> u16 {
    let b = key.as_bytes();
    let tagged = b.iter().position(|&c| c == b'{').and_then(|open| {
        let rest = &b[open + 1..];
        let close = rest.iter().position(|&c| c == b'}')?;
        (close > 0).then(|| &rest[..close])
    });
    crc16::State::<crc16::XMODEM>::calculate(tagged.unwrap_or(b)) % 16384
}

/// How long a token bucket's or GCRA key's hot-key slice lives (Redis's clock): its units
/// count against the bucket's capacity until it is given back or ends, and the key lives
/// at least as long (store::redis::hot).
pub(crate) const BUCKET_SLICE_LIFE: Duration = Duration::from_secs(1);

/// How long every key of a global policy lives after its last touch, in ms: longer than
/// any lease, so a book outlives what it records.
pub(crate) const GLOBAL_KEEP_MS: i64 = 3_600_000;

/// The tag of a concurrency limit's keys.
const CONCURRENCY_TAG: &str = "cc";

/// The tag of a global policy's keys in place of the algorithm's.
const GLOBAL_TAG: &str = "g";

/// The last word of the keys holding fencing tokens.
const FENCE: &str = "fence";

/// The region's coordinator keys sit under this name where a policy's would. Keys of a
/// policy named "coordinator" read as the coordinator's and are left alone by the janitor:
/// the safe side. (They cannot collide: a policy's keys always end in a `{…}` tag.)
const COORDINATOR: &str = "coordinator";

/// Whether `name` may not name a policy: the coordinator's keys are
/// `<prefix>:coordinator:...`, where a policy's would be `<prefix>:<policy>:...`, and the
/// janitor would take a policy's keys for the coordinator's (never expired).
pub(crate) fn reserved_name(name: &str) -> Option<&'static str> {
    (name == COORDINATOR).then_some(
        "\"coordinator\" is reserved: the region's coordinator keeps its keys under <prefix>:coordinator:, where this policy's would be",
    )
}

/// Whose a key is, by its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyOwner<'k> {
    /// A policy's, by name (configured or not).
    Policy(&'k str),
    /// The coordinator's lock, fencing counter or replication ID.
    Coordinator,
    /// A policy's runtime limits (`lua/runtime_limit.lua`): the operator's data, never
    /// expired.
    RuntimeLimits,
    /// Not under this layout's prefix.
    Foreign,
}

/// The key layout under one prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    prefix: String,
    /// This region's name ('' without regions): the origin of the runtime limits written
    /// here, by which regions order their writes.
    region: String,
}

impl Layout {
    /// `prefix` is validated by the config (`policy::valid_prefix`).
    pub fn new(prefix: &str) -> Self {
        Layout {
            prefix: prefix.to_owned(),
            region: String::new(),
        }
    }

    /// The same, in the region named `region`.
    pub(crate) fn in_region(mut self, region: &str) -> Self {
        self.region = region.to_owned();
        self
    }

    /// The prefix every key of this layout starts with (then `:`).
    pub(crate) fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Everything of a policy up to the user key: `<prefix>:<policy>:<tag>:`, and for a
    /// global policy its hash tag after it (see the module docs).
    fn stem(&self, policy: &Policy) -> String {
        let (prefix, name) = (&self.prefix, &policy.name);
        match policy.global {
            Some(_) => format!("{prefix}:{name}:{GLOBAL_TAG}:{{{prefix}:{name}}}:"),
            None => format!("{prefix}:{name}:{}:", policy.algorithm.key_tag()),
        }
    }

    /// Where `policy`'s keys live; for a global policy, also its per-policy keys and the
    /// scripts' numbers for the region `region` describes.
    pub(crate) fn policy(&self, policy: &Policy, region: Option<&RegionPlace>) -> PolicyLayout {
        let stem = self.stem(policy);
        let global = policy.global_policy().map(|g| {
            Arc::new(GlobalLayout {
                keys: PolicyKeys {
                    meta: format!("{stem}meta"),
                    active: format!("{stem}active"),
                    books: format!("{stem}books"),
                    fence: format!("{stem}{FENCE}"),
                    replid: format!("{stem}replid"),
                },
                region: region.map(|r| r.me.index()),
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
                let mut longest = match &policy.calendar {
                    // A key of a calendar period lives to its period's end: never longer
                    // than the longest period of its kind.
                    Some(c) => c.calendar().period().longest_us(),
                    None => policy.limits().longest_ttl_us(policy.algorithm),
                };
                // A bucket's hot-key slices keep its key past a full refill by their life.
                if policy.hot_key_rate.is_some() && policy.algorithm.has_burst() {
                    longest += BUCKET_SLICE_LIFE.as_micros() as i64;
                }
                let longest_ms = (longest.max(0) as u64).div_ceil(1000) as i64;
                // A policy that takes settlements: a key in debt lives until refill has
                // paid it, which a settlement bounds by a year (each; the scripts give
                // such a key its own longer TTL), and a reservation as long as it may
                // wait for its settlement.
                let settling_ms = match policy.settle_within {
                    Some(_) => crate::policy::MAX_WINDOW.as_millis() as i64,
                    None => 0,
                };
                longest_ms.max(settling_ms) + TTL_GRACE_MS
            }
        };
        PolicyLayout {
            stem,
            tag: policy.algorithm.key_tag(),
            global,
            repair_ttl_ms,
        }
    }

    /// Where a concurrency limit's keys live: `<prefix>:<policy>:cc:{<user key>}`, each a
    /// sorted set of the units held, living until its latest lease ends.
    pub(crate) fn concurrency(&self, policy: &ConcurrencyPolicy) -> PolicyLayout {
        let lease_ms = policy.lease.as_millis() as i64;
        PolicyLayout {
            stem: format!("{}:{}:{CONCURRENCY_TAG}:", self.prefix, policy.name),
            tag: CONCURRENCY_TAG,
            global: None,
            repair_ttl_ms: lease_ms + TTL_GRACE_MS,
        }
    }

    /// What a key of this layout is, from its name: the inverse of the stems above.
    pub(crate) fn owner_of<'k>(&self, key: &'k str) -> KeyOwner<'k> {
        let Some(rest) = key
            .strip_prefix(self.prefix.as_str())
            .and_then(|r| r.strip_prefix(':'))
        else {
            return KeyOwner::Foreign;
        };
        match rest.split_once(':') {
            Some((COORDINATOR, _)) => KeyOwner::Coordinator,
            // A global policy's fencing token: like the region's counter, it must never
            // expire (a token must not be accepted again once a newer one was raised).
            Some((_, tail)) if tail.ends_with(&format!("}}:{FENCE}")) => KeyOwner::Coordinator,
            Some((_, tail)) if tail.starts_with(RUNTIME_LIMITS) => KeyOwner::RuntimeLimits,
            Some((policy, _)) => KeyOwner::Policy(policy),
            None => KeyOwner::Foreign,
        }
    }

    /// The region's coordinator lock (value: the holder's instance id).
    pub fn lock_key(&self) -> String {
        format!("{}:{COORDINATOR}:lock", self.prefix)
    }

    /// The lock's fencing counter (value: the last token handed out; each holder raises
    /// every global policy's own fence key to its token before it reads anything). It has
    /// no TTL on purpose: a token must never be handed out twice.
    pub fn fence_key(&self) -> String {
        format!("{}:{COORDINATOR}:{FENCE}", self.prefix)
    }

    /// The region's last incarnation (value: a number, drawn from the holder's wall clock
    /// at each takeover; see `federation::incarnation`). No TTL, like the fence: a lost
    /// value is survivable (the wall clock is the floor), but a kept one is exact.
    pub fn incarnation_key(&self) -> String {
        format!("{}:{COORDINATOR}:incarnation", self.prefix)
    }

    /// Which instance sweeps for lost TTLs this interval (value: its id; expires with the
    /// interval). Under the coordinator's name, so the janitor leaves it alone.
    pub(crate) fn janitor_key(&self) -> String {
        format!("{}:{COORDINATOR}:janitor", self.prefix)
    }

    /// The deny cache's invalidation channel.
    pub(crate) fn invalidate_channel(&self) -> String {
        format!("{}:invalidate", self.prefix)
    }

    /// Where `policy`'s runtime limits live: `<prefix>:<policy>:limits:{<policy>}:` and
    /// `h` (the entries), `v` (the version), `x` (the expiries), `d` (the marks of the
    /// entries that went, kept `keep_ms`), `c` (the keys by the version of their last
    /// change, which peer regions pull: kept for a global policy only, whose changes
    /// spread, as is the region every value of one carries). One hash tag: one slot in a
    /// cluster.
    pub(crate) fn runtime_limit_keys(
        &self,
        policy: &str,
        keep_ms: i64,
        spread: bool,
    ) -> RuntimeLimitKeys {
        let stem = format!("{}:{policy}:{RUNTIME_LIMITS}{{{policy}}}:", self.prefix);
        RuntimeLimitKeys {
            policy: policy.to_owned(),
            entries: format!("{stem}h"),
            version: format!("{stem}v"),
            expiries: format!("{stem}x"),
            gone: format!("{stem}d"),
            changes: format!("{stem}c"),
            origin: if spread {
                self.region.clone()
            } else {
                String::new()
            },
            keep_ms,
        }
    }
}

/// The tail that marks a policy's runtime limits (no algorithm's key tag is `limits`).
const RUNTIME_LIMITS: &str = "limits:";

/// A policy's runtime-limit keys ([`Layout::runtime_limit_keys`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RuntimeLimitKeys {
    pub(crate) policy: String,
    pub(crate) entries: String,
    pub(crate) version: String,
    pub(crate) expiries: String,
    pub(crate) gone: String,
    pub(crate) changes: String,
    /// This region's name, the origin of what is written here, for a policy whose changes
    /// spread to other regions (a global one); '' otherwise: no region in the values and
    /// no index of changes.
    pub(crate) origin: String,
    /// How long the mark of an entry that went is kept: the longest a state of the policy
    /// lives, after which no key can still hold a state written under the entry.
    pub(crate) keep_ms: i64,
}

/// This region among its peers, as far as the global scripts need it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct RegionPlace {
    pub(crate) me: RegionId,
    /// `Params::step_tolerance_us`: the clock step the scripts tolerate before they
    /// distrust the bucket's timestamps.
    pub(crate) step_tolerance_us: i64,
}

/// Where one policy's state lives.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyLayout {
    stem: String,
    /// The tag the stem was built with (the algorithm's, or a concurrency limit's): a
    /// policy reloaded with another algorithm gets other keys (states of two algorithms
    /// must never meet in one key).
    tag: &'static str,
    /// Set exactly for global policies (shared: every check of the policy carries it).
    pub(crate) global: Option<Arc<GlobalLayout>>,
    /// The TTL a key of this policy found without one may be given without changing any
    /// decision: the longest any write sets, plus the stores' grace.
    pub(crate) repair_ttl_ms: i64,
}

/// A global policy's per-policy keys and script numbers.
#[derive(Debug, Clone, PartialEq)]
pub struct GlobalLayout {
    pub keys: PolicyKeys,
    /// The numbers of the policy as loaded at start-up; see [`GlobalLayout::shape_for`].
    pub shape: ScriptShape,
    /// This region's index (None where no region is known: layouts for tools and tests).
    pub(crate) region: Option<usize>,
}

impl GlobalLayout {
    /// The scripts' numbers for `policy` as loaded now. A reload may re-split a global
    /// policy (a new version with other weights; its rate and burst cannot change live),
    /// and the fallback escrow, used only until the coordinator first writes a default,
    /// is then the lower of the start-up and the new one: decrease first, as the
    /// coordinator does.
    pub(crate) fn shape_for(&self, policy: &Policy) -> ScriptShape {
        let now = match (&policy.global, self.region) {
            // The policy's ρ, never a key's own rate (`Policy::key_limit`).
            (Some(g), Some(i)) => escrow_share(self.shape.rho, &g.weights, i),
            _ => self.shape.fallback_escrow,
        };
        ScriptShape {
            fallback_escrow: self.shape.fallback_escrow.min(now),
            ..self.shape
        }
    }
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
        push_tagged(&mut out, key);
        out
    }

    /// Where reservation `id` of the key stored at `storage_key` waits for its settlement:
    /// `<storage key>:r:<id>`, in the key's slot. `id` is quotad's own
    /// ([`ReservationId`]), never a client's text.
    pub fn reservation_key(storage_key: &str, id: &ReservationId) -> String {
        format!("{storage_key}:r:{}", id.as_str())
    }

    /// Where a concurrency limit's key stored at `storage_key` remembers the leases a
    /// reset gave back before their end (`lua/concurrency.lua`): `<storage key>:e`, in
    /// its slot, living until the last of them would have ended.
    pub fn ended_leases_key(storage_key: &str) -> String {
        format!("{storage_key}:e")
    }

    /// What every [`PolicyLayout::reservation_key`] of `storage_key` starts with.
    pub(crate) fn reservation_key_prefix(storage_key: &str) -> String {
        format!("{storage_key}:r:")
    }

    /// Where the key stored at `storage_key` keeps when it was last reset (a settling
    /// policy's key): `<storage key>:z`, in the key's slot, living as long as a
    /// reservation may; the reservations opened before it are ended (`lua/settle.lua`).
    pub fn reset_mark_key(storage_key: &str) -> String {
        format!("{storage_key}:z")
    }

    /// The storage key of a key checked in a co-location group (a composite limit):
    /// `<stem>{<escaped group>}:{<escaped key>}`. The group is the hash tag, so every key
    /// of the group shares a slot and one script can decide them together. Distinct from
    /// every ungrouped key (those hold one brace pair), and injective like
    /// [`PolicyLayout::storage_key`]. Global policies have no groups (the API refuses).
    pub fn grouped_key(&self, group: &str, key: &str) -> String {
        let mut out = String::with_capacity(self.stem.len() + group.len() + key.len() + 5);
        out.push_str(&self.stem);
        push_tagged(&mut out, group);
        out.push(':');
        push_tagged(&mut out, key);
        out
    }
}

/// A reservation's id: 32 lowercase hex digits (128 random bits), so ids cannot be guessed
/// and a settlement's text cannot reach any other key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReservationId(String);

impl ReservationId {
    pub(crate) const LEN: usize = 32;

    /// A new random id.
    pub fn random() -> Self {
        ReservationId(format!("{:032x}", rand::random::<u128>()))
    }

    /// A client's text, if it is an id's shape.
    pub(crate) fn parse(text: &str) -> Option<Self> {
        (text.len() == Self::LEN && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
            .then(|| ReservationId(text.to_owned()))
    }

    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }
}

/// `{<s escaped>}`: `%` `{` `}` become `%25` `%7B` `%7D`, so no input ends a tag early or
/// starts another.
fn push_tagged(out: &mut String, s: &str) {
    out.push('{');
    for c in s.chars() {
        match c {
            '%' => out.push_str("%25"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            c => out.push(c),
        }
    }
    out.push('}');
}

/// The per-policy keys of a global policy, all in the slot of its keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyKeys {
    /// The policy's meta hash: the default escrow the coordinator wrote.
    pub meta: String,
    /// The policy's active set: keys spent in recently, by time.
    pub active: String,
    /// The policy's set of keys that have a lease book.
    pub books: String,
    /// The fencing token every coordinator write to this policy checks.
    pub fence: String,
    /// The replication ID the policy's books were last written under.
    pub replid: String,
}

/// What every script of a global policy needs besides the key.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScriptShape {
    /// The global rate ρ, units per second.
    pub rho: f64,
    /// The global capacity B, in units.
    pub burst: f64,
    /// A clock reading this far (µs) below a book's high-water mark is a backward step.
    pub step_tolerance_us: i64,
    /// The escrow of this region in the running config: applied to keys without a book
    /// while the coordinator has never written a default (a first start).
    pub fallback_escrow: f64,
    /// Lifetime of every key of the policy after its last touch, longer than any lease.
    pub keep_ms: i64,
}

/// The layouts of the loaded policies, by name: built when the app is assembled, and by
/// the janitor before each sweep from the config in force.
#[derive(Debug, Clone)]
pub struct Layouts {
    layout: Layout,
    by_name: HashMap<String, PolicyLayout>,
}

impl Layouts {
    pub(crate) fn new<'a>(
        layout: Layout,
        policies: impl IntoIterator<Item = &'a Policy>,
        region: Option<&RegionPlace>,
    ) -> Self {
        // A name given twice (a policy and its per-key overrides: one set of keys) keeps
        // its first layout with the longest repair TTL of them all.
        let mut by_name: HashMap<String, PolicyLayout> = HashMap::new();
        for p in policies {
            let l = layout.policy(p, region);
            by_name
                .entry(p.name.clone())
                .and_modify(|kept| kept.repair_ttl_ms = kept.repair_ttl_ms.max(l.repair_ttl_ms))
                .or_insert(l);
        }
        Layouts { layout, by_name }
    }

    /// The layout of a policy: the one built at start-up, or, for a policy a reload added
    /// or gave another algorithm (never a global one: those cannot change live), one laid
    /// out on the spot, without a region's escrow.
    pub(crate) fn of(&self, policy: &Policy) -> std::borrow::Cow<'_, PolicyLayout> {
        match self.by_name.get(&policy.name) {
            Some(l) if l.tag == policy.algorithm.key_tag() => std::borrow::Cow::Borrowed(l),
            _ => std::borrow::Cow::Owned(self.layout.policy(policy, None)),
        }
    }

    /// The layout of a concurrency limit, as [`Layouts::of`].
    pub fn of_concurrency(&self, policy: &ConcurrencyPolicy) -> std::borrow::Cow<'_, PolicyLayout> {
        match self.by_name.get(&policy.name) {
            Some(l) if l.tag == CONCURRENCY_TAG => std::borrow::Cow::Borrowed(l),
            _ => std::borrow::Cow::Owned(self.layout.concurrency(policy)),
        }
    }

    /// With the layouts of concurrency limits (names distinct from the policies').
    pub(crate) fn with_concurrency<'a>(
        mut self,
        limits: impl IntoIterator<Item = &'a ConcurrencyPolicy>,
    ) -> Self {
        for c in limits {
            self.by_name
                .insert(c.name.clone(), self.layout.concurrency(c));
        }
        self
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
    fn a_group_is_the_hash_tag_of_its_keys() {
        let l = Layout::new("rl").policy(&policy("api", None), None);
        assert_eq!(
            l.grouped_key("tenant:9", "alice"),
            "rl:api:tb:{tenant:9}:{alice}"
        );
        assert_eq!(l.grouped_key("t}{", "a"), "rl:api:tb:{t%7D%7B}:{a}");
        let tenant = l.grouped_key("tenant:9", "tenant:9");
        for user in ["alice", "bob", "}{", ""] {
            assert_eq!(slot(&l.grouped_key("tenant:9", user)), slot(&tenant));
        }
        assert_ne!(
            l.grouped_key("a", "b"),
            l.storage_key("a}:{b"),
            "never an ungrouped key"
        );
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
        let layout = Layout::new("rl");
        let l = layout.policy(&p, Some(&place));
        assert_eq!(l.storage_key("k"), "rl:g:g:{rl:g}:{k}");
        let g = l.global.clone().expect("a global layout");
        assert_eq!(g.keys.meta, "rl:g:g:{rl:g}:meta");
        assert_eq!(g.keys.active, "rl:g:g:{rl:g}:active");
        assert_eq!(g.keys.books, "rl:g:g:{rl:g}:books");
        assert_eq!(g.keys.fence, "rl:g:g:{rl:g}:fence");
        assert_eq!(g.keys.replid, "rl:g:g:{rl:g}:replid");
        // One slot for all of them, whatever the user key.
        for k in [
            &l.storage_key("a}{b"),
            &l.storage_key("x"),
            &g.keys.meta,
            &g.keys.fence,
        ] {
            assert_eq!(slot(k), slot(&g.keys.active), "{k}");
        }
        assert_eq!(layout.owner_of(&g.keys.fence), KeyOwner::Coordinator);
        assert_eq!(layout.owner_of(&g.keys.meta), KeyOwner::Policy("g"));
        assert_eq!(
            layout.owner_of(&l.storage_key("fence")),
            KeyOwner::Policy("g")
        );
        assert_eq!(g.shape.rho, 10.0);
        assert_eq!(g.shape.step_tolerance_us, 7);
        assert_eq!(
            g.shape.fallback_escrow, 2.5,
            "region 1 of weights 3:1, ρ 10"
        );
        assert_eq!(g.shape.keep_ms, GLOBAL_KEEP_MS);
    }
}
