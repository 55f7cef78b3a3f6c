//! The coordinator thread: holds (or waits for) the region's lock, runs the node's rounds
//! on Redis's clock, feeds it the peers' exchanges and replies, and publishes what it
//! knows for `/v1/status` and the metrics.
//!
//! A plain thread with a synchronous Redis connection, not a task: the node is a
//! sequential state machine whose store calls must complete in order (a grant leaves only
//! after its reservation is durable), and a blocking call here never stalls the request
//! path. Everything reaches it through one channel, so the node never runs concurrently
//! with itself.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use super::lock::Takeover;
use super::{Shared, Status, incarnation};
use quotad_core::clock::Clock;
use quotad_core::coordinator::message::{Exchange, ExchangeReply};
use quotad_core::coordinator::node::{LeaseStore, Link, Node};
use quotad_core::coordinator::{GlobalPolicy, RegionId};

/// Why the coordinator's store could not start an event or renew the region's lock.
#[derive(Debug, thiserror::Error)]
pub enum StoreFault {
    /// Redis refused a command or could not be reached.
    #[error(transparent)]
    Redis(#[from] redis::RedisError),
    /// Redis's clock was read over a round trip too long to place the reading.
    #[error("TIME took {0} us: clock not synced")]
    ClockNotSynced(i64),
    /// A write of the event failed earlier (the first error, as Redis gave it).
    #[error("{0}")]
    EventFailed(String),
}

/// The coordinator's store as the runtime drives it: a [`LeaseStore`] with events that
/// can fail as a whole, and the region's lock.
pub trait Coordinated: LeaseStore + Send {
    /// Starts an event (reads the store's clock; on a round, checks replication).
    fn begin(&mut self, round: bool) -> Result<(), StoreFault>;
    /// The first error since [`Coordinated::begin`]: the event is abandoned.
    fn failure(&self) -> Option<&str>;
    /// A write was refused because another instance holds the lock now.
    fn fenced(&self) -> bool;
    /// Extends the lock; `Ok(false)` if another instance holds it.
    fn renew(&mut self) -> Result<bool, StoreFault>;
    /// Gives the lock up.
    fn release(&mut self);
}

/// Where the coordinator's state lives: Redis (shared by the region's instances, one of
/// which holds the lock) or the embedded store (one instance per region).
pub(crate) trait Backend: Send + 'static {
    type Clock: Clock + Clone;
    type Store: Coordinated;
    /// Tries to become the region's coordinator: a store fenced by the takeover's token,
    /// the store's clock, and the takeover (its token, and the node's incarnation, above
    /// every earlier one a peer may have accepted: [`super::incarnation`]).
    fn try_lead(&mut self, shared: &Shared) -> Option<(Self::Store, Self::Clock, Takeover)>;
}

/// Replies taken in one event at most: one per peer of a round, with room for retries'.
const REPLIES_TOGETHER: usize = 64;

/// How often the coordinator thread adds its CPU time to the metric.
const CPU_EVERY: Duration = Duration::from_secs(1);

/// CPU time the calling thread has run, from `/proc/thread-self/schedstat` (its first
/// field, nanoseconds): `None` where there is no such file (not Linux).
fn thread_cpu() -> Option<Duration> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns: u64 = text.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(ns))
}

pub(crate) enum Event {
    /// A peer's exchange, authenticated; the reply goes back on `reply` (None: not now).
    Exchange {
        msg: Arc<Exchange>,
        reply: oneshot::Sender<Option<ExchangeReply>>,
    },
    /// A peer's reply to one of our exchanges, authenticated.
    Reply(ExchangeReply),
    /// `GET /v1/usage` of a global policy's key: its demand in every region as the
    /// coordinator last heard it (`Node::key_view`; None: not coordinating, or not tracked).
    KeyView {
        policy: String,
        key: String,
        reply: oneshot::Sender<Option<KeyView>>,
    },
    /// A reload changed the shared policies: the holder installs any new version now
    /// (and every round, should this event find the store failing; a non-leader ignores
    /// it: a takeover starts from the shared policies).
    Reloaded,
}

/// A key's demand per region (by region number): units per second, and how long ago it
/// was heard, µs.
pub(crate) type KeyView = Vec<Option<(f64, i64)>>;

pub(crate) struct Runtime<B: Backend> {
    pub(crate) shared: Arc<Shared>,
    pub(crate) backend: B,
    pub(crate) events: Receiver<Event>,
    pub(crate) outbound: mpsc::UnboundedSender<(RegionId, Exchange)>,
}

/// What one step of the loop leaves.
enum Step<B: Backend> {
    Go(Option<Box<Leading<B>>>),
    /// The channel is closed: the daemon is gone.
    Closed,
}

/// What the lock holder runs.
struct Leading<B: Backend> {
    node: Node<B::Clock>,
    store: B::Store,
    token: u64,
    next_round: Instant,
    /// The next read of demand between rounds (`None`: `coordinator.sense` is off).
    next_sense: Option<Instant>,
    next_renew: Instant,
    /// When `/v1/status` and the metrics were last published, and whether a message has
    /// changed what they would show since (published at most every tenth of a round, so
    /// that a grant shows within that, not at the next round, at a bounded cost).
    published: Instant,
    unpublished: bool,
    /// When a loan or reservation ends next: published then too (nothing else wakes the
    /// thread of a cut-off region whose loans run out between rounds).
    next_change: Option<Instant>,
    /// The node's count of deferred keys when last published (the metric adds the rest).
    deferred_published: u64,
}

impl<B: Backend> Runtime<B> {
    pub(crate) fn run(mut self) {
        let mut leading: Option<Box<Leading<B>>> = None;
        let mut closed = false;
        // The thread's CPU, read at most every CPU_EVERY (a file read per event would be
        // I/O on every message): the metric lags by that much and loses nothing.
        let mut cpu = thread_cpu();
        let mut cpu_read = Instant::now();
        while !self.shared.stopping() && !closed {
            // A panic (a bug, or data no config expects) must not leave the region with a
            // dead coordinator that still reports itself leader: step down, pause, go on.
            let step =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match leading.take() {
                    Some(l) => self.lead(l),
                    None => self.follow(),
                }));
            leading = match step {
                Ok(Step::Go(l)) => l,
                Ok(Step::Closed) => {
                    closed = true;
                    None
                }
                Err(_) => {
                    tracing::error!("coordinator panicked; stepping down");
                    self.shared.set_leader(None);
                    std::thread::sleep(self.shared.settings.lock);
                    None
                }
            };
            self.shared.set_leader(leading.as_ref().map(|l| l.token));
            if cpu_read.elapsed() >= CPU_EVERY
                && let (Some(before), Some(now)) = (cpu, thread_cpu())
            {
                let spent = now.saturating_sub(before).as_secs_f64();
                self.shared.metrics.global.coordinator_cpu.inc_by(spent);
                cpu = Some(now);
                cpu_read = Instant::now();
            }
        }
        if let Some(mut l) = leading
            && !l.store.fenced()
        {
            l.store.release();
        }
    }

    /// Not the holder: answer nothing, try the lock every tenth of its period.
    fn follow(&mut self) -> Step<B> {
        let poll = self.shared.settings.lock / 10;
        let deadline = Instant::now() + poll;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.events.recv_timeout(left) {
                Ok(Event::Exchange { reply, .. }) => {
                    let _ = reply.send(None);
                }
                Ok(Event::KeyView { reply, .. }) => {
                    let _ = reply.send(None);
                }
                Ok(Event::Reply(_) | Event::Reloaded) => {}
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => return Step::Closed,
            }
        }
        Step::Go(
            self.backend
                .try_lead(&self.shared)
                .and_then(|(store, clock, takeover)| self.start(store, clock, takeover))
                .map(Box::new),
        )
    }

    fn start(
        &mut self,
        mut store: B::Store,
        clock: B::Clock,
        takeover: Takeover,
    ) -> Option<Leading<B>> {
        let s = &self.shared.settings;
        let Takeover { token, drawn } = takeover;
        let incarnation = drawn.incarnation;
        if drawn.rebased {
            self.shared.metrics.global.incarnation_rebases.inc();
            tracing::warn!(
                incarnation,
                "the region's last incarnation was from the future (a clock was ahead when it was drawn); starting again below it"
            );
        }
        let taken = Instant::now();
        if store.begin(true).is_err() {
            store.release();
            return None;
        }
        let policies: Vec<GlobalPolicy> = self
            .shared
            .policies()
            .iter()
            .filter_map(|p| p.global_policy())
            .collect();
        let node = Node::start(
            s.me,
            s.regions.len(),
            s.params,
            clock,
            incarnation,
            policies,
            &mut store,
        );
        if let Some(e) = store.failure() {
            tracing::warn!(error = %e, "coordinator start failed; retrying");
            store.release();
            return None;
        }
        // Taking over many books takes time out of the lock's period: extend it now, so
        // the first round starts with a whole period ahead of it.
        match store.renew() {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!("coordinator lock lost while taking over; retrying");
                return None;
            }
            Err(e) => {
                tracing::warn!(error = %e, "coordinator lock renewal failed while taking over; retrying");
                store.release();
                return None;
            }
        }
        tracing::info!(
            token,
            incarnation,
            keys = node.tracked_keys(),
            took_ms = taken.elapsed().as_millis() as u64,
            "coordinator lock taken: this instance coordinates the region"
        );
        let now = Instant::now();
        Some(Leading {
            node,
            store,
            token,
            next_round: now,
            next_sense: self.sense_after(now),
            next_renew: now + s.lock / 5,
            published: now,
            unpublished: false,
            next_change: None,
            deferred_published: 0,
        })
    }

    /// The holder: one event (a message, or nothing until the next deadline), then the
    /// renewal and the round if they are due: checked after every message too, so a steady
    /// stream of them cannot starve either. `None` when it lost the lock or its store
    /// failed mid-event (the node is dropped: a restart with a new token).
    fn lead(&mut self, mut l: Box<Leading<B>>) -> Step<B> {
        let left = self.wake_at(&l).saturating_duration_since(Instant::now());
        match self.events.recv_timeout(left) {
            Ok(event) => self.on_event(&mut l, event),
            Err(RecvTimeoutError::Disconnected) => return Step::Closed,
            Err(RecvTimeoutError::Timeout) => {}
        }
        let now = Instant::now();
        if now >= l.next_renew && l.store.failure().is_none() && !self.renew(&mut l, now) {
            return Step::Go(None);
        }
        if now >= l.next_round && l.store.failure().is_none() {
            if self.incarnation_outrun(&l) {
                l.store.release();
                return Step::Go(None);
            }
            self.round(&mut l);
            l.next_round = now + jittered(self.shared.settings.params.round_us);
        }
        if l.next_sense.is_some_and(|t| now >= t) && l.store.failure().is_none() {
            self.sense(&mut l);
            l.next_sense = self.sense_after(now);
        }
        let changed = l.next_change.is_some_and(|t| now >= t);
        if (changed || l.unpublished && now >= l.published + self.publish_gap())
            && l.store.failure().is_none()
        {
            self.publish(&mut l);
        }
        Self::after_event(l)
    }

    /// Whether this life's incarnation is past what a takeover could draw now by this
    /// host's wall clock (it went back by more than the skew since the takeover): peers
    /// would refuse every message of it until real time caught up, so the holder steps
    /// down and takes over again, with an incarnation they accept.
    fn incarnation_outrun(&self, l: &Leading<B>) -> bool {
        let max_skew_ms = self.shared.settings.max_skew.as_millis() as u64;
        let wall_ms = incarnation::now_ms();
        let future = incarnation::from_the_future(l.node.incarnation(), wall_ms, max_skew_ms);
        if future {
            tracing::warn!(
                incarnation = l.node.incarnation(),
                wall_ms,
                "this host's clock went back since the takeover: taking over again with a new incarnation"
            );
        }
        future
    }

    /// The least time between two publications of `/v1/status` and the metrics after a
    /// message: a tenth of a round, so a grant shows within that at a bounded cost.
    fn publish_gap(&self) -> Duration {
        Duration::from_micros(self.shared.settings.params.round_us.max(0) as u64 / 10)
    }

    /// When the holder must wake without a message: the next round, renewal, pending
    /// publication or loan end, whichever comes first (a message may wake it earlier).
    fn wake_at(&self, l: &Leading<B>) -> Instant {
        let mut wake = l.next_round.min(l.next_renew);
        if let Some(t) = l.next_sense {
            wake = wake.min(t);
        }
        if l.unpublished {
            wake = wake.min(l.published + self.publish_gap());
        }
        if let Some(t) = l.next_change {
            wake = wake.min(t);
        }
        wake
    }

    /// One message to the node, in an event of its own: a peer's exchange is answered
    /// (None when the store failed, so no grant leaves without its durable reservation),
    /// a reply is applied; either may let the node send exchanges before the round.
    fn on_event(&self, l: &mut Leading<B>, event: Event) {
        match event {
            // The handler already gave up on this one (it answered 503): the peer retries.
            Event::Exchange { reply, .. } if reply.is_closed() => {}
            Event::Exchange { msg, reply } => {
                if l.store.begin(false).is_ok() {
                    let r = l.node.on_exchange(&msg, &mut l.store);
                    let ok = l.store.failure().is_none();
                    let _ = reply.send(if ok { r } else { None });
                    self.send(l.node.early_exchanges(&mut l.store));
                    l.unpublished = true;
                } else {
                    let _ = reply.send(None);
                }
            }
            Event::KeyView { reply, .. } if reply.is_closed() => {}
            Event::KeyView { policy, key, reply } => {
                let _ = reply.send(l.node.key_view(&policy, &key));
            }
            Event::Reply(r) => {
                // The replies already queued behind this one are taken with it (the
                // round's lenders answer together): each book is then written once.
                let mut replies = vec![r];
                let mut next = None;
                while replies.len() < REPLIES_TOGETHER {
                    match self.events.try_recv() {
                        Ok(Event::Reply(r)) => replies.push(r),
                        Ok(other) => {
                            next = Some(other);
                            break;
                        }
                        Err(_) => break,
                    }
                }
                if l.store.begin(false).is_ok() {
                    l.node.on_replies(&replies, &mut l.store);
                    self.send(l.node.early_exchanges(&mut l.store));
                    l.unpublished = true;
                }
                // What came after them, as its own event (not a reply: no further drain),
                // unless the store failed: the holder then steps down, and a peer's
                // exchange is answered "not now", as when its event cannot begin.
                match next {
                    Some(event) if l.store.failure().is_none() => self.on_event(l, event),
                    Some(Event::Exchange { reply, .. }) => {
                        let _ = reply.send(None);
                    }
                    _ => {}
                }
            }
            Event::Reloaded => {
                if l.store.begin(false).is_ok() {
                    self.install_new_versions(l);
                }
            }
        }
    }

    /// Installs every global policy whose loaded version is newer than the node's
    /// (`Node::set_policy` ignores the others, so this is cheap and idempotent: called on
    /// a reload and at every round, so a reload that met a failing store still lands).
    fn install_new_versions(&self, l: &mut Leading<B>) {
        for p in self.shared.policies() {
            let Some(loaded) = p.global.as_ref().map(|g| g.version) else {
                continue;
            };
            if l.node.version(&p.name).is_some_and(|v| v >= loaded) {
                continue;
            }
            let Some(g) = p.global_policy() else { continue };
            tracing::info!(policy = %g.name, version = g.version, "installing a new version of a global policy");
            l.node.set_policy(g, &mut l.store);
            l.unpublished = true;
        }
    }

    /// Extends the lock (every fifth of its period). `false` when this instance no longer
    /// holds it, or cannot tell: it must stop coordinating before another one starts.
    fn renew(&self, l: &mut Leading<B>, now: Instant) -> bool {
        match l.store.renew() {
            Ok(true) => {
                l.next_renew = now + self.shared.settings.lock / 5;
                true
            }
            Ok(false) => {
                tracing::warn!("coordinator lock lost to another instance");
                false
            }
            Err(e) => {
                tracing::warn!(error = %e, "coordinator lock renewal failed; stepping down");
                false
            }
        }
    }

    /// Demand read between rounds (`coordinator.sense`): what moved goes to the peers
    /// concerned in early exchanges, sent only if the store kept up; timed
    /// (`quotad_sense_duration_seconds`).
    fn sense(&self, l: &mut Leading<B>) {
        if l.store.begin(false).is_err() {
            return;
        }
        let started = Instant::now();
        l.node.sense(&mut l.store);
        if l.store.failure().is_none() {
            self.send(l.node.early_exchanges(&mut l.store));
            l.unpublished = true;
        }
        let took = started.elapsed().as_secs_f64();
        self.shared.metrics.global.sense_duration.observe(took);
    }

    /// When to sense next after `now`, if at all.
    fn sense_after(&self, now: Instant) -> Option<Instant> {
        let us = self.shared.settings.params.sense_us;
        (us > 0).then(|| now + Duration::from_micros(us as u64))
    }

    /// One round of the node, its exchanges sent only if the store kept up, timed
    /// (`quotad_round_duration_seconds`, and a warning when a round eats into the lock
    /// period), then published.
    fn round(&self, l: &mut Leading<B>) {
        if l.store.begin(true).is_err() {
            return;
        }
        let started = Instant::now();
        self.install_new_versions(l);
        let msgs = l.node.round(&mut l.store);
        if l.store.failure().is_none() {
            self.send(msgs);
        }
        let global = &self.shared.metrics.global;
        global.rounds.inc();
        let took = started.elapsed();
        global.round_duration.observe(took.as_secs_f64());
        if took > self.shared.settings.lock / 4 {
            tracing::warn!(
                took_ms = took.as_millis() as u64,
                keys = l.node.tracked_keys(),
                "a coordinator round took over a quarter of the lock period"
            );
        }
        self.publish(l);
    }

    /// Keeps the holder going, unless its store failed mid-event: the node's view of the
    /// store is then unknown, so it is dropped (and the lock released, unless another
    /// instance already holds it) for a restart with a new token.
    fn after_event(mut l: Box<Leading<B>>) -> Step<B> {
        if let Some(e) = l.store.failure() {
            tracing::warn!(error = %e, fenced = l.store.fenced(), "coordinator store failed mid-event; restarting the coordinator");
            if !l.store.fenced() {
                l.store.release();
            }
            return Step::Go(None);
        }
        Step::Go(Some(l))
    }

    fn send(&self, msgs: Vec<(RegionId, Exchange)>) {
        for m in msgs {
            let _ = self.outbound.send(m);
        }
    }

    fn publish(&self, l: &mut Leading<B>) {
        l.published = Instant::now();
        l.unpublished = false;
        // A millisecond past the end, so that the republished rate no longer counts it.
        l.next_change = l.node.next_change_in().and_then(|us| {
            let wait = Duration::from_micros(us.max(0) as u64) + Duration::from_millis(1);
            l.published.checked_add(wait)
        });
        let s = &self.shared.settings;
        let node = &l.node;
        // `/v1/status` lists the busiest keys only: with 100,000 tracked keys the whole list
        // is megabytes per request (the metrics below sum over all of them).
        let summary = node.key_summary(super::STATUS_KEYS);
        let mut status = Status {
            stats: node.stats(),
            peers: Vec::new(),
            keys: summary.busiest,
            keys_total: summary.tracked,
            policies: node.policy_status(),
            as_of_us: Some(summary.at_us),
        };
        let m = &self.shared.metrics.global;
        let deferred = status.stats.keys_deferred;
        m.exchange_keys_deferred
            .inc_by(deferred.saturating_sub(l.deferred_published));
        l.deferred_published = deferred;
        for p in &s.peers {
            let link = node.link(p.id);
            let rtt = node.rtt_us(p.id);
            m.peer_up
                .with_label_values(&[&p.region])
                .set((link == Link::Connected) as i64);
            if let Some(rtt) = rtt {
                m.peer_rtt_seconds
                    .with_label_values(&[&p.region])
                    .set(rtt as f64 / 1e6);
                self.shared.set_rtt(p.id, rtt);
            }
            status.peers.push(super::PeerStatus {
                region: p.region.clone(),
                link,
                rtt_ms: rtt.map(|r| r as f64 / 1000.0),
            });
        }
        for policy in self.shared.policies().iter().filter(|p| p.global.is_some()) {
            let name = policy.name.as_str();
            // A policy loaded but not installed yet counts nothing.
            let sum = summary
                .totals
                .iter()
                .find(|t| t.policy == name)
                .cloned()
                .unwrap_or_default();
            m.share_rate
                .with_label_values(&[name, &s.regions[s.me.index()]])
                .set(sum.enforced);
            m.lent_rate.with_label_values(&[name]).set(sum.lent);
            m.borrowed_rate.with_label_values(&[name]).set(sum.borrowed);
            m.demand_rate.with_label_values(&[name]).set(sum.demand);
            m.hot_keys.with_label_values(&[name]).set(sum.keys as i64);
        }
        self.shared.set_status(status);
    }
}

/// A round interval with ±10% jitter, so regions started together do not stay in step.
fn jittered(round_us: i64) -> Duration {
    let j = rand::random_range(-0.1..0.1);
    Duration::from_micros((round_us as f64 * (1.0 + j)) as u64)
}
