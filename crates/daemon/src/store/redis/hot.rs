//! Hot-key slices: a key checked faster than its policy's `hot_key_rate` on this instance
//! takes units of its quota from Redis in one atomic call (`lua/slice.lua`,
//! `lua/bucket_slice.lua`) and admits from them in memory, without a round trip; what it
//! does not spend it gives back.
//!
//! Why it is exact, for a fixed window (`lua/slice.lua`): every unit admitted here was
//! taken in Redis, in the key's current window, before it was spent (the take counts it
//! as admitted there, so no other instance can be granted it), and it is spent only
//! before that window ends by this instance's clock (the end is timed from when the take
//! was *sent*, shortened by the clock-rate margin, so it is never later than Redis's).
//! The sum admitted by all instances in a window is therefore at most the units Redis
//! granted in it, which is at most the limit.
//!
//! For a token bucket or GCRA key (`lua/bucket_slice.lua`): a slice is tokens taken out of
//! the bucket, recorded with the key and living
//! [`BUCKET_SLICE_LIFE`](crate::layout::BUCKET_SLICE_LIFE) by Redis's clock; while it lives
//! the bucket refills only up to its burst less the units of live slices (every check's
//! script honours that). Tokens in Redis plus units held never pass the burst, and fall by
//! exactly what is admitted wherever it is: the bucket's envelope holds as if each unit had
//! been taken when it was spent. A slice is spent only before its end (timed as a window's)
//! and given back in its last [`COOL`]. Sliding windows and logs do not take part: they
//! weigh each admission by when it happened, which a slice taken earlier does not know.
//!
//! Sizing: a take asks for the units of every check of the key waiting on this instance
//! (all concurrent misses share one take: one Redis call decides a whole burst). A taker
//! alone (no check queued behind it) of a key hot for an [`EPOCH`] already (a steady
//! flow, not a burst) also asks for a prefetch of [`HORIZON`] of this instance's rate
//! of the key, which the script grants only while half the window's limit is left and
//! at most an eighth of what is left, so the last units of a window go out as they are
//! asked for, to whichever instance asks.
//! What an instance holds unspent (at most one prefetch) is given back when the key
//! cools (no check for [`COOL`]), on shutdown, when a reload changes the key's limits,
//! and when the invalidation channel goes quiet; at the window's end it lapses with the
//! window, and a bucket's slice goes back before its end. Until then another instance
//! may be denied units this one holds: the under-admission that docs/benchmarks.md
//! measures.
//!
//! Where it meets other features: a reset or a refund (here or on any instance, through
//! the invalidation channel) ends the key's slice and sends its units back, and the
//! scripts give back only to the ledger or live slice they came from (nothing after a
//! reset, in a new window or after the slice's end); a take in flight meanwhile keeps
//! no slice; slices are used only while the invalidation channel is live, like the deny
//! cache; a reload that changes the key's limits (or gives it an override) gives the
//! old slice back at the key's next take, which takes one under the new limits (none,
//! when they leave nothing: a limit lowered below what was spent). Bounded: at most [`MAX_HOT_KEYS`] keys are hot at
//! once (beyond, a key is decided in Redis as any other, counted).

use std::collections::HashMap;
use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use quotad_core::algorithm::{Algorithm, Limits, Verdict};

use crate::store::redis::deny_cache::RATE_MARGIN;

/// Keys hot at once on one instance, at most.
pub(crate) const MAX_HOT_KEYS: usize = 10_000;
/// A hot key's prefetch: this long of the instance's rate of it.
pub(crate) const HORIZON: Duration = Duration::from_millis(50);
/// A hot key without a check for this long cools: its slice is given back.
pub(crate) const COOL: Duration = Duration::from_millis(200);
/// The rate counters' period: a key is hot once it is checked `hot_key_rate` times
/// within one.
pub(crate) const EPOCH: Duration = Duration::from_secs(1);

/// The script that takes and returns an algorithm's slices, if the algorithm can take
/// part (see the module's notes for why sliding windows and logs cannot).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Taker {
    /// `lua/slice.lua`.
    Window,
    /// `lua/bucket_slice.lua`; `gcra` tells which bucket.
    Bucket { gcra: bool },
}

impl Taker {
    pub(crate) fn of(algorithm: Algorithm) -> Option<Taker> {
        match algorithm {
            Algorithm::FixedWindow => Some(Taker::Window),
            Algorithm::TokenBucket => Some(Taker::Bucket { gcra: false }),
            Algorithm::Gcra => Some(Taker::Bucket { gcra: true }),
            Algorithm::SlidingLog | Algorithm::SlidingWindow => None,
        }
    }
}

/// What [`HotKeys::note`] found a key to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Heat {
    /// Decided in Redis as any key.
    Cold,
    /// Answered from slices.
    Hot,
    /// Hot, but [`MAX_HOT_KEYS`] are hot already: decided in Redis (counted).
    Refused,
}

/// What a take asks Redis for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Want {
    /// The taker's own check: nothing is granted unless this much is left.
    pub(crate) need: u64,
    /// Units of every check of the key waiting on this instance (the taker's included).
    pub(crate) demand: u64,
    /// Units beyond the demand, granted only while the key is far from its limit.
    pub(crate) prefetch: u64,
    /// A bucket's slice of this instance that the take ends, with its unspent units: one
    /// call ends the spent slice and takes the next, so a hot bucket has at most one
    /// live slice per instance and no spent one keeps lowering its capacity.
    pub(crate) ends: Option<(i64, u64)>,
}

/// Where a slice's units came from: what giving them back names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mark {
    /// A fixed window's slot and the slices' ledger in it (`lua/slice.lua`); the slice
    /// ends with the window.
    Window { slot: i64, ledger: i64 },
    /// A token bucket's or GCRA key's slice (`lua/bucket_slice.lua`), `gcra` telling which;
    /// it lives [`BUCKET_SLICE_LIFE`](crate::layout::BUCKET_SLICE_LIFE) and goes back
    /// before it ends.
    Bucket { id: i64, gcra: bool },
}

/// What Redis granted (`lua/slice.lua`, `lua/bucket_slice.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Grant {
    pub(crate) granted: u64,
    /// Units left (in the window, or tokens in the bucket) after the grant.
    pub(crate) left: u64,
    /// The verdict's reset time: the window's end, or until the bucket is full.
    pub(crate) reset_after_us: i64,
    /// When nothing was granted: until the taker's check could pass.
    pub(crate) retry_after_us: i64,
    /// Until the slice ends (Redis's clock).
    pub(crate) ends_after_us: i64,
    /// Where the units came from; None: no slice (nothing beyond the taker's check).
    pub(crate) mark: Option<Mark>,
}

/// Unspent units to give back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Return {
    pub(crate) key: String,
    pub(crate) mark: Mark,
    /// The limits the slice was taken under (a bucket's return refills under them).
    pub(crate) limits: Limits,
    pub(crate) units: u64,
}

#[derive(Debug, Clone, Copy)]
struct Slice {
    limits: Limits,
    mark: Mark,
    units: u64,
    /// Units left when the slice was taken (the `remaining` reported).
    left: u64,
    /// When the slice ends, by this instance's clock (never after Redis's end).
    ends: Instant,
    /// The verdicts' reset time, by this instance's clock.
    resets: Instant,
}

impl Slice {
    /// Whether to give the slice back now rather than let it lapse: a bucket's slice in
    /// the last [`COOL`] of its life (a window's units lapse with their window).
    fn ends_soon(&self, now: Instant) -> bool {
        matches!(self.mark, Mark::Bucket { .. })
            && self.units > 0
            && self.ends.saturating_duration_since(now) < COOL
    }
}

/// A hot key's state, behind one lock: the slice, and what cooling and the prefetch need.
struct State {
    slice: Option<Slice>,
    /// The last check.
    used: Instant,
    /// Units asked for (from slices, or through a take) since `counted_from`: the key's
    /// rate here, for the prefetch.
    spent: u64,
    counted_from: Instant,
    /// Units admitted from what takes granted, since the last tend (the metric).
    admitted: u64,
}

struct Entry {
    state: Mutex<State>,
    /// One take at a time per key: the checks that miss meanwhile wait for it.
    taking: tokio::sync::Mutex<()>,
    /// Units of the checks waiting for a take.
    waiting: AtomicU64,
    /// When the key turned hot: it prefetches only once it has stayed hot a while.
    since: Instant,
}

impl Entry {
    fn new(now: Instant) -> Self {
        Entry {
            state: Mutex::new(State {
                slice: None,
                used: now,
                spent: 0,
                counted_from: now,
                admitted: 0,
            }),
            taking: tokio::sync::Mutex::new(()),
            waiting: AtomicU64::new(0),
            since: now,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A count-min sketch of checks per key, halved every epoch: 4 rows of atomic counters, no
/// lock and no allocation per check; an estimate is never below the true count.
struct Rates {
    rows: [Vec<AtomicU32>; 4],
    hasher: RandomState,
}

const COLUMNS: usize = 1 << 14;

impl Rates {
    fn new() -> Self {
        let row = || (0..COLUMNS).map(|_| AtomicU32::new(0)).collect();
        Rates {
            rows: [row(), row(), row(), row()],
            hasher: RandomState::new(),
        }
    }

    /// Counts one check of `key`; returns the estimate of its count this epoch.
    fn count(&self, key: &str) -> u64 {
        let h = self.hasher.hash_one(key);
        (0..4)
            .map(|i| {
                let column = ((h >> (i * 16)) as usize) & (COLUMNS - 1);
                u64::from(self.rows[i][column].fetch_add(1, Ordering::Relaxed)) + 1
            })
            .min()
            .unwrap_or(0)
    }

    /// Halves every counter: a key's count is then between one and two epochs of its
    /// rate, and a key that stops being checked fades within a few.
    fn decay(&self) {
        for row in &self.rows {
            for c in row {
                c.store(c.load(Ordering::Relaxed) / 2, Ordering::Relaxed);
            }
        }
    }
}

/// What the table saw, for the metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tally {
    /// Keys hot now.
    pub(crate) keys: usize,
    /// Units admitted from takes' grants since the last tend.
    pub(crate) admitted: u64,
}

pub(crate) struct HotKeys {
    shards: Vec<Mutex<HashMap<String, Arc<Entry>>>>,
    hasher: RandomState,
    /// Allocated at the first check of a policy with `hot_key_rate` (256 KiB): a daemon
    /// without one never holds it.
    rates: std::sync::OnceLock<Rates>,
    /// Keys in the table (all shards).
    len: AtomicUsize,
    /// The invalidation channel is subscribed: slices may be used.
    live: AtomicBool,
    /// Slices replaced or dropped, to give back.
    returns: Mutex<Vec<Return>>,
    /// Invalidations and subscription changes so far: a take in flight while one came
    /// does not become a slice.
    invalidations: AtomicU64,
    /// How long a key stays hot before it prefetches ([`EPOCH`]).
    steady: Duration,
}

const SHARDS: usize = 16;

impl Default for HotKeys {
    fn default() -> Self {
        Self::new()
    }
}

impl HotKeys {
    pub(crate) fn new() -> Self {
        HotKeys {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            hasher: RandomState::new(),
            rates: std::sync::OnceLock::new(),
            len: AtomicUsize::new(0),
            live: AtomicBool::new(false),
            returns: Mutex::new(Vec::new()),
            invalidations: AtomicU64::new(0),
            steady: EPOCH,
        }
    }

    /// A table whose keys prefetch once hot for `steady` (tests: at once).
    #[cfg(test)]
    fn with_steady(steady: Duration) -> Self {
        HotKeys {
            steady,
            ..Self::new()
        }
    }

    fn shard(&self, key: &str) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Entry>>> {
        let i = (self.hasher.hash_one(key) as usize) % SHARDS;
        self.shards[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    fn entry(&self, key: &str) -> Option<Arc<Entry>> {
        self.shard(key).get(key).cloned()
    }

    /// Counts a check of `key` and says whether the key is hot: it has a slice entry
    /// already, or it was checked at least `rate` times lately (it then gets one, unless
    /// [`MAX_HOT_KEYS`] are hot).
    pub(crate) fn note(&self, key: &str, rate: u64, now: Instant) -> Heat {
        if !self.live.load(Ordering::Acquire) {
            return Heat::Cold;
        }
        let seen = self.rates.get_or_init(Rates::new).count(key);
        let mut shard = self.shard(key);
        if let Some(e) = shard.get(key) {
            e.state().used = now;
            return Heat::Hot;
        }
        if seen < rate {
            return Heat::Cold;
        }
        if self.len.load(Ordering::Relaxed) >= MAX_HOT_KEYS {
            return Heat::Refused;
        }
        shard.insert(key.to_owned(), Arc::new(Entry::new(now)));
        self.len.fetch_add(1, Ordering::Relaxed);
        Heat::Hot
    }

    /// Admits `cost` units of `key` under `limits` from its slice, if it holds them and
    /// its window has not ended: the verdict, with `remaining` what was left in the window
    /// at the last take less what this slice has spent since.
    #[cfg(test)]
    pub(crate) fn spend(
        &self,
        key: &str,
        limits: Limits,
        cost: u64,
        now: Instant,
    ) -> Option<Verdict> {
        self.spend_from(key, limits, cost, now).map(|(v, _)| v)
    }

    /// [`HotKeys::spend`], with the slice the units came from (what
    /// [`HotKeys::unspend`] names).
    pub(crate) fn spend_from(
        &self,
        key: &str,
        limits: Limits,
        cost: u64,
        now: Instant,
    ) -> Option<(Verdict, Mark)> {
        if !self.live.load(Ordering::Acquire) {
            return None;
        }
        // Under the shard's lock: no reference count to share between threads per check.
        let shard = self.shard(key);
        let mut state = shard.get(key)?.state();
        state.used = now;
        let v = spend(&mut state.slice, limits, cost, now)?;
        let mark = state.slice.as_ref()?.mark;
        state.spent += cost;
        state.admitted += cost;
        Some((v, mark))
    }

    /// Gives `cost` units spent from `key`'s slice `mark` back to it (a denied batch
    /// refunds its other checks), if that slice is still the key's and live. False: the
    /// slice is gone (its unspent units went back to Redis, or lapsed; another may have
    /// taken its place, which holds none of these), and the refund is Redis's to make.
    pub(crate) fn unspend(&self, key: &str, mark: Mark, cost: u64, now: Instant) -> bool {
        {
            let shard = self.shard(key);
            if let Some(entry) = shard.get(key) {
                let mut state = entry.state();
                if let Some(s) = state
                    .slice
                    .as_mut()
                    .filter(|s| s.mark == mark && now < s.ends)
                {
                    s.units += cost;
                    state.admitted = state.admitted.saturating_sub(cost);
                    return true;
                }
            }
        }
        // Ended here but not given back yet (the next tend sends it): the units go back
        // with it.
        let mut returns = self.returns.lock().unwrap_or_else(|p| p.into_inner());
        match returns.iter_mut().find(|r| r.key == key && r.mark == mark) {
            Some(r) => {
                r.units += cost;
                true
            }
            None => false,
        }
    }

    /// Decides a check of a hot key that [`HotKeys::spend`] could not: waits for the
    /// key's take in flight, if any, and spends from what it brought; else takes, through
    /// `take`, the units of every check waiting plus the prefetch, and spends its own.
    /// A denial is Redis's: fewer than `cost` units were left in the window. With the
    /// verdict, the slice its units were spent from (None: from what the take was granted
    /// for this check, which Redis holds as spent): what a refund of them names.
    pub(crate) async fn decide<F, Fut, E>(
        &self,
        key: &str,
        limits: Limits,
        cost: u64,
        take: F,
    ) -> Result<(Verdict, Option<Mark>), E>
    where
        F: FnOnce(Want) -> Fut,
        Fut: Future<Output = Result<Grant, E>>,
    {
        let Some(entry) = self.entry(key) else {
            // Cooled meanwhile: a take of its own, nothing kept.
            return take(Want {
                need: cost,
                demand: cost,
                prefetch: 0,
                ends: None,
            })
            .await
            .map(|g| (grant_verdict(&g, cost), None));
        };
        entry.state().spent += cost;
        entry.waiting.fetch_add(cost, Ordering::AcqRel);
        let turn = entry.taking.lock().await;
        {
            let mut st = entry.state();
            if let Some(v) = spend(&mut st.slice, limits, cost, Instant::now()) {
                let mark = st.slice.as_ref().map(|s| s.mark);
                st.admitted += cost;
                drop(st);
                entry.waiting.fetch_sub(cost, Ordering::AcqRel);
                return Ok((v, mark));
            }
        }
        let demand = entry.waiting.load(Ordering::Acquire).max(cost);
        let ends = self.retire_before_take(key, &entry, limits);
        let sent = Instant::now();
        let prefetch = self.prefetch(&entry, demand, cost, limits, sent);
        let seen_invalidations = self.invalidations.load(Ordering::Acquire);
        let result = take(Want {
            need: cost,
            demand,
            prefetch,
            ends,
        })
        .await;
        entry.waiting.fetch_sub(cost, Ordering::AcqRel);
        let grant = result?;
        let verdict = grant_verdict(&grant, cost);
        if verdict.allowed {
            entry.state().admitted += cost;
        }
        if let (true, Some(mark), true) = (verdict.allowed, grant.mark, grant.granted > cost) {
            let slice = Slice {
                limits,
                mark,
                units: grant.granted - cost,
                left: grant.left,
                ends: sent + window_left(grant.ends_after_us),
                resets: sent + window_left(grant.reset_after_us),
            };
            self.keep(key, &entry, slice, seen_invalidations);
        }
        drop(turn);
        Ok((verdict, None))
    }

    /// Before a take of `key` under `limits`: a slice taken under other limits (a reload
    /// since) is spent no more and goes back now, not when the key cools (a lowered limit
    /// may grant no slice to replace it); a bucket's slice under these limits ends with
    /// this take (spent, or too small for this check), out of the table first so nothing
    /// spends it once the take is sent: its id and units, for the take to end.
    fn retire_before_take(&self, key: &str, entry: &Entry, limits: Limits) -> Option<(i64, u64)> {
        let stale = entry.state().slice.take_if(|s| s.limits != limits);
        if let Some(old) = stale.filter(|o| o.units > 0 && o.ends > Instant::now()) {
            self.give_back(returned(key, &old));
        }
        entry
            .state()
            .slice
            .take_if(|s| s.limits == limits && matches!(s.mark, Mark::Bucket { .. }))
            .and_then(|s| match s.mark {
                Mark::Bucket { id, .. } => Some((id, s.units)),
                Mark::Window { .. } => None,
            })
    }

    /// The units a take sent at `sent` asks for beyond the `demand` waiting. Checks queued
    /// behind this one are the demand a burst brings, and a burst may end with them: units
    /// beyond it would wait, unspent, while other instances are denied. Only a taker
    /// alone, on a key hot for a while (a steady flow), prefetches.
    fn prefetch(
        &self,
        entry: &Entry,
        demand: u64,
        cost: u64,
        limits: Limits,
        sent: Instant,
    ) -> u64 {
        let mut st = entry.state();
        let rate = st.spent as f64 / sent.duration_since(st.counted_from).as_secs_f64().max(1e-3);
        st.spent = 0;
        st.counted_from = sent;
        let steady = sent.duration_since(entry.since) >= self.steady;
        if demand == cost && steady {
            ((rate * HORIZON.as_secs_f64()) as u64).min(limits.limit)
        } else {
            0
        }
    }

    /// Keeps what a take granted beyond its check as `key`'s slice, unless an
    /// invalidation came while the take was in flight (it may predate a reset) or the key
    /// cooled meanwhile: then the units go back rather than into a slice. Units of a slice
    /// this one replaces (under other limits: a reload) go back too, unless it ended (an
    /// earlier window's lapse with it).
    fn keep(&self, key: &str, entry: &Arc<Entry>, slice: Slice, seen_invalidations: u64) {
        let current = self.entry(key).is_some_and(|e| Arc::ptr_eq(&e, entry));
        if current && self.invalidations.load(Ordering::Acquire) == seen_invalidations {
            let old = entry.state().slice.replace(slice);
            let now = Instant::now();
            if let Some(old) = old.filter(|o| o.units > 0 && o.ends > now) {
                self.give_back(returned(key, &old));
            }
        } else {
            self.give_back(returned(key, &slice));
        }
    }

    fn give_back(&self, r: Return) {
        self.returns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(r);
    }

    /// Someone gave capacity back to `key` (a refund or a reset, here or on another
    /// instance; the invalidation does not say which): its slice stops being spent and
    /// its units go back at the next [`HotKeys::tend`]. After a reset the script finds
    /// another ledger (or none) and gives nothing back. Returns whether it ended a slice
    /// (one spent to its last unit too; a take in flight gives its units back when it
    /// lands instead).
    pub(crate) fn forget(&self, key: &str) -> bool {
        self.invalidations.fetch_add(1, Ordering::AcqRel);
        let Some(e) = self.entry(key) else {
            return false;
        };
        let Some(s) = e.state().slice.take() else {
            return false;
        };
        if s.units > 0 {
            self.give_back(returned(key, &s));
        }
        true
    }

    /// Whether slices may be used: only while invalidations from other instances arrive
    /// (a reset elsewhere must reach this instance's slices). Going quiet gives every
    /// slice back at the next [`HotKeys::tend`].
    pub(crate) fn set_live(&self, live: bool) {
        self.invalidations.fetch_add(1, Ordering::AcqRel);
        self.live.store(live, Ordering::Release);
    }

    /// The periodic pass: keys without a check for [`COOL`] (every key, when the channel
    /// is not live, or `all`: shutdown) leave the table, and the unspent units of their
    /// slices, with those of replaced slices and of buckets' slices near their end, are
    /// returned to be given back; slices whose window has ended simply lapse.
    pub(crate) fn tend(&self, now: Instant, all: bool) -> (Vec<Return>, Tally) {
        let mut back = std::mem::take(&mut *self.returns.lock().unwrap_or_else(|p| p.into_inner()));
        let every = all || !self.live.load(Ordering::Acquire);
        let (mut keys, mut admitted) = (0, 0);
        for shard in &self.shards {
            let mut shard = shard.lock().unwrap_or_else(|p| p.into_inner());
            shard.retain(|key, e| {
                let mut st = e.state();
                admitted += std::mem::take(&mut st.admitted);
                let cooled = every || now.saturating_duration_since(st.used) >= COOL;
                // A take in flight keeps its entry: its checks are waiting on it.
                if !cooled || e.waiting.load(Ordering::Acquire) > 0 {
                    if let Some(s) = st.slice.take_if(|s| s.ends_soon(now)) {
                        back.push(returned(key, &s));
                    }
                    return true;
                }
                if let Some(s) = st.slice.take().filter(|s| s.units > 0 && s.ends > now) {
                    back.push(returned(key, &s));
                }
                false
            });
            keys += shard.len();
        }
        self.len.store(keys, Ordering::Relaxed);
        (back, Tally { keys, admitted })
    }

    /// Starts a new rate epoch (every [`EPOCH`]).
    pub(crate) fn new_epoch(&self) {
        if let Some(rates) = self.rates.get() {
            rates.decay();
        }
    }
}

/// What to give back of `s`.
fn returned(key: &str, s: &Slice) -> Return {
    Return {
        key: key.to_owned(),
        mark: s.mark,
        limits: s.limits,
        units: s.units,
    }
}

/// How long until a moment `after_us` after the take was sent by Redis's clock (a
/// window's or a slice's end), by this instance's clock: shortened by the clock-rate
/// margin, so never after Redis's.
fn window_left(after_us: i64) -> Duration {
    let us = after_us.max(0) as f64 * (1.0 - RATE_MARGIN);
    Duration::from_micros(us as u64)
}

fn spend(slice: &mut Option<Slice>, limits: Limits, cost: u64, now: Instant) -> Option<Verdict> {
    let s = slice.as_mut()?;
    if s.limits != limits || now >= s.ends || s.units < cost {
        return None;
    }
    s.units -= cost;
    let reset_after_us = s.resets.saturating_duration_since(now).as_micros() as i64;
    Some(Verdict {
        allowed: true,
        remaining: s.left + s.units,
        reset_after_us,
        retry_after_us: 0,
    })
}

/// The verdict of the taker's own check from a grant: allowed when the grant covers it
/// (it then holds `cost` of the units), else Redis's denial of it.
fn grant_verdict(g: &Grant, cost: u64) -> Verdict {
    if g.granted >= cost && cost > 0 {
        Verdict {
            allowed: true,
            remaining: g.left + (g.granted - cost),
            reset_after_us: g.reset_after_us,
            retry_after_us: 0,
        }
    } else {
        Verdict {
            allowed: false,
            remaining: g.left,
            reset_after_us: g.reset_after_us,
            retry_after_us: g.retry_after_us.max(1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use std::cell::RefCell;
    use std::collections::BTreeMap;

    /// `lua/slice.lua` and a fixed window's check, in Rust, on a clock of real time since
    /// `base`: the model Redis of the property test.
    struct Model {
        base: Instant,
        window_us: i64,
        limit: u64,
        /// (slot, n, hs, h, ledger) of the one key; None after a reset.
        state: Option<(i64, u64, i64, u64, i64)>,
        next_ledger: i64,
    }

    impl Model {
        fn now_us(&self) -> i64 {
            self.base.elapsed().as_micros() as i64
        }

        fn slot_at(&self, t: Instant) -> i64 {
            t.saturating_duration_since(self.base).as_micros() as i64 / self.window_us
        }

        fn take(&mut self, want: Want) -> Grant {
            let now = self.now_us();
            let slot = now / self.window_us;
            let (count, mut held, mut ledger) = match self.state {
                Some((w, n, hs, h, l)) if w == slot => (
                    n,
                    if hs == slot { h } else { 0 },
                    if hs == slot { l } else { 0 },
                ),
                _ => (0, 0, 0),
            };
            if ledger == 0 {
                held = 0;
                self.next_ledger += 1;
                ledger = self.next_ledger;
            }
            let reset_after_us = (slot + 1) * self.window_us - now;
            let left = self.limit.saturating_sub(count);
            if left < want.need {
                return window_grant(0, left, reset_after_us, slot, ledger);
            }
            let extra = if left * 2 >= self.limit {
                want.prefetch.min(left / 8)
            } else {
                0
            };
            let granted = (want.demand + extra).min(left);
            self.state = Some((slot, count + granted, slot, held + granted, ledger));
            window_grant(granted, left - granted, reset_after_us, slot, ledger)
        }

        fn give_back(&mut self, r: &Return) {
            let Mark::Window { slot, ledger } = r.mark else {
                panic!("a window's slice gives back to its window: {r:?}");
            };
            if let Some((w, n, hs, h, l)) = self.state {
                if w == slot && hs == slot && l == ledger {
                    let back = r.units.min(h).min(n);
                    self.state = Some((w, n - back, hs, h - back, l));
                }
            }
        }
    }

    /// A fixed window's grant, as `lua/slice.lua` answers.
    fn window_grant(granted: u64, left: u64, reset_after_us: i64, slot: i64, ledger: i64) -> Grant {
        Grant {
            granted,
            left,
            reset_after_us,
            retry_after_us: reset_after_us,
            ends_after_us: reset_after_us,
            mark: Some(Mark::Window { slot, ledger }),
        }
    }

    const LIMITS: Limits = Limits {
        limit: 40,
        window_us: 4_000,
        burst: 40,
        since: quotad_core::algorithm::Since::ZERO,
    };

    /// Three instances, one key at 40 per 4 ms window, 30,000 random steps (checks of
    /// cost 1 to 3 answered from a slice or by a take, tends, cool-downs, resets, shutdowns):
    /// no window ever admits more than its limit, and every admission happens inside the
    /// window its units were taken in.
    #[tokio::test(flavor = "current_thread")]
    async fn slices_never_admit_more_than_the_window_holds() {
        for seed in 0..4u64 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let model = RefCell::new(Model {
                base: Instant::now(),
                window_us: LIMITS.window_us,
                limit: LIMITS.limit,
                state: None,
                next_ledger: 0,
            });
            let hot: Vec<HotKeys> = (0..3)
                .map(|_| HotKeys::with_steady(Duration::ZERO))
                .collect();
            for h in &hot {
                h.set_live(true);
            }
            // Admitted units per window slot, and per reset epoch within it.
            let mut admitted: BTreeMap<(u32, i64), u64> = BTreeMap::new();
            let mut resets = 0u32;
            let mut local = 0u64;
            for _ in 0..30_000 {
                let i = rng.random_range(0..hot.len());
                let h = &hot[i];
                match rng.random_range(0..100) {
                    0..=84 => {
                        let cost = rng.random_range(1..=3);
                        let Some((allowed, slot, in_memory)) = check_on(h, &model, cost).await
                        else {
                            continue;
                        };
                        local += u64::from(in_memory);
                        if allowed {
                            *admitted.entry((resets, slot)).or_default() += cost;
                        }
                    }
                    85..=94 => {
                        let all = rng.random_range(0..10) == 0;
                        let (back, _) = h.tend(Instant::now(), all);
                        for r in &back {
                            model.borrow_mut().give_back(r);
                        }
                    }
                    95..=97 => h.new_epoch(),
                    _ => {
                        // A reset: the key's state goes, every instance hears of it.
                        model.borrow_mut().state = None;
                        resets += 1;
                        for h in &hot {
                            h.forget("k");
                        }
                    }
                }
            }
            let worst = admitted.values().max().copied().unwrap_or(0);
            assert!(
                worst <= LIMITS.limit,
                "seed {seed}: a window admitted {worst} > {}",
                LIMITS.limit
            );
            assert!(
                local > 1000,
                "seed {seed}: slices answered only {local} checks"
            );
            assert!(
                admitted.len() > 20,
                "seed {seed}: only {} windows",
                admitted.len()
            );
        }
    }

    /// One check of `cost` units of `k` on `h`, its takes from `model`: whether it was
    /// allowed, the window its units fall in, and whether the slice answered it in memory
    /// (`None`: the key is not hot on `h`). The window is the clock's when it was asked (a
    /// slice is spent only before its window ends), or the take's window when it took.
    async fn check_on(h: &HotKeys, model: &RefCell<Model>, cost: u64) -> Option<(bool, i64, bool)> {
        if h.note("k", 5, Instant::now()) != Heat::Hot {
            return None;
        }
        let t = Instant::now();
        let slot = model.borrow().slot_at(t);
        if let Some(v) = h.spend("k", LIMITS, cost, t) {
            return Some((v.allowed, slot, true));
        }
        let took = std::cell::Cell::new(None);
        let (v, _) = h
            .decide("k", LIMITS, cost, |want| {
                let grant = model.borrow_mut().take(want);
                took.set(match grant.mark {
                    Some(Mark::Window { slot, .. }) => Some(slot),
                    _ => None,
                });
                async move { Ok::<_, ()>(grant) }
            })
            .await
            .unwrap();
        Some((v.allowed, took.get().unwrap_or(slot), false))
    }

    /// A live table in which key `k` of 100 a minute is hot, and prefetches at once.
    fn hot_window_key() -> (HotKeys, Limits) {
        let h = HotKeys::with_steady(Duration::ZERO);
        h.set_live(true);
        assert_eq!(h.note("k", 1, Instant::now()), Heat::Hot);
        let limits = Limits {
            limit: 100,
            window_us: 60_000_000,
            burst: 100,
            since: quotad_core::algorithm::Since::ZERO,
        };
        (h, limits)
    }

    /// A take in flight when an invalidation arrives may predate a reset: its own check
    /// stands (as any check sent before the reset), its other units do not become a
    /// slice: they go back (the script refuses them if the ledger is gone).
    #[tokio::test(flavor = "current_thread")]
    async fn a_take_in_flight_during_an_invalidation_keeps_no_slice() {
        let (h, limits) = hot_window_key();
        let (v, _) = h
            .decide("k", limits, 1, |_| {
                h.forget("k");
                async { Ok::<_, ()>(window_grant(6, 94, 30_000_000, 1, 9)) }
            })
            .await
            .unwrap();
        assert!(v.allowed);
        assert!(h.spend("k", limits, 1, Instant::now()).is_none());
        let (back, _) = h.tend(Instant::now(), false);
        assert_eq!(
            back,
            vec![Return {
                key: "k".into(),
                mark: Mark::Window { slot: 1, ledger: 9 },
                limits,
                units: 5
            }]
        );
    }

    /// An invalidation ends a key's slice and says so, also when the slice was spent to
    /// its last unit (nothing goes back for it); with no slice it ends nothing.
    #[tokio::test(flavor = "current_thread")]
    async fn an_invalidation_ends_a_spent_slice_too() {
        assert!(
            !HotKeys::with_steady(Duration::ZERO).forget("k"),
            "no slice yet"
        );
        let (h, limits) = hot_window_key();
        let (v, _) = h
            .decide("k", limits, 1, |_| async {
                Ok::<_, ()>(window_grant(3, 97, 30_000_000, 1, 9))
            })
            .await
            .unwrap();
        assert!(v.allowed);
        // The two units left in the slice, spent.
        for _ in 0..2 {
            assert!(h.spend("k", limits, 1, Instant::now()).is_some());
        }
        assert!(h.forget("k"), "the spent slice is ended");
        assert!(h.spend("k", limits, 1, Instant::now()).is_none());
        let (back, _) = h.tend(Instant::now(), false);
        assert_eq!(back, Vec::new(), "nothing to give back");
        assert!(!h.forget("k"), "ended already");
    }

    /// A bucket's slice in the last [`COOL`] of its life goes back while its key stays hot
    /// (a window's lapses with its window: nothing to give it back to).
    #[tokio::test(flavor = "current_thread")]
    async fn a_buckets_slice_goes_back_before_its_end_and_a_windows_lapses() {
        let limits = Limits {
            limit: 1_000,
            window_us: 1_000_000,
            burst: 1_000,
            since: quotad_core::algorithm::Since::ZERO,
        };
        for (mark, back) in [
            (Mark::Bucket { id: 7, gcra: false }, true),
            (Mark::Window { slot: 1, ledger: 1 }, false),
        ] {
            let h = HotKeys::with_steady(Duration::ZERO);
            h.set_live(true);
            assert_eq!(h.note("k", 1, Instant::now()), Heat::Hot);
            let grant = Grant {
                granted: 6,
                left: 900,
                reset_after_us: 100_000,
                retry_after_us: 0,
                ends_after_us: 150_000,
                mark: Some(mark),
            };
            let (v, _) = h
                .decide("k", limits, 1, |_| async move { Ok::<_, ()>(grant) })
                .await
                .unwrap();
            assert!(v.allowed);
            let (returned, _) = h.tend(Instant::now(), false);
            let want = if back {
                vec![Return {
                    key: "k".into(),
                    mark,
                    limits,
                    units: 5,
                }]
            } else {
                vec![]
            };
            assert_eq!(returned, want, "{mark:?}");
            // The key is still hot; a slice given back is not spent.
            assert_eq!(h.spend("k", limits, 1, Instant::now()).is_some(), !back);
        }
    }

    /// A table whose key `k` is hot, with a slice of 5 units under [`LIMITS`] (window
    /// slot 1, ledger 9), and that slice's mark.
    async fn holding_five() -> (HotKeys, Mark) {
        let h = HotKeys::with_steady(Duration::ZERO);
        h.set_live(true);
        assert_eq!(h.note("k", 1, Instant::now()), Heat::Hot);
        let grant = window_grant(6, 900, 30_000_000, 1, 9);
        let (v, _) = h
            .decide("k", LIMITS, 1, |_| async move { Ok::<_, ()>(grant) })
            .await
            .unwrap();
        assert!(v.allowed);
        (h, Mark::Window { slot: 1, ledger: 9 })
    }

    /// What giving back `units` of `k`'s slice `mark` under [`LIMITS`] sends.
    fn back_of(mark: Mark, units: u64) -> Vec<Return> {
        vec![Return {
            key: "k".into(),
            mark,
            limits: LIMITS,
            units,
        }]
    }

    /// A slice taken under other limits (a reload since) goes back at the key's next take
    /// under the new ones, though that take grants nothing (a limit lowered below what was
    /// spent): it is not held until the key cools.
    #[tokio::test(flavor = "current_thread")]
    async fn a_slice_under_old_limits_goes_back_at_the_next_take_under_new_ones() {
        let (h, mark) = holding_five().await;
        let lowered = Limits {
            limit: 2,
            burst: 2,
            ..LIMITS
        };
        let denied = Grant {
            granted: 0,
            mark: None,
            ..window_grant(0, 0, 30_000_000, 1, 9)
        };
        let (v, from) = h
            .decide("k", lowered, 1, |_| async move { Ok::<_, ()>(denied) })
            .await
            .unwrap();
        assert!(!v.allowed && from.is_none());
        assert_eq!(h.tend(Instant::now(), false).0, back_of(mark, 5));
    }

    /// Units spent from a slice and refunded go back into it while it is the key's, or
    /// with it while it waits to be given back; once it has gone, the refund is Redis's.
    #[tokio::test(flavor = "current_thread")]
    async fn a_refund_of_what_a_slice_spent_goes_back_to_that_slice() {
        let (h, mark) = holding_five().await;
        let (_, from) = h.spend_from("k", LIMITS, 2, Instant::now()).unwrap();
        assert_eq!(from, mark);
        assert!(h.unspend("k", mark, 2, Instant::now()));
        // Not a slice of this key: the store's to refund.
        let other = Mark::Window { slot: 1, ledger: 8 };
        assert!(!h.unspend("k", other, 1, Instant::now()));
        // Ended (a reset elsewhere) but not yet given back: the units go back with it.
        h.spend_from("k", LIMITS, 1, Instant::now()).unwrap();
        assert!(h.forget("k"));
        assert!(h.unspend("k", mark, 1, Instant::now()));
        assert_eq!(h.tend(Instant::now(), false).0, back_of(mark, 5));
        // Given back: gone.
        assert!(!h.unspend("k", mark, 1, Instant::now()));
    }

    /// A check waiting behind a take is served by it: one take for a queue of checks.
    #[tokio::test(flavor = "current_thread")]
    async fn a_take_carries_the_demand_queued_behind_it() {
        let h = HotKeys::new();
        h.set_live(true);
        let now = Instant::now();
        assert_eq!(h.note("k", 1, now), Heat::Hot);
        let limits = Limits {
            limit: 100,
            window_us: 60_000_000,
            burst: 100,
            since: quotad_core::algorithm::Since::ZERO,
        };
        let asked = std::cell::Cell::new(None);
        let (v, _) = h
            .decide("k", limits, 2, |want| {
                asked.set(Some(want));
                async move { Ok::<_, ()>(window_grant(5, 95, 30_000_000, 1, 1)) }
            })
            .await
            .unwrap();
        assert!(v.allowed);
        assert_eq!(
            asked.get(),
            Some(Want {
                need: 2,
                demand: 2,
                prefetch: 0,
                ends: None,
            })
        );
        // The other 3 units are spent from memory.
        assert!(h.spend("k", limits, 3, Instant::now()).is_some());
        assert!(h.spend("k", limits, 1, Instant::now()).is_none());
        // Other limits (a reload): not from this slice.
        let (back, _) = h.tend(Instant::now(), true);
        assert!(back.is_empty(), "nothing left to give back: {back:?}");
    }
}
