//! The region's coordinator lock: several quotad instances may share a region's Redis (all
//! serve checks), and exactly one runs the coordinator. The holder's instance id is the
//! lock's value, with an expiry; on taking the lock the holder increments the fencing
//! counter, keeps the new value as its token, and raises every global policy's fence key
//! to it ([`Lock::raise`]) before it reads a single book. Every coordinator write checks
//! the token against its policy's fence key in the same script (`lua/global/`; the fence
//! shares the policy's hash slot, so this holds on a cluster too), so an instance that lost
//! the lock (paused past the expiry, cut off from Redis) cannot write to a policy once the
//! next holder has raised its fence, and whatever it wrote before is there for the next
//! holder to read. The token doubles as the node's incarnation: it grows with every
//! takeover, as the lease protocol requires, and never goes back (it is also at least
//! Redis's clock in milliseconds, so a lost counter cannot make it repeat).

use std::time::Duration;

use redis::{ConnectionLike, RedisResult, Script};

use crate::store::layout::Layout;

pub struct Lock {
    key: String,
    fence_key: String,
    id: String,
    ttl: Duration,
    renew: Script,
    release: Script,
    next_token: Script,
    fenced_srem: Script,
    raise: Script,
}

impl Lock {
    /// The lock of the region whose keys `layout` names.
    pub fn new(layout: &Layout, id: String, ttl: Duration) -> Self {
        Lock {
            key: layout.lock_key(),
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
            // Never lowers a fence: a holder that finds a newer token is deposed.
            raise: Script::new(
                "local c = tonumber(redis.call('GET', KEYS[1])) or 0 \
                 if c > tonumber(ARGV[1]) then return 0 end \
                 redis.call('SET', KEYS[1], ARGV[1]) return 1",
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

    /// Takes the lock if it is free, draws a fencing token and raises each of `fences` (the
    /// global policies' fence keys) to it, before the caller reads anything; returns the
    /// token. `None` if the lock is held, or if a fence holds a newer token (then the lock
    /// is given back).
    pub fn try_acquire(
        &self,
        conn: &mut dyn ConnectionLike,
        fences: &[&str],
    ) -> RedisResult<Option<u64>> {
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
        for fence in fences {
            let raised: i64 = self.raise.key(*fence).arg(token).invoke(conn)?;
            if raised != 1 {
                tracing::info!("coordinator lock: a policy's fence holds a newer token");
                self.release(conn)?;
                return Ok(None);
            }
        }
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

    /// Adds to a pipeline: remove `member` from the set `set` if `token` is still the
    /// token in `fence` (a deposed coordinator must not prune what the new one just
    /// added). Run it with [`Lock::fenced_srem_script`] loaded.
    pub fn fenced_srem_to(
        &self,
        pipe: &mut redis::Pipeline,
        (fence, token): (&str, u64),
        set: &str,
        member: &str,
    ) {
        let mut inv = self.fenced_srem.prepare_invoke();
        inv.key(fence).key(set).arg(token).arg(member);
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
