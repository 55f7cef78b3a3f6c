//! `quotad demo`: three regions on this machine sharing one global budget, with a load
//! generator that moves demand between them, a cut and a heal of one region, and a live
//! table of what each region is offered, enforces and admits.
//!
//! Each region gets a real `redis-server` when one is on PATH (else the embedded store)
//! and a quotad daemon in this process (the same `app::serve` as `quotad serve`, with its
//! own coordinator thread). Peers reach each other through in-process TCP relays, which
//! is how a region is cut off and healed. Ctrl-C (or the end of the script) stops the
//! load, the daemons and the redis-servers, and removes the temporary directory.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use quotad_daemon::config::Settings;

/// Regions in escrow order (weights 6 / 3 / 1).
const REGIONS: [&str; 3] = ["us-east", "eu-west", "ap-south"];
const WEIGHTS: [u32; 3] = [6, 3, 1];
const RHO: u32 = 1000;
const COST: u64 = 5;

/// One step of the script: from `at` seconds, offered units per second per region.
struct Step {
    at: u64,
    offered: [f64; 3],
    event: Event,
}

#[derive(Clone, Copy, PartialEq)]
enum Event {
    None,
    Cut(usize),
    Heal(usize),
}

fn script() -> Vec<Step> {
    vec![
        Step {
            at: 0,
            offered: [900.0, 250.0, 50.0],
            event: Event::None,
        },
        Step {
            at: 25,
            offered: [100.0, 250.0, 900.0],
            event: Event::None,
        },
        Step {
            at: 45,
            offered: [100.0, 250.0, 900.0],
            event: Event::Cut(2),
        },
        Step {
            at: 65,
            offered: [100.0, 250.0, 900.0],
            event: Event::Heal(2),
        },
    ]
}

#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("cannot start redis-server: {0}")]
    Redis(String),
    #[error("invalid demo config: {0}")]
    Config(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// A redis-server child, killed on drop.
struct RedisChild {
    child: Child,
    port: u16,
}

impl Drop for RedisChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn redis_on_path() -> bool {
    Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

async fn start_redis(dir: &std::path::Path) -> Result<RedisChild, DemoError> {
    let probe = std::net::TcpListener::bind("127.0.0.1:0")?;
    let port = probe.local_addr()?.port();
    drop(probe);
    let child = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .arg("--dir")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| DemoError::Redis(e.to_string()))?;
    let r = RedisChild { child, port };
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if TcpStream::connect(("127.0.0.1", port)).await.is_ok() {
            return Ok(r);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(DemoError::Redis(format!("no answer on port {port}")))
}

/// A TCP relay to one daemon that drops every connection while its region is cut off.
async fn relay(
    listener: TcpListener,
    target: SocketAddr,
    cut: [Arc<AtomicBool>; 2],
    stop: CancellationToken,
) {
    let is_cut = move || cut.iter().any(|c| c.load(Ordering::Relaxed));
    loop {
        let conn = tokio::select! {
            _ = stop.cancelled() => return,
            c = listener.accept() => c,
        };
        let Ok((mut inbound, _)) = conn else { continue };
        if is_cut() {
            continue;
        }
        let is_cut = is_cut.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let Ok(mut outbound) = TcpStream::connect(target).await else {
                return;
            };
            let watch = async {
                while !is_cut() {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            };
            tokio::select! {
                _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                _ = watch => {}
                _ = stop.cancelled() => {}
            }
        });
    }
}

fn region_config(me: usize, store: &str, peer_urls: &[String; 3]) -> String {
    let mut c = format!(
        "region = \"{}\"\n[store]\nredis = \"{store}\"\n[coordinator]\nsecret = \"demo-secret-not-for-production\"\n",
        REGIONS[me]
    );
    for (j, url) in peer_urls.iter().enumerate() {
        if j != me {
            c += &format!("[[peer]]\nregion = \"{}\"\nurl = \"{url}\"\n", REGIONS[j]);
        }
    }
    c += &format!(
        "[[policy]]\nname = \"api\"\nalgorithm = \"token_bucket\"\nlimit = {RHO}\nwindow = \"1s\"\nburst = 200\non_store_error = \"closed\"\n\
         [policy.global]\nescrow = {{ {} = {}, {} = {}, {} = {} }}\n",
        REGIONS[0], WEIGHTS[0], REGIONS[1], WEIGHTS[1], REGIONS[2], WEIGHTS[2]
    );
    c
}

/// The demo's load: per region an offered rate and the units admitted since last read.
struct Load {
    offered: [AtomicU64; 3],
    admitted: [AtomicU64; 3],
}

async fn generate(load: Arc<Load>, region: usize, url: String, stop: CancellationToken) {
    let client = reqwest::Client::new();
    let body = serde_json::json!({"policy": "api", "key": "customer-42", "cost": COST}).to_string();
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    let mut owed = 0.0;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        owed += f64::from_bits(load.offered[region].load(Ordering::Relaxed)) * 0.01 / COST as f64;
        while owed >= 1.0 {
            owed -= 1.0;
            let (client, body, url, load) =
                (client.clone(), body.clone(), url.clone(), load.clone());
            tokio::spawn(async move {
                let r = client
                    .post(format!("{url}/v1/check"))
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await;
                if let Ok(resp) = r {
                    let v: serde_json::Value = resp.json().await.unwrap_or_default();
                    if v["allowed"] == true {
                        load.admitted[region].fetch_add(COST, Ordering::Relaxed);
                    }
                }
            });
        }
    }
}

/// The region's enforced rate for the demo key, from its `/v1/status`.
async fn share(client: &reqwest::Client, url: &str, region: usize) -> Option<f64> {
    let v: serde_json::Value = client
        .get(format!("{url}/v1/status"))
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()?;
    let p = &v["policies"][0];
    let key = p["keys"]
        .as_array()?
        .iter()
        .find(|k| k["key"] == "customer-42");
    match key {
        Some(k) => k["enforced"].as_f64(),
        None => p["escrow"][REGIONS[region]].as_f64(),
    }
}

/// Runs the demo until the script ends or `stop` is cancelled (Ctrl-C).
pub async fn run(
    embedded: bool,
    duration: Duration,
    stop: CancellationToken,
) -> Result<(), DemoError> {
    let dir: PathBuf = std::env::temp_dir().join(format!("quotad-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = run_in(&dir, embedded, duration, stop).await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn run_in(
    dir: &std::path::Path,
    embedded: bool,
    duration: Duration,
    stop: CancellationToken,
) -> Result<(), DemoError> {
    let use_redis = !embedded && redis_on_path();
    let mut redis = Vec::new();
    if use_redis {
        for i in 0..3 {
            let d = dir.join(format!("redis-{i}"));
            std::fs::create_dir_all(&d)?;
            redis.push(start_redis(&d).await?);
        }
    }
    let cut: [Arc<AtomicBool>; 3] = std::array::from_fn(|_| Arc::new(AtomicBool::new(false)));
    let background = CancellationToken::new();
    // Daemons listen first, so the relays (and the peers' configs) know where they are.
    let mut listeners = Vec::new();
    for _ in 0..3 {
        listeners.push(std::net::TcpListener::bind("127.0.0.1:0")?);
    }
    let addrs: Vec<SocketAddr> = listeners
        .iter()
        .map(|l| l.local_addr())
        .collect::<Result<_, _>>()?;
    // urls[a][b]: how region a reaches region b.
    let mut urls: Vec<[String; 3]> = Vec::new();
    for a in 0..3 {
        let mut row: [String; 3] = Default::default();
        for b in (0..3).filter(|&b| b != a) {
            let l = TcpListener::bind("127.0.0.1:0").await?;
            row[b] = format!("http://{}", l.local_addr()?);
            tokio::spawn(relay(
                l,
                addrs[b],
                [cut[a].clone(), cut[b].clone()],
                background.clone(),
            ));
        }
        urls.push(row);
    }
    let mut daemons = Vec::new();
    for (me, listener) in listeners.into_iter().enumerate() {
        let store = match redis.get(me) {
            Some(r) => format!("redis://127.0.0.1:{}", r.port),
            None => "memory".to_owned(),
        };
        let text = region_config(me, &store, &urls[me]);
        let mut settings = Settings::parse(&format!("demo:{}", REGIONS[me]), &text)
            .map_err(|e| DemoError::Config(e.to_string()))?;
        // No load balancer to tell: Ctrl-C stops the daemons at once.
        settings.server.shutdown_delay = std::time::Duration::ZERO;
        listener.set_nonblocking(true)?;
        let listener = TcpListener::from_std(listener)?;
        let token = background.child_token();
        daemons.push(tokio::spawn(quotad_daemon::app::serve(
            settings, listener, token,
        )));
    }
    println!(
        "quotad demo: 3 regions ({}), global budget {RHO}/s, burst 200, escrow {}/{}/{} %",
        if use_redis {
            "a redis-server each"
        } else {
            "embedded store: no redis-server on PATH"
        },
        WEIGHTS[0] * 10,
        WEIGHTS[1] * 10,
        WEIGHTS[2] * 10
    );
    for (i, a) in addrs.iter().enumerate() {
        println!(
            "  {:<9} http://{a}  (try: curl http://{a}/v1/status)",
            REGIONS[i]
        );
    }
    println!(
        "A region lends nothing for the first lease(1+e)+margin = 10.1 s after it starts (learning\n\
         period): until then each enforces its escrow. Ctrl-C stops everything.\n"
    );
    println!(
        "{:>4}  {:^26} {:^26} {:^26} {:>6}",
        "t", REGIONS[0], REGIONS[1], REGIONS[2], "total"
    );
    println!(
        "{:>4}  {:^26} {:^26} {:^26} {:>6}",
        "s",
        "offered enforced admitted",
        "offered enforced admitted",
        "offered enforced admitted",
        "/s"
    );

    let load = Arc::new(Load {
        offered: Default::default(),
        admitted: Default::default(),
    });
    for (r, a) in addrs.iter().enumerate() {
        tokio::spawn(generate(
            load.clone(),
            r,
            format!("http://{a}"),
            background.clone(),
        ));
    }
    let client = reqwest::Client::new();
    let steps = script();
    let started = Instant::now();
    let mut second = tokio::time::interval(Duration::from_secs(1));
    second.tick().await;
    let mut t = 0u64;
    let mut outcome = Ok(());
    loop {
        for s in steps.iter().filter(|s| s.at == t) {
            for (r, x) in s.offered.iter().enumerate() {
                load.offered[r].store(x.to_bits(), Ordering::Relaxed);
            }
            match s.event {
                Event::Cut(r) => {
                    cut[r].store(true, Ordering::Relaxed);
                    println!(
                        "---- {} cut off from both peers: falls back to its escrow within lease(1+e)+margin ----",
                        REGIONS[r]
                    );
                }
                Event::Heal(r) => {
                    cut[r].store(false, Ordering::Relaxed);
                    println!("---- {} reconnected ----", REGIONS[r]);
                }
                Event::None if t > 0 => println!("---- demand moves ----"),
                Event::None => {}
            }
        }
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = second.tick() => {}
        }
        t += 1;
        let mut row = format!("{t:>4}  ");
        let mut total = 0;
        for (r, a) in addrs.iter().enumerate() {
            let offered = f64::from_bits(load.offered[r].load(Ordering::Relaxed));
            let admitted = load.admitted[r].swap(0, Ordering::Relaxed);
            total += admitted;
            let enforced = match share(&client, &format!("http://{a}"), r).await {
                Some(s) => format!("{s:8.0}"),
                None => format!("{:>8}", "-"),
            };
            row += &format!("{offered:7.0} {enforced} {admitted:8}  ");
        }
        println!("{row}{total:>5}");
        if started.elapsed() >= duration {
            break;
        }
        if daemons.iter().any(|d| d.is_finished()) {
            outcome = Err(DemoError::Io(std::io::Error::other("a daemon stopped")));
            break;
        }
    }
    background.cancel();
    for d in daemons {
        let _ = tokio::time::timeout(Duration::from_secs(5), d).await;
    }
    drop(redis);
    println!("\nstopped: daemons shut down, redis-servers stopped.");
    outcome
}
