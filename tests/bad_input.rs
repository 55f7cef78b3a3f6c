//! Bad input gets the right 4xx with a JSON error naming the problem, and writes nothing:
//! DBSIZE on the real Redis is the same before and after.
//!
//! In-process daemons (`Quotad::serve`): requests in, answers and Redis read back; nothing
//! here needs a process boundary.

use quotad_testkit as common;

use common::{ADMIN_PATHS, ADMIN_TOKEN, Config, Policy, Quotad, RedisServer, http, request};
use serde_json::Value;

fn config(redis: &RedisServer) -> String {
    Config::redis(&redis.url())
        .policy(Policy::new("api", "token_bucket", 10, "1s").burst(20))
        .policy(Policy::new("login", "sliding_log", 5, "15m"))
        .to_toml()
}

struct Case {
    name: &'static str,
    path: &'static str,
    content_type: Option<&'static str>,
    body: String,
    status: u16,
    code: &'static str,
    /// A fragment the message must contain (what and which field).
    mentions: &'static str,
}

fn case(
    name: &'static str,
    body: &str,
    status: u16,
    code: &'static str,
    mentions: &'static str,
) -> Case {
    Case {
        name,
        path: "/v1/check",
        content_type: Some("application/json"),
        body: body.to_owned(),
        status,
        code,
        mentions,
    }
}

#[test]
fn every_bad_request_is_a_named_4xx_and_writes_nothing() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&config(&redis));
    let long_key = "k".repeat(513);
    let many: Vec<String> = (0..65)
        .map(|i| format!(r#"{{"policy":"api","key":"k{i}"}}"#))
        .collect();
    let huge = format!(r#"{{"policy":"api","key":"{}"}}"#, "x".repeat(70 * 1024));
    let mut cases = vec![
        case(
            "malformed JSON",
            r#"{"policy": "api", "key": "#,
            400,
            "invalid_json",
            "malformed JSON",
        ),
        case("not an object", r#"[1, 2]"#, 400, "invalid_request", "body"),
        case(
            "missing key",
            r#"{"policy": "api"}"#,
            400,
            "invalid_request",
            "key: missing field",
        ),
        case(
            "missing policy",
            r#"{"key": "a"}"#,
            400,
            "invalid_request",
            "policy: missing field",
        ),
        case(
            "unknown field",
            r#"{"policy": "api", "key": "a", "colour": 1}"#,
            400,
            "invalid_request",
            "colour: unknown field",
        ),
        case(
            "unknown policy",
            r#"{"policy": "nope", "key": "a"}"#,
            404,
            "unknown_policy",
            "unknown policy \"nope\"",
        ),
        case(
            "empty key",
            r#"{"policy": "api", "key": ""}"#,
            400,
            "invalid_request",
            "key: must not be empty",
        ),
        case(
            "key not a string",
            r#"{"policy": "api", "key": 7}"#,
            400,
            "invalid_request",
            "key: must be a string",
        ),
        case(
            "key over the cap",
            &format!(r#"{{"policy": "api", "key": "{long_key}"}}"#),
            400,
            "invalid_request",
            "key: is 513 bytes",
        ),
        case(
            "negative cost",
            r#"{"policy": "api", "key": "a", "cost": -1}"#,
            400,
            "invalid_request",
            "cost: must not be negative",
        ),
        case(
            "fractional cost",
            r#"{"policy": "api", "key": "a", "cost": 1.5}"#,
            400,
            "invalid_request",
            "cost: must be a whole number",
        ),
        case(
            "string cost",
            r#"{"policy": "api", "key": "a", "cost": "1"}"#,
            400,
            "invalid_request",
            "cost: must be an integer",
        ),
        case(
            "cost over capacity",
            r#"{"policy": "api", "key": "a", "cost": 21}"#,
            400,
            "invalid_request",
            "cost: 21 exceeds the capacity 20",
        ),
        case(
            "oversized batch",
            &format!(r#"{{"checks": [{}]}}"#, many.join(",")),
            400,
            "batch_too_large",
            "at most 64 checks, got 65",
        ),
        case(
            "empty batch",
            r#"{"checks": []}"#,
            400,
            "invalid_request",
            "checks: must hold at least one",
        ),
        case(
            "bad check in batch",
            r#"{"checks": [{"policy": "api", "key": "a"}, {"policy": "api", "key": "b", "cost": -2}]}"#,
            400,
            "invalid_request",
            "checks[1].cost",
        ),
        case(
            "unknown policy in batch",
            r#"{"checks": [{"policy": "api", "key": "a"}, {"policy": "x", "key": "b"}]}"#,
            404,
            "unknown_policy",
            "checks[1].policy",
        ),
        case(
            "batch plus single fields",
            r#"{"checks": [{"policy": "api", "key": "a"}], "policy": "api"}"#,
            400,
            "invalid_request",
            "policy: unknown field",
        ),
        case(
            "oversized body",
            &huge,
            413,
            "payload_too_large",
            "larger than 65536 bytes",
        ),
        Case {
            content_type: Some("text/plain"),
            ..case(
                "wrong content type",
                r#"{"policy": "api", "key": "a"}"#,
                415,
                "unsupported_media_type",
                "application/json",
            )
        },
        Case {
            content_type: None,
            ..case(
                "no content type",
                r#"{"policy": "api", "key": "a"}"#,
                415,
                "unsupported_media_type",
                "none given",
            )
        },
        Case {
            path: "/v1/reset",
            ..case(
                "reset without key",
                r#"{"policy": "login"}"#,
                400,
                "invalid_request",
                "key: missing field",
            )
        },
        Case {
            path: "/v1/reset",
            ..case(
                "reset unknown policy",
                r#"{"policy": "x", "key": "a"}"#,
                404,
                "unknown_policy",
                "unknown policy",
            )
        },
        Case {
            path: "/v1/nope",
            ..case(
                "unknown endpoint",
                "{}",
                404,
                "not_found",
                "no such endpoint",
            )
        },
    ];
    // A reset of a key that exists must still change nothing when the request is bad.
    q.check1("login", "alice");
    let before = redis.dbsize();
    assert_eq!(before, 1);
    // An admin endpoint's bad body is read only with its token: without one it is a 401.
    let bearer = format!("Bearer {ADMIN_TOKEN}");
    for c in cases.drain(..) {
        let mut headers: Vec<(&str, &str)> = c
            .content_type
            .map(|t| ("content-type", t))
            .into_iter()
            .collect();
        if ADMIN_PATHS.contains(&c.path) {
            headers.push(("authorization", &bearer));
        }
        let (status, _, text) = request(q.port, "POST", c.path, &headers, &c.body).expect("http");
        let v: Value = serde_json::from_str(&text)
            .unwrap_or_else(|_| panic!("{}: body is not JSON: {text}", c.name));
        assert_eq!(status, c.status, "{}: {text}", c.name);
        assert_eq!(v["error"]["code"], c.code, "{}: {text}", c.name);
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(
            msg.contains(c.mentions),
            "{}: message {msg:?} lacks {:?}",
            c.name,
            c.mentions
        );
    }
    // Wrong method: 405 with the same error shape.
    let (status, _, text) = http(q.port, "GET", "/v1/check", None, "").unwrap();
    assert_eq!(status, 405, "{text}");
    assert!(text.contains("method_not_allowed"), "{text}");
    assert_eq!(redis.dbsize(), before, "a rejected request wrote to Redis");
    // Nothing was consumed either: alice's log still holds exactly one entry.
    let n: i64 = redis::cmd("ZCARD")
        .arg("rl:login:sl:{alice}")
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(n, 1);
    // And quotad is still healthy and answering.
    assert_eq!(q.check1("api", "after")["outcome"], "allowed");
}

#[test]
fn hostile_keys_stay_inside_their_hash_tag() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&config(&redis));
    for key in ["}{", "{a}", "%7B", "a:b", "ünïcödé ✓", "line\nbreak"] {
        assert_eq!(q.check1("api", key)["outcome"], "allowed", "{key:?}");
    }
    let keys = redis.keys();
    assert_eq!(keys.len(), 6, "{keys:?}");
    for k in keys {
        let open = k.find('{').unwrap();
        let close = open + k[open..].find('}').unwrap();
        assert_eq!(
            close,
            k.len() - 1,
            "the hash tag of {k:?} does not span the whole user key"
        );
    }
    redis.assert_every_key_has_ttl();
}

/// `POST /v1/reset` changes limits, so it takes a token of `[admin]`: without one, with a
/// wrong one, with another scheme, or with what a check caller sends (its API key as a
/// bearer token) it is a 401 that names the header, and the key keeps what it spent
/// (DUMP unchanged). With the token the reset is done, counted and in the audit log, which
/// names the token and not the key.
#[test]
fn an_admin_request_without_its_token_is_401_and_changes_nothing() {
    let redis = RedisServer::start();
    let q = Quotad::start(&config(&redis));
    assert_eq!(q.check1("login", "alice")["outcome"], "allowed");
    let key = "rl:login:sl:{alice}";
    let dump = || -> Vec<u8> {
        redis::cmd("DUMP")
            .arg(key)
            .query(&mut redis.conn())
            .unwrap()
    };
    let before = (dump(), redis.dbsize());
    let body = r#"{"policy": "login", "key": "alice"}"#;
    let json = ("content-type", "application/json");
    let wrong = format!("Bearer {ADMIN_TOKEN}x");
    let basic = "Basic dGVzdHM6dGVzdHMtYWRtaW4tdG9rZW4tMDEyMzQ1Njc4OQ==";
    for (name, headers) in [
        ("no token", vec![json]),
        (
            "a wrong token",
            vec![json, ("authorization", wrong.as_str())],
        ),
        ("another scheme", vec![json, ("authorization", basic)]),
        (
            "a check caller's key",
            vec![json, ("authorization", "Bearer alice")],
        ),
    ] {
        let (status, h, text) = request(q.port, "POST", "/v1/reset", &headers, body).unwrap();
        assert_eq!(status, 401, "{name}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["code"], "unauthenticated", "{name}: {text}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("Authorization: Bearer")
        );
        assert!(
            h.iter().any(|(k, v)| k.eq_ignore_ascii_case("www-authenticate") && v.starts_with("Bearer")),
            "{name}: {h:?}"
        );
        assert_eq!((dump(), redis.dbsize()), before, "{name} changed the store");
    }
    assert_eq!(
        q.metric(r#"quotad_admin_requests_total{action="reset",result="unauthenticated"}"#),
        4.0
    );
    assert!(
        !q.log().contains("admin request"),
        "an unauthorized request was audited as a change"
    );

    let (status, _, _) = q.post(
        "/v1/reset",
        &serde_json::json!({"policy": "login", "key": "alice"}),
    );
    assert_eq!(status, 204);
    assert!(redis.dbsize() < before.1, "the reset forgot nothing");
    assert_eq!(
        q.metric(r#"quotad_admin_requests_total{action="reset",result="done"}"#),
        1.0
    );
    let log = q.log();
    let line = log
        .lines()
        .find(|l| l.contains("admin request"))
        .unwrap_or_else(|| panic!("no audit line:\n{log}"));
    assert!(
        line.contains("token=tests") && line.contains("policy=\"login\"")
            || line.contains("policy=login"),
        "{line}"
    );
    assert!(
        line.contains("key_sha256=") && !line.contains("alice"),
        "{line}"
    );
}

/// `[admin]` in a file: a token too short, one with no value, two of a name, one that is a
/// peer region's secret, and `allow_without_token` on a listener anyone can reach are each
/// a config error that names its field.
#[test]
fn admin_tokens_are_checked_when_the_config_is_read() {
    let cases = [
        (
            "[[admin.token]]\nname = \"a\"\ntoken = \"short\"\n",
            "admin.token[0].token",
            "at least 16 bytes",
        ),
        (
            "[[admin.token]]\nname = \"a\"\n",
            "admin.token[0].token",
            "set one of token",
        ),
        (
            "[[admin.token]]\nname = \"a\"\ntoken = \"0123456789abcdef\"\n[[admin.token]]\nname = \"a\"\ntoken = \"fedcba9876543210\"\n",
            "admin.token[1].name",
            "defined already",
        ),
        (
            "[server]\nlisten = \"0.0.0.0:8686\"\n[admin]\nallow_without_token = true\n",
            "admin.allow_without_token",
            "loopback",
        ),
        (
            "region = \"eu\"\n[coordinator]\nsecret = \"shared-secret-of-the-regions\"\n\
             [[peer]]\nregion = \"us\"\nurl = \"http://127.0.0.1:1\"\n\
             [[admin.token]]\nname = \"a\"\ntoken = \"shared-secret-of-the-regions\"\n",
            "admin.token[0].token",
            "must differ from every peer's secret",
        ),
    ];
    for (text, field, why) in cases {
        let err = quotad_daemon::Settings::parse("admin.toml", text)
            .expect_err(text)
            .to_string();
        assert!(err.contains(field) && err.contains(why), "{text}\n{err}");
    }
    let open = "[server]\nlisten = \"127.0.0.1:8686\"\n[admin]\nallow_without_token = true\n\
                [[policy]]\nname = \"p\"\nalgorithm = \"fixed_window\"\nlimit = 1\nwindow = \"1s\"\n";
    assert!(quotad_daemon::Settings::parse("admin.toml", open).is_ok());
}
