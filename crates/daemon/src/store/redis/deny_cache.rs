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
//! An entry answers only the question it was the answer to: the same key, decided
//! under the same algorithm and numbers (a reload that changes a policy's limit, window
//! or burst, or gives the key an override, asks another question, so the store is asked
//! again), and the same cost. The answer is then the store's own: `remaining` does not
//! change while the key stays denied for that cost (a cost-1 denial leaves 0 whole units
//! for every algorithm), and the retry and reset times are instants, reported as what is
//! left of them now. A denial of a cost above 1 is remembered only for a fixed window
//! with nothing left: elsewhere `remaining` grows with time while the key stays denied,
//! and a window's that is not 0 falls when a smaller cost is admitted (here or on
//! another instance, which announces nothing): a remembered one would report the past.
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

use quotad_core::algorithm::{Algorithm, Limits, Verdict};

/// Bound on the rate error between quotad's monotonic clock and Redis's (the same bound
/// ε the coordinator assumes): an entry lives `r (1 - RATE_MARGIN)`.
pub(crate) const RATE_MARGIN: f64 = 1e-3;

const SHARDS: usize = 16;

/// What a check asks the store: its storage key, the rules it is decided under, and its
/// cost (a peek counts as 1).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Question<'a> {
    pub(crate) key: &'a str,
    pub(crate) algorithm: Algorithm,
    pub(crate) limits: Limits,
    pub(crate) cost: u64,
}

impl Question<'_> {
    fn cost(&self) -> u64 {
        self.cost.max(1)
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    /// The question this denial answered: only the same one gets it.
    algorithm: Algorithm,
    limits: Limits,
    cost: u64,
    remaining: u64,
    retry_at: Instant,
    reset_at: Instant,
}

pub(crate) struct DenyCache {
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
    pub(crate) fn new(max_keys: usize) -> Self {
        DenyCache {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            hasher: RandomState::new(),
            max_per_shard: max_keys.div_ceil(SHARDS),
            live: AtomicBool::new(false),
            epoch: AtomicU64::new(0),
        }
    }

    /// Read before a call is sent; hand it to [`DenyCache::remember`].
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    fn shard(&self, key: &str) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        let i = (self.hasher.hash_one(key) as usize) % SHARDS;
        self.shards[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The store's denial of `q`, if one is remembered and still in force at `now`.
    pub(crate) fn lookup(&self, q: &Question<'_>, now: Instant) -> Option<Verdict> {
        if self.max_per_shard == 0 || !self.live.load(Ordering::Acquire) {
            return None;
        }
        let e = *self.shard(q.key).get(q.key)?;
        let same = e.cost == q.cost() && e.algorithm == q.algorithm && e.limits == q.limits;
        if !same || now >= e.retry_at {
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

    /// Remembers the store's denial `v` of `q`, for a call sent at `sent`, when the
    /// cache's epoch then was `epoch`.
    pub(crate) fn remember(&self, q: &Question<'_>, v: &Verdict, sent: Instant, epoch: u64) {
        if self.max_per_shard == 0 || v.allowed || !self.live.load(Ordering::Acquire) {
            return;
        }
        // Above cost 1, only a fixed window's denial with nothing left holds whole while
        // the key is denied: time moves the others' `remaining`, and a smaller cost
        // admitted (here or elsewhere, unannounced) lowers a window's that is not 0.
        if q.cost() > 1 && (q.algorithm != Algorithm::FixedWindow || v.remaining > 0) {
            return;
        }
        let after = |us: i64| {
            let us = (us.max(0) as f64 * (1.0 - RATE_MARGIN)).floor() as u64;
            sent + Duration::from_micros(us)
        };
        let entry = Entry {
            algorithm: q.algorithm,
            limits: q.limits,
            cost: q.cost(),
            remaining: v.remaining,
            retry_at: after(v.retry_after_us),
            reset_at: after(v.reset_after_us),
        };
        let key = q.key;
        let mut shard = self.shard(key);
        // (Checked under the shard's lock: an invalidation of this key takes it too.)
        if self.epoch.load(Ordering::Acquire) != epoch {
            return;
        }
        // A key already there is replaced: its entry came from an earlier answer, and a
        // check reaches the store again only once that no longer covers it.
        if shard.contains_key(key) || shard.len() < self.max_per_shard {
            shard.insert(key.to_owned(), entry);
        }
    }

    /// Someone gave capacity back to `key` (a refund, a reset).
    pub(crate) fn invalidate(&self, key: &str) {
        let mut shard = self.shard(key);
        self.epoch.fetch_add(1, Ordering::AcqRel);
        shard.remove(key);
    }

    /// Whether entries may be used: only while invalidations from other instances arrive.
    /// Both turning on and off start from an empty cache.
    pub(crate) fn set_live(&self, live: bool) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
        self.live.store(live, Ordering::Release);
        for s in &self.shards {
            s.lock().unwrap_or_else(|p| p.into_inner()).clear();
        }
    }

    /// Drops expired entries; returns how many remain.
    pub(crate) fn sweep(&self, now: Instant) -> usize {
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

    const LIMITS: Limits = Limits {
        limit: 5,
        window_us: 1_000_000,
        burst: 5,
        since: quotad_core::algorithm::Since::ZERO,
    };

    fn q(key: &str, algorithm: Algorithm, cost: u64) -> Question<'_> {
        Question {
            key,
            algorithm,
            limits: LIMITS,
            cost,
        }
    }

    #[test]
    fn a_denial_answers_the_same_question_until_just_before_its_retry_time() {
        let c = DenyCache::new(100);
        c.set_live(true);
        let t0 = Instant::now();
        let fw = |cost| q("k", Algorithm::FixedWindow, cost);
        c.remember(&fw(3), &denial(0, 1_000_000, 5_000_000), t0, c.epoch());
        let v = c.lookup(&fw(3), t0 + Duration::from_millis(400)).unwrap();
        assert!(!v.allowed && v.remaining == 0);
        assert!((599_000..=600_000).contains(&v.retry_after_us), "{v:?}");
        assert!(
            c.lookup(&fw(10), t0).is_none(),
            "another cost: ask the store"
        );
        assert!(c.lookup(&fw(2), t0).is_none());
        // Expires a tenth of a percent early, never late.
        let at = |us| t0 + Duration::from_micros(us);
        assert!(c.lookup(&fw(3), at(998_999)).is_some());
        assert!(c.lookup(&fw(3), at(999_000)).is_none());
        c.invalidate("k");
        assert!(c.lookup(&fw(3), t0).is_none());
    }

    #[test]
    fn other_rules_for_the_key_are_another_question() {
        let c = DenyCache::new(100);
        c.set_live(true);
        let t0 = Instant::now();
        c.remember(
            &q("k", Algorithm::SlidingLog, 1),
            &denial(0, 1_000_000, 1_000_000),
            t0,
            c.epoch(),
        );
        assert!(c.lookup(&q("k", Algorithm::SlidingLog, 1), t0).is_some());
        let raised = Question {
            limits: Limits { limit: 6, ..LIMITS },
            ..q("k", Algorithm::SlidingLog, 1)
        };
        assert!(c.lookup(&raised, t0).is_none(), "a reload raised the limit");
        assert!(c.lookup(&q("k", Algorithm::Gcra, 1), t0).is_none());
    }

    #[test]
    fn a_costly_denial_is_remembered_only_where_remaining_holds() {
        let c = DenyCache::new(100);
        c.set_live(true);
        let t0 = Instant::now();
        let tb = q("k", Algorithm::TokenBucket, 3);
        c.remember(&tb, &denial(2, 1_000_000, 1_000_000), t0, c.epoch());
        assert!(
            c.lookup(&tb, t0).is_none(),
            "a bucket refills: remaining grows"
        );
        let fw = q("k", Algorithm::FixedWindow, 3);
        c.remember(&fw, &denial(2, 1_000_000, 1_000_000), t0, c.epoch());
        assert!(
            c.lookup(&fw, t0).is_none(),
            "a smaller cost admitted takes a window's 2 left"
        );
        c.remember(&fw, &denial(0, 1_000_000, 1_000_000), t0, c.epoch());
        assert!(c.lookup(&fw, t0).is_some(), "a full window stays full");
    }

    #[test]
    fn a_denial_in_flight_while_an_invalidation_arrived_is_not_remembered() {
        let c = DenyCache::new(100);
        c.set_live(true);
        let t0 = Instant::now();
        let k = q("k", Algorithm::FixedWindow, 1);
        let sent = c.epoch();
        c.invalidate("other-or-same"); // a refund or reset lands while our call is out
        c.remember(&k, &denial(0, 1_000_000, 1_000_000), t0, sent);
        assert!(c.lookup(&k, t0).is_none());
        c.remember(&k, &denial(0, 1_000_000, 1_000_000), t0, c.epoch());
        assert!(c.lookup(&k, t0).is_some());
    }

    #[test]
    fn nothing_is_used_while_invalidations_cannot_arrive_and_the_bound_holds() {
        let c = DenyCache::new(SHARDS); // one per shard
        let t0 = Instant::now();
        let k = q("k", Algorithm::FixedWindow, 1);
        c.remember(&k, &denial(0, 1_000_000, 1_000_000), t0, c.epoch());
        assert!(c.lookup(&k, t0).is_none(), "not live: not even remembered");
        c.set_live(true);
        for i in 0..1000 {
            let key = format!("k{i}");
            let k = q(&key, Algorithm::FixedWindow, 1);
            c.remember(&k, &denial(0, 1_000_000, 1_000_000), t0, c.epoch());
        }
        assert!(c.sweep(t0) <= SHARDS);
        c.set_live(false);
        assert_eq!(c.sweep(t0), 0, "going down empties the cache");
        assert_eq!(c.sweep(t0 + Duration::from_secs(2)), 0);
    }
}
