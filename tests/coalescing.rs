//! Coalesced Redis I/O (`store::redis::coalesce`): the commands that requests issue in the same
//! turn leave as one pipeline (`quotad_store_pipelines_total` against
//! `quotad_store_pipelined_commands_total`), so Redis reads far fewer times than it runs
//! decisions (its `total_reads_processed` against `cmdstat_evalsha`); a lone check still
//! gets its answer, and a script error answers only the command that caused it.

use quotad_testkit as common;

use common::{Config, Policy, Quotad, RedisServer, runtime};
use serde_json::json;

/// (reads Redis processed, EVALSHAs it ran) so far.
fn reads_and_scripts(redis: &RedisServer) -> (u64, u64) {
    let info: String = redis::cmd("INFO")
        .arg("all")
        .query(&mut redis.conn())
        .unwrap();
    let field = |prefix: &str| -> u64 {
        info.lines()
            .find_map(|l| l.strip_prefix(prefix))
            .and_then(|v| v.split(',').next()?.trim().parse().ok())
            .unwrap_or(0)
    };
    (
        field("total_reads_processed:"),
        field("cmdstat_evalsha:calls="),
    )
}

/// A daemon whose policy `api` never denies here (a million an hour), after one check
/// alone was answered.
fn roomy(redis: &RedisServer) -> Quotad {
    let config = Config::redis(&redis.url())
        .store("timeout", "5s")
        .policy(Policy::new("api", "fixed_window", 1_000_000, "1h"))
        .to_toml();
    let q = Quotad::serve(&config);
    assert_eq!(q.check1("api", "warm")["allowed"], true, "one check alone");
    q
}

const TASKS: usize = 50;
const EACH: usize = 60;

/// TASKS clients each checking EACH distinct keys one after the other.
fn concurrent_checks(q: &Quotad) {
    let url = format!("{}/v1/check", q.url());
    runtime().block_on(async {
        let client = reqwest::Client::new();
        let tasks: Vec<_> = (0..TASKS)
            .map(|t| {
                let (client, url) = (client.clone(), url.clone());
                tokio::spawn(async move {
                    for i in 0..EACH {
                        let body = json!({"policy": "api", "key": format!("k{t}-{i}")});
                        let r = client.post(&url).json(&body).send().await.unwrap();
                        assert_eq!(r.status(), 200);
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
    });
}

/// (reads, scripts) summed over `servers`.
fn summed(servers: &[&RedisServer]) -> (u64, u64) {
    servers
        .iter()
        .map(|r| reads_and_scripts(r))
        .fold((0, 0), |(a, b), (c, d)| (a + c, b + d))
}

/// Reads per decision between `before` and `after`, printed; asserts every check ran.
fn reads_per_decision(before: (u64, u64), after: (u64, u64)) -> f64 {
    let scripts = after.1 - before.1;
    let reads = after.0 - before.0;
    assert!(scripts >= (TASKS * EACH) as u64, "{scripts} scripts");
    let ratio = reads as f64 / scripts as f64;
    eprintln!(
        "{scripts} decisions from {TASKS} concurrent clients reached Redis in {reads} reads ({ratio:.3} per decision)"
    );
    ratio
}

#[test]
fn concurrent_checks_reach_redis_as_pipelines() {
    let redis = RedisServer::start();
    let q = roomy(&redis);
    let before = reads_and_scripts(&redis);
    concurrent_checks(&q);
    let pipelines = q.metric("quotad_store_pipelines_total");
    let commands = q.metric("quotad_store_pipelined_commands_total");
    eprintln!(
        "{commands} commands in {pipelines} pipelines ({:.1} per write)",
        commands / pipelines
    );
    assert!(
        commands >= (TASKS * EACH) as f64,
        "{commands} commands counted"
    );
    let ratio = reads_per_decision(before, reads_and_scripts(&redis));
    assert!(
        ratio < 0.5,
        "Redis read {ratio:.3} times per decision: commands are not coalesced"
    );
}

/// On a cluster the same load reaches each master in few reads: the turn's commands go
/// out together, a pipeline per hash slot, so each node's connection writes what reaches
/// it at once.
#[test]
fn on_a_cluster_concurrent_checks_reach_each_master_in_few_reads() {
    let cluster = quotad_testkit::cluster::RedisCluster::start();
    let config = Config::cluster(&cluster.seeds())
        .store("timeout", "5s")
        .policy(Policy::new("api", "fixed_window", 1_000_000, "1h"))
        .to_toml();
    let q = Quotad::serve(&config);
    assert_eq!(q.check1("api", "warm")["allowed"], true, "one check alone");
    let masters = cluster.masters();
    let before = summed(&masters);
    concurrent_checks(&q);
    let ratio = reads_per_decision(before, summed(&masters));
    assert!(
        q.metric("quotad_store_pipelined_commands_total") >= (TASKS * EACH) as f64,
        "the cluster's commands were not coalesced"
    );
    assert!(
        ratio < 0.5,
        "the masters read {ratio:.3} times per decision: commands are not coalesced"
    );
}

/// A script error (a policy whose numbers the script refuses is impossible through the
/// config, so: a key of another type under the policy's key) fails that check alone, even
/// when it shares a pipeline with others.
#[test]
fn an_error_answers_only_its_own_command_in_a_pipeline() {
    let redis = RedisServer::start();
    let config = Config::redis(&redis.url())
        .policy(Policy::new("api", "fixed_window", 10, "1h").on_store_error("closed"))
        .to_toml();
    let q = Quotad::serve(&config);
    // The fixed window keeps a hash; a string there makes its script fail (WRONGTYPE).
    let _: () = redis::cmd("SET")
        .arg("rl:api:fw:{broken}")
        .arg("x")
        .query(&mut redis.conn())
        .unwrap();
    let checks: Vec<_> = (0..16)
        .map(|i| json!({"policy": "api", "key": if i == 7 { "broken".to_owned() } else { format!("ok{i}") }}))
        .collect();
    // A batch: its checks are issued in one turn, so they share a pipeline.
    let (status, body) = q.check(&json!({"checks": checks}));
    assert_eq!(status, 200, "{body}");
    let results = body["results"].as_array().unwrap();
    for (i, r) in results.iter().enumerate() {
        let want = if i == 7 { "fail_closed" } else { "allowed" };
        assert_eq!(r["outcome"], want, "check {i}: {body}");
    }
}

/// The checks of one batch are issued in one turn: they leave in one pipeline (a few at
/// most, when the flusher runs on another worker while they are still being issued),
/// not one write each.
#[test]
fn a_batchs_checks_leave_in_one_write() {
    let redis = RedisServer::start();
    let q = roomy(&redis);
    const BATCHES: usize = 20;
    const CHECKS: usize = 32;
    let p0 = q.metric("quotad_store_pipelines_total");
    let c0 = q.metric("quotad_store_pipelined_commands_total");
    for b in 0..BATCHES {
        let checks: Vec<_> = (0..CHECKS)
            .map(|i| json!({"policy": "api", "key": format!("b{b}-{i}")}))
            .collect();
        let (status, body) = q.check(&json!({"checks": checks}));
        assert_eq!(status, 200, "{body}");
    }
    let pipelines = q.metric("quotad_store_pipelines_total") - p0;
    let commands = q.metric("quotad_store_pipelined_commands_total") - c0;
    eprintln!("{BATCHES} batches of {CHECKS}: {commands} commands in {pipelines} pipelines");
    assert!(commands >= (BATCHES * CHECKS) as f64);
    // The supervisor's PINGs share the counters: a few pipelines of one.
    assert!(
        commands / pipelines >= 8.0,
        "{commands} commands in {pipelines} pipelines: a batch's checks left one by one"
    );
}
