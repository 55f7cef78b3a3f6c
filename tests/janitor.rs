//! The TTL janitor's sweep against a real Redis: keys that lost their TTL get one back,
//! what is not quotad's (and the coordinator's fencing counter) is left alone, and no
//! step of the sweep shows in SLOWLOG.

use std::time::Duration;

use quotad_daemon::Settings;
use quotad_daemon::testing::redis::{CLIENT_NAME, ORPHAN_TTL_MS, SCAN_COUNT, SweepReport, sweep};
use quotad_testkit::{Config, Policy, Quotad, RedisServer, wait_for};

/// Nothing of the janitor's in SLOWLOG (its connection is named), and the `keys` it
/// swept were read in SCAN steps of about [`SCAN_COUNT`], never with KEYS: a SLOWLOG
/// threshold that survives a loaded CI host cannot tell one big step from a small one.
fn assert_swept_in_small_steps(redis: &RedisServer, keys: u64) {
    let slow = redis.slowlog_of(CLIENT_NAME);
    assert!(slow.is_empty(), "the janitor in SLOWLOG: {slow:?}");
    assert_eq!(redis.command_calls("keys"), 0, "KEYS blocks Redis");
    let steps = redis.command_calls("scan");
    assert!(
        steps >= keys / SCAN_COUNT as u64,
        "{keys} keys in {steps} SCAN steps of at most ~{SCAN_COUNT}"
    );
}

/// One sweep of `redis` under the layouts of `config`, as the daemon's janitor runs it.
fn sweep_once(
    redis: &RedisServer,
    config: &str,
    pause: Duration,
) -> redis::RedisResult<SweepReport> {
    let settings = Settings::parse("janitor.toml", config).unwrap_or_else(|e| panic!("{e}"));
    let layouts = quotad_daemon::testing::layouts(&settings);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let client = redis::Client::open(redis.url()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        sweep(&mut conn, &layouts, pause).await
    })
}

fn pttl(conn: &mut redis::Connection, key: &str) -> i64 {
    redis::cmd("PTTL").arg(key).query(conn).unwrap()
}

#[test]
fn keys_that_lost_their_ttl_get_one_back_and_nothing_else_changes() {
    let redis = RedisServer::start();
    let config = Config::redis(&redis.url())
        .policy(Policy::new("sw", "sliding_window", 10, "1m"))
        .policy(Policy::new("tb", "token_bucket", 10, "1s").burst(50))
        .to_toml();
    let q = Quotad::serve(&config);
    for i in 0..50 {
        q.check1("sw", &format!("user-{i}"));
        q.check1("tb", &format!("user-{i}"));
    }
    drop(q);
    let mut conn = redis.conn();
    let persisted: Vec<String> = (0..20).map(|i| format!("rl:sw:sw:{{user-{i}}}")).collect();
    for k in &persisted {
        let _: i64 = redis::cmd("PERSIST").arg(k).query(&mut conn).unwrap();
    }
    let _: () = redis::cmd("SET")
        .arg("rl:gone:fw:{x}")
        .arg(1)
        .query(&mut conn)
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg("session:1")
        .arg(1)
        .query(&mut conn)
        .unwrap();
    let _: i64 = redis::cmd("INCR")
        .arg("rl:coordinator:fence")
        .query(&mut conn)
        .unwrap();
    redis.watch_slowlog();

    let report = sweep_once(&redis, &config, Duration::from_millis(1)).unwrap();
    assert_eq!(
        report.scanned,
        100 + 1 + 1,
        "100 checked keys, the orphan, the fence"
    );
    assert_eq!(report.without_ttl, 21, "20 persisted keys and the orphan");
    assert_eq!(report.repaired, 21);
    for k in &persisted {
        let t = pttl(&mut conn, k);
        assert!(
            t > 100_000 && t <= 121_000,
            "{k}: two windows plus grace, got {t}"
        );
    }
    let orphan = pttl(&mut conn, "rl:gone:fw:{x}");
    assert!(orphan > 0 && orphan <= ORPHAN_TTL_MS, "{orphan}");
    assert_eq!(pttl(&mut conn, "session:1"), -1, "not quotad's");
    assert_eq!(
        pttl(&mut conn, "rl:coordinator:fence"),
        -1,
        "the fence never expires"
    );
    let _: i64 = redis::cmd("DEL").arg("session:1").query(&mut conn).unwrap();
    // Before the harness's own SCAN.
    assert_swept_in_small_steps(&redis, report.scanned);
    redis.assert_every_key_has_ttl();
}

/// A Redis shared with other applications: most SCAN steps find none of quotad's keys
/// (SCAN may answer a step with no key at all). Such a step is not an error, and the sweep
/// goes on to repair the key it finds later.
#[test]
fn a_sweep_passes_steps_that_find_none_of_quotads_keys() {
    let redis = RedisServer::start();
    let config = Config::redis(&redis.url())
        .policy(Policy::new("fw", "fixed_window", 10, "1m"))
        .to_toml();
    let mut conn = redis.conn();
    let mut foreign = redis::pipe();
    for i in 0..5_000 {
        foreign
            .cmd("SET")
            .arg(format!("session:{i}"))
            .arg(1)
            .ignore();
    }
    let _: () = foreign.query(&mut conn).unwrap();
    let _: () = redis::cmd("SET")
        .arg("rl:fw:fw:{lost}")
        .arg(1)
        .query(&mut conn)
        .unwrap();

    let report = sweep_once(&redis, &config, Duration::ZERO)
        .unwrap_or_else(|e| panic!("a sweep over foreign keys failed: {e}"));
    assert_eq!(report.scanned, 1, "only quotad's key matches");
    assert_eq!(report.repaired, 1);
    let t = pttl(&mut conn, "rl:fw:fw:{lost}");
    assert!(t > 0, "the lost key got a TTL back: {t}");
    assert_eq!(pttl(&mut conn, "session:1"), -1, "not quotad's");
}

/// A config on `redis` whose janitor sweeps every second (tests wait for sweeps), with
/// one policy `fw`: a fixed window of `window`.
fn swept_every_second(redis: &RedisServer, window: &str) -> String {
    Config::redis(&redis.url())
        .store("janitor_interval", "1s")
        .policy(Policy::new("fw", "fixed_window", 10, window))
        .to_toml()
}

/// The daemon runs the janitor: 1,000 keys PERSISTed behind its back have TTLs again
/// within two intervals, and its metrics say so.
#[test]
fn the_daemon_gives_persisted_keys_their_ttl_back_within_two_intervals() {
    let redis = RedisServer::start();
    let config = swept_every_second(&redis, "1h");
    let q = Quotad::serve(&config);
    let mut conn = redis.conn();
    for i in 0..1000 {
        q.check1("fw", &format!("k{i}"));
    }
    let keys: Vec<String> = (0..1000).map(|i| format!("rl:fw:fw:{{k{i}}}")).collect();
    // Wait out a sweep first, so the PERSISTs land between two of them.
    let start = std::time::Instant::now();
    while q.metric("quotad_janitor_last_scan_timestamp_seconds") == 0.0 {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no sweep in 20 s: failed {}, skipped {}",
            q.metric("quotad_janitor_sweeps_total{result=\"failed\"}"),
            q.metric("quotad_janitor_sweeps_total{result=\"skipped\"}"),
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(q.metric("quotad_janitor_sweeps_total{result=\"swept\"}") >= 1.0);
    for k in &keys {
        let _: i64 = redis::cmd("PERSIST").arg(k).query(&mut conn).unwrap();
    }
    let persisted = std::time::Instant::now();
    wait_for(
        "every key with a TTL again",
        Duration::from_secs(10),
        || keys.iter().all(|k| pttl(&mut conn, k) > 0).then_some(()),
    );
    let took = persisted.elapsed();
    assert!(
        took <= Duration::from_secs(3),
        "two intervals (plus 1 s of slack): {took:?}"
    );
    // The counter moves once the sweep is done, just after the last TTL.
    wait_for("the repairs counted", Duration::from_secs(5), || {
        (q.metric("quotad_janitor_repaired_total") >= 1000.0).then_some(())
    });
    // Before the harness's own SCAN.
    assert_swept_in_small_steps(&redis, 1000);
    redis.assert_every_key_has_ttl();
}

/// After a reload that lengthens a window and adds a policy, keys of both PERSISTed
/// behind the daemon's back get the TTL their policy writes now (an hour's window), not
/// the start-up window's minute nor the orphan's: the janitor lays out the config in
/// force before each sweep.
#[test]
fn after_a_reload_persisted_keys_get_the_ttl_of_the_config_in_force() {
    let redis = RedisServer::start();
    let config = swept_every_second(&redis, "1m");
    let q = Quotad::start(&config);
    let file = q.dir.path().join("quotad.toml");
    let started = std::fs::read_to_string(&file).unwrap();
    assert!(started.contains("window = \"1m\""), "{started}");
    // A new window changes what stored counts mean: it needs a higher policy version.
    let reloaded = started.replace("window = \"1m\"", "window = \"1h\"\nversion = 2")
        + "\n[[policy]]\nname = \"added\"\nalgorithm = \"fixed_window\"\nlimit = 10\nwindow = \"1h\"\n";
    std::fs::write(&file, reloaded).unwrap();
    q.hup();
    wait_for("the reload", Duration::from_secs(10), || {
        (q.metric("quotad_config_reloads_total{result=\"ok\"}") == 1.0).then_some(())
    });
    // Two sweeps ending in later seconds: the second began after the reload was in force.
    for _ in 0..2 {
        let last = q.metric("quotad_janitor_last_scan_timestamp_seconds");
        wait_for("a sweep after the reload", Duration::from_secs(10), || {
            (q.metric("quotad_janitor_last_scan_timestamp_seconds") > last).then_some(())
        });
    }
    q.check1("fw", "k");
    q.check1("added", "k");
    let keys = ["rl:fw:fw:{k}", "rl:added:fw:{k}"];
    let mut conn = redis.conn();
    for k in keys {
        let persisted: i64 = redis::cmd("PERSIST").arg(k).query(&mut conn).unwrap();
        assert_eq!(persisted, 1, "{k} had a TTL to lose");
    }
    wait_for(
        "both keys with a TTL again",
        Duration::from_secs(10),
        || keys.iter().all(|k| pttl(&mut conn, k) > 0).then_some(()),
    );
    for k in keys {
        let t = pttl(&mut conn, k);
        assert!(
            t > 3_500_000 && t <= 3_601_000,
            "{k}: the reloaded hour plus grace (not {ORPHAN_TTL_MS} ms, nor a minute), got {t}"
        );
    }
    redis.assert_every_key_has_ttl();
}
