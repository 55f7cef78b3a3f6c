//! Concurrent checks on one key from several OS processes, all sent at the same instant:
//! the load of the atomicity tests (on one Redis, and on a cluster).
//!
//! A test binary with its own harness (libtest-mimic) calls [`child_main`] first thing in
//! `main`: when the binary was started by `run_children` it does one process's share of
//! the requests, prints a tally and exits instead of running tests. So the race is
//! between OS processes end to end, each with its own connections and runtime.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Set in the environment of a child: the mode it runs (`http`, `acquire`, `naive`, or
/// one of [`crate::metered::MODES`]).
const MODE: &str = "QUOTAD_CHILD_MODE";

/// What the children of one race got back, summed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Tally {
    pub allowed: usize,
    /// Allowed plus denied: every request that got a decision.
    pub answered: usize,
}

/// One race: `processes` children, each sending `per_process` requests at once.
#[derive(Debug, Clone, Copy)]
pub struct Race {
    pub processes: usize,
    pub per_process: usize,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

impl Race {
    /// Runs the children in `mode` against `target` (quotad's base URL in `http` mode:
    /// checks of `policy` on `key`; a Redis URL in `naive` mode: GET-then-INCR of `key`
    /// up to `limit`), and sums their tallies. Panics if any request failed.
    pub fn run(&self, mode: &str, target: &str, policy: &str, key: &str, limit: u64) -> Tally {
        self.run_across(mode, &[target], policy, key, limit)
    }

    /// [`Race::run`] with the children spread over `targets` (child i sends to target
    /// i mod their number): several daemons on one store, all racing for one key.
    pub fn run_across(
        &self,
        mode: &str,
        targets: &[&str],
        policy: &str,
        key: &str,
        limit: u64,
    ) -> Tally {
        let mut tally = Tally::default();
        for c in self.spawn(mode, targets, policy, key, limit) {
            let out = c.wait_with_output().expect("child");
            let text = String::from_utf8_lossy(&out.stdout);
            let err = String::from_utf8_lossy(&out.stderr);
            let t = result_of(&text, &err);
            tally.allowed += t.allowed;
            tally.answered += t.answered;
        }
        tally
    }

    /// Acquires of `policy` on `key` from the children, each of which then keeps running
    /// holding what it got, until the caller kills it: clients that crash holding leases.
    /// Returns once every child has its answers: what they hold, and the children.
    pub fn hold_across(&self, targets: &[&str], policy: &str, key: &str) -> (Tally, Vec<Child>) {
        let mut children = self.spawn("hold", targets, policy, key, 0);
        let mut tally = Tally::default();
        for c in &mut children {
            let out = c.stdout.take().expect("the child's stdout");
            let mut line = String::new();
            std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut line)
                .expect("the child's result");
            let t = result_of(&line, "(still running)");
            tally.allowed += t.allowed;
            tally.answered += t.answered;
        }
        (tally, children)
    }

    fn spawn(
        &self,
        mode: &str,
        targets: &[&str],
        policy: &str,
        key: &str,
        limit: u64,
    ) -> Vec<Child> {
        let go_at = unix_ms() + 1500; // every child is connected and waiting by then
        let exe = std::env::current_exe().unwrap();
        (0..self.processes)
            .map(|i| {
                let target = targets[i % targets.len()];
                Command::new(&exe)
                    .env(MODE, mode)
                    .env("QUOTAD_CHILD_TARGET", target)
                    .env("QUOTAD_CHILD_POLICY", policy)
                    .env("QUOTAD_CHILD_KEY", key)
                    .env("QUOTAD_CHILD_LIMIT", limit.to_string())
                    .env("QUOTAD_CHILD_N", self.per_process.to_string())
                    .env("QUOTAD_CHILD_GO_AT", go_at.to_string())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .expect("spawn child")
            })
            .collect()
    }
}

/// A child's `RESULT allowed=… denied=… errors=…` line in `text`; panics on none, or on
/// errors.
fn result_of(text: &str, stderr: &str) -> Tally {
    let line = text
        .lines()
        .find_map(|l| l.find("RESULT ").map(|i| &l[i..]))
        .unwrap_or_else(|| panic!("child gave no result: {text}\n{stderr}"));
    let field = |name: &str| -> usize {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
            .and_then(|v| v.parse().ok())
            .unwrap()
    };
    assert_eq!(field("errors"), 0, "child errors: {line}\n{stderr}");
    Tally {
        allowed: field("allowed"),
        answered: field("allowed") + field("denied"),
    }
}

/// In a child started by [`Race::run`]: does its share of the load, prints its tally and
/// returns true (the caller then exits). Otherwise returns false at once.
pub fn child_main() -> bool {
    let Ok(mode) = std::env::var(MODE) else {
        return false;
    };
    if crate::metered::MODES.contains(&mode.as_str()) {
        crate::metered::child_load(&mode);
    } else {
        child_load(&mode);
    }
    true
}

/// One child process's share of the load in `mode` (`http` or `naive`), its tally printed
/// on stdout as `RESULT allowed=… denied=… errors=…`.
fn child_load(mode: &str) {
    let env = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} not set"));
    let target = env("QUOTAD_CHILD_TARGET");
    let policy = env("QUOTAD_CHILD_POLICY");
    let key = env("QUOTAD_CHILD_KEY");
    let limit: u64 = env("QUOTAD_CHILD_LIMIT").parse().unwrap();
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
            // Checks of a rate policy, or acquires of a concurrency limit (never released:
            // the child exits holding what it got, as a crashed client would).
            "http" | "acquire" | "hold" => {
                let client = reqwest::Client::builder()
                    .timeout(Duration::from_secs(20))
                    .build()
                    .unwrap();
                let path = if mode == "http" { "check" } else { "acquire" };
                let url = format!("{target}/v1/{path}");
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
                        if count.unwrap_or(0) < limit {
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
    if mode == "hold" {
        // Holding what it acquired until killed (a crash, never a release).
        use std::io::Write;
        let _ = std::io::stdout().flush();
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// Every algorithm quotad has, by its config name.
pub const ALGORITHMS: [&str; 5] = [
    "fixed_window",
    "sliding_log",
    "sliding_window",
    "token_bucket",
    "gcra",
];

/// The atomicity property on the store `config` points at: for every algorithm, one race
/// on one key at `limit` per day (nothing refills or rolls over meanwhile) admits exactly
/// `limit`, and the decision counters agree. Returns the daemon (a process) for more checks.
pub fn assert_every_algorithm_admits_exactly_the_limit(
    config: crate::Config,
    race: Race,
    limit: u64,
) -> crate::Quotad {
    // This is about atomicity, not timeouts: on 2 cores, the load processes and a debug
    // build can hold a request off the CPU for longer than the default 50 ms.
    let mut config = config.store("timeout", "5s").store("queue_timeout", "5s");
    for a in ALGORITHMS {
        config = config.policy(crate::Policy::new(a, a, limit, "1day").on_store_error("closed"));
    }
    let q = crate::Quotad::start(&config.to_toml());
    for a in ALGORITHMS {
        let t = race.run("http", &q.url(), a, "hot", limit);
        assert_eq!(t.answered, race.processes * race.per_process, "{a}");
        assert_eq!(
            t.allowed, limit as usize,
            "{a}: admitted {} of {} at limit {limit}",
            t.allowed, t.answered
        );
    }
    let total: f64 = ALGORITHMS
        .iter()
        .map(|a| {
            q.metric(&format!(
                "quotad_decisions_total{{outcome=\"allowed\",policy=\"{a}\"}}"
            ))
        })
        .sum();
    assert_eq!(total, (limit as usize * ALGORITHMS.len()) as f64);
    q
}

/// Runs `tests` under libtest's command line (libtest-mimic), for the test binaries with
/// their own harness: a test is named by its function, and a panic fails it. Use it
/// through [`crate::run_tests!`].
pub fn run_tests(tests: &[(&'static str, fn())]) -> std::process::ExitCode {
    let trials = tests
        .iter()
        .map(|&(name, f)| {
            libtest_mimic::Trial::test(name, move || {
                f();
                Ok(())
            })
        })
        .collect();
    libtest_mimic::run(&libtest_mimic::Arguments::from_args(), trials).exit_code()
}

/// `run_tests!(a, b)`: [`run_tests`] on the functions `a` and `b`, named after them.
#[macro_export]
macro_rules! run_tests {
    ($($test:ident),+ $(,)?) => {
        $crate::race::run_tests(&[$((stringify!($test), $test as fn())),+])
    };
}
