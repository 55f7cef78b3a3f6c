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
use quotad_testkit::{Config, RedisServer};

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

/// The tests, or, in a child started by the race, that child's share of the load.
fn main() -> ExitCode {
    if race::child_main() {
        return ExitCode::SUCCESS;
    }
    quotad_testkit::run_tests!(
        five_hundred_parallel_requests_admit_exactly_the_limit_for_every_algorithm,
        naive_get_then_incr_over_admits_under_the_same_load,
    )
}
