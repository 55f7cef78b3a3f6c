//! 500 concurrent checks at limit 100, sent from 4 OS processes, admit exactly 100 for every
//! algorithm; a naive GET-then-INCR limiter driven the same way over-admits. This is the
//! article's argument for doing the check in one Lua script, measured.
//!
//! The load comes from child processes: this test binary (its own harness, libtest-mimic)
//! re-runs itself as a child of the kit's race (`quotad_testkit::race`), and `main` then
//! does one process's share of the requests and prints a tally instead of running tests.
//! The daemon is a process too (`Quotad::start`), so the race is between OS processes end
//! to end. tests/cluster.rs runs the same race on a Redis Cluster.

use std::process::ExitCode;

use quotad_testkit::race::{self, Race};
use quotad_testkit::{Config, Quotad, RedisServer};

const RACE: Race = Race {
    processes: 4,
    per_process: 125,
};
const LIMIT: u64 = 100;

fn five_hundred_parallel_requests_admit_exactly_the_limit_for_every_algorithm() {
    let redis = RedisServer::start();
    let _q = race::assert_every_algorithm_admits_exactly_the_limit(
        Config::redis(&redis.url()),
        RACE,
        LIMIT,
    );
    redis.assert_every_key_has_ttl();
}

fn naive_get_then_incr_over_admits_under_the_same_load() {
    let redis = RedisServer::start();
    let t = RACE.run("naive", &redis.url(), "", "naive:hot", LIMIT);
    assert_eq!(t.answered, RACE.processes * RACE.per_process);
    assert!(
        t.allowed > LIMIT as usize,
        "the naive limiter admitted {}, expected more than {LIMIT}: the race did not show",
        t.allowed
    );
    eprintln!(
        "naive GET-then-INCR admitted {} of {} at limit {LIMIT}",
        t.allowed, t.answered
    );
}

/// A hot key across instances: four daemons (processes) on one Redis, 1,000 concurrent
/// checks of one key (250 to each, all sent at the same instant) at a limit of 500:
/// exactly 500 admitted, in every one of three runs. The key turns hot at 10 checks a
/// second, so each instance admits from slices taken in Redis (the test checks that they
/// were: slices carried more units than there were slices), and the sum stays exact.
fn a_hot_key_admits_exactly_its_limit(algorithm: &str, window: &str) {
    const HOT_LIMIT: u64 = 500;
    let redis = RedisServer::start();
    let config = Config::redis(&redis.url())
        // Atomicity, not timeouts: see assert_every_algorithm_admits_exactly_the_limit.
        .store("timeout", "5s")
        .store("queue_timeout", "5s")
        .policy(
            quotad_testkit::Policy::new("hot", algorithm, HOT_LIMIT, window)
                .on_store_error("closed")
                .set("hot_key_rate", 10),
        )
        .to_toml();
    let daemons: Vec<Quotad> = (0..4).map(|_| Quotad::start(&config)).collect();
    let urls: Vec<String> = daemons.iter().map(Quotad::url).collect();
    let targets: Vec<&str> = urls.iter().map(String::as_str).collect();
    let race = Race {
        processes: 4,
        per_process: 250,
    };
    for run in 1..=3 {
        // A fixed window: at least 15 s of the hour left (a race takes a few seconds).
        let into_hour = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
            % 3600.0;
        if algorithm == "fixed_window" && into_hour > 3585.0 {
            std::thread::sleep(std::time::Duration::from_secs_f64(3601.0 - into_hour));
        }
        let t = race.run_across("http", &targets, "hot", &format!("hot-{run}"), HOT_LIMIT);
        assert_eq!(t.answered, 1_000, "run {run}");
        assert_eq!(
            t.allowed, HOT_LIMIT as usize,
            "{algorithm} run {run}: admitted {} of {} at limit {HOT_LIMIT}",
            t.allowed, t.answered
        );
        eprintln!("{algorithm} run {run}: four instances admitted exactly {HOT_LIMIT} of 1,000");
    }
    let sum = |series: &str| daemons.iter().map(|q| q.metric(series)).sum::<f64>();
    let slices = sum("quotad_hot_key_slices_total{event=\"taken\"}");
    let units = sum("quotad_hot_key_units_total{event=\"taken\"}");
    eprintln!("{slices} slices carried {units} units");
    assert!(
        slices >= 1.0 && units > slices,
        "the key was never hot: {slices} slices, {units} units"
    );
    redis.assert_every_key_has_ttl();
}

/// 500 per hour, each run placed well inside one hour so no window boundary falls in it
/// (a run waits for the next hour only in its last 15 s; with a minute's window, a
/// quarter of the runs waited up to 16 s).
fn a_hot_fixed_window_key_across_four_instances_admits_exactly_its_limit_every_run() {
    a_hot_key_admits_exactly_its_limit("fixed_window", "1h");
}

/// A burst of 500 refilled at 500 a day: the refill during a run is far below one unit,
/// so exactly the burst is admitted; slices lower the bucket's capacity while they live.
fn a_hot_token_bucket_key_across_four_instances_admits_exactly_its_burst_every_run() {
    a_hot_key_admits_exactly_its_limit("token_bucket", "1d");
}

/// As the token bucket, with the slices kept beside the key's TAT.
fn a_hot_gcra_key_across_four_instances_admits_exactly_its_burst_every_run() {
    a_hot_key_admits_exactly_its_limit("gcra", "1d");
}

/// Settlement's bound across processes: four load processes, each talking to its own
/// daemon (four processes on one Redis), make 1,000 calls on one key, each a reservation
/// of a random estimate settled at a random real cost (over HTTP), or a request-path peek
/// followed by a response-path charge of the real cost (over Envoy's gRPC service). What
/// the key was charged in Redis is exactly the sum of the real costs of the admitted
/// work, whatever the estimates were; admissions stopped once the key ran out; and a key
/// in debt admits nothing, on any instance, until the debt is paid.
fn metered_work_is_charged_exactly_its_real_costs(mode: &str) {
    const CAPACITY: u64 = 5_000;
    let redis = RedisServer::start();
    let mut config = Config::redis(&redis.url())
        // Exactness, not timeouts: see assert_every_algorithm_admits_exactly_the_limit.
        .store("timeout", "5s")
        .store("queue_timeout", "5s")
        // 5,000 at once, refilled at 100 a day: nothing to speak of refills in a run.
        .policy(
            quotad_testkit::Policy::new("tb", "token_bucket", 100, "1d")
                .burst(CAPACITY)
                .on_store_error("closed")
                .set("settle_within", "1m"),
        )
        .policy(
            quotad_testkit::Policy::new("fw", "fixed_window", CAPACITY, "1d")
                .on_store_error("closed")
                .set("settle_within", "1m"),
        );
    for p in ["tb", "fw"] {
        config = config.descriptor(
            p,
            quotad_testkit::Descriptor::new("api_key")
                .policy(p)
                .charge(),
        );
    }
    let config = config.to_toml();
    let grpc_ports: Vec<u16> = (0..4).map(|_| quotad_testkit::free_port()).collect();
    let daemons: Vec<Quotad> = grpc_ports
        .iter()
        .map(|p| Quotad::start_with(&config, &format!("grpc_listen = \"127.0.0.1:{p}\"")))
        .collect();
    let targets: Vec<String> = match mode {
        "charge_grpc" => grpc_ports
            .iter()
            .map(|p| format!("http://127.0.0.1:{p}"))
            .collect(),
        _ => daemons.iter().map(Quotad::url).collect(),
    };
    let targets: Vec<&str> = targets.iter().map(String::as_str).collect();
    // A fixed window of a day: not within a minute of its end (UTC midnight).
    let into_day = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        % 86_400;
    if into_day > 86_400 - 60 {
        std::thread::sleep(std::time::Duration::from_secs(86_400 - into_day + 1));
    }
    let metric = |name: &str| -> f64 { daemons.iter().map(|q| q.metric(name)).sum() };
    for (policy, tag) in [("tb", "tb"), ("fw", "fw")] {
        let key = format!("{mode}-key");
        let run = quotad_testkit::metered::run(mode, &targets, 4, 250, policy, &key, 20);
        assert_eq!(run.admitted + run.denied, 1_000, "{policy}: {run:?}");
        assert!(run.denied > 0, "{policy}: the key never ran out: {run:?}");
        let stored = format!("rl:{policy}:{tag}:{{{key}}}");
        let charged = match policy {
            "tb" => {
                let tokens: f64 = redis::cmd("HGET")
                    .arg(&stored)
                    .arg("t")
                    .query(&mut redis.conn())
                    .unwrap();
                CAPACITY as f64 - tokens
            }
            _ => {
                let (n, o): (u64, Option<u64>) = redis::cmd("HMGET")
                    .arg(&stored)
                    .arg("n")
                    .arg("o")
                    .query(&mut redis.conn())
                    .unwrap();
                (n + o.unwrap_or(0)) as f64
            }
        };
        // What refilled during the run (100 a day: well under a unit) is all the slack.
        let real = run.real as f64;
        eprintln!("{mode} {policy}: Redis charged {charged:.3} for work that cost {real}: {run:?}");
        assert!(
            charged <= real && charged > real - 0.5,
            "{mode} {policy}: Redis charged {charged}, the admitted work cost {real}: {run:?}"
        );
        // The instances' own account agrees: the estimates, plus what the settlements
        // charged beyond them, less what they gave back.
        let units = |d: &str| {
            metric(&format!(
                "quotad_settled_units_total{{direction=\"{d}\",policy=\"{policy}\"}}"
            ))
        };
        let accounted = run.estimated as f64 + units("charged") - units("refunded");
        assert_eq!(accounted, real, "{mode} {policy}: {run:?}");
        let again = metric(&format!(
            "quotad_settlements_total{{policy=\"{policy}\",result=\"already_settled\"}}"
        ));
        assert_eq!(again, run.repeated as f64, "{policy}");
        // Deep in debt now (three capacities more, charged at the real cost): every
        // instance denies, and says how long the debt takes to pay.
        let (status, _, _) = daemons[0].post(
            "/v1/check",
            &serde_json::json!({"policy": policy, "key": "debtor", "cost": 1, "settle": true}),
        );
        assert_eq!(status, 200);
        let debt = quotad_testkit::grpc::charge(grpc_ports[1], policy, "debtor", 4 * CAPACITY);
        assert_eq!(debt, Ok(()), "{policy}: the response-path charge");
        for q in &daemons {
            let v = q.check1(policy, "debtor");
            assert_eq!(v["outcome"], "denied", "{policy}: {v}");
            let wait = v["retry_after_ms"].as_u64().unwrap();
            // A day per 100 (token bucket) or per 5,000 (window): days, either way.
            assert!(
                wait > 86_400_000 / 2,
                "{policy}: retry after {wait} ms: {v}"
            );
        }
    }
    redis.assert_every_key_has_ttl();
}

fn four_processes_settling_random_costs_are_charged_exactly_the_real_costs() {
    metered_work_is_charged_exactly_its_real_costs("settle_http");
}

fn four_processes_charging_through_envoys_grpc_service_are_charged_exactly() {
    metered_work_is_charged_exactly_its_real_costs("charge_grpc");
}

/// Units of `key` held now by Redis's clock: the members whose lease ends after now.
fn held_now(redis: &RedisServer, key: &str) -> (u64, i64) {
    let script = "local t = redis.call('TIME') local now = t[1] * 1000000 + t[2] \
                  return {redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf'), now}";
    let (held, now): (u64, i64) = redis::cmd("EVAL")
        .arg(script)
        .arg(1)
        .arg(key)
        .query(&mut redis.conn())
        .unwrap();
    (held, now)
}

/// A concurrency limit across instances: four daemons (processes) on one Redis.
///
/// - 500 acquires of one key sent at once from four processes at a limit of 50: exactly
///   50 granted, and Redis, read throughout by a sampler, never holds more than 50.
/// - Clients killed while holding leases: their slots stay held until the leases end by
///   Redis's clock, and come back then (the delay is measured and printed).
/// - An extended lease outlives its first end; a release of a lease nobody holds is a
///   404 that changes nothing.
fn concurrent_acquires_hold_exactly_the_limit_and_crashed_holders_free_at_expiry() {
    const LIMIT: usize = 50;
    let redis = RedisServer::start();
    let config = Config::redis(&redis.url())
        .store("timeout", "5s")
        .store("queue_timeout", "5s")
        .policy(quotad_testkit::Policy::new(
            "slots",
            "concurrency",
            LIMIT as u64,
            "1h",
        ))
        .policy(quotad_testkit::Policy::new(
            "short",
            "concurrency",
            LIMIT as u64,
            "3s",
        ))
        .to_toml();
    let daemons: Vec<Quotad> = (0..4).map(|_| Quotad::start(&config)).collect();
    let urls: Vec<String> = daemons.iter().map(Quotad::url).collect();
    let targets: Vec<&str> = urls.iter().map(String::as_str).collect();

    // 500 at once against 50, with Redis sampled all along.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (stop, url) = (stop.clone(), redis.url());
        std::thread::spawn(move || {
            let mut conn = redis::Client::open(url).unwrap().get_connection().unwrap();
            let (mut max, mut samples) = (0u64, 0u64);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let script = "local t = redis.call('TIME') local now = t[1] * 1000000 + t[2] \
                              return redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')";
                let held: u64 = redis::cmd("EVAL")
                    .arg(script)
                    .arg(1)
                    .arg("rl:slots:cc:{hot}")
                    .query(&mut conn)
                    .unwrap();
                max = max.max(held);
                samples += 1;
            }
            (max, samples)
        })
    };
    let race = Race {
        processes: 4,
        per_process: 125,
    };
    let t = race.run_across("acquire", &targets, "slots", "hot", 0);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (max, samples) = sampler.join().unwrap();
    assert_eq!(t.answered, 500);
    assert_eq!(
        t.allowed, LIMIT,
        "granted {} of 500 at limit {LIMIT}",
        t.allowed
    );
    assert_eq!(held_now(&redis, "rl:slots:cc:{hot}").0, LIMIT as u64);
    assert!(
        max <= LIMIT as u64 && samples > 10,
        "max {max} held in {samples} samples"
    );
    eprintln!(
        "500 acquires at limit {LIMIT}: {} granted; at most {max} held in {samples} samples of Redis",
        t.allowed
    );

    // A release of a lease nobody holds: 404, and the key as it was.
    let dump = || -> Vec<u8> {
        redis::cmd("DUMP")
            .arg("rl:slots:cc:{hot}")
            .query(&mut redis.conn())
            .unwrap()
    };
    let before = dump();
    let stranger = serde_json::json!({"policy": "slots", "key": "hot",
        "lease": "0123456789abcdef0123456789abcdef-1"});
    let (status, _, v) = daemons[1].post("/v1/release", &stranger);
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (404, Some("unknown_lease")),
        "{v}"
    );
    assert_eq!(dump(), before, "an unknown release changed the key");

    // Holders killed: their slots come back when their leases end, not before.
    let race = Race {
        processes: 4,
        per_process: 25,
    };
    let (t, mut holders) = race.hold_across(&targets, "short", "crash");
    assert_eq!((t.answered, t.allowed), (100, LIMIT));
    for h in &mut holders {
        h.kill().unwrap();
        h.wait().unwrap();
    }
    let ends: Vec<(String, i64)> = redis::cmd("ZRANGE")
        .arg("rl:short:cc:{crash}")
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query(&mut redis.conn())
        .unwrap();
    let first_end = ends.iter().map(|e| e.1).min().unwrap();
    let last_end = ends.iter().map(|e| e.1).max().unwrap();
    let acquire = serde_json::json!({"policy": "short", "key": "crash"});
    let (held, now) = held_now(&redis, "rl:short:cc:{crash}");
    assert!(
        now < first_end,
        "the leases ended before the holders were killed"
    );
    assert_eq!(
        held, LIMIT as u64,
        "the killed holders' slots are held until their leases end"
    );
    let (_, _, v) = daemons[2].post("/v1/acquire", &acquire);
    assert_eq!(v["outcome"], "denied", "{v}");
    // The first lease's end passes by Redis's clock: its slot is free at once, with no
    // release and nothing but the store's clock to free it.
    quotad_testkit::wait_for(
        "the first lease's end",
        std::time::Duration::from_secs(10),
        || (held_now(&redis, "rl:short:cc:{crash}").1 > first_end).then_some(()),
    );
    let (_, _, v) = daemons[3].post("/v1/acquire", &acquire);
    assert_eq!(v["outcome"], "allowed", "a slot past its lease's end: {v}");
    let back_at = held_now(&redis, "rl:short:cc:{crash}").1;
    eprintln!(
        "killed holders: {LIMIT} leases of 3 s ending within {:.1} ms of each other; a slot acquired again by {:.1} ms after the first ended",
        (last_end - first_end) as f64 / 1000.0,
        (back_at - first_end) as f64 / 1000.0
    );
    quotad_testkit::wait_for(
        "every slot back",
        std::time::Duration::from_secs(10),
        || (held_now(&redis, "rl:short:cc:{crash}").1 > last_end).then_some(()),
    );
    let all = serde_json::json!({"policy": "short", "key": "crash", "units": LIMIT - 1});
    let (_, _, v) = daemons[0].post("/v1/acquire", &all);
    assert_eq!(v["outcome"], "allowed", "all {LIMIT} back: {v}");

    // An extended lease outlives the end it was acquired with.
    let (_, _, v) = daemons[0].post(
        "/v1/acquire",
        &serde_json::json!({"policy": "short", "key": "ext", "hold_ms": 1000}),
    );
    let lease = v["lease"].clone();
    let held = serde_json::json!({"policy": "short", "key": "ext", "lease": lease});
    let (status, _, v) = daemons[1].post(
        "/v1/extend",
        &serde_json::json!({"policy": "short", "key": "ext", "lease": lease, "hold_ms": 3000}),
    );
    assert_eq!(
        (status, v["status"].as_str()),
        (200, Some("extended")),
        "{v}"
    );
    let first = held_now(&redis, "rl:short:cc:{ext}").1 + 1_000_000;
    quotad_testkit::wait_for(
        "the first end passed",
        std::time::Duration::from_secs(5),
        || (held_now(&redis, "rl:short:cc:{ext}").1 > first + 100_000).then_some(()),
    );
    assert_eq!(
        held_now(&redis, "rl:short:cc:{ext}").0,
        1,
        "the extended lease ended"
    );
    let (status, _, v) = daemons[2].post("/v1/release", &held);
    assert_eq!((status, v["held"].as_u64()), (200, Some(0)), "{v}");
    let (status, _, _) = daemons[3].post("/v1/release", &held);
    assert_eq!(status, 404, "released twice");
    redis.assert_every_key_has_ttl();
}

/// The tests, or, in a child started by the race, that child's share of the load.
fn main() -> ExitCode {
    if race::child_main() {
        return ExitCode::SUCCESS;
    }
    quotad_testkit::run_tests!(
        five_hundred_parallel_requests_admit_exactly_the_limit_for_every_algorithm,
        naive_get_then_incr_over_admits_under_the_same_load,
        a_hot_fixed_window_key_across_four_instances_admits_exactly_its_limit_every_run,
        a_hot_token_bucket_key_across_four_instances_admits_exactly_its_burst_every_run,
        a_hot_gcra_key_across_four_instances_admits_exactly_its_burst_every_run,
        four_processes_settling_random_costs_are_charged_exactly_the_real_costs,
        four_processes_charging_through_envoys_grpc_service_are_charged_exactly,
        concurrent_acquires_hold_exactly_the_limit_and_crashed_holders_free_at_expiry,
    )
}
