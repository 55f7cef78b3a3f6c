//! Costs known after the work, from several OS processes at once: the load of the
//! settlement tests. Each child makes `calls` calls on one key, a few in flight at a
//! time: a reserving check of a random estimate and, when admitted, its settlement at a
//! random real cost (over HTTP); or a request-path peek and, when it passes, a
//! response-path charge of the real cost (over Envoy's gRPC service, as Envoy sends
//! them). It prints what it was admitted and what the admitted work really cost.
//!
//! Started like the race's children ([`crate::race`]): a test binary with its own
//! harness calls [`crate::race::child_main`] first thing, which runs [`child_load`] for
//! the modes here.

use std::process::{Command, Stdio};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use quotad_daemon::envoy::{RateLimitDescriptor, RateLimitRequest, UInt64Value};

/// The child modes of this module.
pub const MODES: [&str; 2] = ["settle_http", "charge_grpc"];

/// Calls each child keeps in flight.
const IN_FLIGHT: usize = 8;

/// What the children got, summed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Settled {
    /// Calls admitted (a reservation, or a peek that passed) and denied.
    pub admitted: u64,
    pub denied: u64,
    /// The estimates of the admitted calls (0 over gRPC: the request path peeks).
    pub estimated: u64,
    /// The real costs of the admitted calls: what the key must have been charged.
    pub real: u64,
    /// Settlements sent again, each answered `already_settled`.
    pub repeated: u64,
}

/// One run: `processes` children, child i sending `calls` calls to `targets[i % len]`
/// (a quotad base URL, or `http://127.0.0.1:<grpc port>` for `charge_grpc`) on `key` of
/// `policy` (over gRPC: the domain named like the policy, descriptor `("api_key", key)`). Estimates are
/// 1 ..= `max_estimate`, real costs 0 ..= 2 × the estimate. Panics if any call failed.
#[allow(clippy::too_many_arguments)]
pub fn run(
    mode: &str,
    targets: &[&str],
    processes: usize,
    calls: usize,
    policy: &str,
    key: &str,
    max_estimate: u64,
) -> Settled {
    let exe = std::env::current_exe().expect("the test binary");
    let children: Vec<_> = (0..processes)
        .map(|i| {
            Command::new(&exe)
                .env("QUOTAD_CHILD_MODE", mode)
                .env("QUOTAD_CHILD_TARGET", targets[i % targets.len()])
                .env("QUOTAD_CHILD_POLICY", policy)
                .env("QUOTAD_CHILD_KEY", key)
                .env("QUOTAD_CHILD_N", calls.to_string())
                .env("QUOTAD_CHILD_LIMIT", max_estimate.to_string())
                .env("QUOTAD_CHILD_SEED", (0x5e771e + i).to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn child")
        })
        .collect();
    let mut sum = Settled::default();
    for c in children {
        let out = c.wait_with_output().expect("child");
        let text = String::from_utf8_lossy(&out.stdout);
        let err = String::from_utf8_lossy(&out.stderr);
        let line = text
            .lines()
            .find_map(|l| l.find("SETTLED ").map(|i| &l[i..]))
            .unwrap_or_else(|| panic!("child gave no result: {text}\n{err}"));
        let field = |name: &str| -> u64 {
            line.split_whitespace()
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{name} in {line}"))
        };
        assert_eq!(field("errors"), 0, "child errors: {line}\n{err}");
        sum.admitted += field("admitted");
        sum.denied += field("denied");
        sum.estimated += field("estimated");
        sum.real += field("real");
        sum.repeated += field("repeated");
    }
    sum
}

/// One call's result in a child.
enum Call {
    Admitted {
        estimate: u64,
        real: u64,
        repeated: bool,
    },
    Denied,
    Failed(String),
}

/// In a child started by [`run`]: its share of the load, then its tally on stdout.
pub fn child_load(mode: &str) {
    let env = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} not set"));
    let target = env("QUOTAD_CHILD_TARGET");
    let policy = env("QUOTAD_CHILD_POLICY");
    let key = env("QUOTAD_CHILD_KEY");
    let calls: usize = env("QUOTAD_CHILD_N").parse().expect("N");
    let max_estimate: u64 = env("QUOTAD_CHILD_LIMIT").parse().expect("LIMIT");
    let seed: u64 = env("QUOTAD_CHILD_SEED").parse().expect("SEED");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let results: Vec<Call> = rt.block_on(async {
        let mut rng = StdRng::seed_from_u64(seed);
        // (estimate, real, settle twice) per call, drawn up front: the seed decides them.
        let plan: Vec<(u64, u64, bool)> = (0..calls)
            .map(|_| {
                let estimate = rng.random_range(1..=max_estimate);
                (
                    estimate,
                    rng.random_range(0..=2 * estimate),
                    rng.random_bool(0.1),
                )
            })
            .collect();
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(20))
            .build()
            .expect("client");
        let grpc = match mode {
            "charge_grpc" => Some(
                crate::grpc::RateLimitServiceClient::connect(target.clone())
                    .await
                    .expect("connect"),
            ),
            _ => None,
        };
        let mut out = Vec::with_capacity(calls);
        for chunk in plan.chunks(IN_FLIGHT) {
            let batch = chunk.iter().map(|&(estimate, real, twice)| {
                let (http, grpc) = (http.clone(), grpc.clone());
                let (target, policy, key) = (&target, &policy, &key);
                async move {
                    match grpc {
                        Some(g) => grpc_call(g, policy, key, real).await,
                        None => http_call(&http, target, policy, key, estimate, real, twice).await,
                    }
                }
            });
            out.extend(futures_util::future::join_all(batch).await);
        }
        out
    });
    let mut t = (0u64, 0u64, 0u64, 0u64, 0u64, 0u64);
    for r in results {
        match r {
            Call::Admitted {
                estimate,
                real,
                repeated,
            } => {
                t.0 += 1;
                t.2 += estimate;
                t.3 += real;
                t.4 += u64::from(repeated);
            }
            Call::Denied => t.1 += 1,
            Call::Failed(why) => {
                eprintln!("child call failed: {why}");
                t.5 += 1;
            }
        }
    }
    println!(
        "SETTLED admitted={} denied={} estimated={} real={} repeated={} errors={}",
        t.0, t.1, t.2, t.3, t.4, t.5
    );
}

async fn post(
    http: &reqwest::Client,
    url: String,
    body: serde_json::Value,
) -> Result<(u16, serde_json::Value), String> {
    let r = http
        .post(url)
        .json(&body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = r.status().as_u16();
    let v = r.json().await.map_err(|e| e.to_string())?;
    Ok((status, v))
}

/// A reserving check of `estimate`; admitted, the work "runs" a moment, then settles at
/// `real` (and, when `twice`, again: that must charge nothing).
async fn http_call(
    http: &reqwest::Client,
    target: &str,
    policy: &str,
    key: &str,
    estimate: u64,
    real: u64,
    twice: bool,
) -> Call {
    let body = serde_json::json!({"policy": policy, "key": key, "cost": estimate, "settle": true});
    let v = match post(http, format!("{target}/v1/check"), body).await {
        Ok((200, v)) => v,
        other => return Call::Failed(format!("check: {other:?}")),
    };
    match (v["outcome"].as_str(), v["reservation"].as_str()) {
        (Some("denied"), None) => return Call::Denied,
        (Some("allowed"), Some(_)) => {}
        _ => return Call::Failed(format!("check: {v}")),
    }
    tokio::time::sleep(Duration::from_millis(real % 5)).await;
    let settle = serde_json::json!({
        "policy": policy, "key": key, "reservation": v["reservation"], "cost": real,
    });
    let url = format!("{target}/v1/settle");
    match post(http, url.clone(), settle.clone()).await {
        Ok((200, s)) if s["status"] == "settled" => {}
        other => return Call::Failed(format!("settle: {other:?}")),
    }
    if twice {
        match post(http, url, settle).await {
            Ok((200, s)) if s["status"] == "already_settled" => {}
            other => return Call::Failed(format!("settle again: {other:?}")),
        }
    }
    Call::Admitted {
        estimate,
        real,
        repeated: twice,
    }
}

/// What Envoy sends for one request: the request path's peek (hits 0) of the charged
/// descriptor and, when it passes, the response path's charge of the real cost.
async fn grpc_call(
    mut g: crate::grpc::RateLimitServiceClient,
    domain: &str,
    key: &str,
    real: u64,
) -> Call {
    let request = |hits: u64| RateLimitRequest {
        domain: domain.into(),
        descriptors: vec![RateLimitDescriptor {
            hits_addend: Some(UInt64Value { value: hits }),
            ..crate::grpc::descriptor(&[("api_key", key)])
        }],
        hits_addend: 0,
    };
    const OK: i32 = 1;
    let peek = match g.should_rate_limit(request(0)).await {
        Ok(r) => r.into_inner().overall_code,
        Err(e) => return Call::Failed(format!("peek: {e}")),
    };
    if peek != OK {
        return Call::Denied;
    }
    tokio::time::sleep(Duration::from_millis(real % 5)).await;
    // A real cost of 0 is a hit of 0, which is a peek (and Envoy ignores what the
    // response path is answered): only a charge must be answered OK.
    match g.should_rate_limit(request(real)).await {
        Ok(r) if r.get_ref().overall_code == OK || real == 0 => Call::Admitted {
            estimate: 0,
            real,
            repeated: false,
        },
        other => Call::Failed(format!("charge: {other:?}")),
    }
}
