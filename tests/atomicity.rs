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
        // A fixed window: at least 15 s of the minute left (a race takes a few seconds).
        let into_minute = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
            % 60.0;
        if algorithm == "fixed_window" && into_minute > 45.0 {
            std::thread::sleep(std::time::Duration::from_secs_f64(61.0 - into_minute));
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

/// 500 per minute, each run placed well inside one minute so no window boundary falls
/// in it.
fn a_hot_fixed_window_key_across_four_instances_admits_exactly_its_limit_every_run() {
    a_hot_key_admits_exactly_its_limit("fixed_window", "1m");
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
    )
}
