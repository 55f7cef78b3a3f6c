//! The ways of enforcing one global budget that the simulator compares, fed identical
//! offered load: quotad's leases, and the baselines of docs/simulator.md.
//!
//! - `central`: one token bucket (ρ, B) that sees every request at once: the reference.
//! - `lease`: quotad: the production [`Node`] in every region over a [`RegionStore`].
//! - `static`: each region enforces its escrow E_i, nothing moves.
//! - `independent`: each region enforces the whole budget on its own.
//! - `count_sharing`: each region keeps a replica of the global bucket, spends its own
//!   admissions at once and everyone else's when their counts arrive (gubernator GLOBAL,
//!   Upstash multi-region): a stale count is a free admission. Counts go out every 100 ms,
//!   ten times as often as quotad's rounds, which flatters it.
//! - `naive`: each region sets its own rate to its share of the same allocation quotad uses,
//!   from its own fresh demand and its peers' last reports (DRL's flow-proportional
//!   share): no leases, so views that disagree over-commit.

use std::collections::BTreeMap;

use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Hypergeometric};
use serde::{Deserialize, Serialize};

use quotad_core::coordinator::demand::DemandEstimator;
use quotad_core::coordinator::lease::LeaseBook;
use quotad_core::coordinator::message::{Exchange, ExchangeReply};
use quotad_core::coordinator::node::{LeaseStore, Node};
use quotad_core::coordinator::wire::{self, KeyIds, KeyTable, Spelled};
use quotad_core::coordinator::{GlobalPolicy, LocalUs, Params, RegionId};

use super::clock::SimClock;
use super::store::{RegionStore, key_index, key_name};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModeKind {
    Central,
    Lease,
    Static,
    Independent,
    CountSharing,
    Naive,
}

impl ModeKind {
    pub const ALL: [ModeKind; 6] = [
        ModeKind::Central,
        ModeKind::Lease,
        ModeKind::Static,
        ModeKind::Independent,
        ModeKind::CountSharing,
        ModeKind::Naive,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ModeKind::Central => "central",
            ModeKind::Lease => "lease",
            ModeKind::Static => "static",
            ModeKind::Independent => "independent",
            ModeKind::CountSharing => "count_sharing",
            ModeKind::Naive => "naive",
        }
    }

    pub fn parse(s: &str) -> Option<ModeKind> {
        ModeKind::ALL.into_iter().find(|m| m.name() == s)
    }

    /// Whether invariant S is this mode's promise (a violation stops the run). The
    /// baselines' rates are recorded, not enforced: breaking S is what they are shown for.
    pub fn promises_bound(self) -> bool {
        matches!(self, ModeKind::Lease | ModeKind::Central)
    }
}

/// A message for the network, with the number of keys it carries (for the cost report).
pub struct Send {
    pub from: usize,
    pub to: usize,
    pub bytes: Vec<u8>,
    pub keys: u32,
    /// Ask the engine to call [`Regime::retry`] with this tag after this long.
    pub retry: Option<(i64, i64)>,
}

/// An exchange waiting for its reply (the daemon's client retries it on a timeout). It
/// stays until its reply comes or it is older than the client's timeout: a reply is read
/// against its request, and confirms the keys the request spelled out.
struct Pending {
    bytes: Vec<u8>,
    tries: u32,
    request: Exchange,
    spelled: Spelled,
}

/// How long the daemon's client waits for a reply, in rounds (its timeout).
const REPLY_ROUNDS: i64 = 3;

/// A receiver that cannot read a sender's key numbers answers this, then the epoch it
/// refused (the daemon answers HTTP 409).
const REFUSAL: u8 = b'!';

/// Retries of one exchange (as the daemon's client: each exchange on its own, so a round's
/// exchange is retried even when an early one to the same peer went out after it).
const MAX_RETRIES: u32 = 2;

/// Things that happen to a region (from the scenario's fault schedule).
#[derive(Debug, Clone, PartialEq)]
pub enum RegionEvent {
    Crash,
    Restart,
    LagStart,
    Failover,
    /// A new policy version reaches this region.
    Policy(GlobalPolicy),
}

pub struct Regime {
    pub kind: ModeKind,
    pub stores: Vec<RegionStore>,
    clocks: Vec<SimClock>,
    params: Params,
    /// The policy version each region runs.
    policies: Vec<GlobalPolicy>,
    nodes: Vec<Option<Node<SimClock>>>,
    naive: Vec<BTreeMap<u32, NaiveKey>>,
    /// Naive: rounds run per region.
    rounds: Vec<u64>,
    /// Count sharing: per region, per key, admissions not yet sent to each peer.
    unsent: Vec<BTreeMap<u32, Vec<u64>>>,
    /// Central: which of a tick's simultaneous requests get the tokens.
    split_rng: ChaCha8Rng,
    /// Lease: per (from, to, t_req), an exchange until its reply arrives or its retries
    /// are spent.
    pending: BTreeMap<(usize, usize, LocalUs), Pending>,
    /// Lease: per sender, per receiver, the sender's key numbers (the daemon's peer
    /// client holds these).
    key_ids: Vec<Vec<KeyIds>>,
    /// Lease: per receiver, per sender, the keys it learned (the daemon's handler).
    key_tables: Vec<Vec<KeyTable>>,
}

struct NaiveKey {
    demand: DemandEstimator,
    /// Per peer: last reported demand and the round it arrived in.
    peer: Vec<(f64, Option<u64>)>,
    active: u64,
    hot: Option<u64>,
    /// Whether this region's book holds a share other than its escrow.
    planned: bool,
}

impl NaiveKey {
    fn new(n: usize) -> Self {
        NaiveKey {
            demand: DemandEstimator::default(),
            peer: vec![(0.0, None); n],
            active: 0,
            hot: None,
            planned: false,
        }
    }
}

/// A region's count report (count sharing) or demand report (naive).
#[derive(Serialize, Deserialize)]
struct Report(Vec<(u32, f64)>);

impl Regime {
    /// Builds the regime with one store per region (central: one store on a clock with no
    /// error, the reference) and, for `lease`, a started node per region.
    pub fn new(
        kind: ModeKind,
        policy: &GlobalPolicy,
        params: Params,
        clocks: Vec<SimClock>,
        central_clock: SimClock,
        keys: u32,
        split_rng: ChaCha8Rng,
    ) -> Self {
        let n = clocks.len();
        let tol = params.step_tolerance_us();
        let mut regime = Regime {
            kind,
            stores: Vec::new(),
            clocks: clocks.clone(),
            params,
            policies: vec![policy.clone(); n],
            nodes: (0..n).map(|_| None).collect(),
            naive: (0..n).map(|_| BTreeMap::new()).collect(),
            rounds: vec![0; n],
            unsent: (0..n).map(|_| BTreeMap::new()).collect(),
            split_rng,
            pending: BTreeMap::new(),
            key_ids: (0..n).map(|_| fresh(n, KeyIds::new, &params)).collect(),
            key_tables: (0..n).map(|_| fresh(n, KeyTable::new, &params)).collect(),
        };
        let store_clocks = if kind == ModeKind::Central {
            vec![central_clock]
        } else {
            clocks
        };
        for (i, c) in store_clocks.into_iter().enumerate() {
            let mut store = RegionStore::new(c, policy, keys, tol);
            let rate = match kind {
                ModeKind::Central | ModeKind::Independent | ModeKind::CountSharing => policy.rho,
                _ => policy.escrow[i],
            };
            store.set_default_escrow(&policy.name, rate);
            store.take_changed();
            regime.stores.push(store);
        }
        if kind == ModeKind::Lease {
            for r in 0..n {
                regime.start_node(r);
            }
        }
        regime
    }

    fn start_node(&mut self, r: usize) {
        let store = &mut self.stores[r];
        store.incarnation += 1;
        self.nodes[r] = Some(Node::start(
            RegionId(r as u16),
            self.clocks.len(),
            self.params,
            self.clocks[r].clone(),
            store.incarnation,
            vec![self.policies[r].clone()],
            store,
        ));
    }

    /// The protocol timer's period, if the mode talks at all.
    pub fn timer_us(&self) -> Option<i64> {
        match self.kind {
            ModeKind::Lease | ModeKind::Naive => Some(self.params.round_us),
            ModeKind::CountSharing => Some(self.params.round_us / 10),
            _ => None,
        }
    }

    /// How often a lease node senses demand between rounds, if it does.
    pub fn sense_us(&self) -> Option<i64> {
        (self.kind == ModeKind::Lease && self.params.sense_us > 0).then_some(self.params.sense_us)
    }

    /// The region's sense timer fired: its node reads demand again and sends what should
    /// not wait for the round.
    pub fn sense(&mut self, r: usize, out: &mut Vec<Send>) {
        let (Some(node), store) = (self.nodes[r].as_mut(), &mut self.stores[r]) else {
            return;
        };
        node.sense(store);
        let early = node.early_exchanges(store);
        self.send_exchanges(r, early, out);
    }

    /// One tick's arrivals, `(region, key, count)`; returns how many of each are admitted.
    ///
    /// Requests within a tick count as simultaneous. Per-region buckets do not care in
    /// which order regions are served, but the central bucket does: it admits as many as it
    /// holds tokens for, and which of the simultaneous requests those are is drawn at
    /// random (a multivariate hypergeometric split), as random interleaving would give.
    pub fn admit_tick(&mut self, arrivals: &[(usize, u32, u64)]) -> Vec<u64> {
        if self.kind != ModeKind::Central {
            return arrivals
                .iter()
                .map(|&(r, key, n)| self.admit(r, key, n))
                .collect();
        }
        let mut out = vec![0; arrivals.len()];
        let mut by_key: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
        for (i, a) in arrivals.iter().enumerate() {
            by_key.entry(a.1).or_default().push(i);
        }
        for (key, idx) in by_key {
            let mut population: u64 = idx.iter().map(|&i| arrivals[i].2).sum();
            let mut left = self.stores[0].admit(key, population);
            for &i in &idx {
                let n = arrivals[i].2;
                let x = if population == n {
                    left
                } else {
                    Hypergeometric::new(population, left, n)
                        .map_or(0, |d| d.sample(&mut self.split_rng))
                };
                out[i] = x;
                population -= n;
                left -= x;
            }
        }
        out
    }

    /// `n` requests for `key` arrive in region `r`; returns how many are admitted.
    fn admit(&mut self, r: usize, key: u32, n: u64) -> u64 {
        match self.kind {
            ModeKind::CountSharing => {
                let admitted = self.stores[r].admit(key, n);
                if admitted > 0 {
                    let peers = self.clocks.len();
                    let unsent = self.unsent[r].entry(key).or_insert_with(|| vec![0; peers]);
                    for c in unsent.iter_mut() {
                        *c += admitted;
                    }
                }
                admitted
            }
            _ => self.stores[r].admit(key, n),
        }
    }

    /// The region's protocol timer fired.
    pub fn timer(&mut self, r: usize, out: &mut Vec<Send>) {
        match self.kind {
            ModeKind::Lease => {
                let (Some(node), store) = (self.nodes[r].as_mut(), &mut self.stores[r]) else {
                    return;
                };
                let exchanges = node.round(store);
                let stale = store.now() - REPLY_ROUNDS * self.params.round_us;
                self.pending
                    .retain(|&(from, _, t_req), _| from != r || t_req >= stale);
                self.send_exchanges(r, exchanges, out);
            }
            ModeKind::CountSharing => {
                let unsent = std::mem::take(&mut self.unsent[r]);
                for to in (0..self.clocks.len()).filter(|&j| j != r) {
                    let counts: Vec<(u32, f64)> = unsent
                        .iter()
                        .filter(|(_, c)| c[to] > 0)
                        .map(|(k, c)| (*k, c[to] as f64))
                        .collect();
                    if !counts.is_empty() {
                        out.push(report(r, to, counts));
                    }
                }
            }
            ModeKind::Naive => self.naive_round(r, out),
            _ => {}
        }
    }

    /// Naive apportioning: the same demand estimate, cold-key filter and allocation as
    /// quotad, but each region simply sets its own rate to its share of its own view.
    /// Puts a node's exchanges on the network, each waiting for its reply (and retried).
    fn send_exchanges(
        &mut self,
        r: usize,
        exchanges: Vec<(RegionId, Exchange)>,
        out: &mut Vec<Send>,
    ) {
        let Some(node) = self.nodes[r].as_ref() else {
            return;
        };
        for (to, ex) in exchanges {
            let keys = ex.policies.iter().map(|p| p.keys.len() as u32).sum();
            let t_req = ex.t_req;
            let (bytes, spelled) = self.key_ids[r][to.index()].encode(&ex);
            let timeout = retry_timeout(node.rtt_us(to), self.params.round_us);
            self.pending.insert(
                (r, to.index(), t_req),
                Pending {
                    bytes: bytes.clone(),
                    tries: 0,
                    request: ex,
                    spelled,
                },
            );
            out.push(Send {
                from: r,
                to: to.index(),
                bytes,
                keys,
                retry: Some((timeout, t_req)),
            });
        }
    }

    fn naive_round(&mut self, r: usize, out: &mut Vec<Send>) {
        let n = self.clocks.len();
        let store = &mut self.stores[r];
        let policy = &self.policies[r];
        let p = &self.params;
        let now = store.now();
        let round = self.rounds[r];
        self.rounds[r] += 1;
        for k in store.take_active(&policy.name) {
            if let Some(k) = key_index(&k) {
                self.naive[r]
                    .entry(k)
                    .or_insert_with(|| NaiveKey::new(n))
                    .active = round;
            }
        }
        let linger = p.linger_rounds as u64;
        let recent = |at: u64| round.saturating_sub(at) <= linger;
        let mut reports = Vec::new();
        let mut forget = Vec::new();
        for (&k, nk) in self.naive[r].iter_mut() {
            let counters = store.counters(&policy.name, &key_name(k));
            let d = nk.demand.observe(now, counters, policy.rho, p);
            if d >= p.hot_fraction * policy.escrow[r] {
                nk.hot = Some(round);
            }
            let mentioned = nk.peer.iter().any(|&(_, at)| at.is_some_and(recent));
            let engaged = nk.hot.is_some_and(recent) || mentioned;
            if !engaged {
                if nk.planned {
                    // Back to the escrow split, like a cold key in quotad.
                    store.write_book(
                        &policy.name,
                        &key_name(k),
                        &LeaseBook::new(policy.escrow[r]),
                    );
                    nk.planned = false;
                }
                if !recent(nk.active) {
                    forget.push(k);
                }
                continue;
            }
            reports.push((k, d));
            let mut demand: Vec<f64> = nk.peer.iter().map(|&(d, _)| d).collect();
            demand[r] = d;
            let target = policy.allocate(p, &demand, &vec![false; n]);
            store.write_book(&policy.name, &key_name(k), &LeaseBook::new(target[r]));
            nk.planned = true;
        }
        for k in forget {
            self.naive[r].remove(&k);
        }
        for to in (0..n).filter(|&j| j != r) {
            if !reports.is_empty() {
                out.push(report(r, to, reports.clone()));
            }
        }
    }

    /// A message from `from` arrives at `to`.
    pub fn deliver(&mut self, from: usize, to: usize, bytes: &[u8], out: &mut Vec<Send>) {
        match self.kind {
            ModeKind::Lease => self.deliver_lease(from, to, bytes, out),
            ModeKind::CountSharing => {
                if let Ok(Report(counts)) = serde_json::from_slice(bytes) {
                    for (k, c) in counts {
                        self.stores[to].debit(k, c as u64);
                    }
                }
            }
            ModeKind::Naive => {
                if let Ok(Report(demands)) = serde_json::from_slice(bytes) {
                    let n = self.clocks.len();
                    let round = self.rounds[to];
                    for (k, d) in demands {
                        let nk = self.naive[to].entry(k).or_insert_with(|| NaiveKey::new(n));
                        nk.peer[from] = (d, Some(round));
                    }
                }
            }
            _ => {}
        }
    }

    /// Lease: an exchange (answered, or refused when its key numbers cannot be read), a
    /// reply, or a refusal of ours; then whatever the node sends early.
    fn deliver_lease(&mut self, from: usize, to: usize, bytes: &[u8], out: &mut Vec<Send>) {
        if self.nodes[to].is_none() {
            return; // the daemon is down: the request fails
        }
        match wire::kind(bytes) {
            Some(wire::Kind::Exchange) => match self.key_tables[to][from].decode(bytes) {
                Ok(ex) => {
                    let node = self.nodes[to].as_mut().expect("checked above");
                    if let Some(reply) = node.on_exchange(&ex, &mut self.stores[to]) {
                        let bytes =
                            wire::encode_reply(&ex, &reply).expect("a reply follows its request");
                        out.push(answer(to, from, bytes));
                    }
                }
                Err(e) if e.is_dictionary() => {
                    let epoch = wire::exchange_epoch(bytes).unwrap_or(0);
                    let mut bytes = vec![REFUSAL];
                    bytes.extend_from_slice(&epoch.to_le_bytes());
                    out.push(answer(to, from, bytes));
                }
                Err(_) => {}
            },
            Some(wire::Kind::Reply) => {
                if let Some(reply) = self.take_reply(to, from, bytes) {
                    let node = self.nodes[to].as_mut().expect("checked above");
                    node.on_reply(&reply, &mut self.stores[to]);
                }
            }
            None => {
                if let Some(epoch) = refusal(bytes) {
                    self.key_ids[to][from].refused(epoch);
                }
            }
        }
        let node = self.nodes[to].as_mut().expect("checked above");
        let early = node.early_exchanges(&mut self.stores[to]);
        self.send_exchanges(to, early, out);
    }

    /// A reply from `from` to region `at`: read against the exchange it answers, whose
    /// spelled-out keys it confirms; that exchange is not sent again. A duplicate reply
    /// (to a retry) is read too, as the daemon's client reads every attempt's answer.
    /// `None` for a reply to nothing pending (later than the client waits).
    fn take_reply(&mut self, at: usize, from: usize, bytes: &[u8]) -> Option<ExchangeReply> {
        let t_req = wire::reply_t_req(bytes)?;
        let p = self.pending.get_mut(&(at, from, t_req))?;
        p.tries = MAX_RETRIES;
        let reply = wire::decode_reply(&p.request, bytes).ok()?;
        self.key_ids[at][from].confirm(&p.spelled);
        Some(reply)
    }

    /// An exchange's retry timer fired: send it again if no reply came and it has retries
    /// left (the same bytes: a retry is a duplicate, which the protocol takes).
    pub fn retry(&mut self, from: usize, to: usize, t_req: LocalUs, out: &mut Vec<Send>) {
        let (Some(node), Some(p)) = (
            self.nodes[from].as_ref(),
            self.pending.get_mut(&(from, to, t_req)),
        ) else {
            return;
        };
        if p.tries >= MAX_RETRIES {
            return;
        }
        p.tries += 1;
        let timeout = retry_timeout(node.rtt_us(RegionId(to as u16)), self.params.round_us);
        // The keys were counted when the exchange first went out: a retry adds bytes to
        // the cost per key, not keys.
        out.push(Send {
            from,
            to,
            bytes: p.bytes.clone(),
            keys: 0,
            retry: Some((timeout, t_req)),
        });
    }

    pub fn region_event(&mut self, r: usize, ev: &RegionEvent) {
        match ev {
            RegionEvent::Crash => {
                self.nodes[r] = None;
                self.pending.retain(|&(from, _, _), _| from != r);
                // A process's dictionaries die with it.
                let n = self.clocks.len();
                self.key_ids[r] = fresh(n, KeyIds::new, &self.params);
                self.key_tables[r] = fresh(n, KeyTable::new, &self.params);
            }
            RegionEvent::Restart => {
                if self.kind == ModeKind::Lease && self.nodes[r].is_none() {
                    self.start_node(r);
                }
            }
            RegionEvent::LagStart => {
                if let Some(s) = self.stores.get_mut(r) {
                    s.lagging = true;
                }
            }
            RegionEvent::Failover => {
                if let Some(s) = self.stores.get_mut(r) {
                    s.failover();
                }
            }
            RegionEvent::Policy(p) => {
                self.policies[r] = p.clone();
                match self.kind {
                    ModeKind::Lease => {
                        if let Some(node) = self.nodes[r].as_mut() {
                            node.set_policy(p.clone(), &mut self.stores[r]);
                        }
                    }
                    ModeKind::Static => {
                        self.stores[r].set_default_escrow(&p.name, p.escrow[r]);
                    }
                    _ => {}
                }
            }
        }
    }

    /// The rates enforced for `key` right now, one per store.
    pub fn rates(&self, key: u32) -> Vec<f64> {
        self.stores.iter().map(|s| s.rate(key, s.now())).collect()
    }

    /// Whether any lease for `key` still connects `isolated` regions with the others (a
    /// partition has not yet fallen back to the escrow split).
    pub fn crossing_leases(&self, key: u32, isolated: &[usize]) -> bool {
        if self.kind != ModeKind::Lease {
            return false;
        }
        self.stores.iter().enumerate().any(|(r, s)| {
            let Some(book) = s.book(key) else {
                return false;
            };
            let now = s.now();
            let inside = isolated.contains(&r);
            let across = |peer: RegionId| isolated.contains(&peer.index()) != inside;
            book.reserved
                .iter()
                .any(|x| now < x.until && across(x.borrower))
                || book.borrowed_total(now, self.params.step_tolerance_us()) > 0.0
                    && book
                        .borrowed
                        .iter()
                        .any(|l| now < l.until && across(l.lender))
        })
    }

    /// The first local time after `after` at which region `r`'s rate for `key` changes by
    /// itself.
    pub fn next_expiry(&self, r: usize, key: u32, after: LocalUs) -> Option<LocalUs> {
        self.stores.get(r)?.next_expiry(key, after)
    }
}

fn report(from: usize, to: usize, entries: Vec<(u32, f64)>) -> Send {
    let keys = entries.len() as u32;
    Send {
        from,
        to,
        bytes: serde_json::to_vec(&Report(entries)).expect("plain data"),
        keys,
        retry: None,
    }
}

/// How long the daemon's exchange client waits for a reply before sending the same
/// exchange again: twice the last round trip, between 100 ms and a third of a round
/// (unknown RTT: a quarter round).
pub fn retry_timeout(rtt_us: Option<i64>, round_us: i64) -> i64 {
    let cap = round_us / 3;
    rtt_us.map_or(round_us / 4, |rtt| (2 * rtt).clamp(100_000.min(cap), cap))
}

/// One dictionary per peer, of the daemon's cap.
fn fresh<T>(n: usize, new: fn(usize) -> T, p: &Params) -> Vec<T> {
    (0..n)
        .map(|_| new(wire::dictionary_cap(p.max_exchange_keys)))
        .collect()
}

fn refusal(bytes: &[u8]) -> Option<u64> {
    match bytes {
        [REFUSAL, rest @ ..] => Some(u64::from_le_bytes(rest.try_into().ok()?)),
        _ => None,
    }
}

/// A message back to the sender of the one being answered (no retry: the sender retries).
fn answer(from: usize, to: usize, bytes: Vec<u8>) -> Send {
    Send {
        from,
        to,
        bytes,
        keys: 0,
        retry: None,
    }
}
