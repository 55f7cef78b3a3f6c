//! Denials remembered until their retry time, so a client hammering a key that is over
//! its limit costs no Redis call (the limiter protects itself).
//!
//! Why it is exact: when a script denies a check of cost `c` with retry time `r`, it
//! wrote nothing (denials never write, `lua/`), so until someone writes that key its state
//! changes with time alone, and for every algorithm time only frees capacity
//! monotonically: a fixed window's count holds until the window ends, a sliding log's
//! entries leave one by one, a sliding window's weighted count falls, a token bucket
//! refills, GCRA's theoretical arrival time stays put while `now` advances. `r` is the
//! first instant a cost-`c` check fits again (the property test in
//! `algorithm::tests` checks, for every algorithm, that the model still denies at every
//! instant before it), and any cost `c' >= c` fits no earlier. Writes by others in
//! between either consume capacity (admissions: still denied) or give it back (refunds
//! and resets), and those invalidate the entry: locally at once, and in every other
//! instance through a Redis channel each instance subscribes to; while that subscription
//! is down (or silent: every instance publishes a heartbeat on it each second) nothing is
//! answered from memory, and it starts from an empty cache. A denial whose call was in
//! flight while any invalidation arrived is not remembered (it may predate it). Time: the
//! entry expires at the instant the call was *sent* plus `r`, shortened by the clock-rate
//! bound ([`RATE_MARGIN`]), so it never outlives the store's own retry time.
//!
//! Not cached: peeks whose answer would be "allowed", global policies (a loan arriving
//! raises a key's rate, so its retry time is not final), and anything from the embedded
//! store (in memory already). Bounded: at most `max_keys` entries (beyond, new denials
//! are simply not remembered); expired ones are swept with the embedded store's.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use quotad_core::algorithm::Verdict;

/// Bound on the rate error between quotad's monotonic clock and Redis's (the same bound
/// ε the coordinator assumes): an entry lives `r (1 - RATE_MARGIN)`.
pub const RATE_MARGIN: f64 = 1e-3;

const SHARDS: usize = 16;

#[derive(Debug, Clone, Copy)]
struct Entry {
    /// The smallest cost denied: checks of this cost or more are denied until `retry_at`.
    cost: u64,
    remaining: u64,
    retry_at: Instant,
    reset_at: Instant,
}

pub struct DenyCache {
    shards: Vec<Mutex<HashMap<String, Entry>>>,
    hasher: RandomState,
    max_per_shard: usize,
    /// The invalidation channel is subscribed: entries may be used.
    live: AtomicBool,
    /// Invalidations seen so far (and subscription changes): a denial is remembered only
    /// if none came while its call was in flight.
    epoch: AtomicU64,
}

impl DenyCache {
    pub fn new(max_keys: usize) -> Self {
        DenyCache {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            hasher: RandomState::new(),
            max_per_shard: max_keys.div_ceil(SHARDS),
            live: AtomicBool::new(false),
            epoch: AtomicU64::new(0),
        }
    }

    /// Read before a call is sent; hand it to [`DenyCache::remember`].
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    fn shard(&self, key: &str) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        let i = (self.hasher.hash_one(key) as usize) % SHARDS;
        self.shards[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The store's denial of a check of `cost` (a peek counts as 1) on `key`, if one is
    /// remembered and still in force at `now`.
    pub fn lookup(&self, key: &str, cost: u64, now: Instant) -> Option<Verdict> {
        if self.max_per_shard == 0 || !self.live.load(Ordering::Acquire) {
            return None;
        }
        let cost = cost.max(1);
        let e = *self.shard(key).get(key)?;
        if cost < e.cost || now >= e.retry_at {
            return None;
        }
        let us = |t: Instant| t.saturating_duration_since(now).as_micros() as i64;
        Some(Verdict {
            allowed: false,
            remaining: e.remaining,
            reset_after_us: us(e.reset_at),
            retry_after_us: us(e.retry_at).max(1),
        })
    }

    /// Remembers a denial the store gave for a call sent at `sent`, when the cache's
    /// epoch then was `epoch`.
    pub fn remember(&self, key: &str, cost: u64, v: &Verdict, sent: Instant, epoch: u64) {
        if self.max_per_shard == 0 || v.allowed || !self.live.load(Ordering::Acquire) {
            return;
        }
        let after = |us: i64| {
            let us = (us.max(0) as f64 * (1.0 - RATE_MARGIN)).floor() as u64;
            sent + Duration::from_micros(us)
        };
        let entry = Entry {
            cost: cost.max(1),
            remaining: v.remaining,
            retry_at: after(v.retry_after_us),
            reset_at: after(v.reset_after_us),
        };
        let mut shard = self.shard(key);
        // (Checked under the shard's lock: an invalidation of this key takes it too.)
        if self.epoch.load(Ordering::Acquire) != epoch {
            return;
        }
        // A key already there is replaced: its entry came from an earlier answer, and a
        // check reaches the store again only once that no longer covers it (expired, or a
        // smaller cost).
        if shard.contains_key(key) || shard.len() < self.max_per_shard {
            shard.insert(key.to_owned(), entry);
        }
    }

    /// Someone gave capacity back to `key` (a refund, a reset).
    pub fn invalidate(&self, key: &str) {
        let mut shard = self.shard(key);
        self.epoch.fetch_add(1, Ordering::AcqRel);
        shard.remove(key);
    }

    /// Whether entries may be used: only while invalidations from other instances arrive.
    /// Both turning on and off start from an empty cache.
    pub fn set_live(&self, live: bool) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
        self.live.store(live, Ordering::Release);
        for s in &self.shards {
            s.lock().unwrap_or_else(|p| p.into_inner()).clear();
        }
    }

    /// Drops expired entries; returns how many remain.
    pub fn sweep(&self, now: Instant) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let mut s = s.lock().unwrap_or_else(|p| p.into_inner());
                s.retain(|_, e| e.retry_at > now);
                s.len()
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn denial(remaining: u64, retry_us: i64, reset_us: i64) -> Verdict {
        Verdict {
            allowed: false,
            remaining,
            reset_after_us: reset_us,
            retry_after_us: retry_us,
        }
    }

    #[test]
    fn a_denial_answers_equal_or_larger_costs_until_just_before_its_retry_time() {
        let c = DenyCache::new(100);
        c.set_live(true);
        let t0 = Instant::now();
        c.remember("k", 3, &denial(2, 1_000_000, 5_000_000), t0, c.epoch());
        let v = c.lookup("k", 3, t0 + Duration::from_millis(400)).unwrap();
        assert!(!v.allowed && v.remaining == 2);
        assert!((599_000..=600_000).contains(&v.retry_after_us), "{v:?}");
        assert!(
            c.lookup("k", 10, t0).is_some(),
            "a larger cost is denied too"
        );
        assert!(
            c.lookup("k", 2, t0).is_none(),
            "a smaller one may fit: ask the store"
        );
        // Expires a tenth of a percent early, never late.
        assert!(
            c.lookup("k", 3, t0 + Duration::from_micros(998_999))
                .is_some()
        );
        assert!(
            c.lookup("k", 3, t0 + Duration::from_micros(999_000))
                .is_none()
        );
        c.invalidate("k");
        assert!(c.lookup("k", 3, t0).is_none());
    }

    #[test]
    fn a_denial_in_flight_while_an_invalidation_arrived_is_not_remembered() {
        let c = DenyCache::new(100);
        c.set_live(true);
        let t0 = Instant::now();
        let sent = c.epoch();
        c.invalidate("other-or-same"); // a refund or reset lands while our call is out
        c.remember("k", 1, &denial(0, 1_000_000, 1_000_000), t0, sent);
        assert!(c.lookup("k", 1, t0).is_none());
        c.remember("k", 1, &denial(0, 1_000_000, 1_000_000), t0, c.epoch());
        assert!(c.lookup("k", 1, t0).is_some());
    }

    #[test]
    fn nothing_is_used_while_invalidations_cannot_arrive_and_the_bound_holds() {
        let c = DenyCache::new(SHARDS); // one per shard
        let t0 = Instant::now();
        c.remember("k", 1, &denial(0, 1_000_000, 1_000_000), t0, c.epoch());
        assert!(
            c.lookup("k", 1, t0).is_none(),
            "not live: not even remembered"
        );
        c.set_live(true);
        for i in 0..1000 {
            c.remember(
                &format!("k{i}"),
                1,
                &denial(0, 1_000_000, 1_000_000),
                t0,
                c.epoch(),
            );
        }
        assert!(c.sweep(t0) <= SHARDS);
        c.set_live(false);
        assert_eq!(c.sweep(t0), 0, "going down empties the cache");
        assert_eq!(c.sweep(t0 + Duration::from_secs(2)), 0);
    }
}
