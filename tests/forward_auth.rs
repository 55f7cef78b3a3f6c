//! Forward-auth (`/v1/authz/{policy}`) for proxies: the contract tested directly (as
//! Traefik's `forwardAuth` would call it), then through a real nginx (`auth_request`) and
//! a real Caddy (`forward_auth`), each in front of a tiny upstream, started by the test on
//! free loopback ports.

use quotad_testkit as common;

use common::edge::{Edge, UPSTREAM_BODY};
use common::{Config, Policy, Quotad, RedisServer, request};
use serde_json::Value;

const LIMIT: u64 = 3;
/// The limit of the key "premium" (an override of `edge`).
const PREMIUM: u64 = 6;

/// `edge` (API key, denied with `denied`), `ip` (the client address one proxy saw; no
/// address: allowed), `anon` (no key: counted as "anonymous").
fn config(redis: &RedisServer, denied: u16) -> String {
    let fixed =
        |name: &str| Policy::new(name, "fixed_window", LIMIT, "1h").on_store_error("closed");
    let api_key = ["header:x-api-key"];
    Config::redis(&redis.url())
        .policy(
            fixed("edge")
                .forward_auth(&api_key, "deny", denied)
                .with_override("key", "premium", PREMIUM),
        )
        .policy(fixed("ip").forward_auth(&["client_ip"], "allow", denied))
        .policy(fixed("anon").forward_auth(&api_key, "key:anonymous", denied))
        .policy(fixed("plain"))
        .to_toml()
}

fn get(port: u16, path: &str, headers: &[(&str, &str)]) -> (u16, Vec<(String, String)>, String) {
    request(port, "GET", path, headers, "").expect("http")
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

#[test]
fn the_contract_a_proxy_relies_on() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&config(&redis, 429));
    let key = [("x-api-key", "k1")];
    for i in 1..=LIMIT {
        let (status, h, body) = get(q.port, "/v1/authz/edge", &key);
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["remaining"], LIMIT - i);
        assert!(
            header(&h, "ratelimit").is_some_and(|r| r.contains("\"edge\"")),
            "{h:?}"
        );
    }
    // Any method, no body: the proxy asks about the request it holds.
    let (status, h, _) = request(q.port, "POST", "/v1/authz/edge", &key, "").unwrap();
    assert_eq!(status, 429);
    let retry: u64 = header(&h, "retry-after").unwrap().parse().unwrap();
    assert!(retry >= 1, "{h:?}");
    assert!(header(&h, "ratelimit").is_some(), "{h:?}");
    assert_eq!(
        get(q.port, "/v1/authz/edge", &[("x-api-key", "k2")]).0,
        200,
        "another key"
    );

    // No key: the configured answer, never a 5xx, and nothing written.
    let before = redis.keys().len();
    let (status, _, body) = get(q.port, "/v1/authz/edge", &[]);
    assert_eq!(status, 429, "deny: {body}");
    assert_eq!(get(q.port, "/v1/authz/ip", &[]).0, 200, "allow");
    assert_eq!(redis.keys().len(), before);
    for _ in 0..LIMIT {
        assert_eq!(get(q.port, "/v1/authz/anon", &[]).0, 200);
    }
    assert_eq!(
        get(q.port, "/v1/authz/anon", &[]).0,
        429,
        "keyless requests share a key"
    );
    // Every keyless request counted, by the answer it got: deny and allow decide nothing.
    let missing = |policy: &str, answer: &str| {
        q.metric(&format!(
            "quotad_forward_auth_missing_key_total{{answer=\"{answer}\",policy=\"{policy}\"}}"
        ))
    };
    assert_eq!(missing("edge", "deny"), 1.0);
    assert_eq!(missing("ip", "allow"), 1.0);
    assert_eq!(missing("anon", "key"), (LIMIT + 1) as f64);
    let too_long = "k".repeat(1000); // over server.max_key_bytes (512)
    assert_eq!(
        get(q.port, "/v1/authz/edge", &[("x-api-key", &too_long)]).0,
        429
    );
    assert_eq!(
        missing("edge", "deny"),
        2.0,
        "a key too long to be one is missing"
    );

    // The client address the trusted proxy appended; what the client sent is not trusted.
    for spoof in ["6.6.6.6", "7.7.7.7", "8.8.8.8"] {
        let xff = format!("{spoof}, 203.0.113.7");
        assert_eq!(
            get(q.port, "/v1/authz/ip", &[("x-forwarded-for", &xff)]).0,
            200
        );
    }
    let xff = [("x-forwarded-for", "9.9.9.9, 203.0.113.7")];
    assert_eq!(
        get(q.port, "/v1/authz/ip", &xff).0,
        429,
        "one client, whatever it claims"
    );
    assert_eq!(
        get(q.port, "/v1/authz/ip", &[("x-real-ip", "198.51.100.1")]).0,
        200
    );

    // A policy that does not exist, or has no [policy.forward_auth]: 4xx naming it.
    let (status, _, body) = get(q.port, "/v1/authz/nope", &key);
    assert_eq!(status, 404, "{body}");
    let (status, _, body) = get(q.port, "/v1/authz/plain", &key);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("forward_auth"), "{body}");
    redis.assert_every_key_has_ttl();
}

/// Through a proxy at `edge`: the first LIMIT requests of a key reach the upstream, the
/// next is a 429 with Retry-After at the client; another key is unaffected; no key: 429;
/// the premium key (an override) gets its own limit.
fn through(edge: &Edge) {
    let key = [("x-api-key", "alice")];
    for _ in 0..LIMIT {
        let (status, _, body) = get(edge.port, "/orders", &key);
        assert_eq!((status, body.as_str()), (200, UPSTREAM_BODY));
    }
    let (status, h, body) = get(edge.port, "/orders", &key);
    assert_eq!(status, 429, "{body}");
    let retry: u64 = header(&h, "retry-after")
        .expect("Retry-After")
        .parse()
        .unwrap();
    assert!(retry >= 1);
    assert!(
        header(&h, "ratelimit").is_some_and(|r| r.contains("\"edge\"")),
        "{h:?}"
    );
    let (status, _, body) = get(edge.port, "/orders", &[("x-api-key", "bob")]);
    assert_eq!((status, body.as_str()), (200, UPSTREAM_BODY), "another key");
    let (status, _, _) = get(edge.port, "/orders", &[]);
    assert_eq!(status, 429, "no key: denied as configured");
    let premium = [("x-api-key", "premium")];
    let statuses: Vec<u16> = (0..=PREMIUM)
        .map(|_| get(edge.port, "/orders", &premium).0)
        .collect();
    let mut want = vec![200; PREMIUM as usize];
    want.push(429);
    assert_eq!(statuses, want, "the premium key's own limit");
}

#[test]
fn nginx_auth_request_enforces_the_limit() {
    let redis = RedisServer::start();
    // nginx's auth_request passes on 2xx, 401 and 403 only: quotad denies with 403 and
    // nginx turns it into a 429 (testkit::edge).
    let q = Quotad::serve(&config(&redis, 403));
    let nginx = Edge::nginx(q.port, "edge");
    through(&nginx);
}

#[test]
fn caddy_forward_auth_enforces_the_limit() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&config(&redis, 429));
    let caddy = Edge::caddy(q.port, "edge");
    through(&caddy);
}

/// What the client writes cannot choose its key: with a trusted `X-Forwarded-For` entry
/// that is not an address, the client's `X-Real-IP` is not read (the request has no
/// client address: `ip` answers its `on_missing_key`, allow, without counting anyone);
/// an IPv4 address written as IPv6 is the same client. A path that is not UTF-8 is a
/// JSON error naming the field.
#[test]
fn the_client_cannot_choose_its_address_key() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&config(&redis, 429));
    // Spend the victim's whole budget through a spoofed X-Real-IP: none of it may land.
    let spoof = [
        ("x-forwarded-for", "unknown"),
        ("x-real-ip", "198.51.100.7"),
    ];
    for _ in 0..(LIMIT + 2) {
        let (status, _, body) = get(q.port, "/v1/authz/ip", &spoof);
        assert_eq!(status, 200, "{body}");
        assert!(body.contains("missing_key"), "no address, no key: {body}");
    }
    let victim = [("x-forwarded-for", "198.51.100.7")];
    let (status, _, body) = get(q.port, "/v1/authz/ip", &victim);
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["remaining"],
        LIMIT - 1,
        "the victim's budget is whole: {v}"
    );
    // ::ffff:198.51.100.7 is the same client.
    let mapped = [("x-forwarded-for", "::ffff:198.51.100.7")];
    let (_, _, body) = get(q.port, "/v1/authz/ip", &mapped);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["key"], "198.51.100.7", "{v}");
    assert_eq!(v["remaining"], LIMIT - 2, "{v}");

    let (status, h, body) = get(q.port, "/v1/authz/%FF", &[]);
    assert_eq!(status, 400, "{body}");
    assert_eq!(header(&h, "content-type"), Some("application/json"));
    let v: Value = serde_json::from_str(&body).expect("a JSON error");
    assert_eq!(v["error"]["field"], "policy", "{v}");
}
