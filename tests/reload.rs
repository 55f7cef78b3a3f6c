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

    // Saved without a signal: seen on disk once it has settled (2 s unchanged).
    std::fs::write(&file, new.replace("limit = 10", "limit = 12")).unwrap();
    wait_for("the saved file", Duration::from_secs(10), || {
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

fn reloads(q: &Quotad, result: &str) -> f64 {
    q.metric(&format!(
        "quotad_config_reloads_total{{result=\"{result}\"}}"
    ))
}

/// Rewrites the daemon's file with `edit` applied and reloads it; the result.
fn reload_with(q: &Quotad, edit: impl Fn(&str) -> String) -> &'static str {
    let text = std::fs::read_to_string(q.dir.path().join("quotad.toml")).unwrap();
    q.reload(&edit(&text))
}

/// A key denied just before a reload that raises its limit, or gives it an override, is
/// allowed at once: its remembered denial answered the old numbers, not the new ones.
#[test]
fn a_reload_that_raises_a_limit_ends_a_remembered_denial() {
    let redis = RedisServer::start();
    let config = Config::redis(&redis.url())
        .policy(Policy::new("api", "fixed_window", 2, "1h"))
        .to_toml();
    let q = Quotad::start(&config);
    let hits = "quotad_deny_cache_hits_total{policy=\"api\"}";
    for key in ["k", "vip"] {
        for _ in 0..2 {
            assert_eq!(q.check1("api", key)["allowed"], true);
        }
        let before = q.metric(hits);
        wait_for("a remembered denial", Duration::from_secs(10), || {
            assert_eq!(q.check1("api", key)["allowed"], false);
            (q.metric(hits) > before).then_some(())
        });
    }
    let result = reload_with(&q, |t| {
        t.replace("limit = 2", "limit = 5") + "\n[[policy.override]]\nkey = \"vip\"\nlimit = 9\n"
    });
    assert_eq!(result, "ok");
    let k = q.check1("api", "k");
    assert_eq!(
        (k["allowed"].as_bool(), k["remaining"].as_u64()),
        (Some(true), Some(2)),
        "{k}"
    );
    let vip = q.check1("api", "vip");
    assert_eq!(
        (vip["allowed"].as_bool(), vip["limit"].as_u64()),
        (Some(true), Some(9)),
        "{vip}"
    );
}

/// A rotated store password or peer secret is refused by name, never counted `ok` while
/// the old credentials stay in use; the reason names no secret.
#[test]
fn a_rotated_credential_is_refused_not_reported_applied() {
    let redis = RedisServer::start();
    let config = Config::redis(&redis.url())
        .store("password", "first-password")
        .policy(Policy::new("api", "fixed_window", 2, "1h"))
        .to_toml();
    let q = Quotad::start(&config);
    let result = reload_with(&q, |t| t.replace("first-password", "second-password"));
    assert_eq!(result, "refused");
    let log = q.log();
    assert!(
        log.contains(
            "[store] credentials (username, password, TLS files) cannot change without a restart"
        ),
        "{log}"
    );
    assert!(
        !log.contains("second-password") && !log.contains("first-password"),
        "{log}"
    );
    assert_eq!(reloads(&q, "ok"), 0.0);
}

/// A change that would alter what keys' stored state means (a window, an algorithm) is
/// refused with the reason unless the policy's version is raised; with it, it applies.
#[test]
fn a_new_window_applies_only_with_a_higher_policy_version() {
    let redis = RedisServer::start();
    let config = Config::redis(&redis.url())
        .policy(Policy::new("api", "sliding_log", 3, "1h"))
        .to_toml();
    let q = Quotad::start(&config);
    for _ in 0..3 {
        assert_eq!(q.check1("api", "k")["allowed"], true);
    }
    let result = reload_with(&q, |t| t.replace("window = \"1h\"", "window = \"1s\""));
    assert_eq!(result, "refused");
    assert!(
        q.log().contains("raise policy.version above 1"),
        "{}",
        q.log()
    );
    assert_eq!(
        q.check1("api", "k")["allowed"],
        false,
        "the hour's history holds"
    );
    // (The file on disk holds the refused 1 s window.)
    let result = reload_with(&q, |t| {
        t.replace("window = \"1s\"", "window = \"1s\"\nversion = 2")
    });
    assert_eq!(result, "ok");
    assert_eq!(
        q.json("/v1/policies")["policies"][0]["window_ms"],
        1000,
        "applied with the operator's word"
    );
}

/// The watcher applies a file written in place only once it has stopped changing: a
/// writer that appends one policy at a time (every prefix a valid config) is never served
/// half-way, and the whole file is applied once it settles.
#[test]
fn a_file_being_written_is_applied_only_once_whole() {
    let redis = RedisServer::start();
    let config = Config::redis(&redis.url())
        .policy(Policy::new("p0", "fixed_window", 5, "1h"))
        .to_toml();
    let q = Quotad::start(&config);
    let file = q.dir.path().join("quotad.toml");
    let original = std::fs::read_to_string(&file).unwrap();
    let start_hash = q.json("/v1/policies")["config_hash"].clone();
    let policy = |i: usize| {
        format!(
            "\n[[policy]]\nname = \"p{i}\"\nalgorithm = \"fixed_window\"\nlimit = 5\nwindow = \"1h\"\n"
        )
    };
    // The writer truncates the file and writes it back a policy at a time, 500 ms apart.
    let mut text = original.clone();
    let mut served = Vec::new();
    for i in 1..=8 {
        text.push_str(&policy(i));
        std::fs::write(&file, &text).unwrap();
        let until = std::time::Instant::now() + Duration::from_millis(500);
        while std::time::Instant::now() < until {
            served.push(q.json("/v1/policies")["policies"].as_array().unwrap().len());
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    assert!(
        served.iter().all(|&n| n == 1),
        "a half-written file was served (policy counts seen: {served:?})"
    );
    assert_eq!(q.json("/v1/policies")["config_hash"], start_hash);
    wait_for("the whole file", Duration::from_secs(10), || {
        (q.json("/v1/policies")["policies"].as_array().unwrap().len() == 9).then_some(())
    });
    assert_eq!(reloads(&q, "ok"), 1.0, "applied once, whole");
}

/// An admin token read from a file is read again at a reload: after the file is rotated,
/// the old token is refused and the new one accepted, with no restart (the tokens are
/// derived state of the file: docs/architecture.md, "Derived state").
#[test]
fn a_rotated_admin_token_file_applies_at_the_reload() {
    let redis = RedisServer::start();
    let secrets = tempfile::tempdir().unwrap();
    let file = secrets.path().join("billing.token");
    std::fs::write(&file, "billing-token-aaaaaaaaaaaa\n").unwrap();
    let config = Config::redis(&redis.url())
        .policy(Policy::new("api", "fixed_window", 2, "1h"))
        .to_toml()
        + &format!(
            "\n[[admin.token]]\nname = \"billing\"\ntoken_file = \"{}\"\n",
            file.display()
        );
    let q = Quotad::start(&config);
    let reset = |token: &str| {
        let bearer = format!("Bearer {token}");
        let headers = [
            ("content-type", "application/json"),
            ("authorization", bearer.as_str()),
        ];
        let body = r#"{"policy": "api", "key": "k"}"#;
        common::request(q.port, "POST", "/v1/reset", &headers, body)
            .unwrap()
            .0
    };
    assert_eq!(reset("billing-token-aaaaaaaaaaaa"), 204);
    std::fs::write(&file, "billing-token-bbbbbbbbbbbb\n").unwrap();
    assert_eq!(reload_with(&q, |t| t.to_owned()), "ok");
    assert_eq!(
        reset("billing-token-aaaaaaaaaaaa"),
        401,
        "the rotated-out token still works"
    );
    assert_eq!(reset("billing-token-bbbbbbbbbbbb"), 204);
}
