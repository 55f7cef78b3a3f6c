//! The composition root: builds the store, the fallback store, the limiter and the router
//! from validated settings, serves until the shutdown token fires, and owns shutdown order.
//!
//! Shutdown (SIGTERM/SIGINT cancel the token): `/readyz` turns 503 at once and every
//! response carries `Connection: close`; after `server.shutdown_delay` (time for a load
//! balancer to notice) the listener stops accepting; in-flight requests complete and idle
//! connections close (see [`crate::server`]); the process exits once they are gone, and
//! no later than `server.drain_timeout` after the signal, whatever is still open.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::api::{self, AppState, request::Caps};
use crate::config::{Settings, StoreBackend};
use crate::federation::{BackendChoice, Federation};
use crate::layout::RuntimeLimitKeys;
use crate::layout::{Layout, Layouts, RegionPlace};
use crate::limiter::Limiter;
use crate::metrics::Metrics;
use crate::policy::Policies;
use crate::reload::{self, Live, LiveConfig};
use crate::runtime_limits::RuntimeLimits;
use crate::server::{self, Drain, Endpoint, Listener};
use crate::store::memory::MemoryStore;
use crate::store::{RedisStore, Store, StoreError, janitor};
use quotad_core::clock::SystemClock;

/// Why the daemon could not start or stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// A listener's address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: Endpoint,
        /// Why.
        source: std::io::Error,
    },
    /// The store's Redis URL is not one the client can use.
    #[error("invalid Redis URL: {0}")]
    RedisUrl(redis::RedisError),
    /// The HTTP server failed.
    #[error("server failed: {0}")]
    Serve(std::io::Error),
    /// The gRPC server failed.
    #[error("gRPC server failed: {0}")]
    Grpc(tonic::transport::Error),
}

/// How often expired entries are dropped from in-process stores.
const SWEEP_INTERVAL: Duration = Duration::from_secs(10);

/// Connections the kernel may hold complete but not yet accepted. tokio's default (1024)
/// overflows under a burst of connects, and an overflowing queue leaves clients believing
/// they are connected to a socket nobody will read; the kernel caps it at somaxconn.
const LISTEN_BACKLOG: u32 = 4096;

/// Where the policies' state lives in the store as the daemon starts: the key layout
/// under the configured prefix, with this region's place among its peers for global
/// policies.
pub fn layouts(settings: &Settings) -> Layouts {
    layouts_in_force(settings, &reload::policies(settings))
}

/// Where the state of `policies` lives: those of the config in force, the start-up one or
/// a reload's, which may have added policies or changed windows (the janitor lays them
/// out again before each sweep, so a repaired key gets the TTL its policy writes now).
/// Global policies are always laid out as `settings` started them: a reload can neither
/// add, remove nor reshape one, and the escrow of a re-split reaches the scripts through
/// [`GlobalLayout::shape_for`](crate::layout::GlobalLayout::shape_for), never
/// through a new layout.
pub(crate) fn layouts_in_force(settings: &Settings, policies: &Policies) -> Layouts {
    let region = settings.global.as_ref().map(|g| RegionPlace {
        me: g.me,
        step_tolerance_us: g.params.step_tolerance_us(),
    });
    let globals = settings.policies.iter().filter(|p| p.global.is_some());
    // Overrides share their policy's keys: the layout keeps the longest repair TTL of all.
    let local = policies
        .iter()
        .filter(|p| p.global.is_none())
        .flat_map(|p| {
            let overrides = policies.overrides(&p.name).iter();
            std::iter::once(&**p).chain(overrides.map(|o| &*o.policy))
        });
    let name = settings
        .global
        .as_ref()
        .map_or("", |g| g.regions[g.me.index()].as_str());
    Layouts::new(
        Layout::new(&settings.key_prefix).in_region(name),
        globals.chain(local),
        region.as_ref(),
    )
    .with_concurrency(policies.concurrency_limits().map(|c| &**c))
}

/// Where the policies of `policies` that take runtime limits keep them, with how long the
/// marks of entries that went are kept (the longest a state of the policy lives).
fn runtime_limit_keys(settings: &Settings, policies: &Policies) -> Vec<RuntimeLimitKeys> {
    let layouts = layouts_in_force(settings, policies);
    policies
        .iter()
        .filter(|p| p.runtime.is_some())
        .map(|p| {
            let keep_ms = layouts.by_name(&p.name).map_or(0, |l| l.repair_ttl_ms);
            layouts
                .layout()
                .runtime_limit_keys(&p.name, keep_ms, p.global.is_some())
        })
        .collect()
}

/// Binds the configured endpoint and serves until `shutdown` is cancelled.
pub async fn run(settings: Settings, shutdown: CancellationToken) -> Result<(), AppError> {
    let listener = bind(&settings.server.listen)?;
    serve(settings, listener, shutdown).await
}

/// Binds `addr` (a TCP address or a Unix socket) with the daemon's backlog.
fn bind(addr: &Endpoint) -> Result<Listener, AppError> {
    Listener::bind(addr, LISTEN_BACKLOG).map_err(|source| AppError::Bind {
        addr: addr.clone(),
        source,
    })
}

/// Serves on an already-bound listener (tests bind port 0); binds `[server] grpc_listen`
/// when set.
pub async fn serve(
    settings: Settings,
    listener: impl Into<Listener>,
    shutdown: CancellationToken,
) -> Result<(), AppError> {
    let grpc = match &settings.server.grpc_listen {
        Some(addr) => Some(bind(addr)?),
        None => None,
    };
    serve_both(settings, listener.into(), grpc, shutdown).await
}

/// Serves HTTP on `listener` and, when given, the Envoy rate-limit service on `grpc`; both
/// drain together.
pub(crate) async fn serve_both(
    mut settings: Settings,
    listener: Listener,
    grpc: Option<Listener>,
    shutdown: CancellationToken,
) -> Result<(), AppError> {
    reload::stamp_since(&mut settings, None, reload::now_ms());
    let metrics = new_metrics(&settings);
    let layouts = Arc::new(layouts(&settings));
    let background = Background::default();
    let local = Arc::new(MemoryStore::new(
        Arc::new(SystemClock),
        settings.memory_max_keys,
    ));
    // Runtime limits: on the embedded store this copy is the store; over Redis it is read
    // from there before the first answers that need it (`runtime_limits::sync`).
    let runtime = Arc::new(match settings.store {
        StoreBackend::Memory => RuntimeLimits::in_sync(),
        StoreBackend::Redis(_) => RuntimeLimits::default(),
    });
    let live = Arc::new(LiveConfig::new(
        Live::from_settings(&settings, config_hash(&settings)),
        &settings.log,
        runtime,
    ));
    let opened = open_store(&settings, &layouts, &live, &metrics, &background, &shutdown);
    let Some(store) = opened.await? else {
        return Ok(()); // shut down before the store answered
    };
    count_memory_keys(
        &background,
        &metrics,
        [("local", Some(local.clone())), ("primary", store.memory())],
    );
    let federation = start_federation(&settings, &live.get().policies, &layouts, &store, &metrics)?;
    watch_config(&settings, &live, &metrics, &store, &federation, &background);
    let drain = Drain::default();
    let limiter = Arc::new(Limiter::new(
        store.clone(),
        local,
        layouts.clone(),
        metrics.clone(),
    ));
    background
        .tasks
        .spawn(limiter.clone().reap_until(background.stop.clone()));
    if let Some(f) = &federation {
        // Runtime limits of global policies reach the other regions.
        background.tasks.spawn(crate::federation::limits::pull(
            f.clone(),
            limiter.clone(),
            live.clone(),
            background.stop.clone(),
        ));
    }
    let state = AppState {
        live,
        limiter,
        store,
        metrics: metrics.clone(),
        caps: caps(&settings),
        drain: drain.clone(),
        ready_requires_store: settings.server.ready_requires_store,
        body_budget: api::body::BodyBudget::new(settings.server.max_body_memory, metrics.clone()),
        region: settings.region.as_str().into(),
        federation: federation.clone(),
    };
    let addr = listener.endpoint().map_err(AppError::Serve)?;
    tracing::info!(%addr, region = %settings.region, policies = settings.policies.len(), "quotad listening");
    let limits = connection_limits(&settings);
    let grpc_server = grpc.map(|l| serve_grpc(&settings, &state, l));
    let http = server::serve(listener, api::router(state), limits, metrics, drain.clone());
    let grpc_failed = std::sync::Mutex::new(None);
    let servers = async {
        let grpc = async {
            if let Some(g) = grpc_server
                && let Err(e) = g.await
            {
                tracing::error!(error = %e, "gRPC server failed");
                *grpc_failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
            }
        };
        tokio::join!(http, grpc);
    };
    until_drained(&settings, servers, drain, &shutdown).await;
    stop(background, federation).await;
    tracing::info!("stopped");
    match grpc_failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(AppError::Grpc(e)),
        None => Ok(()),
    }
}

/// After the servers drained: the background tasks and the coordinator stop, given a
/// second to finish.
async fn stop(background: Background, federation: Option<Arc<Federation>>) {
    background.stop.cancel();
    if let Some(f) = &federation {
        f.stop().await;
    }
    background.tasks.close();
    let _ = tokio::time::timeout(Duration::from_secs(1), background.tasks.wait()).await;
}

/// The metric catalogue for these policies, with the series of settling policies and
/// concurrency limits registered before their first event.
fn new_metrics(settings: &Settings) -> Arc<Metrics> {
    let metrics = Arc::new(Metrics::new(
        settings.policies.iter().map(|p| p.name.as_str()),
        &StoreError::KINDS,
    ));
    for p in settings
        .policies
        .iter()
        .filter(|p| p.settle_within.is_some())
    {
        metrics.preregister_settlements(&p.name);
    }
    for c in &settings.concurrency {
        metrics.preregister_concurrency(&c.name);
    }
    metrics
}

/// The HTTP API's request caps, from `[server]`.
fn caps(settings: &Settings) -> Caps {
    Caps {
        max_body_bytes: settings.server.max_body_bytes,
        max_batch: settings.server.max_batch,
        max_key_bytes: settings.server.max_key_bytes,
        body_timeout: settings.server.body_timeout,
    }
}

/// Watches the config file the settings came from (none: nothing to watch): a reload
/// tells the coordinator the new policies, and new `[store]` credentials go in live when
/// they authenticate (Redis only).
fn watch_config(
    settings: &Settings,
    live: &Arc<LiveConfig>,
    metrics: &Arc<Metrics>,
    store: &Arc<Store>,
    federation: &Option<Arc<Federation>>,
    background: &Background,
) {
    let Some(path) = settings.source.clone() else {
        return;
    };
    let coordinator = federation.clone();
    let on_reload: reload::OnReload = Box::new(move |live: &Live| {
        if let Some(f) = &coordinator {
            f.reload(live.policies.iter().cloned().collect());
        }
    });
    let rotate: Option<reload::Rotate> = match &**store {
        Store::Redis(r) => {
            let r = r.clone();
            Some(Arc::new(move |target| {
                let r = r.clone();
                Box::pin(async move { r.rotate(target).await })
            }))
        }
        Store::Memory(_) => None,
    };
    let task = reload::watch(
        path,
        settings.clone(),
        live.clone(),
        metrics.clone(),
        on_reload,
        rotate,
        background.stop.clone(),
    );
    background.tasks.spawn(task);
}

/// The Envoy rate-limit service on the same limiter, policies and drain as the HTTP API,
/// with the HTTP API's request caps and its own connection bound (`api::grpc::Bounds`).
fn serve_grpc(
    settings: &Settings,
    state: &AppState,
    listener: Listener,
) -> impl std::future::Future<Output = Result<(), tonic::transport::Error>> + use<> {
    if let Ok(addr) = listener.endpoint() {
        tracing::info!(%addr, domains = settings.descriptors.len(), "gRPC rate-limit service listening");
    }
    let service = api::grpc::RateLimiter {
        live: state.live.clone(),
        limiter: state.limiter.clone(),
        metrics: state.metrics.clone(),
        caps: state.caps,
    };
    let bounds = api::grpc::Bounds {
        max_connections: settings.server.grpc_max_connections,
        handshake_timeout: settings.server.header_timeout,
        max_message_bytes: settings.server.max_body_bytes,
        max_header_bytes: settings.server.max_header_bytes,
        timeout: settings.server.body_timeout,
    };
    api::grpc::serve(listener, service, bounds, state.drain.clone())
}

/// The hash of the file the settings came from ("builtin" without one).
fn config_hash(settings: &Settings) -> String {
    settings
        .source
        .as_deref()
        .and_then(|p| std::fs::read(p).ok())
        .map_or_else(|| "builtin".to_owned(), |b| reload::hash(&b))
}

/// The tasks that live as long as the daemon serves, and what stops them (after the
/// drain, so they keep working for the requests still being answered).
#[derive(Default)]
struct Background {
    tasks: TaskTracker,
    stop: CancellationToken,
}

impl Background {
    /// Runs `tick` every `interval` until the daemon stops.
    fn every(&self, interval: Duration, tick: impl Fn() + Send + 'static) {
        let stop = self.stop.clone();
        self.tasks.spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(interval) => tick(),
                }
            }
        });
    }
}

/// The store decisions go to: the embedded one, or Redis with its supervisor (reconnects,
/// script loads), its invalidation follower (deny cache), its sweep and the region's TTL
/// janitor, which lays out the policies of `live` before each sweep. `None` when the
/// daemon was told to stop before Redis answered its first probe.
async fn open_store(
    settings: &Settings,
    layouts: &Arc<Layouts>,
    live: &Arc<LiveConfig>,
    metrics: &Arc<Metrics>,
    background: &Background,
    shutdown: &CancellationToken,
) -> Result<Option<Arc<Store>>, AppError> {
    let rs = match &settings.store {
        StoreBackend::Memory => {
            metrics.store_up.set(1);
            let memory = MemoryStore::new(Arc::new(SystemClock), settings.memory_max_keys);
            return Ok(Some(Arc::new(Store::Memory(Arc::new(memory)))));
        }
        StoreBackend::Redis(rs) => rs,
    };
    let redis = Arc::new(
        RedisStore::new(
            rs.clone(),
            layouts.layout(),
            metrics.clone(),
            live.runtime().clone(),
        )
        .map_err(AppError::RedisUrl)?,
    );
    // One bounded attempt before serving, so the first requests are enforced when Redis
    // is up; if it is not, the supervisor keeps trying while we serve.
    let first = tokio::select! {
        r = redis.probe() => r,
        _ = shutdown.cancelled() => return Ok(None),
    };
    match first {
        Ok(()) => tracing::info!(redis = %rs.target.describe(), "redis connected, scripts loaded"),
        Err(e) => {
            tracing::warn!(redis = %rs.target.describe(), error = %e, "redis not reachable at start; serving with fallbacks")
        }
    }
    let stop = &background.stop;
    background
        .tasks
        .spawn(redis.clone().supervise(stop.clone()));
    background
        .tasks
        .spawn(redis.clone().follow_invalidations(stop.clone()));
    background
        .tasks
        .spawn(redis.clone().tend_hot_keys(stop.clone()));
    let swept = redis.clone();
    background.every(SWEEP_INTERVAL, move || swept.sweep());
    let (started, in_force) = (settings.clone(), live.clone());
    background.tasks.spawn(redis.clone().keep_runtime_limits(
        move || runtime_limit_keys(&started, &in_force.get().policies),
        stop.clone(),
    ));
    let (started, live) = (settings.clone(), live.clone());
    background.tasks.spawn(janitor::run(
        redis.shared_target(),
        move || layouts_in_force(&started, &live.get().policies),
        rs.janitor_interval,
        metrics.clone(),
        stop.clone(),
    ));
    Ok(Some(Arc::new(Store::Redis(redis))))
}

/// Sweeps expired entries from the in-process stores and exports their sizes
/// (`quotad_memory_store_keys{store}`).
fn count_memory_keys<const N: usize>(
    background: &Background,
    metrics: &Metrics,
    memories: [(&str, Option<Arc<MemoryStore>>); N],
) {
    for (name, m) in memories {
        let Some(m) = m else { continue };
        let gauge = metrics.memory_store_keys.with_label_values(&[name]);
        background.every(SWEEP_INTERVAL, move || {
            m.sweep();
            gauge.set(m.len() as i64);
        });
    }
}

/// The coordinator of global policies, when there are any: it keeps its state where
/// decisions keep theirs.
fn start_federation(
    settings: &Settings,
    policies: &Policies,
    layouts: &Arc<Layouts>,
    store: &Store,
    metrics: &Arc<Metrics>,
) -> Result<Option<Arc<Federation>>, AppError> {
    let Some(g) = &settings.global else {
        return Ok(None);
    };
    let backend = match (store, &settings.store) {
        (Store::Memory(m), _) => BackendChoice::Memory(m.clone()),
        (Store::Redis(r), StoreBackend::Redis(rs)) => BackendChoice::Redis {
            target: r.shared_target(),
            timeout: rs.timeout.max(Duration::from_millis(200)),
        },
        (Store::Redis(_), StoreBackend::Memory) => {
            return Err(AppError::Serve(std::io::Error::other(
                "the embedded store is missing",
            )));
        }
    };
    Federation::start(
        g.clone(),
        policies.iter().cloned().collect(),
        layouts.clone(),
        backend,
        metrics.clone(),
    )
    .map(Some)
    .map_err(AppError::RedisUrl)
}

/// The connection bounds, after raising the open-files limit as far as allowed; warns
/// when the configured bound is above what that limit leaves.
fn connection_limits(settings: &Settings) -> server::Limits {
    let file_limit = server::raise_file_limit();
    let limits = server::Limits {
        max_connections: settings
            .server
            .max_connections
            .unwrap_or_else(|| server::default_max_connections(file_limit)),
        header_timeout: settings.server.header_timeout,
        idle_timeout: settings.server.idle_timeout,
        max_header_bytes: settings.server.max_header_bytes,
    };
    // The gRPC listener's connections take descriptors too, when it is configured.
    let grpc = match &settings.server.grpc_listen {
        Some(_) => settings.server.grpc_max_connections as u64,
        None => 0,
    };
    if let Some(n) = file_limit
        && limits.max_connections as u64 + grpc + server::RESERVED_FILES > n
    {
        tracing::warn!(
            max_connections = limits.max_connections,
            grpc_max_connections = grpc,
            open_files_limit = n,
            "server.max_connections (plus grpc_max_connections) is above what the open-files limit leaves; accepts will fail first"
        );
    }
    tracing::info!(
        max_connections = limits.max_connections,
        open_files_limit = file_limit,
        "connection bounds"
    );
    limits
}

/// Serves until shutdown, then drains in order: readiness off and `Connection: close` at
/// once, no new connections after `shutdown_delay`, and an exit with requests in flight
/// only after `drain_timeout`.
async fn until_drained(
    settings: &Settings,
    server: impl std::future::Future<Output = ()>,
    drain: Drain,
    shutdown: &CancellationToken,
) {
    let delay = settings.server.shutdown_delay;
    let stop_accepting = async {
        shutdown.cancelled().await;
        drain.begin();
        tracing::info!(
            ?delay,
            "shutting down: readiness off, responses carry Connection: close; a second signal exits at once"
        );
        tokio::time::sleep(delay).await;
        drain.stop_accepting();
        tracing::info!("no longer accepting; draining connections");
    };
    let deadline = async {
        shutdown.cancelled().await;
        tokio::time::sleep(settings.server.drain_timeout).await;
    };
    tokio::select! {
        _ = async { tokio::join!(server, stop_accepting) } => {}
        _ = deadline => {
            tracing::warn!(timeout = ?settings.server.drain_timeout, "drain timeout reached; exiting with requests in flight");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reload::tests::config;

    /// The janitor's layouts after a live re-split that also adds a local policy: the
    /// global policy keeps its start-up layout (escrow included), the new one has its own.
    #[test]
    fn the_layouts_in_force_keep_global_policies_as_started() {
        let started = config(100, "escrow = { eu = 1, us = 1 }", 1, "", "");
        let local =
            "[[policy]]\nname = \"l\"\nalgorithm = \"fixed_window\"\nlimit = 5\nwindow = \"1h\"";
        let reloaded = config(100, "escrow = { eu = 4, us = 1 }", 2, "", local);
        assert_eq!(reload::refusal(&started, &reloaded), None);
        let at_start = layouts(&started);
        let in_force = layouts_in_force(&started, &reload::policies(&reloaded));
        assert_eq!(in_force.by_name("g"), at_start.by_name("g"));
        assert!(at_start.by_name("l").is_none());
        let ttl = in_force.by_name("l").map(|l| l.repair_ttl_ms);
        assert_eq!(ttl, Some(3_600_000 + 1000), "an hour plus grace");
    }
}
