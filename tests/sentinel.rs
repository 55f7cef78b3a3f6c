//! quotad on a master found through Sentinel: it enforces, and a `SENTINEL FAILOVER`
//! under load is followed to the promoted replica. Every answer stays a 200; the answers
//! that are not enforced decisions (fail_*) are counted, and the gap until enforcement is
//! back is measured and bounded.

use quotad_testkit as common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::sentinel::{MASTER_NAME, SentinelSetup};
use common::{Config, Policy, Quotad, RedisServer, check_outcome, wait_for};
use serde_json::json;

/// Enforcement must be back this soon after the failover is asked for.
const MAX_GAP: Duration = Duration::from_secs(20);

#[derive(Debug, Clone)]
struct Sample {
    at: Instant,
    policy: &'static str,
    status: u16,
    outcome: String,
}

fn enforced(outcome: &str) -> bool {
    outcome == "allowed" || outcome == "denied"
}

/// Paced checks: `per_second` per thread on `policy`/`key`, from `threads` threads.
struct Load {
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<Sample>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    fn new() -> Load {
        Load {
            stop: Arc::new(AtomicBool::new(false)),
            samples: Arc::new(Mutex::new(Vec::new())),
            threads: Vec::new(),
        }
    }

    fn add(&mut self, port: u16, policy: &'static str, key: &str, threads: usize, per_second: u32) {
        let period = Duration::from_secs(1) / per_second;
        for _ in 0..threads {
            let (stop, samples) = (self.stop.clone(), self.samples.clone());
            let body = json!({"policy": policy, "key": key, "cost": 1}).to_string();
            self.threads.push(std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(50); // bounded in time
                let mut next = Instant::now();
                while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                    let at = Instant::now();
                    let (status, outcome) = check_outcome(port, &body);
                    samples.lock().unwrap().push(Sample {
                        at,
                        policy,
                        status,
                        outcome,
                    });
                    // Pacing of an open-ish loop, not a wait for a condition.
                    next += period;
                    if let Some(d) = next.checked_duration_since(Instant::now()) {
                        std::thread::sleep(d);
                    }
                }
            }));
        }
    }

    fn samples(&self) -> Vec<Sample> {
        self.samples.lock().unwrap().clone()
    }

    fn finish(self) -> Vec<Sample> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            t.join().unwrap();
        }
        Arc::try_unwrap(self.samples).unwrap().into_inner().unwrap()
    }
}

fn outcome(q: &Quotad, policy: &str, key: &str) -> String {
    let (status, body) = q.check(&json!({"policy": policy, "key": key, "cost": 1}));
    assert_eq!(status, 200, "{policy}/{key}: {body}");
    body["outcome"].as_str().unwrap_or("?").to_owned()
}

/// 5 allowed, then denied.
fn five_then_denied(q: &Quotad, key: &str) {
    let outcomes: Vec<String> = (0..7).map(|_| outcome(q, "five", key)).collect();
    assert_eq!(
        outcomes,
        [
            "allowed", "allowed", "allowed", "allowed", "allowed", "denied", "denied"
        ],
        "key {key}"
    );
}

/// The storage key of `key` on `server`, if there is one.
fn storage_key(server: &RedisServer, key: &str) -> Option<String> {
    let suffix = format!("{{{key}}}");
    server.keys().into_iter().find(|k| k.ends_with(&suffix))
}

/// The admitted count a fixed window holds for `key` on `server`.
fn count(server: &RedisServer, key: &str) -> i64 {
    let Some(k) = storage_key(server, key) else {
        return 0;
    };
    redis::cmd("HGET")
        .arg(k)
        .arg("n")
        .query::<Option<i64>>(&mut server.conn())
        .expect("HGET")
        .unwrap_or(0)
}

/// EVALSHA calls `server` has executed (INFO commandstats). Scripts reach a replica as
/// their effects, so on a replica this stays put: it counts quotad's calls to a master.
fn evalsha_calls(server: &RedisServer) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut server.conn())
        .expect("INFO commandstats");
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// The server's replication role; "?" while it cannot answer (a demoted master closes its
/// clients' connections as it turns into a replica, and the tests poll through that).
fn role(server: &RedisServer) -> String {
    let info: Option<String> = redis::Client::open(server.url())
        .ok()
        .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(1)).ok())
        .and_then(|mut c| redis::cmd("INFO").arg("replication").query(&mut c).ok());
    let Some(info) = info else {
        return "?".to_owned();
    };
    info.lines()
        .find_map(|l| l.strip_prefix("role:"))
        .unwrap_or("?")
        .trim()
        .to_owned()
}

#[test]
fn a_sentinel_failover_under_load_is_followed_to_the_new_master() {
    let setup = SentinelSetup::start();
    let (old, new) = (&setup.master, &setup.replica);
    let q = Quotad::start(
        &Config::sentinel(&setup.sentinel_urls(), MASTER_NAME)
            .store("probe_interval", "100ms")
            .policy(Policy::new("five", "fixed_window", 5, "1d").on_store_error("closed"))
            .policy(Policy::new("bulk", "token_bucket", 1_000_000, "1s").on_store_error("open"))
            .policy(Policy::new("exact", "fixed_window", 1_000_000, "1d").on_store_error("closed"))
            .to_toml(),
    );
    wait_for(
        "quotad to connect to the master",
        Duration::from_secs(10),
        || (q.metric("quotad_store_up") == 1.0).then_some(()),
    );
    five_then_denied(&q, "before");
    assert!(
        storage_key(old, "before").is_some(),
        "written to the master"
    );

    // A few hundred checks/s on a generous key, and a slower key whose admissions are
    // counted exactly.
    let mut load = Load::new();
    load.add(q.port, "bulk", "hot", 4, 75);
    load.add(q.port, "exact", "counted", 1, 25);
    let started = Instant::now();
    wait_for(
        "enforced answers under load",
        Duration::from_secs(10),
        || {
            let s = load.samples();
            (started.elapsed() > Duration::from_secs(1)
                && s.iter().filter(|s| enforced(&s.outcome)).count() > 100)
                .then_some(())
        },
    );
    let new_calls_before = evalsha_calls(new);
    let t0 = Instant::now();
    setup.sentinels[0].failover();
    wait_for(
        "every sentinel to name the replica",
        Duration::from_secs(20),
        || {
            setup
                .sentinels
                .iter()
                .all(|s| s.master_port() == Some(new.port))
                .then_some(())
        },
    );
    let named = t0.elapsed();
    // Enforcement is back on the new master: it runs quotad's scripts, and both loaded
    // policies have enforced answers since.
    let first_call = wait_for("quotad's scripts on the new master", MAX_GAP, || {
        (evalsha_calls(new) > new_calls_before).then(|| t0.elapsed())
    });
    let resumed = Instant::now();
    wait_for(
        "enforced answers after the switch",
        Duration::from_secs(10),
        || {
            let s = load.samples();
            ["bulk", "exact"]
                .iter()
                .all(|p| {
                    s.iter()
                        .any(|s| s.at > resumed && s.policy == *p && enforced(&s.outcome))
                })
                .then_some(())
        },
    );
    let samples = load.finish();
    assert_eq!(role(new), "master");

    // Never a 5xx or a transport error, before, during or after.
    let bad: Vec<&Sample> = samples.iter().filter(|s| s.status != 200).collect();
    assert!(
        bad.is_empty(),
        "{} answers not 200: {:?}",
        bad.len(),
        &bad[..bad.len().min(5)]
    );
    let after: Vec<&Sample> = samples.iter().filter(|s| s.at >= t0).collect();
    let failed: Vec<&&Sample> = after.iter().filter(|s| !enforced(&s.outcome)).collect();
    let fail_open = failed.iter().filter(|s| s.outcome == "fail_open").count();
    let fail_closed = failed.iter().filter(|s| s.outcome == "fail_closed").count();
    assert_eq!(
        fail_open + fail_closed,
        failed.len(),
        "a non-enforced answer is a fail mode: {:?}",
        failed.iter().map(|s| &s.outcome).collect::<Vec<_>>()
    );
    // The gap: from the failover call to the first enforced answer after the last
    // fail_* one (zero when there was none).
    let gap = match failed.iter().map(|s| s.at).max() {
        None => Duration::ZERO,
        Some(last_failed) => after
            .iter()
            .filter(|s| s.at > last_failed && enforced(&s.outcome))
            .map(|s| s.at)
            .min()
            .expect("an enforced answer after the last failed one")
            .duration_since(t0),
    };
    let first_failed = failed.iter().map(|s| s.at.duration_since(t0)).min();
    eprintln!(
        "sentinel failover: {} checks after the call ({:.0}/s); sentinels named the new \
         master after {named:?}; first script on it after {first_call:?}; \
         {} fail_* answers ({fail_open} fail_open, {fail_closed} fail_closed), first after \
         {first_failed:?}; enforcement back (gap) after {gap:?}",
        after.len(),
        after.len() as f64 / t0.elapsed().as_secs_f64(),
        failed.len(),
    );
    assert!(gap < MAX_GAP, "gap {gap:?}");

    // The exactly-counted key: admissions answered vs the count the new master holds.
    // Writes the old master acknowledged after the replica's promotion and before quotad
    // moved to the new master are lost with it (asynchronous replication, and the old
    // master stays writable until the sentinels demote it), so the count may be lower,
    // never higher than admissions plus the calls whose answer was lost.
    let admitted = samples
        .iter()
        .filter(|s| s.policy == "exact" && s.outcome == "allowed")
        .count() as i64;
    let unknown = samples
        .iter()
        .filter(|s| s.policy == "exact" && s.outcome == "fail_closed")
        .count() as i64;
    let held = count(new, "counted");
    eprintln!(
        "exact key: {admitted} admitted, {unknown} fail_closed, {held} counted on the new \
         master ({} lost in the failover)",
        admitted - held
    );
    assert!(
        held > 0 && held <= admitted + unknown,
        "{held} vs {admitted} + {unknown}"
    );

    // Enforced exactly on the new master, and written there.
    five_then_denied(&q, "after");
    assert_eq!(count(new, "after"), 5, "the new master holds the count");
    // The sentinels demote the old master seconds later (they wait for it to report its
    // role for a while); by then quotad has long left it, and nothing changes.
    wait_for("the old master demoted", Duration::from_secs(25), || {
        (role(old) == "slave").then_some(())
    });
    eprintln!(
        "old master demoted {:?} after the failover call",
        t0.elapsed()
    );
    five_then_denied(&q, "demoted");
    assert_eq!(count(new, "demoted"), 5);
}
