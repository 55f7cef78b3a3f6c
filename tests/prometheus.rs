//! The dashboard and the alerts, proven on a real Prometheus. Debian's `prometheus`
//! scrapes two live regions (a Redis and a quotad each, one global policy between them)
//! every second and evaluates deploy/prometheus/quotad-rules.yml every second, while the
//! test drives every entry point. Then every panel query of dashboards/quotad.json and
//! every recording rule must return series; a panel that can only have data under a fault
//! is listed with that fault, and every alert with the fault that fires it: the test
//! causes each fault and asks Prometheus for the alert's own expression.
//!
//! `promtool check rules` and `promtool test rules` run here too.

use quotad_testkit as common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::prometheus::Prometheus;
use common::proxy::{Leg, Proxy};
use common::{Config, Descriptor, Global, Peer, Policy, Quotad, RedisServer, request, wait_for};
use serde_json::{Value, json};

const SECRET: &str = "a-shared-secret-of-32-bytes-long!";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A region's config: every kind of policy the panels and alerts look at.
fn config(region: &str, peer: &str, peer_url: &str, redis: &RedisServer) -> String {
    Config::redis(&redis.url())
        .region(region)
        .store("janitor_interval", "1s")
        .store("max_in_flight", 2)
        .store("max_queued", 2)
        .store("timeout", "200ms")
        .coordinator("secret", SECRET)
        .peer(Peer::new(peer, peer_url))
        .policy(
            Policy::new("api", "token_bucket", 20, "1m")
                .on_store_error("open")
                .runtime_limits(1000),
        )
        .policy(Policy::new("strict", "fixed_window", 5, "1m").on_store_error("closed"))
        .policy(Policy::new("near", "fixed_window", 100, "1m").on_store_error("local"))
        .policy(
            Policy::new("hot", "fixed_window", 1_000_000, "1m")
                .on_store_error("open")
                .set("hot_key_rate", 20),
        )
        .policy(
            Policy::new("edge", "token_bucket", 5, "1m")
                .on_store_error("open")
                .forward_auth(&["header:x-api-key"], "deny", 429),
        )
        .policy(
            Policy::new("g", "token_bucket", 50, "1s")
                .on_store_error("closed")
                .global(
                    Global::escrow(&[("eu", 1), ("us", 1)])
                        .set("lease", "2s")
                        .set("round", "500ms"),
                ),
        )
        .policy(
            Policy::new("metered", "token_bucket", 1_000, "1m")
                .on_store_error("open")
                .set("settle_within", "1m"),
        )
        .policy(Policy::new("streams", "concurrency", 10, "1m").on_store_error("open"))
        .descriptor("envoy", Descriptor::new("user").policy("api"))
        .to_toml()
}

/// Two regions linked through relays (their ports are known before the daemons').
struct Regions {
    redis: Vec<RedisServer>,
    daemons: Vec<Quotad>,
    grpc: Vec<u16>,
    _relays: Vec<Proxy>,
}

impl Regions {
    fn start() -> Regions {
        let leg = || Arc::new(std::sync::Mutex::new(Leg::default()));
        let relays: Vec<Proxy> = (0..2).map(|_| Proxy::start(leg(), leg())).collect();
        // DEBUG SLEEP makes Redis slow on purpose (the redis_slow fault).
        let redis: Vec<RedisServer> = (0..2)
            .map(|_| RedisServer::start_with_args(false, &["--enable-debug-command", "yes"]))
            .collect();
        let names = ["eu", "us"];
        let mut daemons = Vec::new();
        let mut grpc = Vec::new();
        for i in 0..2 {
            let port = common::free_port();
            let text = config(names[i], names[1 - i], &relays[1 - i].url(), &redis[i]);
            daemons.push(Quotad::start_with(
                &text,
                &format!("grpc_listen = \"127.0.0.1:{port}\"\nheader_timeout = \"1s\""),
            ));
            grpc.push(port);
        }
        for (relay, d) in relays.iter().zip(&daemons) {
            relay.set_target(d.port);
        }
        Regions {
            redis,
            daemons,
            grpc,
            _relays: relays,
        }
    }
}

/// Requests of every kind to `q` until `stop`, from `threads` threads.
fn traffic(q: &Quotad, grpc: u16, threads: usize, stop: &AtomicBool) {
    std::thread::scope(|s| {
        for t in 0..threads {
            s.spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let key = format!("k{}", n % 7);
                    for policy in ["api", "strict", "near", "g"] {
                        q.check(&json!({"policy": policy, "key": key}));
                    }
                    q.check(&json!({"policy": "hot", "key": "one"}));
                    q.check(&json!({"checks": [
                        {"policy": "strict", "key": format!("b{t}")},
                        {"policy": "api", "key": format!("b{t}")}
                    ]}));
                    let _ = request(q.port, "GET", "/v1/authz/edge", &[("x-api-key", "k")], "");
                    let _ = request(q.port, "GET", "/v1/authz/edge", &[], "");
                    if n % 10 == 0 {
                        let _ = common::grpc::should_rate_limit(grpc, "envoy", &[("user", "ann")]);
                        let _ = request(q.port, "GET", "/no/such/route", &[], "");
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            });
        }
    });
}

/// Runs `traffic` on every daemon for `d`.
fn load_for(r: &Regions, d: Duration, threads: usize) {
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        for (q, g) in r.daemons.iter().zip(&r.grpc) {
            let stop = &stop;
            s.spawn(move || traffic(q, *g, threads, stop));
        }
        std::thread::sleep(d);
        stop.store(true, Ordering::Relaxed);
    });
}

/// A dashboard query as Grafana sends it, with the variables at "All" and a rate window
/// of 10 scrapes.
fn substitute(expr: &str) -> String {
    expr.replace("$__rate_interval", "10s")
        .replace("$instance", ".*")
        .replace("$policy", ".*")
}

/// Every target of the dashboard: (panel title, refId, query).
fn panel_queries() -> Vec<(String, String, String)> {
    let text = std::fs::read_to_string(root().join("dashboards/quotad.json")).expect("read");
    let d: Value = serde_json::from_str(&text).expect("JSON");
    let mut out = Vec::new();
    fn walk(ps: &Value, out: &mut Vec<(String, String, String)>) {
        for p in ps.as_array().into_iter().flatten() {
            for t in p["targets"].as_array().into_iter().flatten() {
                if let Some(e) = t["expr"].as_str() {
                    out.push((
                        p["title"].as_str().unwrap_or("?").to_owned(),
                        t["refId"].as_str().unwrap_or("?").to_owned(),
                        substitute(e),
                    ));
                }
            }
            walk(&p["panels"], out);
        }
    }
    walk(&d["panels"], &mut out);
    out
}

/// The faults the test causes, in order, and what each is.
const FAULTS: [(&str, &str); 8] = [
    (
        "forged_exchange",
        "an unsigned request to a region's peer endpoint",
    ),
    (
        "redis_stalls",
        "region eu's Redis stopped (SIGSTOP) for 3 s under load",
    ),
    (
        "redis_slow",
        "region eu's Redis answering late (DEBUG SLEEP 0.15 in a loop) for 3 s",
    ),
    (
        "redis_out_of_memory",
        "region eu's Redis refusing writes (maxmemory 1) for 3 s",
    ),
    (
        "key_without_ttl",
        "a quotad key in eu's Redis without a TTL, found by the janitor",
    ),
    ("peer_dies", "region us's daemon killed"),
    (
        "redis_restarts",
        "region eu's Redis killed and restarted, twice",
    ),
    ("all_daemons_stop", "every daemon stopped"),
];

/// Panels with data only under a fault: (title, refId) → fault. None today: every
/// counter a panel rates has its zero series from the start (`Metrics::preregister`), so
/// a panel with no data means a renamed metric or a broken query.
fn panel_faults() -> BTreeMap<(&'static str, &'static str), &'static str> {
    BTreeMap::new()
}

/// An alert no fault here fires: a refund fails only when Redis goes away between a
/// denied batch's script and its refund, a window of microseconds no test can aim at.
/// Its expression without the threshold must return series (the metric and labels are
/// live), and promtool's unit test (deploy/prometheus/quotad-rules.test.yml) fires it.
const NOT_CAUSED: &str = "not_caused";

/// Alerts → the fault that fires them.
fn alert_faults() -> BTreeMap<&'static str, &'static str> {
    BTreeMap::from([
        ("QuotadRefundErrors", NOT_CAUSED),
        ("QuotadStoreDown", "redis_stalls"),
        ("QuotadFailOpenDecisions", "redis_stalls"),
        ("QuotadFailClosedDecisions", "redis_stalls"),
        ("QuotadLocalFallbackDecisions", "redis_stalls"),
        ("QuotadHighCheckLatency", "redis_slow"),
        ("QuotadStoreErrors", "redis_out_of_memory"),
        ("QuotadShedding", "redis_stalls"),
        ("QuotadKeysWithoutTTL", "key_without_ttl"),
        ("QuotadScriptReloads", "redis_restarts"),
        ("QuotadPeerDown", "peer_dies"),
        ("QuotadExchangesRejected", "forged_exchange"),
        ("QuotadRegionNotCoordinated", "redis_restarts"),
        ("QuotadAbsent", "all_daemons_stop"),
    ])
}

/// The queries among `queries` that return nothing now.
fn empty<'a>(p: &Prometheus, queries: impl IntoIterator<Item = &'a String>) -> Vec<String> {
    queries
        .into_iter()
        .filter(|q| p.query(q).is_empty())
        .cloned()
        .collect()
}

#[test]
fn promtool_checks_and_tests_the_rules() {
    let rules = root().join("deploy/prometheus/quotad-rules.yml");
    let tests = root().join("deploy/prometheus/quotad-rules.test.yml");
    for args in [
        vec!["check", "rules", rules.to_str().unwrap()],
        vec!["test", "rules", tests.to_str().unwrap()],
    ] {
        let out = Command::new("promtool")
            .args(&args)
            .output()
            .expect("promtool (apt-get install prometheus)");
        assert!(
            out.status.success(),
            "promtool {args:?}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn every_panel_and_alert_has_data_live_or_under_its_fault() {
    let mut r = Regions::start();
    let rules = root().join("deploy/prometheus/quotad-rules.yml");
    let prom = Prometheus::start(&[r.daemons[0].port, r.daemons[1].port], &rules);

    // Healthy: every entry point, both regions, a reload and a refused one.
    load_for(&r, Duration::from_secs(2), 2);
    let text = std::fs::read_to_string(r.daemons[0].dir.path().join("quotad.toml")).unwrap();
    assert_eq!(r.daemons[0].reload(&format!("{text}\n")), "ok");
    load_for(&r, Duration::from_secs(4), 2);
    wait_for("8 scrapes of both", Duration::from_secs(20), || {
        prom.scraped(2, 8).then_some(())
    });

    let panels = panel_queries();
    assert!(panels.len() >= 40, "{} panel queries", panels.len());
    let faulted = panel_faults();
    let mut missing = Vec::new();
    for (title, id, q) in &panels {
        if faulted.contains_key(&(title.as_str(), id.as_str())) {
            continue;
        }
        if prom.query(q).is_empty() {
            missing.push(format!("{title} [{id}]: {q}"));
        }
    }
    let all_rules = prom.rules();
    let recordings: Vec<String> = all_rules
        .iter()
        .filter(|(kind, _, _)| kind == "recording")
        .map(|(_, _, q)| q.clone())
        .collect();
    missing.extend(empty(&prom, &recordings));
    assert!(
        missing.is_empty(),
        "no data while healthy:\n{}",
        missing.join("\n")
    );

    // Every alert is named with its fault.
    let alerts: BTreeMap<String, String> = all_rules
        .iter()
        .filter(|(kind, _, _)| kind == "alerting")
        .map(|(_, name, q)| (name.clone(), q.clone()))
        .collect();
    let faults = alert_faults();
    let named: BTreeSet<&str> = faults.keys().copied().collect();
    let loaded: BTreeSet<&str> = alerts.keys().map(String::as_str).collect();
    assert_eq!(loaded, named, "every alert needs its fault here");

    for (alert, _) in faults.iter().filter(|(_, f)| **f == NOT_CAUSED) {
        let signal = alerts[*alert].rsplit_once(" > ").map_or("", |(lhs, _)| lhs);
        assert!(
            !signal.is_empty() && !prom.query(signal).is_empty(),
            "{alert}: its signal `{signal}` has no series"
        );
    }

    let mut fired: BTreeMap<&str, bool> = BTreeMap::new();
    // Waits until every alert of `fault` has its expression true, or `within` passes.
    let mut check_fault = |fault: &str, prom: &Prometheus, within: Duration| {
        assert!(
            FAULTS.iter().any(|(f, _)| *f == fault),
            "{fault} is not in FAULTS"
        );
        let want: Vec<&str> = faults
            .iter()
            .filter(|(_, f)| **f == fault)
            .map(|(a, _)| *a)
            .collect();
        let deadline = Instant::now() + within;
        let mut pending: Vec<&str> = want.clone();
        while !pending.is_empty() && Instant::now() < deadline {
            pending.retain(|a| prom.query(&alerts[*a]).is_empty());
            if !pending.is_empty() {
                std::thread::sleep(Duration::from_millis(250));
            }
        }
        for a in want {
            fired.insert(a, !pending.contains(&a));
        }
    };

    // forged_exchange
    let _ = request(
        r.daemons[0].port,
        "POST",
        "/v1/peer/exchange",
        &[("content-type", "application/json")],
        "{}",
    );
    check_fault("forged_exchange", &prom, Duration::from_secs(10));

    // redis_stalls: load on eu while its Redis is stopped.
    r.redis[0].signal("-STOP");
    load_for(&r, Duration::from_secs(3), 6);
    r.redis[0].signal("-CONT");
    check_fault("redis_stalls", &prom, Duration::from_secs(10));

    // redis_slow: every call waits out a 150 ms sleep, under the 200 ms timeout.
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut conn = r.redis[0].conn();
            while !stop.load(Ordering::Relaxed) {
                let _: redis::RedisResult<()> = redis::cmd("DEBUG")
                    .arg("SLEEP")
                    .arg("0.15")
                    .query(&mut conn);
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        load_for(&r, Duration::from_secs(3), 6);
        stop.store(true, Ordering::Relaxed);
    });
    check_fault("redis_slow", &prom, Duration::from_secs(10));

    // redis_out_of_memory: scripts that write are refused, the connection stays fine.
    let mut conn = r.redis[0].conn();
    let set_maxmemory = |conn: &mut redis::Connection, bytes: &str| {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory")
            .arg(bytes)
            .query(conn)
            .unwrap();
    };
    set_maxmemory(&mut conn, "1");
    load_for(&r, Duration::from_secs(3), 6);
    set_maxmemory(&mut conn, "0");
    check_fault("redis_out_of_memory", &prom, Duration::from_secs(10));

    // key_without_ttl
    let _: () = redis::cmd("HSET")
        .arg("rl:api:tb:{forgotten}")
        .arg("t")
        .arg(1)
        .query(&mut conn)
        .unwrap();
    check_fault("key_without_ttl", &prom, Duration::from_secs(15));

    // peer_dies
    r.daemons[1].kill();
    check_fault("peer_dies", &prom, Duration::from_secs(15));

    // redis_restarts
    for _ in 0..2 {
        r.redis[0].kill();
        std::thread::sleep(Duration::from_secs(2));
        r.redis[0].restart();
        wait_for("eu reconnected", Duration::from_secs(10), || {
            (r.daemons[0].metric("quotad_store_up") == 1.0).then_some(())
        });
    }
    check_fault("redis_restarts", &prom, Duration::from_secs(15));

    // all_daemons_stop
    r.daemons[0].kill();
    check_fault("all_daemons_stop", &prom, Duration::from_secs(15));

    let not_fired: Vec<String> = fired
        .iter()
        .filter(|(_, f)| !**f)
        .map(|(a, _)| {
            let why = FAULTS
                .iter()
                .find(|(f, _)| *f == faults[a])
                .map_or("", |(_, w)| *w);
            format!("{a} under {} ({why}): {}", faults[a], alerts[*a])
        })
        .collect();
    assert!(
        not_fired.is_empty(),
        "alerts whose expression stayed empty under their fault:\n{}",
        not_fired.join("\n")
    );
}
