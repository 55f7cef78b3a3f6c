//! The RateLimit headers of `POST /v1/check` mean what draft-ietf-httpapi-ratelimit-headers
//! says (docs/api.md#headers has the table these tests check): `q` is the quota `r` counts
//! against, `w` whole seconds or absent, `t` the seconds within which `r` is all the client
//! can use (after a denial: until it could pass, the same number as `Retry-After`), one
//! list member per enforced policy of a batch, and `pk` a digest of policy and key.
//!
//! In-process daemons against a real Redis. The structured fields are parsed by hand: the
//! members are quoted policy names with integer and byte-sequence parameters.

use quotad_testkit as common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{Config, Policy, Quotad, RedisServer, wait_for};
use quotad_daemon::partition_key;
use serde_json::{Value, json};

/// One member of a RateLimit or RateLimit-Policy list: the policy name and its parameters.
#[derive(Debug, Clone, PartialEq)]
struct Member {
    name: String,
    params: BTreeMap<String, String>,
}

impl Member {
    fn int(&self, p: &str) -> u64 {
        self.params
            .get(p)
            .unwrap_or_else(|| panic!("no {p} in {self:?}"))
            .parse()
            .unwrap_or_else(|_| panic!("{p} is not an integer in {self:?}"))
    }
}

/// A structured-field List of `"name";k=v;...` members (RFC 9651, the subset quotad sends:
/// no commas or semicolons inside names, integers, or byte sequences).
fn parse_list(field: &str) -> Vec<Member> {
    field
        .split(',')
        .map(|m| {
            let mut parts = m.trim().split(';');
            let name = parts.next().unwrap();
            let name = name
                .strip_prefix('"')
                .and_then(|n| n.strip_suffix('"'))
                .unwrap_or_else(|| panic!("member {m:?} of {field:?} is not a string item"));
            let params = parts
                .map(|p| {
                    let (k, v) = p.split_once('=').unwrap_or((p, "?1"));
                    (k.to_owned(), v.to_owned())
                })
                .collect();
            Member {
                name: name.to_owned(),
                params,
            }
        })
        .collect()
}

/// The response's headers of interest.
struct Answer {
    body: Value,
    policy: Vec<Member>,
    limit: Vec<Member>,
    retry_after: Option<u64>,
    reset: Option<u64>,
}

fn check(q: &Quotad, body: &Value) -> Answer {
    let (status, headers, body) = q.post("/v1/check", body);
    assert_eq!(status, 200, "{body}");
    let h = |n| common::header(&headers, n).map(str::to_owned);
    let list = |n| parse_list(&h(n).unwrap_or_else(|| panic!("no {n}: {headers:?}")));
    Answer {
        policy: list("ratelimit-policy"),
        limit: list("ratelimit"),
        retry_after: h("retry-after").map(|v| v.parse().unwrap()),
        reset: h("ratelimit-reset").map(|v| v.parse().unwrap()),
        body,
    }
}

fn one(q: &Quotad, policy: &str, key: &str) -> Answer {
    check(q, &json!({"policy": policy, "key": key}))
}

/// What the table in docs/api.md says a policy reports: `q`, `w` (None: absent), and the
/// range `t` falls in after the first admission and after a denial.
struct Case {
    policy: Policy,
    name: &'static str,
    q: u64,
    w: Option<u64>,
    t_first: (u64, u64),
    t_denied: (u64, u64),
}

fn cases() -> Vec<Case> {
    vec![
        // Until the window's end (windows are aligned to the clock: anywhere in it).
        Case {
            policy: Policy::new("fw", "fixed_window", 3, "60s"),
            name: "fw",
            q: 3,
            w: Some(60),
            t_first: (1, 60),
            t_denied: (1, 60),
        },
        // Until the newest entry leaves; denied: until the oldest does.
        Case {
            policy: Policy::new("log", "sliding_log", 3, "60s"),
            name: "log",
            q: 3,
            w: Some(60),
            t_first: (59, 60),
            t_denied: (55, 60),
        },
        // Until both windows' weight is gone: the end of the next window.
        Case {
            policy: Policy::new("sw", "sliding_window", 3, "60s"),
            name: "sw",
            q: 3,
            w: Some(60),
            t_first: (61, 120),
            t_denied: (1, 120),
        },
        // q is the burst, 5, not the limit, 2; refilling 5 at 2 per 5 s takes 12.5 s: no w.
        // One token is back in 2.5 s: t after the first admission, and after the denial.
        Case {
            policy: Policy::new("tb", "token_bucket", 2, "5s").burst(5),
            name: "tb",
            q: 5,
            w: None,
            t_first: (3, 3),
            t_denied: (1, 3),
        },
        // q is the burst, 3; w the 30 s it takes to refill it; one unit every 10 s.
        Case {
            policy: Policy::new("gc", "gcra", 1, "10s").burst(3),
            name: "gc",
            q: 3,
            w: Some(30),
            t_first: (10, 10),
            t_denied: (9, 10),
        },
        // A sub-second window: no w (the draft has no way to say 100 ms), t rounded up to 1.
        Case {
            policy: Policy::new("fast", "fixed_window", 2, "100ms"),
            name: "fast",
            q: 2,
            w: None,
            t_first: (1, 1),
            t_denied: (1, 1),
        },
    ]
}

fn config(redis: &RedisServer) -> String {
    cases()
        .into_iter()
        .fold(Config::redis(&redis.url()), |c, case| c.policy(case.policy))
        .to_toml()
}

fn in_range(t: u64, (lo, hi): (u64, u64)) -> bool {
    (lo..=hi).contains(&t)
}

#[test]
fn every_algorithm_reports_its_q_w_r_and_t() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&config(&redis));
    for case in cases() {
        let name = case.name;
        let key = format!("user-{name}");
        let pk = partition_key(name, &key);
        assert!(!pk.contains(&key));

        let first = one(&q, name, &key);
        assert_eq!(first.body["allowed"], true, "{name}: {}", first.body);
        let [p] = &first.policy[..] else {
            panic!("{name}: one policy member: {:?}", first.policy)
        };
        assert_eq!(p.name, name);
        assert_eq!(p.int("q"), case.q, "{name}: q");
        assert_eq!(
            p.params.get("w").map(|w| w.parse().unwrap()),
            case.w,
            "{name}: w"
        );
        assert_eq!(p.params["pk"], pk, "{name}: pk");
        let [l] = &first.limit[..] else {
            panic!("{name}: one limit member: {:?}", first.limit)
        };
        assert_eq!(
            (l.name.as_str(), l.int("r")),
            (name, case.q - 1),
            "{name}: r"
        );
        assert!(in_range(l.int("t"), case.t_first), "{name}: t {l:?}");
        assert_eq!(l.params["pk"], pk, "{name}: pk");
        assert_eq!(first.retry_after, None, "{name}");

        // Spend the rest, then the denial: r is what is left, t the wait, and Retry-After
        // the same number. (The sub-second window can roll over between two checks: ask
        // until a check lands in a window already spent.)
        let denied = wait_for(
            &format!("{name}: a denial"),
            Duration::from_secs(10),
            || {
                let a = one(&q, name, &key);
                (a.body["allowed"] == false).then_some(a)
            },
        );
        let l = &denied.limit[0];
        assert_eq!(
            denied.policy, first.policy,
            "{name}: the policy does not change"
        );
        assert_eq!(l.int("r"), denied.body["remaining"].as_u64().unwrap());
        assert_eq!(l.int("r"), 0, "{name}");
        let t = l.int("t");
        assert!(in_range(t, case.t_denied), "{name}: t {t} after a denial");
        assert_eq!(denied.retry_after, Some(t), "{name}: Retry-After and t");
        let retry_ms = denied.body["retry_after_ms"].as_u64().unwrap();
        assert_eq!(
            t,
            retry_ms.div_ceil(1000),
            "{name}: t is retry_after_ms rounded up"
        );
        // The older RateLimit-Reset keeps its meaning: until the key is back to full.
        let reset_ms = denied.body["reset_after_ms"].as_u64().unwrap();
        assert_eq!(denied.reset, Some(reset_ms.div_ceil(1000)), "{name}");
        assert!(denied.reset >= Some(t), "{name}");
    }
}

#[test]
fn a_batch_sends_one_member_per_policy() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&config(&redis));
    let a = check(
        &q,
        &json!({"checks": [
            {"policy": "fw", "key": "b1"},
            {"policy": "gc", "key": "b1"},
            {"policy": "log", "key": "b2"},
            {"policy": "fw", "key": "b2"},
        ]}),
    );
    assert_eq!(a.body["allowed"], true, "{}", a.body);
    let names: Vec<&str> = a.policy.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["fw", "gc", "log", "fw"]);
    let names: Vec<&str> = a.limit.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["fw", "gc", "log", "fw"]);
    let qs: Vec<u64> = a.policy.iter().map(|m| m.int("q")).collect();
    assert_eq!(qs, [3, 3, 3, 3]);
    let rs: Vec<u64> = a.limit.iter().map(|m| m.int("r")).collect();
    assert_eq!(rs, [2, 2, 2, 2]);
    // The same policy twice: the partition keys tell the members apart.
    let pks: Vec<String> = [("fw", "b1"), ("gc", "b1"), ("log", "b2"), ("fw", "b2")]
        .iter()
        .map(|(p, k)| partition_key(p, k))
        .collect();
    for list in [&a.policy, &a.limit] {
        let got: Vec<&String> = list.iter().map(|m| &m.params["pk"]).collect();
        assert_eq!(got, pks.iter().collect::<Vec<_>>());
    }
    assert_eq!(a.retry_after, None);
}

#[test]
fn a_denied_batch_reports_every_policy_and_waits_for_the_denial() {
    let redis = RedisServer::start();
    let q = Quotad::serve(&config(&redis));
    for _ in 0..3 {
        assert_eq!(one(&q, "gc", "d").body["allowed"], true);
    }
    let a = check(
        &q,
        &json!({"checks": [{"policy": "fw", "key": "d"}, {"policy": "gc", "key": "d"}]}),
    );
    assert_eq!(a.body["allowed"], false, "{}", a.body);
    let names: Vec<&str> = a.limit.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["fw", "gc"]);
    let (fw, gc) = (&a.limit[0], &a.limit[1]);
    // The GCRA denied: nothing left for the 9-10 s until one unit is back.
    assert_eq!(gc.int("r"), 0);
    assert!(in_range(gc.int("t"), (9, 10)), "{gc:?}");
    assert_eq!(a.retry_after, Some(gc.int("t")));
    // The fixed window admitted (and was refunded): its own quota and window end.
    assert!(fw.int("r") <= 3 && in_range(fw.int("t"), (1, 60)), "{fw:?}");
    assert_eq!(a.policy[0].int("q"), 3);
    assert_eq!(a.policy[1].params.get("w").map(String::as_str), Some("30"));
}
