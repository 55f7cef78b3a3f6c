//! The Redis backend: one `EVALSHA` of the algorithm's Lua script per operation.
//!
//! Owns the connection, the per-call timeout, the circuit breaker and script loading.
//!
//! - One multiplexed connection carries every in-flight call, so concurrent requests reach
//!   Redis pipelined (Redis then spends about half the CPU per script it spends on
//!   one-request-per-round-trip clients; see docs/benchmarks.md).
//! - At most `max_in_flight` calls are in flight ([`Admission`]); a request waits for its
//!   permits in a bounded queue with its own deadline, or is shed. Every call is then
//!   bounded by `timeout`, timed from when it is sent, so the timeout judges Redis and not
//!   quotad's own queue; a reply that was there when the timer fired, unread because the
//!   runtime was behind, still counts ([`deadline`]).
//! - Failures feed the [`Breaker`]: a dropped or refused connection opens it at once;
//!   `breaker_threshold` timeouts in a row make the supervisor PING Redis, and only an
//!   unanswered PING opens it. While it is open, calls fail in microseconds.
//! - [`RedisStore::supervise`] is the only place that connects: it probes (connect, PING,
//!   SCRIPT LOAD) every `probe_interval` while the breaker is open and closes it on success,
//!   so enforcement returns within one probe interval of Redis coming back. While closed it
//!   PINGs once a second to keep `quotad_store_up` and readiness honest.
//! - Through Sentinel, the health check also asks the sentinels which master they name:
//!   after a failover the old master keeps accepting writes until the sentinels demote it
//!   (seconds later; writes it takes meanwhile are lost), so the store moves to the new
//!   master as soon as the sentinels name it, not when the old one first answers READONLY.
//! - NOSCRIPT (after `SCRIPT FLUSH` or a restart that the connection survived) is answered
//!   with `SCRIPT LOAD` and one retry inside the same call: clients never see it.

pub(crate) mod admission;
pub(crate) mod breaker;
pub(crate) mod cluster;
pub(crate) mod coalesce;
pub(crate) mod connect;
pub(crate) mod deadline;
pub(crate) mod deny_cache;
pub(crate) mod global;
pub(crate) mod hot;
pub(crate) mod janitor;
mod runtime;
mod runtime_sync;
pub(crate) mod scripts;
pub(crate) mod wire;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use redis::{ErrorKind, RedisError, ServerErrorKind};
use tokio_util::sync::CancellationToken;

use crate::layout::Layout;
use crate::metrics::Metrics;
use crate::runtime_limits::{MESSAGE_PREFIX, RuntimeLimits};
use crate::store::call::{
    KeyUsage, LeaseCall, SettleCall, SettleReply, StoreCall, StoreError, UsageReply,
};
use admission::{Admission, AdmissionSettings, Admitted, Shed};
use breaker::Breaker;
use connect::{AsyncConn, SharedTarget, Target};
use deadline::Within;
use deny_cache::{DenyCache, Question};
use hot::{Grant, HotKeys, Mark, Return, Taker, Want};
use quotad_core::algorithm::{Op, Verdict};
use quotad_core::concurrency::LeaseAnswer;
use quotad_core::settlement::Settled;
use scripts::Scripts;
use wire::{parse_lease, parse_verdict};

#[derive(Debug, Clone, PartialEq)]
pub struct RedisSettings {
    /// Where Redis is (standalone, cluster, Sentinel) and how to reach it (TLS, ACL).
    pub target: Target,
    /// Bound on every call (script or probe), connection set-up excluded.
    pub(crate) timeout: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) breaker_threshold: u32,
    pub(crate) probe_interval: Duration,
    pub(crate) admission: AdmissionSettings,
    /// Denials remembered at most (0: none; see [`DenyCache`]).
    pub(crate) deny_cache_keys: usize,
    /// How often the region's TTL janitor sweeps (see [`crate::store::redis::janitor`]).
    pub(crate) janitor_interval: Duration,
}

pub(crate) struct RedisStore {
    /// The live connection with its generation; `None` until the supervisor connects, and
    /// after it is lost. The generation lets a late error from a request on an old
    /// connection leave a newer one alone. A std RwLock: held only to clone the handle out,
    /// never across an await.
    conn: RwLock<Option<(u64, AsyncConn)>>,
    generation: std::sync::atomic::AtomicU64,
    /// Through Sentinel: the address of the master the live connection was opened to.
    master: std::sync::Mutex<Option<String>>,
    scripts: Scripts,
    /// The decision script of global policies (EVALSHA, loaded on NOSCRIPT by the crate).
    global_check: redis::Script,
    /// The all-or-nothing script of co-location groups.
    composite: redis::Script,
    /// A reset and its invalidation in one step (`lua/reset.lua`).
    reset: redis::Script,
    /// Reservations and their settlement (`lua/settle.lua`).
    settle: redis::Script,
    /// Leases of concurrency limits (`lua/concurrency.lua`).
    concurrency: redis::Script,
    settings: RedisSettings,
    /// `settings.target`, and after a live rotation of credentials the new one
    /// ([`RedisStore::rotate`]): what every connection is opened with.
    target: SharedTarget,
    breaker: Breaker,
    /// Set once the current connection has loaded every script.
    loaded: AtomicBool,
    /// Wakes the supervisor the moment the breaker opens or Redis becomes suspect, so
    /// probing or verifying starts at once rather than after its health-check sleep.
    tripped: tokio::sync::Notify,
    admission: Admission,
    /// Denials answered from memory until their retry time.
    deny: DenyCache,
    /// Hot keys' slices, admitted from in memory (`store::redis::hot`).
    hot: HotKeys,
    /// Takes and returns of a fixed window's slices (`lua/slice.lua`).
    slice: redis::Script,
    /// Takes and returns of a token bucket's or GCRA key's slices (`lua/bucket_slice.lua`).
    bucket_slice: redis::Script,
    /// The channel on which every instance announces the keys it gave capacity back to
    /// (refunds, resets), so that none answers an outdated denial from memory; and the
    /// changes of runtime limits.
    channel: String,
    /// Changes of runtime limits (`lua/runtime_limit.lua`).
    runtime_limit: redis::Script,
    /// This instance's copy of the runtime limits, which the channel's change messages
    /// keep true (`crate::runtime_limits`).
    runtime: Arc<RuntimeLimits>,
    metrics: Arc<Metrics>,
}

const HEALTH_INTERVAL: Duration = Duration::from_secs(1);
/// `lua/bucket_slice.lua`'s name for a bucket: GCRA's, or a token bucket's.
fn bucket_kind(gcra: bool) -> &'static str {
    if gcra { "gc" } else { "tb" }
}

/// Slices given back at once, at most (`give_back_slices`).
const RETURNS_IN_FLIGHT: usize = 64;
/// How often each instance proves the invalidation channel alive.
const HEARTBEAT: Duration = Duration::from_secs(1);
/// A payload no storage key can be (keys always carry the prefix).
const HEARTBEAT_PAYLOAD: &str = "";

impl RedisStore {
    /// Checks the target offline; does not connect (the supervisor does). `layout` names
    /// the invalidation channel.
    pub(crate) fn new(
        settings: RedisSettings,
        layout: &Layout,
        metrics: Arc<Metrics>,
        runtime: Arc<RuntimeLimits>,
    ) -> Result<Self, RedisError> {
        settings.target.check()?;
        let breaker = Breaker::new(settings.breaker_threshold);
        // Not connected yet: fail fast until the first probe succeeds.
        breaker.trip();
        metrics.store_up.set(0);
        let admission = Admission::new(settings.admission, metrics.clone());
        Ok(RedisStore {
            target: SharedTarget::new(settings.target.clone()),
            conn: RwLock::new(None),
            generation: std::sync::atomic::AtomicU64::new(0),
            master: std::sync::Mutex::new(None),
            scripts: Scripts::default(),
            global_check: scripts::Global::Check.script(),
            composite: redis::Script::new(scripts::COMPOSITE),
            reset: redis::Script::new(scripts::RESET),
            settle: redis::Script::new(scripts::SETTLE),
            concurrency: redis::Script::new(scripts::CONCURRENCY),
            breaker,
            loaded: AtomicBool::new(false),
            tripped: tokio::sync::Notify::new(),
            admission,
            deny: DenyCache::new(settings.deny_cache_keys),
            hot: HotKeys::new(),
            slice: redis::Script::new(scripts::SLICE),
            bucket_slice: redis::Script::new(scripts::BUCKET_SLICE),
            channel: layout.invalidate_channel(),
            runtime_limit: redis::Script::new(scripts::RUNTIME_LIMIT),
            runtime,
            metrics,
            settings,
        })
    }

    /// A denial of this call's check remembered and still in force (see [`DenyCache`]).
    pub(crate) fn cached_denial(&self, call: &StoreCall<'_>) -> Option<Verdict> {
        match (call.op, &call.global) {
            (Op::Check { cost }, None) => self.deny.lookup(&question(call, cost), Instant::now()),
            _ => None,
        }
    }

    /// Drops expired remembered denials (the app's sweep).
    pub(crate) fn sweep(&self) {
        let n = self.deny.sweep(Instant::now());
        self.metrics.deny_cache_keys.set(n as i64);
    }

    /// Forgets `key`'s remembered denial (and slice) here and in every other instance.
    async fn gave_back(&self, key: &str) {
        self.deny.invalidate(key);
        self.end_slice(key);
        self.publish(key).await;
    }

    /// Ends `key`'s hot slice here, if it has one (capacity was given back to the key).
    fn end_slice(&self, key: &str) {
        if self.hot.forget(key) {
            self.metrics.hot_slices.with_label_values(&["ended"]).inc();
        }
    }

    async fn publish(&self, payload: &str) {
        let channel = self.channel.as_str();
        let published = self
            .guarded(|mut conn| async move {
                redis::cmd("PUBLISH")
                    .arg(channel)
                    .arg(payload)
                    .query_async::<i64>(&mut conn)
                    .await
            })
            .await;
        if let Err(e) = published {
            tracing::debug!(error = %e, "invalidation not published");
        }
    }

    /// Follows the invalidation channel until `shutdown`: remembered denials are used only
    /// while subscribed (from an empty cache at each subscription), so no instance answers
    /// a denial that another's refund or reset has made stale.
    pub(crate) async fn follow_invalidations(self: Arc<Self>, shutdown: CancellationToken) {
        use futures_util::StreamExt;
        loop {
            let subscribed = async {
                let mut last = None;
                for client in self.target.get().pubsub_clients().await? {
                    let attempt = async {
                        let mut pubsub = client.get_async_pubsub().await?;
                        pubsub.subscribe(&self.channel).await?;
                        Ok::<_, RedisError>(pubsub)
                    };
                    match attempt.await {
                        Ok(p) => return Ok(p),
                        Err(e) => last = Some(e),
                    }
                }
                Err(last.unwrap_or_else(|| {
                    RedisError::from(std::io::Error::other("no node to subscribe to"))
                }))
            };
            let attempt = tokio::select! {
                _ = shutdown.cancelled() => return,
                r = tokio::time::timeout(self.settings.connect_timeout, subscribed) => r,
            };
            if let Ok(Ok(mut pubsub)) = attempt {
                self.deny.set_live(true);
                self.hot.set_live(true);
                // A heartbeat of our own through the channel every second: a subscription
                // that stops delivering (a silently dead connection) is noticed within
                // a few, and nothing is answered from memory meanwhile.
                let beat = {
                    let me = self.clone();
                    tokio::spawn(async move {
                        loop {
                            tokio::time::sleep(HEARTBEAT).await;
                            me.publish(HEARTBEAT_PAYLOAD).await;
                        }
                    })
                };
                let mut messages = pubsub.on_message();
                loop {
                    let msg = tokio::select! {
                        _ = shutdown.cancelled() => { beat.abort(); return }
                        m = tokio::time::timeout(HEARTBEAT * 4, messages.next()) => m,
                    };
                    match msg {
                        Ok(Some(m)) => match m.get_payload::<String>() {
                            Ok(key) if key == HEARTBEAT_PAYLOAD => {}
                            Ok(change) if change.starts_with(MESSAGE_PREFIX) => {
                                if let Some(since_ms) = self.runtime.on_message(&change) {
                                    let delay = crate::runtime_limits::now_ms() - since_ms;
                                    self.metrics
                                        .runtime_limit_propagation
                                        .observe(delay.max(0) as f64 / 1000.0);
                                }
                            }
                            Ok(key) => {
                                self.deny.invalidate(&key);
                                self.end_slice(&key);
                                self.metrics.invalidations_received.inc();
                            }
                            Err(_) => {}
                        },
                        Ok(None) => break,
                        Err(_) => {
                            tracing::warn!(
                                "invalidation channel silent: not answering denials from memory until it is back"
                            );
                            break;
                        }
                    }
                }
                beat.abort();
                self.deny.set_live(false);
                self.hot.set_live(false);
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(self.settings.probe_interval) => {}
            }
        }
    }

    /// Permits for `calls` calls of one request; none needed while the breaker is open
    /// (those calls fail in microseconds without reaching Redis).
    pub(crate) async fn admit(&self, calls: usize) -> Result<Option<Admitted<'_>>, Shed> {
        if self.breaker.is_open() {
            return Ok(None);
        }
        self.admission.admit(calls).await.map(Some)
    }

    pub(crate) fn is_ready(&self) -> bool {
        !self.breaker.is_open() && self.loaded.load(Ordering::Acquire)
    }

    fn conn(&self) -> Option<(u64, AsyncConn)> {
        self.conn.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn install(&self, conn: AsyncConn) {
        let generation = self.generation.fetch_add(1, Ordering::AcqRel) + 1;
        *self.conn.write().unwrap_or_else(|p| p.into_inner()) = Some((generation, conn));
    }

    pub(crate) async fn apply(&self, call: &StoreCall<'_>) -> Result<Verdict, StoreError> {
        if let Some(g) = &call.global {
            let inv =
                global::check_invocation(&self.global_check, &g.script_key(call), call.op, None);
            let reply: Vec<i64> = self
                .guarded(|mut conn| async move { inv.invoke_async(&mut conn).await })
                .await?;
            return parse_verdict(&reply);
        }
        let (mode, cost) = match call.op {
            Op::Check { cost } => ("check", cost),
            Op::Refund { cost } => ("refund", cost),
        };
        let sent = Instant::now();
        let epoch = self.deny.epoch();
        let v = parse_verdict(&self.run_algorithm(call, mode, cost).await?)?;
        match call.op {
            Op::Check { cost } if !v.allowed => {
                self.deny.remember(&question(call, cost), &v, sent, epoch)
            }
            Op::Refund { .. } => self.gave_back(call.key).await,
            Op::Check { .. } => {}
        }
        Ok(v)
    }

    /// What `call`'s key used and holds: the script's `usage` operation, which writes
    /// nothing (a global policy's key: the check script's `usage` mode).
    pub(crate) async fn usage(&self, call: &StoreCall<'_>) -> Result<UsageReply, StoreError> {
        if let Some(g) = &call.global {
            let inv = global::usage_invocation(&self.global_check, &g.script_key(call), None);
            let reply: Vec<i64> = self
                .guarded(|mut conn| async move { inv.invoke_async(&mut conn).await })
                .await?;
            let (usage, now_us) = wire::parse_region_usage(&reply)?;
            return Ok(UsageReply {
                usage: KeyUsage::Region(usage),
                now_us,
            });
        }
        let (usage, now_us) = wire::parse_usage(&self.run_algorithm(call, "usage", 0).await?)?;
        Ok(UsageReply {
            usage: KeyUsage::Local(usage),
            now_us,
        })
    }

    /// One call of `call`'s algorithm script in `mode` (`check`, `refund`, `charge`,
    /// `usage`).
    async fn run_algorithm(
        &self,
        call: &StoreCall<'_>,
        mode: &str,
        cost: u64,
    ) -> Result<Vec<i64>, StoreError> {
        let mut cmd = redis::cmd("EVALSHA");
        let (frame, since) = scripts::frame_args(&call.limits);
        cmd.arg(self.scripts.sha(call.algorithm))
            .arg(1)
            .arg(call.key)
            .arg(mode)
            .arg(call.limits.limit)
            .arg(scripts::window_arg(&call.limits, call.periods.as_ref()))
            .arg(call.limits.burst)
            .arg(cost)
            .arg(call.member)
            .arg(frame)
            .arg(since);
        self.eval(&cmd, scripts::source(call.algorithm)).await
    }

    /// Runs `cmd`, an EVALSHA of `source`, under the guard; a Redis that lost its scripts
    /// (NOSCRIPT) gets `source` loaded and the command once more, in the same call.
    async fn eval<T: redis::FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
        source: &'static str,
    ) -> Result<T, StoreError> {
        self.guarded(|mut conn| async move {
            match cmd.query_async(&mut conn).await {
                Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    self.load_source(&mut conn, source).await?;
                    cmd.query_async(&mut conn).await
                }
                r => r,
            }
        })
        .await
    }

    /// Spends `cost` units of `call`'s key whether or not it has them (a charge counted
    /// after the work; see `quotad_core::algorithm::charge`). Never denied.
    pub(crate) async fn charge(
        &self,
        call: &StoreCall<'_>,
        cost: u64,
    ) -> Result<Verdict, StoreError> {
        parse_verdict(&self.run_algorithm(call, "charge", cost).await?)
    }

    /// A check of `estimate` that, admitted, opens the reservation (`lua/settle.lua`).
    pub(crate) async fn reserve(
        &self,
        call: &SettleCall<'_>,
        estimate: u64,
    ) -> Result<Verdict, StoreError> {
        let sent = Instant::now();
        let epoch = self.deny.epoch();
        let v = parse_verdict(&self.run_settle(call, "reserve", estimate).await?)?;
        if !v.allowed {
            let q = Question {
                key: call.key,
                algorithm: call.algorithm,
                limits: call.limits,
                cost: estimate,
            };
            self.deny.remember(&q, &v, sent, epoch);
        }
        Ok(v)
    }

    /// Settles the reservation at the real `cost` (`lua/settle.lua`); what it gave back
    /// is announced like a refund's.
    pub(crate) async fn settle(
        &self,
        call: &SettleCall<'_>,
        cost: u64,
    ) -> Result<SettleReply, StoreError> {
        // Published in the script itself when it gives units back (before it changes
        // anything); what this instance remembers goes at once.
        let reply = SettleReply::parse(&self.run_settle(call, "settle", cost).await?)?;
        if let Settled::Now { refunded: 1.., .. } = reply.settled {
            self.deny.invalidate(call.key);
            self.end_slice(call.key);
        }
        Ok(reply)
    }

    /// One operation on a concurrency limit's key (`lua/concurrency.lua`).
    pub(crate) async fn lease(&self, call: &LeaseCall<'_>) -> Result<LeaseAnswer, StoreError> {
        let (mode, id, units, hold_us) = call.args();
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.concurrency.get_hash())
            .arg(2)
            .arg(call.key)
            .arg(crate::layout::PolicyLayout::ended_leases_key(call.key))
            .arg(mode)
            .arg(call.limit)
            .arg(id)
            .arg(units)
            .arg(hold_us);
        let reply: Vec<i64> = self.eval(&cmd, scripts::CONCURRENCY).await?;
        parse_lease(&reply)
    }

    async fn run_settle(
        &self,
        call: &SettleCall<'_>,
        mode: &str,
        cost: u64,
    ) -> Result<Vec<i64>, StoreError> {
        let mut cmd = redis::cmd("EVALSHA");
        let (frame, since) = scripts::frame_args(&call.limits);
        cmd.arg(self.settle.get_hash())
            .arg(3)
            .arg(call.key)
            .arg(call.reservation)
            .arg(call.reset_mark)
            .arg(mode)
            .arg(call.algorithm.key_tag())
            .arg(call.limits.limit)
            .arg(scripts::window_arg(&call.limits, call.periods.as_ref()))
            .arg(call.limits.burst)
            .arg(cost)
            .arg(call.member)
            .arg(call.keep_ms)
            .arg(&self.channel)
            .arg(frame)
            .arg(since);
        self.eval(&cmd, scripts::SETTLE).await
    }

    /// A co-location group's checks in one script (see [`crate::store::Store::apply_all`]).
    pub(crate) async fn apply_all(
        &self,
        calls: &[StoreCall<'_>],
        enforced: &[bool],
    ) -> Result<Vec<Verdict>, StoreError> {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.composite.get_hash()).arg(calls.len());
        for c in calls {
            cmd.arg(c.key);
        }
        for (c, enforced) in calls.iter().zip(enforced) {
            let Op::Check { cost } = c.op else {
                return Err(StoreError::Command("a refund in a composite batch".into()));
            };
            let (frame, since) = scripts::frame_args(&c.limits);
            cmd.arg(c.algorithm.key_tag())
                .arg(c.limits.limit)
                .arg(scripts::window_arg(&c.limits, c.periods.as_ref()))
                .arg(c.limits.burst)
                .arg(cost)
                .arg(c.member)
                .arg(u8::from(*enforced))
                .arg(frame)
                .arg(since);
        }
        let reply: Vec<i64> = self.eval(&cmd, scripts::COMPOSITE).await?;
        if reply.len() != calls.len() * 4 {
            return Err(StoreError::Reply(format!(
                "{} numbers for {} checks",
                reply.len(),
                calls.len()
            )));
        }
        reply.chunks(4).map(parse_verdict).collect()
    }

    /// Hot-key slices (see [`HotKeys`]).
    pub(crate) fn hot(&self) -> &HotKeys {
        &self.hot
    }

    /// Counts a check of `key` towards its heat (`rate`: the policy's `hot_key_rate`):
    /// whether the key is hot now. A key the table had no room for is counted refused.
    pub(crate) fn heat(&self, key: &str, rate: u64) -> bool {
        match self.hot.note(key, rate, Instant::now()) {
            hot::Heat::Hot => true,
            hot::Heat::Cold => false,
            hot::Heat::Refused => {
                self.metrics.hot_refused.inc();
                false
            }
        }
    }

    /// A check of a hot key that its slice could not answer: decided through a take of
    /// a slice (see [`HotKeys::decide`]), with the slice its units came from; a denial is
    /// remembered as any other.
    pub(crate) async fn apply_hot(
        &self,
        call: &StoreCall<'_>,
        taker: Taker,
        cost: u64,
    ) -> Result<(Verdict, Option<Mark>), StoreError> {
        let sent = Instant::now();
        let epoch = self.deny.epoch();
        let (v, from) = self
            .hot
            .decide(call.key, call.limits, cost, |want| {
                self.take_slice(call, taker, want)
            })
            .await?;
        if !v.allowed {
            self.deny.remember(&question(call, cost), &v, sent, epoch);
        }
        Ok((v, from))
    }

    /// Gives back `cost` units of `call`'s key that this instance's slice `mark` spent
    /// (a denied batch refunds its other checks): into that slice while it is live here,
    /// so no round trip and nothing for other instances to hear; once it has left the
    /// table, to the key in Redis, where a bucket's slice still live there stops holding
    /// them (`lua/bucket_slice.lua`, refund) rather than capping the bucket below them.
    pub(crate) async fn refund_spent(
        &self,
        call: &StoreCall<'_>,
        mark: Mark,
        cost: u64,
    ) -> Result<(), StoreError> {
        if self.hot.unspend(call.key, mark, cost, Instant::now()) {
            return Ok(());
        }
        let Mark::Bucket { id, gcra } = mark else {
            return self.apply(call).await.map(|_| ());
        };
        let l = call.limits;
        let mut inv = self.bucket_slice.key(call.key);
        let (frame, since) = scripts::frame_args(&l);
        inv.arg("refund")
            .arg(bucket_kind(gcra))
            .arg(l.limit)
            .arg(l.window_us)
            .arg(l.burst)
            .arg(id)
            .arg(cost)
            .arg(frame)
            .arg(since);
        let inv = &inv;
        let reply: Vec<i64> = self
            .guarded(|mut conn| async move { inv.invoke_async(&mut conn).await })
            .await?;
        parse_verdict(&reply)?;
        self.gave_back(call.key).await;
        Ok(())
    }

    async fn take_slice(
        &self,
        call: &StoreCall<'_>,
        taker: Taker,
        want: Want,
    ) -> Result<Grant, StoreError> {
        let l = call.limits;
        let mut inv;
        match taker {
            Taker::Window => {
                inv = self.slice.key(call.key);
                inv.arg("take").arg(l.limit).arg(l.window_us);
            }
            Taker::Bucket { gcra } => {
                inv = self.bucket_slice.key(call.key);
                inv.arg("take")
                    .arg(bucket_kind(gcra))
                    .arg(l.limit)
                    .arg(l.window_us)
                    .arg(l.burst);
            }
        }
        inv.arg(want.need).arg(want.demand).arg(want.prefetch);
        if let Taker::Bucket { .. } = taker {
            let (id, units) = want.ends.unwrap_or((0, 0));
            inv.arg(crate::layout::BUCKET_SLICE_LIFE.as_micros() as i64)
                .arg(id)
                .arg(units);
        }
        let (frame, since) = scripts::frame_args(&l);
        inv.arg(frame).arg(since);
        let inv = &inv;
        let reply: Vec<i64> = self
            .guarded(|mut conn| async move { inv.invoke_async(&mut conn).await })
            .await?;
        let (grant, back) = wire::grant(taker, &reply)?;
        if back > 0 {
            // The slice this take ended gave its unspent units back.
            self.metrics
                .hot_units
                .with_label_values(&["returned"])
                .inc_by(back);
        }
        if grant.granted > 0 {
            self.metrics.hot_slices.with_label_values(&["taken"]).inc();
            self.metrics
                .hot_units
                .with_label_values(&["taken"])
                .inc_by(grant.granted);
        }
        Ok(grant)
    }

    /// Gives slices' unspent units back (`lua/slice.lua`); a failure leaves them to
    /// lapse with their window (never more admitted, only fewer).
    async fn give_back_slices(&self, returns: Vec<Return>) {
        use futures_util::StreamExt;
        // Up to RETURNS_IN_FLIGHT at once (they leave coalesced): a shutdown with many hot
        // keys gives them back within its second, and never floods Redis.
        futures_util::stream::iter(returns)
            .for_each_concurrent(RETURNS_IN_FLIGHT, |r| async move {
                let mut inv;
                match r.mark {
                    Mark::Window { slot, ledger } => {
                        inv = self.slice.key(&r.key);
                        inv.arg("return").arg(slot).arg(ledger).arg(r.units);
                    }
                    Mark::Bucket { id, gcra } => {
                        inv = self.bucket_slice.key(&r.key);
                        inv.arg("return")
                            .arg(bucket_kind(gcra))
                            .arg(r.limits.limit)
                            .arg(r.limits.window_us)
                            .arg(r.limits.burst)
                            .arg(id)
                            .arg(r.units);
                    }
                }
                let (frame, since) = scripts::frame_args(&r.limits);
                inv.arg(frame).arg(since);
                let inv = &inv;
                match self
                    .guarded(|mut conn| async move { inv.invoke_async::<i64>(&mut conn).await })
                    .await
                {
                    Ok(back) => {
                        self.metrics
                            .hot_slices
                            .with_label_values(&["returned"])
                            .inc();
                        self.metrics
                            .hot_units
                            .with_label_values(&["returned"])
                            .inc_by(back.max(0) as u64);
                        if back > 0 {
                            // Capacity came back: no instance may answer an old denial.
                            self.deny.invalidate(&r.key);
                            self.publish(&r.key).await;
                        }
                    }
                    Err(e) => {
                        self.metrics
                            .hot_slices
                            .with_label_values(&["not_returned"])
                            .inc();
                        tracing::debug!(error = %e, "giving a hot key's slice back failed");
                    }
                }
            })
            .await;
    }

    /// Tends the hot keys until `shutdown`: cools idle ones and gives back what they hold,
    /// starts a new rate epoch every [`hot::EPOCH`]; on shutdown gives every slice back.
    pub(crate) async fn tend_hot_keys(self: Arc<Self>, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(hot::COOL / 2);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut epoch = Instant::now();
        loop {
            let all = tokio::select! {
                _ = shutdown.cancelled() => true,
                _ = tick.tick() => false,
            };
            let now = Instant::now();
            if now.duration_since(epoch) >= hot::EPOCH {
                self.hot.new_epoch();
                epoch = now;
            }
            let (back, tally) = self.hot.tend(now, all);
            self.metrics.hot_entries.set(tally.keys as i64);
            self.metrics
                .hot_units
                .with_label_values(&["admitted"])
                .inc_by(tally.admitted);
            self.give_back_slices(back).await;
            if all {
                return;
            }
        }
    }

    /// Forgets what `key`'s user spent (see [`crate::store::call::Forget`]) and publishes the
    /// invalidation in the same script: if Redis refuses the PUBLISH, nothing changed and
    /// the error says so.
    pub(crate) async fn reset(
        &self,
        key: &str,
        forget: crate::store::call::Forget,
        ends: Option<crate::store::call::Ends<'_>>,
    ) -> Result<(), StoreError> {
        self.deny.invalidate(key);
        self.end_slice(key);
        let inv = {
            let mut inv = self.reset.key(key);
            inv.arg(&self.channel).arg(forget.word());
            if let Some(e) = ends {
                inv.key(e.mark).arg(e.keep_ms);
            }
            inv
        };
        let inv = &inv;
        self.guarded(|mut conn| async move { inv.invoke_async::<i64>(&mut conn).await })
            .await?;
        Ok(())
    }

    async fn load(
        &self,
        conn: &mut AsyncConn,
        algorithm: quotad_core::algorithm::Algorithm,
    ) -> redis::RedisResult<()> {
        self.load_source(conn, scripts::source(algorithm)).await
    }

    async fn load_source(&self, conn: &mut AsyncConn, source: &str) -> redis::RedisResult<()> {
        self.metrics.script_loads.inc();
        let _: redis::Value = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(source)
            .query_async(conn)
            .await?;
        Ok(())
    }

    /// Runs `f` on the live connection under the timeout, and turns the result into the
    /// breaker's bookkeeping and a [`StoreError`].
    async fn guarded<T, F, Fut>(&self, f: F) -> Result<T, StoreError>
    where
        F: FnOnce(AsyncConn) -> Fut,
        Fut: Future<Output = redis::RedisResult<T>>,
    {
        if self.breaker.is_open() {
            return Err(StoreError::CircuitOpen);
        }
        let Some((generation, conn)) = self.conn() else {
            return Err(StoreError::CircuitOpen);
        };
        let sent = std::time::Instant::now();
        let within = deadline::within(self.settings.timeout, f(conn)).await;
        self.metrics
            .store_call_duration
            .observe(sent.elapsed().as_secs_f64());
        let answer = match within {
            Within::InTime(r) => Some(r),
            Within::Late(r) => {
                self.metrics.store_late_replies.inc();
                Some(r)
            }
            Within::TimedOut => None,
        };
        let result = match answer {
            None => Err(StoreError::Timeout(self.settings.timeout)),
            Some(Ok(v)) => {
                self.breaker.record_success();
                return Ok(v);
            }
            Some(Err(e)) if is_connection_error(&e) => {
                self.lose_connection(generation, "redis connection lost");
                Err(StoreError::Connection(e.to_string()))
            }
            // The server answered: the connection is fine, the command was not.
            Some(Err(e)) => return Err(StoreError::Command(e.to_string())),
        };
        if self.breaker.record_failure() {
            tracing::info!(
                threshold = self.settings.breaker_threshold,
                "redis calls timing out: verifying that redis answers"
            );
            self.tripped.notify_one();
        }
        result
    }

    /// Opens the breaker (counted once per opening).
    fn trip(&self, why: &str) {
        if self.breaker.trip() {
            tracing::warn!("{why}: circuit opened");
            self.metrics.breaker_opens.inc();
            self.tripped.notify_one();
        }
        self.metrics.store_up.set(0);
    }

    /// Redis is suspect (timeouts in a row): a PING on the live connection, with a longer
    /// deadline than a call's, decides. Unanswered, the connection is dropped and the
    /// breaker opens (the probe reconnects); answered, the timeouts were not Redis's doing.
    async fn verify(&self) {
        let deadline = (self.settings.timeout * 4)
            .max(Duration::from_millis(100))
            .min(self.settings.connect_timeout.max(self.settings.timeout));
        let Some((generation, mut conn)) = self.conn() else {
            self.trip("redis connection gone");
            return;
        };
        let cmd = redis::cmd("PING");
        match tokio::time::timeout(deadline, cmd.query_async::<String>(&mut conn)).await {
            Ok(Ok(_)) => {
                tracing::info!("redis answered the verification PING; circuit stays closed");
                self.breaker.cleared();
            }
            Ok(Err(e)) if !is_connection_error(&e) => self.breaker.cleared(),
            failed => {
                let why = match failed {
                    Err(_) => format!("redis did not answer PING within {deadline:?}"),
                    Ok(Err(e)) => format!("redis PING failed: {e}"),
                    Ok(Ok(_)) => unreachable!("handled above"),
                };
                self.lose_connection(generation, &why);
            }
        }
    }

    fn lose_connection(&self, generation: u64, why: &str) {
        {
            let mut conn = self.conn.write().unwrap_or_else(|p| p.into_inner());
            match conn.as_ref() {
                Some((g, _)) if *g == generation => *conn = None,
                // Already replaced by a newer connection: this error is old news.
                _ => return,
            }
        }
        self.loaded.store(false, Ordering::Release);
        self.trip(why);
    }

    /// What every connection to this Redis is opened with (the janitor and the
    /// coordinator share it, so a rotation reaches their next connections too).
    pub(crate) fn shared_target(&self) -> SharedTarget {
        self.target.clone()
    }

    /// Rotates the credentials live: a connection opened with `new` (the same Redis,
    /// other credentials or TLS files) must authenticate and answer first; then `new` is
    /// what every connection is opened with, and the request path moves to a connection
    /// of its own, while calls in flight finish on the old one. Refused (`new` does not
    /// authenticate, or is malformed): nothing changes.
    pub(crate) async fn rotate(&self, new: Target) -> Result<(), StoreError> {
        new.check()
            .map_err(|e| StoreError::Connection(e.to_string()))?;
        let t = self.settings.timeout;
        let trial = async {
            let mut conn = new
                .connect(
                    self.settings.connect_timeout,
                    self.settings.connect_timeout.max(t),
                )
                .await?;
            let _: String = redis::cmd("PING").query_async(&mut conn).await?;
            Ok::<_, RedisError>(())
        };
        match tokio::time::timeout(self.settings.connect_timeout + t, trial).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(StoreError::Connection(e.to_string())),
            Err(_) => return Err(StoreError::Timeout(self.settings.connect_timeout)),
        }
        let old = self.target.get();
        self.target.set(new);
        if let Err(e) = self.probe().await {
            self.target.set((*old).clone());
            return Err(e);
        }
        Ok(())
    }

    /// One probe: connect, PING, load every script. On success installs the connection and
    /// closes the breaker.
    pub(crate) async fn probe(&self) -> Result<(), StoreError> {
        let t = self.settings.timeout;
        let attempt = async {
            let (mut conn, master) = self
                .target
                .get()
                .connect_tracked(
                    self.settings.connect_timeout,
                    self.settings.connect_timeout.max(t),
                )
                .await?;
            let _: String = redis::cmd("PING").query_async(&mut conn).await?;
            for a in quotad_core::algorithm::Algorithm::ALL {
                self.load(&mut conn, a).await?;
            }
            self.load_source(&mut conn, scripts::COMPOSITE).await?;
            self.load_source(&mut conn, scripts::SETTLE).await?;
            self.load_source(&mut conn, scripts::CONCURRENCY).await?;
            Ok::<_, RedisError>((conn, master))
        };
        match tokio::time::timeout(self.settings.connect_timeout + t * 9, attempt).await {
            Ok(Ok((conn, master))) => {
                self.install(conn.coalesced(crate::store::redis::coalesce::Counters {
                    pipelines: self.metrics.store_pipelines.clone(),
                    commands: self.metrics.store_pipelined_commands.clone(),
                }));
                *self.master.lock().unwrap_or_else(|p| p.into_inner()) = master;
                self.loaded.store(true, Ordering::Release);
                self.breaker.close();
                self.metrics.store_up.set(1);
                Ok(())
            }
            Ok(Err(e)) => Err(StoreError::Connection(e.to_string())),
            Err(_) => Err(StoreError::Timeout(self.settings.connect_timeout)),
        }
    }

    /// Through Sentinel: when the sentinels name another master than the live connection's,
    /// connects to it (a probe, which replaces the connection without opening the breaker,
    /// so no request fails over the switch). An unanswered question changes nothing.
    async fn follow_master(&self) {
        let asked = tokio::time::timeout(
            self.settings.connect_timeout,
            self.target.get().sentinel_master(),
        )
        .await;
        let Ok(Ok(Some(named))) = asked else {
            return;
        };
        let current = self
            .master
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if current.as_deref() == Some(named.as_str()) {
            return;
        }
        tracing::info!(
            from = current.as_deref().unwrap_or("?"),
            to = %named,
            "the sentinels name a new master: reconnecting"
        );
        if let Err(e) = self.probe().await {
            tracing::warn!(error = %e, "could not connect to the new master; staying on the old one");
        }
    }

    /// Keeps the connection alive until `shutdown`: probes while the breaker is open, checks
    /// health once a second while it is closed.
    pub(crate) async fn supervise(self: Arc<Self>, shutdown: CancellationToken) {
        let mut logged_down = false;
        loop {
            let wait = if self.breaker.is_open() {
                match self.probe().await {
                    Ok(()) => {
                        tracing::info!(redis = %self.target.get().describe(), "redis connected, scripts loaded");
                        logged_down = false;
                        HEALTH_INTERVAL
                    }
                    Err(e) => {
                        if !logged_down {
                            tracing::warn!(error = %e, "redis unreachable; policies use their on_store_error fallback");
                            logged_down = true;
                        }
                        self.settings.probe_interval
                    }
                }
            } else if self.breaker.is_suspect() {
                self.verify().await;
                if self.breaker.is_open() {
                    self.settings.probe_interval
                } else {
                    HEALTH_INTERVAL
                }
            } else {
                let ping = self
                    .guarded(|mut conn| async move {
                        redis::cmd("PING").query_async::<String>(&mut conn).await
                    })
                    .await;
                match ping {
                    Err(e) => tracing::warn!(error = %e, "redis health check failed"),
                    Ok(_) => self.follow_master().await,
                }
                if self.breaker.is_open() {
                    self.settings.probe_interval
                } else {
                    HEALTH_INTERVAL
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = self.tripped.notified() => {}
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }
}

/// What `call`, a check of `cost`, asks the deny cache.
fn question<'a>(call: &StoreCall<'a>, cost: u64) -> Question<'a> {
    Question {
        key: call.key,
        algorithm: call.algorithm,
        limits: call.limits,
        cost,
    }
}

/// Errors after which the connection is dropped and the probe reconnects. READONLY is
/// one: the server was a master and is now a replica (a Sentinel failover demoted it
/// while the connection stayed up), so the new master must be looked up again.
fn is_connection_error(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_unrecoverable_error()
        || e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_malformed_replies() {
        assert!(parse_verdict(&[1, 2, 3]).is_err());
        assert!(parse_verdict(&[2, 0, 0, 0]).is_err());
        assert!(parse_verdict(&[1, -1, 0, 0]).is_err());
        assert!(parse_verdict(&[0, 3, 10, 5]).is_ok());
    }
}
