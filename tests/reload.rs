//! Hot reload: under load, the config file gets a new limit and an override, SIGHUP: the
//! new limit applies within a second, existing keys keep their counts, no request fails.
//! A broken file, and a change that cannot apply live, are refused, logged and counted,
//! and the running config keeps serving. A change saved without a signal is picked up too.

use quotad_testkit as common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{Config, Policy, Quotad, RedisServer, wait_for};

fn limit_of(q: &Quotad) -> u64 {
    q.json("/v1/policies")["policies"][0]["limit"]
        .as_u64()
        .unwrap()
}

#[test]
fn a_reload_applies_new_limits_and_keeps_every_count() {
    let redis = RedisServer::start();
    let config = Config::redis(&redis.url())
        .policy(Policy::new("api", "fixed_window", 5, "1h").on_store_error("closed"))
        .to_toml();
    let mut q = Quotad::start(&config);
    let file = q.dir.path().join("quotad.toml");
    let original = std::fs::read_to_string(&file).unwrap();
    let hash = q.json("/v1/policies")["config_hash"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(hash.len(), 64, "a SHA-256");

    // Load throughout: every answer must be a 200 decision.
    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let (stop, port) = (stop.clone(), q.port);
        std::thread::spawn(move || {
            let body = serde_json::json!({"policy": "api", "key": "load"}).to_string();
            let mut answers = 0;
            while !stop.load(Ordering::Relaxed) {
                let (status, _, text) =
                    common::http(port, "POST", "/v1/check", Some("application/json"), &body)
                        .unwrap();
                assert_eq!(status, 200, "{text}");
                answers += 1;
            }
            answers
        })
    };

    for _ in 0..3 {
        assert_eq!(q.check1("api", "k")["allowed"], true);
    }
    let new = original.replace("limit = 5", "limit = 10")
        + "\n[[policy.override]]\nkey = \"vip\"\nlimit = 20\n";
    std::fs::write(&file, &new).unwrap();
    let asked = Instant::now();
    q.hup();
    wait_for("the new limit", Duration::from_secs(5), || {
        (limit_of(&q) == 10).then_some(())
    });
    let took = asked.elapsed();
    eprintln!("new limit served {took:?} after SIGHUP");
    assert!(took <= Duration::from_secs(1), "{took:?}");
    let d = q.check1("api", "k");
    assert_eq!(
        (d["limit"].as_u64(), d["remaining"].as_u64()),
        (Some(10), Some(6)),
        "the count survived: {d}"
    );
    let vip = (0..25)
        .take_while(|_| q.check1("api", "vip")["allowed"] == true)
        .count();
    assert_eq!(vip, 20, "the override added by the reload");
    assert_eq!(q.metric("quotad_config_reloads_total{result=\"ok\"}"), 1.0);
    assert_ne!(q.json("/v1/policies")["config_hash"], hash.as_str());

    // A broken file: refused with file, line and field, counted; the old config serves.
    std::fs::write(&file, new.replace("limit = 10", "limit = -1")).unwrap();
    q.hup();
    wait_for("the refusal counted", Duration::from_secs(5), || {
        (q.metric("quotad_config_reloads_total{result=\"invalid\"}") >= 1.0).then_some(())
    });
    let log = q.log();
    assert!(log.contains("config reload refused"), "{log}");
    assert!(
        log.contains("quotad.toml:") && log.contains("policy[0].limit"),
        "{log}"
    );
    assert_eq!(limit_of(&q), 10);

    // A change that needs a restart: refused with the reason.
    std::fs::write(
        &file,
        new.replace("key_prefix", "key_prefix_x")
            .replace("[store]", "[store]\nkey_prefix = \"other\""),
    )
    .unwrap();
    q.hup();
    wait_for("the refusal counted", Duration::from_secs(5), || {
        (q.metric("quotad_config_reloads_total{result=\"refused\"}") >= 1.0).then_some(())
    });
    assert!(q.log().contains("[store] cannot change without a restart"));
    assert_eq!(limit_of(&q), 10);

    // Saved without a signal: seen on disk within a couple of seconds.
    std::fs::write(&file, new.replace("limit = 10", "limit = 12")).unwrap();
    wait_for("the saved file", Duration::from_secs(5), || {
        (limit_of(&q) == 12).then_some(())
    });

    stop.store(true, Ordering::Relaxed);
    let answers = load.join().expect("every load answer was a 200");
    eprintln!("{answers} checks under load across the reloads, all 200");
    assert!(answers > 0);
    assert!(
        q.child().try_wait().unwrap().is_none(),
        "the daemon is running"
    );
}
