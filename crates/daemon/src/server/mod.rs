//! The socket layer: every listener (the HTTP API and the gRPC service, each on a TCP
//! address or a Unix socket: [`listener`]) is bound and accepted here, and everything a
//! client can make quotad hold through a connection is bounded here, with the same
//! per-listener metrics ([`ListenerMetrics`]). HTTP connections are served by this module
//! (below); the gRPC service's are handed to tonic with a slot, a first-bytes deadline and
//! the counters around them ([`handoff`]). The API's routes are the [`axum::Router`] it is
//! given; this module owns sockets, their count, their timeouts and the drain on shutdown,
//! and nothing else.
//!
//! Every connection is in one of four phases, and each phase but one has a deadline:
//!
//! | phase | what quotad waits for | deadline |
//! |---|---|---|
//! | fresh | the first request's headers | `header_timeout` from accept |
//! | headers | the rest of a request's headers | `header_timeout` from its first byte |
//! | busy | the handler (which bounds the body by `body_timeout`) | none here |
//! | idle | the next request on a keep-alive connection | `idle_timeout` |
//!
//! A per-connection watchdog closes a connection whose deadline passes (slowloris, a
//! half-sent request, an idle socket). Headers are capped at `max_header_bytes` (431).
//! At most `max_connections` are open: when a new one arrives at the bound, one without a
//! request in progress is closed to make room (one that never completed a request first,
//! then the longest waiting), as nginx reuses keep-alive connections; with every
//! connection busy, the new one is closed at once. Either way it is counted. A connection costs no buffers until
//! its first byte arrives: idle sockets cost a task and a file descriptor, nothing more.
//!
//! Drain (shutdown): [`Drain::begin`] only fails readiness; connections carry on as usual
//! while load balancers notice (the app's `shutdown_delay`), so keep-alive clients are not
//! pushed to reconnect to an instance that is about to close. [`Drain::stop_accepting`]
//! then takes the connections already completed by the kernel, closes the listener, and
//! from then on every response carries `Connection: close`: a client sending continuously
//! moves off each connection right after an answer and never has a request cut. A
//! connection that stays idle for [`DRAIN_IDLE`] is closed. [`serve`] returns once every
//! connection is gone.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::{HeaderValue, Request, header};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, ReadBuf};
use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::metrics::Metrics;

pub(crate) mod handoff;
pub(crate) mod listener;

pub(crate) use handoff::{Handed, Handoff, incoming};
pub(crate) use listener::Stream;
pub use listener::{Endpoint, Listener};

/// Bounds from `[server]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    pub(crate) max_connections: usize,
    pub(crate) header_timeout: Duration,
    pub(crate) idle_timeout: Duration,
    pub(crate) max_header_bytes: usize,
}

/// Connections looked at to choose one to evict (all of them, up to this many).
pub(crate) const EVICTION_SAMPLE: usize = 64;

/// How long a connection may stay idle once the listener has closed for shutdown: long
/// enough for a client that sends continuously to use it once more (and be told
/// `Connection: close`), short enough that the process exits promptly.
pub(crate) const DRAIN_IDLE: Duration = Duration::from_secs(1);

/// Why the server closed a connection: the `reason` label of
/// `quotad_connections_closed_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Closed {
    HeaderTimeout,
    IdleTimeout,
    Evicted,
    Rejected,
    Drained,
}

impl Closed {
    pub(crate) fn reason(self) -> &'static str {
        match self {
            Closed::HeaderTimeout => "header_timeout",
            Closed::IdleTimeout => "idle_timeout",
            Closed::Evicted => "evicted",
            Closed::Rejected => "rejected",
            Closed::Drained => "drained",
        }
    }

    /// Every reason, in declaration order: `ALL[why as usize] == why`.
    pub(crate) const ALL: [Closed; 5] = [
        Closed::HeaderTimeout,
        Closed::IdleTimeout,
        Closed::Evicted,
        Closed::Rejected,
        Closed::Drained,
    ];
}

/// One listener's connection metrics, its label values resolved once (not per
/// connection): `quotad_connections_open{listener}`,
/// `quotad_connections_closed_total{listener,reason}`, `quotad_accept_errors_total{listener}`.
#[derive(Clone)]
pub(crate) struct ListenerMetrics {
    pub(crate) open: prometheus::IntGauge,
    pub(crate) accept_errors: prometheus::IntCounter,
    /// Indexed like [`Closed::ALL`].
    closed: [prometheus::IntCounter; 5],
}

impl ListenerMetrics {
    /// The series of the listener named `listener` (`http`, `grpc`), all created now so
    /// that each shows 0 from the start.
    pub(crate) fn new(metrics: &Metrics, listener: &str) -> Self {
        ListenerMetrics {
            open: metrics.connections_open.with_label_values(&[listener]),
            accept_errors: metrics.accept_errors.with_label_values(&[listener]),
            closed: Closed::ALL.map(|c| {
                metrics
                    .connections_closed
                    .with_label_values(&[listener, c.reason()])
            }),
        }
    }

    pub(crate) fn closed(&self, why: Closed) {
        self.closed[why as usize].inc();
    }
}

/// The shutdown sequence as the server sees it; the app drives it.
#[derive(Clone, Default)]
pub(crate) struct Drain {
    /// Readiness fails from here on.
    draining: Arc<AtomicBool>,
    /// The listener closes, responses carry `Connection: close`, idle connections get
    /// [`DRAIN_IDLE`].
    stop: CancellationToken,
}

impl Drain {
    /// Readiness fails.
    pub(crate) fn begin(&self) {
        self.draining.store(true, Ordering::Release);
    }

    pub(crate) fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    fn is_closing(&self) -> bool {
        self.stop.is_cancelled()
    }

    /// Resolves once the listeners are to stop accepting (the gRPC listener's signal).
    pub(crate) async fn closing(&self) {
        self.stop.cancelled().await;
    }

    /// Stops accepting; connections finish as described in the module doc.
    pub(crate) fn stop_accepting(&self) {
        self.begin();
        self.stop.cancel();
    }
}

const FRESH: u8 = 0;
const HEADERS: u8 = 1;
const BUSY: u8 = 2;
const IDLE: u8 = 3;

/// One connection's phase and when it entered it, shared by its reader, its service
/// calls and its watchdog. Atomics: two stores per request, no lock.
struct Conn {
    phase: AtomicU8,
    /// Milliseconds on the server's clock ([`Shared::now_ms`]).
    since: AtomicU64,
    /// Eviction: the watchdog closes the connection at once.
    evict: Notify,
    evicted: AtomicBool,
    /// Position in `Shared::conns`.
    index: std::sync::atomic::AtomicUsize,
}

impl Conn {
    fn set(&self, phase: u8, now_ms: u64) {
        self.since.store(now_ms, Ordering::Release);
        self.phase.store(phase, Ordering::Release);
    }

    /// Whether it may be evicted, and how readily (lower first): a connection that has
    /// not completed a request yet before one that has (a client that proved itself keeps
    /// its keep-alive connection through a flood of silent sockets), then the one waiting
    /// longest. `None`: busy, or already evicted.
    fn waiting(&self) -> Option<(bool, u64)> {
        match self.phase.load(Ordering::Acquire) {
            BUSY => None,
            _ if self.evicted.load(Ordering::Acquire) => None,
            p => Some((p != FRESH, self.since.load(Ordering::Acquire))),
        }
    }
}

struct Shared {
    limits: Limits,
    metrics: ListenerMetrics,
    drain: Drain,
    epoch: Instant,
    slots: Arc<Semaphore>,
    /// Open connections by id, for eviction.
    /// Open connections, for eviction; each knows its position (`Conn::index`), so that
    /// joining and leaving are O(1).
    conns: Mutex<Vec<Arc<Conn>>>,
}

impl Shared {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn closed(&self, why: Closed) {
        self.metrics.closed(why);
    }

    /// Closes a connection without a request in progress: one that never completed a
    /// request before one that did, the longest waiting first (of all, up to
    /// [`EVICTION_SAMPLE`] connections; of that many picked at random beyond: a flood of
    /// connects must not cost a scan of every connection each); false if none of them is
    /// waiting.
    fn evict_one(&self) -> bool {
        let conns = self.conns.lock().unwrap_or_else(|p| p.into_inner());
        let pick = |c: &Arc<Conn>| c.waiting().map(|since| (since, c.clone()));
        let victim = if conns.len() <= EVICTION_SAMPLE {
            conns
                .iter()
                .filter_map(pick)
                .min_by_key(|(since, _)| *since)
        } else {
            (0..EVICTION_SAMPLE)
                .map(|_| &conns[rand::random_range(0..conns.len())])
                .filter_map(pick)
                .min_by_key(|(since, _)| *since)
        };
        match victim {
            Some((_, c)) => {
                c.evicted.store(true, Ordering::Release);
                c.evict.notify_one();
                true
            }
            None => false,
        }
    }
}

/// Serves `router` on `listener` until `drain` stops accepting and every connection has
/// closed. Accept errors (a full file table, a connection reset before accept) are
/// logged, counted and retried after a short pause: they never stop the server.
pub(crate) async fn serve(
    listener: Listener,
    router: Router,
    limits: Limits,
    metrics: Arc<Metrics>,
    drain: Drain,
) {
    let shared = Arc::new(Shared {
        slots: Arc::new(Semaphore::new(limits.max_connections.max(1))),
        limits,
        metrics: ListenerMetrics::new(&metrics, "http"),
        drain: drain.clone(),
        epoch: Instant::now(),
        conns: Mutex::new(Vec::new()),
    });
    let tasks = TaskTracker::new();
    let mut accept_errors = 0u64;
    let spawn = |stream: Stream| {
        let shared = shared.clone();
        let router = router.clone();
        tasks.spawn(async move {
            let Some(_slot) = slot(&shared).await else {
                shared.closed(Closed::Rejected);
                return;
            };
            shared.metrics.open.inc();
            connection(&shared, stream, router).await;
            shared.metrics.open.dec();
        });
    };
    loop {
        let accepted = tokio::select! {
            _ = drain.stop.cancelled() => break,
            r = listener.accept() => r,
        };
        match accepted {
            Ok(stream) => spawn(stream),
            Err(e) => {
                accept_errors += 1;
                shared.metrics.accept_errors.inc();
                if accept_errors.is_power_of_two() {
                    tracing::warn!(error = %e, occurrences = accept_errors, "accept failed");
                }
                // EMFILE/ENFILE: room appears as connections close (the watchdogs see to
                // that). A short pause instead of a spin, not axum's 1 s stall.
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }
    // Connections the kernel completed before the stop have clients that sent (or are
    // sending) a request: serve them rather than let closing the listener reset them.
    // Bounded: a client that reconnects in a loop must not keep the listener open. (One
    // whose handshake completes in the instant between this and the close is reset: no
    // listener can avoid that, which is what shutdown_delay and the load balancer are for.)
    let until = Instant::now() + Duration::from_millis(50);
    while Instant::now() < until {
        match tokio::time::timeout(Duration::ZERO, listener.accept()).await {
            Ok(Ok(stream)) => spawn(stream),
            _ => break,
        }
    }
    drop(listener);
    tasks.close();
    tasks.wait().await;
}

/// A connection slot: a free one, or one freed by evicting the longest-waiting connection
/// (its task ends within microseconds of the notice); `None` when every connection is busy.
async fn slot(shared: &Shared) -> Option<tokio::sync::OwnedSemaphorePermit> {
    if let Ok(p) = shared.slots.clone().try_acquire_owned() {
        return Some(p);
    }
    if !shared.evict_one() {
        return None;
    }
    tokio::time::timeout(
        Duration::from_millis(100),
        shared.slots.clone().acquire_owned(),
    )
    .await
    .ok()?
    .ok()
}

async fn connection(shared: &Arc<Shared>, stream: Stream, router: Router) {
    let conn = Arc::new(Conn {
        phase: AtomicU8::new(FRESH),
        since: AtomicU64::new(shared.now_ms()),
        evict: Notify::new(),
        evicted: AtomicBool::new(false),
        index: std::sync::atomic::AtomicUsize::new(0),
    });
    {
        let mut conns = shared.conns.lock().unwrap_or_else(|p| p.into_inner());
        conn.index.store(conns.len(), Ordering::Release);
        conns.push(conn.clone());
    }
    let why = serve_connection(shared, &conn, stream, router).await;
    {
        let mut conns = shared.conns.lock().unwrap_or_else(|p| p.into_inner());
        let i = conn.index.load(Ordering::Acquire);
        conns.swap_remove(i);
        if let Some(moved) = conns.get(i) {
            moved.index.store(i, Ordering::Release);
        }
    }
    if let Some(why) = why {
        shared.closed(why);
    }
}

/// Runs one connection to its end; the reason when the server closed it.
async fn serve_connection(
    shared: &Arc<Shared>,
    conn: &Arc<Conn>,
    stream: Stream,
    router: Router,
) -> Option<Closed> {
    // Until its first byte a connection gets no hyper state at all: its buffers (8 KiB
    // each way) and the connection's state machine live in a box made only then, so an
    // idle socket costs its task and little more.
    tokio::select! {
        r = stream.first_byte() => if !matches!(r, Ok(1..)) { return None },
        why = watchdog(shared, conn) => return Some(why),
    }
    Box::pin(serve_http(shared, conn, stream, router)).await
}

/// The HTTP part of a connection, from its first byte on.
async fn serve_http(
    shared: &Arc<Shared>,
    conn: &Arc<Conn>,
    stream: Stream,
    router: Router,
) -> Option<Closed> {
    let io = TokioIo::new(Tracked {
        inner: stream,
        conn: conn.clone(),
        shared: shared.clone(),
    });
    let service = {
        let (shared, conn) = (shared.clone(), conn.clone());
        hyper::service::service_fn(move |req: Request<Incoming>| {
            conn.set(BUSY, shared.now_ms());
            let mut router = router.clone();
            let (shared, conn) = (shared.clone(), conn.clone());
            async move {
                let mut resp =
                    tower_service::Service::call(&mut router, req.map(axum::body::Body::new))
                        .await?;
                if shared.drain.is_closing() {
                    resp.headers_mut()
                        .insert(header::CONNECTION, HeaderValue::from_static("close"));
                }
                conn.set(IDLE, shared.now_ms());
                Ok::<_, std::convert::Infallible>(resp)
            }
        })
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .keep_alive(true)
        // The read buffer never needs more than the headers (a body is read by the handler
        // in chunks): a connection that dribbles headers holds at most this much.
        .max_buf_size(shared.limits.max_header_bytes.max(8192))
        .max_header_size(shared.limits.max_header_bytes);
    let served = builder.serve_connection(io, service);
    tokio::pin!(served);
    tokio::select! {
        r = served.as_mut() => {
            if let Err(e) = r {
                tracing::debug!(error = %e, "connection ended with an error");
            }
            None
        }
        why = watchdog(shared, conn) => Some(why),
    }
}

/// Resolves when the connection must close: its phase's deadline passed, it was evicted,
/// or the drain found it idle.
async fn watchdog(shared: &Shared, conn: &Conn) -> Closed {
    loop {
        let phase = conn.phase.load(Ordering::Acquire);
        let since = conn.since.load(Ordering::Acquire);
        let stopped = shared.drain.stop.is_cancelled();
        let (limit, why) = match phase {
            // A client that connected just before the listener closed sends at once.
            FRESH | IDLE if stopped => {
                (DRAIN_IDLE.min(shared.limits.idle_timeout), Closed::Drained)
            }
            FRESH | HEADERS => (shared.limits.header_timeout, Closed::HeaderTimeout),
            IDLE => (shared.limits.idle_timeout, Closed::IdleTimeout),
            // Busy: nothing to time here; look again in a while.
            _ => (shared.limits.header_timeout, Closed::HeaderTimeout),
        };
        let deadline = shared.epoch + Duration::from_millis(since) + limit;
        // Phase changes do not wake the watchdog (that would cost every request a
        // notification); it looks again at least every shortest timeout instead, so a
        // deadline is kept within that of its time.
        let look = Instant::now() + shared.limits.header_timeout.min(shared.limits.idle_timeout);
        tokio::select! {
            _ = tokio::time::sleep_until(deadline.min(look).into()) => {}
            _ = conn.evict.notified() => return Closed::Evicted,
            _ = shared.drain.stop.cancelled(), if !stopped => continue,
        }
        let unchanged = conn.phase.load(Ordering::Acquire) == phase
            && conn.since.load(Ordering::Acquire) == since;
        if unchanged && phase != BUSY && Instant::now() >= deadline {
            return why;
        }
    }
}

/// The socket, noting when the first byte of a request arrives on a waiting connection.
struct Tracked {
    inner: Stream,
    conn: Arc<Conn>,
    shared: Arc<Shared>,
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            // Idle → the next request has begun: its headers now have header_timeout.
            // (Fresh keeps counting from accept.)
            if self.conn.phase.load(Ordering::Acquire) == IDLE {
                let now = self.shared.now_ms();
                self.conn.set(HEADERS, now);
            }
        }
        r
    }
}

listener::writes_through!(Tracked, inner);

/// Raises the soft limit on open files to the hard limit (where allowed) and returns the
/// limit in force, for sizing `max_connections`.
pub(crate) fn raise_file_limit() -> Option<u64> {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(n) => Some(n),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read or raise the open-files limit");
            None
        }
    }
}

/// File descriptors kept back from connections: Redis, the coordinator, peers, logs.
pub(crate) const RESERVED_FILES: u64 = 256;

/// The default connection bound under a file limit: 10,000, or what the limit leaves.
pub(crate) fn default_max_connections(file_limit: Option<u64>) -> usize {
    let cap = 10_000u64;
    match file_limit {
        Some(n) => cap.min(n.saturating_sub(RESERVED_FILES).max(64)) as usize,
        None => cap as usize,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_closing_reason_counts_in_its_own_series() {
        for (i, c) in Closed::ALL.iter().enumerate() {
            assert_eq!(*c as usize, i, "ALL is in declaration order");
        }
        let metrics = Metrics::new(["p"], &[]);
        let m = ListenerMetrics::new(&metrics, "http");
        m.closed(Closed::Evicted);
        let text = metrics.render();
        assert!(
            text.contains(
                "quotad_connections_closed_total{listener=\"http\",reason=\"evicted\"} 1"
            ),
            "{text}"
        );
    }
}
