//! Generated hostile input against a daemon on a real Redis, over raw sockets (so that any
//! byte sequence can be sent): 10,000 requests that are each wrong in one generated way
//! across `POST /v1/check`, `POST /v1/reset`, `POST /v1/peer/exchange` and the rest of the
//! routes, then 2,000 generated valid ones. Every wrong request gets a 4xx with the error
//! shape, no request gets a 5xx, the daemon never panics, and after all the wrong ones
//! Redis holds no key but the coordinator's own: a rejected request writes nothing.
//!
//! An in-process daemon (`Quotad::serve`): "never panics" is read from the panics this
//! process recorded, which is what the daemon's log was searched for.

use quotad_testkit as common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::federation::{eu_with_silent_us, even_escrow};
use common::{Policy, Quotad, RedisServer, wait_for};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use quotad_core::coordinator::RegionId;
use quotad_core::coordinator::message::{Exchange, KeyReport, PolicyReport};
use quotad_daemon::testing::federation as auth;
use serde_json::{Value, json};

const SECRET: &str = "fuzz-test-secret-0123456789abcdef";

/// (name, capacity) of every local policy; `g` is global (region eu, peer us).
const POLICIES: [(&str, u64); 5] = [("fw", 10), ("sl", 5), ("sw", 10), ("tb", 20), ("gc", 8)];

fn config(redis: &RedisServer) -> String {
    eu_with_silent_us(&redis.url(), SECRET)
        .policy(Policy::new("fw", "fixed_window", 10, "1s"))
        .policy(Policy::new("sl", "sliding_log", 5, "1s").on_store_error("closed"))
        .policy(Policy::new("sw", "sliding_window", 10, "1s").on_store_error("local"))
        .policy(Policy::new("tb", "token_bucket", 10, "1s").burst(20))
        .policy(Policy::new("gc", "gcra", 8, "1s").shadow())
        .policy(Policy::new("g", "token_bucket", 100, "1s").global(even_escrow()))
        .to_toml()
}

/// One request as bytes on the wire.
#[derive(Debug, Clone)]
struct Raw {
    what: String,
    head: String,
    body: Vec<u8>,
}

/// The header that lets a request through to an admin endpoint's body (the kit's token).
const ADMIN: &str = "authorization: Bearer tests-admin-token-0123456789\r\n";

fn post(path: &str, content_type: &str, extra: &str, body: Vec<u8>, what: String) -> Raw {
    Raw {
        what,
        head: format!(
            "POST {path} HTTP/1.1\r\nhost: q\r\nconnection: close\r\ncontent-type: {content_type}\r\n{extra}content-length: {}\r\n\r\n",
            body.len()
        ),
        body,
    }
}

fn key_strategy() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z0-9]{1,12}",
        "\\PC{1,20}",
        Just("{tag}".to_owned()),
        Just("a%7Bb%7D".to_owned()),
    ]
}

/// A valid check body's fields: policy, key, cost.
fn valid_check() -> impl Strategy<Value = (String, String, u64)> {
    (0..POLICIES.len(), key_strategy(), any::<u64>()).prop_map(|(p, key, c)| {
        let (name, cap) = POLICIES[p];
        (name.to_owned(), key, c % (cap + 1))
    })
}

/// A JSON value that is not a string.
fn not_a_string() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<i64>().prop_map(Value::from),
        any::<bool>().prop_map(Value::from),
        Just(Value::Null),
        Just(json!([1, "a"])),
        Just(json!({"x": 1})),
        (-1e9f64..1e9).prop_map(|f| json!(f)),
    ]
}

/// A cost that no policy accepts.
fn bad_cost() -> impl Strategy<Value = String> {
    prop_oneof![
        (1i64..i64::MAX).prop_map(|n| format!("-{n}")),
        Just("18446744073709551616".to_owned()),
        Just("1e300".to_owned()),
        Just("-0.5".to_owned()),
        (0u32..1000, 1u32..999).prop_map(|(a, b)| format!("{a}.{b:03}")),
        (21u64..u64::MAX).prop_map(|n| n.to_string()),
        Just("\"1\"".to_owned()),
        Just("[1]".to_owned()),
        Just("true".to_owned()),
        Just("null".to_owned()),
    ]
}

/// A request to `/v1/check` or `/v1/reset` that is wrong in exactly one generated way.
fn bad_client_request() -> impl Strategy<Value = Raw> {
    let check = |body: String, what: &str| {
        post(
            "/v1/check",
            "application/json",
            "",
            body.into_bytes(),
            what.to_owned(),
        )
    };
    prop_oneof![
        // A field missing.
        (valid_check(), any::<bool>()).prop_map(move |((p, k, c), drop_policy)| {
            let v = if drop_policy {
                json!({"key": k, "cost": c})
            } else {
                json!({"policy": p, "cost": c})
            };
            check(v.to_string(), "missing field")
        }),
        // A field of the wrong type.
        (valid_check(), not_a_string(), any::<bool>()).prop_map(move |((p, k, c), bad, on_key)| {
            let v = if on_key {
                json!({"policy": p, "key": bad, "cost": c})
            } else {
                json!({"policy": bad, "key": k, "cost": c})
            };
            check(v.to_string(), "wrong type")
        }),
        // An unknown field.
        (valid_check(), "[a-z_]{1,10}").prop_filter_map("a known field", move |((p, k, c), f)| {
            (!["policy", "key", "cost", "checks"].contains(&f.as_str())).then(|| {
                let mut v = json!({"policy": p, "key": k, "cost": c});
                v[f] = json!(1);
                check(v.to_string(), "unknown field")
            })
        }),
        // A duplicated field, both values valid.
        (valid_check(), 0usize..3).prop_map(move |((p, k, c), which)| {
            let body = match which {
                0 => format!(r#"{{"policy":"{p}","key":{},"key":"other","cost":{c}}}"#, json!(k)),
                1 => format!(r#"{{"policy":"{p}","policy":"{p}","key":{},"cost":{c}}}"#, json!(k)),
                _ => format!(r#"{{"policy":"{p}","key":{},"cost":{c},"cost":0}}"#, json!(k)),
            };
            check(body, "duplicate field")
        }),
        // An unknown policy.
        (key_strategy(), "[a-z]{1,10}").prop_filter_map("a real policy", move |(k, p)| {
            (!POLICIES.iter().any(|(n, _)| *n == p) && p != "g")
                .then(|| check(json!({"policy": p, "key": k}).to_string(), "unknown policy"))
        }),
        // An empty or over-long key.
        (valid_check(), prop_oneof![Just(0usize), 513usize..2000]).prop_map(move |((p, _, c), n)| {
            check(json!({"policy": p, "key": "k".repeat(n), "cost": c}).to_string(), "key length")
        }),
        // A bad cost.
        (valid_check(), bad_cost()).prop_map(move |((p, k, _), cost)| {
            check(format!(r#"{{"policy":"{p}","key":{},"cost":{cost}}}"#, json!(k)), "bad cost")
        }),
        // Truncated JSON.
        (valid_check(), any::<prop::sample::Index>()).prop_map(move |((p, k, c), at)| {
            let body = json!({"policy": p, "key": k, "cost": c}).to_string();
            let mut cut = at.index(body.len() - 1);
            while !body.is_char_boundary(cut) {
                cut -= 1;
            }
            check(body[..cut].to_owned(), "truncated JSON")
        }),
        // Not a JSON object at all.
        prop_oneof![
            Just("[]".to_owned()),
            Just("\"check\"".to_owned()),
            Just("42".to_owned()),
            Just("null".to_owned()),
            Just("".to_owned()),
        ]
        .prop_map(move |b| check(b, "not an object")),
        // A wrong content type.
        (valid_check(), prop_oneof![
            Just("text/plain"),
            Just("application/x-www-form-urlencoded"),
            Just("application/jsonx"),
            Just("multipart/form-data; boundary=x"),
        ])
        .prop_map(|((p, k, c), ct)| {
            post(
                "/v1/check",
                ct,
                "",
                json!({"policy": p, "key": k, "cost": c}).to_string().into_bytes(),
                "content type".into(),
            )
        }),
        // A body over the cap (valid JSON, padded).
        valid_check().prop_map(move |(p, k, c)| {
            let mut body = json!({"policy": p, "key": k, "cost": c}).to_string();
            body.push_str(&" ".repeat(70_000));
            check(body, "body over the cap")
        }),
        // Batches: over the cap, empty, not an array, one bad element.
        (prop::collection::vec(valid_check(), 1..8), 0usize..4, bad_cost()).prop_map(move |(checks, how, cost)| {
            let list: Vec<Value> = checks
                .iter()
                .map(|(p, k, c)| json!({"policy": p, "key": k, "cost": c}))
                .collect();
            let body = match how {
                0 => json!({"checks": vec![list[0].clone(); 65]}).to_string(),
                1 => json!({"checks": []}).to_string(),
                2 => json!({"checks": list[0]}).to_string(),
                _ => {
                    let (p, k, _) = &checks[checks.len() - 1];
                    let items: Vec<String> = list[..list.len() - 1]
                        .iter()
                        .map(Value::to_string)
                        .chain([format!(r#"{{"policy":"{p}","key":{},"cost":{cost}}}"#, json!(k))])
                        .collect();
                    format!(r#"{{"checks":[{}]}}"#, items.join(","))
                }
            };
            check(body, "bad batch")
        }),
        // Broken chunked framing.
        (valid_check(), prop_oneof![Just("zz"), Just("-1"), Just("ffffffffffffffffff"), Just("3;")]).prop_map(
            |((p, k, c), size)| {
                let json = json!({"policy": p, "key": k, "cost": c}).to_string();
                Raw {
                    what: "broken chunked framing".into(),
                    head: "POST /v1/check HTTP/1.1\r\nhost: q\r\nconnection: close\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n".into(),
                    body: format!("{size}\r\n{json}\r\n0\r\n\r\n").into_bytes(),
                }
            },
        ),
        // Resets: missing, extra, wrong-typed fields, unknown policy.
        (valid_check(), 0usize..4).prop_map(|((p, k, c), how)| {
            let body = match how {
                0 => json!({"policy": p}),
                1 => json!({"policy": p, "key": k, "cost": c}),
                2 => json!({"policy": p, "key": 7}),
                _ => json!({"policy": "no-such-policy", "key": k}),
            };
            post("/v1/reset", "application/json", ADMIN, body.to_string().into_bytes(), "bad reset".into())
        }),
        // Other routes and methods.
        ("[A-Z]{3,7}", prop_oneof![
            Just("/v1/check"),
            Just("/v1/reset"),
            Just("/v1/nope"),
            Just("/metrics"),
            Just("/v1/peer/exchange"),
        ])
        .prop_filter_map("an allowed method", |(m, path)| {
            let allowed = match path {
                "/v1/check" | "/v1/reset" | "/v1/peer/exchange" => m == "POST",
                "/metrics" => m == "GET" || m == "HEAD",
                _ => false,
            };
            (!allowed && m != "CONNECT").then(|| Raw {
                what: format!("{m} {path}"),
                head: format!("{m} {path} HTTP/1.1\r\nhost: q\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"),
                body: Vec::new(),
            })
        }),
    ]
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// A peer request that must be refused: missing or garbled auth headers, a wrong secret,
/// a stale timestamp, a body the signature does not cover, or a signed exchange with a
/// value out of bounds.
fn bad_peer_request() -> impl Strategy<Value = Raw> {
    let exchange = (
        any::<u64>(),
        prop::collection::vec(("\\PC{1,8}", any::<f32>()), 0..5),
    )
        .prop_map(|(inc, keys)| Exchange {
            from: RegionId(1),
            incarnation: inc % 1000 + 1,
            to_incarnation: 0,
            t_req: 0,
            policies: vec![PolicyReport {
                name: "g".into(),
                applied: 1,
                keys: keys
                    .into_iter()
                    .map(|(key, d)| KeyReport {
                        key,
                        demand: d,
                        want: Some(1.0),
                        release: None,
                        held: None,
                        freed: false,
                    })
                    .collect(),
            }],
        });
    (
        exchange,
        0usize..7,
        prop::collection::vec(any::<u8>(), 0..200),
    )
        .prop_map(|(mut msg, how, junk)| {
            let mut body = serde_json::to_vec(&msg).unwrap();
            let (region, secret, ts) = ("us", SECRET.as_bytes(), now_ms());
            let (what, signed) = match how {
                0 => ("no auth headers", None),
                1 => (
                    "wrong secret",
                    Some(auth::sign_request(
                        b"not-the-secret-at-all",
                        region,
                        "eu",
                        ts,
                        &body,
                    )),
                ),
                2 => (
                    "stale",
                    Some(auth::sign_request(
                        secret,
                        region,
                        "eu",
                        ts - 3_600_000,
                        &body,
                    )),
                ),
                3 => (
                    "unknown region",
                    Some(auth::sign_request(secret, "ap", "eu", ts, &body)),
                ),
                4 => {
                    let s = auth::sign_request(secret, region, "eu", ts, &body);
                    body = junk;
                    ("body not signed", Some(s))
                }
                5 => {
                    msg.incarnation = u64::MAX - msg.incarnation;
                    body = serde_json::to_vec(&msg).unwrap();
                    (
                        "absurd incarnation",
                        Some(auth::sign_request(secret, region, "eu", ts, &body)),
                    )
                }
                _ => {
                    let mut s = auth::sign_request(secret, region, "eu", ts, &body);
                    s.signature = hex_junk(&junk);
                    ("garbled signature", Some(s))
                }
            };
            let extra = match &signed {
                None => String::new(),
                Some(s) => s
                    .headers()
                    .iter()
                    .map(|(name, value)| format!("{name}: {value}\r\n"))
                    .collect(),
            };
            post(
                "/v1/peer/exchange",
                "application/json",
                &extra,
                body,
                format!("peer: {what}"),
            )
        })
}

fn hex_junk(bytes: &[u8]) -> String {
    bytes
        .iter()
        .take(40)
        .map(|b| format!("{b:02x}"))
        .collect::<String>()
}

/// Sends one request on its own connection: (status, body).
fn send(port: u16, raw: &Raw) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(raw.head.as_bytes()).expect("headers");
    let _ = s.write_all(&raw.body); // a refusal may come before the body is read
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_owned();
    (status, body)
}

/// Keys in Redis that are not the coordinator's own (its lock and token counter, and the
/// global policy's meta hash, fence and replication ID, which it writes every round: the
/// per-policy keys are the ones not ending in a user key's brace).
fn limiter_keys(redis: &RedisServer) -> Vec<String> {
    redis
        .keys()
        .into_iter()
        .filter(|k| !k.starts_with("rl:coordinator:"))
        .filter(|k| !k.starts_with("rl:g:g:{rl:g}:") || k.ends_with('}'))
        .collect()
}

#[test]
fn generated_hostile_requests_get_4xx_write_nothing_and_never_5xx() {
    assert!(
        ADMIN.contains(common::ADMIN_TOKEN),
        "the kit's admin token changed"
    );
    let redis = RedisServer::start();
    let q = Quotad::serve(&config(&redis));
    wait_for("eu to coordinate", Duration::from_secs(10), || {
        (q.json("/v1/status")["coordinator"]["leader"] == true).then_some(())
    });
    assert_eq!(limiter_keys(&redis), Vec::<String>::new());

    let port = q.port;
    let mut runner = TestRunner::new(Config {
        cases: 10_000,
        failure_persistence: None,
        ..Config::default()
    });
    let strategy = prop_oneof![4 => bad_client_request(), 1 => bad_peer_request()];
    runner
        .run(&strategy, |raw| {
            let (status, body) = send(port, &raw);
            if !(400..500).contains(&status) {
                return Err(TestCaseError::fail(format!(
                    "{}: status {status}, body {body}",
                    raw.what
                )));
            }
            // The error shape, where there is a body (431 and friends come from the HTTP
            // layer itself, without one).
            if !body.is_empty() {
                let v: Value = serde_json::from_str(&body)
                    .map_err(|e| TestCaseError::fail(format!("{}: {e}: {body}", raw.what)))?;
                prop_assert!(v["error"]["code"].is_string(), "{}: {body}", raw.what);
            }
            Ok(())
        })
        .unwrap();
    assert_eq!(
        limiter_keys(&redis),
        Vec::<String>::new(),
        "10,000 rejected requests wrote to Redis"
    );
    assert_eq!(
        q.metric("quotad_decisions_total{outcome=\"allowed\",policy=\"fw\"}"),
        0.0
    );

    // Valid requests, generated too: always answered, never a 5xx.
    let valid = prop_oneof![
        4 => valid_check().prop_map(|(p, k, c)| post(
            "/v1/check", "application/json", "",
            json!({"policy": p, "key": k, "cost": c}).to_string().into_bytes(), "check".into())),
        1 => prop::collection::vec(valid_check(), 1..10).prop_map(|cs| post(
            "/v1/check", "application/json", "",
            json!({"checks": cs.iter().map(|(p, k, c)| json!({"policy": p, "key": k, "cost": c})).collect::<Vec<_>>()})
                .to_string().into_bytes(), "batch".into())),
        1 => valid_check().prop_map(|(p, k, _)| post(
            "/v1/reset", "application/json", ADMIN,
            json!({"policy": p, "key": k}).to_string().into_bytes(), "reset".into())),
    ];
    let mut runner = TestRunner::new(Config {
        cases: 2_000,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&valid, |raw| {
            let (status, body) = send(port, &raw);
            prop_assert!(
                status == 200 || status == 204,
                "{}: {status} {body}",
                raw.what
            );
            Ok(())
        })
        .unwrap();
    let log = q.log();
    assert!(!log.contains("panicked"), "{log}");
    assert_eq!(q.get("/healthz").0, 200);
    redis.assert_every_key_has_ttl();
}
