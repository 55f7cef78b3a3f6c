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

/// Redis with quotad's ACL user, and quotad started with its password in a file (the
/// file's directory is kept alive with it), up and authenticated.
fn with_password_file() -> (RedisServer, tempfile::TempDir, std::path::PathBuf, Quotad) {
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
    (redis, dir, file, q)
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
    let (redis, _dir, file, q) = with_password_file();
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

    // An unrelated change after it applies: the file's policies go in, the credential
    // stays as it runs, and the answer names both (every later reload used to be
    // refused whole, so the new limit never applied).
    let raised = Config::redis(&redis.url())
        .policy(Policy::new("five", "fixed_window", 5, "1d").on_store_error("closed"))
        .policy(Policy::new("open", "fixed_window", 7, "1d").on_store_error("open"))
        .store("username", "quotad")
        .store("password_file", file.to_str().unwrap())
        .to_toml();
    assert_eq!(q.reload(&q.config_file_text(&raised)), "partial");
    let policies: serde_json::Value = serde_json::from_str(&q.get("/v1/policies").1).unwrap();
    let open = policies["policies"]
        .as_array()
        .and_then(|l| l.iter().find(|p| p["name"] == "open"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(open["limit"], 7, "{policies}");
    let kept = policies["config_not_applied"].to_string();
    assert!(kept.contains("[store] credentials"), "{policies}");
    assert!(
        q.log().contains("config reloaded in part") && q.log().contains("running as before"),
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

/// A password rotated to one that authenticates (the ACL user has both while the Secret
/// rolls out) goes in live: the reload is `ok`, and once the old password is gone from
/// Redis and every connection of quotad's user is dropped, quotad reconnects with the new
/// one and decides as before. It used to be refused until a restart.
#[test]
fn a_password_rotated_to_one_that_authenticates_goes_in_live() {
    let (redis, _dir, file, q) = with_password_file();
    assert_eq!(outcome(&q, "five"), "allowed");
    let next = "the-next-password-of-quotad";
    let acl = |args: &[&str]| {
        let _: redis::Value = redis::cmd("ACL")
            .arg("SETUSER")
            .arg("quotad")
            .arg(args)
            .query(&mut redis.conn())
            .unwrap();
    };
    acl(&[&format!(">{next}")]);
    std::fs::write(&file, format!("{next}\n")).unwrap();
    let ok = "quotad_config_reloads_total{result=\"ok\"}";
    wait_for("the rotation applied", Duration::from_secs(15), || {
        (q.metric(ok) == 1.0).then_some(())
    });
    assert!(
        q.log()
            .contains("the new [store] credentials authenticated"),
        "{}",
        q.log()
    );
    // The old password gone, and every connection of quotad's dropped: only the new one
    // opens them again.
    acl(&[&format!("<{PASSWORD}")]);
    let _: redis::Value = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("USER")
        .arg("quotad")
        .query(&mut redis.conn())
        .unwrap();
    let decided = wait_for("decisions again", Duration::from_secs(15), || {
        let o = outcome(&q, "five");
        (o == "allowed" || o == "denied").then_some(o)
    });
    assert_eq!(decided, "allowed", "the second of five");
    assert!(!q.log().contains(next) && !q.log().contains(PASSWORD));
}
