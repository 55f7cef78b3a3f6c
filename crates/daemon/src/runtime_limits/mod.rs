//! Runtime limits: a key's own limit in a policy, set by an admin (a billing system) at
//! runtime instead of in a config file. The region's Redis holds them (`lua/runtime_limit.lua`:
//! one hash per policy, a version counter, the expiries, and the marks of entries that
//! went); every instance keeps a copy ([`RuntimeLimits`]) that every check reads, kept
//! true by the change messages on the invalidation channel and by a resync whenever the
//! version in Redis is not its own (`store::redis::runtime_sync`; on the embedded store
//! the copy is the store: [`RuntimeLimits::write_local`]). This module is data only: the
//! policies read it (`policy::Policies::for_key`), the store writes and keeps it.
//!
//! Precedence: a key's runtime limit replaces the limit and burst of what the config gives
//! it (an override's numbers, else the policy's); the window and everything else stay the
//! config's. Every decision says which (`limit_source`: `runtime`).
//!
//! The transition rule: a runtime entry's numbers came into force at its write (Redis's
//! clock), and when it goes (deleted or expired) the config's numbers come back into force
//! at that instant for that key, so a key's stored state is read as for any change of its
//! numbers (`quotad_core::algorithm::frame`): usage carries over, a newer number wins.

use std::collections::HashMap;

use compact_str::CompactString;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

/// A policy's keys with their own limit (or the mark of its end): keys inline up to 24
/// bytes and a seeded fast hash, since every check of such a key looks it up among all.
pub(crate) type Slots = HashMap<CompactString, Slot, foldhash::fast::RandomState>;

/// The prefix of a change message on the invalidation channel (no storage key starts
/// with `#`: prefixes are `[A-Za-z0-9_.-]`).
pub(crate) const MESSAGE_PREFIX: &str = "#L\t";

/// A key's own numbers, as Redis keeps them (`limit:burst:expires_ms:since_ms`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) limit: u64,
    /// 0: the limit (the window algorithms have no burst).
    pub(crate) burst: u64,
    /// When it ends, ms since the epoch by Redis's clock; 0: never.
    pub(crate) expires_ms: i64,
    /// When it came into force, ms since the epoch by Redis's clock.
    pub(crate) since_ms: i64,
}

impl Entry {
    /// The value as stored (`lua/runtime_limit.lua`): four numbers, and the region it was
    /// written in (absent without regions, and in values written before regions had it).
    pub(crate) fn parse(value: &str) -> Option<Entry> {
        let mut f = value.split(':');
        let entry = Entry {
            limit: f.next()?.parse().ok()?,
            burst: f.next()?.parse().ok()?,
            expires_ms: f.next()?.parse().ok()?,
            since_ms: f.next()?.parse().ok()?,
        };
        match (f.next(), f.next()) {
            (None, _) => Some(entry),
            (Some(origin), None) if valid_origin(origin) => Some(entry),
            _ => None,
        }
    }

    pub(crate) fn live_at(&self, now_ms: i64) -> bool {
        self.expires_ms == 0 || now_ms < self.expires_ms
    }
}

/// One change of a key's runtime limit, as a peer region pulls it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct PeerChange {
    pub(crate) key: String,
    /// The version of the set it was made at, in the region that sent it.
    pub(crate) version: u64,
    /// The stored value (`limit:burst:expires_ms:since_ms[:origin]`); absent: it went.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) value: Option<String>,
    /// When it went (ms), for a change that ended the key's limit.
    #[serde(default)]
    pub(crate) gone_ms: i64,
}

/// A region's name as a value carries it: what the config allows in one.
pub(crate) fn valid_origin(origin: &str) -> bool {
    !origin.is_empty()
        && origin.len() <= 64
        && origin
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// What a key of a policy has: its own numbers, or the mark of their end (since when the
/// config's numbers are back).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slot {
    Set(Entry),
    Gone { since_ms: i64 },
}

/// What became of a change applied to a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Applied {
    /// It was the next version: applied.
    Now,
    /// The copy has it already (its own write, or a resync read it).
    Already,
    /// A version between the copy's and this one is missing: the resync reads the set.
    Gap,
    /// A read of the whole set is in progress: applied on top of it when it ends.
    Later,
}

/// A change of a policy's runtime limits (`lua/runtime_limit.lua`).
#[derive(Debug, Clone, Copy)]
pub(crate) enum RuntimeWrite<'a> {
    /// `key`'s own limit (and burst: 0 for the limit's), until `expires_ms` (0: never),
    /// refused when the policy holds `max_keys` and `key` has none.
    Set {
        key: &'a str,
        limit: u64,
        burst: u64,
        expires_ms: i64,
        max_keys: u64,
        /// The key's storage key: its remembered denials and slices end.
        storage_key: &'a str,
    },
    /// `key`'s own limit goes.
    Delete { key: &'a str, storage_key: &'a str },
    /// A peer region's change of `key` (its stored value, or `None`: it went at
    /// `gone_ms`), taken if newer than this region's (`lua/runtime_limit.lua`, merge).
    Merge {
        key: &'a str,
        value: Option<&'a str>,
        gone_ms: i64,
        storage_key: &'a str,
    },
    /// The entries whose expiry has passed go.
    Purge,
}

impl RuntimeWrite<'_> {
    /// What the key is after this write, done at `at_ms` (a purge: nothing of one key).
    pub(crate) fn slot(&self, at_ms: i64) -> Option<Slot> {
        match *self {
            RuntimeWrite::Set {
                limit,
                burst,
                expires_ms,
                ..
            } => Some(Slot::Set(Entry {
                limit,
                burst,
                expires_ms,
                since_ms: at_ms,
            })),
            RuntimeWrite::Delete { .. } => Some(Slot::Gone { since_ms: at_ms }),
            RuntimeWrite::Merge { value: Some(v), .. } => Entry::parse(v).map(Slot::Set),
            RuntimeWrite::Merge {
                value: None,
                gone_ms,
                ..
            } => Some(Slot::Gone { since_ms: gone_ms }),
            RuntimeWrite::Purge => None,
        }
    }
}

/// What a [`RuntimeWrite`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RuntimeWritten {
    /// Done at `version`, on the set at version `before`, at `at_ms` by the store's clock
    /// (when the change came into force); `old`: the key's entry before; `purged`: entries
    /// a purge ended.
    Done {
        before: u64,
        version: u64,
        at_ms: i64,
        old: Option<Entry>,
        purged: u64,
    },
    /// The policy holds its maximum of keys with their own limit.
    Full,
    /// The expiry is not after Redis's now.
    ExpiryPassed,
    /// A delete of a key that has no entry.
    NotFound,
}

/// One policy's runtime limits on this instance.
#[derive(Debug, Default)]
pub(crate) struct PolicyLimits {
    /// The version of Redis's set this copy is at (0: never read).
    version: AtomicU64,
    slots: RwLock<Slots>,
    /// While the set is read again: the changes that arrive meanwhile, applied on top of
    /// what was read ([`PolicyLimits::begin_read`], [`PolicyLimits::replace`]), so a read
    /// during a stream of changes does not lose the ones it began before.
    arriving: std::sync::Mutex<Option<Vec<Change>>>,
}

/// A change as a message brings it: made on the set at version `before`, giving `version`.
#[derive(Debug, Clone)]
struct Change {
    before: u64,
    version: u64,
    key: String,
    slot: Slot,
}

impl PolicyLimits {
    pub(crate) fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// How many keys have their own numbers here (expired ones until they are purged).
    pub(crate) fn len(&self) -> usize {
        self.read()
            .values()
            .filter(|s| matches!(s, Slot::Set(_)))
            .count()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Slots> {
        self.slots.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Slots> {
        self.slots.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The whole set as read from Redis at `version`.
    pub(crate) fn replace(&self, version: u64, slots: Slots) -> Vec<i64> {
        let arrived = self.end_read();
        let mut held = self.write();
        *held = slots;
        // What arrived during the read, in order from the version read: the read may hold
        // some of it already (a change is the key's whole value: applying it again is the
        // same), and a gap leaves the copy at the version before it for the next read.
        let mut at = version;
        let mut applied = Vec::new();
        let mut changes = arrived;
        changes.sort_by_key(|c| c.version);
        for c in changes {
            if c.version <= at {
                continue;
            }
            if c.before != at {
                break;
            }
            if let Slot::Set(e) = c.slot {
                applied.push(e.since_ms);
            }
            held.insert(c.key.into(), c.slot);
            at = c.version;
        }
        self.version.store(at, Ordering::Release);
        applied
    }

    /// The changes that arrived during a read of the whole set, which ends.
    fn end_read(&self) -> Vec<Change> {
        self.arriving
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .unwrap_or_default()
    }

    /// A read of the whole set begins: the changes that arrive until [`Self::replace`] are
    /// kept to apply on top of it.
    pub(crate) fn begin_read(&self) {
        *self.arriving.lock().unwrap_or_else(|p| p.into_inner()) = Some(Vec::new());
    }

    /// A read of the whole set that failed: what arrived meanwhile applies to the copy as
    /// it is, as far as it follows from its version.
    pub(crate) fn abandon_read(&self) {
        for c in self.end_read() {
            self.apply(c.before, c.version, &c.key, c.slot);
        }
    }

    /// Change `version`, made on the set at version `before`: applied if this copy is at
    /// `before`; kept for the end of a read of the whole set in progress.
    pub(crate) fn apply(&self, before: u64, version: u64, key: &str, slot: Slot) -> Applied {
        if let Some(arriving) = self
            .arriving
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
        {
            arriving.push(Change {
                before,
                version,
                key: key.to_owned(),
                slot,
            });
            return Applied::Later;
        }
        let mut held = self.write();
        let at = self.version.load(Ordering::Acquire);
        if version <= at {
            return Applied::Already;
        }
        if at != before {
            return Applied::Gap;
        }
        held.insert(key.into(), slot);
        self.version.store(version, Ordering::Release);
        Applied::Now
    }

    pub(crate) fn get(&self, key: &str) -> Option<Slot> {
        self.read().get(key).copied()
    }

    /// The embedded store's page of entries: in key order from offset `cursor`; the next
    /// offset, 0 after the last.
    pub(crate) fn page(&self, cursor: u64, count: usize) -> (u64, Vec<(String, Entry)>) {
        let held = self.read();
        let mut all: Vec<(&CompactString, &Entry)> = held
            .iter()
            .filter_map(|(k, s)| match s {
                Slot::Set(e) => Some((k, e)),
                Slot::Gone { .. } => None,
            })
            .collect();
        all.sort_unstable_by(|a, b| a.0.cmp(b.0));
        let from = (cursor as usize).min(all.len());
        let to = from.saturating_add(count).min(all.len());
        let page = all[from..to]
            .iter()
            .map(|(k, e)| (k.to_string(), **e))
            .collect();
        let next = if to >= all.len() { 0 } else { to as u64 };
        (next, page)
    }
}

/// Every policy's runtime limits on this instance, by policy name. Shared by the request
/// path (reads), the invalidation follower (messages) and the resync.
#[derive(Debug, Default)]
pub(crate) struct RuntimeLimits {
    policies: RwLock<HashMap<String, Arc<PolicyLimits>>>,
    /// Set when a message showed a gap: the resync reads the set again without waiting
    /// for its next round.
    pub(crate) behind: tokio::sync::Notify,
    /// The first round of the resync is done (or there is nothing to read: the embedded
    /// store): until then an instance that just started may not know every key's limit.
    synced: std::sync::atomic::AtomicBool,
}

impl RuntimeLimits {
    /// The copy of an instance on the embedded store: nothing to read, in sync from the
    /// start.
    pub(crate) fn in_sync() -> RuntimeLimits {
        let r = RuntimeLimits::default();
        r.mark_synced();
        r
    }

    pub(crate) fn mark_synced(&self) {
        self.synced.store(true, Ordering::Release);
    }

    pub(crate) fn is_synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    /// A change on the embedded store, where this copy is the store: what
    /// `lua/runtime_limit.lua` does in Redis (`max_keys` counted among the entries that
    /// have not expired; no marks are dropped: the process holds them until it ends).
    pub(crate) fn write_local(&self, policy: &str, write: &RuntimeWrite<'_>) -> RuntimeWritten {
        let limits = self.of(policy);
        let now = now_ms();
        let mut held = limits.write();
        let version = limits.version.load(Ordering::Acquire) + 1;
        let old = |held: &Slots, key: &str| match held.get(key) {
            Some(Slot::Set(e)) if e.live_at(now) => Some(*e),
            _ => None,
        };
        let done = |old| RuntimeWritten::Done {
            before: version - 1,
            version,
            at_ms: now,
            old,
            purged: 0,
        };
        let out = match *write {
            RuntimeWrite::Set {
                key,
                limit,
                burst,
                expires_ms,
                max_keys,
                ..
            } => {
                let before = old(&held, key);
                let live = held
                    .values()
                    .filter(|s| matches!(s, Slot::Set(e) if e.live_at(now)))
                    .count() as u64;
                if expires_ms != 0 && expires_ms <= now {
                    return RuntimeWritten::ExpiryPassed;
                }
                if before.is_none() && live >= max_keys {
                    return RuntimeWritten::Full;
                }
                let entry = Entry {
                    limit,
                    burst,
                    expires_ms,
                    since_ms: now,
                };
                held.insert(key.into(), Slot::Set(entry));
                done(before)
            }
            RuntimeWrite::Delete { key, .. } => {
                let Some(before) = old(&held, key) else {
                    return RuntimeWritten::NotFound;
                };
                held.insert(key.into(), Slot::Gone { since_ms: now });
                done(Some(before))
            }
            // Peers' changes reach Redis only (the config refuses runtime limits of a
            // global policy on the embedded store).
            RuntimeWrite::Purge | RuntimeWrite::Merge { .. } => return done(None),
        };
        limits.version.store(version, Ordering::Release);
        out
    }

    /// The copy of `policy`'s limits (created empty, at version 0, on first use).
    pub(crate) fn of(&self, policy: &str) -> Arc<PolicyLimits> {
        if let Some(p) = self
            .policies
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(policy)
        {
            return p.clone();
        }
        self.policies
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .entry(policy.to_owned())
            .or_default()
            .clone()
    }

    fn existing(&self, policy: &str) -> Option<Arc<PolicyLimits>> {
        self.policies
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(policy)
            .cloned()
    }

    /// A change message from the channel (`lua/runtime_limit.lua`): applied, or the
    /// resync woken when it shows this copy behind. Returns when the change was made (ms,
    /// Redis's clock) when it was applied now, for the propagation delay.
    pub(crate) fn on_message(&self, payload: &str) -> Option<i64> {
        let rest = payload.strip_prefix(MESSAGE_PREFIX)?;
        let mut f = rest.splitn(5, '\t');
        let (policy, before, version) = (f.next()?, f.next()?, f.next()?);
        let (value, key) = (f.next()?, f.next()?);
        let before: u64 = before.parse().ok()?;
        let version: u64 = version.parse().ok()?;
        let slot = match value.strip_prefix('-') {
            Some(at) => Slot::Gone {
                since_ms: at.parse().ok()?,
            },
            None => Slot::Set(Entry::parse(value)?),
        };
        match self.of(policy).apply(before, version, key, slot) {
            Applied::Now => Some(match slot {
                Slot::Set(e) => e.since_ms,
                Slot::Gone { since_ms } => since_ms,
            }),
            Applied::Already | Applied::Later => None,
            Applied::Gap => {
                self.behind.notify_one();
                None
            }
        }
    }

    /// What `key` of `policy` has here: its own numbers, or the mark of their end.
    pub(crate) fn slot(&self, policy: &str, key: &str) -> Option<Slot> {
        self.existing(policy)?.get(key)
    }
}

/// This instance's clock, ms since the epoch.
pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(limit: u64) -> Slot {
        Slot::Set(Entry {
            limit,
            burst: 0,
            expires_ms: 0,
            since_ms: 1,
        })
    }

    /// Changes that arrive while the whole set is read apply on top of what was read, in
    /// order from its version; one after a gap waits for the next read.
    #[test]
    fn changes_during_a_read_are_not_lost_to_it() {
        let p = PolicyLimits::default();
        assert_eq!(p.apply(0, 1, "a", set(1)), Applied::Now);
        assert_eq!(p.apply(5, 6, "z", set(9)), Applied::Gap, "2..5 missed");
        p.begin_read();
        // Arriving while the read is in flight (it began at version 5).
        assert_eq!(p.apply(5, 6, "b", set(6)), Applied::Later);
        assert_eq!(p.apply(6, 7, "a", set(7)), Applied::Later);
        assert_eq!(p.apply(8, 9, "c", set(9)), Applied::Later);
        let read: Slots = [("a".into(), set(5)), ("old".into(), set(4))]
            .into_iter()
            .collect();
        let timed = p.replace(5, read);
        assert_eq!(timed.len(), 2, "6 and 7 applied; 9 waits (8 missing)");
        assert_eq!(p.version(), 7);
        assert_eq!(p.get("a"), Some(set(7)));
        assert_eq!(p.get("b"), Some(set(6)));
        assert_eq!(p.get("old"), Some(set(4)));
        assert_eq!(p.get("c"), None);
        // After the read, changes apply at once again.
        assert_eq!(p.apply(7, 8, "d", set(8)), Applied::Now);
    }

    #[test]
    fn a_message_is_parsed_or_ignored_whole() {
        let r = RuntimeLimits::default();
        assert_eq!(
            r.on_message("#L\tapi\t0\t1\t5:0:0:1700\tk\twith\ttabs"),
            Some(1700)
        );
        assert_eq!(
            r.slot("api", "k\twith\ttabs"),
            Some(set(5)).map(|_| Slot::Set(Entry {
                limit: 5,
                burst: 0,
                expires_ms: 0,
                since_ms: 1700
            }))
        );
        assert_eq!(
            r.on_message("#L\tapi\t1\t2\t-1800\tk\twith\ttabs"),
            Some(1800)
        );
        assert_eq!(
            r.slot("api", "k\twith\ttabs"),
            Some(Slot::Gone { since_ms: 1800 })
        );
        for bad in [
            "#L\tapi",
            "#L\tapi\tx\t3\t5:0:0:1\tk",
            "#L\tapi\t2\t3\t5:0\tk",
            "rl:api:fw:{k}",
        ] {
            assert_eq!(r.on_message(bad), None, "{bad}");
        }
        assert_eq!(r.of("api").version(), 2);
    }
}
