//! The node's tests: two and three regions on map stores and one manual clock, every
//! message delivered at once. They drive the node only through its API, so they sit
//! beside the parts rather than in one of them.

use super::*;
use crate::clock::ManualClock;
use crate::coordinator::Mode;
use crate::coordinator::lease::Reservation;
use crate::coordinator::message::{ExchangeReply, KeyReport, PolicyReport};
use std::sync::Arc;

/// A store that keeps books in a map; every write durable.
#[derive(Default)]
struct MapStore {
    books: BTreeMap<String, LeaseBook>,
    counters: Counters,
    /// Keys whose counters differ from `counters`.
    key_counters: BTreeMap<String, Counters>,
    escrow: Option<f64>,
    /// (policy, key) of every book write, in order.
    writes: Vec<(String, String)>,
    failover: bool,
}

impl LeaseStore for MapStore {
    fn take_failover(&mut self) -> bool {
        std::mem::take(&mut self.failover)
    }
    fn write_book(&mut self, policy: &str, key: &str, book: &LeaseBook) -> Written {
        self.writes.push((policy.to_owned(), key.to_owned()));
        self.books.insert(key.to_owned(), book.clone());
        Written {
            durable: true,
            epoch: book.epoch,
        }
    }
    fn read_book(&mut self, _: &str, key: &str) -> Option<LeaseBook> {
        self.books.get(key).cloned()
    }
    fn books(&mut self, _: &str) -> Vec<(String, LeaseBook)> {
        self.books
            .iter()
            .map(|(k, b)| (k.clone(), b.clone()))
            .collect()
    }
    fn take_active(&mut self, _: &str) -> Vec<String> {
        vec!["k".to_owned()]
    }
    fn counters(&mut self, _: &str, key: &str) -> Counters {
        self.key_counters.get(key).copied().unwrap_or(self.counters)
    }
    fn default_escrow(&mut self, _: &str) -> Option<f64> {
        self.escrow
    }
    fn set_default_escrow(&mut self, _: &str, escrow: f64) -> bool {
        self.escrow = Some(escrow);
        true
    }
}

impl Clock for Arc<ManualClock> {
    fn now_us(&self) -> i64 {
        self.as_ref().now_us()
    }
}

type Pair = (Arc<ManualClock>, [MapStore; 2], Vec<Node<Arc<ManualClock>>>);

/// Two regions 50/50 of ρ = 100 over map stores, on one manual clock at 0.
fn pair() -> Pair {
    let p = Params::default();
    let policy = GlobalPolicy::from_weights("g", 1, 100.0, 100.0, &[1.0, 1.0], Mode::Proportional);
    let clock = Arc::new(ManualClock::new(0));
    let mut stores = [MapStore::default(), MapStore::default()];
    let nodes = (0..2)
        .map(|i| {
            Node::start(
                RegionId(i as u16),
                2,
                p,
                clock.clone(),
                1,
                vec![policy.clone()],
                &mut stores[i],
            )
        })
        .collect();
    (clock, stores, nodes)
}

/// One round of both regions with every message delivered at once; region 1 offers
/// `offered` units in the round. Returns the largest amount region 0 granted in it.
fn round_trip(pair: &mut Pair, offered: u64) -> f64 {
    let (_, stores, nodes) = pair;
    stores[1].counters.rejected += offered;
    let mut granted: f64 = 0.0;
    for i in 0..2 {
        let out = nodes[i].round(&mut stores[i]);
        for (to, ex) in out {
            let j = to.index();
            let reply = nodes[j].on_exchange(&ex, &mut stores[j]).expect("reply");
            if j == 0 {
                let grants = reply.policies.iter().flat_map(|p| &p.keys);
                for g in grants.filter_map(|k| k.grant) {
                    granted = granted.max(g.amount);
                }
            }
            nodes[i].on_reply(&reply, &mut stores[i]);
        }
    }
    granted
}

/// A pair after 15 rounds in which region 1 offered `offered` units each: past the
/// learning period, region 1 borrowing if `offered` is more than its escrow.
fn warmed_up(offered: u64) -> Pair {
    let mut pair = pair();
    for r in 1..=15i64 {
        pair.0.set(r * 1_000_000);
        round_trip(&mut pair, offered);
    }
    pair
}

/// Region 1's exchange for region 0, out of what its round sent.
fn to_lender(out: Vec<(RegionId, Exchange)>) -> Exchange {
    out.into_iter()
        .find(|(to, _)| *to == RegionId(0))
        .expect("an exchange for region 0")
        .1
}

/// Region 1's round at `t_us`, having offered `offered` units since the last: its
/// exchange for region 0, not delivered.
fn asks_at(pair: &mut Pair, t_us: LocalUs, offered: u64) -> Exchange {
    let (clock, stores, nodes) = pair;
    clock.set(t_us);
    stores[1].counters.rejected += offered;
    to_lender(nodes[1].round(&mut stores[1]))
}

fn rate(store: &MapStore, now: LocalUs) -> f64 {
    let tol = Params::default().step_tolerance_us();
    store.books.get("k").map_or(50.0, |b| b.rate(now, tol))
}

/// A book at escrow 50 that reserves 5 for region 1 (seq 1) until `until`.
fn leased_book(until: LocalUs) -> LeaseBook {
    let mut leased = LeaseBook::new(50.0);
    leased.reserved.push(Reservation {
        borrower: RegionId(1),
        seq: 1,
        amount: 5.0,
        until,
    });
    leased
}

/// Unchanged loan-free books are re-asserted every REASSERT_ROUNDS rounds, each in its
/// key's round; after a failover, every book of every policy in the next round.
#[test]
fn unchanged_books_are_reasserted_in_turn_and_all_after_a_failover() {
    let policies: Vec<GlobalPolicy> = ["a", "b"]
        .map(|n| GlobalPolicy::from_weights(n, 1, 100.0, 100.0, &[1.0, 1.0], Mode::Proportional))
        .to_vec();
    let clock = Arc::new(ManualClock::new(0));
    let mut store = MapStore::default();
    let leased = leased_book(600_000_000);
    for i in 0..20 {
        store.books.insert(format!("a{i}"), leased.clone());
    }
    let mut node = Node::start(
        RegionId(0),
        2,
        Params::default(),
        clock.clone(),
        1,
        policies,
        &mut store,
    );
    let mut per_round = Vec::new();
    for _ in 0..(1 + 2 * REASSERT_ROUNDS) {
        clock.advance(1_000_000);
        store.writes.clear();
        node.round(&mut store);
        per_round.push(
            store
                .writes
                .iter()
                .filter(|(_, k)| k.starts_with('a'))
                .count(),
        );
    }
    // The first round writes every adopted book (of both policies: the map store
    // lists them for each); later rounds only the keys whose turn it is.
    assert!(per_round[0] >= 20, "{per_round:?}");
    let later: usize = per_round[1..=REASSERT_ROUNDS as usize].iter().sum();
    assert!(
        (20..=2 * 20).contains(&later),
        "each book about once per cycle: {per_round:?}"
    );
    assert!(per_round[1..].iter().all(|&n| n < 20 * 2), "{per_round:?}");
    store.failover = true;
    clock.advance(1_000_000);
    store.writes.clear();
    node.round(&mut store);
    let policies_written: std::collections::BTreeSet<&str> =
        store.writes.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(
        policies_written.len(),
        2,
        "every policy re-asserted: {:?}",
        store.writes
    );
    assert!(store.writes.len() >= 40, "{}", store.writes.len());
}

/// More keys qualify for an exchange than it may carry: the lease goes first, then
/// what the peer asked about; the rest are counted as deferred, not dropped silently.
#[test]
fn an_exchange_carries_at_most_the_cap_leases_first() {
    let p = Params {
        max_exchange_keys: 3,
        ..Params::default()
    };
    let policy = GlobalPolicy::from_weights("g", 1, 100.0, 100.0, &[1.0, 1.0], Mode::Proportional);
    let clock = Arc::new(ManualClock::new(0));
    let mut store = MapStore::default();
    let leased = leased_book(60_000_000);
    store.books.insert("z-leased".into(), leased);
    let mut node = Node::start(
        RegionId(0),
        2,
        p,
        clock.clone(),
        1,
        vec![policy],
        &mut store,
    );
    // The peer asks about five keys (no loan wanted): each is "mentioned".
    let report = |key: &str| KeyReport {
        key: key.into(),
        demand: 1.0,
        want: None,
        release: None,
        held: None,
        freed: false,
    };
    let ex = Exchange {
        from: RegionId(1),
        incarnation: 1,
        to_incarnation: 0,
        t_req: 0,
        policies: vec![PolicyReport {
            name: "g".into(),
            applied: 1,
            keys: ["a", "b", "c", "d", "e"].map(report).to_vec(),
        }],
    };
    node.on_exchange(&ex, &mut store).expect("a reply");
    let out = node.round(&mut store);
    let keys: Vec<&str> = out[0].1.policies[0]
        .keys
        .iter()
        .map(|k| k.key.as_str())
        .collect();
    assert_eq!(keys, ["a", "b", "z-leased"]);
    assert_eq!(node.stats().keys_deferred, 3);
}

/// Region 1 offers 90/s, region 0 nothing. After the learning period and a few rounds,
/// region 1 enforces more than its escrow, region 0 less, and the two never sum above ρ.
#[test]
fn a_hot_region_borrows_and_the_sum_stays_within_rho() {
    let mut pair = pair();
    let mut max_sum: f64 = 0.0;
    let mut borrowed_seen = false;
    for r in 1..=20i64 {
        pair.0.set(r * 1_000_000);
        round_trip(&mut pair, 90);
        let now = pair.0.now_us();
        let rates = [rate(&pair.1[0], now), rate(&pair.1[1], now)];
        max_sum = max_sum.max(rates[0] + rates[1]);
        borrowed_seen |= rates[1] > 50.0 + 1.0 && rates[0] < 50.0 - 1.0;
    }
    assert!(max_sum <= 100.0 + 1e-9, "sum of enforced rates {max_sum}");
    assert!(borrowed_seen, "the hot region never borrowed");
}

/// A lender restarted on a store that holds its policy's state knows every reservation it
/// granted (each was written before its grant left) and lends again at once. Restarted on
/// a store that lost that state, it cannot know what the borrower still counts, and lends
/// nothing until any reservation of its previous life has ended.
#[test]
fn a_restarted_lender_lends_at_once_from_its_books_and_learns_without_them() {
    let mut pair = pair();
    let p = Params::default();
    let policy = GlobalPolicy::from_weights("g", 1, 100.0, 100.0, &[1.0, 1.0], Mode::Proportional);
    // A first start finds nothing in the store: no grant for D(1+ε) + m, then loans.
    let mut first_loan = None;
    for r in 1..=20i64 {
        pair.0.set(r * 1_000_000);
        if round_trip(&mut pair, 90) > 0.0 && first_loan.is_none() {
            first_loan = Some(r * 1_000_000);
        }
    }
    let first_loan = first_loan.expect("region 0 never lent");
    assert!(first_loan >= p.lender_hold_us(), "lent at {first_loan} µs");
    let restart = |pair: &mut Pair, incarnation: u64, t: i64| {
        pair.0.set(t);
        let (clock, stores, nodes) = pair;
        nodes[0] = Node::start(
            RegionId(0),
            2,
            p,
            clock.clone(),
            incarnation,
            vec![policy.clone()],
            &mut stores[0],
        );
    };
    // Restarted with its books: the next round lends.
    restart(&mut pair, 2, 20_500_000);
    pair.0.set(21_000_000);
    assert!(round_trip(&mut pair, 90) > 0.0, "no loan after a restart");
    // Restarted on a store that lost everything: nothing until the old holds have ended.
    pair.1[0] = MapStore::default();
    restart(&mut pair, 3, 21_500_000);
    for r in 22..=31i64 {
        pair.0.set(r * 1_000_000);
        let granted = round_trip(&mut pair, 90);
        assert_eq!(granted, 0.0, "lent {granted} at {r} s with no books");
    }
    let mut lent_again = false;
    for r in 32..=40i64 {
        pair.0.set(r * 1_000_000);
        lent_again |= round_trip(&mut pair, 90) > 0.0;
    }
    assert!(lent_again, "never lent again");
}

/// Three regions on map stores and one manual clock. Every message is delivered at
/// once, in order, together with the early exchanges each delivery causes; the grants
/// are logged as (lender, borrower, amount).
struct Trio {
    clock: Arc<ManualClock>,
    stores: Vec<MapStore>,
    nodes: Vec<Node<Arc<ManualClock>>>,
    grants: Vec<(usize, usize, f64)>,
    /// The largest Σ of the three books' net rates after any delivery.
    max_sum: f64,
}

impl Trio {
    fn new(weights: &[f64; 3], rho: f64) -> Trio {
        let policy = GlobalPolicy::from_weights("g", 1, rho, rho, weights, Mode::Proportional);
        let clock = Arc::new(ManualClock::new(0));
        let mut stores: Vec<MapStore> = (0..3).map(|_| MapStore::default()).collect();
        let nodes = (0..3)
            .map(|i| {
                let (c, p) = (clock.clone(), Params::default());
                Node::start(
                    RegionId(i),
                    3,
                    p,
                    c,
                    1,
                    vec![policy.clone()],
                    &mut stores[i as usize],
                )
            })
            .collect();
        Trio {
            clock,
            stores,
            nodes,
            grants: Vec::new(),
            max_sum: 0.0,
        }
    }

    fn deliver(&mut self, from: usize, out: Vec<(RegionId, Exchange)>) {
        let mut queue: std::collections::VecDeque<(usize, RegionId, Exchange)> =
            out.into_iter().map(|(to, ex)| (from, to, ex)).collect();
        while let Some((from, to, ex)) = queue.pop_front() {
            let j = to.index();
            let reply = self.nodes[j]
                .on_exchange(&ex, &mut self.stores[j])
                .expect("reply");
            for k in reply.policies.iter().flat_map(|p| &p.keys) {
                if let Some(g) = k.grant {
                    self.grants.push((j, from, g.amount));
                }
            }
            let early = self.nodes[j].early_exchanges(&mut self.stores[j]);
            queue.extend(early.into_iter().map(|(t, e)| (j, t, e)));
            self.nodes[from].on_reply(&reply, &mut self.stores[from]);
            let early = self.nodes[from].early_exchanges(&mut self.stores[from]);
            queue.extend(early.into_iter().map(|(t, e)| (from, t, e)));
            let (now, tol) = (self.clock.now_us(), Params::default().step_tolerance_us());
            let sum: f64 = self
                .stores
                .iter()
                .map(|s| {
                    let book = s.books.get("k");
                    book.map_or(s.escrow.unwrap_or(0.0), |b| b.net_rate(now, tol))
                })
                .sum();
            self.max_sum = self.max_sum.max(sum);
        }
    }

    /// Rounds 1-14 s of every region, region 1 hot (1000/s offered), the others idle: past
    /// the learning period, region 1 borrows.
    fn region_1_hot_past_learning(&mut self) {
        for t in 1..=14 {
            for r in 0..3 {
                self.round(r, t, if r == 1 { 1000 } else { 0 });
            }
        }
    }

    /// A round of region `r` at `t` seconds, offering it `offered` more units.
    fn round(&mut self, r: usize, t: i64, offered: u64) {
        self.clock.set(t * 1_000_000);
        self.stores[r].counters.rejected += offered;
        let out = self.nodes[r].round(&mut self.stores[r]);
        self.deliver(r, out);
    }

    fn loan(&self, borrower: usize, lender: u16) -> f64 {
        let now = self.clock.now_us();
        let book = self.stores[borrower].books.get("k");
        book.and_then(|b| b.loan_from(RegionId(lender), now))
            .map_or(0.0, |l| l.amount)
    }
}

/// Capacity moves from one borrower to another between rounds: region 1 borrows all of
/// region 0's spare; then region 2 gets hot and asks region 0, which can grant little
/// (it is reserved for region 1). Region 1 gives back at once when it hears of region
/// 2's demand, region 0 tells region 2 the capacity is free, and region 2 asks again:
/// within region 2's one round, not a round of each region in turn.
#[test]
fn freed_capacity_reaches_the_next_borrower_within_one_round() {
    let mut trio = Trio::new(&[8.0, 1.0, 1.0], 1000.0);
    trio.region_1_hot_past_learning();
    let before = trio.loan(1, 0);
    assert!(before > 500.0, "region 1 borrowed {before} from region 0");
    // Region 2 gets as hot: one round of its own.
    trio.grants.clear();
    trio.round(2, 15, 1000);
    let to_2: Vec<f64> = trio
        .grants
        .iter()
        .filter(|g| g.0 == 0 && g.1 == 2)
        .map(|g| g.2)
        .collect();
    assert!(to_2.len() >= 2, "one grant only: {to_2:?}");
    let (first, last) = (to_2[0], trio.loan(2, 0));
    assert!(
        last > first + 100.0,
        "region 2 asked again for nothing: {to_2:?}"
    );
    assert!(
        trio.loan(1, 0) < before - 100.0,
        "region 1 gave nothing back"
    );
    assert!(
        trio.max_sum <= 1000.0 + 1e-9,
        "Σ R reached {}",
        trio.max_sum
    );
}

/// A demand step between rounds is acted on before the next round: region 2 gets hot a
/// quarter of a round after its last one; its sense reads the step, plans, and asks
/// region 0 in an early exchange, which grants. Steady demand read between rounds, by
/// contrast, sends nothing.
#[test]
fn a_demand_step_between_rounds_borrows_before_the_next_round() {
    let mut trio = Trio::new(&[8.0, 1.0, 1.0], 1000.0);
    trio.region_1_hot_past_learning();
    // Steady: region 1 keeps its 1000/s, read a quarter of a round on.
    trio.clock.set(14_250_000);
    trio.stores[1].counters.rejected += 250;
    trio.nodes[1].sense(&mut trio.stores[1]);
    let steady = trio.nodes[1].early_exchanges(&mut trio.stores[1]);
    assert!(
        steady.is_empty(),
        "steady demand sent {} early",
        steady.len()
    );
    // The step: region 2, idle so far, offered 1000/s for that quarter.
    trio.stores[2].counters.rejected += 250;
    trio.grants.clear();
    trio.nodes[2].sense(&mut trio.stores[2]);
    let out = trio.nodes[2].early_exchanges(&mut trio.stores[2]);
    assert!(
        out.iter().any(|(to, _)| to.index() == 0),
        "region 2 did not ask region 0"
    );
    trio.deliver(2, out);
    assert!(
        trio.loan(2, 0) > 0.0,
        "no loan before region 2's next round"
    );
    assert!(
        trio.max_sum <= 1000.0 + 1e-9,
        "Σ R reached {}",
        trio.max_sum
    );
}

/// The bug a toy simulation of this protocol once found (docs/global-budgets.md, the safety rule):
/// a borrower that took an older grant after announcing a newer release watermark
/// counted a loan whose reservation the lender had already dropped (Σ R reached
/// 1.0006 ρ). Here the older grant is also the larger one, so taking it would show.
#[test]
fn a_grant_older_than_the_announced_watermark_is_refused() {
    let mut pair = warmed_up(90);
    let (clock, stores, nodes) = &mut pair;
    let grant = |r: &ExchangeReply| r.policies[0].keys[0].grant.expect("a grant");
    // Two requests in a row: the first while region 1 is hot, the second once it has
    // cooled down (it wants much less). Their replies come back in the wrong order.
    clock.set(16_000_000);
    stores[1].counters.rejected += 90;
    let ex_a = to_lender(nodes[1].round(&mut stores[1]));
    let reply_a = nodes[0].on_exchange(&ex_a, &mut stores[0]).expect("reply");
    clock.set(17_000_000);
    stores[1].counters.rejected += 5;
    let ex_b = to_lender(nodes[1].round(&mut stores[1]));
    let reply_b = nodes[0].on_exchange(&ex_b, &mut stores[0]).expect("reply");
    let (ga, gb) = (grant(&reply_a), grant(&reply_b));
    assert!(gb.seq > ga.seq && ga.amount > gb.amount, "{ga:?} {gb:?}");
    nodes[1].on_reply(&reply_b, &mut stores[1]);
    // The borrower announces the newer lease as its watermark; the lender drops the
    // older, larger reservation.
    clock.set(18_000_000);
    let ex_c = to_lender(nodes[1].round(&mut stores[1]));
    assert_eq!(ex_c.policies[0].keys[0].release, Some(gb.seq));
    nodes[0].on_exchange(&ex_c, &mut stores[0]);
    assert!(
        stores[0].books["k"]
            .reserved
            .iter()
            .all(|r| r.seq >= gb.seq)
    );
    // The delayed older grant arrives: it must not count.
    let stale_before = nodes[1].stats().stale_grants;
    nodes[1].on_reply(&reply_a, &mut stores[1]);
    assert_eq!(nodes[1].stats().stale_grants, stale_before + 1);
    let now = clock.now_us();
    let loan = stores[1].books["k"].loan_from(RegionId(0), now).copied();
    assert!(loan.is_none_or(|l| l.seq == gb.seq), "{loan:?}");
    let sum = rate(&stores[0], now) + rate(&stores[1], now);
    assert!(sum <= 100.0 + 1e-9, "Σ R = {sum}");
}

/// Exchanges overtake each other on a WAN. An ask that arrives after a newer one of the
/// same borrower is not answered with a grant: under a newer seq, its smaller loan would
/// replace the larger one the borrower holds, while the lender still reserved the larger
/// one until the borrower's release came back (capacity that neither region used; in the
/// slow-WAN scenario, for seconds on end).
#[test]
fn an_exchange_overtaken_by_a_newer_one_is_not_granted() {
    let mut pair = warmed_up(10);
    // Region 1 asks while mildly hot, then, its demand up, for more. The second
    // exchange arrives first.
    let older = asks_at(&mut pair, 16_000_000, 60);
    let newer = asks_at(&mut pair, 17_000_000, 90);
    let (clock, stores, nodes) = &mut pair;
    let want = |ex: &Exchange| ex.policies[0].keys[0].want.unwrap_or(0.0);
    assert!(want(&newer) > want(&older), "{newer:?} {older:?}");
    let reply_new = nodes[0].on_exchange(&newer, &mut stores[0]).expect("reply");
    let big = reply_new.policies[0].keys[0].grant.expect("a grant");
    assert!(big.amount > want(&older), "{big:?}");
    nodes[1].on_reply(&reply_new, &mut stores[1]);
    // The older one, late: answered (its demand and releases are news), but not granted.
    let reply_old = nodes[0].on_exchange(&older, &mut stores[0]).expect("reply");
    assert_eq!(reply_old.policies[0].keys[0].grant, None);
    assert_eq!(nodes[0].stats().stale_exchanges, 1);
    nodes[1].on_reply(&reply_old, &mut stores[1]);
    // The borrower still holds the larger loan, and the lender reserves nothing more.
    let now = clock.now_us();
    let loan = stores[1].books["k"].loan_from(RegionId(0), now).copied();
    assert_eq!(loan.map(|l| (l.seq, l.amount)), Some((big.seq, big.amount)));
    assert_eq!(
        stores[0].books["k"].reserved_for(RegionId(1), now),
        big.amount
    );
}

/// An exchange more than a lease older than the newest is no late message (it would
/// answer nothing its sender still counts): the sender's clock stepped back, and its
/// asks are answered at once, not once its clock is back where it was. A restarted
/// sender (a new incarnation) starts over.
#[test]
fn an_exchange_a_lease_older_than_the_newest_or_of_a_new_life_is_taken() {
    let mut pair = warmed_up(90);
    let ex = asks_at(&mut pair, 16_000_000, 90);
    let (_, stores, nodes) = &mut pair;
    let mut stepped = ex.clone();
    stepped.t_req = ex.t_req - Params::default().lease_us - 1;
    let mut late = ex.clone();
    let granted = |r: Option<ExchangeReply>| r.expect("reply").policies[0].keys[0].grant;
    assert!(granted(nodes[0].on_exchange(&ex, &mut stores[0])).is_some());
    assert!(granted(nodes[0].on_exchange(&stepped, &mut stores[0])).is_some());
    // From then on, the stepped clock is the newest: a message just before it is late.
    late.t_req = stepped.t_req - 1;
    assert_eq!(granted(nodes[0].on_exchange(&late, &mut stores[0])), None);
    // A restarted sender starts over, whatever its clock says.
    let mut reborn = late.clone();
    reborn.incarnation += 1;
    assert!(granted(nodes[0].on_exchange(&reborn, &mut stores[0])).is_some());
}

/// A re-split (version 2, 50/50 -> 80/20) rolled out region 0 first: region 0 waits at
/// its old escrow while region 1 runs version 1 (an increase waits for every peer),
/// region 1 lowers to 20 the moment it installs version 2 (a decrease applies at once),
/// and region 0 rises to 80 once region 1 reports version 2 applied. At no step does the
/// sum of the escrows in force exceed ρ.
#[test]
fn a_resplit_lowers_at_once_and_raises_after_every_peer_applied_it() {
    let mut pair = pair();
    round_trip(&mut pair, 0);
    let v2 = GlobalPolicy::from_weights("g", 2, 100.0, 100.0, &[4.0, 1.0], Mode::Proportional);
    let status = |pair: &Pair, i: usize| pair.2[i].policy_status().remove(0);
    let sum = |pair: &Pair| status(pair, 0).escrow_in_force + status(pair, 1).escrow_in_force;

    {
        let (_, stores, nodes) = &mut pair;
        nodes[0].set_policy(v2.clone(), &mut stores[0]);
    }
    for _ in 0..3 {
        round_trip(&mut pair, 0);
        let s0 = status(&pair, 0);
        assert_eq!((s0.version, s0.escrow_in_force), (2, 50.0));
        assert!(s0.resplit_pending, "region 1 still runs version 1");
        assert_eq!(s0.peers_applied[1], 1);
        assert!(sum(&pair) <= 100.0 + 1e-9);
    }

    {
        let (_, stores, nodes) = &mut pair;
        nodes[1].set_policy(v2.clone(), &mut stores[1]);
    }
    let s1 = status(&pair, 1);
    assert_eq!(
        (s1.version, s1.escrow_in_force),
        (2, 20.0),
        "lowered at once"
    );
    assert_eq!(
        pair.1[1].escrow,
        Some(20.0),
        "and the store's default with it"
    );
    assert!(sum(&pair) <= 100.0 + 1e-9);

    for _ in 0..3 {
        round_trip(&mut pair, 0);
        assert!(sum(&pair) <= 100.0 + 1e-9);
    }
    let s0 = status(&pair, 0);
    assert_eq!(s0.escrow_in_force, 80.0, "raised once region 1 applied v2");
    assert!(!s0.resplit_pending);
    assert_eq!(s0.peers_applied, vec![2, 2]);
    assert_eq!(pair.1[0].escrow, Some(80.0));

    // A delayed push of the old config changes nothing.
    let v1 = GlobalPolicy::from_weights("g", 1, 100.0, 100.0, &[1.0, 1.0], Mode::Proportional);
    let (_, stores, nodes) = &mut pair;
    nodes[0].set_policy(v1, &mut stores[0]);
    assert_eq!(nodes[0].policy_status()[0].version, 2);
}

/// A round's replies taken together (as the daemon takes the replies queued on its
/// thread) write the borrower's book once, not once per lender, and every grant in them
/// counts: both lenders' loans are renewed in that one write.
#[test]
fn replies_taken_together_write_the_book_once() {
    let mut trio = Trio::new(&[1.0, 1.0, 1.0], 1000.0);
    trio.region_1_hot_past_learning();
    let until = |trio: &Trio, lender: u16| {
        let now = trio.clock.now_us();
        trio.stores[1].books["k"]
            .loan_from(RegionId(lender), now)
            .map(|l| l.until)
    };
    let before = [until(&trio, 0), until(&trio, 2)];
    assert!(
        before.iter().all(Option::is_some),
        "region 1 borrows from both: {before:?}"
    );
    trio.clock.set(15_000_000);
    trio.stores[1].counters.rejected += 1000;
    let out = trio.nodes[1].round(&mut trio.stores[1]);
    let replies: Vec<ExchangeReply> = out
        .iter()
        .map(|(to, ex)| {
            let j = to.index();
            trio.nodes[j]
                .on_exchange(ex, &mut trio.stores[j])
                .expect("a reply")
        })
        .collect();
    assert_eq!(replies.len(), 2, "an exchange to each lender");
    let writes = trio.stores[1].writes.len();
    trio.nodes[1].on_replies(&replies, &mut trio.stores[1]);
    assert_eq!(
        trio.stores[1].writes[writes..],
        [("g".to_owned(), "k".to_owned())],
        "one write of the book for both replies"
    );
    let after = [until(&trio, 0), until(&trio, 2)];
    assert!(
        after.iter().zip(&before).all(|(a, b)| a > b),
        "both loans renewed: {before:?} -> {after:?}"
    );
}

/// A borrower with nine lenders asks each again once its loan is off the plan by more than
/// a ninth of the hysteresis: nine loans each short by almost the whole of it would leave
/// 9% of ρ unasked for, which cost ten regions (S15) 3% of utilisation.
#[test]
fn a_borrower_of_nine_lenders_splits_the_hysteresis_between_them() {
    use super::planning::plan;
    use super::state::{KeyState, Reported};
    use crate::coordinator::allocation;
    use crate::coordinator::lease::Loan;
    let p = Params::default();
    let policy = GlobalPolicy::from_weights("g", 1, 1000.0, 1000.0, &[1.0; 10], Mode::Proportional);
    let links = vec![Link::Connected; 10];
    let mut demand = vec![10.0; 10];
    demand[0] = 2000.0;
    let target = policy.allocate(&p, &demand, &[false; 10]);
    let loans = allocation::loans_to(&policy.escrow, &target, 0);
    // Each loan 0.5% of ρ short of the plan: within a whole hysteresis (1%), not a ninth.
    let mut book = LeaseBook::new(100.0);
    for j in 1..10u16 {
        book.borrowed.push(Loan {
            lender: RegionId(j),
            lender_incarnation: 1,
            seq: 1,
            amount: floor_milli(loans[j as usize]) - 5.0,
            until: 60_000_000,
        });
    }
    let mut ks = KeyState::new(book, 10);
    ks.demand.observe(0, Counters::default(), policy.rho, &p);
    let offered = Counters {
        admitted: 0,
        rejected: 2000,
    };
    ks.demand.observe(1_000_000, offered, policy.rho, &p);
    for (j, peer) in ks.peers.iter_mut().enumerate().skip(1) {
        peer.demand = Some(Reported {
            demand: demand[j],
            round: 1,
        });
    }
    plan(&mut ks, &policy, RegionId(0), &links, 1, &p, 1_000_000);
    for (j, (peer, &loan)) in ks.peers.iter().zip(&loans).enumerate().skip(1) {
        let (want, planned) = (peer.lender.want, floor_milli(loan));
        assert!(planned > 5.0, "lender {j} plans {planned}");
        assert_eq!(want, planned, "lender {j}: asks {want}, plan {planned}");
    }
}

/// Status pages list the busiest keys: the most demand here first, ties in key order, at
/// most as many as asked; the totals and the count cover every tracked key.
#[test]
fn the_key_summary_lists_the_busiest_keys_and_sums_every_key() {
    let clock = Arc::new(ManualClock::new(0));
    let policy = GlobalPolicy::from_weights("g", 1, 100.0, 100.0, &[1.0, 1.0], Mode::Proportional);
    let mut store = MapStore::default();
    for key in ["c", "b", "a"] {
        let mut book = LeaseBook::new(50.0);
        book.reserved.push(Reservation {
            borrower: RegionId(1),
            seq: 1,
            amount: 5.0,
            until: 60_000_000,
        });
        store.books.insert(key.to_owned(), book);
        store
            .key_counters
            .insert(key.to_owned(), Counters::default());
    }
    let mut node = Node::start(
        RegionId(0),
        2,
        Params::default(),
        clock.clone(),
        1,
        vec![policy],
        &mut store,
    );
    // "k", the store's one active key, has traffic: 40 requests a second.
    for r in 1..=3 {
        clock.set(r * 1_000_000);
        store.counters.admitted += 40;
        node.round(&mut store);
    }
    let keys = |s: &KeySummary| s.busiest.iter().map(|k| k.key.clone()).collect::<Vec<_>>();
    let all = node.key_summary(10);
    assert_eq!(keys(&all), ["k", "a", "b", "c"]);
    assert!(all.busiest[0].demand > 0.0, "{:?}", all.busiest[0]);
    assert_eq!(all.tracked, 4);
    let two = node.key_summary(2);
    assert_eq!(keys(&two), ["k", "a"]);
    assert_eq!(two.tracked, 4);
    assert_eq!(two.totals, all.totals);
    let [sum] = &two.totals[..] else {
        panic!("one policy: {:?}", two.totals)
    };
    assert_eq!((sum.policy.as_str(), sum.keys), ("g", 4));
    assert_eq!(sum.lent, 15.0, "every key's reservation, listed or not");
    assert_eq!(sum.demand, all.busiest[0].demand);
    assert_eq!(
        sum.enforced,
        all.busiest.iter().map(|k| k.enforced).sum::<f64>()
    );
}
