//! The coordinator's view of the region's Redis: [`LeaseStore`] over `lua/global/`, and
//! the coordinator's clock, which is Redis's.
//!
//! The coordinator thread owns one synchronous connection (its calls are sequential by
//! nature: the node writes a book, then decides what to send). Every write is fenced by the
//! lock's token, so an instance that lost the lock (paused, partitioned from Redis) changes
//! nothing once another took over.
//!
//! Errors: the node's store interface cannot fail, so the first error of an event is
//! remembered ([`RedisLeaseStore::failure`]), every later write of that event is skipped
//! (reported not durable: no grant leaves, no release is announced), and reads return
//! nothing. The runtime then drops the node and starts over with a new incarnation, the
//! crash-and-restart path the simulator checks (S11): a half-applied event is a crash.
//!
//! Durability: with replicas attached, a write counts as durable once `WAIT` sees one
//! acknowledge it; a Redis without replicas acknowledges by answering (run Redis with
//! replicas or `appendfsync always` if a restart must not lose lease writes; see docs/global-budgets.md, Durability).
//!
//! Scale: books, counters and writes of many keys go in pipelines of [`BATCH`] commands
//! (one `WAIT` after a batch of writes), so a takeover with 100,000 tracked keys costs a
//! hundred round trips, not a hundred thousand, and stays well inside the lock period.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use super::Shared;
use super::books::{self, SLOT_FIELDS};
use super::lock::{Lock, Takeover};
use super::runtime::{Backend, Coordinated, StoreFault};
use crate::config::GlobalSettings;
use crate::layout::{GlobalLayout, Layouts, PolicyLayout};
use crate::policy::Policy;
use crate::store::{GlobalScript as Global, SharedTarget, SyncConn};
use quotad_core::clock::Clock;
use quotad_core::coordinator::demand::Counters;
use quotad_core::coordinator::lease::LeaseBook;
use quotad_core::coordinator::node::{LeaseStore, Written};

/// Commands per pipeline: large enough that round trips do not dominate, small enough
/// that one pipeline's replies stay well inside the socket timeout.
pub(crate) const BATCH: usize = 1000;

/// Redis's clock as the coordinator reads it: the offset from a monotonic clock, re-read
/// (`TIME`) at the start of every event, so the node's readings between two syncs move
/// with the local monotonic clock and a step of Redis's clock shows at the next sync.
#[derive(Debug, Clone)]
pub struct RedisClock {
    base: Instant,
    offset_us: Arc<AtomicI64>,
}

impl RedisClock {
    /// A clock synchronised with no Redis yet (offset 0).
    pub fn new() -> Self {
        RedisClock {
            base: Instant::now(),
            offset_us: Arc::new(AtomicI64::new(0)),
        }
    }

    fn mono_us(&self) -> i64 {
        self.base.elapsed().as_micros() as i64
    }
}

impl Default for RedisClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for RedisClock {
    fn now_us(&self) -> i64 {
        self.mono_us() + self.offset_us.load(Ordering::Acquire)
    }
}

/// One global policy as a coordinator store needs it: where its keys live, and its
/// per-policy keys and script numbers (the layout's, without the Option).
pub struct PolicyEntry {
    pub(crate) layout: PolicyLayout,
    pub global: Arc<GlobalLayout>,
}

/// The global policies by name, laid out by `layouts`, with the numbers of the policies
/// as loaded now (a reload may have re-split one).
pub fn global_policies(
    policies: &[Arc<Policy>],
    layouts: &Layouts,
) -> HashMap<String, PolicyEntry> {
    policies
        .iter()
        .filter_map(|p| {
            let layout = layouts.of(p).into_owned();
            let started = layout.global.as_deref()?;
            let global = Arc::new(GlobalLayout {
                shape: started.shape_for(p),
                ..started.clone()
            });
            Some((p.name.clone(), PolicyEntry { layout, global }))
        })
        .collect()
}

/// Redis as the coordinator's backend: connects, takes the region's lock.
pub(crate) struct RedisBackend {
    pub(crate) target: SharedTarget,
    pub(crate) lock: Arc<Lock>,
    pub(crate) timeout: Duration,
    pub(crate) conn: Option<SyncConn>,
    /// An eviction-policy problem was logged (once).
    pub(crate) warned: bool,
}

impl RedisBackend {
    fn connect(&self) -> Option<SyncConn> {
        // Twice the call bound: a `WAIT` that runs its full `timeout` (no replica
        // acknowledged) must come back as "not durable", not as a dead connection that
        // would restart the coordinator.
        match self
            .target
            .get()
            .connect_sync((self.timeout * 2).max(Duration::from_millis(500)))
        {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::debug!(error = %e, "coordinator: cannot connect to redis");
                None
            }
        }
    }
}

impl RedisBackend {
    /// Lease books have TTLs: a Redis that evicts keys under memory pressure could drop a
    /// live reservation. Coordinate only on `noeviction` (Redis's default), checked on the
    /// master of every global policy (on a cluster they may differ).
    fn evicts_nothing(&mut self, policies: &HashMap<String, PolicyEntry>) -> bool {
        let Some(conn) = self.conn.as_mut() else {
            return false;
        };
        for p in policies.values() {
            let policy: Result<Vec<String>, _> = conn.query_at(
                redis::cmd("CONFIG").arg("GET").arg("maxmemory-policy"),
                &p.global.keys.fence,
            );
            match policy.as_deref() {
                Ok([_, p]) if p != "noeviction" => {
                    if !self.warned {
                        tracing::error!(policy = %p, "redis maxmemory-policy evicts keys: not coordinating (global policies stay on their escrow); set maxmemory-policy noeviction");
                        self.warned = true;
                    }
                    return false;
                }
                Ok(_) => {}
                // CONFIG may be renamed or disabled (managed Redis): the operator's call.
                Err(e) if !self.warned => {
                    tracing::warn!(error = %e, "cannot read redis maxmemory-policy; make sure it is noeviction");
                    self.warned = true;
                }
                Err(_) => {}
            }
        }
        true
    }
}

impl Backend for RedisBackend {
    type Clock = RedisClock;
    type Store = RedisLeaseStore;

    fn try_lead(&mut self, shared: &Shared) -> Option<(RedisLeaseStore, RedisClock, Takeover)> {
        if self.conn.is_none() {
            self.conn = self.connect();
        }
        let policies = global_policies(&shared.policies(), &shared.layouts);
        if !self.evicts_nothing(&policies) {
            return None;
        }
        let fences: Vec<&str> = policies
            .values()
            .map(|p| p.global.keys.fence.as_str())
            .collect();
        let now_ms = super::incarnation::now_ms();
        let taken = match self.lock.try_acquire(self.conn.as_mut()?, &fences, now_ms) {
            Ok(Some(t)) => t,
            Ok(None) => return None,
            Err(e) => {
                tracing::debug!(error = %e, "coordinator lock: redis unreachable");
                self.conn = None;
                return None;
            }
        };
        let clock = RedisClock::new();
        let store = RedisLeaseStore::new(
            self.conn.take()?,
            clock.clone(),
            self.lock.clone(),
            taken.token,
            policies,
            self.timeout,
            &shared.settings,
        );
        Some((store, clock, taken))
    }
}

/// The coordinator's lease books in the region's Redis: read, written under the region's
/// lock's fencing token, and made durable with `WAIT` where replicas are attached.
pub struct RedisLeaseStore {
    conn: SyncConn,
    clock: RedisClock,
    lock: Arc<Lock>,
    token: u64,
    policies: HashMap<String, PolicyEntry>,
    write: redis::Script,
    drop: redis::Script,
    default: redis::Script,
    /// Replicas attached to each policy's master at the last round (0: a write is
    /// durable when answered).
    replicas: HashMap<String, u32>,
    wait_timeout: Duration,
    /// Redis time of the previous `take_active`, per policy.
    active_since: HashMap<String, i64>,
    failure: Option<String>,
    /// A `WAIT` timed out since the last round (see [`RedisLeaseStore::durable`]).
    lagging: bool,
    fenced: bool,
    /// Regions in the config (ids in stored books must be below).
    regions: usize,
    /// Half the longest TIME round trip accepted for a clock sync.
    max_sync_us: i64,
    /// A failover was detected and the node has not been told yet.
    failed_over: bool,
    /// Policies whose replication-ID key this store has written (so its absence is news).
    replid_written: std::collections::HashSet<String>,
    /// When the lock was last extended; long batches extend it as they go.
    renewed: Instant,
}

impl RedisLeaseStore {
    /// A lease store over `conn`, writing under `token` (the lock `lock` granted).
    pub fn new(
        conn: SyncConn,
        clock: RedisClock,
        lock: Arc<Lock>,
        token: u64,
        policies: HashMap<String, PolicyEntry>,
        wait_timeout: Duration,
        settings: &GlobalSettings,
    ) -> Self {
        RedisLeaseStore {
            regions: settings.regions.len(),
            max_sync_us: (settings.params.margin_us / 4).max(1_000),
            conn,
            clock,
            lock,
            token,
            policies,
            write: Global::WriteBook.script(),
            drop: Global::DropLoans.script(),
            default: Global::SetDefault.script(),
            replicas: HashMap::new(),
            wait_timeout,
            active_since: HashMap::new(),
            failure: None,
            lagging: false,
            fenced: false,
            failed_over: false,
            replid_written: Default::default(),
            renewed: Instant::now(),
        }
    }

    /// Extends the lock between the pipelines of a long batch, so that loading or writing
    /// many books never outlasts it (the runtime renews between events, too).
    fn keep_lock(&mut self) {
        if self.failure.is_some() || self.renewed.elapsed() < self.lock.ttl() / 4 {
            return;
        }
        match self.lock.renew(&mut self.conn) {
            Ok(true) => self.renewed = Instant::now(),
            Ok(false) => {
                self.fenced = true;
                self.fail("coordinator lock lost during a batch");
            }
            Err(e) => self.fail(e),
        }
    }

    fn fail(&mut self, e: impl std::fmt::Display) {
        if self.failure.is_none() {
            let msg = e.to_string();
            if msg.contains("FENCED") {
                self.fenced = true;
            }
            self.failure = Some(msg);
        }
    }

    /// Starts an event: reads Redis's clock (`TIME`, halfway through the round trip) and,
    /// on a round, replication (replicas attached; a failover drops every loan).
    fn begin_event(&mut self, round: bool) -> Result<(), StoreFault> {
        self.failure = None;
        let t0 = self.clock.mono_us();
        let time: Result<(i64, i64), _> = redis::cmd("TIME").query(&mut self.conn);
        let t1 = self.clock.mono_us();
        match time {
            // The reading is placed at the round trip's midpoint, so it is off by at most
            // half the round trip: beyond a quarter of the margin (half of what the step
            // tolerance leaves) the event is skipped and the previous offset kept.
            Ok(_) if t1 - t0 > self.max_sync_us * 2 => {
                return Err(StoreFault::ClockNotSynced(t1 - t0));
            }
            Ok((s, us)) => {
                let redis_us = s * 1_000_000 + us;
                self.clock
                    .offset_us
                    .store(redis_us - (t0 + t1) / 2, Ordering::Release);
            }
            Err(e) => {
                self.fail(&e);
                return Err(e.into());
            }
        }
        if round {
            self.lagging = false;
            self.replication()?;
        }
        Ok(())
    }

    /// Reads the replicas attached to each policy's master, and detects a failover: the
    /// replication ID a policy's books were last written under is kept in Redis itself (a
    /// replicated key in the policy's slot), so a promoted replica, or a restart that
    /// reloaded its data, shows a different one, even to a coordinator that only just
    /// connected. Then every loan is dropped (of every policy: the safe side).
    fn replication(&mut self) -> Result<(), StoreFault> {
        let mut names: Vec<String> = self.policies.keys().cloned().collect();
        names.sort();
        let mut current = Vec::with_capacity(names.len());
        let mut lost_any = false;
        for name in &names {
            let keys = &self.policies[name].global.keys;
            let (info, stored): (String, Option<String>) = {
                let replid = keys.replid.clone();
                let info = self
                    .conn
                    .query_at(redis::cmd("INFO").arg("replication"), &replid)?;
                let stored = redis::cmd("GET").arg(&replid).query(&mut self.conn)?;
                (info, stored)
            };
            let field = |name: &str| {
                info.lines()
                    .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                    .map(|v| v.trim().to_owned())
            };
            let replicas = field("connected_slaves")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            self.replicas.insert(name.clone(), replicas);
            let Some(now) = field("master_replid") else {
                continue;
            };
            // The key is written every round (with an hour's TTL): gone after this store
            // wrote it means Redis lost its data (a restart without persistence); changed
            // means a failover or a restart that reloaded older data. Either way writes it
            // took may be lost.
            let lost = stored.is_none() && self.replid_written.contains(name);
            lost_any |= lost || stored.as_ref().is_some_and(|s| *s != now);
            current.push((name.clone(), now));
        }
        if lost_any {
            tracing::warn!(
                "redis replication ID changed or lost (failover or restart): dropping every loan"
            );
            self.failed_over = true;
            self.drop_all_loans();
            if let Some(e) = &self.failure {
                return Err(StoreFault::EventFailed(e.clone()));
            }
        }
        // Refreshed every round: its TTL must not lapse while the region runs.
        for (name, replid) in current {
            let p = &self.policies[&name].global;
            let _: () = redis::cmd("SET")
                .arg(&p.keys.replid)
                .arg(&replid)
                .arg("PX")
                .arg(p.shape.keep_ms)
                .query(&mut self.conn)?;
            self.replid_written.insert(name);
        }
        Ok(())
    }

    fn drop_all_loans(&mut self) {
        let names: Vec<String> = self.policies.keys().cloned().collect();
        for name in names {
            let keys: Vec<String> = self.books(&name).into_iter().map(|(k, _)| k).collect();
            for chunk in keys.chunks(BATCH) {
                self.keep_lock();
                let p = &self.policies[&name];
                let mut pipe = redis::pipe();
                for key in chunk {
                    let storage = p.layout.storage_key(key);
                    let inv = books::drop_loans_invocation(
                        &self.drop,
                        &storage,
                        &p.global.keys,
                        self.token,
                        &p.global.shape,
                        None,
                    );
                    pipe.invoke_script(&inv).ignore();
                }
                if let Err(e) = query_scripts::<()>(&mut self.conn, &pipe, &self.drop) {
                    self.fail(e);
                    return;
                }
            }
        }
    }

    /// Whether writes so far are durable (see the module docs): acknowledged by every
    /// replica connected at the last round.
    ///
    /// A `WAIT` that timed out marks the replicas lagging until the next round: writes
    /// until then are reported not durable at once, and the round's first write probes
    /// again. A stalled replica (stopped, or its link hung: Redis keeps it connected until
    /// `repl-timeout`; or still waiting for its first sync) then costs one timeout per
    /// round. Waiting per write would block the coordinator for the timeout and a tick of
    /// Redis's clock (about 300 ms here: the 200 ms floor, at the default `hz`) on every
    /// message and every re-asserted book: peers' requests would time out queued behind
    /// it, and the lock could go stale. Not durable is always the safe answer: no grant
    /// leaves, no release is announced, the book is rewritten at the next round.
    fn durable(&mut self, policy: &str) -> bool {
        let replicas = self.replicas.get(policy).copied().unwrap_or(0);
        if replicas == 0 {
            return true;
        }
        if self.lagging {
            return false;
        }
        let Some(p) = self.policies.get(policy) else {
            return false;
        };
        // Every replica of the policy's master: a failover may promote any of them. On a
        // cluster WAIT goes to the master the writes went to (the policy's slot).
        let fence = p.global.keys.fence.clone();
        let acked: Result<i64, _> = self.conn.query_at(
            redis::cmd("WAIT")
                .arg(replicas)
                .arg(self.wait_timeout.as_millis() as u64),
            &fence,
        );
        match acked {
            Ok(n) => {
                self.lagging = n < replicas as i64;
                !self.lagging
            }
            Err(e) => {
                self.fail(e);
                false
            }
        }
    }

    /// The hashes of `keys`, pipelined; `None` for each when the event already failed
    /// (or fails here).
    fn read_slots(
        &mut self,
        policy: &str,
        keys: &[&str],
    ) -> Vec<Option<quotad_core::coordinator::bucket::KeySlot>> {
        let none = || (0..keys.len()).map(|_| None).collect();
        if self.failure.is_some() {
            return none();
        }
        if !self.policies.contains_key(policy) {
            return none();
        }
        let mut out = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(BATCH) {
            self.keep_lock();
            let p = &self.policies[policy];
            let mut pipe = redis::pipe();
            for key in chunk {
                pipe.cmd("HMGET")
                    .arg(p.layout.storage_key(key))
                    .arg(&SLOT_FIELDS[..]);
            }
            let rows: Result<Vec<Vec<Option<String>>>, _> = pipe.query(&mut self.conn);
            let rows = match rows {
                Ok(r) => r,
                Err(e) => {
                    self.fail(e);
                    return none();
                }
            };
            for row in rows {
                match books::decode_slot(&row) {
                    Ok(mut slot) => {
                        // A loan from a region this config does not have (the region set
                        // changed) is dropped: dropping a loan is always safe. Reservations
                        // are kept (they only lower the rate) and are matched by id, never
                        // indexed.
                        let n = self.regions;
                        if let Some(b) = slot.book.as_mut() {
                            b.borrowed.retain(|l| l.lender.index() < n);
                        }
                        out.push(Some(slot));
                    }
                    Err(e) => {
                        self.fail(e);
                        return none();
                    }
                }
            }
        }
        out
    }
}

/// Runs a pipeline of `script`'s invocations, loading the script once if Redis does not
/// have it (a restart, SCRIPT FLUSH): a pipeline's EVALSHAs are not retried by the crate.
/// Retrying the whole pipeline is safe: every script here sets state, so running one
/// twice leaves what running it once does.
fn query_scripts<T: redis::FromRedisValue>(
    conn: &mut SyncConn,
    pipe: &redis::Pipeline,
    script: &redis::Script,
) -> redis::RedisResult<T> {
    match pipe.query(conn) {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            script.prepare_invoke().load(conn)?;
            pipe.query(conn)
        }
        r => r,
    }
}

impl Coordinated for RedisLeaseStore {
    fn begin(&mut self, round: bool) -> Result<(), StoreFault> {
        self.begin_event(round)
    }

    fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }

    fn fenced(&self) -> bool {
        self.fenced
    }

    fn renew(&mut self) -> Result<bool, StoreFault> {
        let renewed = self.lock.renew(&mut self.conn)?;
        if renewed {
            self.renewed = Instant::now();
        }
        Ok(renewed)
    }

    fn release(&mut self) {
        let _ = self.lock.release(&mut self.conn);
    }
}

impl LeaseStore for RedisLeaseStore {
    fn write_book(&mut self, policy: &str, key: &str, book: &LeaseBook) -> Written {
        self.write_books(policy, &[(key, book)])
            .pop()
            .unwrap_or(Written {
                durable: false,
                epoch: book.epoch,
            })
    }

    fn write_books(&mut self, policy: &str, books: &[(&str, &LeaseBook)]) -> Vec<Written> {
        let not_written = || {
            books
                .iter()
                .map(|(_, b)| Written {
                    durable: false,
                    epoch: b.epoch,
                })
                .collect()
        };
        if self.failure.is_some() || books.is_empty() {
            return not_written();
        }
        if !self.policies.contains_key(policy) {
            return not_written();
        }
        let mut epochs = Vec::with_capacity(books.len());
        for chunk in books.chunks(BATCH) {
            self.keep_lock();
            if self.failure.is_some() {
                return not_written();
            }
            let p = &self.policies[policy];
            let storage: Vec<String> = chunk.iter().map(|(k, _)| p.layout.storage_key(k)).collect();
            let mut pipe = redis::pipe();
            for (group, names) in chunk
                .chunks(books::BOOKS_PER_CALL)
                .zip(storage.chunks(books::BOOKS_PER_CALL))
            {
                let writes: Vec<books::BookWrite> = group
                    .iter()
                    .zip(names)
                    .map(|((key, book), storage_key)| books::BookWrite {
                        storage_key,
                        user_key: key,
                        book,
                    })
                    .collect();
                let inv = books::write_books_invocation(
                    &self.write,
                    &p.global.keys,
                    self.token,
                    &p.global.shape,
                    &writes,
                    None,
                );
                pipe.invoke_script(&inv);
            }
            match query_scripts::<Vec<Vec<u64>>>(&mut self.conn, &pipe, &self.write) {
                Ok(e) => epochs.extend(e.into_iter().flatten()),
                Err(e) => {
                    self.fail(e);
                    return not_written();
                }
            }
        }
        if epochs.len() != books.len() {
            self.fail(format!(
                "write_book answered {} epochs for {} books",
                epochs.len(),
                books.len()
            ));
            return not_written();
        }
        // One WAIT covers the whole batch: a replica acknowledges in order.
        let durable = self.durable(policy);
        epochs
            .into_iter()
            .map(|epoch| Written { durable, epoch })
            .collect()
    }

    fn read_book(&mut self, policy: &str, key: &str) -> Option<LeaseBook> {
        self.read_books(policy, &[key]).pop().flatten()
    }

    fn read_books(&mut self, policy: &str, keys: &[&str]) -> Vec<Option<LeaseBook>> {
        self.read_slots(policy, keys)
            .into_iter()
            .map(|s| s.and_then(|s| s.book))
            .collect()
    }

    fn books(&mut self, policy: &str) -> Vec<(String, LeaseBook)> {
        let Some(p) = self.policies.get(policy) else {
            return Vec::new();
        };
        let set = p.global.keys.books.clone();
        let fence = p.global.keys.fence.clone();
        let members: Vec<String> = match redis::cmd("SMEMBERS").arg(&set).query(&mut self.conn) {
            Ok(m) => m,
            Err(e) => {
                self.fail(e);
                return Vec::new();
            }
        };
        let keys: Vec<&str> = members.iter().map(String::as_str).collect();
        let books = self.read_books(policy, &keys);
        if self.failure.is_some() {
            return Vec::new();
        }
        let mut out = Vec::new();
        let mut expired = Vec::new();
        for (key, book) in members.iter().zip(books) {
            match book {
                Some(book) => out.push((key.clone(), book)),
                // The key expired (idle for the keep time): nothing left to adopt.
                None => expired.push(key.as_str()),
            }
        }
        for chunk in expired.chunks(BATCH) {
            let mut pipe = redis::pipe();
            for key in chunk {
                self.lock
                    .fenced_srem_to(&mut pipe, (&fence, self.token), &set, key);
            }
            // Best effort: a member left behind is pruned at the next adoption.
            let _ = query_scripts::<()>(&mut self.conn, &pipe, self.lock.fenced_srem_script());
        }
        out
    }

    fn take_active(&mut self, policy: &str) -> Vec<String> {
        if self.failure.is_some() {
            return Vec::new();
        }
        let Some(p) = self.policies.get(policy) else {
            return Vec::new();
        };
        let now = self.clock.now_us();
        let keep_us = p.global.shape.keep_ms * 1000;
        let since = self
            .active_since
            .get(policy)
            .copied()
            .unwrap_or(now - keep_us);
        // One pipeline: the keys active since the last call (with a little overlap: a key
        // listed twice is harmless, one missed would be stale for a round), trimming what
        // aged out of the keep window.
        let active = p.global.keys.active.clone();
        let keys: Result<Vec<String>, _> = redis::pipe()
            .cmd("ZRANGEBYSCORE")
            .arg(&active)
            .arg(since - 100_000)
            .arg("+inf")
            .cmd("ZREMRANGEBYSCORE")
            .arg(&active)
            .arg("-inf")
            .arg(format!("({}", now - keep_us))
            .ignore()
            .query::<(Vec<String>,)>(&mut self.conn)
            .map(|(k,)| k);
        let keys = match keys {
            Ok(k) => k,
            Err(e) => {
                self.fail(e);
                return Vec::new();
            }
        };
        self.active_since.insert(policy.to_owned(), now);
        if keys.is_empty() {
            return keys;
        }
        keys
    }

    fn counters(&mut self, policy: &str, key: &str) -> Counters {
        self.counters_of(policy, &[key]).pop().unwrap_or_default()
    }

    /// Every tracked key's two counters, in pipelines of [`BATCH`].
    fn counters_of(&mut self, policy: &str, keys: &[&str]) -> Vec<Counters> {
        let mut out = Vec::with_capacity(keys.len());
        if self.failure.is_some() {
            return vec![Counters::default(); keys.len()];
        }
        let Some(p) = self.policies.get(policy) else {
            return vec![Counters::default(); keys.len()];
        };
        for chunk in keys.chunks(BATCH) {
            let mut pipe = redis::pipe();
            for k in chunk {
                pipe.cmd("HMGET")
                    .arg(p.layout.storage_key(k))
                    .arg("a")
                    .arg("x")
                    .arg("kr");
            }
            let rho = p.global.shape.rho;
            match pipe.query::<Vec<(Option<u64>, Option<u64>, Option<f64>)>>(&mut self.conn) {
                Ok(rows) => out.extend(rows.into_iter().map(|row| counters_of(row, rho))),
                Err(e) => {
                    self.fail(e);
                    break;
                }
            }
        }
        out.resize(keys.len(), Counters::default());
        out
    }

    fn take_failover(&mut self) -> bool {
        std::mem::take(&mut self.failed_over)
    }

    fn default_escrow(&mut self, policy: &str) -> Option<f64> {
        if self.failure.is_some() {
            return None;
        }
        let meta = self.policies.get(policy)?.global.keys.meta.clone();
        let v: Result<Vec<Option<String>>, _> = redis::cmd("HMGET")
            .arg(&meta)
            .arg(&["d", "dp", "dt"])
            .query(&mut self.conn);
        let decoded = v.map(|v| books::decode_default(&v));
        match decoded {
            Ok(Ok(d)) => d.map(|d| d.escrow),
            Ok(Err(e)) => {
                self.fail(e);
                None
            }
            Err(e) => {
                self.fail(e);
                None
            }
        }
    }

    fn set_default_escrow(&mut self, policy: &str, escrow: f64) -> bool {
        if self.failure.is_some() {
            return false;
        }
        let Some(p) = self.policies.get(policy) else {
            return false;
        };
        let inv = books::set_default_invocation(
            &self.default,
            &p.global.keys,
            self.token,
            escrow,
            p.global.shape.keep_ms,
            None,
        );
        match inv.invoke::<i64>(&mut self.conn) {
            Ok(_) => self.durable(policy),
            Err(e) => {
                self.fail(e);
                false
            }
        }
    }
}

/// A key's `a` and `x` fields (absent: 0).
/// A key's counters in policy units: the script counts the key's units, and a key with its
/// own rate ρ_K (`kr`) offers n·ρ/ρ_K of the policy's, the units the coordinator's shares
/// are in. A change of ρ_K rescales the whole count, so the round across it reads a jump
/// (clamped by the estimator) or a fall (a new baseline): one round's estimate, never the
/// bound, which the books keep in policy units whatever the numbers.
fn counters_of(
    (admitted, rejected, rate): (Option<u64>, Option<u64>, Option<f64>),
    rho: f64,
) -> Counters {
    let scale = |n: Option<u64>| {
        let n = n.unwrap_or(0);
        match rate {
            Some(r) if r > 0.0 && r.is_finite() => (n as f64 * rho / r).round() as u64,
            _ => n,
        }
    };
    Counters {
        admitted: scale(admitted),
        rejected: scale(rejected),
    }
}
