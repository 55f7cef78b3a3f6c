//! Latency at a fixed offered rate (open loop): requests are scheduled at exact intervals
//! and a request held back by the previous answer on its connection counts its latency
//! from the instant it was *scheduled*, so a slow answer is counted against every request
//! it delayed (no coordinated omission); one sent on an idle connection counts from the
//! send (tokio's timer wakes up to a millisecond late: the generator's delay, not the
//! target's).
//! Below saturation this is the latency a service sees; `wrk` (closed loop) cannot show it.
//!
//! Two targets, so quotad can be put beside a client calling Redis itself:
//!
//! ```sh
//! # POST /v1/check on keys k1..kN, policy "bench"
//! cargo run --release --example fixed_rate -- --http 127.0.0.1:8686 --rate 20000 \
//!     --connections 50 --duration 10s --keys 100000
//! # EVALSHA of a loaded script on keys rl:bench:tb:{k1..kN}, one connection per worker
//! cargo run --release --example fixed_rate -- --redis 127.0.0.1:6379 --sha SHA --rate 20000 \
//!     --connections 50 --duration 10s --keys 100000
//! ```
//!
//! Prints one line: `FIXED_RATE target=… rate=… sent=… p50_us=… p99_us=… p999_us=…
//! max_us=… errors=…`. `bench/latency.sh` runs it at 50% and 80% of capacity.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[derive(Clone)]
enum Target {
    Http(String),
    Redis { addr: String, sha: String },
}

struct Args {
    target: Target,
    rate: f64,
    connections: usize,
    duration: Duration,
    keys: u64,
}

fn args() -> Result<Args, String> {
    let mut a = std::env::args().skip(1);
    let (mut http, mut redis, mut sha) = (None, None, None);
    let (mut rate, mut connections, mut duration, mut keys) =
        (1000.0f64, 50usize, Duration::from_secs(10), 100_000u64);
    while let Some(flag) = a.next() {
        let v = a.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--http" => http = Some(v),
            "--redis" => redis = Some(v),
            "--sha" => sha = Some(v),
            "--rate" => rate = v.parse().map_err(|e| format!("{flag}: {e}"))?,
            "--connections" => connections = v.parse().map_err(|e| format!("{flag}: {e}"))?,
            "--duration" => {
                duration = humantime::parse_duration(&v).map_err(|e| format!("{flag}: {e}"))?
            }
            "--keys" => keys = v.parse().map_err(|e| format!("{flag}: {e}"))?,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    let target = match (http, redis, sha) {
        (Some(h), None, _) => Target::Http(h),
        (None, Some(r), Some(s)) => Target::Redis { addr: r, sha: s },
        _ => return Err("give --http ADDR, or --redis ADDR with --sha SHA".into()),
    };
    if !rate.is_finite() || rate <= 0.0 || connections == 0 {
        return Err("--rate and --connections must be positive".into());
    }
    Ok(Args {
        target,
        rate,
        connections,
        duration,
        keys,
    })
}

/// One connection's share: requests `j, j + C, j + 2C, …` of the schedule.
async fn worker(
    target: Target,
    j: usize,
    c: usize,
    start: Instant,
    interval: Duration,
    total: usize,
    keys: u64,
) -> (Vec<u32>, usize) {
    let mut lat = Vec::with_capacity(total / c + 1);
    let mut errors = 0;
    let mut seed = 0x9E37_79B9_7F4A_7C15u64 ^ (j as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let mut key = move || {
        // xorshift64*: a key per request without a shared RNG.
        seed ^= seed >> 12;
        seed ^= seed << 25;
        seed ^= seed >> 27;
        seed.wrapping_mul(0x2545_F491_4F6C_DD1D) % keys + 1
    };
    let addr = match &target {
        Target::Http(addr) | Target::Redis { addr, .. } => addr,
    };
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let _ = s.set_nodelay(true);
    let mut buf = Vec::with_capacity(4096);
    let frame = bench_frame();
    let mut i = j;
    let mut busy_until = start;
    while i < total {
        let at = start + interval * i as u32;
        tokio::time::sleep_until(at.into()).await;
        // The latency counts from the scheduled instant when this connection was still
        // waiting for its previous answer then (the server's delay: no coordinated
        // omission), else from the send: the timer wheel wakes up to a millisecond late,
        // and that lateness is the load generator's, not the target's.
        let from = if busy_until > at { at } else { Instant::now() };
        let ok = match &target {
            Target::Http(_) => {
                let body = format!("{{\"policy\":\"bench\",\"key\":\"k{}\"}}", key());
                let req = format!(
                    "POST /v1/check HTTP/1.1\r\nHost: q\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                );
                exchange(&mut s, &mut buf, req.as_bytes(), http_answer).await
            }
            Target::Redis { sha, .. } => {
                let k = format!("rl:bench:tb:{{k{}}}", key());
                // As quotad sends it: mode, limit, window_us, burst, cost, member, then
                // the frame and since of the bench policy's numbers.
                let args = [
                    "EVALSHA", sha, "1", &k, "check", "100", "60000000", "100", "1", "-", &frame.0,
                    &frame.1,
                ];
                let mut cmd = format!("*{}\r\n", args.len());
                for a in args {
                    cmd.push_str(&format!("${}\r\n{a}\r\n", a.len()));
                }
                exchange(&mut s, &mut buf, cmd.as_bytes(), resp_answer).await
            }
        };
        if ok {
            lat.push(from.elapsed().as_micros().min(u32::MAX as u128) as u32);
        } else {
            errors += 1;
        }
        busy_until = Instant::now();
        i += c;
    }
    (lat, errors)
}

/// Sends `msg` and reads until `answered` says the reply in `buf` is whole: `Some(ok)`.
/// False on a write or read error, or a connection closed first.
/// The frame and since quotad sends for the bench policy (100 per minute, version 1,
/// in force from now).
fn bench_frame() -> (String, String) {
    use quotad_core::algorithm::{Limits, Since};
    let at_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    quotad_daemon::testing::redis::frame_args(&Limits {
        limit: 100,
        window_us: 60_000_000,
        burst: 100,
        since: Since { version: 1, at_ms },
    })
}

async fn exchange(
    s: &mut TcpStream,
    buf: &mut Vec<u8>,
    msg: &[u8],
    answered: impl Fn(&[u8]) -> Option<bool>,
) -> bool {
    if s.write_all(msg).await.is_err() {
        return false;
    }
    buf.clear();
    let mut chunk = [0u8; 4096];
    loop {
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
        if let Some(ok) = answered(buf) {
            return ok;
        }
    }
}

/// An HTTP/1.1 answer once whole (headers, then Content-Length bytes): 200 or not.
fn http_answer(buf: &[u8]) -> Option<bool> {
    let end = find(buf, b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    (buf.len() >= end + 4 + len).then(|| head.starts_with("http/1.1 200"))
}

/// A RESP answer once whole: an error line (false), or the limiter scripts' array of four
/// integers, `*4` and four `:n` lines (true).
fn resp_answer(buf: &[u8]) -> Option<bool> {
    if buf.first() == Some(&b'-') && buf.ends_with(b"\r\n") {
        return Some(false);
    }
    (buf.starts_with(b"*") && buf.iter().filter(|&&b| b == b'\n').count() >= 5).then_some(true)
}

fn find(h: &[u8], n: &[u8]) -> Option<usize> {
    h.windows(n.len()).position(|w| w == n)
}

fn main() {
    let a = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("fixed_rate: {e}");
            std::process::exit(2);
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let total = (a.rate * a.duration.as_secs_f64()) as usize;
    let interval = Duration::from_secs_f64(1.0 / a.rate);
    let label = match &a.target {
        Target::Http(h) => format!("http://{h}/v1/check"),
        Target::Redis { addr, .. } => format!("redis://{addr} EVALSHA"),
    };
    let (mut lat, errors) = rt.block_on(async {
        // Connections first, then the schedule starts for all at once.
        let start = Instant::now() + Duration::from_millis(200);
        let tasks: Vec<_> = (0..a.connections)
            .map(|j| {
                tokio::spawn(worker(
                    a.target.clone(),
                    j,
                    a.connections,
                    start,
                    interval,
                    total,
                    a.keys,
                ))
            })
            .collect();
        let mut lat = Vec::with_capacity(total);
        let mut errors = 0;
        for t in tasks {
            let (l, e) = t.await.expect("worker");
            lat.extend(l);
            errors += e;
        }
        (lat, errors)
    });
    lat.sort_unstable();
    let p = |q: f64| {
        lat.get(((lat.len() as f64 * q) as usize).min(lat.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    println!(
        "FIXED_RATE target={label} rate={} sent={} p50_us={} p99_us={} p999_us={} max_us={} errors={errors}",
        a.rate,
        lat.len() + errors,
        p(0.5),
        p(0.99),
        p(0.999),
        lat.last().copied().unwrap_or(0)
    );
}
