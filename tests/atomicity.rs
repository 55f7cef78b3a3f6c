//! 500 concurrent checks at limit 100, sent from 4 OS processes, admit exactly 100 for every
//! algorithm; a naive GET-then-INCR limiter driven the same way over-admits. This is the
//! article's argument for doing the check in one Lua script, measured.
//!
//! The load comes from child processes: this test binary (its own harness, libtest-mimic)
//! re-runs itself with `QUOTAD_CHILD_MODE` set, and `main` then does one process's share of
//! the requests and prints a tally instead of running tests. The daemon is a process too
//! (`Quotad::start`), so the race is between OS processes end to end.

use quotad_testkit as common;

use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{Config, Policy, Quotad, RedisServer};
use libtest_mimic::{Arguments, Trial};

const PROCESSES: usize = 4;
const PER_PROCESS: usize = 125;
const LIMIT: u64 = 100;

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Runs PROCESSES children in `mode` against `target`; returns the total admitted.
fn run_children(mode: &str, target: &str, policy: &str, key: &str) -> (usize, usize) {
    let go_at = unix_ms() + 1500; // every child is connected and waiting by then
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..PROCESSES)
        .map(|_| {
            Command::new(&exe)
                .env("QUOTAD_CHILD_MODE", mode)
                .env("QUOTAD_CHILD_TARGET", target)
                .env("QUOTAD_CHILD_POLICY", policy)
                .env("QUOTAD_CHILD_KEY", key)
                .env("QUOTAD_CHILD_N", PER_PROCESS.to_string())
                .env("QUOTAD_CHILD_GO_AT", go_at.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn child")
        })
        .collect();
    let mut allowed = 0;
    let mut answered = 0;
    for c in children {
        let out = c.wait_with_output().expect("child");
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text
            .lines()
            .find_map(|l| l.find("RESULT ").map(|i| &l[i..]))
            .unwrap_or_else(|| {
                panic!(
                    "child gave no result: {text}\n{}",
                    String::from_utf8_lossy(&out.stderr)
                )
            });
        let field = |name: &str| -> usize {
            line.split_whitespace()
                .find_map(|kv| kv.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
                .and_then(|v| v.parse().ok())
                .unwrap()
        };
        allowed += field("allowed");
        answered += field("allowed") + field("denied");
        assert_eq!(
            field("errors"),
            0,
            "child errors: {line}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    (allowed, answered)
}

fn five_hundred_parallel_requests_admit_exactly_the_limit_for_every_algorithm() {
    let redis = RedisServer::start();
    // This test is about atomicity, not timeouts: on 2 cores, 4 load processes and a debug
    // build can hold a request off the CPU for longer than the default 50 ms.
    let mut config = Config::redis(&redis.url())
        .store("timeout", "5s")
        .store("queue_timeout", "5s");
    let algorithms = [
        "fixed_window",
        "sliding_log",
        "sliding_window",
        "token_bucket",
        "gcra",
    ];
    for a in algorithms {
        // A window long enough that nothing refills or rolls over during the test.
        config = config.policy(Policy::new(a, a, LIMIT, "1day").on_store_error("closed"));
    }
    let q = Quotad::start(&config.to_toml());
    for a in algorithms {
        let (allowed, answered) = run_children("http", &q.url(), a, "hot");
        assert_eq!(answered, PROCESSES * PER_PROCESS, "{a}");
        assert_eq!(
            allowed, LIMIT as usize,
            "{a}: admitted {allowed} of {answered} at limit {LIMIT}"
        );
    }
    // The counters agree with the responses.
    let total: f64 = algorithms
        .iter()
        .map(|a| {
            q.metric(&format!(
                "quotad_decisions_total{{outcome=\"allowed\",policy=\"{a}\"}}"
            ))
        })
        .sum();
    assert_eq!(total, (LIMIT as usize * algorithms.len()) as f64);
    redis.assert_every_key_has_ttl();
}

fn naive_get_then_incr_over_admits_under_the_same_load() {
    let redis = RedisServer::start();
    let (allowed, answered) = run_children("naive", &redis.url(), "", "naive:hot");
    assert_eq!(answered, PROCESSES * PER_PROCESS);
    assert!(
        allowed > LIMIT as usize,
        "the naive limiter admitted {allowed}, expected more than {LIMIT}: the race did not show"
    );
    eprintln!("naive GET-then-INCR admitted {allowed} of {answered} at limit {LIMIT}");
}

/// The tests, or, in a child started by `run_children`, that child's share of the load.
fn main() -> ExitCode {
    if let Ok(mode) = std::env::var("QUOTAD_CHILD_MODE") {
        child_load(&mode);
        return ExitCode::SUCCESS;
    }
    // A test is named by its function, as under libtest; a panic fails it.
    macro_rules! trial {
        ($test:ident) => {
            Trial::test(stringify!($test), || {
                $test();
                Ok(())
            })
        };
    }
    let tests = vec![
        trial!(five_hundred_parallel_requests_admit_exactly_the_limit_for_every_algorithm),
        trial!(naive_get_then_incr_over_admits_under_the_same_load),
    ];
    libtest_mimic::run(&Arguments::from_args(), tests).exit_code()
}

/// One child process's share of the load in `mode` (`http` or `naive`), its tally printed
/// on stdout as `RESULT allowed=… denied=… errors=…`.
fn child_load(mode: &str) {
    let env = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} not set"));
    let target = env("QUOTAD_CHILD_TARGET");
    let policy = env("QUOTAD_CHILD_POLICY");
    let key = env("QUOTAD_CHILD_KEY");
    let n: usize = env("QUOTAD_CHILD_N").parse().unwrap();
    let go_at: u64 = env("QUOTAD_CHILD_GO_AT").parse().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (allowed, denied, errors) = rt.block_on(async move {
        let wait = go_at.saturating_sub(unix_ms());
        match mode {
            "http" => {
                let client = reqwest::Client::builder()
                    .timeout(Duration::from_secs(20))
                    .build()
                    .unwrap();
                let url = format!("{target}/v1/check");
                let body = serde_json::json!({"policy": policy, "key": key});
                // Open the connections first so the requests leave together.
                futures_util::future::join_all(
                    (0..n).map(|_| client.get(format!("{target}/healthz")).send()),
                )
                .await;
                tokio::time::sleep(Duration::from_millis(wait)).await;
                let replies = futures_util::future::join_all(
                    (0..n).map(|_| client.post(&url).json(&body).send()),
                )
                .await;
                let mut tally = (0, 0, 0);
                for r in replies {
                    match r {
                        Ok(r) if r.status() == 200 => match r.json::<serde_json::Value>().await {
                            Ok(v) if v["allowed"] == true && v["outcome"] == "allowed" => {
                                tally.0 += 1
                            }
                            Ok(v) if v["outcome"] == "denied" => tally.1 += 1,
                            other => {
                                eprintln!("child unexpected reply: {other:?}");
                                tally.2 += 1
                            }
                        },
                        other => {
                            eprintln!("child error: {other:?}");
                            tally.2 += 1
                        }
                    }
                }
                tally
            }
            "naive" => {
                let client = redis::Client::open(target.as_str()).unwrap();
                let conn = client.get_multiplexed_async_connection().await.unwrap();
                tokio::time::sleep(Duration::from_millis(wait)).await;
                let replies = futures_util::future::join_all((0..n).map(|_| {
                    let mut conn = conn.clone();
                    let key = key.clone();
                    async move {
                        // The race: read, decide in the client, then write.
                        let count: Option<u64> =
                            redis::cmd("GET").arg(&key).query_async(&mut conn).await?;
                        if count.unwrap_or(0) < LIMIT {
                            let _: u64 =
                                redis::cmd("INCR").arg(&key).query_async(&mut conn).await?;
                            Ok::<bool, redis::RedisError>(true)
                        } else {
                            Ok(false)
                        }
                    }
                }))
                .await;
                let allowed = replies.iter().filter(|r| matches!(r, Ok(true))).count();
                let denied = replies.iter().filter(|r| matches!(r, Ok(false))).count();
                (allowed, denied, n - allowed - denied)
            }
            other => panic!("unknown mode {other}"),
        }
    });
    println!("RESULT allowed={allowed} denied={denied} errors={errors}");
}
