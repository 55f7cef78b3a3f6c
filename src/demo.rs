//! `quotad demo`: regions on this machine (three unless `--regions` says otherwise, up to
//! ten) sharing one global budget, with a load generator that moves demand between them,
//! a cut and a heal of one region, and a live table of what each region is offered,
//! enforces and admits.
//!
//! It is built from the test kit, the same parts the multi-region tests use: a real
//! `redis-server` per region when one is on PATH (else the embedded store), a daemon per
//! region served in this process (the same `app::serve` as `quotad serve`, each with its
//! coordinator), the fault proxy between every two regions (how a region is cut off and
//! healed), and the open-loop load generator. Ctrl-C (or the end of the script) stops the
//! load, the daemons and the redis-servers.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use quotad_daemon::Settings;
use quotad_testkit::load::{Answer, Load, ManyKeys, admitted_between, max_admitted_in_window};
use quotad_testkit::proxy::{Leg, LegHandle, Proxy};
use quotad_testkit::{Config, Global, Peer, Policy, Quotad, RedisServer, redis_available};

/// Region names in escrow order; a demo of n regions runs the first n.
const NAMES: [&str; MAX_REGIONS] = [
    "us-east",
    "eu-west",
    "ap-south",
    "sa-east",
    "af-south",
    "me-central",
    "ap-northeast",
    "eu-north",
    "us-west",
    "ap-southeast",
];
pub(crate) const MAX_REGIONS: usize = 10;
pub(crate) const MAX_KEYS: usize = 100_000;
const RHO: u64 = 1000;
const BURST: u64 = 200;
const COST: u64 = 5;
/// The `bulk` policy of `--keys`: per key, ρ 10/s; each key offered 2 units/s in one
/// region (key i in region i mod n), so it is hot there and, where that region's escrow
/// is below 2/s, borrows.
const BULK_RHO: u64 = 10;
/// Its burst: at ten regions the smallest weight (1 of 24) still holds two units of it
/// at its escrow (the config refuses less than one).
const BULK_BURST: u64 = 5 * BULK_RHO;
const BULK_OFFERED: f64 = 2.0;

/// What to run.
pub struct Demo {
    pub regions: usize,
    pub embedded: bool,
    /// Keys of the `bulk` policy (0: none).
    pub keys: usize,
    pub duration: Duration,
}

/// Rounds, leases and the lock: the defaults, and with more than 1,000 bulk keys what a
/// round of that many keys takes on a small machine (every region's daemon and Redis,
/// and the load, on the same cores).
fn timing(keys: usize) -> (Duration, Duration, Duration) {
    if keys > 1000 {
        (
            Duration::from_secs(3),
            Duration::from_secs(12),
            Duration::from_secs(15),
        )
    } else {
        (
            Duration::from_secs(1),
            Duration::from_secs(10),
            Duration::from_secs(3),
        )
    }
}

/// How often each bulk key is checked: every 500 ms up to 2,000 keys; beyond, the same
/// units in fewer, larger checks, so that the bulk load stays at 4,000 checks/s: on two
/// cores the regions' redis-servers need the rest for their rounds' book writes.
fn bulk_sweep(keys: usize) -> Duration {
    Duration::from_secs_f64((keys as f64 / 4000.0).max(0.5))
}

fn bulk_key(i: usize) -> String {
    format!("bulk-{i:06}")
}

/// One step of the script: from `at` seconds, offered units per second per region.
struct Step {
    at: u64,
    offered: Vec<f64>,
    event: Event,
}

#[derive(Clone, Copy, PartialEq)]
enum Event {
    None,
    Cut(usize),
    Heal(usize),
}

/// Escrow weights: 6 / 3 / 1 for the first three regions (60/30/10% of three), 2 for
/// each further one.
fn weights(n: usize) -> Vec<u32> {
    (0..n)
        .map(|i| [6, 3, 1].get(i).copied().unwrap_or(2))
        .collect()
}

/// 1,200 units/s (1.2 x the budget) in all: first mostly in the first region, then mostly
/// in the last one, which is then cut off and healed.
fn script(n: usize) -> Vec<Step> {
    let last = n - 1;
    // `heavy` units/s in region `r`, the rest of the 1,200 spread evenly over the others.
    let mostly = |r: usize, heavy: f64| -> Vec<f64> {
        let rest = (1200.0 - heavy) / (n - 1) as f64;
        (0..n).map(|i| if i == r { heavy } else { rest }).collect()
    };
    let step = |at, offered, event| Step { at, offered, event };
    vec![
        step(0, mostly(0, 900.0), Event::None),
        step(25, mostly(last, 900.0), Event::None),
        step(45, mostly(last, 900.0), Event::Cut(last)),
        step(65, mostly(last, 900.0), Event::Heal(last)),
    ]
}

#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("cannot start redis-server: {0}")]
    Redis(String),
    #[error("a daemon stopped")]
    DaemonStopped,
    /// A region's config that the daemon would refuse (checked before any daemon starts).
    #[error("region {region}: {errors}")]
    Config {
        region: &'static str,
        errors: String,
    },
}

/// The regions: their stores, daemons, and the proxies between them.
struct Regions {
    n: usize,
    /// `legs[a][b]`: the direction a → b (requests of a to b, answers of a to b's).
    legs: Vec<Vec<LegHandle>>,
    daemons: Vec<Quotad>,
    _proxies: Vec<Proxy>,
    redis: Vec<RedisServer>,
}

impl Regions {
    fn start(n: usize, use_redis: bool, keys: usize) -> Result<Regions, DemoError> {
        let redis: Vec<RedisServer> = if use_redis {
            (0..n)
                .map(|_| RedisServer::try_start().map_err(DemoError::Redis))
                .collect::<Result<_, _>>()?
        } else {
            Vec::new()
        };
        let legs: Vec<Vec<LegHandle>> = (0..n)
            .map(|_| {
                (0..n)
                    .map(|_| Arc::new(Mutex::new(Leg::default())))
                    .collect()
            })
            .collect();
        // proxies[a][b]: how region a reaches region b; started before the daemons, whose
        // configs name them.
        let mut proxies: Vec<Vec<Option<Proxy>>> =
            (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
        for (a, row) in proxies.iter_mut().enumerate() {
            for (b, slot) in row.iter_mut().enumerate().filter(|(b, _)| *b != a) {
                *slot = Some(Proxy::start(legs[a][b].clone(), legs[b][a].clone()));
            }
        }
        // Every config is checked before any daemon starts: a refused one is the demo's
        // error, not a daemon's panic.
        let configs: Vec<String> = (0..n)
            .map(|me| {
                let store = redis.get(me).map_or("memory".to_owned(), |r| r.url());
                let urls: Vec<String> = proxies[me]
                    .iter()
                    .map(|p| p.as_ref().map_or(String::new(), Proxy::url))
                    .collect();
                checked_config(n, me, &store, &urls, keys)
            })
            .collect::<Result<_, _>>()?;
        let daemons: Vec<Quotad> = configs.iter().map(|c| Quotad::serve(c)).collect();
        for row in &proxies {
            for (b, p) in row.iter().enumerate() {
                if let Some(p) = p {
                    p.set_target(daemons[b].port);
                }
            }
        }
        Ok(Regions {
            n,
            legs,
            daemons,
            _proxies: proxies.into_iter().flatten().flatten().collect(),
            redis,
        })
    }

    /// Cuts region `r` off from every peer (both directions), or heals it.
    fn set_cut(&self, r: usize, cut: bool) {
        for other in (0..self.n).filter(|&o| o != r) {
            for (a, b) in [(r, other), (other, r)] {
                self.legs[a][b]
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .cut = cut;
            }
        }
    }

    /// What each region's metrics (and redis-server) say now.
    fn exchanged(&self) -> Vec<Exchanged> {
        self.daemons
            .iter()
            .enumerate()
            .map(|(r, d)| Exchanged::read(d, self.redis.get(r)))
            .collect()
    }

    fn urls(&self) -> Vec<Vec<String>> {
        self.daemons.iter().map(|d| vec![d.url()]).collect()
    }
}

/// [`region_config`], as the daemon would take it (a refused one is the demo's error).
fn checked_config(
    n: usize,
    me: usize,
    store: &str,
    peer_urls: &[String],
    keys: usize,
) -> Result<String, DemoError> {
    let config = region_config(n, me, store, peer_urls, keys);
    match Settings::parse("demo.toml", &config) {
        Ok(_) => Ok(config),
        Err(e) => Err(DemoError::Config {
            region: NAMES[me],
            errors: e.to_string(),
        }),
    }
}

fn region_config(n: usize, me: usize, store: &str, peer_urls: &[String], keys: usize) -> String {
    let (round, lease, lock) = timing(keys);
    let secs = |d: Duration| format!("{}s", d.as_secs());
    let mut config = Config::redis(store)
        .region(NAMES[me])
        .coordinator("secret", "demo-secret-not-for-production")
        .coordinator("lock", secs(lock))
        .coordinator("max_exchange_keys", (keys as i64 + 1000).max(10_000));
    for (j, url) in peer_urls.iter().enumerate().filter(|(j, _)| *j != me) {
        config = config.peer(Peer::new(NAMES[j], url));
    }
    let escrow: Vec<(&str, u32)> = NAMES.iter().copied().zip(weights(n)).collect();
    let global = || {
        Global::escrow(&escrow)
            .set("round", secs(round))
            .set("lease", secs(lease))
    };
    config = config.policy(
        Policy::new("api", "token_bucket", RHO, "1s")
            .burst(BURST)
            .on_store_error("closed")
            .global(global()),
    );
    if keys > 0 {
        config = config.policy(
            Policy::new("bulk", "token_bucket", BULK_RHO, "1s")
                .burst(BULK_BURST)
                .on_store_error("closed")
                .global(global()),
        );
    }
    config.to_toml()
}

/// The region's enforced rate for the demo key, from its `/v1/status`.
fn share(daemon: &Quotad, region: usize) -> Option<f64> {
    let (_, text) = daemon.try_get("/v1/status")?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let p = &v["policies"][0];
    let key = p["keys"]
        .as_array()?
        .iter()
        .find(|k| k["key"] == "customer-42");
    match key {
        Some(k) => k["enforced"].as_f64(),
        None => p["escrow"][NAMES[region]].as_f64(),
    }
}

fn print_header(use_redis: bool, daemons: &[Quotad], keys: usize) {
    let n = daemons.len();
    let w = weights(n);
    let total: u32 = w.iter().sum();
    let escrow: Vec<String> = w
        .iter()
        .map(|x| format!("{:.0}", 100.0 * f64::from(*x) / f64::from(total)))
        .collect();
    println!(
        "quotad demo: {n} regions ({}), global budget {RHO}/s, burst 200, escrow {} %",
        if use_redis {
            "a redis-server each"
        } else {
            "embedded store: no redis-server on PATH"
        },
        escrow.join("/")
    );
    for (i, d) in daemons.iter().enumerate() {
        let a = format!("127.0.0.1:{}", d.port);
        println!(
            "  {:<12} http://{a}  (try: curl http://{a}/v1/status)",
            NAMES[i]
        );
    }
    let (round, lease, _) = timing(keys);
    if keys > 0 {
        println!(
            "  and {keys} keys of policy bulk ({BULK_RHO}/s each), each offered {BULK_OFFERED}/s in one region (a check every {:.1} s); rounds of {} s",
            bulk_sweep(keys).as_secs_f64(),
            round.as_secs()
        );
    }
    println!(
        "A region lends nothing for the first lease(1+e)+margin = {:.1} s after it starts (learning\n\
         period): until then each enforces its escrow. Ctrl-C stops everything.\n",
        lease.as_secs_f64() * 1.001 + 0.1
    );
    let mut names = format!("{:>4} ", "t");
    let mut units = format!("{:>4} ", "s");
    for name in &NAMES[..n] {
        names += &format!(" {name:^26}");
        units += &format!(" {:^26}", "offered enforced admitted");
    }
    println!("{names} {:>6}", "total");
    println!("{units} {:>6}", "/s");
}

/// Applies the script's steps that start at second `t`.
fn play(steps: &[Step], t: u64, load: &Load, offered: &mut Vec<f64>, regions: &Regions) {
    for s in steps.iter().filter(|s| s.at == t) {
        offered.clone_from(&s.offered);
        for (r, x) in s.offered.iter().enumerate() {
            load.set_rate(r, *x);
        }
        match s.event {
            Event::Cut(r) => {
                regions.set_cut(r, true);
                println!(
                    "---- {} cut off from every peer: falls back to its escrow within lease(1+e)+margin ----",
                    NAMES[r]
                );
            }
            Event::Heal(r) => {
                regions.set_cut(r, false);
                println!("---- {} reconnected ----", NAMES[r]);
            }
            Event::None if t > 0 => println!("---- demand moves ----"),
            Event::None => {}
        }
    }
}

/// One row: second `t`, per region offered, enforced and admitted (units sent in the
/// last second and allowed), and the total admitted.
fn row(t: u64, offered: &[f64], load: &Load, regions: &Regions) -> String {
    let answers = load.answers();
    let (from, to) = (load.elapsed() - 1.0, load.elapsed());
    let mut row = format!("{t:>4}  ");
    let mut total = 0;
    for (r, d) in regions.daemons.iter().enumerate() {
        let admitted = admitted_between(&answers, r, from, to);
        total += admitted;
        let enforced = match share(d, r) {
            Some(s) => format!("{s:8.0}"),
            None => format!("{:>8}", "-"),
        };
        row += &format!("{:7.0} {enforced} {admitted:8}  ", offered[r]);
    }
    format!("{row}{total:>5}")
}

/// Runs the demo of `n` regions (2 to [`MAX_REGIONS`]) until the script ends or `stop` is
/// cancelled (Ctrl-C). Blocking: the daemons and the load generator run on runtimes of
/// their own.
pub fn run(demo: Demo, stop: CancellationToken) -> Result<(), DemoError> {
    let Demo {
        regions: n,
        embedded,
        keys,
        duration,
    } = demo;
    let use_redis = !embedded && redis_available();
    let regions = Regions::start(n, use_redis, keys)?;
    print_header(use_redis, &regions.daemons, keys);
    let load = Load::start(regions.urls(), "api", "customer-42", COST);
    let bulk = (keys > 0).then(|| {
        let targets = regions
            .daemons
            .iter()
            .enumerate()
            .map(|(r, d)| (d.port, (r..keys).step_by(n).map(bulk_key).collect()))
            .collect();
        ManyKeys::start("bulk", targets, BULK_OFFERED, bulk_sweep(keys))
    });
    let before = regions.exchanged();
    let steps = script(n);
    let started = Instant::now();
    let mut offered = vec![0.0; n];
    let mut outcome = Ok(());
    // When demand moved and when the cut healed, on the load's clock: τ5 is timed from there.
    let mut changes: Vec<(&str, f64)> = Vec::new();
    for t in 0.. {
        for s in steps.iter().filter(|s| s.at == t && t > 0) {
            match s.event {
                Event::None => changes.push(("demand moved", load.elapsed())),
                Event::Heal(_) => changes.push(("the heal", load.elapsed())),
                Event::Cut(_) => {}
            }
        }
        play(&steps, t, &load, &mut offered, &regions);
        let next = started + Duration::from_secs(t + 1);
        while Instant::now() < next && !stop.is_cancelled() {
            std::thread::sleep(Duration::from_millis(20).min(next - Instant::now()));
        }
        if stop.is_cancelled() {
            break;
        }
        println!("{}", row(t + 1, &offered, &load, &regions));
        if started.elapsed() >= duration {
            break;
        }
        if regions
            .daemons
            .iter()
            .any(|d| d.try_get("/healthz").is_none())
        {
            outcome = Err(DemoError::DaemonStopped);
            break;
        }
    }
    drop(bulk);
    let answers = load.answers();
    let (most, at) = max_admitted_in_window(&answers, 1.0);
    println!(
        "\ncustomer-42: at most {most} units admitted in any 1 s window (at {at:.1} s; bound rho + burst = {})",
        RHO + BURST
    );
    print_convergence(&answers, &changes, timing(keys).1);
    if keys > 0 {
        print_exchange(&regions, &before);
    }
    load.finish();
    drop(regions);
    println!("\nstopped: daemons shut down, redis-servers stopped.");
    outcome
}

/// τ5 (the simulator's definition, `quotad_sim::metrics`): the time from each change until
/// the admissions of the last second, over every region, are within 5% of what one token
/// bucket for the whole budget (the central oracle) admits of the same requests, and stay
/// so for 5 s. And the utilisation after the learning period: admitted over what the
/// oracle admits.
fn print_convergence(answers: &[Answer], changes: &[(&str, f64)], lease: Duration) {
    use quotad_sim::metrics::{central_decisions, tau5_ticks};
    const TICK: f64 = 0.01;
    let mut sorted: Vec<&Answer> = answers.iter().collect();
    sorted.sort_by(|a, b| a.sent.total_cmp(&b.sent));
    let stream: Vec<(i64, u64)> = sorted
        .iter()
        .map(|a| ((a.sent * 1e6) as i64, a.cost))
        .collect();
    let central = central_decisions(&stream, RHO as f64, BURST as f64);
    let end = sorted.last().map_or(0.0, |a| a.sent);
    let ticks = (end / TICK) as usize + 1;
    let (mut ours, mut oracle) = (vec![0u32; ticks], vec![0u32; ticks]);
    let learned = lease.as_secs_f64() * 1.001 + 0.1;
    let (mut ours_after, mut oracle_after) = (0u64, 0u64);
    for (a, c) in sorted.iter().zip(&central) {
        let i = ((a.sent / TICK) as usize).min(ticks - 1);
        if a.allowed {
            ours[i] += a.cost as u32;
        }
        if *c {
            oracle[i] += a.cost as u32;
        }
        if a.sent >= learned {
            ours_after += if a.allowed { a.cost } else { 0 };
            oracle_after += if *c { a.cost } else { 0 };
        }
    }
    for (what, at) in changes {
        let tau = tau5_ticks(&ours, &oracle, TICK, &[*at]);
        println!(
            "customer-42: τ5 after {what} (at {at:.0} s): {}",
            tau.map_or("did not settle".to_owned(), |t| format!("{t:.1} s"))
        );
    }
    if oracle_after > 0 {
        println!(
            "customer-42: admitted {:.3} of what one bucket for the budget would have, from {learned:.0} s on (the cut included)",
            ours_after as f64 / oracle_after as f64
        );
    }
}

/// What a region's metrics say of its exchanges and rounds, at one moment.
#[derive(Clone, Copy, Default)]
struct Exchanged {
    rounds: f64,
    round_seconds: f64,
    bytes_sent: f64,
    keys_sent: f64,
    tracked: f64,
    cpu_seconds: f64,
    coordinator_cpu: f64,
    redis_cpu: Option<f64>,
}

impl Exchanged {
    fn read(d: &Quotad, redis: Option<&RedisServer>) -> Exchanged {
        let text = d.try_get("/metrics").map(|(_, t)| t).unwrap_or_default();
        // Summed over every series of `name` whose labels contain `with`.
        let sum = |name: &str, with: &str| -> f64 {
            text.lines()
                .filter(|l| l.starts_with(name) && l.contains(with))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum()
        };
        Exchanged {
            rounds: sum("quotad_rounds_total ", ""),
            round_seconds: sum("quotad_round_duration_seconds_sum", ""),
            bytes_sent: sum("quotad_exchange_bytes_total{", "direction=\"sent\""),
            keys_sent: sum("quotad_exchange_keys_total{", ""),
            tracked: sum("quotad_hot_keys{", "policy=\"bulk\""),
            cpu_seconds: sum("process_cpu_seconds_total ", ""),
            coordinator_cpu: sum("quotad_coordinator_cpu_seconds_total ", ""),
            redis_cpu: redis.and_then(RedisServer::cpu_seconds),
        }
    }
}

/// Per region, since the start: keys tracked, rounds and their mean time, bytes sent per
/// round and per key reported, the CPU of its coordinator thread and of its redis-server;
/// and the CPU of the whole demo process (the daemons run in it, beside the load
/// generator).
fn print_exchange(regions: &Regions, before: &[Exchanged]) {
    println!("\nbulk keys' exchange, per region since the start:");
    println!(
        "{:<12} {:>8} {:>7} {:>12} {:>12} {:>10} {:>20} {:>14}",
        "region",
        "tracked",
        "rounds",
        "round mean",
        "bytes/round",
        "bytes/key",
        "coordinator CPU (s)",
        "Redis CPU (s)"
    );
    let mut cpu = 0.0;
    for (r, (now, b)) in regions.exchanged().iter().zip(before).enumerate() {
        let rounds = (now.rounds - b.rounds).max(1.0);
        let keys = (now.keys_sent - b.keys_sent).max(1.0);
        let bytes = now.bytes_sent - b.bytes_sent;
        cpu = now.cpu_seconds - b.cpu_seconds;
        let redis = match (now.redis_cpu, b.redis_cpu) {
            (Some(n), Some(b)) => format!("{:.1}", n - b),
            _ => "-".to_owned(),
        };
        println!(
            "{:<12} {:>8.0} {:>7.0} {:>9.0} ms {:>12.0} {:>10.1} {:>20.1} {:>14}",
            NAMES[r],
            now.tracked,
            rounds,
            1000.0 * (now.round_seconds - b.round_seconds) / rounds,
            bytes / rounds,
            bytes / keys,
            now.coordinator_cpu - b.coordinator_cpu,
            redis
        );
    }
    println!("CPU of the demo process (daemons and load): {cpu:.0} s");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every region count the demo offers, with `--keys`, gives each region a config the
    /// daemon takes: among others, every region holds at least one unit of each policy's
    /// burst at its escrow.
    #[test]
    fn every_region_count_gives_configs_the_daemon_takes() {
        for n in 2..=MAX_REGIONS {
            let urls: Vec<String> = (0..n)
                .map(|i| format!("http://127.0.0.1:{}", 9000 + i))
                .collect();
            for me in 0..n {
                if let Err(e) = checked_config(n, me, "redis://127.0.0.1:6379", &urls, 1) {
                    panic!("{n} regions: {e}");
                }
            }
        }
    }
}
