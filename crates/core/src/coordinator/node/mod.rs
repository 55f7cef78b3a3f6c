//! One region's coordinator: the round, link states, and the lender and borrower rules.
//!
//! The safety rule (decrease before increase), in the order the code applies it:
//! 1. The borrower reads its clock (`t_req`) *before* it builds the request.
//! 2. The lender appends a reservation held until `now + D(1+ε) + m` by its clock, writes
//!    the book, and grants only if the store says the write is durable.
//! 3. The borrower counts the grant until `t_req + D(1−ε)` by its clock, accepts only a
//!    seq above every seq it accepted from that lender incarnation (hence never below a
//!    watermark it announced), keeps only the newest lease per lender, and announces
//!    `release = seq` only once the book holding that lease is durable.
//!
//! Everything here is deterministic: time comes from the node's [`Clock`], the store and
//! the network belong to the caller ([`LeaseStore`]; messages are returned, not sent), and
//! every map is ordered.
//!
//! The node is split by what each part owns:
//! - `links`: per-peer link state (heard from, round trips, [`Link`]) and what is pending
//!   for a peer between rounds;
//! - `state`: the per-policy and per-key state (`PolicyState`, `KeyState`, and per key the
//!   state for each peer in one `KeyPeer`), and how books are read and written;
//! - `planning`: the refresh of every engaged key (in a round and after a heal), the plan
//!   of one key, the end of a re-split, and which keys matter (urgency, relevance);
//! - `lender`: answering a peer's exchange, and lending;
//! - `borrower`: building exchanges and taking replies.
//!
//! This file keeps the [`Node`] itself, its public API, the store it writes through
//! ([`LeaseStore`], [`Written`]), and the round that drives the parts.

mod borrower;
mod lender;
mod links;
mod planning;
mod state;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;

use serde::Serialize;

use super::demand::Counters;
use super::lease::LeaseBook;
use super::message::Exchange;
use super::{GlobalPolicy, LocalUs, Params, RegionId};
use crate::clock::Clock;

pub use links::Link;
use links::Peer;
use state::PolicyState;

/// The region's store as the coordinator uses it (Redis in the daemon, a map in the
/// simulator). Writes settle the key's bucket at the old rate before the book changes.
pub trait LeaseStore {
    /// Replaces the key's book, settling its bucket at the old rate first. A book whose
    /// `epoch` is below the stored one loses its loans on the way in (they predate a
    /// backward step the store detected, see [`LeaseBook::observe_time`]).
    fn write_book(&mut self, policy: &str, key: &str, book: &LeaseBook) -> Written;
    /// The key's book, if it has one.
    fn read_book(&mut self, policy: &str, key: &str) -> Option<LeaseBook>;
    /// Every key of the policy that has a book (recovery after a restart).
    fn books(&mut self, policy: &str) -> Vec<(String, LeaseBook)>;
    /// Keys of the policy with traffic since the previous call.
    fn take_active(&mut self, policy: &str) -> Vec<String>;
    /// The key's cumulative counts.
    fn counters(&mut self, policy: &str, key: &str) -> Counters;
    /// The escrow the store applies to keys of the policy that have no book; `None` if
    /// never set (a first start).
    fn default_escrow(&mut self, policy: &str) -> Option<f64>;
    /// Sets the escrow for keys without a book; false if the store refused (fenced).
    fn set_default_escrow(&mut self, policy: &str, escrow: f64) -> bool;

    /// Several books at once, in order. The node reads and writes through these, so that
    /// a store with round trips (Redis) can pipeline them: with 100,000 keys, one round
    /// trip each would outlast the coordinator lock. The defaults go one by one.
    fn read_books(&mut self, policy: &str, keys: &[&str]) -> Vec<Option<LeaseBook>> {
        keys.iter().map(|k| self.read_book(policy, k)).collect()
    }
    /// Writes several books, in order; one [`Written`] each.
    fn write_books(&mut self, policy: &str, books: &[(&str, &LeaseBook)]) -> Vec<Written> {
        books
            .iter()
            .map(|(k, b)| self.write_book(policy, k, b))
            .collect()
    }
    /// Counters of several keys, in order.
    fn counters_of(&mut self, policy: &str, keys: &[&str]) -> Vec<Counters> {
        keys.iter().map(|k| self.counters(policy, k)).collect()
    }
    /// Whether the store failed over since the last call (a write it took durably may be
    /// gone): the next round re-asserts every book, not only the changed ones.
    fn take_failover(&mut self) -> bool {
        false
    }
}

/// An engaged book that did not change since its last durable write, and carries no
/// loans, is re-asserted every this many rounds rather than every round: with 100,000
/// leased keys, a write of each per round would cost Redis seconds per round. A book
/// with loans is still written every round (it keeps the stored high-water mark, against
/// which the store detects a backward clock step, fresh), and so is every book in the
/// round after a failover.
pub const REASSERT_ROUNDS: u64 = 5;

/// What the store did with a book write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Written {
    /// Acknowledged by a replica where there is one: a lender must not grant, and a
    /// borrower must not release, on a write a failover could lose.
    pub durable: bool,
    /// The key's step epoch in the store after the write. Above the book's, the store had
    /// dropped the loans that book carries and kept them out: the writer drops them too.
    pub epoch: u64,
}

/// Counters for the report and for `/v1/status`.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct NodeStats {
    /// Rounds run.
    pub rounds: u64,
    /// Loans granted.
    pub grants: u64,
    /// Loans that would have been granted, withheld because their reservation was not
    /// durable.
    pub grants_withheld: u64,
    /// Loans accepted as a borrower.
    pub loans_accepted: u64,
    /// Grants refused as stale (older than one accepted, ended, or before a backward step).
    pub stale_grants: u64,
    /// Exchanges that arrived after a newer one of the same peer: nothing granted.
    pub stale_exchanges: u64,
    /// Backward clock steps detected.
    pub backward_steps: u64,
    /// Σ over rounds of the keys exchanged with each peer (for bytes per key).
    pub key_reports: u64,
    /// Keys left out of an exchange because more qualified than one may carry.
    pub keys_deferred: u64,
}

/// One key as the coordinator sees it, for status pages and tests.
#[derive(Debug, Clone, Serialize)]
pub struct KeyStatus {
    /// The policy.
    pub policy: String,
    /// The key.
    pub key: String,
    /// This region's escrow, units per second.
    pub escrow: f64,
    /// The rate enforced here: escrow − lent + borrowed.
    pub enforced: f64,
    /// Units per second lent to others.
    pub lent: f64,
    /// Units per second borrowed.
    pub borrowed: f64,
    /// Smoothed offered load here.
    pub demand: f64,
    /// What the allocation would have this region enforce.
    pub target: f64,
}

/// A key's figures, before its names are copied for a status page.
#[derive(Debug, Clone, Copy)]
struct KeyNumbers {
    escrow: f64,
    enforced: f64,
    lent: f64,
    borrowed: f64,
    demand: f64,
    target: f64,
}

/// Per policy, the sums over its tracked keys (for the metrics).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PolicyTotals {
    /// The policy.
    pub policy: String,
    /// Σ enforced rate.
    pub enforced: f64,
    /// Σ lent.
    pub lent: f64,
    /// Σ borrowed.
    pub borrowed: f64,
    /// Σ demand.
    pub demand: f64,
    /// Keys tracked.
    pub keys: usize,
}

impl PolicyTotals {
    fn add(&mut self, k: &KeyNumbers) {
        self.enforced += k.enforced;
        self.lent += k.lent;
        self.borrowed += k.borrowed;
        self.demand += k.demand;
        self.keys += 1;
    }
}

/// What [`Node::key_summary`] returns.
#[derive(Debug, Clone, Default)]
pub struct KeySummary {
    /// One entry per policy the node runs, in name order.
    pub totals: Vec<PolicyTotals>,
    /// The keys with the most demand here, busiest first.
    pub busiest: Vec<KeyStatus>,
    /// Keys tracked, over every policy.
    pub tracked: usize,
    /// The node's clock when the figures were taken: each key's rate holds at this
    /// instant, and changes after it with the next message or loan end.
    pub at_us: i64,
}

/// One global policy as the coordinator runs it: which version, and how far a re-split
/// to it has come (for status pages: an operator rolling out a new split watches this).
#[derive(Debug, Clone, Serialize)]
pub struct PolicyStatus {
    /// The policy.
    pub policy: String,
    /// The version installed here.
    pub version: u64,
    /// The newest version this region is durably at or below (what it reports to peers).
    pub applied: u64,
    /// This region's escrow now: min(old, new) while a re-split waits for its peers.
    pub escrow_in_force: f64,
    /// Whether a re-split is still waiting for a peer to report this version applied.
    pub resplit_pending: bool,
    /// Per region (this one's entry is its own `applied`): the version it reported applied.
    pub peers_applied: Vec<u64>,
}

/// One region's coordinator: its books, its peers and the rounds between them (driven by
/// the daemon or the simulator).
pub struct Node<C: Clock> {
    me: RegionId,
    params: Params,
    clock: C,
    incarnation: u64,
    next_seq: u64,
    round: u64,
    /// Rounds and senses so far: early exchanges go at most once per peer per tick.
    tick: u64,
    started: LocalUs,
    high_water: LocalUs,
    /// Per peer (this region's own entry unused): its incarnation, its link, and what is
    /// pending for it between rounds.
    peers: Vec<Peer>,
    policies: BTreeMap<String, PolicyState>,
    stats: NodeStats,
}

impl<C: Clock> Node<C> {
    /// Starts (or restarts) region `me`'s coordinator. `incarnation` must exceed every
    /// incarnation this region used before (the daemon keeps a counter in its store).
    /// Books already in the store are taken over.
    pub fn start(
        me: RegionId,
        regions: usize,
        params: Params,
        clock: C,
        incarnation: u64,
        policies: Vec<GlobalPolicy>,
        store: &mut dyn LeaseStore,
    ) -> Self {
        let now = clock.now_us();
        let mut node = Node {
            me,
            params,
            clock,
            incarnation,
            next_seq: 1,
            round: 0,
            tick: 0,
            started: now,
            high_water: now,
            peers: vec![Peer::default(); regions],
            policies: BTreeMap::new(),
            stats: NodeStats::default(),
        };
        for p in policies {
            node.install(p, store);
        }
        node
    }

    /// Installs a new version of a policy (config reload). Decreases apply at once;
    /// increases wait until every peer has applied this version. A version older than or
    /// equal to the one running is ignored (a delayed push of an old config).
    pub fn set_policy(&mut self, policy: GlobalPolicy, store: &mut dyn LeaseStore) {
        if self
            .policies
            .get(&policy.name)
            .is_some_and(|ps| policy.version <= ps.policy.version)
        {
            return;
        }
        self.install(policy, store);
    }

    fn install(&mut self, policy: GlobalPolicy, store: &mut dyn LeaseStore) {
        let n = self.peers.len();
        let me = self.me.index();
        let name = policy.name.clone();
        let running = self.policies.remove(&name);
        let old = match &running {
            Some(ps) => Some(ps.escrow_in_force(me)),
            None => store.default_escrow(&name),
        };
        let new = policy.escrow[me];
        let previous_escrow = old.filter(|o| (o - new).abs() > 1e-12);
        // Every reservation this region granted is in the store's books before its grant
        // left, so a node that finds the policy's state there (the default escrow is set
        // with the books and expires after them) knows everything a previous life lent and
        // may lend at once. A store without it (a first start, or a store that lost its
        // data) cannot say what borrowers still count: the policy lends nothing until any
        // reservation of a previous life has ended (Doorman's learning mode).
        let learning_until = match &running {
            Some(ps) => ps.learning_until,
            None if old.is_some() => LocalUs::MIN,
            None => self.clock.now_us() + self.params.lender_hold_us(),
        };
        // The newest version this region vouches for. A (re)start vouches for none until
        // its books show it (a stored default may already be lowered while books still
        // cover reservations of the old split); a transition keeps the last one complete.
        let applied = match &running {
            Some(ps) => ps.applied_version(me),
            None => 0,
        };
        let mut ps = PolicyState {
            policy,
            previous_escrow,
            applied,
            peer_applied: vec![0; n],
            default_durable: false,
            learning_until,
            keys: running.map(|ps| ps.keys).unwrap_or_default(),
        };
        // Every book in the store is re-asserted at the escrow now in force, also those of
        // keys this node had forgotten: a book keeps the escrow it was written with.
        ps.adopt_books(store, n);
        let escrow = ps.escrow_in_force(me);
        ps.default_durable = store.set_default_escrow(&name, escrow);
        self.policies.insert(name, ps);
    }

    fn escrow_in_force(&self, ps: &PolicyState) -> f64 {
        ps.escrow_in_force(self.me.index())
    }

    /// This region.
    pub fn region(&self) -> RegionId {
        self.me
    }

    /// This life of the node (bumped on every restart).
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The counters.
    pub fn stats(&self) -> NodeStats {
        self.stats
    }

    /// Keys in the exchange (hot here, leased, or mentioned by a peer lately).
    pub fn tracked_keys(&self) -> usize {
        self.policies.values().map(|p| p.keys.len()).sum()
    }

    /// The keys as status pages show them: per policy the sums over every tracked key,
    /// and the `busiest` keys with the most demand here (ties in key order), busiest
    /// first. Only those are copied out: the daemon publishes this up to ten times a
    /// round, and a list of 10,000 keys built and sorted each time was most of a
    /// coordinator's CPU.
    pub fn key_summary(&self, busiest: usize) -> KeySummary {
        let now = self.clock.now_us();
        let tol = self.params.step_tolerance_us();
        let mut totals = Vec::new();
        let mut all = Vec::new();
        for (name, ps) in &self.policies {
            let mut sum = PolicyTotals {
                policy: name.clone(),
                ..PolicyTotals::default()
            };
            for (key, ks) in &ps.keys {
                // The rate as `LeaseBook::rate` computes it, from sums taken once.
                let (lent, borrowed) = (
                    ks.book.reserved_total(now),
                    ks.book.borrowed_total(now, tol),
                );
                let numbers = KeyNumbers {
                    escrow: ks.book.escrow,
                    enforced: (ks.book.escrow - lent + borrowed).max(0.0),
                    // `+ 0.0`: an empty f64 sum is -0.0, which status pages print as such.
                    lent: lent + 0.0,
                    borrowed: borrowed + 0.0,
                    demand: ks.demand.value(),
                    target: ks.target_self,
                };
                sum.add(&numbers);
                all.push((name.as_str(), key.as_str(), numbers));
            }
            totals.push(sum);
        }
        let tracked = all.len();
        // Most demand first, then key and policy order: the same list however many keys
        // there are beyond it.
        let order = |a: &(&str, &str, KeyNumbers), b: &(&str, &str, KeyNumbers)| {
            b.2.demand
                .total_cmp(&a.2.demand)
                .then_with(|| a.1.cmp(b.1))
                .then_with(|| a.0.cmp(b.0))
        };
        if all.len() > busiest && busiest > 0 {
            all.select_nth_unstable_by(busiest - 1, order);
        }
        all.truncate(busiest);
        all.sort_by(order);
        KeySummary {
            totals,
            busiest: all
                .into_iter()
                .map(|(policy, key, n)| KeyStatus {
                    policy: policy.to_owned(),
                    key: key.to_owned(),
                    escrow: n.escrow,
                    enforced: n.enforced,
                    lent: n.lent,
                    borrowed: n.borrowed,
                    demand: n.demand,
                    target: n.target,
                })
                .collect(),
            tracked,
            at_us: now,
        }
    }

    /// One key's demand in every region (by region number) as this node last heard it,
    /// with how long ago, in µs of rounds (`GET /v1/usage`): this region's own estimate
    /// (age 0), each peer's last report; `None` for a region not heard of about the key,
    /// and for a key the node does not track (cold everywhere: each region runs on its
    /// escrow).
    pub fn key_view(&self, policy: &str, key: &str) -> Option<Vec<Option<(f64, i64)>>> {
        let ks = self.policies.get(policy)?.keys.get(key)?;
        let me = self.me.index();
        Some(
            ks.peers
                .iter()
                .enumerate()
                .map(|(j, peer)| match j == me {
                    true => Some((ks.demand.value(), 0)),
                    false => peer.demand.map(|r| {
                        let rounds = self.round.saturating_sub(r.round) as i64;
                        (r.demand, rounds * self.params.round_us)
                    }),
                })
                .collect(),
        )
    }

    /// The version of `policy` installed here, if it is one of the node's.
    pub fn version(&self, policy: &str) -> Option<u64> {
        self.policies.get(policy).map(|ps| ps.policy.version)
    }

    /// Every global policy the node runs, with its re-split's progress.
    pub fn policy_status(&self) -> Vec<PolicyStatus> {
        let me = self.me.index();
        self.policies
            .values()
            .map(|ps| {
                let applied = ps.applied_version(me);
                let mut peers_applied = ps.peer_applied.clone();
                peers_applied[me] = applied;
                PolicyStatus {
                    policy: ps.policy.name.clone(),
                    version: ps.policy.version,
                    applied,
                    escrow_in_force: ps.escrow_in_force(me),
                    resplit_pending: ps.previous_escrow.is_some(),
                    peers_applied,
                }
            })
            .collect()
    }

    /// Microseconds (node clock) until the next instant some tracked key's enforced rate
    /// changes by itself (a loan or reservation ends), if any: a status page shows the
    /// change then, not at the next event.
    pub fn next_change_in(&self) -> Option<i64> {
        let now = self.clock.now_us();
        self.policies
            .values()
            .flat_map(|ps| ps.keys.values())
            .filter_map(|ks| ks.book.next_expiry(now))
            .min()
            .map(|t| t - now)
    }

    /// A daemon-side backward-step check: drop every loan (the store does the same on its
    /// own clock, per key, on the next touch).
    fn observe_clock(&mut self, store: &mut dyn LeaseStore) -> LocalUs {
        let now = self.clock.now_us();
        if now + self.params.step_tolerance_us() < self.high_water {
            self.stats.backward_steps += 1;
            for (name, ps) in self.policies.iter_mut() {
                let mut stepped = Vec::new();
                for (key, ks) in ps.keys.iter_mut() {
                    if !ks.book.borrowed.is_empty() {
                        ks.book.borrowed.clear();
                        ks.book.epoch += 1;
                        stepped.push(key.clone());
                    }
                }
                ps.write(store, name, stepped.iter().map(String::as_str), self.round);
            }
        }
        self.high_water = self.high_water.max(now);
        now
    }

    /// One round: read demand, plan, re-assert every book, and build one exchange per peer.
    pub fn round(&mut self, store: &mut dyn LeaseStore) -> Vec<(RegionId, Exchange)> {
        let now = self.observe_clock(store);
        self.round += 1;
        self.tick += 1;
        self.stats.rounds += 1;
        self.clear_link_up();
        self.refresh(store, now, true);
        let me = self.me.index();
        (0..self.peers.len())
            .filter(|&j| j != me)
            .map(|j| (RegionId(j as u16), self.exchange_for(j, now, false)))
            .collect()
    }

    /// What should not wait for the next round; call after delivering a message (usually
    /// empty):
    /// - a whole exchange for each peer heard from again since the last round (a heal, a
    ///   restart), planned with it connected, so that loans resume a round earlier;
    /// - an exchange of just the keys with news for a peer: a give-back this region made
    ///   as a borrower (the lender lowers its reservation a round earlier), capacity it
    ///   freed as a lender for a borrower it granted short, and the re-ask of a borrower
    ///   so told. After a heal, capacity moves from one borrower to another in a few
    ///   one-way delays instead of a round of each region in turn. At most one per peer
    ///   per tick (a round or a [`Self::sense`]), and one per round trip to it.
    pub fn early_exchanges(&mut self, store: &mut dyn LeaseStore) -> Vec<(RegionId, Exchange)> {
        let me = self.me.index();
        let now = self.observe_clock(store);
        let news: Vec<usize> = self
            .peers
            .iter()
            .enumerate()
            .filter(|&(j, peer)| j != me && !peer.link_up && peer.news && self.early_due(j, now))
            .map(|(j, _)| j)
            .collect();
        let up: Vec<usize> = self
            .peers
            .iter()
            .enumerate()
            .filter(|(_, peer)| peer.link_up)
            .map(|(j, _)| j)
            .collect();
        if up.is_empty() && news.is_empty() {
            return Vec::new();
        }
        let mut out = Vec::new();
        if !up.is_empty() {
            self.refresh(store, now, false);
            self.clear_link_up();
            for j in up {
                out.push((RegionId(j as u16), self.exchange_for(j, now, false)));
            }
        }
        for j in news {
            if self.link_at(j, now) == Link::Connected {
                self.peers[j].early_tick = self.tick;
                self.peers[j].early_at = Some(now);
                out.push((RegionId(j as u16), self.exchange_for(j, now, true)));
            }
        }
        out
    }
}

fn floor_milli(x: f64) -> f64 {
    (x * 1000.0).floor() / 1000.0
}

/// A peer's reported demand, as planning may use it: finite, not negative, and clamped
/// like our own estimate (a retry storm, or a bogus report, must not swamp the split).
fn peer_demand(d: f32, policy: &GlobalPolicy, p: &Params) -> f64 {
    sanitize(d as f64).min(p.demand_clamp * policy.rho)
}

fn sanitize(x: f64) -> f64 {
    if x.is_finite() && x > 0.0 { x } else { 0.0 }
}
