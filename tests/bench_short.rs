//! A short benchmark inside the suite: what a check through quotad costs beside a client
//! calling Redis itself, and what a hot key's slices save. It prints its ratios and
//! asserts none of them (speed belongs in benchmarks: the suite runs a debug build on a
//! shared machine; bench/run.sh, bench/protocols.sh and bench/hot.sh measure the release
//! build). What it does assert is that every request was answered and enforced, so a
//! figure is never printed for a run that failed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use quotad_testkit::{Config, Policy, Quotad, RedisServer, quotad_binary, runtime};

const CONCURRENCY: usize = 32;
const RUN: Duration = Duration::from_secs(2);
const LIMIT: u64 = 1_000_000_000;

/// Completed calls per second of `call`, run by CONCURRENCY tasks for RUN on `rt`.
fn closed_loop<F, Fut>(rt: &tokio::runtime::Runtime, call: F) -> f64
where
    F: Fn(u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let call = Arc::new(call);
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    rt.block_on(async {
        let tasks: Vec<_> = (0..CONCURRENCY as u64)
            .map(|t| {
                let (call, done) = (call.clone(), done.clone());
                tokio::spawn(async move {
                    let mut i = t;
                    while started.elapsed() < RUN {
                        call(i).await;
                        done.fetch_add(1, Ordering::Relaxed);
                        i += CONCURRENCY as u64;
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("a load task");
        }
    });
    done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
}

/// `POST /v1/check` of policy `policy` on `key(i)`, answered `allowed` by the store.
fn quotad_rate(
    rt: &tokio::runtime::Runtime,
    q: &Quotad,
    policy: &'static str,
    key: fn(u64) -> String,
) -> f64 {
    let client = reqwest::Client::new();
    let url = format!("{}/v1/check", q.url());
    closed_loop(rt, move |i| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let body = serde_json::json!({"policy": policy, "key": key(i)});
            let v: serde_json::Value = client
                .post(&url)
                .json(&body)
                .send()
                .await
                .expect("an answer")
                .json()
                .await
                .expect("JSON");
            assert_eq!(v["outcome"], "allowed", "{v}");
        }
    })
}

#[test]
fn a_check_through_quotad_beside_evalsha_and_a_hot_key_beside_both() {
    let redis = RedisServer::start();
    // What this measures is quotad's latency beside the client's own; an answer it must
    // give is `allowed`, and the default 50 ms store timeout, on a 2-core box beside the
    // exactness tests under load, turned a few into fail_open (a clean clone, once).
    let config = Config::redis(&redis.url())
        .store("timeout", "2s")
        .policy(Policy::new("fw", "fixed_window", LIMIT, "1h"))
        .policy(Policy::new("hot", "fixed_window", LIMIT, "1h").set("hot_key_rate", 100));
    let q = Quotad::start(&config.to_toml());

    // The client calling Redis itself: quotad's own fixed-window script, one multiplexed
    // connection (pipelined as concurrent calls are), the same keys.
    let script = std::process::Command::new(quotad_binary())
        .args(["script", "fixed_window"])
        .output()
        .expect("quotad script");
    let script = redis::Script::new(&String::from_utf8(script.stdout).expect("UTF-8"));
    let rt = runtime();
    let conn = rt
        .block_on(
            redis::Client::open(redis.url())
                .unwrap()
                .get_multiplexed_async_connection(),
        )
        .expect("a connection");
    let script = Arc::new(script);
    let direct = closed_loop(&rt, move |i| {
        let (mut conn, script) = (conn.clone(), script.clone());
        async move {
            let reply: Vec<i64> = script
                .key(format!("rl:direct:fw:{{k{}}}", i % 100_000))
                .arg("check")
                .arg(LIMIT)
                .arg(3_600_000_000u64)
                .arg(LIMIT)
                .arg(1)
                .arg("")
                .arg(format!("{LIMIT}:3600000000:{LIMIT}"))
                .arg("0")
                .invoke_async(&mut conn)
                .await
                .expect("EVALSHA");
            assert_eq!(reply[0], 1, "{reply:?}");
        }
    });
    let through = quotad_rate(&rt, &q, "fw", |i| format!("k{}", i % 100_000));
    let hot = quotad_rate(&rt, &q, "hot", |_| "one".to_owned());
    let from_memory = q.metric("quotad_hot_key_admits_total{policy=\"hot\"}");
    eprintln!(
        "debug build, {CONCURRENCY} in flight, {RUN:?} each: EVALSHA direct {direct:.0}/s; \
         quotad /v1/check {through:.0}/s ({:.2} of direct); one hot key {hot:.0}/s \
         ({:.2} of /v1/check, {from_memory:.0} checks from memory)",
        through / direct,
        hot / through,
    );
    assert!(from_memory > 0.0, "the hot key never admitted from memory");
}

/// The benchmarks call quotad's token-bucket script as quotad does (the EVALSHA ceiling
/// quotad is compared with, the open-loop generator's Redis target, the memory figures):
/// the script answers their arguments with a decision, not an argument error, and their
/// since is spelled as quotad spells it. The scripts once took two more arguments (a
/// key's frame and since) and the ceiling went on measuring errors.
#[test]
fn the_benchmarks_call_the_scripts_as_quotad_does() {
    use quotad_core::algorithm::{Algorithm, Limits, Since};
    use quotad_daemon::testing::redis as scripts;
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let read = |f: &str| std::fs::read_to_string(root.join(f)).unwrap();
    let redis = RedisServer::start();
    for file in ["bench/lib.sh", "bench/topologies.sh"] {
        let text = read(file);
        let line = text
            .lines()
            .map(str::trim)
            .find(|l| l.starts_with("EVAL_ARGS=(evalsha "))
            .unwrap_or_else(|| panic!("{file}: no EVAL_ARGS"));
        // The words as bash makes them: "evalsha" "$SHA" 1 "<key>", then the script's.
        let out = std::process::Command::new("bash")
            .arg("-c")
            .arg(format!(
                "SHA=sha; {line}; printf '%s\\n' \"${{EVAL_ARGS[@]}}\""
            ))
            .output()
            .unwrap();
        let words: Vec<String> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(String::from)
            .collect();
        let key = words[3].replace("__rand_int__", "1");
        let reply: redis::RedisResult<Vec<i64>> = redis::cmd("EVAL")
            .arg(scripts::source(Algorithm::TokenBucket))
            .arg(1)
            .arg(&key)
            .arg(&words[4..])
            .query(&mut redis.conn());
        assert!(
            matches!(reply.as_deref(), Ok([1, ..])),
            "{file}: {words:?} answered {reply:?}"
        );
        let since = &words[words.len() - 1];
        let at_ms = since.strip_prefix("b1n").and_then(|ms| ms.parse().ok());
        let quotads = at_ms.map(|at_ms| {
            let l = Limits {
                limit: 100,
                window_us: 60_000_000,
                burst: 100,
                since: Since { version: 1, at_ms },
            };
            scripts::frame_args(&l).1
        });
        assert_eq!(quotads.as_ref(), Some(since), "{file}: {words:?}");
    }
    // The generator takes them from `frame_args`; the memory figures spell them as above.
    assert!(read("examples/fixed_rate.rs").contains("testing::redis::frame_args"));
    let memory = read("bench/memory.sh");
    assert!(
        memory.contains("SINCE=\"b1n$(date +%s%3N)\"")
            && memory.contains("$n:3600000000:$n $SINCE")
    );
}
