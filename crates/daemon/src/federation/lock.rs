//! The region's coordinator lock: several quotad instances may share a region's Redis (all
//! serve checks), and exactly one runs the coordinator. The holder's instance id is the
//! lock's value, with an expiry; on taking the lock the holder increments the fencing
//! counter and keeps the new value as its token. Every coordinator write checks the token
//! (`lua/global/`), so an instance that lost the lock (paused past the expiry, cut off from
//! Redis) cannot write after the next holder has raised the counter, which it does before
//! it reads a single book. The token doubles as the node's incarnation: it grows with every
//! takeover, as the lease protocol requires, and never goes back (it is also at least
//! Redis's clock in milliseconds, so a lost counter cannot make it repeat).

use std::time::Duration;

use redis::{ConnectionLike, RedisResult, Script};

use crate::store::layout::Layout;

pub struct Lock {
    key: String,
    replid_key: String,
    fence_key: String,
    id: String,
    ttl: Duration,
    renew: Script,
    release: Script,
    next_token: Script,
    fenced_srem: Script,
}

impl Lock {
    /// The lock of the region whose keys `layout` names.
    pub fn new(layout: &Layout, id: String, ttl: Duration) -> Self {
        Lock {
            key: layout.lock_key(),
            replid_key: layout.replid_key(),
            fence_key: layout.fence_key(),
            id,
            ttl,
            renew: Script::new(
                "if redis.call('GET', KEYS[1]) == ARGV[1] then \
                   return redis.call('PEXPIRE', KEYS[1], ARGV[2]) else return 0 end",
            ),
            release: Script::new(
                "if redis.call('GET', KEYS[1]) == ARGV[1] then \
                   return redis.call('DEL', KEYS[1]) else return 0 end",
            ),
            // Above the stored token and above Redis's clock in ms: the token is the
            // region's incarnation, and must grow even if the counter was lost (a
            // failover before it replicated, a restart without persistence).
            fenced_srem: Script::new(
                "if redis.call('GET', KEYS[1]) == ARGV[1] then \
                   return redis.call('SREM', KEYS[2], ARGV[2]) else return 0 end",
            ),
            next_token: Script::new(
                "local t = redis.call('TIME') \
                 local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) \
                 local n = math.max((tonumber(redis.call('GET', KEYS[1])) or 0) + 1, now) \
                 redis.call('SET', KEYS[1], string.format('%d', n)) \
                 return n",
            ),
        }
    }

    /// How long the lock lives without a renewal.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    pub fn fence_key(&self) -> &str {
        &self.fence_key
    }

    /// The replication ID the books were last written under, next to the lock.
    pub fn replid_key(&self) -> &str {
        &self.replid_key
    }

    /// Takes the lock if it is free; returns the fencing token.
    pub fn try_acquire(&self, conn: &mut dyn ConnectionLike) -> RedisResult<Option<u64>> {
        let set: Option<String> = redis::cmd("SET")
            .arg(&self.key)
            .arg(&self.id)
            .arg("NX")
            .arg("PX")
            .arg(self.ttl.as_millis() as u64)
            .query(conn)?;
        if set.is_none() {
            return Ok(None);
        }
        let token: u64 = self.next_token.key(&self.fence_key).invoke(conn)?;
        Ok(Some(token))
    }

    /// Extends the lock; false if another instance holds it now.
    pub fn renew(&self, conn: &mut dyn ConnectionLike) -> RedisResult<bool> {
        let n: i64 = self
            .renew
            .key(&self.key)
            .arg(&self.id)
            .arg(self.ttl.as_millis() as u64)
            .invoke(conn)?;
        Ok(n == 1)
    }

    /// Removes `member` from the set `set` if `token` is still the current fencing token
    /// (a deposed coordinator must not prune what the new one just added).
    pub fn fenced_srem(
        &self,
        conn: &mut dyn ConnectionLike,
        token: u64,
        set: &str,
        member: &str,
    ) -> RedisResult<()> {
        let _: i64 = self
            .fenced_srem
            .key(&self.fence_key)
            .key(set)
            .arg(token)
            .arg(member)
            .invoke(conn)?;
        Ok(())
    }

    /// Adds [`Lock::fenced_srem`] to a pipeline (run it with [`Lock::fenced_srem_script`]
    /// loaded).
    pub fn fenced_srem_to(&self, pipe: &mut redis::Pipeline, token: u64, set: &str, member: &str) {
        let mut inv = self.fenced_srem.prepare_invoke();
        inv.key(&self.fence_key).key(set).arg(token).arg(member);
        pipe.invoke_script(&inv).ignore();
    }

    pub fn fenced_srem_script(&self) -> &Script {
        &self.fenced_srem
    }

    /// Gives the lock up (a clean shutdown: the next instance need not wait the expiry).
    pub fn release(&self, conn: &mut dyn ConnectionLike) -> RedisResult<()> {
        let _: i64 = self.release.key(&self.key).arg(&self.id).invoke(conn)?;
        Ok(())
    }
}
