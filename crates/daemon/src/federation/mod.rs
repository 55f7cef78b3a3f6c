//! Global budgets between real processes: this region's coordinator and its links to the
//! others. The protocol itself is [`quotad_core::coordinator`] (pure); this module runs it.
//!
//! - [`lock`]: which of the region's instances coordinates (a Redis lock with a fencing
//!   token that every coordinator write checks).
//! - [`incarnation`]: the number a takeover draws for its peers, from the wall clock.
//! - [`lease_store`]: the node's store and clock, both Redis's (`lua/global/`).
//! - [`runtime`]: the coordinator thread (rounds, incoming exchanges, replies, status).
//! - [`auth`]: signed exchanges (HMAC-SHA256, timestamps, nonces).
//! - [`peers`]: the HTTP client that sends exchanges and retries them.
//!
//! Data flow: a peer's POST → [`Federation::exchange`] (verify; refused requests never
//! reach the node) → the runtime's channel → `Node::on_exchange` → reply back to the
//! handler, signed. Rounds run on the thread; their exchanges go to [`peers`], whose
//! verified replies come back through the same channel.

pub(crate) mod auth;
pub(crate) mod books;
pub(crate) mod incarnation;
pub(crate) mod lease_store;
pub(crate) mod limits;
pub(crate) mod lock;
pub(crate) mod memory;
pub(crate) mod peers;
pub(crate) mod runtime;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use serde::Serialize;
use tokio::sync::{mpsc, oneshot};

use crate::config::{Encoding, GlobalSettings};
use crate::layout::Layouts;
use crate::metrics::Metrics;
use crate::policy::Policy;
use auth::{Rejection, Signed};
use quotad_core::coordinator::message::{Exchange, ExchangeReply};
use quotad_core::coordinator::node::{KeyStatus, Link, NodeStats, PolicyStatus};
use quotad_core::coordinator::wire::{self, KeyTable};
use quotad_core::coordinator::{GlobalPolicy, RegionId};
use runtime::Event;

/// What the coordinator thread last published (whether it leads is `Shared`'s token).
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Status {
    pub(crate) stats: NodeStats,
    pub(crate) peers: Vec<PeerStatus>,
    /// The [`STATUS_KEYS`] keys with the most demand here (all, when there are fewer).
    pub(crate) keys: Vec<KeyStatus>,
    /// Keys the coordinator tracks.
    pub(crate) keys_total: usize,
    /// Each global policy's version and escrow in force here (a re-split's progress).
    pub(crate) policies: Vec<PolicyStatus>,
    /// The region's Redis clock (µs since the epoch) at which the keys' figures hold;
    /// None until a coordinator here has published.
    pub(crate) as_of_us: Option<i64>,
}

/// Keys listed in `/v1/status` at most.
pub(crate) const STATUS_KEYS: usize = 1000;

#[derive(Debug, Clone, Serialize)]
pub(crate) struct PeerStatus {
    pub(crate) region: String,
    pub(crate) link: Link,
    pub(crate) rtt_ms: Option<f64>,
}

/// State shared by the HTTP handlers, the coordinator thread and the peer client.
pub(crate) struct Shared {
    pub(crate) settings: GlobalSettings,
    /// The policies as loaded now (a reload may install a new version of a global one).
    policies: RwLock<Vec<Arc<Policy>>>,
    /// Where the policies' keys live (the store's layout).
    pub(crate) layouts: Arc<Layouts>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) instance: String,
    leader_token: AtomicU64,
    stopping: AtomicBool,
    status: RwLock<Status>,
    /// Per region id: the last round trip (us; -1 unknown) and the peer URL in use.
    rtt_us: Vec<AtomicI64>,
    url: Vec<AtomicUsize>,
}

impl Shared {
    /// Nobody leads yet and nothing is known of the peers; `instance` is a random id, so
    /// that the region's lock tells this process from any other (a restart included).
    fn new(
        settings: GlobalSettings,
        policies: Vec<Arc<Policy>>,
        layouts: Arc<Layouts>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let n = settings.regions.len();
        Shared {
            settings,
            policies: RwLock::new(policies),
            layouts,
            metrics,
            instance: format!("{:016x}", rand::random::<u64>()),
            leader_token: AtomicU64::new(0),
            stopping: AtomicBool::new(false),
            status: RwLock::new(Status::default()),
            rtt_us: (0..n).map(|_| AtomicI64::new(-1)).collect(),
            url: (0..n).map(|_| AtomicUsize::new(0)).collect(),
        }
    }

    pub(crate) fn policies(&self) -> Vec<Arc<Policy>> {
        self.policies
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub(crate) fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    pub(crate) fn is_leader(&self) -> bool {
        self.leader_token.load(Ordering::Acquire) != 0
    }

    fn set_leader(&self, token: Option<u64>) {
        let t = token.unwrap_or(0);
        if self.leader_token.swap(t, Ordering::AcqRel) != t {
            let region = &self.settings.regions[self.settings.me.index()];
            self.metrics
                .global
                .leader
                .with_label_values(&[region])
                .set((t != 0) as i64);
            if t == 0 {
                *self.status.write().unwrap_or_else(|p| p.into_inner()) = Status::default();
            }
        }
    }

    /// `quotad_exchange_bytes_total{peer,direction}`.
    fn count_bytes(&self, peer: &str, direction: &str, bytes: usize) {
        self.metrics
            .global
            .exchange_bytes
            .with_label_values(&[peer, direction])
            .inc_by(bytes as u64);
    }

    /// `quotad_exchange_keys_total{peer}`: the keys of one exchange sent.
    fn count_keys(&self, peer: &str, msg: &Exchange) {
        let keys: usize = msg.policies.iter().map(|p| p.keys.len()).sum();
        self.metrics
            .global
            .exchange_keys
            .with_label_values(&[peer])
            .inc_by(keys as u64);
    }

    /// Keys a peer's dictionary may hold, at each end ([`wire::dictionary_cap`]): with the
    /// defaults and 256-byte keys, at most 5 MB per peer.
    fn dictionary_cap(&self) -> usize {
        wire::dictionary_cap(self.settings.params.max_exchange_keys)
    }

    fn set_status(&self, s: Status) {
        *self.status.write().unwrap_or_else(|p| p.into_inner()) = s;
    }

    pub(crate) fn status(&self) -> Status {
        self.status
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn set_rtt(&self, peer: RegionId, us: i64) {
        if let Some(a) = self.rtt_us.get(peer.index()) {
            a.store(us, Ordering::Relaxed);
        }
    }

    fn rtt_us(&self, peer: RegionId) -> Option<i64> {
        let v = self.rtt_us.get(peer.index())?.load(Ordering::Relaxed);
        (v >= 0).then_some(v)
    }

    fn url_index(&self, peer: RegionId) -> usize {
        self.url
            .get(peer.index())
            .map_or(0, |a| a.load(Ordering::Relaxed))
    }

    /// The URL at `idx` failed: move on, unless another attempt already did.
    fn next_url(&self, peer: RegionId, idx: usize) {
        if let Some(a) = self.url.get(peer.index()) {
            let _ = a.compare_exchange(idx, idx + 1, Ordering::Relaxed, Ordering::Relaxed);
        }
    }
}

/// Where the region's coordinator keeps its state.
pub(crate) enum BackendChoice {
    /// The region's Redis: shared by its instances, one of which holds the lock.
    Redis {
        /// Shared with the request path: credentials rotated live reach the
        /// coordinator's next connection.
        target: crate::store::SharedTarget,
        timeout: Duration,
    },
    /// The embedded store of this process (one instance per region).
    Memory(Arc<crate::store::memory::MemoryStore>),
}

/// The handle the app and the API hold.
pub(crate) struct Federation {
    pub(crate) shared: Arc<Shared>,
    events: std::sync::mpsc::Sender<Event>,
    verifier: auth::Verifier,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Per peer (in `settings.peers` order): KiB of request bodies being read or handled.
    /// Bounds what unauthenticated bodies can make quotad hold: the HMAC needs the whole
    /// body, so until then anyone who names a peer and a fresh timestamp is a suspect.
    budgets: Vec<Arc<tokio::sync::Semaphore>>,
    /// Per peer (in `settings.peers` order): the keys it numbered in binary exchanges.
    tables: Vec<Mutex<KeyTable>>,
}

/// A peer request that passed every check its headers allow, holding its share of that
/// peer's body budget until it is answered.
pub(crate) struct Admitted {
    signed: Signed,
    peer: usize,
    /// Bytes its body may have (its declared length).
    pub(crate) max_bytes: usize,
    _budget: tokio::sync::OwnedSemaphorePermit,
}

/// Requests from one peer in flight: twice the largest body (a round's exchange and an
/// early one, with retries of small ones around them).
const BUDGET_BODIES: usize = 2;

/// The coordinator's answer to a peer's exchange, and its signature for the peer.
pub(crate) struct SignedReply {
    pub(crate) body: Vec<u8>,
    /// In the binary form (the request was); JSON otherwise.
    pub(crate) binary: bool,
    pub(crate) signature: String,
}

fn spawn_runtime<B: runtime::Backend>(
    shared: Arc<Shared>,
    backend: B,
    events: std::sync::mpsc::Receiver<Event>,
    outbound: mpsc::UnboundedSender<(RegionId, Exchange)>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let runtime = runtime::Runtime {
        shared,
        backend,
        events,
        outbound,
    };
    std::thread::Builder::new()
        .name("coordinator".into())
        .spawn(move || runtime.run())
}

impl BackendChoice {
    /// Starts the coordinator thread on this backend. On Redis, its lock is renewed every
    /// fifth of the period; a dead holder's lock lapses within 0.8 of it and the others
    /// poll every tenth: a takeover within one period.
    fn spawn(
        self,
        shared: &Arc<Shared>,
        events: std::sync::mpsc::Receiver<Event>,
        outbound: mpsc::UnboundedSender<(RegionId, Exchange)>,
    ) -> Result<std::thread::JoinHandle<()>, redis::RedisError> {
        let spawned = match self {
            BackendChoice::Redis { target, timeout } => {
                let lock = lock::Lock::new(
                    shared.layouts.layout(),
                    shared.instance.clone(),
                    shared.settings.lock.mul_f64(0.8),
                    shared.settings.max_skew,
                );
                let backend = lease_store::RedisBackend {
                    target,
                    lock: Arc::new(lock),
                    timeout,
                    conn: None,
                    warned: false,
                };
                spawn_runtime(shared.clone(), backend, events, outbound)
            }
            BackendChoice::Memory(store) => {
                let backend = memory::MemoryBackend { store, last: None };
                spawn_runtime(shared.clone(), backend, events, outbound)
            }
        };
        spawned.map_err(start_error)
    }
}

/// Start-up failures that are not Redis's, in the error type [`Federation::start`]
/// returns (the app reports them all the same way).
fn start_error(e: impl std::error::Error + Send + Sync + 'static) -> redis::RedisError {
    redis::RedisError::from(std::io::Error::other(e))
}

/// Checks peers' signatures: one secret per peer region, timestamps within `max_skew`.
fn verifier(settings: &GlobalSettings) -> auth::Verifier {
    let me = &settings.regions[settings.me.index()];
    let secrets: HashMap<String, Vec<u8>> = settings
        .peers
        .iter()
        .map(|p| (p.region.clone(), p.secret.0.clone()))
        .collect();
    auth::Verifier::new(me, secrets, settings.max_skew.as_millis() as i64)
}

/// A zero series for every rejection reason, this region's leader gauge and each peer's
/// exchange series, so that rates and alerts over them work before the first event.
fn preregister(metrics: &Metrics, settings: &GlobalSettings) {
    for r in Rejection::ALL {
        metrics
            .global
            .exchange_rejected
            .with_label_values(&[r.reason()]);
    }
    let me = &settings.regions[settings.me.index()];
    metrics.global.leader.with_label_values(&[me]).set(0);
    let g = &metrics.global;
    for p in &settings.peers {
        let binary = settings.encoding == Encoding::Binary;
        g.exchange_binary
            .with_label_values(&[&p.region])
            .set(binary as i64);
        g.exchange_renumbered.with_label_values(&[&p.region]);
        g.exchange_keys.with_label_values(&[&p.region]);
        for side in ["ours", "theirs"] {
            g.exchange_dictionary_keys
                .with_label_values(&[&p.region, side]);
        }
        for direction in ["sent", "received"] {
            g.exchange_bytes.with_label_values(&[&p.region, direction]);
        }
    }
}

/// Spawns the client that sends the coordinator's exchanges to the peers, with timeouts
/// that follow the round: a connection within one, an answer within three.
fn start_peer_client(
    shared: &Arc<Shared>,
    events: std::sync::mpsc::Sender<Event>,
    outbound: mpsc::UnboundedReceiver<(RegionId, Exchange)>,
) -> Result<(), redis::RedisError> {
    let round = Duration::from_micros(shared.settings.params.round_us as u64);
    let http = reqwest::Client::builder()
        .timeout(round * 3)
        .connect_timeout(round)
        .build()
        .map_err(start_error)?;
    let cap = shared.dictionary_cap();
    let client = Arc::new(peers::PeerClient {
        shared: shared.clone(),
        http,
        events,
        wires: (0..shared.settings.peers.len())
            .map(|_| Mutex::new(peers::PeerWire::new(cap)))
            .collect(),
    });
    tokio::spawn(client.run(outbound));
    Ok(())
}

/// One body budget per peer (in `settings.peers` order), in KiB: [`BUDGET_BODIES`] of the
/// largest exchange, so that unauthenticated bodies cannot make quotad hold more.
fn body_budgets(settings: &GlobalSettings) -> Vec<Arc<tokio::sync::Semaphore>> {
    let kib = (settings.max_exchange_bytes.div_ceil(1024) * BUDGET_BODIES).max(1);
    settings
        .peers
        .iter()
        .map(|_| Arc::new(tokio::sync::Semaphore::new(kib)))
        .collect()
}

impl Federation {
    /// Starts the coordinator thread and the peer client (on the current tokio runtime).
    pub(crate) fn start(
        settings: GlobalSettings,
        policies: Vec<Arc<Policy>>,
        layouts: Arc<Layouts>,
        backend: BackendChoice,
        metrics: Arc<Metrics>,
    ) -> Result<Arc<Federation>, redis::RedisError> {
        let verifier = verifier(&settings);
        preregister(&metrics, &settings);
        let shared = Arc::new(Shared::new(settings, policies, layouts, metrics));
        let (events_tx, events_rx) = std::sync::mpsc::channel();
        let (out_tx, out_rx) = mpsc::unbounded_channel();
        let thread = backend.spawn(&shared, events_rx, out_tx)?;
        start_peer_client(&shared, events_tx.clone(), out_rx)?;
        let cap = shared.dictionary_cap();
        Ok(Arc::new(Federation {
            budgets: body_budgets(&shared.settings),
            tables: (0..shared.settings.peers.len())
                .map(|_| Mutex::new(KeyTable::new(cap)))
                .collect(),
            shared,
            events: events_tx,
            verifier,
            thread: Mutex::new(Some(thread)),
        }))
    }

    /// A reload's policies. The config layer let through no change of a global policy's
    /// rate, burst, algorithm or mode, and a re-split only with a higher version: the
    /// coordinator installs each new version decrease-first (`Node::set_policy`), and a
    /// takeover starts from these.
    pub(crate) fn reload(&self, policies: Vec<Arc<Policy>>) {
        *self
            .shared
            .policies
            .write()
            .unwrap_or_else(|p| p.into_inner()) = policies;
        let _ = self.events.send(Event::Reloaded);
    }

    /// Stops the coordinator thread (releasing the lock) and waits for it, bounded.
    pub(crate) async fn stop(&self) {
        self.shared.stopping.store(true, Ordering::Release);
        let handle = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = handle {
            let _ = tokio::task::spawn_blocking(move || h.join()).await;
        }
    }

    /// Counts a refused peer request (`quotad_exchange_rejected_total{reason}`).
    pub(crate) fn count_rejection(&self, r: Rejection) {
        self.shared
            .metrics
            .global
            .exchange_rejected
            .with_label_values(&[r.reason()])
            .inc();
    }

    /// `POST /v1/peer/exchange`, before its body is read: everything the headers settle
    /// (signed form, known peer, fresh, not replayed, this instance coordinates, a length
    /// within what a round can carry), then a share of that peer's body budget.
    /// `declared_len` is the request's Content-Length.
    pub(crate) fn admit(
        &self,
        signed: Signed,
        declared_len: Option<u64>,
    ) -> Result<Admitted, Rejection> {
        let len = declared_len.ok_or(Rejection::LengthRequired)?;
        self.verifier.precheck(&signed, len, auth::wall_ms())?;
        let s = &self.shared.settings;
        let peer = s
            .peers
            .iter()
            .position(|p| p.region == signed.from)
            .ok_or(Rejection::UnknownPeer)?;
        if !self.shared.is_leader() {
            return Err(Rejection::NotCoordinator);
        }
        if len > s.max_exchange_bytes as u64 {
            return Err(Rejection::TooLarge);
        }
        let kib = (len as usize).div_ceil(1024).max(1) as u32;
        let budget = self.budgets[peer]
            .clone()
            .try_acquire_many_owned(kib)
            .map_err(|_| Rejection::Busy)?;
        Ok(Admitted {
            signed,
            peer,
            max_bytes: len as usize,
            _budget: budget,
        })
    }

    /// The rest of `POST /v1/peer/exchange`: verify the body's signature, check its
    /// values, hand it to the coordinator, sign its reply.
    pub(crate) async fn exchange(
        &self,
        admitted: Admitted,
        body: &[u8],
    ) -> Result<SignedReply, Rejection> {
        let signed = &admitted.signed;
        self.verifier.verify(signed, body, auth::wall_ms())?;
        let s = &self.shared.settings;
        let peer = &s.peers[admitted.peer];
        self.shared
            .count_bytes(&peer.region, "received", body.len());
        let binary = wire::is_binary(body);
        let msg = Arc::new(self.decode_from(body, admitted.peer)?);
        let me = self.shared.leader_token.load(Ordering::Acquire);
        if let Err(why) = validate_exchange(&msg, signed.timestamp_ms, me, s) {
            tracing::warn!(peer = %peer.region, why, "peer exchange refused: a value is out of bounds");
            return Err(Rejection::Invalid);
        }
        let reply = self.ask_coordinator(msg.clone()).await?;
        // A reply goes in the request's form; one the binary form cannot carry (it does
        // not follow its request's order) goes as JSON, which the peer tells by its first
        // byte.
        let encoded = binary.then(|| wire::encode_reply(&msg, &reply)).flatten();
        let binary = encoded.is_some();
        let body = encoded.unwrap_or_else(|| serde_json::to_vec(&reply).unwrap_or_default());
        self.shared.count_bytes(&peer.region, "sent", body.len());
        let signature = auth::sign_reply(&peer.secret.0, &signed.nonce, &body);
        Ok(SignedReply {
            body,
            binary,
            signature,
        })
    }

    /// The exchange in a body (binary, or JSON), which must speak for the region that
    /// signed it. A region pinned to JSON refuses the binary form as malformed, as
    /// versions before it do: the peer goes back to JSON.
    fn decode_from(&self, body: &[u8], peer: usize) -> Result<Exchange, Rejection> {
        let id = self.shared.settings.peers[peer].id;
        let decoded = if wire::is_binary(body) {
            if self.shared.settings.encoding == Encoding::Json {
                return Err(Rejection::Malformed);
            }
            let mut table = self.tables[peer].lock().unwrap_or_else(|p| p.into_inner());
            let decoded = table.decode(body);
            self.shared
                .metrics
                .global
                .exchange_dictionary_keys
                .with_label_values(&[&self.shared.settings.peers[peer].region, "theirs"])
                .set(table.len() as i64);
            decoded.map_err(|e| {
                if e.is_dictionary() {
                    Rejection::UnknownKeys
                } else {
                    tracing::debug!(error = %e, "binary exchange not readable");
                    Rejection::Malformed
                }
            })?
        } else {
            serde_json::from_slice::<Exchange>(body).map_err(|_| Rejection::Malformed)?
        };
        if decoded.from != id {
            return Err(Rejection::Malformed);
        }
        Ok(decoded)
    }

    /// A global policy's key as the region's coordinator last heard of it in every
    /// region, when this instance coordinates and tracks the key (asked of the
    /// coordinator thread; at most 100 ms: a status read never waits on a busy round).
    pub(crate) async fn key_view(&self, policy: &str, key: &str) -> Option<runtime::KeyView> {
        if !self.shared.is_leader() {
            return None;
        }
        let (tx, rx) = oneshot::channel();
        let ask = Event::KeyView {
            policy: policy.to_owned(),
            key: key.to_owned(),
            reply: tx,
        };
        self.events.send(ask).ok()?;
        tokio::time::timeout(Duration::from_millis(100), rx)
            .await
            .ok()?
            .ok()?
    }

    /// Hands an exchange to the coordinator thread and waits at most one round for its
    /// reply; an instance that does not (or no longer) coordinate answers nothing.
    async fn ask_coordinator(&self, msg: Arc<Exchange>) -> Result<ExchangeReply, Rejection> {
        if !self.shared.is_leader() {
            return Err(Rejection::NotCoordinator);
        }
        let (tx, rx) = oneshot::channel();
        if self
            .events
            .send(Event::Exchange { msg, reply: tx })
            .is_err()
        {
            return Err(Rejection::NotCoordinator);
        }
        let round = Duration::from_micros(self.shared.settings.params.round_us as u64);
        match tokio::time::timeout(round, rx).await {
            Ok(Ok(Some(r))) => Ok(r),
            _ => Err(Rejection::NotCoordinator),
        }
    }

    /// What `GET /v1/status` shows of global budgets, as of the last round.
    pub(crate) fn report(&self) -> StatusReport {
        let s = &self.shared.settings;
        StatusReport {
            regions: s.regions.clone(),
            instance: self.shared.instance.clone(),
            leader: self.shared.is_leader(),
            token: self.shared.leader_token.load(Ordering::Acquire),
            status: self.shared.status(),
            policies: self
                .shared
                .policies()
                .iter()
                .filter_map(|p| p.global_policy())
                .collect(),
        }
    }
}

/// A snapshot of global budgets in this instance: what `/v1/status` shows.
pub(crate) struct StatusReport {
    pub(crate) regions: Vec<String>,
    pub(crate) instance: String,
    pub(crate) leader: bool,
    /// The fencing token while this instance coordinates; 0 otherwise.
    pub(crate) token: u64,
    pub(crate) status: Status,
    pub(crate) policies: Vec<GlobalPolicy>,
}

/// The bounds a signed exchange must keep before its coordinator sees it: at most
/// `max_exchange_keys` keys, none longer than a client's key may be, an incarnation no
/// later than the message's own (verified) timestamp plus the allowed skew (incarnations
/// are the sender's store clock in ms at its takeover), and ours as it names it no later
/// than ours. A message past them is refused whole and changes nothing, so a bad value
/// cannot wedge the "newer than" checks that every later message of that peer must pass.
pub(crate) fn validate_exchange(
    msg: &Exchange,
    signed_ms: i64,
    my_incarnation: u64,
    s: &GlobalSettings,
) -> Result<(), &'static str> {
    let keys: usize = msg.policies.iter().map(|p| p.keys.len()).sum();
    if keys > s.params.max_exchange_keys || msg.policies.len() > s.params.max_exchange_keys {
        return Err("more keys than a round allows");
    }
    let latest = signed_ms.max(0) as u64 + s.max_skew.as_millis() as u64;
    if msg.incarnation > latest || msg.incarnation > quotad_core::coordinator::MAX_SEQ {
        return Err("incarnation from the future");
    }
    if msg.to_incarnation > my_incarnation {
        return Err("names an incarnation of ours that does not exist yet");
    }
    let bad_key = msg
        .policies
        .iter()
        .flat_map(|p| &p.keys)
        .any(|k| k.key.is_empty() || k.key.len() > s.max_key_bytes);
    if bad_key {
        return Err("an empty or over-long key");
    }
    let bad_seq = msg.policies.iter().flat_map(|p| &p.keys).any(|k| {
        k.release
            .is_some_and(|r| r > quotad_core::coordinator::MAX_SEQ)
    });
    if bad_seq {
        return Err("a release seq past 2^53");
    }
    Ok(())
}

/// The same bounds for a reply to one of our exchanges (its incarnation judged by our own
/// wall clock: a reply carries no timestamp of its own).
pub(crate) fn validate_reply(
    reply: &ExchangeReply,
    now_ms: i64,
    s: &GlobalSettings,
) -> Result<(), &'static str> {
    let keys: usize = reply.policies.iter().map(|p| p.keys.len()).sum();
    if keys > s.params.max_exchange_keys || reply.policies.len() > s.params.max_exchange_keys {
        return Err("more keys than a round allows");
    }
    let latest = now_ms.max(0) as u64 + s.max_skew.as_millis() as u64;
    if reply.incarnation > latest || reply.incarnation > quotad_core::coordinator::MAX_SEQ {
        return Err("incarnation from the future");
    }
    let bad_seq = reply.policies.iter().flat_map(|p| &p.keys).any(|k| {
        k.grant
            .is_some_and(|g| g.seq > quotad_core::coordinator::MAX_SEQ)
    });
    if bad_seq {
        return Err("a grant seq past 2^53");
    }
    Ok(())
}
