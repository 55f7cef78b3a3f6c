//! The metric catalogue: every metric quotad exports, its labels and what it means, in one
//! place. Dashboards and alerts use only names defined here.
//!
//! Label values come from bounded sets only: policy names (from the config), outcomes
//! (a fixed enum), store error kinds (a fixed enum). Never a user key: one series per key
//! would let any client grow the exposition without bound.

use prometheus::core::Collector;
use prometheus::{
    Counter, Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

/// The git commit the running binary was built from, for `quotad_build_info`: the binary
/// sets it (its build script knows it) before the daemon starts; unset, `unknown`.
pub static REVISION: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();

/// The results of a settlement (`quotad_settlements_total{result}`).
pub(crate) const SETTLE_RESULTS: [&str; 6] = [
    "settled",
    "already_settled",
    "ended_by_reset",
    "unknown",
    "charged",
    "failed",
];

/// The events of a lease's units (`quotad_lease_units_total{event}`).
pub(crate) const LEASE_EVENTS: [&str; 4] = ["acquired", "released", "extended", "expired"];

/// The results of a config reload (`quotad_config_reloads_total{result}`).
/// `partial`: the policies applied, a part that needs a restart (a rotated credential, say)
/// did not.
pub(crate) const RELOAD_RESULTS: [&str; 4] = ["ok", "partial", "invalid", "refused"];

/// The admin endpoints' actions (`quotad_admin_requests_total{action}`).
pub(crate) const ADMIN_ACTIONS: [&str; 4] = ["reset", "limit_set", "limit_delete", "limit_read"];
/// What became of an admin request (`quotad_admin_requests_total{result}`): done, refused
/// for its credentials (401), or not done (a bad request, the store failing).
pub(crate) const ADMIN_RESULTS: [&str; 3] = ["done", "unauthenticated", "failed"];

pub(crate) struct Metrics {
    registry: Registry,
    /// `quotad_decisions_total{policy,outcome}`: every decision, by outcome
    /// (allowed, denied, shadow, fail_open, fail_closed, local).
    pub(crate) decisions: IntCounterVec,
    /// `quotad_check_duration_seconds{entry}`: time to decide one request, store round
    /// trips included, by the way it came in: `http` (`POST /v1/check`, single or batch,
    /// from the start of the request to its answer), `forward_auth` (`/v1/authz/...`),
    /// `grpc` (one `ShouldRateLimit`, all its descriptors).
    pub(crate) check_duration: ByEntry,
    /// `quotad_http_responses_total{route,status}`: every HTTP answer, by the route it
    /// matched (`/v1/check`, `/v1/authz/{policy}`, ...; `other` when none did) and status.
    pub(crate) http_responses: IntCounterVec,
    /// `quotad_grpc_responses_total{code}`: every gRPC call, by its status code (`OK`,
    /// `INVALID_ARGUMENT`, `UNAVAILABLE`, ...). Calls the deadline cut short are not
    /// among them (they end before an answer).
    pub(crate) grpc_responses: IntCounterVec,
    /// `quotad_store_call_duration_seconds`: Redis calls from send to answer (or to their
    /// timeout, `store.timeout`), scripts and pipelines alike.
    pub(crate) store_call_duration: Histogram,
    /// `quotad_store_errors_total{kind}`: store calls that gave no decision.
    pub(crate) store_errors: IntCounterVec,
    /// `quotad_store_up`: 1 while the store answers probes and the circuit is closed.
    pub(crate) store_up: IntGauge,
    /// `quotad_script_loads_total`: SCRIPT LOADs sent (start-up, reconnects, NOSCRIPT recovery).
    pub(crate) script_loads: IntCounter,
    /// `quotad_refund_errors_total`: refunds of a denied batch's siblings that failed (those
    /// units stay charged until their window passes).
    pub(crate) refund_errors: IntCounter,
    /// `quotad_build_info{version,revision}`: always 1. The revision is the git commit the
    /// binary was built from (`QUOTAD_REVISION` at build time, else `git`), or `unknown`.
    pub(crate) build_info: IntGaugeVec,
    /// `quotad_shed_total{reason}`: requests refused with 503 `overloaded` before reaching
    /// Redis (`queue_full`, `queue_timeout`); not decisions, nothing charged.
    pub(crate) shed: IntCounterVec,
    /// `quotad_store_in_flight`: permits held by requests whose Redis calls are in flight.
    pub(crate) store_in_flight: IntGauge,
    /// `quotad_store_queued`: requests waiting for Redis permits.
    pub(crate) store_queued: IntGauge,
    /// `quotad_store_pipelines_total`: pipelines the request path sent to Redis (one
    /// socket write each; `store::redis::coalesce`).
    pub(crate) store_pipelines: IntCounter,
    /// `quotad_store_pipelined_commands_total`: commands sent in them; over
    /// `quotad_store_pipelines_total`, the commands per write.
    pub(crate) store_pipelined_commands: IntCounter,
    /// `quotad_store_breaker_opens_total`: times the circuit breaker opened (a lost
    /// connection, or timeouts confirmed by an unanswered PING).
    pub(crate) breaker_opens: IntCounter,
    /// `quotad_connections_open{listener}`: connections open now, by listener (`http`,
    /// `grpc`), whatever carries them (TCP or a Unix socket); each listener holds at most
    /// its own bound (`server.max_connections`, `server.grpc_max_connections`).
    pub(crate) connections_open: IntGaugeVec,
    /// `quotad_connections_closed_total{listener,reason}`: connections the server closed
    /// (`header_timeout`: nothing, or no whole request or HTTP/2 preface, within
    /// `server.header_timeout`; `idle_timeout`, `evicted`, `rejected`, `drained`: HTTP);
    /// clients' own closes are not counted.
    pub(crate) connections_closed: IntCounterVec,
    /// `quotad_accept_errors_total{listener}`: failed accepts (a full file table, usually).
    pub(crate) accept_errors: IntCounterVec,
    /// `quotad_deny_cache_hits_total{policy}`: denials answered from memory, without a
    /// Redis call (a key hammered while over its limit).
    pub(crate) deny_cache_hits: IntCounterVec,
    /// `quotad_deny_cache_keys`: denials remembered (at the last sweep).
    pub(crate) deny_cache_keys: IntGauge,
    /// `quotad_invalidations_received_total`: invalidations (a reset or refund on any
    /// instance) this instance took off the channel and applied.
    pub(crate) invalidations_received: IntCounter,
    /// `quotad_keys_without_ttl`: quotad keys the janitor's last sweep found without a
    /// TTL (each one would have stayed in Redis forever).
    pub(crate) keys_without_ttl: IntGauge,
    /// `quotad_janitor_repaired_total`: TTLs the janitor gave back.
    pub(crate) janitor_repaired: IntCounter,
    /// `quotad_store_late_replies_total`: Redis replies taken after the call's timer
    /// fired, in the scheduler turns `store::redis::deadline` allows: quotad's runtime was behind
    /// in reading them (they are answers, not timeouts).
    pub(crate) store_late_replies: IntCounter,
    /// `quotad_hot_key_admits_total{policy}`: checks admitted from a hot key's slice, in
    /// memory (also counted in `quotad_decisions_total` as `allowed`).
    pub(crate) hot_admits: IntCounterVec,
    /// `quotad_hot_key_slices_total{event}`: slices `taken` from Redis and `returned`;
    /// slices `ended` early because capacity was given back to the key (a reset or a
    /// refund, here or on another instance); and slices `not_returned`, whose give-back
    /// the store did not answer (their units lapse unspent).
    pub(crate) hot_slices: IntCounterVec,
    /// `quotad_hot_key_units_total{event}`: units in the slices `taken`, `admitted` from
    /// them (counted every 100 ms), and `returned` to their window; what is left of what
    /// was taken lapsed with its window unspent: the slices' under-admission.
    pub(crate) hot_units: IntCounterVec,
    /// `quotad_hot_key_entries`: keys hot on this instance, with or without a slice (at
    /// the last tend; `quotad_hot_keys` is the coordinator's count of global keys).
    pub(crate) hot_entries: IntGauge,
    /// `quotad_hot_keys_refused_total`: keys that passed their rate while the table held
    /// its maximum of hot keys (decided in Redis instead).
    pub(crate) hot_refused: IntCounter,
    /// `quotad_janitor_last_scan_timestamp_seconds`: when this instance last finished a
    /// sweep (Unix time); stale when no instance of the region sweeps.
    pub(crate) janitor_last_scan: IntGauge,
    /// `quotad_janitor_sweeps_total{result}`: this instance's janitor intervals by what
    /// came of them: `swept`, `skipped` (another instance claimed the interval) or
    /// `failed` (Redis refused or timed out; retried the next interval, and logged).
    pub(crate) janitor_sweeps: IntCounterVec,
    /// `quotad_forward_auth_missing_key_total{policy,answer}`: forward-auth requests that
    /// carried no key (or one too long to be a key), by the `on_missing_key` answer they
    /// got: `deny` and `allow` decide nothing, so no other metric counts them; `key` is
    /// counted here too, so this is every keyless request of the policy.
    pub(crate) forward_auth_missing_key: IntCounterVec,
    /// `quotad_grpc_invalid_descriptors_total{policy}`: gRPC request descriptors that
    /// matched a policy but carried no usable key (a value empty, not UTF-8, or over
    /// `server.max_key_bytes`) or a cost above the policy's capacity: each answered
    /// `OVER_LIMIT`, the request's other descriptors peeked, nothing charged.
    pub(crate) grpc_invalid_descriptors: IntCounterVec,
    /// `quotad_settlements_total{policy,result}`: costs counted after the work: a
    /// reservation `settled`, one `already_settled` (nothing charged again), one
    /// `ended_by_reset` (a reset of its key ended it: nothing charged or given back), one
    /// `unknown` (never made, or kept no longer: its estimate stands), charges taken
    /// (`charged`: `POST /v1/charge`, a gRPC descriptor on the response path), and
    /// `failed` ones the store did not answer.
    pub(crate) settlements: IntCounterVec,
    /// `quotad_settled_units_total{policy,direction}`: units `charged` beyond the
    /// estimates (a charge is charged whole) and `refunded` below them.
    pub(crate) settled_units: IntCounterVec,
    /// `quotad_lease_units_total{policy,event}`: units of concurrency limits' leases
    /// `acquired`, `released`, `extended`, and `expired` (found ended by an operation on
    /// their key: a holder that never released; counted once, by the instance whose
    /// operation dropped them).
    pub(crate) lease_units: IntCounterVec,
    /// `quotad_leases_tracked`: leases acquired here whose key is read at their end
    /// (`limiter::reaper`), at most 100,000.
    pub(crate) leases_tracked: IntGauge,
    /// `quotad_leases_untracked_total`: leases acquired while 100,000 were tracked: their
    /// end is counted only when their key is next touched.
    pub(crate) leases_untracked: IntCounter,
    /// `quotad_config_reloads_total{result}`: reloads of the config file (SIGHUP or a
    /// change seen on disk): `ok`, `invalid` (the file has errors), `refused` (a change
    /// that cannot apply without a restart). The running config stays on all but `ok`.
    pub(crate) config_reloads: IntCounterVec,
    /// `quotad_admin_requests_total{action,result}`: requests to the admin endpoints.
    pub(crate) admin_requests: IntCounterVec,
    /// `quotad_runtime_limits{policy}`: keys with their own runtime limit in this
    /// instance's copy (expired ones until they are purged).
    pub(crate) runtime_limits: IntGaugeVec,
    /// `quotad_runtime_limit_propagation_seconds`: from a runtime limit's write (Redis's
    /// clock) to this instance applying it from the channel.
    pub(crate) runtime_limit_propagation: Histogram,
    /// `quotad_runtime_limit_resyncs_total`: whole reads of a policy's runtime limits, for
    /// a copy behind Redis's version (a message missed, a restart, a failover).
    pub(crate) runtime_limit_resyncs: IntCounter,
    /// `quotad_runtime_limit_pulls_total{peer,outcome}`: this region's pulls of a peer
    /// region's runtime-limit changes (global policies), by the coordinating instance:
    /// `ok`, `refused` (the peer answered with an error), `failed` (no answer, or a
    /// change not written here), `invalid` (a reply unsigned, badly signed or unreadable).
    pub(crate) runtime_limit_pulls: IntCounterVec,
    /// `quotad_runtime_limit_merges_total{peer,result}`: a peer region's changes merged
    /// here: `taken` (newer than this region's), `older` (this region had a newer one).
    pub(crate) runtime_limit_merged: IntCounterVec,
    /// `quotad_memory_store_keys{store}`: keys the embedded store holds (`primary` in
    /// memory mode, `local` for the fallback), at the last sweep; at `store.memory_max_keys`
    /// new keys are refused (`quotad_store_errors_total{kind="full"}`).
    pub(crate) memory_store_keys: IntGaugeVec,
    /// Global budgets, from the instance that coordinates the region (the others export
    /// zeros and `quotad_coordinator_leader 0`). Rates are units per second summed over the
    /// keys the coordinator tracks (hot or leased keys; cold keys run on their escrow).
    pub(crate) global: GlobalMetrics,
}

pub(crate) struct GlobalMetrics {
    /// `quotad_share_rate{policy,region}`: the rate this region enforces.
    pub(crate) share_rate: GaugeVec,
    /// `quotad_lent_rate{policy}`, `quotad_borrowed_rate{policy}`: reserved for peers,
    /// borrowed from them.
    pub(crate) lent_rate: GaugeVec,
    pub(crate) borrowed_rate: GaugeVec,
    /// `quotad_demand_rate{policy}`: smoothed offered load here.
    pub(crate) demand_rate: GaugeVec,
    /// `quotad_hot_keys{policy}`: keys the coordinator tracks.
    pub(crate) hot_keys: IntGaugeVec,
    /// `quotad_peer_up{peer}`: 1 while the link is connected (heard within 3 rounds).
    pub(crate) peer_up: IntGaugeVec,
    /// `quotad_peer_rtt_seconds{peer}`: the last exchange round trip.
    pub(crate) peer_rtt_seconds: GaugeVec,
    /// `quotad_exchange_bytes_total{peer,direction}`: exchange bodies sent and received.
    pub(crate) exchange_bytes: IntCounterVec,
    /// `quotad_exchange_keys_total{peer}`: keys in the exchanges sent to the peer, each
    /// exchange once (not per attempt): bytes sent over keys sent, summed over the regions,
    /// is the exchange's cost per key and round (the simulator's measure).
    pub(crate) exchange_keys: IntCounterVec,
    /// `quotad_exchange_keys_deferred_total`: keys left out of an exchange because more
    /// qualified than `coordinator.max_exchange_keys` (each runs on its escrow until there
    /// is room): above zero, the cap is smaller than the keys hot at once.
    pub(crate) exchange_keys_deferred: IntCounter,
    /// `quotad_exchange_binary{peer}`: 1 while this instance sends the peer the binary
    /// form, 0 while JSON (pinned, or the peer refused the binary form: an older version).
    pub(crate) exchange_binary: IntGaugeVec,
    /// `quotad_exchange_dictionary_keys{peer,side}`: keys in the dictionary of our numbers
    /// for the peer (`side="ours"`) and of the peer's numbers (`side="theirs"`); each is at
    /// most 2 × `coordinator.max_exchange_keys`.
    pub(crate) exchange_dictionary_keys: IntGaugeVec,
    /// `quotad_exchange_renumbered_total{peer}`: key dictionaries started over because
    /// the peer did not know our key numbers (it restarted, or another instance took over).
    pub(crate) exchange_renumbered: IntCounterVec,
    /// `quotad_exchange_rejected_total{reason}`: peer requests refused before the
    /// coordinator saw them (unauthenticated, bad_signature, stale, replay, ...).
    pub(crate) exchange_rejected: IntCounterVec,
    /// `quotad_rounds_total`: coordinator rounds run by this instance.
    pub(crate) rounds: IntCounter,
    /// `quotad_round_duration_seconds`: how long a round took (reading demand, planning,
    /// writing every engaged book); it must stay well inside the lock period.
    pub(crate) round_duration: Histogram,
    /// `quotad_sense_duration_seconds`: how long a read of demand between rounds took
    /// (`coordinator.sense`: counters of the keys in the exchange, plans of the keys that
    /// moved, their early exchanges built).
    pub(crate) sense_duration: Histogram,
    /// `quotad_coordinator_cpu_seconds_total`: CPU time of the coordinator thread (rounds,
    /// peers' exchanges and replies, takeovers; Linux only, 0 elsewhere): what global
    /// budgets cost this instance beside its checks.
    pub(crate) coordinator_cpu: Counter,
    /// `quotad_coordinator_leader{region}`: 1 while this instance holds the region's lock
    /// (summed by region: exactly 1 when the region is coordinated).
    pub(crate) leader: IntGaugeVec,
    /// `quotad_incarnation_rebases_total`: takeovers by this instance that drew an
    /// incarnation below the region's last one, which a clock ahead of real time had made
    /// one its peers would refuse.
    pub(crate) incarnation_rebases: IntCounter,
}

/// One decision-time histogram per entry point, resolved once (`quotad_check_duration_seconds`).
pub(crate) struct ByEntry {
    pub(crate) http: Histogram,
    pub(crate) forward_auth: Histogram,
    pub(crate) grpc: Histogram,
}

/// The entry points of `quotad_check_duration_seconds{entry}`.
pub(crate) const ENTRIES: [&str; 3] = ["http", "forward_auth", "grpc"];

/// `quotad_store_call_duration_seconds` buckets (s): from a loopback round trip to past
/// any sane `store.timeout`.
const STORE_CALL_BUCKETS: [f64; 12] = [
    0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

/// `quotad_runtime_limit_propagation_seconds` buckets (s): a message's way (a
/// millisecond) to the resync's round (a second) and beyond. Redis's clock against this
/// instance's: a skew shows here too.
const PROPAGATION_BUCKETS: [f64; 10] =
    [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0, 5.0];

/// `quotad_round_duration_seconds` buckets (s), a named constant to keep the catalogue
/// entry short. The runtime warns past a quarter of the lock period (0.75 s by default).
const ROUND_BUCKETS: [f64; 10] = [0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0];

impl GlobalMetrics {
    /// Registers the global-budget metrics through `c`, in the daemon's one registry, so
    /// that `/metrics` shows them whether or not this instance ever coordinates.
    fn new(c: &Catalogue) -> Self {
        GlobalMetrics {
            share_rate: c.labels(&["policy", "region"]).gauge(Opts::new(
                "quotad_share_rate",
                "Rate this region enforces (tracked keys).",
            )),
            lent_rate: c.labels(&["policy"]).gauge(Opts::new(
                "quotad_lent_rate",
                "Rate reserved for loans to peers.",
            )),
            borrowed_rate: c.labels(&["policy"]).gauge(Opts::new(
                "quotad_borrowed_rate",
                "Rate borrowed from peers.",
            )),
            demand_rate: c.labels(&["policy"]).gauge(Opts::new(
                "quotad_demand_rate",
                "Smoothed offered load here.",
            )),
            hot_keys: c
                .labels(&["policy"])
                .int_gauge(Opts::new("quotad_hot_keys", "Keys the coordinator tracks.")),
            peer_up: c.labels(&["peer"]).int_gauge(Opts::new(
                "quotad_peer_up",
                "1 while the peer link is connected.",
            )),
            peer_rtt_seconds: c.labels(&["peer"]).gauge(Opts::new(
                "quotad_peer_rtt_seconds",
                "Last exchange round trip.",
            )),
            exchange_bytes: c
                .labels(&["peer", "direction"])
                .counter(Opts::new("quotad_exchange_bytes_total", "Exchange bytes.")),
            exchange_keys: c.labels(&["peer"]).counter(Opts::new(
                "quotad_exchange_keys_total",
                "Keys in exchanges sent.",
            )),
            exchange_keys_deferred: c.counter(Opts::new(
                "quotad_exchange_keys_deferred_total",
                "Keys left out of exchanges by coordinator.max_exchange_keys.",
            )),
            exchange_binary: c.labels(&["peer"]).int_gauge(Opts::new(
                "quotad_exchange_binary",
                "1 while exchanges to the peer go in the binary form.",
            )),
            exchange_dictionary_keys: c.labels(&["peer", "side"]).int_gauge(Opts::new(
                "quotad_exchange_dictionary_keys",
                "Keys in a peer's exchange dictionary.",
            )),
            exchange_renumbered: c.labels(&["peer"]).counter(Opts::new(
                "quotad_exchange_renumbered_total",
                "Key dictionaries started over for the peer.",
            )),
            exchange_rejected: c.labels(&["reason"]).counter(Opts::new(
                "quotad_exchange_rejected_total",
                "Peer requests refused.",
            )),
            rounds: c.counter(Opts::new("quotad_rounds_total", "Coordinator rounds run.")),
            round_duration: c.histogram(
                HistogramOpts::new(
                    "quotad_round_duration_seconds",
                    "Time a coordinator round took.",
                )
                .buckets(ROUND_BUCKETS.to_vec()),
            ),
            sense_duration: c.histogram(
                HistogramOpts::new(
                    "quotad_sense_duration_seconds",
                    "Time a read of demand between rounds took.",
                )
                .buckets(ROUND_BUCKETS.to_vec()),
            ),
            coordinator_cpu: c.float_counter(Opts::new(
                "quotad_coordinator_cpu_seconds_total",
                "CPU time of the coordinator thread.",
            )),
            leader: c.labels(&["region"]).int_gauge(Opts::new(
                "quotad_coordinator_leader",
                "1 while this instance coordinates its region.",
            )),
            incarnation_rebases: c.counter(Opts::new(
                "quotad_incarnation_rebases_total",
                "Takeovers that left an incarnation from the future behind.",
            )),
        }
    }
}

/// The decision outcomes, as exported in `quotad_decisions_total{outcome}` and the API.
pub(crate) const OUTCOMES: [&str; 6] = [
    "allowed",
    "denied",
    "shadow",
    "fail_open",
    "fail_closed",
    "local",
];

/// `quotad_check_duration_seconds` buckets (s), a named constant to keep the catalogue
/// entry short: 50 us to 1 s.
const CHECK_BUCKETS: [f64; 13] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

impl Metrics {
    /// Builds the catalogue and pre-registers a zero series for every policy and outcome
    /// and every store error kind, so rates and alerts work before the first event of each
    /// kind. The kinds come from the store (`StoreError::KINDS`), which owns them: this
    /// module depends on nothing else in the daemon.
    pub(crate) fn new<'a>(
        policies: impl IntoIterator<Item = &'a str>,
        store_error_kinds: &[&str],
    ) -> Self {
        let registry = Registry::new();
        // process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds,
        // process_max_fds, process_threads, process_start_time_seconds (from /proc).
        #[cfg(target_os = "linux")]
        registry
            .register(Box::new(
                prometheus::process_collector::ProcessCollector::for_self(),
            ))
            .expect("the process collector registers once");
        let metrics = Self::catalogue(registry);
        metrics.preregister(policies, store_error_kinds);
        metrics
    }

    /// Every metric, registered in `registry`, with no series yet: what each one is lives
    /// here and in the field docs, apart from the zero series [`Metrics::preregister`]
    /// adds from the config.
    fn catalogue(registry: Registry) -> Self {
        let c = Catalogue(&registry);
        Metrics {
            decisions: c.labels(&["policy", "outcome"]).counter(Opts::new(
                "quotad_decisions_total",
                "Decisions by policy and outcome.",
            )),
            check_duration: ByEntry::new(
                c.labels(&["entry"]).histogram(
                    HistogramOpts::new(
                        "quotad_check_duration_seconds",
                        "Time to decide a request, by entry point (http, forward_auth, grpc).",
                    )
                    .buckets(CHECK_BUCKETS.to_vec()),
                ),
            ),
            http_responses: c.labels(&["route", "status"]).counter(Opts::new(
                "quotad_http_responses_total",
                "HTTP answers by matched route and status.",
            )),
            grpc_responses: c.labels(&["code"]).counter(Opts::new(
                "quotad_grpc_responses_total",
                "gRPC calls answered, by status code.",
            )),
            store_call_duration: c.histogram(
                HistogramOpts::new(
                    "quotad_store_call_duration_seconds",
                    "Redis calls from send to answer or timeout.",
                )
                .buckets(STORE_CALL_BUCKETS.to_vec()),
            ),
            store_errors: c.labels(&["kind"]).counter(Opts::new(
                "quotad_store_errors_total",
                "Store calls that produced no decision, by kind.",
            )),
            store_up: c.int_gauge(Opts::new(
                "quotad_store_up",
                "1 while the store is reachable.",
            )),
            script_loads: c.counter(Opts::new(
                "quotad_script_loads_total",
                "Lua scripts loaded into Redis.",
            )),
            refund_errors: c.counter(Opts::new(
                "quotad_refund_errors_total",
                "Failed refunds of admitted checks in a denied batch.",
            )),
            build_info: c
                .labels(&["version", "revision"])
                .int_gauge(Opts::new("quotad_build_info", "Build information.")),
            shed: c.labels(&["reason"]).counter(Opts::new(
                "quotad_shed_total",
                "Requests shed with 503 before reaching Redis, by reason.",
            )),
            store_in_flight: c.int_gauge(Opts::new(
                "quotad_store_in_flight",
                "Redis call permits held by requests in flight.",
            )),
            store_queued: c.int_gauge(Opts::new(
                "quotad_store_queued",
                "Requests waiting for Redis call permits.",
            )),
            store_pipelines: c.counter(Opts::new(
                "quotad_store_pipelines_total",
                "Pipelines the request path sent to Redis (one write each).",
            )),
            store_pipelined_commands: c.counter(Opts::new(
                "quotad_store_pipelined_commands_total",
                "Commands the request path sent to Redis in those pipelines.",
            )),
            breaker_opens: c.counter(Opts::new(
                "quotad_store_breaker_opens_total",
                "Times the store circuit breaker opened.",
            )),
            connections_open: c.labels(&["listener"]).int_gauge(Opts::new(
                "quotad_connections_open",
                "Connections open, by listener (http, grpc).",
            )),
            connections_closed: c.labels(&["listener", "reason"]).counter(Opts::new(
                "quotad_connections_closed_total",
                "Connections closed by the server, by listener and reason.",
            )),
            accept_errors: c.labels(&["listener"]).counter(Opts::new(
                "quotad_accept_errors_total",
                "Failed accepts, by listener.",
            )),
            deny_cache_hits: c.labels(&["policy"]).counter(Opts::new(
                "quotad_deny_cache_hits_total",
                "Denials answered from memory without a Redis call.",
            )),
            deny_cache_keys: c
                .int_gauge(Opts::new("quotad_deny_cache_keys", "Denials remembered.")),
            invalidations_received: c.counter(Opts::new(
                "quotad_invalidations_received_total",
                "Invalidations taken off the channel and applied.",
            )),
            keys_without_ttl: c.int_gauge(Opts::new(
                "quotad_keys_without_ttl",
                "quotad keys found without a TTL by the last janitor sweep.",
            )),
            hot_admits: c.labels(&["policy"]).counter(Opts::new(
                "quotad_hot_key_admits_total",
                "Checks admitted from a hot key's slice, in memory.",
            )),
            hot_slices: c.labels(&["event"]).counter(Opts::new(
                "quotad_hot_key_slices_total",
                "Hot-key slices taken from Redis, returned, ended by a reset or refund, and not returned (the store failed).",
            )),
            hot_units: c.labels(&["event"]).counter(Opts::new(
                "quotad_hot_key_units_total",
                "Units of hot-key slices taken from Redis and given back.",
            )),
            hot_entries: c.int_gauge(Opts::new(
                "quotad_hot_key_entries",
                "Keys hot on this instance (taking slices).",
            )),
            hot_refused: c.counter(Opts::new(
                "quotad_hot_keys_refused_total",
                "Keys that passed their hot rate while the hot-key table was full.",
            )),
            store_late_replies: c.counter(Opts::new(
                "quotad_store_late_replies_total",
                "Redis replies taken in the turns after their timer fired: quotad was behind, Redis was not.",
            )),
            janitor_repaired: c.counter(Opts::new(
                "quotad_janitor_repaired_total",
                "TTLs the janitor gave back to quotad keys.",
            )),
            janitor_last_scan: c.int_gauge(Opts::new(
                "quotad_janitor_last_scan_timestamp_seconds",
                "When this instance last finished a janitor sweep.",
            )),
            janitor_sweeps: c.labels(&["result"]).counter(Opts::new(
                "quotad_janitor_sweeps_total",
                "Janitor intervals of this instance by result: swept, skipped or failed.",
            )),
            forward_auth_missing_key: c.labels(&["policy", "answer"]).counter(Opts::new(
                "quotad_forward_auth_missing_key_total",
                "Forward-auth requests without their key, by policy and on_missing_key answer.",
            )),
            grpc_invalid_descriptors: c.labels(&["policy"]).counter(Opts::new(
                "quotad_grpc_invalid_descriptors_total",
                "gRPC descriptors of a policy without a usable key or with a cost over its capacity: answered OVER_LIMIT.",
            )),
            settlements: c.labels(&["policy", "result"]).counter(Opts::new(
                "quotad_settlements_total",
                "Costs counted after the work, by policy and result (settled, already_settled, ended_by_reset, unknown, charged, failed).",
            )),
            settled_units: c.labels(&["policy", "direction"]).counter(Opts::new(
                "quotad_settled_units_total",
                "Units charged beyond the estimates, and refunded below them, by policy.",
            )),
            lease_units: c.labels(&["policy", "event"]).counter(Opts::new(
                "quotad_lease_units_total",
                "Units of concurrency leases acquired, released, extended and expired, by policy.",
            )),
            leases_tracked: c.int_gauge(Opts::new(
                "quotad_leases_tracked",
                "Leases acquired here whose key is read when they end.",
            )),
            leases_untracked: c.counter(Opts::new(
                "quotad_leases_untracked_total",
                "Leases acquired while the tracked ones were at their bound.",
            )),
            admin_requests: c.labels(&["action", "result"]).counter(Opts::new(
                "quotad_admin_requests_total",
                "Requests to the admin endpoints, by action and result.",
            )),
            runtime_limits: c.labels(&["policy"]).int_gauge(Opts::new(
                "quotad_runtime_limits",
                "Keys with their own runtime limit in this instance's copy, by policy.",
            )),
            runtime_limit_propagation: c.histogram(
                HistogramOpts::new(
                    "quotad_runtime_limit_propagation_seconds",
                    "From a runtime limit's write to this instance applying it.",
                )
                .buckets(PROPAGATION_BUCKETS.to_vec()),
            ),
            runtime_limit_resyncs: c.counter(Opts::new(
                "quotad_runtime_limit_resyncs_total",
                "Whole reads of a policy's runtime limits for a copy behind Redis.",
            )),
            runtime_limit_pulls: c.labels(&["peer", "outcome"]).counter(Opts::new(
                "quotad_runtime_limit_pulls_total",
                "Pulls of a peer region's runtime-limit changes, by outcome.",
            )),
            runtime_limit_merged: c.labels(&["peer", "result"]).counter(Opts::new(
                "quotad_runtime_limit_merges_total",
                "A peer region's runtime-limit changes merged here, by result (taken, older).",
            )),
            config_reloads: c.labels(&["result"]).counter(Opts::new(
                "quotad_config_reloads_total",
                "Config reloads by result (ok, invalid, refused).",
            )),
            memory_store_keys: c.labels(&["store"]).int_gauge(Opts::new(
                "quotad_memory_store_keys",
                "Keys held by the embedded store.",
            )),
            global: GlobalMetrics::new(&c),
            registry,
        }
    }

    /// Creates the zero series of every policy and outcome and of every store error kind,
    /// and sets `quotad_build_info`: a series that does not exist yet has no rate, so
    /// without them alerts and dashboards would see nothing until the first event.
    fn preregister<'a>(
        &self,
        policies: impl IntoIterator<Item = &'a str>,
        store_error_kinds: &[&str],
    ) {
        for p in policies {
            for o in OUTCOMES {
                self.decisions.with_label_values(&[p, o]);
            }
            self.deny_cache_hits.with_label_values(&[p]);
            self.grpc_invalid_descriptors.with_label_values(&[p]);
        }
        for k in store_error_kinds {
            self.store_errors.with_label_values(&[k]);
        }
        for r in RELOAD_RESULTS {
            self.config_reloads.with_label_values(&[r]);
        }
        for a in ADMIN_ACTIONS {
            for r in ADMIN_RESULTS {
                self.admin_requests.with_label_values(&[a, r]);
            }
        }
        self.build_info
            .with_label_values(&[
                env!("CARGO_PKG_VERSION"),
                REVISION.get().copied().unwrap_or("unknown"),
            ])
            .set(1);
    }

    /// The zero series of a concurrency limit.
    pub(crate) fn preregister_concurrency(&self, policy: &str) {
        for o in OUTCOMES {
            self.decisions.with_label_values(&[policy, o]);
        }
        for e in LEASE_EVENTS {
            self.lease_units.with_label_values(&[policy, e]);
        }
    }

    /// The zero series of a policy that takes settlements.
    pub(crate) fn preregister_settlements(&self, policy: &str) {
        for r in SETTLE_RESULTS {
            self.settlements.with_label_values(&[policy, r]);
        }
        for d in ["charged", "refunded"] {
            self.settled_units.with_label_values(&[policy, d]);
        }
    }

    /// Counts a store call that produced no decision; `kind` is `StoreError::kind`.
    pub(crate) fn store_error(&self, kind: &str) {
        self.store_errors.with_label_values(&[kind]).inc();
    }

    /// The Prometheus text exposition.
    pub(crate) fn render(&self) -> String {
        let mut buf = Vec::new();
        // Encoding into a Vec cannot fail for well-formed metrics.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

/// Creates metrics and registers each in the daemon's one registry, the one
/// [`Metrics::render`] gathers: no metric can be defined and then missing from `/metrics`,
/// and the catalogue states only what differs between metrics. Names and help texts stay
/// literal `Opts` at each call: tests/dashboards.rs reads the names from there.
struct Catalogue<'a>(&'a Registry);

impl<'a> Catalogue<'a> {
    /// Registers `metric` and hands it back.
    fn register<M: Collector + Clone + 'static>(&self, metric: M) -> M {
        self.0
            .register(Box::new(metric.clone()))
            .expect("metric names are unique");
        metric
    }

    fn counter(&self, opts: Opts) -> IntCounter {
        self.register(IntCounter::with_opts(opts).expect("valid metric"))
    }

    fn int_gauge(&self, opts: Opts) -> IntGauge {
        self.register(IntGauge::with_opts(opts).expect("valid metric"))
    }

    /// Float values: seconds.
    fn float_counter(&self, opts: Opts) -> Counter {
        self.register(Counter::with_opts(opts).expect("valid metric"))
    }

    /// Its buckets are in `opts`.
    fn histogram(&self, opts: HistogramOpts) -> Histogram {
        self.register(Histogram::with_opts(opts).expect("valid metric"))
    }

    /// The labelled kinds (`IntCounterVec`, ...) with these label names: a step of its own
    /// so that the metric's `Opts` is the last argument, which keeps each entry short.
    fn labels(&self, names: &'a [&'a str]) -> Labelled<'a> {
        Labelled {
            catalogue: Catalogue(self.0),
            names,
        }
    }
}

/// [`Catalogue::labels`]: metrics with one series per combination of these label values.
struct Labelled<'a> {
    catalogue: Catalogue<'a>,
    names: &'a [&'a str],
}

impl Labelled<'_> {
    fn counter(&self, opts: Opts) -> IntCounterVec {
        let metric = IntCounterVec::new(opts, self.names).expect("valid metric");
        self.catalogue.register(metric)
    }

    fn int_gauge(&self, opts: Opts) -> IntGaugeVec {
        let metric = IntGaugeVec::new(opts, self.names).expect("valid metric");
        self.catalogue.register(metric)
    }

    /// Its buckets are in `opts`.
    fn histogram(&self, opts: HistogramOpts) -> HistogramVec {
        let metric = HistogramVec::new(opts, self.names).expect("valid metric");
        self.catalogue.register(metric)
    }

    /// Float values: rates, seconds.
    fn gauge(&self, opts: Opts) -> GaugeVec {
        let metric = GaugeVec::new(opts, self.names).expect("valid metric");
        self.catalogue.register(metric)
    }
}

impl ByEntry {
    /// The three series of `vec` (so each exists, at zero, from the start).
    fn new(vec: HistogramVec) -> Self {
        let [http, forward_auth, grpc] = ENTRIES.map(|e| vec.with_label_values(&[e]));
        ByEntry {
            http,
            forward_auth,
            grpc,
        }
    }
}
