//! ACL credentials (`store.username`, `store.password`): quotad authenticates as its own
//! user; a user whose ACL does not cover quotad's keys, or a wrong password, gets no
//! decision from Redis, and each policy's fail mode answers (never a 5xx).

use quotad_testkit as common;

use common::{Config, Policy, Quotad, RedisServer, wait_for};
use serde_json::json;
use std::time::Duration;

const PASSWORD: &str = "s3cret-pass-for-quotad";

/// A Redis with a `quotad` user for quotad's keys; the default user may only touch
/// `probe:*` (enough for the test kit's own PING).
fn redis_with_acl() -> RedisServer {
    let quotad_user = format!(">{PASSWORD}");
    RedisServer::start_with_args(
        false,
        &[
            "--user",
            "quotad",
            "on",
            &quotad_user,
            "~*",
            "&*",
            "+@all",
            "--user",
            "default",
            "on",
            "nopass",
            "~probe:*",
            "&*",
            "+@all",
        ],
    )
}

fn config(redis: &RedisServer) -> Config {
    Config::redis(&redis.url())
        .policy(Policy::new("five", "fixed_window", 5, "1d").on_store_error("closed"))
        .policy(Policy::new("open", "fixed_window", 5, "1d").on_store_error("open"))
}

fn outcome(q: &Quotad, policy: &str) -> String {
    let (status, v) = q.check(&json!({"policy": policy, "key": "alice"}));
    assert_eq!(status, 200, "{v}");
    v["outcome"].as_str().unwrap().to_owned()
}

#[test]
fn quotad_authenticates_as_its_acl_user() {
    let redis = redis_with_acl();
    let q = Quotad::start(
        &config(&redis)
            .store("username", "quotad")
            .store("password", PASSWORD)
            .to_toml(),
    );
    wait_for("redis up", Duration::from_secs(10), || {
        (q.metric("quotad_store_up") == 1.0).then_some(())
    });
    let outcomes: Vec<String> = (0..7).map(|_| outcome(&q, "five")).collect();
    assert_eq!(outcomes[..5], ["allowed"; 5]);
    assert_eq!(outcomes[5..], ["denied"; 2]);
    let as_quotad = redis::Client::open(format!(
        "redis://quotad:{PASSWORD}@127.0.0.1:{}",
        redis.port
    ))
    .unwrap();
    let count: Option<i64> = redis::cmd("HGET")
        .arg("rl:five:fw:{alice}")
        .arg("n")
        .query(&mut as_quotad.get_connection().unwrap())
        .unwrap();
    assert_eq!(count, Some(5));
}

#[test]
fn without_the_right_credentials_the_fail_modes_answer() {
    let redis = redis_with_acl();
    // The default user: connected, but its ACL refuses quotad's keys (NOPERM).
    let q = Quotad::start(&config(&redis).to_toml());
    wait_for("redis up", Duration::from_secs(10), || {
        (q.metric("quotad_store_up") == 1.0).then_some(())
    });
    assert_eq!(outcome(&q, "five"), "fail_closed");
    assert_eq!(outcome(&q, "open"), "fail_open");
    assert!(
        q.metric("quotad_store_errors_total{kind=\"command\"}") >= 2.0,
        "counted as command errors"
    );
    wait_for("the refusal logged", Duration::from_secs(5), || {
        q.log().contains("no permissions to access").then_some(())
    });
    // A wrong password: no connection at all.
    let q = Quotad::start(
        &config(&redis)
            .store("username", "quotad")
            .store("password", "wrong-password")
            .to_toml(),
    );
    assert_eq!(outcome(&q, "five"), "fail_closed");
    assert_eq!(outcome(&q, "open"), "fail_open");
    assert_eq!(q.metric("quotad_store_up"), 0.0);
    wait_for("the refusal logged", Duration::from_secs(5), || {
        q.log()
            .contains("Password authentication failed")
            .then_some(())
    });
}

/// `store.password_file`: quotad authenticates with the file's content (its trailing
/// newline dropped), shows it nowhere (log, `/v1/*`, `/metrics`), and a rotated file is
/// noticed without a SIGHUP and refused by name: the old credentials stay in use and the
/// reload is not counted `ok`.
#[test]
fn a_password_from_a_file_is_used_shown_nowhere_and_its_rotation_refused() {
    let redis = redis_with_acl();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("redis-password");
    std::fs::write(&file, format!("{PASSWORD}\n")).unwrap();
    let q = Quotad::start(
        &config(&redis)
            .store("username", "quotad")
            .store("password_file", file.to_str().unwrap())
            .to_toml(),
    );
    wait_for("redis up", Duration::from_secs(10), || {
        (q.metric("quotad_store_up") == 1.0).then_some(())
    });
    let outcomes: Vec<String> = (0..6).map(|_| outcome(&q, "five")).collect();
    assert_eq!(
        outcomes,
        [
            "allowed", "allowed", "allowed", "allowed", "allowed", "denied"
        ]
    );

    let rotated = "a-rotated-password-nobody-may-see";
    std::fs::write(&file, format!("{rotated}\n")).unwrap();
    let refused = "quotad_config_reloads_total{result=\"refused\"}";
    wait_for("the rotation noticed", Duration::from_secs(15), || {
        (q.metric(refused) == 1.0).then_some(())
    });
    assert_eq!(q.metric("quotad_config_reloads_total{result=\"ok\"}"), 0.0);
    assert!(
        q.log().contains(
            "[store] credentials (username, password, TLS files) cannot change without a restart"
        ),
        "{}",
        q.log()
    );
    assert_eq!(
        outcome(&q, "open"),
        "allowed",
        "the old connection still serves"
    );

    let mut seen = vec![("log".to_owned(), q.log())];
    for path in ["/v1/status", "/v1/policies", "/metrics", "/readyz"] {
        seen.push((path.to_owned(), q.get(path).1));
    }
    for (place, text) in seen {
        for secret in [PASSWORD, rotated] {
            assert!(!text.contains(secret), "{place} shows a password:\n{text}");
        }
    }
}
