//! Composite limits, the article's advice: a tenant limit and a per-user limit checked in
//! one batch that names the tenant as its co-location group are decided by one script,
//! all or nothing, so the tenant's counter is always the sum of what its users were
//! admitted: never a moment with a charge on one and not the other.
//!
//! 8 users of one tenant (tenant limit 100, user limit 20) hammered by 4 OS processes at
//! once, on a 3-master Redis Cluster and on one Redis, while a watcher reads all nine
//! counters in one script (they share a slot) and compares them. The load comes from child
//! processes: this binary (its own harness) re-runs itself with `QUOTAD_CHILD_MODE` set.

use quotad_testkit as common;

use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::cluster::RedisCluster;
use common::{Config, Policy, Quotad, RedisServer};

const PROCESSES: usize = 4;
const PER_PROCESS: usize = 125;
const USERS: usize = 8;
const TENANT_LIMIT: u64 = 100;
const USER_LIMIT: u64 = 20;
const GROUP: &str = "tenant:9";

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// The two policies; a window long enough that nothing rolls over during the test.
fn policies(config: Config) -> Config {
    config
        // About atomicity, not overload: on 2 cores, 4 load processes and a debug build can
        // hold a request off the CPU, or in admission's queue, longer than the defaults.
        .store("timeout", "5s")
        .store("queue_timeout", "5s")
        .policy(
            Policy::new("tenant", "fixed_window", TENANT_LIMIT, "1day").on_store_error("closed"),
        )
        .policy(Policy::new("user", "fixed_window", USER_LIMIT, "1day").on_store_error("closed"))
}

fn storage_key(policy: &str, key: &str) -> String {
    format!("rl:{policy}:fw:{{{GROUP}}}:{{{key}}}")
}

/// The tenant's counter and every user's, read in one script (one slot: one atomic read).
fn counters(conn: &mut dyn redis::ConnectionLike) -> (u64, Vec<u64>) {
    let mut keys = vec![storage_key("tenant", "t9")];
    keys.extend((0..USERS).map(|u| storage_key("user", &format!("u{u}"))));
    let script = redis::Script::new(
        "local out = {} for i, k in ipairs(KEYS) do \
           out[i] = tonumber(redis.call('HGET', k, 'n')) or 0 end return out",
    );
    let mut inv = script.prepare_invoke();
    for k in &keys {
        inv.key(k);
    }
    let v: Vec<u64> = inv.invoke(conn).expect("the counters");
    (v[0], v[1..].to_vec())
}

/// Runs the children against `url` while watching the counters through `conn`; returns
/// what the children saw admitted per user.
fn hammer(url: &str, conn: &mut (dyn redis::ConnectionLike + Send)) -> Vec<usize> {
    let go_at = unix_ms() + 1500;
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..PROCESSES)
        .map(|i| {
            Command::new(&exe)
                .env("QUOTAD_CHILD_MODE", "composite")
                .env("QUOTAD_CHILD_TARGET", url)
                .env("QUOTAD_CHILD_SEED", i.to_string())
                .env("QUOTAD_CHILD_GO_AT", go_at.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn child")
        })
        .collect();
    let done = Arc::new(AtomicBool::new(false));
    let mut samples = 0;
    let watch_until = std::time::Instant::now() + Duration::from_secs(60);
    let waiter = {
        let done = done.clone();
        std::thread::spawn(move || {
            let outs: Vec<_> = children
                .into_iter()
                .map(|c| c.wait_with_output().expect("child"))
                .collect();
            done.store(true, Ordering::Release);
            outs
        })
    };
    while !done.load(Ordering::Acquire) && std::time::Instant::now() < watch_until {
        let (tenant, users) = counters(conn);
        assert_eq!(
            tenant,
            users.iter().sum::<u64>(),
            "a partial charge was visible: tenant {tenant}, users {users:?}"
        );
        samples += 1;
    }
    eprintln!("{samples} consistent samples of the nine counters while the load ran");
    let mut admitted = vec![0; USERS];
    for out in waiter.join().unwrap() {
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text
            .lines()
            .find(|l| l.starts_with("RESULT "))
            .unwrap_or_else(|| panic!("no result: {text}{}", String::from_utf8_lossy(&out.stderr)));
        let mut fields = line.split_whitespace().skip(1);
        for a in admitted.iter_mut() {
            *a += fields.next().unwrap().parse::<usize>().unwrap();
        }
        assert_eq!(
            fields.next(),
            Some("errors=0"),
            "{line}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    admitted
}

fn check_outcome(admitted: &[usize], conn: &mut dyn redis::ConnectionLike) {
    let total: usize = admitted.iter().sum();
    assert_eq!(
        total, TENANT_LIMIT as usize,
        "admitted per tenant: {admitted:?}"
    );
    assert!(
        admitted.iter().all(|&a| a <= USER_LIMIT as usize),
        "a user over its limit: {admitted:?}"
    );
    let (tenant, users) = counters(conn);
    assert_eq!(tenant, TENANT_LIMIT, "the tenant's counter");
    let by_user: Vec<usize> = users.iter().map(|&u| u as usize).collect();
    assert_eq!(
        by_user, admitted,
        "each user's counter is what it was admitted"
    );
}

fn a_tenant_and_its_users_are_charged_together_on_a_cluster() {
    let cluster = RedisCluster::start();
    let config = policies(Config::cluster(&cluster.seeds()));
    let q = Quotad::start(&config.to_toml());
    let client = redis::cluster::ClusterClient::new(cluster.seeds()).unwrap();
    let mut conn = client.get_connection().unwrap();
    let admitted = hammer(&q.url(), &mut conn);
    check_outcome(&admitted, &mut conn);
    let masters = cluster.masters();
    let holding: Vec<u16> = masters
        .iter()
        .filter(|m| {
            let mut c = m.conn();
            redis::cmd("EXISTS")
                .arg(storage_key("tenant", "t9"))
                .query::<i64>(&mut c)
                .unwrap_or(0) // MOVED: not this master's slot
                == 1
        })
        .map(|m| m.port)
        .collect();
    assert_eq!(holding.len(), 1, "one master holds the group");
    for m in masters {
        m.assert_every_key_has_ttl();
    }
}

fn a_tenant_and_its_users_are_charged_together_on_one_redis() {
    let redis = RedisServer::start();
    let q = Quotad::start(&policies(Config::redis(&redis.url())).to_toml());
    let mut conn = redis.conn();
    let admitted = hammer(&q.url(), &mut conn);
    check_outcome(&admitted, &mut conn);
    redis.assert_every_key_has_ttl();
}

fn main() -> ExitCode {
    if std::env::var("QUOTAD_CHILD_MODE").is_ok() {
        child_load();
        return ExitCode::SUCCESS;
    }
    quotad_testkit::run_tests!(
        a_tenant_and_its_users_are_charged_together_on_a_cluster,
        a_tenant_and_its_users_are_charged_together_on_one_redis,
    )
}

/// One child's share: PER_PROCESS batches (tenant + one of the users, in turn), all in
/// flight at once; prints `RESULT <admitted per user…> errors=N`.
fn child_load() {
    let env = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} not set"));
    let target = env("QUOTAD_CHILD_TARGET");
    let seed: usize = env("QUOTAD_CHILD_SEED").parse().unwrap();
    let go_at: u64 = env("QUOTAD_CHILD_GO_AT").parse().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (admitted, errors) = rt.block_on(async move {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(20))
            .build()
            .unwrap();
        let url = format!("{target}/v1/check");
        futures_util::future::join_all(
            (0..PER_PROCESS).map(|_| client.get(format!("{target}/healthz")).send()),
        )
        .await;
        tokio::time::sleep(Duration::from_millis(go_at.saturating_sub(unix_ms()))).await;
        let replies = futures_util::future::join_all((0..PER_PROCESS).map(|i| {
            let user = (seed + i) % USERS;
            let body = serde_json::json!({"checks": [
                {"policy": "tenant", "key": "t9", "group": GROUP},
                {"policy": "user", "key": format!("u{user}"), "group": GROUP},
            ]});
            let req = client.post(&url).json(&body).send();
            async move { (user, req.await) }
        }))
        .await;
        let mut admitted = vec![0usize; USERS];
        let mut errors = 0;
        for (user, r) in replies {
            let v = match r {
                Ok(r) if r.status() == 200 => r.json::<serde_json::Value>().await.ok(),
                other => {
                    eprintln!("child error: {other:?}");
                    None
                }
            };
            let Some(v) = v else {
                errors += 1;
                continue;
            };
            let outcomes: Vec<&str> = v["results"]
                .as_array()
                .map(|a| a.iter().filter_map(|d| d["outcome"].as_str()).collect())
                .unwrap_or_default();
            match (v["allowed"].as_bool(), outcomes.as_slice()) {
                (Some(true), ["allowed", "allowed"]) => admitted[user] += 1,
                (Some(false), [_, _]) if outcomes.contains(&"denied") => {}
                _ => {
                    eprintln!("unexpected reply: {v}");
                    errors += 1;
                }
            }
        }
        (admitted, errors)
    });
    let counts: Vec<String> = admitted.iter().map(|a| a.to_string()).collect();
    println!("RESULT {} errors={errors}", counts.join(" "));
}
