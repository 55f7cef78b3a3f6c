//! Runtime limits in Redis (`lua/runtime_limit.lua`): the writes, and the reads of the
//! whole set (a resync) and of one key or one page (the admin API).

use super::RedisStore;
use crate::layout::RuntimeLimitKeys;
use crate::runtime_limits::{Entry, PeerChange, RuntimeWrite, RuntimeWritten, Slot, Slots};
use crate::store::call::StoreError;

/// Entries per HSCAN step of a resync or a page.
const SCAN_COUNT: usize = 1000;

impl RedisStore {
    /// A set, delete or purge of `keys`' policy (see `lua/runtime_limit.lua`).
    pub(crate) async fn runtime_write(
        &self,
        keys: &RuntimeLimitKeys,
        write: &RuntimeWrite<'_>,
    ) -> Result<RuntimeWritten, StoreError> {
        // ARGV[2..6] and the storage key, per operation (`lua/runtime_limit.lua`).
        let (op, key, a3, a4, a5, a6, storage): (&str, &str, String, i64, i64, u64, &str) =
            match *write {
                RuntimeWrite::Set {
                    key,
                    limit,
                    burst,
                    expires_ms,
                    max_keys,
                    storage_key,
                } => (
                    "set",
                    key,
                    limit.to_string(),
                    burst as i64,
                    expires_ms,
                    max_keys,
                    storage_key,
                ),
                RuntimeWrite::Delete { key, storage_key } => {
                    ("delete", key, "0".into(), 0, 0, 0, storage_key)
                }
                RuntimeWrite::Purge => ("purge", "", "0".into(), 0, 0, 0, ""),
                RuntimeWrite::Merge {
                    key,
                    value,
                    gone_ms,
                    storage_key,
                } => (
                    "merge",
                    key,
                    value.unwrap_or("").to_owned(),
                    gone_ms,
                    0,
                    0,
                    storage_key,
                ),
            };
        let mut inv = self.runtime_invocation(keys, op);
        inv.arg(key).arg(a3).arg(a4).arg(a5).arg(a6);
        self.push_runtime_tail(&mut inv, keys, storage);
        let inv = &inv;
        let (version, old, before, at_ms): (i64, redis::Value, Option<u64>, i64) = self
            .guarded(|mut conn| async move { inv.invoke_async(&mut conn).await })
            .await?;
        let old = match old {
            redis::Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
            redis::Value::Int(n) => n.to_string(),
            _ => String::new(),
        };
        Ok(match version {
            -1 => RuntimeWritten::ExpiryPassed,
            -2 => RuntimeWritten::Full,
            0 if op == "delete" || op == "merge" => RuntimeWritten::NotFound,
            v => RuntimeWritten::Done {
                before: before.unwrap_or(0),
                version: v as u64,
                at_ms,
                old: Entry::parse(&old),
                purged: if op == "purge" {
                    old.parse().unwrap_or(0)
                } else {
                    0
                },
            },
        })
    }

    /// The script's call for `op` on `keys`' policy: its five keys and ARGV[1].
    fn runtime_invocation(&self, keys: &RuntimeLimitKeys, op: &str) -> redis::ScriptInvocation<'_> {
        let mut inv = self.runtime_limit.prepare_invoke();
        inv.key(&keys.entries)
            .key(&keys.version)
            .key(&keys.expiries)
            .key(&keys.gone)
            .key(&keys.changes)
            .arg(op);
        inv
    }

    /// ARGV[7..11], which every operation takes: the channel, the policy, the storage key
    /// (or ''), how long marks are kept, and this region's name for a policy that spreads.
    fn push_runtime_tail(
        &self,
        inv: &mut redis::ScriptInvocation<'_>,
        keys: &RuntimeLimitKeys,
        storage: &str,
    ) {
        inv.arg(&self.channel)
            .arg(&keys.policy)
            .arg(storage)
            .arg(keys.keep_ms)
            .arg(&keys.origin);
    }

    /// The changes of `keys`' policy after version `after`, oldest first, at most
    /// `count`, and the set's version now (`lua/runtime_limit.lua`, changes): what a peer
    /// region pulls.
    pub(crate) async fn runtime_changes(
        &self,
        keys: &RuntimeLimitKeys,
        after: u64,
        count: usize,
    ) -> Result<(u64, Vec<PeerChange>), StoreError> {
        let mut inv = self.runtime_invocation(keys, "changes");
        inv.arg("").arg(after).arg(count).arg(0).arg(0);
        self.push_runtime_tail(&mut inv, keys, "");
        let inv = &inv;
        let reply: Vec<redis::Value> = self
            .guarded(|mut conn| async move { inv.invoke_async(&mut conn).await })
            .await?;
        parse_changes(&reply).ok_or_else(|| StoreError::Reply("runtime limit changes".into()))
    }

    /// The version of `keys`' policy's set in Redis (0: never written).
    pub(crate) async fn runtime_version(&self, keys: &RuntimeLimitKeys) -> Result<u64, StoreError> {
        let key = keys.version.as_str();
        let v: Option<u64> = self
            .guarded(
                |mut conn| async move { redis::cmd("GET").arg(key).query_async(&mut conn).await },
            )
            .await?;
        Ok(v.unwrap_or(0))
    }

    /// The whole set of `keys`' policy, and the version it is at: the version is read
    /// first, so a change during the read makes the copy's version lag Redis's, and the
    /// next round reads it again.
    pub(crate) async fn runtime_read_all(
        &self,
        keys: &RuntimeLimitKeys,
    ) -> Result<(u64, Slots), StoreError> {
        let version = self.runtime_version(keys).await?;
        let mut slots = Slots::default();
        let gone = keys.gone.as_str();
        let marks: Vec<(String, i64)> = self
            .guarded(|mut conn| async move {
                redis::cmd("ZRANGE")
                    .arg(gone)
                    .arg(0)
                    .arg(-1)
                    .arg("WITHSCORES")
                    .query_async(&mut conn)
                    .await
            })
            .await?;
        for (k, since_ms) in marks {
            slots.insert(k.into(), Slot::Gone { since_ms });
        }
        let mut cursor = 0;
        loop {
            let (next, page) = self.runtime_page(keys, cursor, SCAN_COUNT).await?;
            for (k, e) in page {
                slots.insert(k.into(), Slot::Set(e));
            }
            if next == 0 {
                return Ok((version, slots));
            }
            cursor = next;
        }
    }

    /// One HSCAN step of `keys`' policy's entries from `cursor` (0: the first): the next
    /// cursor (0: the last) and the entries (unparsable values skipped).
    pub(crate) async fn runtime_page(
        &self,
        keys: &RuntimeLimitKeys,
        cursor: u64,
        count: usize,
    ) -> Result<(u64, Vec<(String, Entry)>), StoreError> {
        let entries = keys.entries.as_str();
        let (next, flat): (u64, Vec<(String, String)>) = self
            .guarded(|mut conn| async move {
                redis::cmd("HSCAN")
                    .arg(entries)
                    .arg(cursor)
                    .arg("COUNT")
                    .arg(count)
                    .query_async(&mut conn)
                    .await
            })
            .await?;
        let page = flat
            .into_iter()
            .filter_map(|(k, v)| Entry::parse(&v).map(|e| (k, e)))
            .collect();
        Ok((next, page))
    }

    /// `key`'s entry in `keys`' policy, as Redis has it now.
    pub(crate) async fn runtime_get(
        &self,
        keys: &RuntimeLimitKeys,
        key: &str,
    ) -> Result<Option<Entry>, StoreError> {
        let entries = keys.entries.as_str();
        let value: Option<String> = self
            .guarded(|mut conn| async move {
                redis::cmd("HGET")
                    .arg(entries)
                    .arg(key)
                    .query_async(&mut conn)
                    .await
            })
            .await?;
        Ok(value.as_deref().and_then(Entry::parse))
    }
}

/// The `changes` reply: the version, then per key its name, version, value ('' : gone)
/// and when it went.
fn parse_changes(reply: &[redis::Value]) -> Option<(u64, Vec<PeerChange>)> {
    let text = |v: &redis::Value| match v {
        redis::Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        redis::Value::SimpleString(s) => Some(s.clone()),
        redis::Value::Int(n) => Some(n.to_string()),
        _ => None,
    };
    let (first, rest) = reply.split_first()?;
    let version: u64 = text(first)?.parse().ok()?;
    if rest.len() % 4 != 0 {
        return None;
    }
    let changes = rest
        .chunks(4)
        .map(|c| {
            let value = text(&c[2])?;
            Some(PeerChange {
                key: text(&c[0])?,
                // A score as Redis prints it (an integer, in full).
                version: text(&c[1])?.parse::<f64>().ok()? as u64,
                value: (!value.is_empty()).then_some(value),
                gone_ms: text(&c[3])?.parse().ok()?,
            })
        })
        .collect::<Option<Vec<_>>>()?;
    Some((version, changes))
}
