//! The global policies' Lua scripts (`lua/global/`) against their reference model
//! ([`quotad_core::coordinator::bucket::KeySlot`]): random sequences of checks, peeks, refunds,
//! book writes (reservations, loans, stale epochs), failover drops, default changes and
//! clock steps (forward and backward, beyond the step tolerance), and keys' own numbers (a
//! runtime limit) set, changed and gone between decisions, go through both on a real
//! redis-server with injected time, and after every step the verdict and the whole stored
//! state (tokens to the last bit, book, epoch, high water, counters) must be identical.

use quotad_testkit as common;

use std::collections::HashMap;

use common::RedisServer;
use quotad_core::algorithm::{Op, Verdict};
use quotad_core::coordinator::RegionId;
use quotad_core::coordinator::bucket::{DefaultEscrow, KeyLimit, KeySlot, RegionUsage, Shape};
use quotad_core::coordinator::lease::{LeaseBook, Loan, Reservation};
use quotad_daemon::testing::federation::{self as books, SLOT_FIELDS};
use quotad_daemon::testing::redis as global;
use quotad_daemon::testing::redis::Global;
use quotad_daemon::testing::{PolicyKeys, ScriptShape};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const SEEDS: u64 = 12;
const STEPS: usize = 1_500;
const FENCE: &str = "t:coordinator:fence";

struct Scripts {
    check: redis::Script,
    write: redis::Script,
    drop: redis::Script,
    default: redis::Script,
}

fn read_slot(conn: &mut redis::Connection, key: &str) -> KeySlot {
    let v: Vec<Option<String>> = redis::cmd("HMGET")
        .arg(key)
        .arg(&SLOT_FIELDS[..])
        .query(conn)
        .unwrap();
    books::decode_slot(&v).unwrap()
}

fn random_book(rng: &mut StdRng, now: i64, rho: f64) -> LeaseBook {
    let until = |rng: &mut StdRng| now + rng.random_range(-1_000_000..10_000_000);
    let mut book = LeaseBook::new(rng.random_range(0.0..=rho));
    for _ in 0..rng.random_range(0..4) {
        book.reserved.push(Reservation {
            borrower: RegionId(rng.random_range(1..4)),
            seq: rng.random_range(1..20),
            amount: rng.random_range(0.0..rho / 2.0),
            until: until(rng),
        });
    }
    for _ in 0..rng.random_range(0..3) {
        book.borrowed.push(Loan {
            lender: RegionId(rng.random_range(1..4)),
            lender_incarnation: rng.random_range(1..5),
            seq: rng.random_range(1..20),
            amount: rng.random_range(0.0..rho / 2.0),
            until: until(rng),
        });
    }
    book.high_water = match rng.random_range(0..4) {
        0 => i64::MIN,
        1 => now + rng.random_range(0..2_000_000),
        _ => now - rng.random_range(0..2_000_000),
    };
    book.epoch = rng.random_range(0..3);
    book
}

fn run(seed: u64, conn: &mut redis::Connection, s: &Scripts) {
    let mut rng = StdRng::seed_from_u64(seed);
    let rho = [7.0, 100.0, 1000.0, 12_345.6][rng.random_range(0..4)];
    let shape = Shape {
        rho,
        burst: rho * rng.random_range(0.05..2.0),
        step_tolerance: 50_000,
    };
    let fallback = rho * rng.random_range(0.0..1.0);
    let args = ScriptShape {
        rho,
        burst: shape.burst,
        step_tolerance_us: shape.step_tolerance,
        fallback_escrow: fallback,
        keep_ms: 3_600_000,
    };
    let keys = PolicyKeys {
        meta: format!("t:p{seed}:g:meta"),
        active: format!("t:p{seed}:g:active"),
        books: format!("t:p{seed}:g:books"),
        fence: FENCE.to_owned(),
        replid: format!("t:p{seed}:g:replid"),
    };
    let users = ["alice", "bob", "carol"];
    let storage = |u: &str| format!("t:p{seed}:g:{{{u}}}");
    let mut model: HashMap<&str, KeySlot> = HashMap::new();
    let mut default: Option<DefaultEscrow> = None;
    let mut own_numbers: HashMap<&str, Option<KeyLimit>> = HashMap::new();
    let mut now: i64 = 1_764_000_000_000_000 + rng.random_range(0..1_000_000_000);
    let mut trace: Vec<String> = Vec::new();
    for step in 0..STEPS {
        now += match rng.random_range(0..100) {
            0..=19 => 0,
            20..=79 => rng.random_range(1..200_000),
            80..=92 => rng.random_range(200_000..5_000_000),
            93..=96 => -rng.random_range(1..40_000),
            _ => -rng.random_range(60_000..1_500_000),
        };
        let user = users[rng.random_range(0..users.len())];
        let key = storage(user);
        let d = default.unwrap_or(DefaultEscrow::new(fallback));
        let slot = model.entry(user).or_default();
        // Writes books of one or more users in one call, as a round does.
        let write = |token: u64, books: &[(&str, &LeaseBook)]| {
            let names: Vec<String> = books.iter().map(|(u, _)| storage(u)).collect();
            let writes: Vec<books::BookWrite> = books
                .iter()
                .zip(&names)
                .map(|((u, book), storage_key)| books::BookWrite {
                    storage_key,
                    user_key: u,
                    book,
                })
                .collect();
            books::write_books_invocation(&s.write, &keys, token, &args, &writes, Some(now))
        };
        // The users whose stored state the step may change, compared with the model after it.
        let mut touched = vec![user];
        let what = match rng.random_range(0..100) {
            0..=54 => {
                let op = match rng.random_range(0..10) {
                    0 => Op::Check { cost: 0 },
                    1 => Op::Refund {
                        cost: rng.random_range(1..4),
                    },
                    _ => Op::Check {
                        cost: rng.random_range(1..4),
                    },
                };
                // The key's own numbers as the calling instance has them: mostly what
                // the last call had, sometimes others (a runtime limit set, changed or
                // gone), above and below the policy's.
                let own = own_numbers.entry(user).or_insert(None);
                if rng.random_bool(0.1) {
                    *own = rng.random_bool(0.7).then(|| KeyLimit {
                        rate: rho * rng.random_range(0.01..3.0),
                        burst: shape.burst * rng.random_range(0.01..3.0),
                    });
                }
                let limit = *own;
                let target = global::GlobalKey {
                    storage_key: &key,
                    user_key: user,
                    keys: &keys,
                    shape: &args,
                    limit,
                };
                let inv = global::check_invocation(&s.check, &target, op, Some(now));
                let reply: Vec<i64> = inv.invoke(conn).unwrap();
                let got = quotad_daemon::testing::redis::parse_verdict(&reply).unwrap();
                let want: Verdict = slot.decide(&d, &shape, now, op, limit);
                assert_eq!(
                    got,
                    want,
                    "seed {seed} step {step}: {op:?} on {user}\n{}",
                    trace.join("\n")
                );
                // What the key holds here, read by the usage mode: as the model reads
                // it, and nothing written (the stored state is compared below).
                let inv = global::usage_invocation(&s.check, &target, Some(now));
                let reply: Vec<i64> = inv.invoke(conn).unwrap();
                let (got_usage, at) =
                    quotad_daemon::testing::redis::parse_region_usage(&reply).unwrap();
                let want_usage = slot.usage(&d, &shape, now, limit);
                let milli = |u: &RegionUsage| {
                    [u.rate, u.escrow, u.lent, u.borrowed, u.capacity]
                        .map(|x| (x * 1000.0 + 0.5).floor() / 1000.0)
                };
                assert_eq!(
                    (got_usage.verdict, milli(&got_usage), at),
                    (want_usage.verdict, milli(&want_usage), now),
                    "seed {seed} step {step}: usage of {user}\n{}",
                    trace.join("\n")
                );
                format!("{op:?} -> {got:?}")
            }
            55..=74 => {
                // This user's book, and sometimes the others' in the same call.
                let mut together = vec![user];
                for u in users {
                    if u != user && rng.random_bool(0.3) {
                        together.push(u);
                    }
                }
                let books: Vec<LeaseBook> = together
                    .iter()
                    .map(|_| random_book(&mut rng, now, rho))
                    .collect();
                let call: Vec<(&str, &LeaseBook)> = together.iter().copied().zip(&books).collect();
                let epochs: Vec<u64> = write(1, &call).invoke(conn).unwrap();
                touched.clone_from(&together);
                let want: Vec<u64> = call
                    .iter()
                    .map(|(u, book)| {
                        model
                            .entry(u)
                            .or_default()
                            .write_book(&d, &shape, now, book)
                            .epoch
                    })
                    .collect();
                assert_eq!(epochs, want, "seed {seed} step {step}");
                format!("write {call:?}")
            }
            75..=82 => {
                let inv = books::drop_loans_invocation(&s.drop, &key, &keys, 1, &args, Some(now));
                let dropped: i64 = inv.invoke(conn).unwrap();
                assert_eq!(
                    dropped == 1,
                    slot.drop_loans(&d, &shape, now),
                    "seed {seed} step {step}"
                );
                "drop loans".to_owned()
            }
            83..=89 => {
                // A stale coordinator: fenced, and nothing changes.
                let book = random_book(&mut rng, now, rho);
                let err = write(2, &[(user, &book)])
                    .invoke::<Vec<u64>>(conn)
                    .unwrap_err();
                assert!(err.to_string().contains("FENCED"), "{err}");
                "fenced write".to_owned()
            }
            _ => {
                let escrow = if rng.random_bool(0.2) {
                    d.escrow
                } else {
                    rho * rng.random_range(0.0..1.0)
                };
                let inv = books::set_default_invocation(
                    &s.default,
                    &keys,
                    1,
                    escrow,
                    args.keep_ms,
                    Some(now),
                );
                let changed: i64 = inv.invoke(conn).unwrap();
                let want = match &mut default {
                    Some(d) => d.change(escrow, now),
                    None => {
                        default = Some(DefaultEscrow::new(escrow));
                        true
                    }
                };
                assert_eq!(changed == 1, want, "seed {seed} step {step}");
                format!("default {escrow}")
            }
        };
        trace.push(format!("step {step}: t={now} {user}: {what}"));
        if trace.len() > 15 {
            trace.remove(0);
        }
        for u in touched {
            let Some(want) = model.get(u) else { continue };
            assert_eq!(
                &read_slot(conn, &storage(u)),
                want,
                "seed {seed} step {step}: {u}'s stored state differs\n{}",
                trace.join("\n")
            );
        }
        let meta: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(&keys.meta)
            .arg(&["d", "dp", "dt"])
            .query(conn)
            .unwrap();
        assert_eq!(
            books::decode_default(&meta).unwrap(),
            default,
            "seed {seed} step {step}"
        );
    }
    // Every key the scripts wrote has a TTL (keep_ms or longer).
    for u in users {
        let pttl: i64 = redis::cmd("PTTL").arg(storage(u)).query(conn).unwrap();
        assert!(pttl == -2 || pttl >= 3_000_000, "{u}: PTTL {pttl}");
    }
    let active: Vec<String> = redis::cmd("ZRANGE")
        .arg(&keys.active)
        .arg(0)
        .arg(-1)
        .query(conn)
        .unwrap();
    assert!(!active.is_empty() && active.iter().all(|a| users.contains(&a.as_str())));
}

#[test]
fn lua_global_scripts_match_the_reference_model() {
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let _: () = redis::cmd("SET")
        .arg(FENCE)
        .arg(1)
        .query(&mut conn)
        .unwrap();
    let scripts = Scripts {
        check: Global::Check.script(),
        write: Global::WriteBook.script(),
        drop: Global::DropLoans.script(),
        default: Global::SetDefault.script(),
    };
    for seed in 0..SEEDS {
        run(seed, &mut conn, &scripts);
    }
}

/// Malformed calls are refused by the scripts themselves (quotad never sends them; this
/// guards the scripts' own argument checks).
#[test]
fn global_scripts_refuse_wrong_arity() {
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    for g in Global::ALL {
        let err = g
            .script()
            .key("k")
            .arg(1)
            .invoke::<i64>(&mut conn)
            .unwrap_err();
        assert!(err.to_string().contains("expected"), "{g:?}: {err}");
    }
    assert_eq!(redis.dbsize(), 0);
}
