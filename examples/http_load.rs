//! HTTP/1.1 load over TCP or a Unix socket: `POST /v1/check` of policy `--policy` on keys
//! k1..kN (`--keys`), as fast as quotad answers (closed loop, like `wrk`), from
//! `--connections` keep-alive connections with one request in flight each. wrk cannot
//! reach a Unix socket; this can, so the two transports are measured with one client.
//! Requests are written and responses read as bytes (the status line and Content-Length
//! only): the client's own CPU per request stays small beside quotad's on a shared
//! machine. Prints one line that the bench scripts read:
//! `HTTP_RESULT rps=… p50_us=… p99_us=… p999_us=… errors=…`.
//!
//! ```sh
//! cargo run --release --example http_load -- --addr unix:/tmp/quotad.sock \
//!     --connections 50 --duration 10s --keys 100000
//! cargo run --release --example http_load -- --addr 127.0.0.1:8686
//! ```

use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

#[path = "support/http1.rs"]
mod http1;

struct Args {
    addr: String,
    policy: String,
    connections: usize,
    duration: Duration,
    keys: u64,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        addr: "127.0.0.1:8686".into(),
        policy: "bench".into(),
        connections: 50,
        duration: Duration::from_secs(10),
        keys: 100_000,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--addr" => a.addr = value,
            "--policy" => a.policy = value,
            "--connections" => a.connections = value.parse().map_err(|e| format!("{e}"))?,
            "--duration" => {
                a.duration = humantime::parse_duration(&value).map_err(|e| format!("{e}"))?
            }
            "--keys" => a.keys = value.parse().map_err(|e| format!("{e}"))?,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if a.connections == 0 || a.keys == 0 {
        return Err("--connections and --keys must be at least 1".into());
    }
    Ok(a)
}

/// What one connection saw.
#[derive(Default)]
struct Tally {
    latencies_us: Vec<u32>,
    errors: u64,
}

/// The request for key `k`, whole.
fn request(policy: &str, k: u64) -> Vec<u8> {
    let body = format!(r#"{{"policy":"{policy}","key":"k{k}","cost":1}}"#);
    format!(
        "POST /v1/check HTTP/1.1\r\nHost: quotad\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// One connection's closed loop until `until`.
async fn drive<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    args: &Args,
    seed: u64,
    until: Instant,
) -> Tally {
    let mut tally = Tally::default();
    let mut buf = Vec::with_capacity(8192);
    let mut x = seed | 1;
    while Instant::now() < until {
        // xorshift: the keys spread like wrk's math.random, with no allocation.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let req = request(&args.policy, x % args.keys + 1);
        let sent = Instant::now();
        let ok = match s.write_all(&req).await {
            Ok(()) => http1::read_response(&mut s, &mut buf, |status, _| status == 200).await,
            Err(e) => Err(e),
        };
        match ok {
            Ok(true) => tally
                .latencies_us
                .push(sent.elapsed().as_micros().min(u32::MAX as u128) as u32),
            Ok(false) => tally.errors += 1,
            Err(_) => {
                tally.errors += 1;
                break;
            }
        }
    }
    tally
}

async fn connection(args: &Args, seed: u64, until: Instant) -> Tally {
    if let Some(path) = args.addr.strip_prefix("unix:") {
        match tokio::net::UnixStream::connect(path).await {
            Ok(s) => drive(s, args, seed, until).await,
            Err(_) => Tally {
                errors: 1,
                ..Tally::default()
            },
        }
    } else {
        match tokio::net::TcpStream::connect(&args.addr).await {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                drive(s, args, seed, until).await
            }
            Err(_) => Tally {
                errors: 1,
                ..Tally::default()
            },
        }
    }
}

fn main() -> std::process::ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("http_load: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    // One thread, like `wrk -t1`.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let started = Instant::now();
    let until = started + args.duration;
    let tallies = rt.block_on(futures_util::future::join_all(
        (0..args.connections).map(|i| connection(&args, 0x9e37_79b9_7f4a_7c15 ^ i as u64, until)),
    ));
    let elapsed = started.elapsed().as_secs_f64();
    let mut all: Vec<u32> = tallies
        .iter()
        .flat_map(|t| t.latencies_us.iter().copied())
        .collect();
    let errors: u64 = tallies.iter().map(|t| t.errors).sum();
    all.sort_unstable();
    let at = |q: f64| all.get(((all.len() as f64 * q) as usize).min(all.len().saturating_sub(1)));
    println!(
        "HTTP_RESULT rps={:.1} p50_us={} p99_us={} p999_us={} errors={errors}",
        all.len() as f64 / elapsed,
        at(0.5).copied().unwrap_or(0),
        at(0.99).copied().unwrap_or(0),
        at(0.999).copied().unwrap_or(0),
    );
    std::process::ExitCode::SUCCESS
}
