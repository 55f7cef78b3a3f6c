//! The Lua scripts against the Rust reference models ([`quotad_core::algorithm`],
//! [`quotad_core::concurrency`]): random sequences of keys, costs, refunds, peeks, leases
//! and time steps go through both, and every answer (allowed, remaining, reset_after,
//! retry_after; for leases also what is held and what expired) must be identical.
//!
//! Time is injected through the scripts' test-only ARGV[7], so it is virtual, while Redis
//! expires keys on its real clock. To keep the comparison about decisions, every step checks
//! the TTL the script set (it must be the model's TTL) and then PERSISTs the key; that expiry
//! never changes a decision is checked on the model itself (`expiry_is_equivalent_to_absence`
//! in src/algorithm).

use quotad_testkit as common;

use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

use common::RedisServer;
use quotad_core::algorithm::{self, Algorithm, Limits, Op, Since, State, Usage, Verdict, Write};
use quotad_core::calendar::{Calendar, Period, Periods};
use quotad_daemon::testing::redis as scripts;
use quotad_daemon::testing::ttl_ms;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const STEPS_PER_ALGORITHM: usize = 12_000;

fn real_now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64
}

/// Loads a script; its SHA1.
fn load(conn: &mut redis::Connection, source: &str) -> String {
    redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(source)
        .query(conn)
        .unwrap()
}

/// A redis-server of its own with `source` loaded: the server (stopped when dropped), a
/// connection, and the script's SHA1.
fn with_script(source: &str) -> (RedisServer, redis::Connection, String) {
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let sha = load(&mut conn, source);
    (redis, conn, sha)
}

struct Run {
    alg: Algorithm,
    /// Two configs of the policy, the second newer: each step reads with one of them, as
    /// two instances do while a change rolls out (the transition rule).
    limits: [Limits; 2],
    seed: u64,
}

/// Runs a one-key script with `args`, then reads the key's PTTL and removes it, in one
/// MULTI/EXEC: nothing can expire in between, and PTTL sees the same clock snapshot as the
/// script. Returns the script's reply and the PTTL (ms; -2: no key).
fn eval_then_persist(
    conn: &mut redis::Connection,
    sha: &str,
    key: &str,
    args: &[String],
) -> (Vec<i64>, i64) {
    let (r, pttl, _): (Vec<i64>, i64, i64) = redis::pipe()
        .atomic()
        .cmd("EVALSHA")
        .arg(sha)
        .arg(1)
        .arg(key)
        .arg(args)
        .cmd("PTTL")
        .arg(key)
        .cmd("PERSIST")
        .arg(key)
        .query(conn)
        .unwrap_or_else(|e| panic!("EVALSHA failed: {e}"));
    (r, pttl)
}

/// A key written with a model TTL of `ttl_us` has a PTTL between that (rounded up to a
/// millisecond) and that plus the scripts' grace.
fn assert_model_ttl(pttl: i64, ttl_us: i64, step: usize) {
    let logical = (ttl_us as u64).div_ceil(1000) as i64;
    assert!(
        pttl >= logical && pttl <= ttl_ms(ttl_us),
        "step {step}: PTTL {pttl} ms, model TTL {ttl_us} us"
    );
}

/// One operation of an algorithm's script (see [`eval_then_persist`]).
#[allow(clippy::too_many_arguments)]
fn lua(
    conn: &mut redis::Connection,
    sha: &str,
    key: &str,
    op: Op,
    l: &Limits,
    member: &str,
    now: i64,
    periods: Option<&Periods>,
) -> (Verdict, i64) {
    let (mode, cost) = match op {
        Op::Check { cost } => ("check", cost),
        Op::Refund { cost } => ("refund", cost),
    };
    lua_mode(conn, sha, key, mode, cost, l, member, now, periods)
}

/// One operation of an algorithm's script by its name (`check`, `refund`, `charge`).
#[allow(clippy::too_many_arguments)]
fn lua_mode(
    conn: &mut redis::Connection,
    sha: &str,
    key: &str,
    mode: &str,
    cost: u64,
    l: &Limits,
    member: &str,
    now: i64,
    periods: Option<&Periods>,
) -> (Verdict, i64) {
    let (frame, since) = scripts::frame_args(l);
    let args = [
        mode.to_owned(),
        l.limit.to_string(),
        scripts::window_arg(l, periods).to_string(),
        l.burst.to_string(),
        cost.to_string(),
        member.to_owned(),
        frame,
        since,
        now.to_string(),
    ];
    let (r, pttl) = eval_then_persist(conn, sha, key, &args);
    let v = Verdict {
        allowed: r[0] == 1,
        remaining: r[1] as u64,
        reset_after_us: r[2],
        retry_after_us: r[3],
    };
    (v, pttl)
}

/// The script's `usage` operation on `key` at `now`, which must leave the key exactly as
/// it was (its DUMP and its PTTL), against the model's [`algorithm::usage`].
#[allow(clippy::too_many_arguments)]
fn usage_matches(
    conn: &mut redis::Connection,
    sha: &str,
    key: &str,
    alg: Algorithm,
    l: &Limits,
    state: Option<&State>,
    now: i64,
    periods: Option<&Periods>,
    context: &dyn Fn() -> String,
) {
    let (frame, since) = scripts::frame_args(l);
    let window = scripts::window_arg(l, periods).to_string();
    type Read = (Option<Vec<u8>>, i64, Vec<i64>, Option<Vec<u8>>, i64);
    let (before, pttl0, r, after, pttl1): Read = redis::pipe()
        .atomic()
        .cmd("DUMP")
        .arg(key)
        .cmd("PTTL")
        .arg(key)
        .cmd("EVALSHA")
        .arg(sha)
        .arg(1)
        .arg(key)
        .arg("usage")
        .arg(l.limit)
        .arg(&window)
        .arg(l.burst)
        .arg(0)
        .arg("")
        .arg(frame)
        .arg(since)
        .arg(now)
        .cmd("DUMP")
        .arg(key)
        .cmd("PTTL")
        .arg(key)
        .query(conn)
        .unwrap_or_else(|e| panic!("usage failed: {e}"));
    assert_eq!(before, after, "usage wrote the key: {}", context());
    assert_eq!(pttl0, pttl1, "usage changed the key's TTL: {}", context());
    let got = Usage {
        verdict: Verdict {
            allowed: r[0] == 1,
            remaining: r[1] as u64,
            reset_after_us: r[2],
            retry_after_us: r[3],
        },
        used: r[4] as u64,
        debt: r[5] as u64,
    };
    assert_eq!(r.len(), 7, "{}", context());
    assert_eq!(r[6], now, "usage answers the store's clock: {}", context());
    let want = algorithm::usage(periods, alg, l, state, now);
    assert_eq!(got, want, "usage: Lua and Rust disagree: {}", context());
}

fn drive(redis: &RedisServer, run: &Run, steps: usize) {
    let mut conn = redis.conn();
    let sha = load(&mut conn, scripts::source(run.alg));
    let mut rng = StdRng::seed_from_u64(run.seed);
    let keys = ["a", "b", "c{x}", "d"];
    // Which config reads: runs of one, then the other (a rollout's instances taking turns).
    let mut reader = 0;
    let mut model: HashMap<&str, State> = HashMap::new();
    // Admitted requests that may be refunded: (key, member, cost).
    let mut admitted: Vec<(&str, String, u64)> = Vec::new();
    let mut now = real_now_us();
    let mut trace: Vec<String> = Vec::new();
    for step in 0..steps {
        if rng.random_range(0..100) < 15 {
            reader = 1 - reader;
        }
        let l = run.limits[reader];
        let cap = l.capacity(run.alg);
        // Time: mostly small steps, sometimes none (same microsecond), sometimes a jump,
        // and rarely a step back (the clock of a promoted replica, an NTP correction).
        let w = l.window_us;
        let dt = match rng.random_range(0..100) {
            0..=19 => 0,
            20..=68 => rng.random_range(1..=w / 20 + 1),
            69..=93 => rng.random_range(1..=w / 2),
            94..=96 => -rng.random_range(1..=w),
            _ => rng.random_range(w..=3 * w),
        };
        now += dt;
        let key = keys[rng.random_range(0..keys.len())];
        let member = format!("m{step}");
        let (op, member) = match rng.random_range(0..100) {
            0..=9 if !admitted.is_empty() => {
                let (k, m, c) = admitted.swap_remove(rng.random_range(0..admitted.len()));
                // Refund on its own key only: the batch refund path.
                if k == key {
                    (Op::Refund { cost: c }, m)
                } else {
                    (Op::Check { cost: 0 }, member)
                }
            }
            10..=17 => (Op::Check { cost: 0 }, member),
            18..=25 => (
                Op::Check {
                    cost: rng.random_range(1..=cap),
                },
                member,
            ),
            _ => (
                Op::Check {
                    cost: rng.random_range(1..=cap.min(3)),
                },
                member,
            ),
        };
        let storage_key = format!("diff:{}:{}:{key}", run.alg.key_tag(), run.seed);
        // Where keys can owe, sometimes a charge instead: up to three times the capacity,
        // spent whether or not the key has it.
        let charged = (run.alg.holds_debt() && rng.random_range(0..100) < 8)
            .then(|| rng.random_range(1..=3 * cap));
        let (got, pttl, out) = match charged {
            Some(c) => {
                let (got, pttl) = lua_mode(
                    &mut conn,
                    &sha,
                    &storage_key,
                    "charge",
                    c,
                    &l,
                    &member,
                    now,
                    None,
                );
                let out = algorithm::charge(run.alg, &l, model.get(key), now, c);
                (got, pttl, out.expect("a key of this algorithm holds debt"))
            }
            None => {
                let (got, pttl) = lua(&mut conn, &sha, &storage_key, op, &l, &member, now, None);
                (
                    got,
                    pttl,
                    algorithm::apply(run.alg, &l, model.get(key), now, op, &member),
                )
            }
        };
        // An admission or a charge writes the key with the model's TTL: never shorter than
        // the time until the state is equivalent to absent, never longer than that plus the
        // grace.
        let spent = charged.is_some() || (matches!(op, Op::Check { cost: 1.. }) && got.allowed);
        if let (true, Write::Put { ttl_us, .. }) = (spent, &out.write) {
            let want = ttl_ms(*ttl_us);
            let logical = (*ttl_us as u64).div_ceil(1000) as i64;
            assert!(
                pttl <= want && pttl >= logical,
                "{:?} seed {} step {step}: PTTL {pttl} ms, model TTL {want} ms ({ttl_us} us) op {op:?} got {got:?} now {now}",
                run.alg,
                run.seed
            );
        }
        let what = match charged {
            Some(c) => format!("Charge {{ cost: {c} }}"),
            None => format!("{op:?}"),
        };
        trace.push(format!(
            "step {step}: t={now} key={key} {what} member={member} -> lua {got:?}"
        ));
        if got != out.verdict {
            let tail = trace
                .iter()
                .rev()
                .take(12)
                .rev()
                .cloned()
                .collect::<Vec<_>>()
                .join("\n");
            panic!(
                "{:?} {:?} seed {}: Lua and Rust disagree at step {step}\n lua  {got:?}\n rust {:?}\n model state {:?}\nlast steps:\n{tail}",
                run.alg,
                l,
                run.seed,
                out.verdict,
                model.get(key)
            );
        }
        match out.write {
            Write::Keep => {}
            Write::Put { state, .. } => {
                model.insert(key, state);
            }
            Write::Delete => {
                model.remove(key);
            }
        }
        if rng.random_range(0..100) < 20 {
            let k = keys[rng.random_range(0..keys.len())];
            let storage_key = format!("diff:{}:{}:{k}", run.alg.key_tag(), run.seed);
            let context = || format!("{:?} seed {} step {step} key {k}", run.alg, run.seed);
            let state = model.get(k);
            usage_matches(
                &mut conn,
                &sha,
                &storage_key,
                run.alg,
                &l,
                state,
                now,
                None,
                &context,
            );
        }
        if let (Op::Check { cost }, None) = (op, charged) {
            if got.allowed && cost > 0 {
                admitted.push((key, member, cost));
            }
        }
        if admitted.len() > 64 {
            admitted.remove(0);
        }
    }
}

fn runs(alg: Algorithm) -> Vec<Run> {
    let ms = 1000;
    // Each shape with another config of it: a higher or lower limit, burst and window.
    let shapes: [[(u64, i64, u64); 2]; 5] = [
        [(3, 100 * ms, 3), (6, 50 * ms, 2)],
        [(10, 250 * ms, 4), (5, 500 * ms, 8)],
        [(100, 1000 * ms, 150), (40, 1000 * ms, 60)],
        [(7, 30 * ms, 1), (7, 90 * ms, 3)],
        [(1, 50 * ms, 1), (2, 50 * ms, 1)],
    ];
    shapes
        .iter()
        .enumerate()
        .map(|(i, pair)| Run {
            alg,
            limits: [0, 1].map(|v| {
                let (limit, window_us, burst) = pair[v];
                Limits {
                    limit,
                    window_us,
                    burst: if alg.has_burst() { burst } else { limit },
                    since: Since {
                        version: 1,
                        at_ms: 1 + v as u64,
                    },
                }
            }),
            seed: 0x5eed_0000 + (alg.index() as u64) * 16 + i as u64,
        })
        .collect()
}

fn differential(alg: Algorithm) {
    let redis = RedisServer::start();
    let rs = runs(alg);
    let per = STEPS_PER_ALGORITHM / rs.len();
    for r in &rs {
        drive(&redis, r, per);
    }
}

#[test]
fn fixed_window_lua_matches_rust() {
    differential(Algorithm::FixedWindow);
}

/// µs since the epoch of the civil instant `y-m-d h:00` in `zone`.
fn civil_us(zone: &str, (y, m, d, h): (i16, i8, i8, i8)) -> i64 {
    jiff::civil::date(y, m, d)
        .at(h, 0, 0, 0)
        .in_tz(zone)
        .unwrap()
        .timestamp()
        .as_microsecond()
}

/// One calendar scenario: two configs of a fixed window taking turns as a rollout's
/// instances do (`None`: a calendar period's reader; `Some(w)`: a fixed window of `w` µs
/// reading the same keys), around a boundary of `period` in `zone`.
struct CalendarRun {
    zone: &'static str,
    period: Period,
    boundary: (i16, i8, i8, i8),
    limits: [(u64, Option<i64>); 2],
    seed: u64,
}

/// A fixed window of calendar periods, through the script and the model: episodes that
/// start shortly before `run.boundary` and step across it (small steps, same-µs steps,
/// jumps of periods, clock steps back), with checks, peeks, refunds and charges into
/// debt. quotad builds the periods table from its own clock, here a few seconds off
/// Redis's (the injected time), so the script, not quotad, picks the period.
fn drive_calendar(redis: &RedisServer, run: &CalendarRun, episodes: usize, steps: usize) {
    let mut conn = redis.conn();
    let sha = load(&mut conn, scripts::source(Algorithm::FixedWindow));
    let mut rng = StdRng::seed_from_u64(run.seed);
    let calendar = Calendar::new(run.period, run.zone).unwrap();
    let n = run.period.nominal_us();
    let boundary = civil_us(run.zone, run.boundary);
    // The second config is the newer.
    let limits = [0, 1].map(|v| {
        let (limit, fixed) = run.limits[v];
        Limits {
            limit,
            window_us: fixed.unwrap_or(n),
            burst: limit,
            since: Since {
                version: 1,
                at_ms: 1 + v as u64,
            },
        }
    });
    let all_calendar = run.limits.iter().all(|(_, fixed)| fixed.is_none());
    let mut trace: Vec<String> = Vec::new();
    for episode in 0..episodes {
        let mut now = boundary - rng.random_range(0..n / 3);
        let mut model: HashMap<String, State> = HashMap::new();
        let mut admitted: Vec<(String, String, u64)> = Vec::new();
        let mut reader = 0;
        for step in 0..steps {
            if rng.random_range(0..100) < 15 {
                reader = 1 - reader;
            }
            let (l, calendar_reader) = (limits[reader], run.limits[reader].1.is_none());
            let w = l.window_us;
            now += match rng.random_range(0..100) {
                0..=14 => 0,
                15..=69 => rng.random_range(1..=w / 50 + 1),
                70..=91 => rng.random_range(1..=w / 4),
                92..=94 => -rng.random_range(1..=w / 10),
                _ => rng.random_range(w / 2..=2 * w),
            };
            // quotad's clock, up to 5 s off Redis's.
            let skew = rng.random_range(-5_000_000..=5_000_000);
            let table = calendar.periods(now + skew);
            let periods = calendar_reader.then_some(&table);
            let key = ["a", "b", "c"][rng.random_range(0..3)].to_string();
            let member = format!("m{episode}.{step}");
            let cap = l.limit;
            let op = match rng.random_range(0..100) {
                0..=9 if !admitted.is_empty() => {
                    let (k, m, c) = admitted.swap_remove(rng.random_range(0..admitted.len()));
                    if k == key {
                        (Op::Refund { cost: c }, m)
                    } else {
                        (Op::Check { cost: 0 }, member.clone())
                    }
                }
                10..=17 => (Op::Check { cost: 0 }, member.clone()),
                _ => (
                    Op::Check {
                        cost: rng.random_range(1..=cap.min(3)),
                    },
                    member.clone(),
                ),
            };
            let (op, member) = op;
            let charged = (rng.random_range(0..100) < 8).then(|| rng.random_range(1..=3 * cap));
            let storage_key = format!("cal:{}:{episode}:{key}", run.seed);
            let state = model.get(&key);
            let (got, pttl, out) = match charged {
                Some(c) => {
                    let (got, pttl) = lua_mode(
                        &mut conn,
                        &sha,
                        &storage_key,
                        "charge",
                        c,
                        &l,
                        &member,
                        now,
                        periods,
                    );
                    let out =
                        algorithm::charge_on(periods, Algorithm::FixedWindow, &l, state, now, c);
                    (got, pttl, out.unwrap())
                }
                None => {
                    let (got, pttl) =
                        lua(&mut conn, &sha, &storage_key, op, &l, &member, now, periods);
                    let out = algorithm::on_periods(periods, now, |t| {
                        algorithm::apply(Algorithm::FixedWindow, &l, state, t, op, &member)
                    });
                    (got, pttl, out)
                }
            };
            trace.push(format!(
                "episode {episode} step {step}: t={now} skew={skew} reader={reader} key={key} {op:?} charge={charged:?} -> lua {got:?}"
            ));
            if got != out.verdict {
                let tail = trace[trace.len().saturating_sub(12)..].join("\n");
                panic!(
                    "{} {:?} seed {}: Lua and Rust disagree\n lua  {got:?}\n rust {:?}\n state {:?}\n{tail}",
                    run.zone, run.period, run.seed, out.verdict, state
                );
            }
            let spent = charged.is_some() || (matches!(op, Op::Check { cost: 1.. }) && got.allowed);
            if let (true, Write::Put { ttl_us, .. }) = (spent, &out.write) {
                assert_model_ttl(pttl, *ttl_us, step);
            }
            // A count of calendar periods resets no sooner than its period's real end.
            if all_calendar
                && got.allowed
                && charged.is_none()
                && matches!(op, Op::Check { cost: 1.. })
            {
                if let Some(span) = calendar.containing(now).end_us.checked_sub(now) {
                    assert!(
                        got.reset_after_us >= span,
                        "{} {:?}: reset in {} us, the period ends in {span}",
                        run.zone,
                        run.period,
                        got.reset_after_us
                    );
                }
            }
            match out.write {
                Write::Keep => {}
                Write::Put { state, .. } => {
                    model.insert(key.clone(), state);
                }
                Write::Delete => {
                    model.remove(&key);
                }
            }
            if rng.random_range(0..100) < 20 {
                let k = ["a", "b", "c"][rng.random_range(0..3)];
                let storage_key = format!("cal:{}:{episode}:{k}", run.seed);
                let context = || {
                    format!(
                        "{} seed {} episode {episode} step {step}",
                        run.zone, run.seed
                    )
                };
                let state = model.get(k);
                let alg = Algorithm::FixedWindow;
                usage_matches(
                    &mut conn,
                    &sha,
                    &storage_key,
                    alg,
                    &l,
                    state,
                    now,
                    periods,
                    &context,
                );
            }
            if let (Op::Check { cost }, None) = (op, charged) {
                if got.allowed && cost > 0 {
                    admitted.push((key, member, cost));
                }
            }
            if admitted.len() > 32 {
                admitted.remove(0);
            }
        }
    }
}

/// Calendar periods in the script and the model, across the boundaries the calendar
/// makes hard: a spring and an autumn day in two zones with DST (23 and 25 hours), a
/// February 29, December 31 to January 1, a month of 31 days after one of 30 (with the
/// autumn hour in it), a week from Sunday to Monday; two limits of one period taking
/// turns, and a fixed window of 30 days taking turns with the calendar month it becomes.
#[test]
fn fixed_window_on_the_calendar_lua_matches_rust() {
    let redis = RedisServer::start();
    let runs = [
        (
            "Europe/Berlin",
            Period::Day,
            (2027, 3, 28, 3),
            [(5, None), (3, None)],
        ),
        (
            "Europe/Berlin",
            Period::Day,
            (2026, 10, 26, 0),
            [(5, None), (8, None)],
        ),
        (
            "America/New_York",
            Period::Day,
            (2027, 3, 15, 0),
            [(4, None), (6, None)],
        ),
        (
            "America/New_York",
            Period::Day,
            (2026, 11, 2, 0),
            [(6, None), (4, None)],
        ),
        (
            "UTC",
            Period::Month,
            (2028, 3, 1, 0),
            [(10, None), (7, None)],
        ),
        (
            "America/New_York",
            Period::Month,
            (2026, 12, 1, 0),
            [(5, None), (9, None)],
        ),
        (
            "Asia/Tokyo",
            Period::Year,
            (2027, 1, 1, 0),
            [(6, None), (4, None)],
        ),
        (
            "Europe/Berlin",
            Period::Week,
            (2026, 12, 14, 0),
            [(5, None), (5, None)],
        ),
        (
            "Europe/Berlin",
            Period::Month,
            (2027, 4, 1, 0),
            [(6, None), (6, Some(30 * 86_400_000_000))],
        ),
    ];
    for (i, (zone, period, boundary, limits)) in runs.into_iter().enumerate() {
        let run = CalendarRun {
            zone,
            period,
            boundary,
            limits,
            seed: 0xca1e_0000 + i as u64,
        };
        drive_calendar(&redis, &run, 6, 120);
    }
}

#[test]
fn sliding_log_lua_matches_rust() {
    differential(Algorithm::SlidingLog);
}

#[test]
fn sliding_window_lua_matches_rust() {
    differential(Algorithm::SlidingWindow);
}

#[test]
fn token_bucket_lua_matches_rust() {
    differential(Algorithm::TokenBucket);
}

#[test]
fn gcra_lua_matches_rust() {
    differential(Algorithm::Gcra);
}

/// GCRA at 10,000/s with sub-millisecond spacing, where millisecond arithmetic breaks
/// (brandur/redis-cell#50, #80): one request every 50 us for a virtual second admits
/// exactly the rate, in Lua as in Rust.
#[test]
fn gcra_is_exact_at_ten_thousand_per_second_in_lua() {
    let (_redis, mut conn, sha) = with_script(scripts::source(Algorithm::Gcra));
    let l = Limits {
        limit: 10_000,
        window_us: 1_000_000,
        burst: 1,
        since: Since::ZERO,
    };
    let t0 = real_now_us();
    let (frame, since) = scripts::frame_args(&l);
    let mut pipe = redis::pipe();
    pipe.atomic();
    for i in 0..20_000i64 {
        pipe.cmd("EVALSHA")
            .arg(&sha)
            .arg(1)
            .arg("gcra:fast")
            .arg("check")
            .arg(l.limit)
            .arg(l.window_us)
            .arg(l.burst)
            .arg(1)
            .arg("")
            .arg(&frame)
            .arg(&since)
            .arg(t0 + i * 50)
            .cmd("PERSIST")
            .arg("gcra:fast")
            .ignore();
    }
    let replies: Vec<Vec<i64>> = pipe.query(&mut conn).unwrap();
    let admitted = replies.iter().filter(|r| r[0] == 1).count();
    assert_eq!(admitted, 10_000);
}

/// The composite script (a co-location group's all-or-nothing batch) against the model's
/// [`algorithm::apply_all`]: random batches over keys of all five algorithms, with costs,
/// peeks, shadow (unenforced) checks and time steps; every verdict must be identical, and
/// a batch must charge all its keys or none.
#[test]
fn composite_lua_matches_rust() {
    let (_redis, mut conn, sha) = with_script(scripts::COMPOSITE);
    let ms = 1000;
    let keys: Vec<(String, Algorithm, Limits)> = Algorithm::ALL
        .iter()
        .flat_map(|&alg| {
            [(5, 100 * ms, 7), (20, 1000 * ms, 20)].map(|(limit, window_us, burst)| {
                let burst = if alg.has_burst() { burst } else { limit };
                let name = format!("diff:{{g}}:{}:{limit}", alg.key_tag());
                (
                    name,
                    alg,
                    Limits {
                        limit,
                        window_us,
                        burst,
                        since: Since::ZERO,
                    },
                )
            })
        })
        .collect();
    let mut rng = StdRng::seed_from_u64(0xc0_4b05);
    let mut model: HashMap<usize, State> = HashMap::new();
    let mut now = real_now_us();
    for step in 0..3_000 {
        now += match rng.random_range(0..10) {
            0..=2 => 0,
            3..=8 => rng.random_range(1..=50 * ms),
            _ => rng.random_range(100 * ms..=1500 * ms),
        };
        let n = rng.random_range(1..=4);
        let mut picked: Vec<usize> = Vec::new();
        while picked.len() < n {
            let k = rng.random_range(0..keys.len());
            if !picked.contains(&k) {
                picked.push(k);
            }
        }
        let member = format!("m{step}");
        let checks: Vec<(usize, u64, bool)> = picked
            .iter()
            .map(|&k| {
                let cap = keys[k].2.capacity(keys[k].1);
                let cost = match rng.random_range(0..10) {
                    0 => 0,
                    1 => rng.random_range(1..=cap),
                    _ => rng.random_range(1..=cap.min(2)),
                };
                (k, cost, rng.random_range(0..8) != 0)
            })
            .collect();
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&sha).arg(checks.len());
        for (k, _, _) in &checks {
            cmd.arg(&keys[*k].0);
        }
        for (k, cost, enforced) in &checks {
            let (_, alg, l) = &keys[*k];
            let (frame, since) = scripts::frame_args(l);
            cmd.arg(alg.key_tag())
                .arg(l.limit)
                .arg(l.window_us)
                .arg(l.burst)
                .arg(cost)
                .arg(&member)
                .arg(u8::from(*enforced))
                .arg(frame)
                .arg(since);
        }
        cmd.arg(now);
        let mut pipe = redis::pipe();
        pipe.atomic().add_command(cmd);
        for (k, _, _) in &checks {
            pipe.cmd("PERSIST").arg(&keys[*k].0).ignore();
        }
        let (reply,): (Vec<i64>,) = pipe.query(&mut conn).unwrap();
        let got: Vec<Verdict> = reply
            .chunks(4)
            .map(|r| Verdict {
                allowed: r[0] == 1,
                remaining: r[1] as u64,
                reset_after_us: r[2],
                retry_after_us: r[3],
            })
            .collect();
        let parts: Vec<algorithm::Part<'_>> = checks
            .iter()
            .map(|&(k, cost, enforced)| algorithm::Part {
                algorithm: keys[k].1,
                limits: keys[k].2,
                state: model.get(&k),
                cost,
                member: &member,
                enforced,
                periods: None,
            })
            .collect();
        let (want, writes) = algorithm::apply_all(&parts, now);
        assert_eq!(got, want, "step {step}: batch {checks:?}");
        for ((k, _, _), w) in checks.iter().zip(writes.into_iter().flatten()) {
            match w {
                Write::Keep => {}
                Write::Put { state, .. } => {
                    model.insert(*k, state);
                }
                Write::Delete => {
                    model.remove(k);
                }
            }
        }
    }
}

/// The concurrency script against its reference model ([`quotad_core::concurrency`]):
/// random acquires (new leases of 1 to 3 units), releases and extends of leases taken
/// before and of unknown ones, clears, peeks, and time steps (a few backward) over keys of three
/// limits. Every answer must be identical, and every write must carry the model's TTL.
#[test]
fn concurrency_lua_matches_rust() {
    use quotad_core::concurrency::{self, LeaseAnswer, LeaseOp, LeaseWrite, Leases};
    let (_redis, mut conn, sha) = with_script(scripts::CONCURRENCY);
    let ms = 1000;
    let keys = [("diff:cc:a", 3u64), ("diff:cc:b", 10), ("diff:cc:{c}", 1)];
    let mut rng = StdRng::seed_from_u64(0xc0_4c);
    let mut model: HashMap<&str, Leases> = HashMap::new();
    // Leases acquired: (key, id, units).
    let mut taken: Vec<(&str, String, u64)> = Vec::new();
    let mut now = real_now_us();
    let (mut granted, mut expired, mut unknown, mut cleared, mut ended) = (0, 0, 0, 0, 0);
    for step in 0..6_000 {
        now += match rng.random_range(0..100) {
            0..=19 => 0,
            20..=79 => rng.random_range(1..=20 * ms),
            80..=96 => rng.random_range(20 * ms..=300 * ms),
            97 => -rng.random_range(1..=50 * ms),
            _ => rng.random_range(300 * ms..=1_000 * ms),
        };
        let (key, limit) = keys[rng.random_range(0..keys.len())];
        let hold_us = rng.random_range(1..=200 * ms);
        let new_id = format!("l{step}");
        let mine: Vec<usize> = (0..taken.len()).filter(|&i| taken[i].0 == key).collect();
        // Half the time the key's latest lease (most likely still live), else any.
        let pick = |rng: &mut StdRng| match rng.random_range(0..2) {
            0 => mine.last().copied(),
            _ => mine.get(rng.random_range(0..mine.len().max(1))).copied(),
        };
        let (mode, id, units) = match rng.random_range(0..100) {
            0..=39 => ("acquire", new_id, rng.random_range(1..=limit.min(3))),
            40..=74 => {
                let mode = if rng.random_range(0..2) == 0 {
                    "release"
                } else {
                    "extend"
                };
                // A tenth name a lease with another unit count than it was issued with
                // (an edited id): no lease of the key's.
                let edit = rng.random_range(0..10) == 0;
                match pick(&mut rng) {
                    Some(i) if edit => (mode, taken[i].1.clone(), rng.random_range(1..=4)),
                    Some(i) => (mode, taken[i].1.clone(), taken[i].2),
                    None => (mode, format!("u{step}"), 1),
                }
            }
            75..=84 => ("release", format!("u{step}"), 1),
            85..=89 => ("clear", String::new(), 1),
            _ => ("peek", String::new(), 1),
        };
        let op = match mode {
            "acquire" => LeaseOp::Acquire {
                id: &id,
                units,
                hold_us,
            },
            "release" => LeaseOp::Release { id: &id, units },
            "extend" => LeaseOp::Extend {
                id: &id,
                units,
                hold_us,
            },
            "clear" => LeaseOp::Clear,
            _ => LeaseOp::Peek,
        };
        let args = [
            mode.to_owned(),
            limit.to_string(),
            id.clone(),
            units.to_string(),
            hold_us.to_string(),
            now.to_string(),
        ];
        // The key and, beside it, the leases a clear ended (both persisted: time is
        // virtual here).
        let ended_key = format!("{key}:e");
        let (r, pttl, _, _): (Vec<i64>, i64, i64, i64) = redis::pipe()
            .atomic()
            .cmd("EVALSHA")
            .arg(&sha)
            .arg(2)
            .arg(key)
            .arg(&ended_key)
            .arg(&args)
            .cmd("PTTL")
            .arg(key)
            .cmd("PERSIST")
            .arg(key)
            .cmd("PERSIST")
            .arg(&ended_key)
            .query(&mut conn)
            .unwrap_or_else(|e| panic!("EVALSHA failed: {e}"));
        let got = LeaseAnswer {
            ok: r[0] == 1,
            held: r[1] as u64,
            reset_after_us: r[2],
            retry_after_us: r[3],
            expired: r[4] as u64,
            released: r[5] as u64,
            ended: r[0] == 2,
        };
        let out = concurrency::apply(limit, model.get(key), now, op);
        assert_eq!(
            got,
            out.answer,
            "step {step}: {key} {op:?} at {now}, model state {:?}",
            model.get(key)
        );
        match out.write {
            LeaseWrite::Keep => {}
            LeaseWrite::Put { leases, .. } => {
                // The key lives until its latest unit's end; with none held it is gone
                // (what the model keeps then is the ended leases, beside it).
                match leases.entries.iter().map(|(t, _)| *t).max() {
                    Some(last) => assert_model_ttl(pttl, last - now, step),
                    None => assert_eq!(pttl, -2, "step {step}: the key should be gone"),
                }
                model.insert(key, leases);
            }
            LeaseWrite::Delete => {
                assert_eq!(pttl, -2, "step {step}: the key should be gone");
                model.remove(key);
            }
        }
        match (mode, got.ok) {
            ("acquire", true) => {
                granted += 1;
                taken.push((key, id.clone(), units));
            }
            ("release", true) => taken.retain(|t| t.1 != id),
            // (The leases a clear gave back stay among those released and extended:
            // told "ended by a reset".)
            ("clear", _) => cleared += got.released,
            ("release" | "extend", false) if got.ended => ended += 1,
            ("release" | "extend", false) => unknown += 1,
            _ => {}
        }
        expired += got.expired;
        if taken.len() > 64 {
            taken.remove(0);
        }
    }
    // The sequence reached every branch.
    assert!(
        granted > 500 && expired > 100 && unknown > 100 && cleared > 50 && ended > 10,
        "{granted} {expired} {unknown} {cleared} {ended}"
    );
}

/// A sliding window or log forgets what leaves it, so it cannot hold a debt: its script
/// refuses a charge with an error and writes nothing.
#[test]
fn a_sliding_script_refuses_a_charge() {
    for alg in [Algorithm::SlidingLog, Algorithm::SlidingWindow] {
        let (_redis, mut conn, sha) = with_script(scripts::source(alg));
        let r: redis::RedisResult<Vec<i64>> = redis::cmd("EVALSHA")
            .arg(&sha)
            .arg(1)
            .arg("k")
            .arg(&[
                "charge",
                "10",
                "1000000",
                "10",
                "20",
                "m",
                "10:1000000:10",
                "0",
            ])
            .query(&mut conn);
        let e = r.expect_err("a charge on a window");
        assert!(e.to_string().contains("cannot hold a debt"), "{alg:?}: {e}");
        let exists: bool = redis::cmd("EXISTS").arg("k").query(&mut conn).unwrap();
        assert!(!exists, "{alg:?} wrote the key");
    }
}

/// The settlement script against its model ([`quotad_core::settlement`]): reservations at
/// random estimates, settled at random real costs (up to three times the capacity: into
/// debt), settled again, and settlements of reservations that do not exist, over a fixed
/// window, a token bucket and a GCRA key; every answer, every stored reservation and every
/// TTL the key gets must be the model's.
#[test]
fn settlement_lua_matches_rust() {
    use quotad_core::settlement::{self, Reservation, Settled};
    let (_redis, mut conn, sha) = with_script(scripts::SETTLE);
    let ms = 1000;
    let keys = [
        ("diff:st:{fw}", Algorithm::FixedWindow, 5u64, 200 * ms, 5u64),
        ("diff:st:{tb}", Algorithm::TokenBucket, 4, 300 * ms, 6),
        ("diff:st:{gc}", Algorithm::Gcra, 10, 1000 * ms, 3),
        // A fixed window of Berlin days: the run crosses a midnight.
        (
            "diff:st:{cal}",
            Algorithm::FixedWindow,
            40,
            86_400_000 * ms,
            40,
        ),
    ];
    let days = Calendar::new(Period::Day, "Europe/Berlin").unwrap();
    let mut rng = StdRng::seed_from_u64(0x5e_771e);
    let mut model: HashMap<usize, State> = HashMap::new();
    let mut booked: HashMap<String, Reservation> = HashMap::new();
    // Reservations made: (key index, reservation key).
    let mut made: Vec<(usize, String)> = Vec::new();
    // A minute before the next midnight in Berlin.
    let mut now = days.containing(real_now_us()).end_us - 60_000_000;
    let (mut settled, mut again, mut unknown, mut into_debt) = (0, 0, 0, 0);
    let (mut ended, mut resets) = (0, 0);
    // When each key was last reset (the mark's value).
    let mut reset_at: HashMap<usize, i64> = HashMap::new();
    for step in 0..4_000 {
        now += match rng.random_range(0..10) {
            0..=2 => 0,
            3..=8 => rng.random_range(1..=50 * ms),
            _ => rng.random_range(100 * ms..=1_500 * ms),
        };
        let k = rng.random_range(0..keys.len());
        let (key, alg, limit, window_us, burst) = keys[k];
        let l = Limits {
            limit,
            window_us,
            burst,
            since: Since::ZERO,
        };
        let cap = l.capacity(alg);
        let (frame, since) = scripts::frame_args(&l);
        let table = (key == "diff:st:{cal}").then(|| days.periods(now));
        let periods = table.as_ref();
        let member = format!("m{step}");
        let mark = format!("{key}:z");
        // Now and then a reset of the key (lua/reset.lua's writes, at the virtual time):
        // the reservations open on it end.
        if rng.random_range(0..40) == 0 {
            let _: () = redis::pipe()
                .atomic()
                .cmd("DEL")
                .arg(key)
                .ignore()
                .cmd("SET")
                .arg(&mark)
                .arg(now)
                .ignore()
                .query(&mut conn)
                .unwrap();
            model.remove(&k);
            reset_at.insert(k, now);
            resets += 1;
            continue;
        }
        let mine: Vec<&String> = made.iter().filter(|m| m.0 == k).map(|m| &m.1).collect();
        let (mode, rkey, cost) = match rng.random_range(0..10) {
            0..=3 => (
                "reserve",
                format!("{key}:r:{step}"),
                rng.random_range(1..=cap),
            ),
            4..=8 if !mine.is_empty() => (
                "settle",
                mine[rng.random_range(0..mine.len())].clone(),
                rng.random_range(0..=3 * cap),
            ),
            _ => (
                "settle",
                format!("{key}:r:none{step}"),
                rng.random_range(0..=cap),
            ),
        };
        let (r, pttl, stored, _): (Vec<i64>, i64, Option<String>, i64) = redis::pipe()
            .atomic()
            .cmd("EVALSHA")
            .arg(&sha)
            .arg(3)
            .arg(key)
            .arg(&rkey)
            .arg(&mark)
            .arg(mode)
            .arg(alg.key_tag())
            .arg(limit)
            .arg(scripts::window_arg(&l, periods))
            .arg(burst)
            .arg(cost)
            .arg(&member)
            .arg(3_600_000)
            .arg("diff:invalidate")
            .arg(&frame)
            .arg(&since)
            .arg(now)
            .cmd("PTTL")
            .arg(key)
            .cmd("GET")
            .arg(&rkey)
            .cmd("PERSIST")
            .arg(key)
            .query(&mut conn)
            .unwrap_or_else(|e| panic!("EVALSHA failed: {e}"));
        let state = model.get(&k);
        let write = if mode == "reserve" {
            let (out, opened) =
                settlement::reserve(alg, &l, state, now, cost, &member, periods).unwrap();
            let got = Verdict {
                allowed: r[0] == 1,
                remaining: r[1] as u64,
                reset_after_us: r[2],
                retry_after_us: r[3],
            };
            assert_eq!(got, out.verdict, "step {step}: reserve {cost} on {key}");
            if let Some(res) = opened {
                booked.insert(rkey.clone(), res);
                made.push((k, rkey.clone()));
            }
            out.write
        } else {
            let reset = reset_at.get(&k).copied();
            let reservation = booked.get(&rkey);
            let out = settlement::settle(
                alg,
                &l,
                state,
                reservation,
                reset,
                now,
                cost,
                &member,
                periods,
            );
            let out = out.unwrap();
            let (code, charged, refunded) = match out.settled {
                Settled::Now { charged, refunded } => (1, charged, refunded),
                Settled::Already => (2, 0, 0),
                Settled::Unknown => (0, 0, 0),
                Settled::Ended => (3, 0, 0),
            };
            let want = [
                code,
                out.verdict.remaining as i64,
                out.verdict.reset_after_us,
                charged as i64,
                refunded as i64,
            ];
            assert_eq!(
                r,
                want,
                "step {step}: settle {rkey} at {cost} ({:?})",
                booked.get(&rkey)
            );
            match code {
                1 => settled += 1,
                2 => again += 1,
                3 => ended += 1,
                _ => unknown += 1,
            }
            into_debt += u64::from(charged > 0 && out.verdict.remaining == 0);
            if let Some(res) = out.reservation {
                booked.insert(rkey.clone(), res);
            }
            out.write
        };
        let want_stored = booked.get(&rkey).map(|res| match res {
            Reservation::Open {
                estimate,
                opened_us,
            } => format!("o:{estimate}:{opened_us}"),
            Reservation::Settled { cost } => format!("s:{cost}"),
            Reservation::Ended => "e:".to_owned(),
        });
        assert_eq!(stored, want_stored, "step {step}: the stored reservation");
        match write {
            Write::Keep => {}
            Write::Put { state, ttl_us } => {
                assert_model_ttl(pttl, ttl_us, step);
                model.insert(k, state);
            }
            Write::Delete => {
                model.remove(&k);
            }
        }
        if made.len() > 48 {
            made.remove(0);
        }
    }
    assert!(
        // (The counts move with the real clock the steps start from: settled ran 500-530.)
        settled > 400 && again > 200 && unknown > 200 && into_debt > 100 && ended > 10,
        "{settled} {again} {unknown} {into_debt} {ended} of {resets} resets"
    );
}
