//! The metric catalogue: every metric quotad exports, its labels and what it means, in one
//! place. Dashboards and alerts use only names defined here.
//!
//! Label values come from bounded sets only: policy names (from the config), outcomes
//! (a fixed enum), store error kinds (a fixed enum). Never a user key: one series per key
//! would let any client grow the exposition without bound.

use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry, TextEncoder,
};

pub struct Metrics {
    registry: Registry,
    /// `quotad_decisions_total{policy,outcome}`: every decision, by outcome
    /// (allowed, denied, shadow, fail_open, fail_closed, local).
    pub decisions: IntCounterVec,
    /// `quotad_check_duration_seconds`: time to answer one `POST /v1/check` (single or batch),
    /// from parsed request to decision, store round trips included.
    pub check_duration: Histogram,
    /// `quotad_store_errors_total{kind}`: store calls that gave no decision.
    pub store_errors: IntCounterVec,
    /// `quotad_store_up`: 1 while the store answers probes and the circuit is closed.
    pub store_up: IntGauge,
    /// `quotad_script_loads_total`: SCRIPT LOADs sent (start-up, reconnects, NOSCRIPT recovery).
    pub script_loads: IntCounter,
    /// `quotad_refund_errors_total`: refunds of a denied batch's siblings that failed (those
    /// units stay charged until their window passes).
    pub refund_errors: IntCounter,
    /// `quotad_build_info{version}`: always 1.
    pub build_info: IntGaugeVec,
    /// `quotad_shed_total{reason}`: requests refused with 503 `overloaded` before reaching
    /// Redis (`queue_full`, `queue_timeout`); not decisions, nothing charged.
    pub shed: IntCounterVec,
    /// `quotad_store_in_flight`: permits held by requests whose Redis calls are in flight.
    pub store_in_flight: IntGauge,
    /// `quotad_store_queued`: requests waiting for Redis permits.
    pub store_queued: IntGauge,
    /// `quotad_store_breaker_opens_total`: times the circuit breaker opened (a lost
    /// connection, or timeouts confirmed by an unanswered PING).
    pub breaker_opens: IntCounter,
    /// `quotad_connections_open`: HTTP connections open now.
    pub connections_open: IntGauge,
    /// `quotad_connections_closed_total{reason}`: connections the server closed
    /// (`header_timeout`, `idle_timeout`, `evicted`, `rejected`, `drained`); clients'
    /// own closes are not counted.
    pub connections_closed: IntCounterVec,
    /// `quotad_accept_errors_total`: failed accepts (a full file table, usually).
    pub accept_errors: IntCounter,
    /// `quotad_deny_cache_hits_total{policy}`: denials answered from memory, without a
    /// Redis call (a key hammered while over its limit).
    pub deny_cache_hits: IntCounterVec,
    /// `quotad_deny_cache_keys`: denials remembered (at the last sweep).
    pub deny_cache_keys: IntGauge,
    /// `quotad_memory_store_keys{store}`: keys the embedded store holds (`primary` in
    /// memory mode, `local` for the fallback), at the last sweep; at `store.memory_max_keys`
    /// new keys are refused (`quotad_store_errors_total{kind="full"}`).
    pub memory_store_keys: IntGaugeVec,
    /// Global budgets, from the instance that coordinates the region (the others export
    /// zeros and `quotad_coordinator_leader 0`). Rates are units per second summed over the
    /// keys the coordinator tracks (hot or leased keys; cold keys run on their escrow).
    pub global: GlobalMetrics,
}

pub struct GlobalMetrics {
    /// `quotad_share_rate{policy,region}`: the rate this region enforces.
    pub share_rate: GaugeVec,
    /// `quotad_lent_rate{policy}`, `quotad_borrowed_rate{policy}`: reserved for peers,
    /// borrowed from them.
    pub lent_rate: GaugeVec,
    pub borrowed_rate: GaugeVec,
    /// `quotad_demand_rate{policy}`: smoothed offered load here.
    pub demand_rate: GaugeVec,
    /// `quotad_hot_keys{policy}`: keys the coordinator tracks.
    pub hot_keys: IntGaugeVec,
    /// `quotad_peer_up{peer}`: 1 while the link is connected (heard within 3 rounds).
    pub peer_up: IntGaugeVec,
    /// `quotad_peer_rtt_seconds{peer}`: the last exchange round trip.
    pub peer_rtt_seconds: GaugeVec,
    /// `quotad_exchange_bytes_total{peer,direction}`: exchange bodies sent and received.
    pub exchange_bytes: IntCounterVec,
    /// `quotad_exchange_rejected_total{reason}`: peer requests refused before the
    /// coordinator saw them (unauthenticated, bad_signature, stale, replay, ...).
    pub exchange_rejected: IntCounterVec,
    /// `quotad_rounds_total`: coordinator rounds run by this instance.
    pub rounds: IntCounter,
    /// `quotad_round_duration_seconds`: how long a round took (reading demand, planning,
    /// writing every engaged book); it must stay well inside the lock period.
    pub round_duration: Histogram,
    /// `quotad_coordinator_leader{region}`: 1 while this instance holds the region's lock
    /// (summed by region: exactly 1 when the region is coordinated).
    pub leader: IntGaugeVec,
}

impl GlobalMetrics {
    fn new(registry: &Registry) -> Self {
        let gauge = |opts: Opts, labels: &[&str]| {
            let g = GaugeVec::new(opts, labels).expect("valid metric");
            registry
                .register(Box::new(g.clone()))
                .expect("unique metric");
            g
        };
        let int_gauge = |opts: Opts, labels: &[&str]| {
            let g = IntGaugeVec::new(opts, labels).expect("valid metric");
            registry
                .register(Box::new(g.clone()))
                .expect("unique metric");
            g
        };
        let counter = |opts: Opts, labels: &[&str]| {
            let c = IntCounterVec::new(opts, labels).expect("valid metric");
            registry
                .register(Box::new(c.clone()))
                .expect("unique metric");
            c
        };
        let rounds = IntCounter::new("quotad_rounds_total", "Coordinator rounds run.")
            .expect("valid metric");
        registry
            .register(Box::new(rounds.clone()))
            .expect("unique metric");
        let round_duration = Histogram::with_opts(
            HistogramOpts::new(
                "quotad_round_duration_seconds",
                "Time a coordinator round took.",
            )
            .buckets(vec![
                0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            ]),
        )
        .expect("valid metric");
        registry
            .register(Box::new(round_duration.clone()))
            .expect("unique metric");
        let leader = int_gauge(
            Opts::new(
                "quotad_coordinator_leader",
                "1 while this instance coordinates its region.",
            ),
            &["region"],
        );
        GlobalMetrics {
            share_rate: gauge(
                Opts::new(
                    "quotad_share_rate",
                    "Rate this region enforces (tracked keys).",
                ),
                &["policy", "region"],
            ),
            lent_rate: gauge(
                Opts::new("quotad_lent_rate", "Rate reserved for loans to peers."),
                &["policy"],
            ),
            borrowed_rate: gauge(
                Opts::new("quotad_borrowed_rate", "Rate borrowed from peers."),
                &["policy"],
            ),
            demand_rate: gauge(
                Opts::new("quotad_demand_rate", "Smoothed offered load here."),
                &["policy"],
            ),
            hot_keys: int_gauge(
                Opts::new("quotad_hot_keys", "Keys the coordinator tracks."),
                &["policy"],
            ),
            peer_up: int_gauge(
                Opts::new("quotad_peer_up", "1 while the peer link is connected."),
                &["peer"],
            ),
            peer_rtt_seconds: gauge(
                Opts::new("quotad_peer_rtt_seconds", "Last exchange round trip."),
                &["peer"],
            ),
            exchange_bytes: counter(
                Opts::new("quotad_exchange_bytes_total", "Exchange bytes."),
                &["peer", "direction"],
            ),
            exchange_rejected: counter(
                Opts::new("quotad_exchange_rejected_total", "Peer requests refused."),
                &["reason"],
            ),
            rounds,
            round_duration,
            leader,
        }
    }
}

/// The decision outcomes, as exported in `quotad_decisions_total{outcome}` and the API.
pub const OUTCOMES: [&str; 6] = [
    "allowed",
    "denied",
    "shadow",
    "fail_open",
    "fail_closed",
    "local",
];

impl Metrics {
    /// Builds the catalogue and pre-registers a zero series for every policy and outcome
    /// and every store error kind, so rates and alerts work before the first event of each
    /// kind. The kinds come from the store (`StoreError::KINDS`), which owns them: this
    /// module depends on nothing else in the daemon.
    pub fn new<'a>(
        policies: impl IntoIterator<Item = &'a str>,
        store_error_kinds: &[&str],
    ) -> Self {
        let registry = Registry::new();
        let decisions = IntCounterVec::new(
            Opts::new("quotad_decisions_total", "Decisions by policy and outcome."),
            &["policy", "outcome"],
        )
        .expect("valid metric");
        let check_duration = Histogram::with_opts(
            HistogramOpts::new(
                "quotad_check_duration_seconds",
                "Time to answer a check request.",
            )
            .buckets(vec![
                0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05,
                0.1, 0.25, 1.0,
            ]),
        )
        .expect("valid metric");
        let store_errors = IntCounterVec::new(
            Opts::new(
                "quotad_store_errors_total",
                "Store calls that produced no decision, by kind.",
            ),
            &["kind"],
        )
        .expect("valid metric");
        let store_up = IntGauge::new("quotad_store_up", "1 while the store is reachable.")
            .expect("valid metric");
        let script_loads = IntCounter::new(
            "quotad_script_loads_total",
            "Lua scripts loaded into Redis.",
        )
        .expect("valid metric");
        let refund_errors = IntCounter::new(
            "quotad_refund_errors_total",
            "Failed refunds of admitted checks in a denied batch.",
        )
        .expect("valid metric");
        let build_info = IntGaugeVec::new(
            Opts::new("quotad_build_info", "Build information."),
            &["version"],
        )
        .expect("valid metric");
        let shed = IntCounterVec::new(
            Opts::new(
                "quotad_shed_total",
                "Requests shed with 503 before reaching Redis, by reason.",
            ),
            &["reason"],
        )
        .expect("valid metric");
        let store_in_flight = IntGauge::new(
            "quotad_store_in_flight",
            "Redis call permits held by requests in flight.",
        )
        .expect("valid metric");
        let store_queued = IntGauge::new(
            "quotad_store_queued",
            "Requests waiting for Redis call permits.",
        )
        .expect("valid metric");
        let breaker_opens = IntCounter::new(
            "quotad_store_breaker_opens_total",
            "Times the store circuit breaker opened.",
        )
        .expect("valid metric");
        let connections_open = IntGauge::new("quotad_connections_open", "HTTP connections open.")
            .expect("valid metric");
        let connections_closed = IntCounterVec::new(
            Opts::new(
                "quotad_connections_closed_total",
                "HTTP connections closed by the server, by reason.",
            ),
            &["reason"],
        )
        .expect("valid metric");
        let accept_errors = IntCounter::new(
            "quotad_accept_errors_total",
            "Failed accepts on the listener.",
        )
        .expect("valid metric");
        let deny_cache_hits = IntCounterVec::new(
            Opts::new(
                "quotad_deny_cache_hits_total",
                "Denials answered from memory without a Redis call.",
            ),
            &["policy"],
        )
        .expect("valid metric");
        let deny_cache_keys =
            IntGauge::new("quotad_deny_cache_keys", "Denials remembered.").expect("valid metric");
        let memory_store_keys = IntGaugeVec::new(
            Opts::new(
                "quotad_memory_store_keys",
                "Keys held by the embedded store.",
            ),
            &["store"],
        )
        .expect("valid metric");
        for m in [
            Box::new(decisions.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(deny_cache_hits.clone()),
            Box::new(deny_cache_keys.clone()),
            Box::new(memory_store_keys.clone()),
            Box::new(connections_open.clone()),
            Box::new(connections_closed.clone()),
            Box::new(accept_errors.clone()),
            Box::new(shed.clone()),
            Box::new(store_in_flight.clone()),
            Box::new(store_queued.clone()),
            Box::new(breaker_opens.clone()),
            Box::new(check_duration.clone()),
            Box::new(store_errors.clone()),
            Box::new(store_up.clone()),
            Box::new(script_loads.clone()),
            Box::new(refund_errors.clone()),
            Box::new(build_info.clone()),
        ] {
            registry.register(m).expect("metric names are unique");
        }
        for p in policies {
            for o in OUTCOMES {
                decisions.with_label_values(&[p, o]);
            }
            deny_cache_hits.with_label_values(&[p]);
        }
        for k in store_error_kinds {
            store_errors.with_label_values(&[k]);
        }

        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        let global = GlobalMetrics::new(&registry);
        Metrics {
            registry,
            decisions,
            check_duration,
            store_errors,
            store_up,
            script_loads,
            refund_errors,
            build_info,
            shed,
            store_in_flight,
            store_queued,
            breaker_opens,
            connections_open,
            connections_closed,
            accept_errors,
            deny_cache_hits,
            deny_cache_keys,
            memory_store_keys,
            global,
        }
    }

    /// Counts a store call that produced no decision; `kind` is `StoreError::kind`.
    pub fn store_error(&self, kind: &str) {
        self.store_errors.with_label_values(&[kind]).inc();
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        // Encoding into a Vec cannot fail for well-formed metrics.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}
