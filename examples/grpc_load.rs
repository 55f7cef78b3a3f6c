//! gRPC load: `ShouldRateLimit` calls on Envoy's rate-limit service as fast as quotad
//! answers (closed loop, like `wrk`), from `--connections` HTTP/2 connections with
//! `--streams` calls in flight on each (Envoy multiplexes a worker's calls over one
//! connection), one descriptor `{key: "k", value: k1..kN}` per call in `--domain`.
//! Prints one line that bench/protocols.sh reads:
//! `GRPC_RESULT rps=… p50_us=… p99_us=… p999_us=… errors=… over_limit=…`.
//!
//! ```sh
//! cargo run --release --example grpc_load -- --addr 127.0.0.1:8081 --domain bench \
//!     --connections 2 --streams 25 --duration 10s --keys 100000
//! ```
//!
//! There is no Go toolchain here for ghz, so the client is tonic's, of the same Envoy
//! messages as the server (`quotad_daemon::envoy`).

use std::time::{Duration, Instant};

use quotad_daemon::envoy::{Code, Entry, RateLimitDescriptor, RateLimitRequest};
use quotad_testkit::grpc::RateLimitServiceClient;

struct Args {
    addr: String,
    domain: String,
    connections: usize,
    streams: usize,
    duration: Duration,
    keys: u64,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        addr: "127.0.0.1:8081".into(),
        domain: "bench".into(),
        connections: 50,
        streams: 1,
        duration: Duration::from_secs(10),
        keys: 100_000,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--addr" => a.addr = v,
            "--domain" => a.domain = v,
            "--connections" => a.connections = v.parse().map_err(|e| format!("{flag}: {e}"))?,
            "--streams" => a.streams = v.parse().map_err(|e| format!("{flag}: {e}"))?,
            "--duration" => {
                a.duration = humantime::parse_duration(&v).map_err(|e| format!("{flag}: {e}"))?
            }
            "--keys" => a.keys = v.parse().map_err(|e| format!("{flag}: {e}"))?,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(a)
}

type Client = RateLimitServiceClient;

/// Latencies in µs, errors, over-limit answers.
type Stats = (Vec<u64>, u64, u64);

/// One connection: `--streams` loops of calls over it at once.
async fn connection(a: std::sync::Arc<Args>, seed: u64) -> Result<Stats, String> {
    let client = RateLimitServiceClient::connect(format!("http://{}", a.addr))
        .await
        .map_err(|e| e.to_string())?;
    let loops: Vec<_> = (0..a.streams as u64)
        .map(|s| tokio::spawn(calls(a.clone(), client.clone(), seed * 1_000_003 + s)))
        .collect();
    let mut out: Stats = (Vec::new(), 0, 0);
    for l in futures_util::future::join_all(loops).await {
        let (lat, errors, over) = l.map_err(|e| e.to_string())?;
        out.0.extend(lat);
        out.1 += errors;
        out.2 += over;
    }
    Ok(out)
}

/// One loop of calls, the next sent when the last is answered.
async fn calls(a: std::sync::Arc<Args>, mut client: Client, seed: u64) -> Stats {
    let (mut lat, mut errors, mut over) = (Vec::new(), 0, 0);
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let end = Instant::now() + a.duration;
    while Instant::now() < end {
        // xorshift: a key per call, no shared state between connections.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let req = RateLimitRequest {
            domain: a.domain.clone(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: "k".into(),
                    value: format!("k{}", x % a.keys + 1),
                }],
                ..Default::default()
            }],
            hits_addend: 1,
        };
        let t = Instant::now();
        match client.should_rate_limit(req).await {
            Ok(r) => {
                lat.push(t.elapsed().as_micros() as u64);
                if r.into_inner().overall_code == Code::OverLimit as i32 {
                    over += 1;
                }
            }
            Err(_) => errors += 1,
        }
    }
    (lat, errors, over)
}

fn main() {
    let a = match parse_args() {
        Ok(a) => std::sync::Arc::new(a),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let started = Instant::now();
    let results = rt.block_on(async {
        let tasks: Vec<_> = (0..a.connections)
            .map(|i| tokio::spawn(connection(a.clone(), i as u64 + 1)))
            .collect();
        futures_util::future::join_all(tasks).await
    });
    let secs = started.elapsed().as_secs_f64();
    let (mut lat, mut errors, mut over) = (Vec::new(), 0, 0);
    for r in results {
        match r {
            Ok(Ok((l, e, o))) => {
                lat.extend(l);
                errors += e;
                over += o;
            }
            Ok(Err(e)) => {
                eprintln!("connection failed: {e}");
                errors += 1;
            }
            Err(e) => {
                eprintln!("task failed: {e}");
                errors += 1;
            }
        }
    }
    lat.sort_unstable();
    let pct = |p: f64| {
        lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    println!(
        "GRPC_RESULT rps={:.1} p50_us={} p99_us={} p999_us={} errors={errors} over_limit={over}",
        lat.len() as f64 / secs,
        pct(0.50),
        pct(0.99),
        pct(0.999)
    );
}
