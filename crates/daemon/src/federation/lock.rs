//! The region's coordinator lock: several quotad instances may share a region's Redis (all
//! serve checks), and exactly one runs the coordinator. The holder's instance id is the
//! lock's value, with an expiry; on taking the lock the holder increments the fencing
//! counter, keeps the new value as its token, and raises every global policy's fence key
//! to it ([`Lock::raise`]) before it reads a single book. Every coordinator write checks
//! the token against its policy's fence key in the same script (`lua/global/`; the fence
//! shares the policy's hash slot, so this holds on a cluster too), so an instance that lost
//! the lock (paused past the expiry, cut off from Redis) cannot write to a policy once the
//! next holder has raised its fence, and whatever it wrote before is there for the next
//! holder to read. The token grows with every takeover and never goes back (it is also at
//! least Redis's clock in milliseconds, so a lost counter cannot make it repeat). Having
//! taken the lock, the holder also draws the region's next incarnation (the number its
//! peers see; [`super::incarnation`]), from its own wall clock rather than Redis's.

use std::time::Duration;

use redis::{ConnectionLike, RedisResult, Script};

use super::incarnation;
use crate::layout::Layout;

/// The region's lock: one coordinator per region writes the books, and every write carries
/// its fencing token.
pub struct Lock {
    key: String,
    fence_key: String,
    incarnation_key: String,
    id: String,
    ttl: Duration,
    /// `coordinator.max_skew` in ms: how far ahead of a message's timestamp peers accept
    /// its incarnation.
    max_skew_ms: u64,
    renew: Script,
    release: Script,
    next_token: Script,
    fenced_srem: Script,
    raise: Script,
    swap: Script,
}

/// What a takeover drew.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Takeover {
    /// The fencing token (every coordinator write checks it).
    pub token: u64,
    /// The region's incarnation for this life ([`super::incarnation::next`]).
    pub(crate) drawn: incarnation::Drawn,
}

impl Lock {
    /// The lock of the region whose keys `layout` names.
    pub fn new(layout: &Layout, id: String, ttl: Duration, max_skew: Duration) -> Self {
        Lock {
            key: layout.lock_key(),
            fence_key: layout.fence_key(),
            incarnation_key: layout.incarnation_key(),
            id,
            ttl,
            max_skew_ms: max_skew.as_millis() as u64,
            renew: Script::new(
                "if redis.call('GET', KEYS[1]) == ARGV[1] then \
                   return redis.call('PEXPIRE', KEYS[1], ARGV[2]) else return 0 end",
            ),
            release: Script::new(
                "if redis.call('GET', KEYS[1]) == ARGV[1] then \
                   return redis.call('DEL', KEYS[1]) else return 0 end",
            ),
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
            // Above the stored token and above Redis's clock in ms: the token must grow
            // even if the counter was lost (a failover before it replicated, a restart
            // without persistence).
            next_token: Script::new(
                "local t = redis.call('TIME') \
                 local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) \
                 local n = math.max((tonumber(redis.call('GET', KEYS[1])) or 0) + 1, now) \
                 redis.call('SET', KEYS[1], string.format('%d', n)) \
                 return n",
            ),
            // Compare and set: the incarnation is drawn from what was read, so a holder
            // deposed meanwhile (whose successor drew one already) writes nothing.
            swap: Script::new(
                "if (redis.call('GET', KEYS[1]) or '') == ARGV[1] then \
                   redis.call('SET', KEYS[1], ARGV[2]) return 1 else return 0 end",
            ),
        }
    }

    /// How long the lock lives without a renewal.
    pub(crate) fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Takes the lock if it is free, draws a fencing token and raises each of `fences` (the
    /// global policies' fence keys) to it, before the caller reads anything, then draws
    /// the region's incarnation at wall-clock `wall_ms`. `None` if the lock is held, or if
    /// a fence holds a newer token or another holder drew an incarnation meanwhile (then
    /// the lock is given back).
    pub fn try_acquire(
        &self,
        conn: &mut dyn ConnectionLike,
        fences: &[&str],
        wall_ms: u64,
    ) -> RedisResult<Option<Takeover>> {
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
        let Some(drawn) = self.draw_incarnation(conn, token, wall_ms)? else {
            tracing::info!("coordinator lock: another holder drew an incarnation meanwhile");
            self.release(conn)?;
            return Ok(None);
        };
        Ok(Some(Takeover { token, drawn }))
    }

    /// The region's next incarnation ([`incarnation::next`]) after the last one stored;
    /// without one (a region whose earlier versions used the token as the incarnation),
    /// after this takeover's token less one, which is at least every token handed out
    /// before. `None` if the stored value changed between the read and the write.
    fn draw_incarnation(
        &self,
        conn: &mut dyn ConnectionLike,
        token: u64,
        wall_ms: u64,
    ) -> RedisResult<Option<incarnation::Drawn>> {
        let stored: Option<String> = redis::cmd("GET").arg(&self.incarnation_key).query(conn)?;
        // A value that is not a number is no incarnation any peer accepted: start over.
        let last = match &stored {
            Some(s) => s.parse::<u64>().ok(),
            None => Some(token.saturating_sub(1)),
        };
        let drawn = incarnation::next(last, wall_ms, self.max_skew_ms);
        let swapped: i64 = self
            .swap
            .key(&self.incarnation_key)
            .arg(stored.as_deref().unwrap_or(""))
            .arg(drawn.incarnation)
            .invoke(conn)?;
        Ok((swapped == 1).then_some(drawn))
    }

    /// Extends the lock; false if another instance holds it now.
    pub(crate) fn renew(&self, conn: &mut dyn ConnectionLike) -> RedisResult<bool> {
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
    pub(crate) fn fenced_srem_to(
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

    pub(crate) fn fenced_srem_script(&self) -> &Script {
        &self.fenced_srem
    }

    /// Gives the lock up (a clean shutdown: the next instance need not wait the expiry).
    pub(crate) fn release(&self, conn: &mut dyn ConnectionLike) -> RedisResult<()> {
        let _: i64 = self.release.key(&self.key).arg(&self.id).invoke(conn)?;
        Ok(())
    }
}
