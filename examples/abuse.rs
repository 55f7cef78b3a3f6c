//! Abuse probe: holds many hostile connections open against a running quotad while a
//! probe client checks that it keeps answering, and reports how quotad coped.
//!
//! ```sh
//! cargo run --release --example abuse -- --url 127.0.0.1:8686 --pid PID --mode idle --count 30000
//! ```
//!
//! Modes: `idle` (connect, send nothing), `slowloris` (send a header byte every second,
//! never finish), `peer-half` (a `POST /v1/peer/exchange` naming a peer region with a fresh
//! timestamp and signatures of the right form but no secret behind them, declaring 1 MiB,
//! sending half). The probe
//! sends `POST /v1/check` every 10 ms on one keep-alive connection (reconnecting if quotad
//! closes it) and records each latency. quotad's resident memory is sampled every 100 ms
//! from /proc. Reported: connections opened, how many quotad closed and how long after
//! they opened, the probe's latency (p50, p99, max) and failures, and RSS before, at
//! peak, and once the attack is over. Connections come from 127.0.0.2-127.0.0.9, so that
//! 30,000 of them fit in the ephemeral port range. `bench/abuse.sh` runs all three.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

use quotad_testkit::load::percentile_ms;

struct Args {
    addr: SocketAddr,
    pid: u32,
    mode: String,
    count: usize,
    hold: Duration,
    path: String,
    body: String,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        addr: "127.0.0.1:8686".parse().unwrap(),
        pid: 0,
        mode: "idle".into(),
        count: 1000,
        hold: Duration::from_secs(30),
        path: "/v1/check".into(),
        body: r#"{"policy":"default","key":"probe","cost":0}"#.into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--url" => {
                a.addr = value()?
                    .trim_start_matches("http://")
                    .parse()
                    .map_err(|e| format!("{e}"))?
            }
            "--pid" => a.pid = value()?.parse().map_err(|e| format!("{e}"))?,
            "--mode" => a.mode = value()?,
            "--count" => a.count = value()?.parse().map_err(|e| format!("{e}"))?,
            "--hold" => a.hold = humantime::parse_duration(&value()?).map_err(|e| e.to_string())?,
            "--probe-body" => a.body = value()?,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(a)
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

/// A connection from 127.0.0.(2 + i % 8).
async fn connect(addr: SocketAddr, i: usize) -> std::io::Result<TcpStream> {
    let s = TcpSocket::new_v4()?;
    s.bind(SocketAddr::from((
        Ipv4Addr::new(127, 0, 0, 2 + (i % 8) as u8),
        0,
    )))?;
    s.connect(addr).await
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// One hostile connection; returns how long it stayed open if quotad closed it.
async fn hostile(a: Arc<Args>, i: usize, stop: Arc<AtomicBool>) -> Option<Duration> {
    let mut s = connect(a.addr, i).await.ok()?;
    let opened = Instant::now();
    match a.mode.as_str() {
        "peer-half" => {
            let head = format!(
                "POST /v1/peer/exchange HTTP/1.1\r\nhost: q\r\ncontent-type: application/json\r\n\
                 x-quotad-region: us\r\nx-quotad-timestamp: {}\r\nx-quotad-nonce: n{i}x{}\r\n\
                 x-quotad-signature: {}\r\nx-quotad-headers-signature: {}\r\ncontent-length: {}\r\n\r\n",
                now_ms(),
                opened.elapsed().as_nanos(),
                "ab".repeat(32),
                "cd".repeat(32),
                1 << 20
            );
            if s.write_all(head.as_bytes()).await.is_err() {
                return Some(opened.elapsed());
            }
            let half = vec![b' '; 512 * 1024];
            let _ = s.write_all(&half).await;
        }
        "slowloris" => {
            let line = b"GET /healthz HTTP/1.1\r\nhost: q\r\nx-slow: ";
            let mut n = 0;
            let mut buf = [0u8; 256];
            loop {
                let byte = line[n % line.len()];
                n += 1;
                if s.write_all(&[byte]).await.is_err() {
                    return Some(opened.elapsed());
                }
                tokio::select! {
                    r = s.read(&mut buf) => match r {
                        Ok(0) | Err(_) => return Some(opened.elapsed()),
                        Ok(_) => {}
                    },
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
                if stop.load(Ordering::Relaxed) {
                    return None;
                }
            }
        }
        _ => {}
    }
    let mut buf = [0u8; 4096];
    loop {
        tokio::select! {
            r = s.read(&mut buf) => match r {
                Ok(0) | Err(_) => return Some(opened.elapsed()),
                Ok(_) => {}
            },
            _ = tokio::time::sleep(Duration::from_millis(200)) => {
                if stop.load(Ordering::Relaxed) {
                    return None;
                }
            }
        }
    }
}

/// The probe: one keep-alive connection, a check every 10 ms.
async fn probe(a: Arc<Args>, stop: Arc<AtomicBool>, failures: Arc<AtomicU64>) -> Vec<u32> {
    let req = format!(
        "POST {} HTTP/1.1\r\nhost: q\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{}",
        a.path,
        a.body.len(),
        a.body
    );
    let mut lat = Vec::new();
    let mut conn: Option<TcpStream> = None;
    while !stop.load(Ordering::Relaxed) {
        let start = Instant::now();
        if conn.is_none() {
            conn = tokio::time::timeout(Duration::from_secs(1), TcpStream::connect(a.addr))
                .await
                .ok()
                .and_then(Result::ok);
        }
        let ok = match conn.as_mut() {
            Some(s) => {
                let exchange = async {
                    s.write_all(req.as_bytes()).await?;
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    loop {
                        let n = s.read(&mut chunk).await?;
                        if n == 0 {
                            return Err(std::io::ErrorKind::UnexpectedEof.into());
                        }
                        buf.extend_from_slice(&chunk[..n]);
                        let text = String::from_utf8_lossy(&buf);
                        if let Some((head, body)) = text.split_once("\r\n\r\n") {
                            let len: usize = head
                                .to_ascii_lowercase()
                                .lines()
                                .find_map(|l| {
                                    l.strip_prefix("content-length:")
                                        .map(|v| v.trim().parse().unwrap_or(0))
                                })
                                .unwrap_or(0);
                            if body.len() >= len {
                                return Ok::<bool, std::io::Error>(
                                    head.starts_with("HTTP/1.1 200"),
                                );
                            }
                        }
                    }
                };
                matches!(
                    tokio::time::timeout(Duration::from_secs(2), exchange).await,
                    Ok(Ok(true))
                )
            }
            None => false,
        };
        if ok {
            lat.push(start.elapsed().as_micros() as u32);
        } else {
            failures.fetch_add(1, Ordering::Relaxed);
            conn = None;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    lat
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
    let rss_before = rss_kib(a.pid);
    let peak = Arc::new(AtomicU64::new(rss_before));
    let sampler = {
        let (pid, stop, peak) = (a.pid, stop.clone(), peak.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(rss_kib(pid), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let failures = Arc::new(AtomicU64::new(0));
    let prober = tokio::spawn(probe(a.clone(), stop.clone(), failures.clone()));
    tokio::time::sleep(Duration::from_millis(500)).await;

    let started = Instant::now();
    let hostile_stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::with_capacity(a.count);
    for i in 0..a.count {
        tasks.push(tokio::spawn(hostile(a.clone(), i, hostile_stop.clone())));
        if i % 500 == 499 {
            tokio::task::yield_now().await;
        }
    }
    let opened_in = started.elapsed();
    // Wait for quotad to close them, at most `hold`.
    let deadline = tokio::time::sleep(a.hold);
    tokio::pin!(deadline);
    let mut closed = Vec::new();
    let mut open_at_end = 0usize;
    let mut all = futures_util::future::join_all(tasks);
    let results = tokio::select! {
        r = &mut all => Some(r),
        _ = &mut deadline => None,
    };
    let results = match results {
        Some(r) => r,
        None => {
            hostile_stop.store(true, Ordering::Relaxed);
            all.await
        }
    };
    for r in results {
        match r {
            Ok(Some(d)) => closed.push(d),
            _ => open_at_end += 1,
        }
    }
    let attack_over = started.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_after = rss_kib(a.pid);
    stop.store(true, Ordering::Relaxed);
    let mut lat = prober.await.unwrap_or_default();
    let _ = sampler.await;
    lat.sort_unstable();
    closed.sort();
    let q = |p: f64| {
        closed
            .get(
                ((closed.len() as f64 * p).ceil() as usize)
                    .saturating_sub(1)
                    .min(closed.len().saturating_sub(1)),
            )
            .map_or(f64::NAN, |d| d.as_secs_f64())
    };
    println!(
        "mode {} count {}: opened in {:.1} s; closed by quotad {} (time open: median {:.1} s, max {:.1} s), still open after {:.0} s: {}",
        a.mode,
        a.count,
        opened_in.as_secs_f64(),
        closed.len(),
        q(0.5),
        q(1.0),
        attack_over.as_secs_f64(),
        open_at_end
    );
    println!(
        "probe: {} checks, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms, failures {}",
        lat.len(),
        percentile_ms(&lat, 50.0),
        percentile_ms(&lat, 99.0),
        percentile_ms(&lat, 100.0),
        failures.load(Ordering::Relaxed)
    );
    println!(
        "quotad RSS: before {:.1} MB, peak {:.1} MB (+{:.1} MB), after {:.1} MB",
        rss_before as f64 / 1024.0,
        peak.load(Ordering::Relaxed) as f64 / 1024.0,
        (peak.load(Ordering::Relaxed).saturating_sub(rss_before)) as f64 / 1024.0,
        rss_after as f64 / 1024.0
    );
}
