//! docs/openapi.json is the HTTP contract: it declares OpenAPI 3.1 and every `$ref` in it
//! resolves; each documented request shape, sent to a running daemon, gets a documented
//! status and a body of the documented shape; every documented (route, method, status)
//! is exercised here or named below with the test that does; routes it does not list
//! answer 404.

use quotad_testkit as common;

use std::collections::BTreeSet;

use common::federation::{eu_with_silent_us, even_escrow};
use common::{Policy, Quotad, RedisServer, request};
use serde_json::{Value, json};

fn spec() -> Value {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/openapi.json"))
        .expect("docs/openapi.json");
    serde_json::from_str(&text).expect("the spec is JSON")
}

fn resolve<'a>(spec: &'a Value, v: &'a Value) -> &'a Value {
    match v.get("$ref").and_then(Value::as_str) {
        Some(r) => {
            let pointer = r.strip_prefix('#').expect("local $ref");
            let target = spec
                .pointer(pointer)
                .unwrap_or_else(|| panic!("unresolved $ref {r}"));
            resolve(spec, target)
        }
        None => v,
    }
}

/// Every `$ref` anywhere in the spec points at something.
fn all_refs_resolve(spec: &Value, v: &Value) {
    match v {
        Value::Object(m) => {
            if m.contains_key("$ref") {
                resolve(spec, v);
            }
            m.values().for_each(|x| all_refs_resolve(spec, x));
        }
        Value::Array(a) => a.iter().for_each(|x| all_refs_resolve(spec, x)),
        _ => {}
    }
}

/// The JSON Schema keywords the spec uses: type (a name or a list), required, properties,
/// items, enum, oneOf.
fn conforms(spec: &Value, schema: &Value, v: &Value) -> Result<(), String> {
    let schema = resolve(spec, schema);
    if let Some(alts) = schema.get("oneOf").and_then(Value::as_array) {
        return match alts.iter().filter(|s| conforms(spec, s, v).is_ok()).count() {
            0 => Err(format!("{v} matches none of oneOf")),
            _ => Ok(()),
        };
    }
    if let Some(values) = schema.get("enum").and_then(Value::as_array) {
        if !values.contains(v) {
            return Err(format!("{v} not in {values:?}"));
        }
    }
    let is = |t: &str| match t {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "integer" => v.is_u64() || v.is_i64(),
        "number" => v.is_number(),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        _ => true,
    };
    // `type` is a name, or (3.1) a list of them: `["object", "null"]`.
    let ok = match schema.get("type") {
        Some(Value::String(t)) => is(t),
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).any(is),
        _ => true,
    };
    if !ok {
        return Err(format!("{v} is not a {}", schema["type"]));
    }
    if v.is_null() {
        return Ok(());
    }
    for r in schema
        .get("required")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let name = r.as_str().unwrap();
        if v.get(name).is_none() {
            return Err(format!("missing {name} in {v}"));
        }
    }
    if let (Some(props), Some(obj)) = (
        schema.get("properties").and_then(Value::as_object),
        v.as_object(),
    ) {
        for (k, s) in props {
            if let Some(x) = obj.get(k) {
                conforms(spec, s, x).map_err(|e| format!("{k}: {e}"))?;
            }
        }
    }
    if let (Some(items), Some(arr)) = (schema.get("items"), v.as_array()) {
        for x in arr {
            conforms(spec, items, x)?;
        }
    }
    Ok(())
}

struct Case {
    method: &'static str,
    path: &'static str,
    /// The spec's path template.
    route: &'static str,
    headers: Vec<(&'static str, &'static str)>,
    body: Value,
}

/// `Bearer` and the kit's admin token, for the admin endpoints.
const ADMIN_BEARER: &str = "Bearer tests-admin-token-0123456789";

fn case(method: &'static str, path: &'static str, route: &'static str, body: Value) -> Case {
    let mut headers = if body.is_null() {
        vec![]
    } else {
        vec![("content-type", "application/json")]
    };
    if common::ADMIN_PATHS.contains(&path) {
        headers.push(("authorization", ADMIN_BEARER));
    }
    Case {
        method,
        path,
        route,
        headers,
        body,
    }
}

/// Documented, and tested elsewhere (they need a signed peer, a killed Redis, a draining
/// or overloaded daemon, or a slow client).
const ELSEWHERE: &[(&str, &str, &str, &str)] = &[
    (
        "/v1/check",
        "post",
        "408",
        "tests/bad_input.rs (a body that stops arriving)",
    ),
    (
        "/v1/check",
        "post",
        "503",
        "tests/overload.rs (shed with Retry-After)",
    ),
    ("/readyz", "get", "503", "tests/shutdown.rs (draining)"),
    (
        "/v1/usage/{policy}/{key}",
        "get",
        "503",
        "tests/usage.rs (a read of a Redis that is gone)",
    ),
    (
        "/v1/usage",
        "post",
        "408",
        "tests/bad_input.rs (a body that stops arriving: the same reader as /v1/check)",
    ),
    (
        "/v1/usage",
        "post",
        "503",
        "tests/usage.rs (a read of a Redis that is gone)",
    ),
    (
        "/v1/acquire",
        "post",
        "503",
        "the same shedding as /v1/check (tests/overload.rs)",
    ),
    (
        "/v1/charge",
        "post",
        "503",
        "the same shedding as /v1/check (tests/overload.rs)",
    ),
    (
        "/v1/authz/{policy}",
        "*",
        "503",
        "the same shedding as /v1/check (tests/overload.rs)",
    ),
];

#[test]
fn the_spec_is_the_contract() {
    assert!(
        ADMIN_BEARER.ends_with(common::ADMIN_TOKEN),
        "the kit's admin token changed"
    );
    let spec = spec();
    assert_eq!(spec["openapi"], "3.1.0");
    // Every operation has an operationId, unique (what client generators name methods by).
    let mut ids = BTreeSet::new();
    for (route, item) in spec["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            if method == "parameters" {
                continue;
            }
            let id = op["operationId"].as_str();
            assert!(
                id.is_some_and(|id| ids.insert(id.to_owned())),
                "{method} {route}: {id:?}"
            );
        }
    }
    all_refs_resolve(&spec, &spec);

    let mut redis = RedisServer::start();
    let config = eu_with_silent_us(&redis.url(), "0123456789abcdef")
        .policy(Policy::new("api", "fixed_window", 1, "1h").forward_auth(
            &["header:x-api-key"],
            "deny",
            429,
        ))
        .policy(Policy::new("g", "token_bucket", 100, "1s").global(even_escrow()))
        .policy(Policy::new("metered", "token_bucket", 100, "1s").set("settle_within", "1m"))
        .policy(Policy::new("streams", "concurrency", 5, "1m"))
        .policy(Policy::new("plan", "fixed_window", 10, "1h").runtime_limits(1))
        .to_toml();
    let q = Quotad::serve(&config);
    let (_, _, acquired) = q.post("/v1/acquire", &json!({"policy": "streams", "key": "s"}));
    let lease = acquired["lease"].clone();
    let (_, _, extended) = q.post("/v1/acquire", &json!({"policy": "streams", "key": "s"}));
    let held = |lease: &Value| json!({"policy": "streams", "key": "s", "lease": lease});
    let nobody = json!("0123456789abcdef0123456789abcdef-1");
    let big = "x".repeat(70_000);
    let (_, _, reserved) = q.post(
        "/v1/check",
        &json!({"policy": "metered", "key": "m", "cost": 5, "settle": true}),
    );
    let reservation = reserved["reservation"].clone();
    let settle =
        |id: &Value| json!({"policy": "metered", "key": "m", "reservation": id, "cost": 8});
    let mut cases = vec![
        case(
            "POST",
            "/v1/check",
            "/v1/check",
            json!({"policy": "api", "key": "a"}),
        ),
        case(
            "POST",
            "/v1/check",
            "/v1/check",
            json!({"checks": [{"policy": "api", "key": "b"}, {"policy": "api", "key": "b2", "group": "t"}]}),
        ),
        case("POST", "/v1/check", "/v1/check", json!({"policy": "api"})),
        case(
            "POST",
            "/v1/check",
            "/v1/check",
            json!({"policy": "nope", "key": "a"}),
        ),
        case(
            "POST",
            "/v1/check",
            "/v1/check",
            json!({"policy": "api", "key": big}),
        ),
        case(
            "POST",
            "/v1/reset",
            "/v1/reset",
            json!({"policy": "api", "key": "a"}),
        ),
        case("POST", "/v1/reset", "/v1/reset", json!({"policy": "api"})),
        case(
            "POST",
            "/v1/reset",
            "/v1/reset",
            json!({"policy": "nope", "key": "a"}),
        ),
        case(
            "POST",
            "/v1/check",
            "/v1/check",
            json!({"policy": "metered", "key": "m2", "cost": 5, "settle": true}),
        ),
        case("POST", "/v1/settle", "/v1/settle", settle(&reservation)),
        case(
            "POST",
            "/v1/charge",
            "/v1/charge",
            json!({"policy": "metered", "key": "m", "cost": 250}),
        ),
        case(
            "POST",
            "/v1/charge",
            "/v1/charge",
            json!({"policy": "metered", "key": "m"}),
        ),
        case(
            "POST",
            "/v1/charge",
            "/v1/charge",
            json!({"policy": "nope", "key": "m", "cost": 1}),
        ),
        case(
            "POST",
            "/v1/settle",
            "/v1/settle",
            settle(&json!("0123456789abcdef0123456789abcdef")),
        ),
        case(
            "POST",
            "/v1/settle",
            "/v1/settle",
            json!({"policy": "metered", "key": "m", "cost": 1}),
        ),
        case(
            "POST",
            "/v1/acquire",
            "/v1/acquire",
            json!({"policy": "streams", "key": "s", "units": 2}),
        ),
        case(
            "POST",
            "/v1/acquire",
            "/v1/acquire",
            json!({"policy": "streams", "key": "s", "units": 0}),
        ),
        case(
            "POST",
            "/v1/acquire",
            "/v1/acquire",
            json!({"policy": "nope", "key": "s"}),
        ),
        case("POST", "/v1/release", "/v1/release", held(&lease)),
        case("POST", "/v1/release", "/v1/release", held(&json!("x"))),
        case("POST", "/v1/release", "/v1/release", held(&nobody)),
        case("POST", "/v1/extend", "/v1/extend", held(&extended["lease"])),
        case("POST", "/v1/extend", "/v1/extend", held(&json!("x"))),
        case("POST", "/v1/extend", "/v1/extend", held(&nobody)),
        case("GET", "/v1/policies", "/v1/policies", Value::Null),
        case("GET", "/v1/status", "/v1/status", Value::Null),
        case("GET", "/healthz", "/healthz", Value::Null),
        case("GET", "/readyz", "/readyz", Value::Null),
        case("GET", "/metrics", "/metrics", Value::Null),
    ];
    // 415: not JSON.
    let mut c = case("POST", "/v1/check", "/v1/check", json!("x"));
    c.headers = vec![("content-type", "text/plain")];
    cases.push(c);
    let mut c = case("POST", "/v1/reset", "/v1/reset", json!("x"));
    c.headers = vec![
        ("content-type", "text/plain"),
        ("authorization", ADMIN_BEARER),
    ];
    cases.push(c);
    // 401: an admin endpoint without its token.
    let mut c = case(
        "POST",
        "/v1/reset",
        "/v1/reset",
        json!({"policy": "api", "key": "a"}),
    );
    c.headers = vec![("content-type", "application/json")];
    cases.push(c);
    for path in [
        "/v1/settle",
        "/v1/charge",
        "/v1/acquire",
        "/v1/release",
        "/v1/extend",
    ] {
        let mut c = case("POST", path, path, json!("x"));
        c.headers = vec![("content-type", "text/plain")];
        cases.push(c);
    }
    // The runtime limits: set, refused, full, read, listed, deleted (in this order).
    const LIMIT: &str = "/v1/limits/{policy}/{key}";
    const LIMITS: &str = "/v1/limits/{policy}";
    let admin = |method, path, route, body: Value| {
        let mut c = case(method, path, route, body);
        c.headers.push(("authorization", ADMIN_BEARER));
        c
    };
    let no_token = |method, path, route, body: Value| case(method, path, route, body);
    let mut plain_text = admin("PUT", "/v1/limits/plan/a", LIMIT, json!("x"));
    plain_text.headers[0] = ("content-type", "text/plain");
    cases.extend([
        admin("PUT", "/v1/limits/plan/a", LIMIT, json!({"limit": 50})),
        admin("PUT", "/v1/limits/plan/a", LIMIT, json!({"limit": 0})),
        admin("PUT", "/v1/limits/plan/b", LIMIT, json!({"limit": 50})),
        admin("PUT", "/v1/limits/nope/a", LIMIT, json!({"limit": 50})),
        no_token("PUT", "/v1/limits/plan/a", LIMIT, json!({"limit": 50})),
        plain_text,
        admin("GET", "/v1/limits/plan/a", LIMIT, Value::Null),
        admin("GET", "/v1/limits/plan/zz", LIMIT, Value::Null),
        admin("GET", "/v1/limits/api/a", LIMIT, Value::Null),
        no_token("GET", "/v1/limits/plan/a", LIMIT, Value::Null),
        admin("GET", "/v1/limits/plan", LIMITS, Value::Null),
        admin("GET", "/v1/limits/plan?count=0", LIMITS, Value::Null),
        admin("GET", "/v1/limits/nope", LIMITS, Value::Null),
        no_token("GET", "/v1/limits/plan", LIMITS, Value::Null),
        admin("DELETE", "/v1/limits/plan/a", LIMIT, Value::Null),
        admin("DELETE", "/v1/limits/plan/a", LIMIT, Value::Null),
        admin("DELETE", "/v1/limits/api/a", LIMIT, Value::Null),
        no_token("DELETE", "/v1/limits/plan/a", LIMIT, Value::Null),
    ]);
    // Usage: one key (a local and a global policy's), refused, and several at once.
    const USAGE_KEY: &str = "/v1/usage/{policy}/{key}";
    let mut usage_text = case("POST", "/v1/usage", "/v1/usage", json!("x"));
    usage_text.headers = vec![("content-type", "text/plain")];
    cases.extend([
        case("GET", "/v1/usage/plan/a", USAGE_KEY, Value::Null),
        case("GET", "/v1/usage/g/a", USAGE_KEY, Value::Null),
        case("GET", "/v1/usage/nope/a", USAGE_KEY, Value::Null),
        case("GET", "/v1/usage/streams/a", USAGE_KEY, Value::Null),
        case(
            "POST",
            "/v1/usage",
            "/v1/usage",
            json!({"keys": [{"policy": "plan", "key": "a"}, {"policy": "metered", "key": "m"}]}),
        ),
        case("POST", "/v1/usage", "/v1/usage", json!({"keys": []})),
        case(
            "POST",
            "/v1/usage",
            "/v1/usage",
            json!({"keys": [{"policy": "nope", "key": "a"}]}),
        ),
        case(
            "POST",
            "/v1/usage",
            "/v1/usage",
            json!({"keys": [{"policy": "plan", "key": big}]}),
        ),
        usage_text,
    ]);
    for m in ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"] {
        let route = "/v1/authz/{policy}";
        let key: &'static str = Box::leak(format!("k-{m}").into_boxed_str());
        let mut ok = case(m, "/v1/authz/api", route, Value::Null);
        ok.headers = vec![("x-api-key", key)];
        cases.push(ok); // allowed
        let mut over = case(m, "/v1/authz/api", route, Value::Null);
        over.headers = vec![("x-api-key", key)];
        cases.push(over); // denied: the limit is 1
        cases.push(case(m, "/v1/authz/api", route, Value::Null)); // no key: deny
        cases.push(case(m, "/v1/authz/nope", route, Value::Null)); // 404
        cases.push(case(m, "/v1/authz/g", route, Value::Null)); // no forward_auth: 400
    }

    let mut covered = BTreeSet::new();
    for c in &cases {
        let body = if c.body.is_null() {
            String::new()
        } else {
            c.body.to_string()
        };
        let (status, _, text) = request(q.port, c.method, c.path, &c.headers, &body).expect("http");
        let method = c.method.to_ascii_lowercase();
        let op = &spec["paths"][c.route][&method];
        assert!(op.is_object(), "{} {} is not documented", c.method, c.route);
        let code = status.to_string();
        let range = format!("{}XX", status / 100);
        let key = if op["responses"].get(&code).is_some() {
            code
        } else {
            range
        };
        let documented = op["responses"].get(&key).unwrap_or_else(|| {
            panic!(
                "{} {} answered {status}, not documented: {text}",
                c.method, c.path
            )
        });
        let documented = resolve(&spec, documented);
        if let Some(schema) = documented.pointer("/content/application~1json/schema") {
            if c.method != "HEAD" {
                let v: Value = serde_json::from_str(&text)
                    .unwrap_or_else(|_| panic!("{} {}: not JSON: {text}", c.method, c.path));
                conforms(&spec, schema, &v)
                    .unwrap_or_else(|e| panic!("{} {} {status}: {e}", c.method, c.path));
            }
        }
        covered.insert((c.route.to_owned(), method, key));
    }
    // Without a global policy there is no peer endpoint.
    let plain = Quotad::serve(
        &common::Config::redis(&redis.url())
            .policy(Policy::new("api", "fixed_window", 1, "1h"))
            .policy(Policy::new("metered", "token_bucket", 100, "1s").set("settle_within", "1m"))
            .policy(Policy::new("streams", "concurrency", 5, "1m"))
            .to_toml(),
    );
    // The peer exchange is the regions' own protocol (docs/global-budgets.md), not in the
    // public spec: without a global policy it does not exist either.
    assert!(spec["paths"].get("/v1/peer/exchange").is_none());
    let (status, _, text) = request(plain.port, "POST", "/v1/peer/exchange", &[], "{}").unwrap();
    assert_eq!(status, 404, "{text}");

    // Redis gone: a reset cannot be done, and says so.
    redis.kill();
    let reset = json!({"policy": "api", "key": "a"}).to_string();
    let json_ct = [
        ("content-type", "application/json"),
        ("authorization", ADMIN_BEARER),
    ];
    let text = common::wait_for(
        "the store to be down",
        std::time::Duration::from_secs(10),
        || {
            let (status, _, text) =
                request(plain.port, "POST", "/v1/reset", &json_ct, &reset).unwrap();
            (status == 503).then_some(text)
        },
    );
    let err = resolve(
        &spec,
        &spec["paths"]["/v1/reset"]["post"]["responses"]["503"],
    );
    let schema = err.pointer("/content/application~1json/schema").unwrap();
    conforms(&spec, schema, &serde_json::from_str(&text).unwrap()).unwrap();
    covered.insert(("/v1/reset".into(), "post".into(), "503".into()));
    // And a settlement cannot be made: nothing changed, and a retry is safe.
    let (status, _, text) = request(
        plain.port,
        "POST",
        "/v1/settle",
        &json_ct,
        &settle(&reservation).to_string(),
    )
    .unwrap();
    assert_eq!(status, 503, "{text}");
    let err = resolve(
        &spec,
        &spec["paths"]["/v1/settle"]["post"]["responses"]["503"],
    );
    let schema = err.pointer("/content/application~1json/schema").unwrap();
    conforms(&spec, schema, &serde_json::from_str(&text).unwrap()).unwrap();
    covered.insert(("/v1/settle".into(), "post".into(), "503".into()));
    // Nor a release or an extend.
    for path in ["/v1/release", "/v1/extend"] {
        let (status, _, text) = request(
            plain.port,
            "POST",
            path,
            &json_ct,
            &held(&lease).to_string(),
        )
        .unwrap();
        assert_eq!(status, 503, "{path}: {text}");
        let err = resolve(&spec, &spec["paths"][path]["post"]["responses"]["503"]);
        let schema = err.pointer("/content/application~1json/schema").unwrap();
        conforms(&spec, schema, &serde_json::from_str(&text).unwrap()).unwrap();
        covered.insert((path.into(), "post".into(), "503".into()));
    }

    // Nor a runtime limit set, read, listed or deleted.
    let limits_on = Quotad::serve(
        &common::Config::redis(&redis.url())
            .policy(Policy::new("plan", "fixed_window", 10, "1h").runtime_limits(10))
            .to_toml(),
    );
    for (method, path, route, body) in [
        ("PUT", "/v1/limits/plan/a", LIMIT, r#"{"limit": 5}"#),
        ("GET", "/v1/limits/plan/a", LIMIT, ""),
        ("DELETE", "/v1/limits/plan/a", LIMIT, ""),
        ("GET", "/v1/limits/plan", LIMITS, ""),
    ] {
        let (status, _, text) = request(limits_on.port, method, path, &json_ct, body).unwrap();
        assert_eq!(status, 503, "{method} {path}: {text}");
        let m = method.to_ascii_lowercase();
        let err = resolve(&spec, &spec["paths"][route][&m]["responses"]["503"]);
        let schema = err.pointer("/content/application~1json/schema").unwrap();
        conforms(&spec, schema, &serde_json::from_str(&text).unwrap()).unwrap();
        covered.insert((route.into(), m, "503".into()));
    }

    let elsewhere = |route: &str, method: &str, status: &str| {
        ELSEWHERE
            .iter()
            .any(|(r, m, s, _)| *r == route && (*m == method || *m == "*") && *s == status)
    };
    for (route, item) in spec["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let Some(responses) = op.get("responses").and_then(Value::as_object) else {
                continue;
            };
            for status in responses.keys() {
                let k = (route.clone(), method.clone(), status.clone());
                assert!(
                    covered.contains(&k) || elsewhere(route, method, status),
                    "{method} {route} {status} is documented but exercised nowhere"
                );
            }
        }
    }

    // What the spec does not list does not exist.
    for path in [
        "/v1/nope",
        "/v2/check",
        "/v1/check/x",
        "/v1/authz",
        "/v1/authz/api/x",
        "/",
    ] {
        let (status, _, text) = request(q.port, "GET", path, &[], "").unwrap();
        assert_eq!(status, 404, "{path}: {text}");
        assert!(spec["paths"].get(path).is_none());
    }
}
