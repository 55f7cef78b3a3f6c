//! Runtime limits through the limiter: where a policy's runtime limits and a key's state
//! live (the layouts), admission, and the store's write, which every instance then applies
//! (`crate::runtime_limits`). This instance applies its own write at once, so the next
//! check here sees it without waiting for the channel.

use super::{Limiter, ResetError};
use crate::layout::RuntimeLimitKeys;
use crate::policy::Policy;
use crate::runtime_limits::PeerChange;
use crate::runtime_limits::{Entry, RuntimeLimits, RuntimeWrite, RuntimeWritten};

/// A key's own numbers to set.
#[derive(Debug, Clone, Copy)]
pub(crate) struct NewLimit {
    pub(crate) limit: u64,
    /// 0: the limit's.
    pub(crate) burst: u64,
    /// 0: never.
    pub(crate) expires_ms: i64,
}

impl Limiter {
    fn runtime_keys(&self, policy: &Policy) -> RuntimeLimitKeys {
        let keep_ms = self.layouts.of(policy).repair_ttl_ms;
        self.layouts
            .layout()
            .runtime_limit_keys(&policy.name, keep_ms, policy.global.is_some())
    }

    /// Sets `key`'s own limit in `policy` (which takes runtime limits: the caller checked).
    pub(crate) async fn set_runtime_limit(
        &self,
        runtime: &RuntimeLimits,
        policy: &Policy,
        key: &str,
        new: NewLimit,
    ) -> Result<RuntimeWritten, ResetError> {
        let storage_key = self.layouts.of(policy).storage_key(key);
        let write = RuntimeWrite::Set {
            key,
            limit: new.limit,
            burst: new.burst,
            expires_ms: new.expires_ms,
            max_keys: policy.runtime.map_or(0, |r| r.max_keys),
            storage_key: &storage_key,
        };
        self.change_runtime_limit(runtime, policy, key, &write)
            .await
    }

    /// Deletes `key`'s own limit in `policy`: its config numbers apply again.
    pub(crate) async fn delete_runtime_limit(
        &self,
        runtime: &RuntimeLimits,
        policy: &Policy,
        key: &str,
    ) -> Result<RuntimeWritten, ResetError> {
        let storage_key = self.layouts.of(policy).storage_key(key);
        let write = RuntimeWrite::Delete {
            key,
            storage_key: &storage_key,
        };
        self.change_runtime_limit(runtime, policy, key, &write)
            .await
    }

    /// `write` in the store; done, this instance's copy has it at once, with the store's
    /// instant of it as every other copy will (the channel brings it to the others, and
    /// here too, where it is then a version already applied).
    async fn change_runtime_limit(
        &self,
        runtime: &RuntimeLimits,
        policy: &Policy,
        key: &str,
        write: &RuntimeWrite<'_>,
    ) -> Result<RuntimeWritten, ResetError> {
        let keys = self.runtime_keys(policy);
        let permit = self.store.admit(1).await?;
        let written = self
            .store
            .runtime_write(&permit, runtime, &keys, write)
            .await?;
        if let RuntimeWritten::Done {
            before,
            version,
            at_ms,
            ..
        } = written
            && let Some(slot) = write.slot(at_ms)
        {
            runtime.of(&policy.name).apply(before, version, key, slot);
        }
        Ok(written)
    }

    /// A peer region's change of `key`'s own limit in `policy`, taken if it is newer than
    /// this region's (the last write wins): as a write here, every instance applies it.
    pub(crate) async fn merge_runtime_limit(
        &self,
        runtime: &RuntimeLimits,
        policy: &Policy,
        change: &PeerChange,
    ) -> Result<RuntimeWritten, ResetError> {
        let storage_key = self.layouts.of(policy).storage_key(&change.key);
        let write = RuntimeWrite::Merge {
            key: &change.key,
            value: change.value.as_deref(),
            gone_ms: change.gone_ms,
            storage_key: &storage_key,
        };
        self.change_runtime_limit(runtime, policy, &change.key, &write)
            .await
    }

    /// The changes of `policy`'s runtime limits after version `after` (at most `count`),
    /// and the set's version now: what a peer region pulls.
    pub(crate) async fn runtime_changes(
        &self,
        policy: &Policy,
        after: u64,
        count: usize,
    ) -> Result<(u64, Vec<PeerChange>), ResetError> {
        let keys = self.runtime_keys(policy);
        let permit = self.store.admit(1).await?;
        Ok(self
            .store
            .runtime_changes(&permit, &keys, after, count)
            .await?)
    }

    /// `key`'s own limit in `policy`, as the store has it.
    pub(crate) async fn runtime_limit(
        &self,
        runtime: &RuntimeLimits,
        policy: &Policy,
        key: &str,
    ) -> Result<Option<Entry>, ResetError> {
        let keys = self.runtime_keys(policy);
        let permit = self.store.admit(1).await?;
        Ok(self.store.runtime_get(&permit, runtime, &keys, key).await?)
    }

    /// A page of `policy`'s runtime limits from `cursor` (0: the first).
    pub(crate) async fn runtime_limits_page(
        &self,
        runtime: &RuntimeLimits,
        policy: &Policy,
        cursor: u64,
        count: usize,
    ) -> Result<(u64, Vec<(String, Entry)>), ResetError> {
        let keys = self.runtime_keys(policy);
        let permit = self.store.admit(1).await?;
        Ok(self
            .store
            .runtime_page(&permit, runtime, &keys, cursor, count)
            .await?)
    }
}
