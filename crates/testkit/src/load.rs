//! An open-loop load generator for multi-region tests: per region an offered rate (units
//! per second, changeable while it runs) of checks of one policy and key, spread over the
//! region's daemons, and a log of every answer with when it was sent and received. The
//! admission bound is checked from that log ([`max_admitted_in_window`]).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One answer.
#[derive(Debug, Clone, Copy)]
pub struct Answer {
    pub region: usize,
    /// Seconds since the generator started.
    pub sent: f64,
    pub received: f64,
    pub cost: u64,
    pub allowed: bool,
    /// HTTP status (0: no answer).
    pub status: u16,
}

pub struct Load {
    rates: Vec<Arc<AtomicU64>>,
    stop: Arc<AtomicBool>,
    log: Arc<Mutex<Vec<Answer>>>,
    started: Instant,
    thread: Option<std::thread::JoinHandle<()>>,
}

const TICK: Duration = Duration::from_millis(10);

impl Load {
    /// `urls[r]`: the daemons of region r (requests alternate between them; one that does
    /// not answer is skipped until it does).
    pub fn start(urls: Vec<Vec<String>>, policy: &str, key: &str, cost: u64) -> Load {
        let rates: Vec<Arc<AtomicU64>> = urls.iter().map(|_| Arc::new(AtomicU64::new(0))).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let log = Arc::new(Mutex::new(Vec::new()));
        let started = Instant::now();
        let sender = Sender {
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(2))
                .pool_max_idle_per_host(64)
                .build()
                .expect("client"),
            body: serde_json::json!({"policy": policy, "key": key, "cost": cost}).to_string(),
            cost,
            started,
            log: log.clone(),
        };
        let (rates2, stop2) = (rates.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            crate::runtime().block_on(async move {
                let tasks: Vec<_> = urls
                    .into_iter()
                    .zip(rates2)
                    .enumerate()
                    .map(|(region, (urls, rate))| {
                        let region = Region {
                            index: region,
                            urls,
                            next: Arc::new(AtomicUsize::new(0)),
                        };
                        tokio::spawn(offer(region, rate, stop2.clone(), sender.clone()))
                    })
                    .collect();
                for t in tasks {
                    let _ = t.await;
                }
                // Let requests in flight finish (bounded by the client timeout).
                tokio::time::sleep(Duration::from_millis(2100)).await;
            });
        });
        Load {
            rates,
            stop,
            log,
            started,
            thread: Some(thread),
        }
    }

    pub fn set_rate(&self, region: usize, units_per_second: f64) {
        self.rates[region].store(units_per_second.to_bits(), Ordering::Relaxed);
    }

    pub fn elapsed(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    pub fn answers(&self) -> Vec<Answer> {
        self.log.lock().unwrap().clone()
    }

    /// Stops and returns every answer.
    pub fn finish(mut self) -> Vec<Answer> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.answers()
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// What every request of a load shares: the client, the body, and the log of answers.
#[derive(Clone)]
struct Sender {
    client: reqwest::Client,
    body: String,
    cost: u64,
    started: Instant,
    log: Arc<Mutex<Vec<Answer>>>,
}

/// One region's daemons, and which of them is in use.
#[derive(Clone)]
struct Region {
    index: usize,
    urls: Vec<String>,
    next: Arc<AtomicUsize>,
}

/// Open loop: every tick, sends the requests the region's rate owes, without waiting for
/// answers, until `stop`.
async fn offer(region: Region, rate: Arc<AtomicU64>, stop: Arc<AtomicBool>, sender: Sender) {
    let mut owed = 0.0f64;
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let units = f64::from_bits(rate.load(Ordering::Relaxed));
        owed += units * TICK.as_secs_f64() / sender.cost as f64;
        while owed >= 1.0 {
            owed -= 1.0;
            tokio::spawn(send(region.clone(), sender.clone()));
        }
    }
}

/// One check, logged with when it was sent and answered.
async fn send(region: Region, sender: Sender) {
    let i = region.next.load(Ordering::Relaxed) % region.urls.len();
    let sent = sender.started.elapsed().as_secs_f64();
    let r = sender
        .client
        .post(format!("{}/v1/check", region.urls[i]))
        .header("content-type", "application/json")
        .body(sender.body.clone())
        .send()
        .await;
    let (status, allowed) = match r {
        Ok(resp) => {
            let status = resp.status().as_u16();
            let v: serde_json::Value = resp.json().await.unwrap_or_default();
            (status, v["allowed"] == true)
        }
        Err(_) => {
            // That daemon is down: use the next one.
            region.next.fetch_add(1, Ordering::Relaxed);
            (0, false)
        }
    };
    let received = sender.started.elapsed().as_secs_f64();
    sender.log.lock().unwrap().push(Answer {
        region: region.index,
        sent,
        received,
        cost: sender.cost,
        allowed,
        status,
    });
}

/// The largest number of units admitted (over all regions) certainly inside one window of
/// `window` seconds, and where it starts. "Certainly": an admission happened somewhere
/// between its request's send and receive times, so only admissions whose whole
/// interval lies in the window are counted: the check never blames the system for the
/// client's latency, and any admission burst beyond ρW + B still shows.
pub fn max_admitted_in_window(answers: &[Answer], window: f64) -> (u64, f64) {
    let mut adm: Vec<&Answer> = answers.iter().filter(|a| a.allowed).collect();
    adm.sort_by(|a, b| a.sent.total_cmp(&b.sent));
    let mut best = (0, 0.0);
    for (i, a) in adm.iter().enumerate() {
        let end = a.sent + window;
        let mut sum = 0;
        for b in &adm[i..] {
            if b.sent > end {
                break;
            }
            if b.received <= end {
                sum += b.cost;
            }
        }
        if sum > best.0 {
            best = (sum, a.sent);
        }
    }
    best
}

/// Units admitted per region in [from, to) by send time.
pub fn admitted_between(answers: &[Answer], region: usize, from: f64, to: f64) -> u64 {
    answers
        .iter()
        .filter(|a| a.allowed && a.region == region && a.sent >= from && a.sent < to)
        .map(|a| a.cost)
        .sum()
}

/// The `p`th percentile (nearest rank) of latencies in µs, sorted ascending, in ms; NaN
/// for none.
pub fn percentile_ms(sorted_us: &[u32], p: f64) -> f64 {
    if sorted_us.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted_us.len() as f64 * p / 100.0).ceil() as usize).clamp(1, sorted_us.len()) - 1;
    sorted_us[i] as f64 / 1000.0
}

/// One answer of a [`Checks`] load.
#[derive(Debug, Clone)]
pub struct Sample {
    /// When the request was sent.
    pub at: std::time::Instant,
    /// Which of the load's request bodies it sent.
    pub request: usize,
    /// HTTP status (0: no answer, `outcome` then says why).
    pub status: u16,
    /// The decision's `outcome` (`allowed`, `denied`, `fail_open`, …).
    pub outcome: String,
    pub latency: Duration,
}

impl Sample {
    /// The store decided (`allowed` or `denied`), as opposed to a fallback.
    pub fn enforced(&self) -> bool {
        self.outcome == "allowed" || self.outcome == "denied"
    }
}

/// A closed-loop load for fault tests: `threads` threads each send one check at a time
/// (one connection per request, like independent clients), cycling over the request
/// bodies, and record every answer with its outcome, until stopped or `bound` has passed.
pub struct Checks {
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<Sample>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Checks {
    pub fn start(
        port: u16,
        bodies: Vec<serde_json::Value>,
        threads: usize,
        bound: Duration,
    ) -> Checks {
        let stop = Arc::new(AtomicBool::new(false));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let bodies: Arc<Vec<String>> = Arc::new(bodies.iter().map(|b| b.to_string()).collect());
        let threads = (0..threads)
            .map(|t| {
                let (stop, samples, bodies) = (stop.clone(), samples.clone(), bodies.clone());
                std::thread::spawn(move || {
                    let deadline = Instant::now() + bound;
                    let mut i = t;
                    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                        let request = i % bodies.len();
                        i += 1;
                        let at = Instant::now();
                        let (status, outcome) = crate::check_outcome(port, &bodies[request]);
                        let latency = at.elapsed();
                        samples.lock().unwrap().push(Sample {
                            at,
                            request,
                            status,
                            outcome,
                            latency,
                        });
                    }
                })
            })
            .collect();
        Checks {
            stop,
            samples,
            threads,
        }
    }

    /// Answers so far.
    pub fn count(&self) -> usize {
        self.samples.lock().unwrap().len()
    }

    /// Answers to requests sent at or after `t`.
    pub fn since(&self, t: Instant) -> Vec<Sample> {
        self.samples
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.at >= t)
            .cloned()
            .collect()
    }

    /// Waits until `n` more answers than now have come (the load made progress).
    pub fn wait_answers(&self, n: usize, timeout: Duration) {
        let target = self.count() + n;
        crate::wait_for("answers from the load", timeout, || {
            (self.count() >= target).then_some(())
        });
    }

    /// Stops and returns every answer.
    pub fn finish(mut self) -> Vec<Sample> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            t.join().unwrap();
        }
        std::mem::take(&mut *self.samples.lock().unwrap())
    }
}

impl Drop for Checks {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Many keys of one policy, each offered a steady rate, checked in batches of 64: the load
/// that puts thousands of hot keys in a global policy's exchange. `targets` pairs a
/// daemon's port with the keys offered there; every key is checked once per sweep (a
/// sweep lasts at least `sweep`, from [`MANY_KEYS_THREADS`] threads per target), each
/// check costing what `rate` units/s come to over the last sweep: a longer sweep offers
/// the same units in fewer, larger checks.
pub struct ManyKeys {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

pub const MANY_KEYS_THREADS: usize = 4;

impl ManyKeys {
    pub fn start(
        policy: &str,
        targets: Vec<(u16, Vec<String>)>,
        rate: f64,
        sweep: Duration,
    ) -> ManyKeys {
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        for (port, keys) in targets {
            let keys = Arc::new(keys);
            for t in 0..MANY_KEYS_THREADS {
                let (stop, keys, policy) = (stop.clone(), keys.clone(), policy.to_owned());
                threads.push(std::thread::spawn(move || {
                    let mine: Vec<&String> =
                        keys.iter().skip(t).step_by(MANY_KEYS_THREADS).collect();
                    sweep_until(&stop, port, &policy, &mine, rate, sweep);
                }));
            }
        }
        ManyKeys { stop, threads }
    }
}

fn sweep_until(
    stop: &AtomicBool,
    port: u16,
    policy: &str,
    keys: &[&String],
    rate: f64,
    min_sweep: Duration,
) {
    let mut cost = (rate * min_sweep.as_secs_f64()).ceil().max(1.0) as u64;
    while !stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        let batches = keys.len().div_ceil(64).max(1) as u32;
        for (i, chunk) in keys.chunks(64).enumerate() {
            // Batches spread over the sweep, as many clients' traffic would be: one burst
            // of every key would queue behind itself in Redis.
            let due = started + min_sweep * i as u32 / batches;
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
            let checks: Vec<serde_json::Value> = chunk
                .iter()
                .map(|k| serde_json::json!({"policy": policy, "key": k, "cost": cost}))
                .collect();
            let body = serde_json::json!({ "checks": checks }).to_string();
            let _ = crate::http(port, "POST", "/v1/check", Some("application/json"), &body);
            if stop.load(Ordering::Relaxed) {
                return;
            }
        }
        let sweep = started.elapsed().max(min_sweep);
        cost = (rate * sweep.as_secs_f64()).ceil().max(1.0) as u64;
        std::thread::sleep(sweep.saturating_sub(started.elapsed()));
    }
}

impl Drop for ManyKeys {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
