//! Stateful tests that look for the next place where features meet: random interleavings
//! of what clients and operators do, against real daemons and real redis-servers, with
//! the answer or the bound checked after every step.
//!
//! - Two instances on one Redis (`two_instances_answer_every_step_as_the_model_does`):
//!   checks, peeks, batches, resets through either instance, reloads of both (every
//!   parameter of every algorithm: limits, bursts, a window with and without a version
//!   bump, an override added, changed and removed), rollouts that reach one instance only
//!   (the two then run two configs on the same keys until a later reload), reservations
//!   settled at random costs and charges into debt, and a concurrency limit's leases;
//!   every answer is compared with a model. Counts that a change never reaches in the
//!   test (a sliding log, the settling bucket) have a model of their own here; the fixed
//!   and sliding windows, GCRA and token bucket are modeled by `quotad_core::algorithm`,
//!   the reference model with the transition rule in it, run at the instance's own
//!   numbers and the instant they came into force there. Instance B's Redis user may not
//!   PUBLISH: a reset through it is either done (the model resets) or refused with
//!   nothing changed, and every later answer of either instance must agree. Each case
//!   uses keys of its own; proptest shrinks a failure to its shortest sequence.
//! - Two regions sharing one global budget
//!   (`two_regions_keep_the_bound_through_resets_and_reloads`): demand moving between
//!   the regions (so loans are made), resets of the key in either region, and re-splits
//!   rolled out by reload in either order; after every step the rates the two regions'
//!   books allow at Redis time must sum to at most ρ.

use quotad_testkit as common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::proxy::{Leg, LegHandle, Proxy};
use common::{Config, Global, Peer, Policy, Quotad, RedisServer, wait_for};
use proptest::prelude::*;
use proptest::test_runner::{Config as RunnerConfig, TestCaseError, TestRunner};
use quotad_core::algorithm::{self, Algorithm, Limits, Since, State, Write};
use quotad_core::coordinator::Params;
use quotad_core::coordinator::bucket::Shape;
use quotad_daemon::testing::federation::{SLOT_FIELDS, decode_default, decode_slot};
use serde_json::{Value, json};

// ------------------------------------------------------------------ two instances

const PASSWORD: &str = "stateful-test-password";
/// Cases of the two-instance test, and the steps of each.
const CASES: u32 = 128;
const MAX_STEPS: usize = 50;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Pol {
    /// sliding_log, 1 h or 2 h: a count that time does not change within the test.
    Log,
    /// token_bucket refilling per day, with settlements: whole tokens that time does not
    /// change either.
    Bucket,
    /// fixed_window and sliding_window of 100 or 200 days, gcra and token_bucket (a burst
    /// of its own) of 1 or 2 days: what time changes in the test is a small fraction of
    /// a unit. Modeled by `quotad_core::algorithm`.
    Fixed,
    Sliding,
    Gcra,
    Tb,
}

/// The policies the reference model decides, in `Rules::core`'s order.
const CORE: [Pol; 4] = [Pol::Fixed, Pol::Sliding, Pol::Gcra, Pol::Tb];

impl Pol {
    fn name(self) -> &'static str {
        match self {
            Pol::Log => "log",
            Pol::Bucket => "bucket",
            Pol::Fixed => "fixed",
            Pol::Sliding => "sliding",
            Pol::Gcra => "gcra",
            Pol::Tb => "tb",
        }
    }

    /// The reference model's algorithm, for the policies it decides.
    fn core(self) -> Option<Algorithm> {
        match self {
            Pol::Fixed => Some(Algorithm::FixedWindow),
            Pol::Sliding => Some(Algorithm::SlidingWindow),
            Pol::Gcra => Some(Algorithm::Gcra),
            Pol::Tb => Some(Algorithm::TokenBucket),
            Pol::Log | Pol::Bucket => None,
        }
    }

    /// The length of `n` windows of this policy, in days.
    fn days(self, n: u64) -> u64 {
        match self {
            Pol::Fixed | Pol::Sliding => 100 * n,
            _ => n,
        }
    }
}

/// The counter of invalidations an instance took off the channel.
const INVALIDATIONS: &str = "quotad_invalidations_received_total";

/// The keys a case draws from; `vip` may get an override of `log`.
const KEYS: [&str; 3] = ["k0", "k1", "vip"];

/// A policy's numbers modeled by `quotad_core`: its limit, its window (1 or 2 of the
/// policy's unit, [`Pol::days`]) and its burst (the buckets'; a window's is its limit).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Numbers {
    limit: u64,
    windows: u64,
    burst: u64,
}

/// What a daemon runs: the models' parameters, written as its config.
#[derive(Debug, Clone, PartialEq)]
struct Rules {
    log_limit: u64,
    log_hours: u64,
    /// `log`'s override for `vip` (same window).
    vip: Option<u64>,
    bucket_limit: u64,
    /// `slots`: a concurrency limit's units held at once.
    slots_limit: u64,
    /// [`CORE`]'s numbers, in its order.
    core: [Numbers; 4],
    /// `gcra`'s override for `vip`: its limit (the policy's window and burst).
    gcra_vip: Option<u64>,
}

const THREE: Numbers = Numbers {
    limit: 3,
    windows: 1,
    burst: 3,
};

const START: Rules = Rules {
    log_limit: 3,
    log_hours: 1,
    vip: None,
    bucket_limit: 3,
    slots_limit: 3,
    core: [THREE; 4],
    gcra_vip: None,
};

impl Rules {
    fn numbers(&self, pol: Pol) -> Numbers {
        self.core[CORE.iter().position(|p| *p == pol).expect("a core policy")]
    }

    /// The limits an instance running these rules decides `pol`'s key under (`vip`: the
    /// case's `vip` key), with `since` (its numbers' instant there).
    fn limits(&self, pol: Pol, vip: bool, since: Since) -> Limits {
        let alg = pol.core().expect("a core policy");
        let n = self.numbers(pol);
        let limit = match (pol, self.gcra_vip) {
            (Pol::Gcra, Some(v)) if vip => v,
            _ => n.limit,
        };
        Limits {
            limit,
            window_us: pol.days(n.windows) as i64 * 86_400_000_000,
            burst: if alg.has_burst() { n.burst } else { limit },
            since,
        }
    }

    /// Whether any window differs from `other`'s (a change that needs a higher version).
    fn windows_differ(&self, other: &Rules) -> bool {
        self.log_hours != other.log_hours
            || CORE
                .iter()
                .any(|p| self.numbers(*p).windows != other.numbers(*p).windows)
    }

    /// These rules with `core`'s modeled parts (a rollout changes only those: the
    /// hand-modeled policies always run the same numbers on both instances).
    fn with_core_of(&self, other: &Rules) -> Rules {
        Rules {
            core: other.core,
            gcra_vip: other.gcra_vip,
            ..self.clone()
        }
    }
}

/// Since when each core policy's numbers (and `gcra`'s override) are in force on one
/// instance, as `reload::stamp_since` stamps them: kept while the numbers and version
/// stay, else the version and the moment of the reload (here a tick that orders the
/// reloads as the daemons' clocks do).
#[derive(Debug, Clone, Default)]
struct Sinces(HashMap<(Pol, bool), Since>);

impl Sinces {
    fn get(&self, pol: Pol, vip: bool) -> Since {
        self.0[&(pol, vip)]
    }

    /// From `old` at `old_v` to `new` at `new_v`, at `tick`.
    fn restamp(&mut self, old: Option<(&Rules, u64)>, new: &Rules, new_v: u64, tick: u64) {
        let fresh = Since {
            version: new_v,
            at_ms: tick,
        };
        let numbers = |r: &Rules, pol, vip| r.limits(pol, vip, Since::ZERO);
        for pol in CORE {
            let kept = old.is_some_and(|(r, v)| {
                v == new_v && numbers(r, pol, false) == numbers(new, pol, false)
            });
            if !kept {
                self.0.insert((pol, false), fresh);
            }
        }
        let had = old.is_some_and(|(r, _)| r.gcra_vip.is_some());
        let kept = had
            && old.is_some_and(|(r, v)| {
                v == new_v && numbers(r, Pol::Gcra, true) == numbers(new, Pol::Gcra, true)
            });
        match new.gcra_vip {
            Some(_) if kept => {}
            Some(_) => {
                self.0.insert((Pol::Gcra, true), fresh);
            }
            None => {
                self.0.remove(&(Pol::Gcra, true));
            }
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Check {
        on: usize,
        pol: Pol,
        key: usize,
        cost: u64,
    },
    /// Distinct (policy, key) pairs.
    Batch {
        on: usize,
        items: Vec<(Pol, usize, u64)>,
    },
    Reset {
        on: usize,
        pol: Pol,
        key: usize,
    },
    /// Both daemons reload `rules`; `bump`: with a version above both instances'.
    Reload {
        rules: Rules,
        bump: bool,
    },
    /// A change that reaches one instance only (so far): `on` reloads the core policies'
    /// part of `rules`; `bump`: with a version above both instances' (a new file's).
    Rollout {
        on: usize,
        rules: Rules,
        bump: bool,
    },
    /// `bucket` takes settlements: a check reserving `estimate`.
    Reserve {
        on: usize,
        key: usize,
        estimate: u64,
    },
    /// Settles the case's reservation number `which` (modulo how many there are; a
    /// reservation nobody made when there is none) at `cost`.
    Settle {
        on: usize,
        which: usize,
        cost: u64,
    },
    /// A cost charged after the work (never denied).
    Charge {
        on: usize,
        key: usize,
        cost: u64,
    },
    /// `slots`, a concurrency limit: `units` held under a lease of an hour.
    Acquire {
        on: usize,
        key: usize,
        units: u64,
    },
    /// Releases the case's lease number `which` (one nobody holds when there is none).
    Release {
        on: usize,
        which: usize,
    },
    /// A reset of a `slots` key: every lease it holds given back.
    ResetSlots {
        on: usize,
        key: usize,
    },
    /// A core policy's key given its own limit at runtime through `on` (`None`: deleted);
    /// through B, which may not PUBLISH, refused with nothing changed.
    Limit {
        on: usize,
        pol: Pol,
        key: usize,
        limit: Option<u64>,
    },
}

const ALL: [Pol; 6] = [
    Pol::Log,
    Pol::Bucket,
    Pol::Fixed,
    Pol::Sliding,
    Pol::Gcra,
    Pol::Tb,
];

/// One of `pols`.
fn pol(pols: Vec<Pol>) -> impl Strategy<Value = Pol> {
    prop::sample::select(pols)
}

fn numbers() -> impl Strategy<Value = Numbers> {
    (2u64..=6, 1u64..=2, 2u64..=8).prop_map(|(limit, windows, burst)| Numbers {
        limit,
        windows,
        burst,
    })
}

fn rules() -> impl Strategy<Value = Rules> {
    (
        (
            2u64..=6,
            1u64..=2,
            prop::option::of(2u64..=8),
            2u64..=6,
            2u64..=4,
        ),
        [numbers(), numbers(), numbers(), numbers()],
        prop::option::of(2u64..=8),
    )
        .prop_map(
            |((log_limit, log_hours, vip, bucket_limit, slots_limit), core, gcra_vip)| Rules {
                log_limit,
                log_hours,
                vip,
                bucket_limit,
                slots_limit,
                core,
                gcra_vip,
            },
        )
}

/// A step on the policies `pols` and keys `keys` (a case dwells on a few, so that what
/// happens to one key in a few steps in a row, a bug's usual recipe, happens often);
/// reservations, settlements and charges when `bucket` is among them.
fn op(pols: Vec<Pol>, keys: Vec<usize>) -> BoxedStrategy<Op> {
    let settling = pols.contains(&Pol::Bucket);
    let pols_all = pols.clone();
    let pol = move || pol(pols.clone());
    let key = move || prop::sample::select(keys.clone());
    let mut arms: Vec<(u32, BoxedStrategy<Op>)> = vec![
        (
            8,
            (0usize..2, pol(), key(), 0u64..=2)
                .prop_map(|(on, pol, key, cost)| Op::Check { on, pol, key, cost })
                .boxed(),
        ),
        (
            2,
            (
                0usize..2,
                prop::collection::vec((pol(), key(), 1u64..=2), 2..=3),
            )
                .prop_map(|(on, mut items)| {
                    let mut seen = Vec::new();
                    items.retain(|(p, k, _)| {
                        let new = !seen.contains(&(*p, *k));
                        seen.push((*p, *k));
                        new
                    });
                    Op::Batch { on, items }
                })
                .boxed(),
        ),
        (
            2,
            (0usize..2, pol(), key())
                .prop_map(|(on, pol, key)| Op::Reset { on, pol, key })
                .boxed(),
        ),
        (
            2,
            (rules(), any::<bool>())
                .prop_map(|(rules, bump)| Op::Reload { rules, bump })
                .boxed(),
        ),
        (
            4,
            (0usize..2, rules(), any::<bool>())
                .prop_map(|(on, rules, bump)| Op::Rollout { on, rules, bump })
                .boxed(),
        ),
        (
            2,
            (0usize..2, key(), 1u64..=2)
                .prop_map(|(on, key, units)| Op::Acquire { on, key, units })
                .boxed(),
        ),
        (
            2,
            (0usize..2, any::<usize>())
                .prop_map(|(on, which)| Op::Release { on, which })
                .boxed(),
        ),
        (
            1,
            (0usize..2, key())
                .prop_map(|(on, key)| Op::ResetSlots { on, key })
                .boxed(),
        ),
    ];
    let core: Vec<Pol> = CORE
        .iter()
        .copied()
        .filter(|p| pols_all.contains(p))
        .collect();
    if !core.is_empty() {
        arms.push((
            3,
            (
                0usize..2,
                prop::sample::select(core),
                key(),
                prop::option::weighted(0.75, 2u64..=8),
            )
                .prop_map(|(on, pol, key, limit)| Op::Limit {
                    on,
                    pol,
                    key,
                    limit,
                })
                .boxed(),
        ));
    }
    if settling {
        arms.extend([
            (
                3,
                (0usize..2, key(), 1u64..=3)
                    .prop_map(|(on, key, estimate)| Op::Reserve { on, key, estimate })
                    .boxed(),
            ),
            (
                3,
                (0usize..2, any::<usize>(), 0u64..=6)
                    .prop_map(|(on, which, cost)| Op::Settle { on, which, cost })
                    .boxed(),
            ),
            (
                1,
                (0usize..2, key(), 0u64..=4)
                    .prop_map(|(on, key, cost)| Op::Charge { on, key, cost })
                    .boxed(),
            ),
        ]);
    }
    prop::strategy::Union::new_weighted(arms).boxed()
}

/// The counts as the store should hold them.
#[derive(Default)]
struct Model {
    /// `log`: entries in the window, by key.
    log: HashMap<String, i64>,
    /// `bucket`: tokens as last written (whole: the refill per day is negligible; below
    /// zero in debt) and the burst they were written under, by key.
    bucket: HashMap<String, (i64, u64)>,
    /// `bucket`'s reservations, in the order made: (key, id, estimate, settled, ended by
    /// a reset of the key).
    reservations: Vec<(usize, String, u64, bool, bool)>,
    /// `slots`: units held, by key; and the leases, in the order acquired: (key, lease,
    /// units, still held).
    held: HashMap<usize, u64>,
    /// And whether a reset of its key gave it back while it was held.
    leases: Vec<(usize, String, u64, bool, bool)>,
    /// The core policies' keys, as the reference model holds them.
    core: HashMap<(Pol, usize), State>,
}

/// A core policy's check or refund of key `k` in the reference model, at `now`.
struct CoreCall {
    pol: Pol,
    k: usize,
    limits: Limits,
    now: i64,
}

/// What a check answers in the model, and what it writes if it stands.
struct Decided {
    allowed: bool,
    remaining: u64,
    write: Pending,
}

enum Pending {
    /// A hand-modeled count or tokens to write (None: nothing).
    Hand(Option<u64>),
    /// The reference model's write, and the call it came from (a refund goes through
    /// the same numbers).
    Core(Write, CoreCall),
}

impl Model {
    fn capacity(rules: &Rules, pol: Pol, key: &str) -> u64 {
        match (pol, rules.vip) {
            (Pol::Log, Some(v)) if key == "vip" => v,
            (Pol::Log, _) => rules.log_limit,
            (Pol::Bucket, _) => rules.bucket_limit,
            _ => unreachable!("the reference model decides {pol:?}"),
        }
    }

    /// (allowed, remaining) of a check, and the state it would write.
    fn decide(&self, rules: &Rules, pol: Pol, key: &str, cost: u64) -> (bool, u64, Option<u64>) {
        let cap = Self::capacity(rules, pol, key);
        let need = cost.max(1);
        match pol {
            Pol::Log => {
                let n = self.log.get(key).copied().unwrap_or(0) as u64;
                if n + need <= cap {
                    (true, cap - n - cost, (cost > 0).then_some(n + cost))
                } else {
                    (false, cap.saturating_sub(n), None)
                }
            }
            Pol::Bucket => {
                let t = self.tokens(cap, key);
                if t >= need as i64 {
                    let left = (t - cost as i64) as u64;
                    (true, left, (cost > 0).then_some(left))
                } else {
                    (false, t.max(0) as u64, None)
                }
            }
            _ => unreachable!("the reference model decides {pol:?}"),
        }
    }

    fn write(&mut self, rules: &Rules, pol: Pol, key: &str, value: u64) {
        match pol {
            Pol::Log => self.log.insert(key.to_owned(), value as i64),
            Pol::Bucket => self.put_tokens(rules, key, value as i64),
            _ => unreachable!("the reference model writes {pol:?}"),
        };
    }

    /// `bucket`'s tokens written under the burst in force.
    fn put_tokens(&mut self, rules: &Rules, key: &str, tokens: i64) -> Option<i64> {
        self.bucket
            .insert(key.to_owned(), (tokens, rules.bucket_limit))
            .map(|t| t.0)
    }

    /// `bucket`'s tokens now under capacity `cap`: what was used carries over from the
    /// burst they were written under (the transition rule: a raise adds the difference,
    /// a lowering takes it, down to empty; a debt carries whole).
    fn tokens(&self, cap: u64, key: &str) -> i64 {
        let Some(&(t, written)) = self.bucket.get(key) else {
            return cap as i64;
        };
        if t < 0 || written == cap {
            return t;
        }
        (t + cap as i64 - written as i64).max(0)
    }

    fn reset(&mut self, pol: Pol, k: usize) {
        match pol {
            Pol::Log => self.log.remove(KEYS[k]).map(|_| ()),
            Pol::Bucket => self.bucket.remove(KEYS[k]).map(|_| ()),
            _ => self.core.remove(&(pol, k)).map(|_| ()),
        };
    }

    /// One operation of a core policy's key in the reference model.
    fn core_apply(&self, call: &CoreCall, op: algorithm::Op) -> algorithm::Outcome {
        let alg = call.pol.core().expect("a core policy");
        let state = self.core.get(&(call.pol, call.k));
        algorithm::apply(alg, &call.limits, state, call.now, op, "")
    }

    fn core_write(&mut self, call: &CoreCall, write: Write) {
        let mut state = self.core.remove(&(call.pol, call.k));
        write.apply_to(&mut state);
        if let Some(st) = state {
            self.core.insert((call.pol, call.k), st);
        }
    }

    /// A check of `cost` of key `k` of `pol` through instance `on` of `pair`, at its own
    /// numbers (and, for a core policy, since when they are in force there).
    fn check(&self, pair: &Pair, on: usize, pol: Pol, k: usize, cost: u64) -> Decided {
        if pol.core().is_none() {
            let (allowed, remaining, write) = self.decide(&pair.rules[on], pol, KEYS[k], cost);
            return Decided {
                allowed,
                remaining,
                write: Pending::Hand(write),
            };
        }
        let call = CoreCall {
            pol,
            k,
            limits: pair.limits(on, pol, k),
            now: now_us(),
        };
        let out = self.core_apply(&call, algorithm::Op::Check { cost });
        Decided {
            allowed: out.verdict.allowed,
            remaining: out.verdict.remaining,
            write: Pending::Core(out.write, call),
        }
    }

    /// Puts what `d` writes (a check that stood).
    fn stand(&mut self, rules: &Rules, pol: Pol, k: usize, d: Decided) {
        match d.write {
            Pending::Hand(Some(w)) => self.write(rules, pol, KEYS[k], w),
            Pending::Hand(None) => {}
            Pending::Core(w, call) => self.core_write(&call, w),
        }
    }

    /// `d`, a check of `cost` admitted in a batch that was denied: written, then refunded.
    fn refunded(&mut self, rules: &Rules, pol: Pol, k: usize, cost: u64, d: Decided) {
        match d.write {
            // A bucket holds what it held before, now written down (a key the batch
            // created stays, full at the burst in force).
            Pending::Hand(Some(_)) if pol == Pol::Bucket => {
                self.write(rules, pol, KEYS[k], d.remaining + cost)
            }
            Pending::Hand(_) => {}
            Pending::Core(w, call) => {
                self.core_write(&call, w);
                let out = self.core_apply(&call, algorithm::Op::Refund { cost });
                self.core_write(&call, out.write);
            }
        }
    }
}

/// The real clock, in microseconds (Redis's, on this machine): read after an answer, so
/// the model's instants fall between the scripts' in the same order.
fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

/// Two daemons on one Redis, A as a user that may PUBLISH and B as one that may not.
struct Pair {
    redis: RedisServer,
    daemons: [Quotad; 2],
    users: [&'static str; 2],
    /// What each runs (the hand-modeled parts are the same on both).
    rules: [Rules; 2],
    /// Each one's policies' `version`: only ever raised, across cases.
    versions: [u64; 2],
    sinces: [Sinces; 2],
    /// Orders the moments numbers came into force, as the daemons' clocks do.
    tick: u64,
    /// Checks of core policies answered while the two ran different numbers of them.
    split_checks: u64,
    /// The case's runtime limits, as both instances have them once a change has reached
    /// them: a key's own limit, or the tick its entry went; with the tick it was set.
    runtime: HashMap<(Pol, usize), (Option<u64>, u64)>,
    /// Runtime-limit changes made (through A).
    limit_changes: u64,
}

impl Pair {
    fn config(url: &str, user: &str, rules: &Rules, version: u64) -> String {
        let v = version as i64;
        let window = format!("{}h", rules.log_hours);
        let mut log = Policy::new("log", "sliding_log", rules.log_limit, &window).set("version", v);
        if let Some(l) = rules.vip {
            // Every case's own `…-vip` key.
            log = log.with_override("glob", "*-vip", l);
        }
        let mut config = Config::redis(url)
            .store("username", user)
            .store("password", PASSWORD)
            .policy(log)
            .policy(
                Policy::new("bucket", "token_bucket", rules.bucket_limit, "1d")
                    .set("settle_within", "1h"),
            )
            .policy(Policy::new("slots", "concurrency", rules.slots_limit, "1h"));
        for pol in CORE {
            let n = rules.numbers(pol);
            let alg = pol.core().expect("core");
            let days = format!("{}d", pol.days(n.windows));
            let mut p = Policy::new(pol.name(), alg.name(), n.limit, &days)
                .set("version", v)
                .runtime_limits(100_000);
            if alg.has_burst() {
                p = p.burst(n.burst);
            }
            if let (Pol::Gcra, Some(l)) = (pol, rules.gcra_vip) {
                p = p.with_override("glob", "*-vip", l);
            }
            config = config.policy(p);
        }
        config.to_toml()
    }

    fn start() -> Pair {
        let pass = format!(">{PASSWORD}");
        let redis = RedisServer::start_with_args(
            false,
            &[
                "--user", "a", "on", &pass, "~*", "&*", "+@all", "--user", "b", "on", &pass, "~*",
                "&*", "+@all", "-publish",
            ],
        );
        let users = ["a", "b"];
        let daemons = users.map(|u| Quotad::start(&Self::config(&redis.url(), u, &START, 1)));
        // Stamped as each started, A first.
        let mut sinces = [Sinces::default(), Sinces::default()];
        for (i, s) in sinces.iter_mut().enumerate() {
            s.restamp(None, &START, 1, i as u64 + 1);
        }
        Pair {
            redis,
            daemons,
            users,
            rules: [START, START],
            versions: [1, 1],
            sinces,
            tick: 2,
            split_checks: 0,
            runtime: HashMap::new(),
            limit_changes: 0,
        }
    }

    /// Whether the two run different numbers of the core policies (a rollout between).
    fn split(&self) -> bool {
        let [a, b] = &self.rules;
        a.core != b.core || a.gcra_vip != b.gcra_vip
    }

    /// The limits instance `on` decides core policy `pol`'s key `k` under: its config's,
    /// under the key's runtime limit (the limit and burst its own, in force since its
    /// write; gone, the config's back since then).
    fn limits(&self, on: usize, pol: Pol, k: usize) -> Limits {
        let vip = KEYS[k] == "vip" && pol == Pol::Gcra && self.rules[on].gcra_vip.is_some();
        let mut l = self.rules[on].limits(pol, vip, self.sinces[on].get(pol, vip));
        let Some(&(limit, tick)) = self.runtime.get(&(pol, k)) else {
            return l;
        };
        let at = Since {
            version: l.since.version,
            at_ms: tick,
        };
        match limit {
            Some(n) => {
                (l.limit, l.burst, l.since) = (n, n, at);
            }
            None => l.since = l.since.max(at),
        }
        l
    }

    /// Daemon `on` reloads `rules` at `version`: the result it counted (the same file:
    /// "ok" without a reload). Applied, the rules and their instants are its own now.
    fn reload(&mut self, on: usize, rules: &Rules, version: u64) -> &'static str {
        let q = &self.daemons[on];
        let text = q.config_file_text(&Self::config(
            &self.redis.url(),
            self.users[on],
            rules,
            version,
        ));
        let file = q.dir.path().join("quotad.toml");
        let old = std::fs::read_to_string(&file).unwrap();
        if text == old {
            return "ok";
        }
        let result = q.reload(&text);
        if result != "ok" {
            // The file again says what runs, so the next reload starts from it.
            std::fs::write(&file, old).unwrap();
            return result;
        }
        self.tick += 1;
        let before = (&self.rules[on], self.versions[on]);
        self.sinces[on].restamp(Some(before), rules, version, self.tick);
        self.rules[on] = rules.clone();
        self.versions[on] = version;
        result
    }

    /// What a reload of `rules` at `version` on `on` must answer: refused when a window
    /// changes without a higher version.
    fn expected(&self, on: usize, rules: &Rules, version: u64) -> &'static str {
        if rules.windows_differ(&self.rules[on]) && version <= self.versions[on] {
            "refused"
        } else {
            "ok"
        }
    }
}

fn check_body(pol: Pol, key: &str, cost: u64) -> Value {
    json!({"policy": pol.name(), "key": key, "cost": cost})
}

/// Runs `ops` on keys of their own (`tag`); an error names the step.
fn run_case(pair: &mut Pair, tag: u64, ops: &[Op]) -> Result<(), TestCaseError> {
    // Every case starts from the same rules, on both (a version above both's, so any
    // window may go back).
    if pair.rules != [START, START] {
        let version = pair.versions[0].max(pair.versions[1]) + 1;
        for on in 0..2 {
            let r = pair.reload(on, &START, version);
            prop_assert_eq!(r, "ok", "back to the start rules on {}", on);
        }
    }
    let key = |k: usize| format!("c{tag}-{}", KEYS[k]);
    let mut model = Model::default();
    pair.runtime.clear();
    for (step, op) in ops.iter().enumerate() {
        let at = format!("step {step}: {op:?}");
        match op {
            Op::Check {
                on,
                pol,
                key: k,
                cost,
            } => {
                let (status, v) = pair.daemons[*on].check(&check_body(*pol, &key(*k), *cost));
                let d = model.check(pair, *on, *pol, *k, *cost);
                if pol.core().is_some() && pair.split() {
                    pair.split_checks += 1;
                }
                prop_assert_eq!(status, 200, "{}: {}", at, v);
                prop_assert_eq!(&v["allowed"], &json!(d.allowed), "{}: {}", at, v);
                prop_assert_eq!(&v["remaining"], &json!(d.remaining), "{}: {}", at, v);
                model.stand(&pair.rules[*on], *pol, *k, d);
            }
            Op::Batch { on, items } => {
                let checks: Vec<Value> = items
                    .iter()
                    .map(|(p, k, c)| check_body(*p, &key(*k), *c))
                    .collect();
                let (status, v) = pair.daemons[*on].check(&json!({"checks": checks}));
                prop_assert_eq!(status, 200, "{}: {}", at, v);
                let decided: Vec<Decided> = items
                    .iter()
                    .map(|(p, k, c)| model.check(pair, *on, *p, *k, *c))
                    .collect();
                let passed = decided.iter().all(|d| d.allowed);
                prop_assert_eq!(&v["allowed"], &json!(passed), "{}: {}", at, v);
                for (i, ((p, k, c), d)) in items.iter().zip(decided).enumerate() {
                    let r = &v["results"][i];
                    prop_assert_eq!(&r["allowed"], &json!(d.allowed), "{} [{}]: {}", at, i, v);
                    prop_assert_eq!(
                        &r["remaining"],
                        &json!(d.remaining),
                        "{} [{}]: {}",
                        at,
                        i,
                        v
                    );
                    if passed {
                        model.stand(&pair.rules[*on], *p, *k, d);
                    } else if d.allowed {
                        model.refunded(&pair.rules[*on], *p, *k, *c, d);
                    }
                }
            }
            Op::Reset { on, pol, key: k } => {
                let body = json!({"policy": pol.name(), "key": key(*k)});
                let other = &pair.daemons[1 - *on];
                let received = other.metric(INVALIDATIONS);
                let (status, _, v) = pair.daemons[*on].post("/v1/reset", &body);
                // Done, or refused with nothing changed (B may not PUBLISH); either way
                // every later answer, from either instance, must agree with the model.
                match status {
                    204 => {
                        model.reset(*pol, *k);
                        // A reset of a `bucket` key ends the reservations open on it.
                        for r in model.reservations.iter_mut() {
                            if *pol == Pol::Bucket && r.0 == *k && !r.3 {
                                r.4 = true;
                            }
                        }
                        // The other instance hears of it through the channel, as fast as
                        // its subscription delivers (a step sent before that could meet a
                        // denial it still remembers: the documented window, not a bug).
                        wait_for("the invalidation delivered", Duration::from_secs(5), || {
                            (other.metric(INVALIDATIONS) > received).then_some(())
                        });
                    }
                    503 => prop_assert_eq!(&v["error"]["code"], "reset_refused", "{}: {}", at, v),
                    _ => prop_assert!(false, "{}: {} {}", at, status, v),
                }
                if *on == 0 {
                    prop_assert_eq!(status, 204, "{}: A may publish: {}", at, v);
                }
            }
            Op::Reload { rules, bump } => {
                // One file for both: a version above both's when they differ (a rollout
                // raised one), so both answer alike.
                let raise = *bump || pair.versions[0] != pair.versions[1];
                let version = pair.versions[0].max(pair.versions[1]) + u64::from(raise);
                for on in 0..2 {
                    let want = pair.expected(on, rules, version);
                    let got = pair.reload(on, rules, version);
                    prop_assert_eq!(got, want, "{} on {}", at, on);
                }
            }
            Op::Rollout { on, rules, bump } => {
                let rules = pair.rules[*on].with_core_of(rules);
                let version = match bump {
                    true => pair.versions[0].max(pair.versions[1]) + 1,
                    false => pair.versions[*on],
                };
                let want = pair.expected(*on, &rules, version);
                let got = pair.reload(*on, &rules, version);
                prop_assert_eq!(got, want, "{}", at);
            }
            Op::Reserve {
                on,
                key: k,
                estimate,
            } => {
                let (allowed, remaining, write) =
                    model.decide(&pair.rules[*on], Pol::Bucket, KEYS[*k], *estimate);
                let body =
                    json!({"policy": "bucket", "key": key(*k), "cost": estimate, "settle": true});
                let (status, v) = pair.daemons[*on].check(&body);
                if *estimate > pair.rules[*on].bucket_limit {
                    prop_assert_eq!(status, 400, "{}: over the capacity: {}", at, v);
                    continue;
                }
                prop_assert_eq!(status, 200, "{}: {}", at, v);
                prop_assert_eq!(&v["allowed"], &json!(allowed), "{}: {}", at, v);
                prop_assert_eq!(&v["remaining"], &json!(remaining), "{}: {}", at, v);
                match (allowed, v["reservation"].as_str()) {
                    (true, Some(id)) => {
                        model
                            .reservations
                            .push((*k, id.to_owned(), *estimate, false, false))
                    }
                    (false, None) => {}
                    _ => prop_assert!(false, "{}: a reservation iff admitted: {}", at, v),
                }
                if let Some(w) = write {
                    model.write(&pair.rules[*on], Pol::Bucket, KEYS[*k], w);
                }
            }
            Op::Settle { on, which, cost } => {
                let cap = pair.rules[*on].bucket_limit;
                let (k, id, estimate, settled, ended) = match model.reservations.len() {
                    0 => (0, "0".repeat(32), 0, false, false),
                    n => model.reservations[which % n].clone(),
                };
                let body =
                    json!({"policy": "bucket", "key": key(k), "reservation": id, "cost": cost});
                let other = &pair.daemons[1 - *on];
                let received = other.metric(INVALIDATIONS);
                let (status, _, v) = pair.daemons[*on].post("/v1/settle", &body);
                let t = model.tokens(cap, KEYS[k]);
                if model.reservations.is_empty() {
                    prop_assert_eq!(status, 404, "{}: {}", at, v);
                } else if settled {
                    prop_assert_eq!(status, 200, "{}: {}", at, v);
                    prop_assert_eq!(&v["status"], "already_settled", "{}: {}", at, v);
                    prop_assert_eq!(&v["remaining"], &json!(t.max(0)), "{}: {}", at, v);
                } else if ended {
                    // A reset of its key ended it: nothing charged or given back.
                    prop_assert_eq!(status, 200, "{}: {}", at, v);
                    prop_assert_eq!(&v["status"], "ended_by_reset", "{}: {}", at, v);
                    prop_assert_eq!(&v["remaining"], &json!(t.max(0)), "{}: {}", at, v);
                } else if *cost < estimate && *on == 1 {
                    // B may not PUBLISH: a give-back is refused whole.
                    prop_assert_eq!(status, 503, "{}: {}", at, v);
                    prop_assert_eq!(&v["error"]["code"], "settle_refused", "{}: {}", at, v);
                } else {
                    let t = if *cost >= estimate {
                        t - (*cost - estimate) as i64
                    } else {
                        (t + (estimate - *cost) as i64).min(cap as i64)
                    };
                    prop_assert_eq!(status, 200, "{}: {}", at, v);
                    prop_assert_eq!(&v["status"], "settled", "{}: {}", at, v);
                    prop_assert_eq!(&v["remaining"], &json!(t.max(0)), "{}: {}", at, v);
                    // At the estimate nothing is charged or given back: nothing is
                    // written (a write would put the key in the numbers in force).
                    if *cost != estimate {
                        model.put_tokens(&pair.rules[*on], KEYS[k], t);
                    }
                    if let Some(r) = model.reservations.iter_mut().find(|r| r.1 == id) {
                        r.3 = true;
                    }
                    if *cost < estimate {
                        // Announced in the settlement's script: the other instance drops
                        // what it remembers as the message arrives (as for a reset).
                        wait_for("the invalidation delivered", Duration::from_secs(5), || {
                            (other.metric(INVALIDATIONS) > received).then_some(())
                        });
                    }
                }
            }
            Op::Charge { on, key: k, cost } => {
                let t = model.tokens(pair.rules[*on].bucket_limit, KEYS[*k]) - *cost as i64;
                let body = json!({"policy": "bucket", "key": key(*k), "cost": cost});
                let (status, _, v) = pair.daemons[*on].post("/v1/charge", &body);
                prop_assert_eq!(status, 200, "{}: {}", at, v);
                prop_assert_eq!(&v["outcome"], "allowed", "{}: {}", at, v);
                prop_assert_eq!(&v["remaining"], &json!(t.max(0)), "{}: {}", at, v);
                model.put_tokens(&pair.rules[*on], KEYS[*k], t);
            }
            Op::Acquire { on, key: k, units } => {
                let held = model.held.get(k).copied().unwrap_or(0);
                let allowed = held + units <= pair.rules[*on].slots_limit;
                let body = json!({"policy": "slots", "key": key(*k), "units": units});
                let (status, _, v) = pair.daemons[*on].post("/v1/acquire", &body);
                prop_assert_eq!(status, 200, "{}: {}", at, v);
                prop_assert_eq!(&v["allowed"], &json!(allowed), "{}: {}", at, v);
                let now = if allowed { held + units } else { held };
                prop_assert_eq!(&v["held"], &json!(now), "{}: {}", at, v);
                if allowed {
                    let lease = v["lease"].as_str().unwrap_or_default().to_owned();
                    model.leases.push((*k, lease, *units, true, false));
                    model.held.insert(*k, now);
                }
            }
            Op::Release { on, which } => {
                let (k, lease, units, live, by_reset) = match model.leases.len() {
                    0 => (0, format!("{}-1", "0".repeat(32)), 0, false, false),
                    n => model.leases[which % n].clone(),
                };
                let body = json!({"policy": "slots", "key": key(k), "lease": lease});
                let (status, _, v) = pair.daemons[*on].post("/v1/release", &body);
                if live {
                    let held = model.held.get(&k).copied().unwrap_or(0) - units;
                    prop_assert_eq!(status, 200, "{}: {}", at, v);
                    prop_assert_eq!(&v["held"], &json!(held), "{}: {}", at, v);
                    model.held.insert(k, held);
                    if let Some(l) = model.leases.iter_mut().find(|l| l.1 == lease) {
                        l.3 = false;
                    }
                } else if by_reset {
                    // A reset gave it back (within its hour): told so, nothing changed.
                    let held = model.held.get(&k).copied().unwrap_or(0);
                    prop_assert_eq!(status, 200, "{}: {}", at, v);
                    prop_assert_eq!(&v["status"], "ended_by_reset", "{}: {}", at, v);
                    prop_assert_eq!(&v["held"], &json!(held), "{}: {}", at, v);
                } else {
                    prop_assert_eq!(status, 404, "{}: {}", at, v);
                }
            }
            Op::Limit {
                on,
                pol,
                key: k,
                limit,
            } => {
                let path = format!("/v1/limits/{}/{}", pol.name(), key(*k));
                let q = &pair.daemons[*on];
                let had = matches!(pair.runtime.get(&(*pol, *k)), Some((Some(_), _)));
                let (status, v) = match limit {
                    Some(n) => q.admin("PUT", &path, Some(&json!({"limit": n}))),
                    None => q.admin("DELETE", &path, None),
                };
                match (*on, limit) {
                    // B may not PUBLISH: refused whole, nothing changed.
                    (1, Some(_)) => {
                        prop_assert_eq!(status, 503, "{}: {}", at, v);
                    }
                    (1, None) if had => prop_assert_eq!(status, 503, "{}: {}", at, v),
                    (_, None) if !had => {
                        prop_assert_eq!(status, 404, "{}: {}", at, v);
                    }
                    _ => {
                        prop_assert_eq!(status, 200, "{}: {}", at, v);
                        // Ordered among the reloads' instants as the clocks order them.
                        pair.tick += 1;
                        pair.runtime.insert((*pol, *k), (*limit, pair.tick));
                        pair.limit_changes += 1;
                        // The other instance applies it as the message arrives.
                        let other = &pair.daemons[1 - *on];
                        let want = pair.limits(1 - *on, *pol, *k).limit;
                        let runtime = limit.is_some();
                        wait_for(
                            "the change on the other instance",
                            Duration::from_secs(5),
                            || {
                                let (_, d) = other.check(&check_body(*pol, &key(*k), 0));
                                let from_runtime = d["limit_source"] == "runtime";
                                (d["limit"] == json!(want) && from_runtime == runtime).then_some(())
                            },
                        );
                    }
                }
            }
            Op::ResetSlots { on, key: k } => {
                let body = json!({"policy": "slots", "key": key(*k)});
                let (status, _, v) = pair.daemons[*on].post("/v1/reset", &body);
                prop_assert_eq!(status, 204, "{}: {}", at, v);
                model.held.insert(*k, 0);
                for l in model.leases.iter_mut().filter(|l| l.0 == *k) {
                    l.4 |= l.3;
                    l.3 = false;
                }
            }
        }
    }
    Ok(())
}

/// Every answer of two instances sharing one Redis (checks, peeks, batches, resets
/// through either, reloads of both, reservations settled and charges into debt, leases
/// acquired and released) is the reference model's.
#[test]
fn two_instances_answer_every_step_as_the_model_does() {
    let mut pair = Pair::start();
    let mut runner = TestRunner::new(RunnerConfig {
        cases: CASES,
        max_shrink_iters: 256,
        failure_persistence: None,
        ..RunnerConfig::default()
    });
    // The runner takes an `Fn`: the daemons and counters behind a RefCell.
    let state = std::cell::RefCell::new((0u64, 0usize));
    let pair = std::cell::RefCell::new(&mut pair);
    let started = Instant::now();
    let ops = (
        prop::sample::subsequence(ALL.to_vec(), 1..=3),
        prop::sample::subsequence(vec![0, 1, 2], 1..=2),
    )
        .prop_flat_map(|(pols, keys)| prop::collection::vec(op(pols, keys), 1..=MAX_STEPS));
    let result = runner.run(&ops, |ops| {
        let tag = {
            let mut s = state.borrow_mut();
            s.0 += 1;
            s.1 += ops.len();
            s.0
        };
        run_case(&mut pair.borrow_mut(), tag, &ops)
    });
    let (runs, steps) = *state.borrow();
    let split = pair.borrow().split_checks;
    eprintln!(
        "{runs} runs ({CASES} cases and any shrinking), {steps} steps in {:.1} s; {split} checks of keys under two configs",
        started.elapsed().as_secs_f64()
    );
    if let Err(e) = result {
        panic!("{e}");
    }
    assert!(
        split > 100,
        "only {split} checks under two configs: rollouts barely exercised"
    );
    let changes = pair.borrow().limit_changes;
    assert!(changes > 50, "only {changes} runtime-limit changes made");
}

// ------------------------------------------------------------------ two regions

const REGIONS: [&str; 2] = ["eu", "us"];
const RHO: f64 = 100.0;
const SECRET: &str = "stateful-test-secret-0123456789abcdef";
const SEEDS: u64 = 3;
const GLOBAL_STEPS: usize = 24;

type RawReply = (Vec<Option<String>>, Vec<Option<String>>, (i64, i64));

/// One region's hashes for a key, as read at Redis time `now`.
struct RawBooks {
    slot: Vec<Option<String>>,
    meta: Vec<Option<String>>,
    now: i64,
}

struct Regions {
    redis: [RedisServer; 2],
    daemons: Vec<Quotad>,
    /// Each region's URL for its peer (through a proxy).
    peer_urls: [String; 2],
    _proxies: Vec<Proxy>,
    weights: [u32; 2],
    version: u64,
}

fn region_config(
    me: usize,
    redis: &str,
    peer_url: &str,
    weights: [u32; 2],
    version: u64,
) -> String {
    let escrow: Vec<(&str, u32)> = REGIONS.into_iter().zip(weights).collect();
    Config::redis(redis)
        .region(REGIONS[me])
        .coordinator("secret", SECRET)
        .coordinator("lock", "1s")
        .peer(Peer::new(REGIONS[1 - me], peer_url))
        .policy(
            Policy::new("g", "token_bucket", RHO as u64, "1s")
                .burst(RHO as u64)
                .on_store_error("closed")
                .global(
                    Global::escrow(&escrow)
                        .set("lease", "2s")
                        .set("round", "200ms")
                        .set("version", version as i64),
                ),
        )
        .policy(Policy::new("local", "sliding_log", 5, "1h"))
        .to_toml()
}

impl Regions {
    fn start() -> Regions {
        let leg = || -> LegHandle { std::sync::Arc::new(std::sync::Mutex::new(Leg::default())) };
        let (ab, ba) = (leg(), leg());
        // proxies[r]: region r's peer URL (the other region, through a proxy).
        let proxies = vec![Proxy::start(ab.clone(), ba.clone()), Proxy::start(ba, ab)];
        let redis = [RedisServer::start(), RedisServer::start()];
        let weights = [1, 1];
        let daemons: Vec<Quotad> = (0..2)
            .map(|r| {
                Quotad::start(&region_config(
                    r,
                    &redis[r].url(),
                    &proxies[r].url(),
                    weights,
                    1,
                ))
            })
            .collect();
        proxies[0].set_target(daemons[1].port);
        proxies[1].set_target(daemons[0].port);
        Regions {
            redis,
            daemons,
            peer_urls: [proxies[0].url(), proxies[1].url()],
            _proxies: proxies,
            weights,
            version: 1,
        }
    }

    /// Region r's hash for `key` and its meta hash, read in one transaction with Redis's
    /// clock.
    fn raw(&self, r: usize, key: &str) -> RawBooks {
        let stem = "rl:g:g:{rl:g}:";
        let mut conn = self.redis[r].conn();
        let (slot, meta, (secs, us)): RawReply = redis::pipe()
            .atomic()
            .cmd("HMGET")
            .arg(format!("{stem}{{{key}}}"))
            .arg(&SLOT_FIELDS[..])
            .cmd("HMGET")
            .arg(format!("{stem}meta"))
            .arg(&["d", "dp", "dt"])
            .cmd("TIME")
            .query(&mut conn)
            .unwrap();
        RawBooks {
            slot,
            meta,
            now: secs * 1_000_000 + us,
        }
    }

    /// The rates the two regions' books (or default escrows) allow `key` at one moment, and
    /// whether a loan or reservation is in force in either book. The two Redis servers
    /// cannot be read at once, so region 0 is read before and after region 1 until it did
    /// not change in between: both books are then as they were at region 1's read, and are
    /// weighed at its clock (the two servers share this machine's). Reading them one after
    /// the other instead sees a lender's older reservation beside a borrower's newer loan.
    fn rates(&self, key: &str) -> ([f64; 2], bool) {
        loop {
            let before = self.raw(0, key);
            let one = self.raw(1, key);
            let after = self.raw(0, key);
            if (&before.slot, &before.meta) != (&after.slot, &after.meta) {
                continue;
            }
            let now = one.now;
            let mut rates = [0.0; 2];
            let mut leased = false;
            for (r, raw) in [(0, &before), (1, &one)] {
                let slot = decode_slot(&raw.slot).expect("a key's hash");
                let default = decode_default(&raw.meta)
                    .expect("the meta hash")
                    .expect("written before the first step");
                let shape = Shape {
                    rho: RHO,
                    burst: RHO,
                    step_tolerance: Params::default().step_tolerance_us(),
                };
                leased |= slot.book.as_ref().is_some_and(|b| {
                    b.borrowed.iter().any(|l| l.until > now)
                        || b.reserved.iter().any(|x| x.until > now)
                });
                rates[r] = slot.rate(&default, &shape, now);
            }
            return (rates, leased);
        }
    }

    /// Region r's checks of `key`, as fast as they come, for `ms`.
    fn hot(&self, r: usize, key: &str, ms: u64) -> usize {
        let until = Instant::now() + Duration::from_millis(ms);
        let body = json!({"policy": "g", "key": key});
        let mut n = 0;
        while Instant::now() < until {
            let (status, v) = self.daemons[r].check(&body);
            assert_eq!(status, 200, "{v}");
            n += 1;
        }
        n
    }

    fn reset(&self, r: usize, key: &str) {
        let (status, _, v) = self.daemons[r].post("/v1/reset", &json!({"policy": "g", "key": key}));
        assert_eq!(status, 204, "{v}");
    }

    /// Region r reloads its file with the current weights and version, and another limit
    /// for its local policy.
    fn reload(&self, r: usize, local_limit: u64) {
        let q = &self.daemons[r];
        let text = region_config(
            r,
            &self.redis[r].url(),
            &self.peer_urls[r],
            self.weights,
            self.version,
        )
        .replace("limit = 5\n", &format!("limit = {local_limit}\n"));
        let result = q.reload(&q.config_file_text(&text));
        assert_eq!(result, "ok", "{}", q.log());
    }

    /// Until both regions' coordinators have written their default escrow (the rate of
    /// keys without a book).
    fn wait_for_defaults(&self) {
        for r in 0..2 {
            wait_for(
                "the default escrow written",
                Duration::from_secs(20),
                || {
                    let d: Option<String> = redis::cmd("HGET")
                        .arg("rl:g:g:{rl:g}:meta")
                        .arg("d")
                        .query(&mut self.redis[r].conn())
                        .unwrap();
                    d.map(|_| ())
                },
            );
        }
    }
}

/// A global key across two regions: demand moves (loans are made), the key is reset in
/// either region, and re-splits roll out by reload in either order; after every step the
/// rates the two regions' books allow sum to at most ρ.
#[test]
fn two_regions_keep_the_bound_through_resets_and_reloads() {
    use rand::{Rng, SeedableRng};
    let mut regions = Regions::start();
    regions.wait_for_defaults();
    let mut steps = 0;
    let mut loans_seen = 0;
    for seed in 0..SEEDS {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let key = format!("k{seed}");
        let mut hot = rng.random_range(0..2);
        let mut pending_reload: Option<usize> = None;
        for step in 0..GLOBAL_STEPS {
            let what = rng.random_range(0..10);
            let done = match what {
                0..=4 => {
                    if rng.random_bool(0.2) {
                        hot = 1 - hot;
                    }
                    let n = regions.hot(hot, &key, 300);
                    format!("region {hot} hot for 300 ms ({n} checks)")
                }
                5..=6 => {
                    let r = rng.random_range(0..2);
                    regions.reset(r, &key);
                    format!("reset in region {r}")
                }
                7..=8 => match pending_reload {
                    // The other region follows a re-split rolled out half-way.
                    Some(r) => {
                        regions.reload(1 - r, rng.random_range(3..9));
                        pending_reload = None;
                        format!("region {} reloads version {}", 1 - r, regions.version)
                    }
                    None => {
                        let r = rng.random_range(0..2);
                        regions.weights = [rng.random_range(1..5), rng.random_range(1..5)];
                        regions.version += 1;
                        regions.reload(r, rng.random_range(3..9));
                        pending_reload = Some(r);
                        format!(
                            "region {r} reloads version {} (weights {:?})",
                            regions.version, regions.weights
                        )
                    }
                },
                _ => {
                    std::thread::sleep(Duration::from_millis(200));
                    "a round passes".to_owned()
                }
            };
            steps += 1;
            let (rates, leased) = regions.rates(&key);
            if leased {
                loans_seen += 1;
            }
            assert!(
                rates[0] + rates[1] <= RHO * 1.001,
                "seed {seed} step {step} ({done}): the regions' rates {rates:?} sum above ρ = {RHO}"
            );
        }
        if let Some(r) = pending_reload {
            regions.reload(1 - r, 5);
        }
    }
    eprintln!(
        "{SEEDS} seeds, {steps} steps, the bound checked after each; a loan in force at {loans_seen} of them"
    );
    assert!(
        loans_seen > 0,
        "no step saw a loan: the test proved nothing"
    );
}
