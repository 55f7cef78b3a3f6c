//! Per-key overrides (`[[policy.override]]`): a key named exactly, by prefix or by glob gets
//! its own limit, for HTTP checks (single and batch) and forward-auth alike; the others keep
//! the policy's. `GET /v1/policies` lists them.

use quotad_testkit as common;

use common::{Config, Policy, Quotad, RedisServer, request};
use serde_json::json;

fn hex_sha256(s: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(s.as_bytes()))
}

fn allowed_in_a_row(q: &Quotad, key: &str) -> usize {
    (0..20)
        .take_while(|_| q.check1("api", key)["allowed"] == true)
        .count()
}

#[test]
fn overridden_keys_get_their_own_limits() {
    let redis = RedisServer::start();
    let config = Config::redis(&redis.url())
        .policy(
            Policy::new("api", "fixed_window", 3, "1h")
                .with_override("key", "premium-1", 10)
                .with_override("prefix", "gold-", 5)
                .with_override("glob", "*-trial", 1)
                // An exact key wins over an earlier prefix or glob that matches it too.
                .with_override("key", "gold-vip", 7)
                .forward_auth(&["header:x-api-key"], "deny", 429),
        )
        .to_toml();
    let q = Quotad::serve(&config);
    assert_eq!(allowed_in_a_row(&q, "premium-1"), 10);
    assert_eq!(allowed_in_a_row(&q, "gold-a"), 5);
    assert_eq!(allowed_in_a_row(&q, "gold-vip"), 7);
    assert_eq!(allowed_in_a_row(&q, "acme-trial"), 1);
    assert_eq!(allowed_in_a_row(&q, "plain"), 3);
    let d = q.check1("api", "gold-b");
    assert_eq!(
        (&d["limit"], &d["limit_source"]),
        (&json!(5), &json!("override")),
        "the decision reports the override's limit and says so: {d}"
    );
    for key in ["premium-1", "gold-vip", "acme-trial"] {
        assert_eq!(q.check1("api", key)["limit_source"], "override", "{key}");
    }
    assert_eq!(q.check1("api", "plain")["limit_source"], "config");

    // A batch, and forward-auth, see the same limits.
    let (status, _, body) = q.post(
        "/v1/check",
        &json!({"checks": [{"policy": "api", "key": "gold-c"}, {"policy": "api", "key": "gold-d"}]}),
    );
    assert_eq!(status, 200);
    assert!(
        body["results"]
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d["limit"] == 5 && d["limit_source"] == "override")
    );
    let authz = |key: &str| {
        request(q.port, "GET", "/v1/authz/api", &[("x-api-key", key)], "")
            .unwrap()
            .0
    };
    let statuses: Vec<u16> = (0..11).map(|_| authz("premium-2")).collect();
    assert_eq!(
        statuses,
        [200, 200, 200, 429, 429, 429, 429, 429, 429, 429, 429]
    );
    assert_eq!(
        authz("premium-1"),
        429,
        "spent over HTTP above: one key, one count"
    );

    // A cost is bounded by the override's capacity, not the policy's.
    let (status, _, body) = q.post(
        "/v1/check",
        &json!({"policy": "api", "key": "gold-e", "cost": 5}),
    );
    assert_eq!(status, 200, "{body}");
    let (status, _, body) = q.post(
        "/v1/check",
        &json!({"policy": "api", "key": "plain2", "cost": 5}),
    );
    assert_eq!(status, 400, "{body}");

    let policies = q.json("/v1/policies");
    let listed = &policies["policies"][0]["overrides"];
    assert_eq!(listed.as_array().unwrap().len(), 4, "{listed}");
    // An exact key may be an API key: listed by its SHA-256 only, never as written.
    let premium_sha = hex_sha256("premium-1");
    assert_eq!(
        listed[0],
        json!({"key_sha256": premium_sha, "limit": 10, "window_ms": 3_600_000, "burst": 10})
    );
    let (_, text) = q.get("/v1/policies");
    assert!(
        !text.contains("premium-1") && !text.contains("gold-vip"),
        "exact override keys leak through /v1/policies: {text}"
    );
    assert_eq!(listed[1]["prefix"], "gold-");
    assert_eq!(listed[2]["glob"], "*-trial");
    redis.assert_every_key_has_ttl();
}

/// An override without `burst` keeps the policy's burst (docs/api.md): a premium key with
/// a higher rate must not get a smaller bucket than an ordinary key.
#[test]
fn an_override_without_burst_keeps_the_policys_burst() {
    let redis = RedisServer::start();
    let config = Config::redis(&redis.url())
        .policy(
            Policy::new("api", "token_bucket", 5, "1h")
                .burst(10)
                .with_override("key", "premium", 8),
        )
        .to_toml();
    let q = Quotad::serve(&config);
    assert_eq!(allowed_in_a_row(&q, "ordinary"), 10);
    assert_eq!(
        allowed_in_a_row(&q, "premium"),
        10,
        "the premium key's bucket holds the policy's burst, not its own limit"
    );
    let listed = &q.json("/v1/policies")["policies"][0]["overrides"][0];
    assert_eq!(listed["burst"], 10, "{listed}");
    assert_eq!(listed["limit"], 8, "{listed}");
}
