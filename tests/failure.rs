//! Store failures: Redis killed in the middle of a load, and Redis hung (SIGSTOP). Each
//! policy answers with its fail mode, every response comes within the store timeout plus a
//! small margin, the counts show in /metrics, and enforcement returns once Redis does, with
//! no client-visible error. A hot key's slice that a hung Redis cannot take back is
//! counted too.
//!
//! Process daemons (`Quotad::start`): the latency bounds (the store timeout plus a margin)
//! are about the binary a deployment runs, on its own allocator and runtime, not about a
//! daemon sharing this process with the load threads.

use quotad_testkit as common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Config, Policy, Quotad, RedisServer, check_outcome, wait_for};

const TIMEOUT_MS: u64 = 50;
/// Allowance on top of the store timeout for HTTP, scheduling and a debug build on 2 cores.
const MARGIN_MS: u64 = 200;

fn config(redis: &RedisServer) -> String {
    Config::redis(&redis.url())
        .store("timeout", format!("{TIMEOUT_MS}ms"))
        .store("probe_interval", "100ms")
        .store("breaker_threshold", 3)
        .policy(Policy::new("p-open", "token_bucket", 100000, "1m").on_store_error("open"))
        .policy(Policy::new("p-closed", "fixed_window", 100000, "1m").on_store_error("closed"))
        .policy(Policy::new("p-local", "sliding_window", 100000, "1m").on_store_error("local"))
        .to_toml()
}

const POLICIES: [&str; 3] = ["p-open", "p-closed", "p-local"];

#[derive(Debug, Clone)]
struct Sample {
    at: Instant,
    policy: &'static str,
    status: u16,
    outcome: String,
    latency: Duration,
}

/// Sends checks round-robin over the policies from `threads` threads until stopped.
struct Load {
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<Sample>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    fn start(port: u16, threads: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let threads = (0..threads)
            .map(|t| {
                let (stop, samples) = (stop.clone(), samples.clone());
                std::thread::spawn(move || {
                    let deadline = Instant::now() + Duration::from_secs(60); // bounded in time
                    let mut i = t;
                    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                        let policy = POLICIES[i % POLICIES.len()];
                        i += 1;
                        let body = format!(r#"{{"policy":"{policy}","key":"k{}"}}"#, i % 50);
                        let start = Instant::now();
                        let (status, outcome) = check_outcome(port, &body);
                        let latency = start.elapsed();
                        samples.lock().unwrap().push(Sample {
                            at: start,
                            policy,
                            status,
                            outcome,
                            latency,
                        });
                    }
                })
            })
            .collect();
        Load {
            stop,
            samples,
            threads,
        }
    }

    fn since(&self, t: Instant) -> Vec<Sample> {
        self.samples
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.at >= t)
            .cloned()
            .collect()
    }

    fn finish(self) -> Vec<Sample> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            t.join().unwrap();
        }
        Arc::try_unwrap(self.samples).unwrap().into_inner().unwrap()
    }
}

fn enforced(outcome: &str) -> bool {
    outcome == "allowed" || outcome == "denied"
}

/// Polls until every policy's latest answers since `t` satisfy `pred`.
fn wait_outcomes(
    load: &Load,
    t: Instant,
    what: &str,
    pred: impl Fn(&str, &str) -> bool,
) -> Instant {
    wait_for(what, Duration::from_secs(10), || {
        let s = load.since(t);
        let ok = POLICIES.iter().all(|p| {
            let mine: Vec<_> = s.iter().filter(|x| x.policy == *p).collect();
            mine.len() >= 3 && mine[mine.len() - 3..].iter().all(|x| pred(p, &x.outcome))
        });
        ok.then(Instant::now)
    })
}

fn fallback_for(policy: &str) -> &'static str {
    match policy {
        "p-open" => "fail_open",
        "p-closed" => "fail_closed",
        _ => "local",
    }
}

#[test]
fn redis_killed_mid_load_falls_back_per_policy_and_recovers() {
    let mut redis = RedisServer::start();
    let q = Quotad::start(&config(&redis));
    // The same config, with readiness following the store (the opt-in).
    let strict = Quotad::start_with(&config(&redis), "ready_requires_store = true");
    assert_eq!(strict.get("/readyz").0, 200);
    let t0 = Instant::now();
    let load = Load::start(q.port, 3);
    wait_outcomes(&load, t0, "enforced decisions", |_, o| enforced(o));

    redis.kill();
    let killed = Instant::now();
    wait_outcomes(&load, killed, "fallback outcomes", |p, o| {
        o == fallback_for(p)
    });
    std::thread::sleep(Duration::from_millis(300));
    // Ready by default: this instance answers per its policies (they just showed it), so
    // it must stay in its Service; the store's state is reported, not acted on.
    let (status, body) = q.get("/readyz");
    assert_eq!(status, 200, "readyz while Redis is down: {body}");
    let body: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["store_ready"], false, "{body}");
    assert_eq!(q.metric("quotad_store_up"), 0.0);
    // The opt-in instance has no traffic: its health check (every second) finds Redis gone.
    wait_for(
        "readyz 503 with ready_requires_store",
        Duration::from_secs(5),
        || (strict.get("/readyz").0 == 503).then_some(()),
    );

    redis.restart(); // a new process: no data, empty script cache
    let restarted = Instant::now();
    let back = wait_outcomes(&load, restarted, "enforcement to return", |_, o| {
        enforced(o)
    });
    let recovery = back - restarted;
    let samples = load.finish();

    eprintln!("enforcement back {recovery:?} after Redis answered PING again");
    assert!(
        recovery < Duration::from_secs(1),
        "enforcement took {recovery:?} to return"
    );
    // No client ever saw an error, and every answer came within the timeout plus a margin.
    let bad: Vec<_> = samples.iter().filter(|s| s.status != 200).collect();
    assert!(
        bad.is_empty(),
        "{} non-200 responses, e.g. {:?}",
        bad.len(),
        bad.first()
    );
    let slowest = samples.iter().map(|s| s.latency).max().unwrap();
    eprintln!("{} responses, slowest {slowest:?}", samples.len());
    assert!(
        slowest <= Duration::from_millis(TIMEOUT_MS + MARGIN_MS),
        "slowest response {slowest:?} exceeds the {TIMEOUT_MS} ms timeout plus {MARGIN_MS} ms"
    );
    // Each fallback shows in the metrics, under its policy.
    for p in POLICIES {
        let fb = fallback_for(p);
        let counted = q.metric(&format!(
            "quotad_decisions_total{{outcome=\"{fb}\",policy=\"{p}\"}}"
        ));
        let seen = samples
            .iter()
            .filter(|s| s.policy == p && s.outcome == fb)
            .count();
        assert!(
            counted >= seen as f64 && seen > 0,
            "{p}: {fb} counted {counted}, seen {seen}"
        );
    }
    let errors = q.metric("quotad_store_errors_total{kind=\"connection\"}")
        + q.metric("quotad_store_errors_total{kind=\"circuit_open\"}");
    assert!(errors > 0.0);
    assert_eq!(q.metric("quotad_store_up"), 1.0);
    assert_eq!(q.get("/readyz").0, 200);
    // The restarted Redis holds the new state, with TTLs.
    assert!(redis.dbsize() > 0);
    redis.assert_every_key_has_ttl();
}

#[test]
fn hung_redis_costs_at_most_the_timeout_then_fails_fast() {
    let redis = RedisServer::start();
    let q = Quotad::start(&config(&redis));
    assert_eq!(q.check1("p-open", "a")["outcome"], "allowed");

    redis.signal("-STOP");
    let mut latencies = Vec::new();
    for i in 0..20 {
        let start = Instant::now();
        let v = q.check1("p-open", &format!("k{i}"));
        latencies.push(start.elapsed());
        assert_eq!(v["outcome"], "fail_open", "{v}");
    }
    let worst = *latencies.iter().max().unwrap();
    assert!(
        worst <= Duration::from_millis(TIMEOUT_MS + MARGIN_MS),
        "a request took {worst:?}"
    );
    // Three timeouts in a row make Redis suspect; the breaker opens once a PING with a
    // longer deadline (4 x the timeout, here 200 ms) goes unanswered too. From then on no
    // decision waits for the timeout: the slow answers are a prefix of at most 3 + 4 + 1.
    let slow = latencies
        .iter()
        .take_while(|l| **l >= Duration::from_millis(TIMEOUT_MS))
        .count();
    assert!(
        (3..=8).contains(&slow)
            && latencies[slow..]
                .iter()
                .all(|l| *l < Duration::from_millis(TIMEOUT_MS)),
        "requests still paid the timeout after the breaker opened: {latencies:?}"
    );
    assert_eq!(q.metric("quotad_store_breaker_opens_total"), 1.0);
    // Requests counted at least one timeout (the supervisor's health PING may have been one
    // of the 3 failures that opened the breaker; it is not a decision, so not in this metric).
    assert!(q.metric("quotad_store_errors_total{kind=\"timeout\"}") >= 1.0);
    assert!(q.metric("quotad_store_errors_total{kind=\"circuit_open\"}") >= 1.0);
    let closed = q.check1("p-closed", "x");
    assert_eq!(
        (closed["allowed"].as_bool(), closed["outcome"].as_str()),
        (Some(false), Some("fail_closed"))
    );
    assert!(closed["retry_after_ms"].as_u64().unwrap() > 0);
    assert_eq!(q.check1("p-local", "x")["outcome"], "local");

    redis.signal("-CONT");
    let resumed = Instant::now();
    wait_for("enforcement after SIGCONT", Duration::from_secs(10), || {
        (q.check1("p-open", "b")["outcome"] == "allowed").then_some(())
    });
    let recovery = resumed.elapsed();
    eprintln!("enforcement back {recovery:?} after SIGCONT");
    assert!(
        recovery < Duration::from_secs(1),
        "enforcement took {recovery:?} to return"
    );
    redis.assert_every_key_has_ttl();
}

/// A hot key's slice whose give-back Redis does not answer (hung) is counted: its units
/// lapse unspent (never admitted, only fewer), and `not_returned` says how often.
#[test]
fn a_slice_redis_cannot_take_back_is_counted_as_not_returned() {
    let redis = RedisServer::start();
    let config = Config::redis(&redis.url())
        .store("timeout", format!("{TIMEOUT_MS}ms"))
        .policy(Policy::new("hot", "fixed_window", 1_000_000, "1h").set("hot_key_rate", 5))
        .to_toml();
    let q = Quotad::start(&config);
    let metric = |name: &str, event: &str| q.metric(&format!("{name}{{event=\"{event}\"}}"));
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                q.check1("hot", "k");
            }
        });
        // Hot and steady: takes prefetch, so the slice holds units not yet spent.
        wait_for("a prefetched slice", Duration::from_secs(10), || {
            (metric("quotad_hot_key_units_total", "taken")
                > metric("quotad_hot_key_slices_total", "taken") + 1.0)
                .then_some(())
        });
        assert_eq!(metric("quotad_hot_key_slices_total", "not_returned"), 0.0);
        // Hung while the key is still hot (stopping the load first let a slow machine
        // cool the key and give its slice back before the hang): its slice goes back to a
        // Redis that does not answer.
        redis.signal("-STOP");
        stop.store(true, Ordering::Relaxed);
    });
    let lost = wait_for("a give-back that failed", Duration::from_secs(10), || {
        let n = metric("quotad_hot_key_slices_total", "not_returned");
        (n > 0.0).then_some(n)
    });
    redis.signal("-CONT");
    assert!(lost >= 1.0);
}

/// A shadow policy never denies (`policy.shadow`, docs/api.md), not even when its store
/// is gone and its fail mode is `closed`: the denial it would have made is reported and
/// counted as `shadow`, as the store's own denials are. A policy on trial must not take
/// traffic down with Redis.
#[test]
fn a_shadow_policy_stays_open_when_its_store_fails_closed() {
    let mut redis = RedisServer::start();
    let q = Quotad::start(
        &Config::redis(&redis.url())
            .store("timeout", format!("{TIMEOUT_MS}ms"))
            .policy(
                Policy::new("trial", "fixed_window", 10, "1m")
                    .on_store_error("closed")
                    .shadow(),
            )
            .policy(Policy::new("enforced", "fixed_window", 10, "1m").on_store_error("closed"))
            .to_toml(),
    );
    assert_eq!(q.check1("trial", "a")["outcome"], "allowed");
    redis.kill();
    let v = q.check1("trial", "a");
    assert_eq!(
        (v["allowed"].as_bool(), v["outcome"].as_str()),
        (Some(true), Some("shadow")),
        "{v}"
    );
    // An enforced policy's fail mode is unchanged.
    let v = q.check1("enforced", "a");
    assert_eq!(
        (v["allowed"].as_bool(), v["outcome"].as_str()),
        (Some(false), Some("fail_closed")),
        "{v}"
    );
}
