//! Global budgets between real processes: a redis-server and quotad daemon(s) per region on
//! loopback, every peer link through a fault proxy (delay, jitter, loss, one-way cuts),
//! and an open-loop load generator that moves demand between regions. Shares are read
//! from `/v1/status`; the admission bound is checked on every answer the generator got.
//!
//! Process daemons (`Quotad::start`): daemons are killed (SIGKILL) and restarted, and the
//! instances of a region must fail independently of each other and of the test.

use quotad_testkit as common;

use std::time::{Duration, Instant};

use common::cluster::RedisCluster;
use common::load::{Answer, Load, admitted_between, max_admitted_in_window};
use common::proxy::{Leg, LegHandle, Proxy};
use common::{Config, Global, Peer, Policy, Quotad, RedisServer, wait_for};
use quotad_core::coordinator::{GlobalPolicy, Mode, Params};
use serde_json::Value;

/// Regions, sorted by name (their ids in the protocol).
const REGIONS: [&str; 3] = ["ap", "eu", "us"];
const WEIGHTS: [f64; 3] = [1.0, 3.0, 6.0];
const RHO: f64 = 1000.0;
const BURST: f64 = 100.0;
const COST: u64 = 5;
const SECRET: &str = "integration-test-secret-0123456789";
const ROUND: Duration = Duration::from_millis(500);
/// Two seconds (four rounds): what the fallback and restart phases wait on is D(1+ε) + m,
/// so a short lease keeps them short; nothing asserted depends on its length otherwise.
const LEASE: Duration = Duration::from_secs(2);
const LOCK: Duration = Duration::from_secs(2);
/// One-way delays: ap-eu 110 ms, ap-us 80 ms, eu-us 40 ms (half the design's RTTs).
const DELAY_MS: [[u64; 3]; 3] = [[0, 110, 80], [110, 0, 40], [80, 40, 0]];

/// What a deployment runs: the tests use short leases so that fallbacks fit in a test;
/// the comparison with the simulator uses the simulator's settings.
struct Setup {
    round: Duration,
    lease: Duration,
    burst: f64,
    /// Uniform jitter added to every one-way delay, up to this.
    jitter: Duration,
    /// Keys may have their own limits (`[policy.runtime_limits]`): the regions then pull
    /// each other's changes every round.
    runtime_limits: bool,
}

const TEST: Setup = Setup {
    round: ROUND,
    lease: LEASE,
    burst: BURST,
    jitter: Duration::ZERO,
    runtime_limits: false,
};

fn params() -> Params {
    Params {
        round_us: ROUND.as_micros() as i64,
        lease_us: LEASE.as_micros() as i64,
        ..Params::default()
    }
}

fn policy() -> GlobalPolicy {
    GlobalPolicy::from_weights("g", 1, RHO, BURST, &WEIGHTS, Mode::Proportional)
}

/// What a region keeps its state in.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Backing {
    /// One redis-server.
    Redis,
    /// Its own Redis Cluster of 3 masters (and 3 replicas).
    Cluster,
}

enum RegionStore {
    Redis(RedisServer),
    Cluster(RedisCluster),
}

impl RegionStore {
    fn start(backing: Backing) -> Self {
        match backing {
            Backing::Redis => RegionStore::Redis(RedisServer::start()),
            Backing::Cluster => RegionStore::Cluster(RedisCluster::start()),
        }
    }

    /// The region's store. What these tests measure is the coordination, not Redis's
    /// latency: on the busy 2-core machine a call can take over the default 50 ms, and
    /// would answer fail_closed, which the checks' assertions read as a wrong answer. No
    /// test here stops a Redis.
    fn config(&self) -> Config {
        match self {
            RegionStore::Redis(r) => Config::redis(&r.url()),
            RegionStore::Cluster(c) => Config::cluster(&c.seeds()),
        }
        .store("timeout", "2s")
    }

    fn masters(&self) -> Vec<&RedisServer> {
        match self {
            RegionStore::Redis(r) => vec![r],
            RegionStore::Cluster(c) => c.masters(),
        }
    }
}

/// A region's daemons, its Redis, and the proxies its peers call it through.
struct Region {
    store: RegionStore,
    daemons: Vec<Quotad>,
}

struct Deployment {
    regions: Vec<Region>,
    /// legs[a][b]: messages from region a to region b.
    legs: Vec<Vec<LegHandle>>,
    _proxies: Vec<Proxy>,
}

fn config(me: usize, store: Config, peer_urls: &[Vec<String>], setup: &Setup) -> String {
    let ms = |d: Duration| format!("{}ms", d.as_millis());
    let mut c = store
        .region(REGIONS[me])
        .coordinator("secret", SECRET)
        .coordinator("lock", ms(LOCK));
    for (j, urls) in peer_urls.iter().enumerate().filter(|(j, _)| *j != me) {
        c = c.peer(Peer::with_urls(REGIONS[j], urls));
    }
    let escrow: Vec<(&str, u32)> = REGIONS.into_iter().zip(WEIGHTS.map(|w| w as u32)).collect();
    // ρ, the burst and the weights are whole numbers here (the config takes integers).
    let mut p = Policy::new("g", "token_bucket", RHO as u64, "1s")
        .burst(setup.burst as u64)
        .on_store_error("closed");
    if setup.runtime_limits {
        p = p.runtime_limits(1000);
    }
    c.policy(
        p.global(
            Global::escrow(&escrow)
                .set("lease", ms(setup.lease))
                .set("round", ms(setup.round)),
        ),
    )
    .to_toml()
}

impl Deployment {
    /// `instances[r]` daemons in region r, all sharing r's Redis.
    fn start(instances: [usize; 3]) -> Deployment {
        Self::start_with(instances, &TEST, Backing::Redis)
    }

    fn start_with(instances: [usize; 3], setup: &Setup, backing: Backing) -> Deployment {
        let legs: Vec<Vec<LegHandle>> = (0..3)
            .map(|a| {
                (0..3)
                    .map(|b| {
                        let d = Duration::from_millis(DELAY_MS[a][b]);
                        std::sync::Arc::new(std::sync::Mutex::new(Leg {
                            delay: d,
                            jitter: if setup.jitter.is_zero() {
                                d / 4
                            } else {
                                setup.jitter
                            },
                            ..Leg::default()
                        }))
                    })
                    .collect()
            })
            .collect();
        // proxies[a][b][i]: region a calling instance i of region b.
        let proxies: Vec<Vec<Vec<Proxy>>> = (0..3)
            .map(|a| {
                (0..3)
                    .map(|b| {
                        (0..if a == b { 0 } else { instances[b] })
                            .map(|_| Proxy::start(legs[a][b].clone(), legs[b][a].clone()))
                            .collect()
                    })
                    .collect()
            })
            .collect();
        let mut regions = Vec::new();
        for (me, n) in instances.iter().enumerate() {
            let store = RegionStore::start(backing);
            let urls: Vec<Vec<String>> = (0..3)
                .map(|b| proxies[me][b].iter().map(Proxy::url).collect())
                .collect();
            let text = config(me, store.config(), &urls, setup);
            let daemons: Vec<Quotad> = (0..*n).map(|_| Quotad::start(&text)).collect();
            regions.push(Region { store, daemons });
        }
        for row in &proxies {
            for (b, list) in row.iter().enumerate() {
                for (i, p) in list.iter().enumerate() {
                    p.set_target(regions[b].daemons[i].port);
                }
            }
        }
        Deployment {
            regions,
            legs,
            _proxies: proxies.into_iter().flatten().flatten().collect(),
        }
    }

    fn urls(&self) -> Vec<Vec<String>> {
        self.regions
            .iter()
            .map(|r| r.daemons.iter().map(Quotad::url).collect())
            .collect()
    }

    /// Cuts (or heals) messages from a to b.
    fn cut(&self, a: usize, b: usize, cut: bool) {
        self.legs[a][b].lock().unwrap().cut = cut;
    }

    fn set_drop(&self, p: f64) {
        for row in &self.legs {
            for leg in row {
                leg.lock().unwrap().drop = p;
            }
        }
    }

    fn isolate(&self, r: usize, cut: bool) {
        for o in (0..3).filter(|&o| o != r) {
            self.cut(r, o, cut);
            self.cut(o, r, cut);
        }
    }

    /// The status of the region's coordinating instance, if one coordinates.
    fn leader_status(&self, r: usize) -> Option<Value> {
        self.regions[r].daemons.iter().find_map(|d| {
            let (code, text) = d.try_get("/v1/status")?;
            let v: Value = serde_json::from_str(&text).ok()?;
            (code == 200 && v["coordinator"]["leader"] == true).then_some(v)
        })
    }

    /// The rate region r enforces for key `k` (its escrow while the key is cold there).
    fn enforced(&self, r: usize) -> Option<f64> {
        let s = self.leader_status(r)?;
        let p = &s["policies"][0];
        let key = p["keys"].as_array()?.iter().find(|k| k["key"] == "k");
        Some(match key {
            Some(k) => k["enforced"].as_f64()?,
            None => p["escrow"][REGIONS[r]].as_f64()?,
        })
    }
}

/// How long a phase's shares must stay within 5% of ρ of their targets before it ends
/// early (six rounds).
const HOLD: f64 = 3.0;

/// How long a phase may take to settle (30 rounds) before the test fails. This is
/// liveness, not speed: shares settle within 2.5 s on a quiet machine (printed; the
/// release figures are in docs/global-budgets.md), but in a debug build beside the
/// other tests and the simulator gate on two loaded cores, the load generator's own
/// jitter kept shares outside the 5% band for up to 7 s. How fast they settle is the
/// simulator's measurement (τ5, reconvergence), where time is deterministic.
const SETTLE: f64 = 15.0;

/// Samples of every region's enforced rate: (seconds since the load started, rates).
struct Trace(Vec<(f64, [f64; 3])>);

impl Trace {
    /// Polls the three regions every 25 ms until `until` (load seconds). A time read off
    /// the trace is late by up to one poll (plus the three status requests), so the poll
    /// is kept short next to the 500 ms round.
    fn record(&mut self, d: &Deployment, load: &Load, until: f64) {
        while load.elapsed() < until {
            self.sample(d, load);
        }
    }

    fn sample(&mut self, d: &Deployment, load: &Load) {
        let rates = [0, 1, 2].map(|r| d.enforced(r).unwrap_or(f64::NAN));
        self.0.push((load.elapsed(), rates));
        std::thread::sleep(Duration::from_millis(25));
    }

    /// Records from `from` until every region in `which` has stayed within 5% of ρ of
    /// `target` for [`HOLD`], or for `longest` seconds; returns [`Self::settled`] over what
    /// was recorded, and the end of the recording. A phase that has converged need not
    /// wait out a fixed window: what it asserts is when the shares settled, and that they
    /// stayed.
    fn record_until_settled(
        &mut self,
        d: &Deployment,
        load: &Load,
        (from, longest): (f64, f64),
        target: &[f64; 3],
        which: &[usize],
    ) -> (Option<f64>, f64) {
        loop {
            self.sample(d, load);
            let now = load.elapsed();
            let settled = self.settled(from, f64::INFINITY, target, which);
            let held = settled.is_some_and(|t| now - (from + t) >= HOLD);
            if held || now >= from + longest {
                return (settled, now);
            }
        }
    }

    /// The first time after `from` from which every region in `which` stays within 5% of ρ
    /// of `target` until `to` (the measurement window of τ5 in the simulator, on shares).
    fn settled(&self, from: f64, to: f64, target: &[f64; 3], which: &[usize]) -> Option<f64> {
        let ok = |r: &[f64; 3]| {
            which
                .iter()
                .all(|&i| (r[i] - target[i]).abs() <= 0.05 * RHO)
        };
        let window: Vec<&(f64, [f64; 3])> = self
            .0
            .iter()
            .filter(|(t, _)| *t >= from && *t < to)
            .collect();
        let last_bad = window.iter().rposition(|(_, r)| !ok(r));
        match last_bad {
            None => window.first().map(|(t, _)| *t - from),
            Some(i) if i + 1 < window.len() => Some(window[i + 1].0 - from),
            Some(_) => None,
        }
    }

    /// The first time after `from` from which every region in `which` stayed within 5% of
    /// ρ of `target` for `hold` seconds (seconds after `from`).
    fn held(&self, from: f64, hold: f64, target: &[f64; 3], which: &[usize]) -> Option<f64> {
        let ok = |r: &[f64; 3]| {
            which
                .iter()
                .all(|&i| (r[i] - target[i]).abs() <= 0.05 * RHO)
        };
        let mut start: Option<f64> = None;
        for (t, r) in self.0.iter().filter(|(t, _)| *t >= from) {
            if !ok(r) {
                start = None;
                continue;
            }
            let s = *start.get_or_insert(*t);
            if t - s >= hold {
                return Some(s - from);
            }
        }
        None
    }

    fn dump(&self, from: f64, to: f64) -> String {
        self.0
            .iter()
            .filter(|(t, _)| *t >= from && *t < to)
            .map(|(t, r)| format!("{t:6.1}s ap {:7.1} eu {:7.1} us {:7.1}", r[0], r[1], r[2]))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

fn targets(demand: [f64; 3], pinned: [bool; 3]) -> [f64; 3] {
    let t = policy().allocate(&params(), &demand, &pinned);
    [t[0], t[1], t[2]]
}

fn assert_bound(answers: &[Answer]) {
    assert_bound_with(answers, RHO, BURST);
}

/// Demand moves from us to ap; ap is cut off while hot and healed; a one-way cut; us's
/// daemon is killed and restarted; 5% message loss throughout. Shares follow demand, a
/// cut-off region runs on exactly its escrow, and admissions never exceed ρW + B in any
/// 1 s window.
#[test]
fn three_regions_rebalance_fall_back_heal_and_keep_the_bound() {
    cut_heal_restart(Backing::Redis);
}

/// The same with each region on its own 3-master Redis Cluster, through the heal (the
/// one-way cut and the restart are the single-Redis run's): every global script runs in
/// the policy's slot, and the coordinator's per-round commands to each master are counted
/// and printed.
#[test]
fn three_regions_on_redis_clusters_keep_the_bound() {
    cut_heal_restart(Backing::Cluster);
}

fn cut_heal_restart(backing: Backing) {
    let mut d = Deployment::start_with([1, 1, 1], &TEST, backing);
    // 5% of the exchange messages are lost on every link, throughout.
    d.set_drop(0.05);
    let load = Load::start(d.urls(), "g", "k", COST);
    let mut trace = Trace(Vec::new());
    let (ap, eu, us) = (0, 1, 2);
    let escrow = policy().escrow;

    // Phase 1: all demand in us.
    load.set_rate(us, 1500.0);
    let t1 = targets([0.0, 0.0, 1500.0], [false; 3]);
    let (settle1, end1) = trace.record_until_settled(&d, &load, (0.0, SETTLE), &t1, &[0, 1, 2]);
    println!("phase 1 targets {t1:?}: settled after {settle1:?} s");
    assert!(
        settle1.is_some(),
        "us never reached its share:\n{}",
        trace.dump(0.0, end1)
    );

    // Phase 2: demand moves from us to ap in one step.
    let step_at = load.elapsed();
    load.set_rate(us, 0.0);
    load.set_rate(ap, 1500.0);
    let t2 = targets([1500.0, 0.0, 0.0], [false; 3]);
    let (tau, end2) = trace.record_until_settled(&d, &load, (step_at, SETTLE), &t2, &[0, 1, 2]);
    println!("phase 2 (demand moves us -> ap) targets {t2:?}: converged after {tau:?} s");
    assert!(
        tau.is_some(),
        "no convergence within {SETTLE} s:\n{}",
        trace.dump(step_at, end2)
    );

    // Phase 3: ap (hot, borrowing) is cut off from both peers; eu gets demand too.
    load.set_rate(eu, 800.0);
    let cut_at = load.elapsed();
    d.isolate(ap, true);
    trace.record(&d, &load, cut_at + 9.0);
    let fallback_bound = params().fallback_bound_us() as f64 / 1e6;
    let fallback = trace
        .0
        .iter()
        .filter(|(t, _)| *t >= cut_at)
        .find(|(_, r)| (r[ap] - escrow[ap]).abs() < 1e-6)
        .map(|(t, _)| t - cut_at);
    println!(
        "phase 3: ap back on its escrow {} after {fallback:?} s (bound {fallback_bound:.3} s)",
        escrow[ap]
    );
    let fallback = fallback
        .unwrap_or_else(|| panic!("ap never fell back:\n{}", trace.dump(cut_at, cut_at + 9.0)));
    assert!(
        fallback <= fallback_bound + 0.25,
        "fallback took {fallback} s"
    );
    // ... and from then on runs on exactly its escrow, serving.
    for (t, r) in trace
        .0
        .iter()
        .filter(|(t, _)| *t >= cut_at + fallback_bound + 0.2)
    {
        assert!((r[ap] - escrow[ap]).abs() < 1e-6, "ap at {} at {t}", r[ap]);
    }
    // Over the last 5 s of the cut, all of them after the fallback bound.
    let served = admitted_between(&load.answers(), ap, cut_at + 4.0, cut_at + 9.0) as f64 / 5.0;
    println!(
        "phase 3: ap admitted {served:.1}/s while cut off (escrow {})",
        escrow[ap]
    );
    assert!(
        served >= 0.8 * escrow[ap] && served <= escrow[ap] + BURST / 5.0 + 1.0,
        "{served}"
    );
    // us and eu keep rebalancing among themselves, ap pinned at its escrow.
    // They have rebalanced once they held their targets for a lease (recorded on, ap still
    // cut off, until they have). Not "and stayed to the end of the cut": on a starved
    // 2-core box (debug daemons beside the other tests) a stall past the test's 2 s lease
    // lapses part of a loan for a moment now and then (in two clean clones, dips of up to
    // 0.3 s, 2.6-2.9 s apart), which is the lease doing its job.
    let t3 = targets([1500.0, 800.0, 0.0], [true, false, false]);
    let lease = LEASE.as_secs_f64();
    let rebalanced = loop {
        let held = trace.held(cut_at, lease, &t3, &[eu, us]);
        if held.is_some() || load.elapsed() >= cut_at + SETTLE {
            break held;
        }
        trace.sample(&d, &load);
    };
    let end3 = load.elapsed();
    println!("phase 3 targets {t3:?}: us/eu settled after {rebalanced:?} s");
    assert!(
        rebalanced.is_some(),
        "us/eu did not rebalance within {SETTLE} s:\n{}",
        trace.dump(cut_at, end3)
    );

    // Phase 4: heal.
    let heal_at = load.elapsed();
    d.isolate(ap, false);
    let t4 = targets([1500.0, 800.0, 0.0], [false; 3]);
    let (reconverged, end4) =
        trace.record_until_settled(&d, &load, (heal_at, SETTLE), &t4, &[0, 1, 2]);
    println!("phase 4 (heal) targets {t4:?}: reconverged after {reconverged:?} s");
    assert!(
        reconverged.is_some(),
        "no reconvergence within {SETTLE} s:\n{}",
        trace.dump(heal_at, end4)
    );

    // The one-way cut and the lender's restart are the single-Redis run's: on clusters
    // the phases above already run every script in the policy's slot, and the run is the
    // suite's longest (66 s of a clean clone's 221 s of tests with them).
    if backing == Backing::Redis {
        // Phase 5: a one-way cut: nothing from us reaches ap (ap's requests to us arrive,
        // the answers do not; us's requests to ap are lost), for 4 s (two leases).
        let one_way_at = load.elapsed();
        d.cut(us, ap, true);
        trace.record(&d, &load, one_way_at + 4.0);
        d.cut(us, ap, false);
        trace.record(&d, &load, one_way_at + 6.0);

        // Phase 6: us (the lender) is killed and restarted.
        let kill_at = load.elapsed();
        d.regions[us].daemons[0].kill();
        while load.elapsed() < kill_at + 3.0 {
            std::thread::sleep(Duration::from_millis(100));
        }
        d.regions[us].daemons[0].restart();
        // The restarted lender takes over its books from Redis and lends again at once.
        trace.record(&d, &load, kill_at + 9.0);
    }
    let answers = load.finish();
    println!("{} answers", answers.len());
    assert_bound(&answers);
    assert!(
        answers.iter().filter(|a| a.status == 200).count() * 10 >= answers.len() * 9,
        "most checks answered"
    );
    for r in &d.regions {
        for m in r.store.masters() {
            m.assert_every_key_has_ttl();
        }
    }
    report_round_trips(&d);
}

/// With the load stopped, what each master of each region serves in 3 s: the coordinator's
/// rounds (every ROUND) and the daemons' once-a-second health PING and invalidation
/// heartbeat (PUBLISH), from INFO commandstats. Commands are an upper bound on round trips
/// (a pipeline is one round trip for several).
fn report_round_trips(d: &Deployment) {
    let calls = |m: &RedisServer| -> std::collections::BTreeMap<String, u64> {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut m.conn())
            .unwrap();
        info.lines()
            .filter_map(|l| {
                let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
                let calls = rest.split(',').find_map(|f| f.strip_prefix("calls="))?;
                Some((name.to_owned(), calls.parse().ok()?))
            })
            .collect()
    };
    let quiet = Duration::from_secs(3);
    let rounds = quiet.as_secs_f64() / ROUND.as_secs_f64();
    let before: Vec<Vec<_>> = d
        .regions
        .iter()
        .map(|r| r.store.masters().into_iter().map(calls).collect())
        .collect();
    std::thread::sleep(quiet);
    for (i, r) in d.regions.iter().enumerate() {
        for (m, was) in r.store.masters().into_iter().zip(&before[i]) {
            let now = calls(m);
            let per_round: Vec<String> = now
                .iter()
                .filter_map(|(name, n)| {
                    // Less the INFO that read `was` (counted once it completed).
                    let mine = u64::from(name.as_str() == "info");
                    let d = n - was.get(name).copied().unwrap_or(0) - mine;
                    (d > 0).then(|| format!("{name} {:.1}", d as f64 / rounds))
                })
                .collect();
            println!(
                "{} master :{} per round ({:?}): {}",
                REGIONS[i],
                m.port,
                ROUND,
                per_round.join(", ")
            );
        }
    }
}

/// Two instances share us's Redis: one coordinates; killed, the other takes over within
/// one lock period, peers find it through their URL lists, and the bound holds.
#[test]
fn a_standby_instance_takes_over_within_one_lock_period() {
    let mut d = Deployment::start([1, 1, 2]);
    let load = Load::start(d.urls(), "g", "k", COST);
    let (ap, us) = (0, 2);
    load.set_rate(ap, 1500.0);
    let leader = wait_for("a coordinator in us", Duration::from_secs(10), || {
        d.regions[us].daemons.iter().position(|q| {
            q.try_get("/v1/status")
                .and_then(|(_, t)| serde_json::from_str::<Value>(&t).ok())
                .is_some_and(|v| v["coordinator"]["leader"] == true)
        })
    });
    // Let ap borrow from us before the kill.
    wait_for("ap borrowing", Duration::from_secs(15), || {
        (d.enforced(ap)? > 500.0).then_some(())
    });
    let killed = Instant::now();
    d.regions[us].daemons[leader].kill();
    let other = 1 - leader;
    wait_for("the standby to coordinate", Duration::from_secs(10), || {
        let (_, t) = d.regions[us].daemons[other].try_get("/v1/status")?;
        let v: Value = serde_json::from_str(&t).ok()?;
        (v["coordinator"]["leader"] == true).then_some(())
    });
    let takeover = killed.elapsed();
    println!("takeover after {takeover:?} (lock period {LOCK:?})");
    assert!(takeover <= LOCK, "took {takeover:?}");
    // The new coordinator trades with the peers again (through their second URL).
    wait_for(
        "exchanges with the new coordinator",
        Duration::from_secs(10),
        || {
            let s = d.leader_status(us)?;
            let peers = s["peers"].as_array()?;
            peers.iter().all(|p| p["link"] == "connected").then_some(())
        },
    );
    std::thread::sleep(Duration::from_secs(4));
    let answers = load.finish();
    assert_bound(&answers);
}

/// docs/simulator.md's comparison: the same demand step (S2: ap rises from
/// 10% to 65% of the demand within 1 s while us drops, at 1.2x the budget) with the same
/// WAN delays, lease and round, run by the simulator (10 seeds) and by real processes
/// (one run). Prints η and τ5 side by side; asserts only that both stay within the
/// design's targets' neighbourhood, since one real run is one sample.
#[test]
#[ignore = "a benchmark of about 100 s: cargo test --release --test suite multi_region::sim_and_real -- --ignored --nocapture"]
fn sim_and_real_agree_on_a_demand_step() {
    use quotad_sim::metrics::{central_decisions, tau5_ticks};
    use quotad_sim::scenario::Load as SimLoad;
    use quotad_sim::{ModeKind, Scenario, SuiteOptions, run_suite};

    const WARMUP: f64 = 30.0;
    const MEASURED: f64 = 60.0;
    const STEP: f64 = 20.0;
    // The simulator orders regions us, eu, ap; the deployment by name: ap, eu, us.
    let (steady, stepped) = ([720.0, 360.0, 120.0], [60.0, 360.0, 780.0]);
    let by_name = |v: [f64; 3]| [v[2], v[1], v[0]];

    let mut sc = Scenario::by_id("S2").unwrap();
    sc.duration_s = MEASURED;
    sc.warmup_s = WARMUP;
    sc.steps_s = vec![STEP];
    sc.load = SimLoad::Schedule(vec![
        (STEP, steady.to_vec()),
        (STEP + 1.0, stepped.to_vec()),
    ]);
    let (rho, burst) = (sc.rho, sc.burst);
    let suite = run_suite(&SuiteOptions {
        scenarios: vec![sc.clone()],
        modes: vec![ModeKind::Lease],
        first_seed: 0,
        seeds: 10,
        threads: 2,
    });
    let sim = suite
        .rows
        .iter()
        .find(|r| r.mode == "lease")
        .expect("lease row");

    let setup = Setup {
        round: Duration::from_micros(sc.params.round_us as u64),
        lease: Duration::from_micros(sc.params.lease_us as u64),
        burst,
        jitter: Duration::from_millis(10),
        runtime_limits: false,
    };
    let d = Deployment::start_with([1, 1, 1], &setup, Backing::Redis);
    let load = Load::start(d.urls(), "g", "k", 1);
    let set = |v: [f64; 3]| {
        for (r, x) in by_name(v).iter().enumerate() {
            load.set_rate(r, *x);
        }
    };
    set(steady);
    let wait_until = |t: f64| {
        while load.elapsed() < t {
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    wait_until(WARMUP + STEP);
    for i in 1..=10 {
        let f = i as f64 / 10.0;
        set([0, 1, 2].map(|k| steady[k] + (stepped[k] - steady[k]) * f));
        wait_until(WARMUP + STEP + f);
    }
    wait_until(WARMUP + MEASURED);
    let answers = load.finish();

    // Central: one bucket over the very same requests, in the order they were sent.
    let mut reqs: Vec<&Answer> = answers
        .iter()
        .filter(|a| a.sent < WARMUP + MEASURED)
        .collect();
    reqs.sort_by(|a, b| a.sent.total_cmp(&b.sent));
    let stream: Vec<(i64, u64)> = reqs
        .iter()
        .map(|a| ((a.sent * 1e6) as i64, a.cost))
        .collect();
    let central = central_decisions(&stream, rho, burst);
    let tick = 0.01;
    let ticks = (MEASURED / tick) as usize;
    let (mut ours, mut theirs) = (vec![0u32; ticks], vec![0u32; ticks]);
    for (a, c) in reqs.iter().zip(&central) {
        let t = a.sent - WARMUP;
        if t < 0.0 {
            continue;
        }
        let i = ((t / tick) as usize).min(ticks - 1);
        if a.allowed {
            ours[i] += a.cost as u32;
        }
        if *c {
            theirs[i] += a.cost as u32;
        }
    }
    let eta =
        ours.iter().map(|&x| x as f64).sum::<f64>() / theirs.iter().map(|&x| x as f64).sum::<f64>();
    let tau = tau5_ticks(&ours, &theirs, tick, &[STEP]);
    println!(
        "\nS2 (step at {STEP} s of {MEASURED} s measured, after {WARMUP} s warm-up), lease {:?}, round {:?}",
        setup.lease, setup.round
    );
    println!("| run | η | τ5 (s) |");
    println!("|---|---|---|");
    println!(
        "| simulator, 10 seeds (mean / min η; mean / max τ5) | {:.3} / {:.3} | {} / {} |",
        sim.utilization,
        sim.utilization_min,
        sim.tau5_s.map_or("-".into(), |t| format!("{t:.1}")),
        sim.tau5_max_s.map_or("-".into(), |t| format!("{t:.1}"))
    );
    println!(
        "| real processes, one run | {eta:.3} | {} |",
        tau.map_or("-".into(), |t| format!("{t:.1}"))
    );
    assert_bound_with(&answers, rho, burst);
    assert!(eta > 0.9, "η {eta}");
}

fn assert_bound_with(answers: &[Answer], rho: f64, burst: f64) {
    let (max, at) = max_admitted_in_window(answers, 1.0);
    println!(
        "max admitted in any 1 s window: {max} (bound {})",
        rho + burst
    );
    assert!(
        max as f64 <= rho + burst,
        "{max} admitted in the 1 s window from {at:.2}s"
    );
}

/// Region r's policy `g` as its coordinator runs it (`in_force` of `/v1/status`).
fn in_force(d: &Deployment, r: usize) -> Option<Value> {
    let s = d.leader_status(r)?;
    let p = s["policies"][0]["in_force"].clone();
    (!p.is_null()).then_some(p)
}

/// Rewrites region r's config file with escrow `weights` at `version` and sends SIGHUP.
fn resplit(d: &Deployment, r: usize, weights: [i64; 3], version: i64) {
    let q = &d.regions[r].daemons[0];
    let file = q.dir.path().join("quotad.toml");
    let mut doc: common::toml::Table = std::fs::read_to_string(&file).unwrap().parse().unwrap();
    let global = doc["policy"].as_array_mut().unwrap()[0]
        .as_table_mut()
        .unwrap()
        .get_mut("global")
        .unwrap()
        .as_table_mut()
        .unwrap();
    let escrow: common::toml::Table = REGIONS
        .iter()
        .zip(weights)
        .map(|(r, w)| (r.to_string(), common::toml::Value::Integer(w)))
        .collect();
    global.insert("escrow".into(), escrow.into());
    global.insert("version".into(), common::toml::Value::Integer(version));
    std::fs::write(&file, doc.to_string()).unwrap();
    q.hup();
}

/// The sum of the escrows in force, read increasing region first (ap), so that a raise
/// seen there was preceded by the lowering read after it.
fn escrow_sum(d: &Deployment) -> f64 {
    (0..3)
        .map(|r| in_force(d, r).map_or(0.0, |p| p["escrow"].as_f64().unwrap()))
        .sum()
}

/// A re-split by hot reload, ap 100 -> 600, us 600 -> 100 (ρ = 1000), rolled out
/// increasing region first: ap installs version 2 but keeps 100 while the others run
/// version 1; a re-split without a version bump is refused; us lowers to 100 the moment
/// it reloads; ap rises to 600 once every region reported version 2 applied. The escrows
/// in force never sum above ρ, and checks under load answer decisions throughout.
#[test]
fn a_resplit_rolls_out_by_reload_decrease_first() {
    let d = Deployment::start([1, 1, 1]);
    let applied = |d: &Deployment, r: usize, v: u64| {
        in_force(d, r).filter(|p| p["applied"] == v && p["resplit_pending"] == false)
    };
    for r in 0..3 {
        wait_for("version 1 in force", Duration::from_secs(20), || {
            applied(&d, r, 1)
        });
    }
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let loads: Vec<_> = (0..3)
        .map(|r| {
            let (port, stop) = (d.regions[r].daemons[0].port, stop.clone());
            std::thread::spawn(move || {
                let body = serde_json::json!({"policy": "g", "key": "k"}).to_string();
                let mut bad = Vec::new();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let (status, _, text) =
                        common::http(port, "POST", "/v1/check", Some("application/json"), &body)
                            .unwrap();
                    if status != 200 || text.contains("fail_") {
                        bad.push(format!("{status} {text}"));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                bad
            })
        })
        .collect();

    resplit(&d, 0, [6, 3, 1], 2);
    wait_for("ap installs version 2", Duration::from_secs(5), || {
        in_force(&d, 0).filter(|p| p["version"] == 2)
    });
    // Four rounds: ap stays at 100 (an increase waits for every region).
    let until = Instant::now() + ROUND * 4;
    while Instant::now() < until {
        let p = in_force(&d, 0).unwrap();
        assert_eq!(p["escrow"], 100.0, "ap raised before us lowered: {p}");
        assert!(escrow_sum(&d) <= RHO + 1e-6);
        std::thread::sleep(Duration::from_millis(50));
    }

    // eu's file gets the new split without a version bump: refused, eu keeps running v1.
    resplit(&d, 1, [6, 3, 1], 1);
    let eu = &d.regions[1].daemons[0];
    wait_for("the refusal counted", Duration::from_secs(5), || {
        (eu.metric("quotad_config_reloads_total{result=\"refused\"}") >= 1.0).then_some(())
    });
    assert!(eu.log().contains("needs a higher policy.global.version"));

    resplit(&d, 2, [6, 3, 1], 2);
    wait_for("us lowers to 100 at once", Duration::from_secs(3), || {
        in_force(&d, 2).filter(|p| p["version"] == 2 && p["escrow"] == 100.0)
    });
    resplit(&d, 1, [6, 3, 1], 2);
    let raised = Instant::now();
    let p = wait_for("ap at 600", Duration::from_secs(10), || {
        assert!(escrow_sum(&d) <= RHO + 1e-6);
        in_force(&d, 0).filter(|p| p["escrow"] == 600.0)
    });
    println!(
        "ap raised {:?} after the last region reloaded: {p}",
        raised.elapsed()
    );
    assert_eq!(
        p["regions_applied"],
        serde_json::json!({"ap": 2, "eu": 2, "us": 2})
    );
    for r in 0..3 {
        wait_for("version 2 applied", Duration::from_secs(5), || {
            applied(&d, r, 2)
        });
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for l in loads {
        let bad = l.join().unwrap();
        assert!(
            bad.is_empty(),
            "{} bad answers: {:?}",
            bad.len(),
            bad.first()
        );
    }
}

/// The numbers region `r` decides `key` under now (a peek): its limit and where it came
/// from.
fn numbers(d: &Deployment, r: usize, key: &str) -> (u64, String) {
    let (status, body) = d.regions[r].daemons[0].check(&serde_json::json!({
        "policy": "g", "key": key, "cost": 0
    }));
    assert_eq!(status, 200, "{body}");
    (
        body["limit"].as_u64().unwrap_or(0),
        body["limit_source"].as_str().unwrap_or("").to_owned(),
    )
}

/// Waits until every region in `which` decides `key` under `limit` from `source`; the
/// seconds it took.
fn until_everywhere(d: &Deployment, which: &[usize], key: &str, limit: u64, source: &str) -> f64 {
    let start = Instant::now();
    for &r in which {
        wait_for(
            &format!("{} on {limit} from {source}", REGIONS[r]),
            Duration::from_secs(10),
            || (numbers(d, r, key) == (limit, source.to_owned())).then_some(()),
        );
    }
    start.elapsed().as_secs_f64()
}

fn between(answers: &[Answer], from: f64, to: f64) -> Vec<Answer> {
    answers
        .iter()
        .filter(|a| a.sent >= from && a.received < to)
        .copied()
        .collect()
}

/// A key's own limit set in one region reaches the others (pulled every round), and the
/// rule for a change in flight holds: set to 300/s in us, it reaches eu and ap; with ap cut
/// off, lowered to 100/s in us, it reaches eu but not ap, which keeps 300/s on its escrow
/// until it hears; then set to 150/s in ap, still cut off: the newest write, it is what
/// every region has after the heal (the last write wins, whichever region made it). The
/// three together never admit more than the largest numbers any of them has (300/s plus
/// its burst in any 1 s window) while the changes spread, and once every region has 150/s,
/// never more than 150/s plus its burst. A delete in ap brings the policy's numbers back
/// everywhere. Offered: 1,200 units/s over the three regions throughout.
#[test]
fn a_keys_own_limit_reaches_every_region_and_holds_through_a_cut() {
    let setup = Setup {
        runtime_limits: true,
        ..TEST
    };
    let d = Deployment::start_with([1, 1, 1], &setup, Backing::Redis);
    let (ap, eu, us) = (0, 1, 2);
    let load = Load::start(d.urls(), "g", "k", COST);
    load.set_rate(ap, 300.0);
    load.set_rate(eu, 300.0);
    load.set_rate(us, 600.0);
    let put = |r: usize, limit: u64| {
        let (status, body) = d.regions[r].daemons[0].admin(
            "PUT",
            "/v1/limits/g/k",
            Some(&serde_json::json!({"limit": limit, "burst": limit})),
        );
        assert_eq!(status, 200, "{body}");
    };

    put(us, 300);
    let spread = until_everywhere(&d, &[us, eu, ap], "k", 300, "runtime");
    println!("300/s set in us: in every region after {spread:.2} s");

    d.isolate(ap, true);
    let cut_at = load.elapsed();
    put(us, 100);
    let spread = until_everywhere(&d, &[us, eu], "k", 100, "runtime");
    println!("100/s set in us with ap cut off: in eu after {spread:.2} s");
    // ap cannot hear it: it keeps the old numbers, on its escrow once its loans end.
    let fallback = params().fallback_bound_us() as f64 / 1e6;
    while load.elapsed() < cut_at + fallback + 2.0 {
        assert_eq!(
            numbers(&d, ap, "k"),
            (300, "runtime".to_owned()),
            "ap heard through a cut"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // A write in ap, still cut off: the newest, so it wins everywhere after the heal.
    put(ap, 150);
    assert_eq!(numbers(&d, ap, "k"), (150, "runtime".to_owned()));
    let heal_at = load.elapsed();
    d.isolate(ap, false);
    let spread = until_everywhere(&d, &[us, eu, ap], "k", 150, "runtime");
    let everywhere = load.elapsed();
    println!("after the heal, ap's newer 150/s in every region after {spread:.2} s");
    // A round for the last decisions under the old numbers to pass, then 5 s on the new.
    std::thread::sleep(Duration::from_secs(1));
    let settled = load.elapsed();
    std::thread::sleep(Duration::from_secs(5));
    let answers = load.answers();

    println!("while the changes spread (ap cut off on 300/s then 150/s, the others on 100/s):");
    assert_bound_with(&between(&answers, cut_at, everywhere), 300.0, 300.0);
    println!("once every region had 150/s:");
    assert_bound_with(&between(&answers, settled, load.elapsed()), 150.0, 150.0);
    let cut = between(&answers, cut_at + fallback, heal_at);
    let admitted: u64 = cut.iter().filter(|a| a.allowed).map(|a| a.cost).sum();
    println!(
        "admitted while cut, after the fallback: {:.0}/s",
        admitted as f64 / (heal_at - cut_at - fallback)
    );

    // Gone, from another region: the policy's numbers everywhere again.
    let (status, body) = d.regions[ap].daemons[0].admin("DELETE", "/v1/limits/g/k", None);
    assert_eq!(status, 200, "{body}");
    let spread = until_everywhere(&d, &[ap, eu, us], "k", RHO as u64, "config");
    println!("deleted in ap: the policy's numbers everywhere after {spread:.2} s");
    // Counted: every region pulled from each peer, and ap took what it missed.
    for r in [ap, eu, us] {
        for p in (0..3).filter(|&p| p != r) {
            let series = format!(
                "quotad_runtime_limit_pulls_total{{outcome=\"ok\",peer=\"{}\"}}",
                REGIONS[p]
            );
            let pulled = d.regions[r].daemons[0].metric(&series);
            assert!(pulled > 0.0, "{}: {series} {pulled}", REGIONS[r]);
        }
    }
    // ap took the 300/s, and found us's 100/s older than its own 150/s.
    let merged = |result: &str| -> f64 {
        [eu, us]
            .map(|p| {
                d.regions[ap].daemons[0].metric(&format!(
                    "quotad_runtime_limit_merges_total{{peer=\"{}\",result=\"{result}\"}}",
                    REGIONS[p]
                ))
            })
            .iter()
            .sum()
    };
    assert!(
        merged("taken") >= 1.0,
        "ap took {} changes",
        merged("taken")
    );
    assert!(merged("older") >= 1.0, "ap found {} older", merged("older"));
    load.finish();
}
