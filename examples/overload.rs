//! Overload probe: many keep-alive connections sending `POST /v1/check` as fast as quotad
//! answers (closed loop, like `wrk`), on distinct keys spread over the given policies.
//! Reports what a rate limiter must be judged on under a spike: how many decisions were
//! answered, how many of them the store enforced (not `fail_open` / `fail_closed`), how
//! many requests were shed (503 `overloaded`), latency of the answered ones, whether the
//! circuit breaker opened, and how often `/readyz` left 200.
//!
//! ```sh
//! cargo run --release --example overload -- --url http://127.0.0.1:8686 \
//!     --connections 1000 --duration 10s --policies open,closed
//! ```
//!
//! `bench/overload.sh` starts Redis and quotad and runs this at 50, 200, 500 and 1,000
//! connections. Plain HTTP/1.1 over tokio sockets, no client library: at 1,000 connections
//! on 2 cores the load generator must cost as little CPU as the thing it measures.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

#[path = "support/http1.rs"]
mod http1;

use quotad_testkit::load::percentile_ms;

struct Args {
    addr: String,
    connections: usize,
    duration: Duration,
    keys: u64,
    policies: Vec<String>,
    csv: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        addr: "127.0.0.1:8686".into(),
        connections: 100,
        duration: Duration::from_secs(10),
        keys: 100_000,
        policies: vec!["default".into()],
        csv: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--url" => {
                let v = value()?;
                a.addr = v.trim_start_matches("http://").trim_end_matches('/').into();
            }
            "--connections" => a.connections = value()?.parse().map_err(|e| format!("{e}"))?,
            "--duration" => {
                a.duration = humantime::parse_duration(&value()?).map_err(|e| e.to_string())?
            }
            "--keys" => a.keys = value()?.parse().map_err(|e| format!("{e}"))?,
            "--policies" => a.policies = value()?.split(',').map(str::to_owned).collect(),
            "--csv" => a.csv = true,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(a)
}

/// What one connection saw.
#[derive(Default)]
struct Tally {
    /// Latency (us) of every 200 answer.
    answered_us: Vec<u32>,
    outcomes: BTreeMap<String, u64>,
    statuses: BTreeMap<u16, u64>,
    errors: u64,
}

fn outcome(body: &str) -> String {
    body.split("\"outcome\":\"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .unwrap_or("?")
        .to_owned()
}

async fn connection(addr: String, a: Arc<Args>, seed: u64, stop: Arc<AtomicBool>) -> Tally {
    let mut t = Tally::default();
    let mut rng = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    while !stop.load(Ordering::Relaxed) {
        let Ok(mut s) = TcpStream::connect(&addr).await else {
            t.errors += 1;
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let _ = s.set_nodelay(true);
        let mut buf = Vec::with_capacity(1024);
        while !stop.load(Ordering::Relaxed) {
            let r = next();
            let policy = &a.policies[(r % a.policies.len() as u64) as usize];
            let key = (r >> 8) % a.keys;
            let body = format!(r#"{{"policy":"{policy}","key":"k{key}","cost":1}}"#);
            let req = format!(
                "POST /v1/check HTTP/1.1\r\nhost: quotad\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            let sent = Instant::now();
            if s.write_all(req.as_bytes()).await.is_err() {
                t.errors += 1;
                break;
            }
            match http1::read_response(&mut s, &mut buf, |status, body| {
                (status, String::from_utf8_lossy(body).into_owned())
            })
            .await
            {
                Ok((status, body)) => {
                    *t.statuses.entry(status).or_default() += 1;
                    if status == 200 {
                        t.answered_us
                            .push(sent.elapsed().as_micros().min(u32::MAX as u128) as u32);
                        *t.outcomes.entry(outcome(&body)).or_default() += 1;
                    }
                }
                Err(_) => {
                    t.errors += 1;
                    break;
                }
            }
        }
    }
    t
}

/// `GET path` on a fresh connection; the status (0 when there was no answer).
async fn get(addr: &str, path: &str) -> (u16, String) {
    let attempt = async {
        let mut s = TcpStream::connect(addr).await?;
        let req = format!("GET {path} HTTP/1.1\r\nhost: quotad\r\nconnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await?;
        let mut buf = Vec::new();
        http1::read_response(&mut s, &mut buf, |status, body| {
            (status, String::from_utf8_lossy(body).into_owned())
        })
        .await
    };
    match tokio::time::timeout(Duration::from_secs(2), attempt).await {
        Ok(Ok(r)) => r,
        _ => (0, String::new()),
    }
}

/// Sums the samples of `name` (every label set) in a Prometheus text exposition.
fn metric_sum(text: &str, name: &str, label: Option<&str>) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|r| r.starts_with(' ') || r.starts_with('{'))
        })
        .filter(|l| label.is_none_or(|lab| l.contains(lab)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::main]
async fn main() {
    let a = match parse_args() {
        Ok(a) => Arc::new(a),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let stop = Arc::new(AtomicBool::new(false));
    let before = get(&a.addr, "/metrics").await.1;

    // Readiness as a Kubernetes probe sees it, every 50 ms.
    let (ready_checks, ready_fails, ready_flaps) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let poller = {
        let (addr, stop) = (a.addr.clone(), stop.clone());
        let (c, f, fl) = (
            ready_checks.clone(),
            ready_fails.clone(),
            ready_flaps.clone(),
        );
        tokio::spawn(async move {
            let mut was_ok = true;
            while !stop.load(Ordering::Relaxed) {
                let ok = get(&addr, "/readyz").await.0 == 200;
                c.fetch_add(1, Ordering::Relaxed);
                if !ok {
                    f.fetch_add(1, Ordering::Relaxed);
                }
                if ok != was_ok && !ok {
                    fl.fetch_add(1, Ordering::Relaxed);
                }
                was_ok = ok;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };

    let started = Instant::now();
    let tasks: Vec<_> = (0..a.connections)
        .map(|i| {
            tokio::spawn(connection(
                a.addr.clone(),
                a.clone(),
                i as u64 + 1,
                stop.clone(),
            ))
        })
        .collect();
    tokio::time::sleep(a.duration).await;
    stop.store(true, Ordering::Relaxed);
    let elapsed = started.elapsed().as_secs_f64();
    let mut total = Tally::default();
    for t in tasks {
        // A connection waiting for an answer when the time is up is abandoned.
        if let Ok(Ok(t)) = tokio::time::timeout(Duration::from_secs(5), t).await {
            total.answered_us.extend(t.answered_us);
            for (k, v) in t.outcomes {
                *total.outcomes.entry(k).or_default() += v;
            }
            for (k, v) in t.statuses {
                *total.statuses.entry(k).or_default() += v;
            }
            total.errors += t.errors;
        }
    }
    let _ = poller.await;
    let after = get(&a.addr, "/metrics").await.1;
    let delta = |name: &str, label: Option<&str>| {
        metric_sum(&after, name, label) - metric_sum(&before, name, label)
    };

    total.answered_us.sort_unstable();
    let answered = total.answered_us.len() as u64;
    let unenforced = total.outcomes.get("fail_open").copied().unwrap_or(0)
        + total.outcomes.get("fail_closed").copied().unwrap_or(0);
    let shed = total.statuses.get(&503).copied().unwrap_or(0);
    let other: u64 = total
        .statuses
        .iter()
        .filter(|(s, _)| **s != 200 && **s != 503)
        .map(|(_, n)| n)
        .sum();
    let not_enforced_pct = if answered > 0 {
        100.0 * unenforced as f64 / answered as f64
    } else {
        0.0
    };
    let circuit_opened = delta("quotad_store_breaker_opens_total", None);
    let circuit_open_calls = delta("quotad_store_errors_total", Some("kind=\"circuit_open\""));
    let shed_metric = delta("quotad_shed_total", None);
    let row = [
        a.connections.to_string(),
        format!("{:.0}", answered as f64 / elapsed),
        answered.to_string(),
        format!("{not_enforced_pct:.2}"),
        shed.to_string(),
        format!("{shed_metric:.0}"),
        other.to_string(),
        total.errors.to_string(),
        format!("{:.2}", percentile_ms(&total.answered_us, 50.0)),
        format!("{:.2}", percentile_ms(&total.answered_us, 99.0)),
        format!("{:.2}", percentile_ms(&total.answered_us, 99.9)),
        format!("{circuit_opened:.0}"),
        format!("{circuit_open_calls:.0}"),
        format!(
            "{}/{}",
            ready_fails.load(Ordering::Relaxed),
            ready_checks.load(Ordering::Relaxed)
        ),
        ready_flaps.load(Ordering::Relaxed).to_string(),
    ];
    if a.csv {
        println!("{}", row.join(","));
    } else {
        let names = [
            "connections",
            "answered/s",
            "answered",
            "not enforced %",
            "shed (503)",
            "quotad_shed_total",
            "other non-200",
            "socket errors",
            "p50 ms",
            "p99 ms",
            "p99.9 ms",
            "breaker opened",
            "circuit_open calls",
            "readyz non-200",
            "readyz flaps",
        ];
        for (n, v) in names.iter().zip(&row) {
            println!("{n:>20}: {v}");
        }
        println!("{:>20}: {:?}", "outcomes", total.outcomes);
    }
}
