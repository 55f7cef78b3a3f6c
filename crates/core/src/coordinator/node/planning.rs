//! Planning: the refresh of every engaged key (each round, and after a heal), the plan of
//! one key (its target, and what to ask each lender for), the end of a re-split, and which
//! keys matter (engaged, relevant, and how urgent for an exchange).
//!
//! Why apart: the plan is the one place where demand becomes loans; the lender re-plans
//! with it before it lends and the round with it before it asks, and both must follow
//! the same rule. The bookkeeping around it (what a refresh writes, keeps or forgets)
//! decides what the store is asked to do every round, which is what sets its cost.

use super::state::{KeyState, PolicyState};
use super::{LeaseStore, Link, Node, REASSERT_ROUNDS, floor_milli};
use crate::clock::Clock;
use crate::coordinator::allocation;
use crate::coordinator::demand::Counters;
use crate::coordinator::lease::LeaseBook;
use crate::coordinator::{GlobalPolicy, LocalUs, Params, RegionId};

/// One refresh, as every policy in it sees it.
#[derive(Clone, Copy)]
struct Sweep<'a> {
    now: LocalUs,
    /// A round: demand is read first, newly active keys join and forgotten ones leave.
    sample: bool,
    /// The store failed over: every book is re-asserted, not only the changed ones.
    reassert_all: bool,
    links: &'a [Link],
}

/// One policy's part of a refresh, as every key of it sees it.
struct PolicySweep<'a> {
    sweep: Sweep<'a>,
    policy: &'a GlobalPolicy,
    /// The escrow in force for the policy (see [`PolicyState::escrow_in_force`]).
    escrow_now: f64,
}

/// What a refresh does with one key.
enum Fate {
    /// Forgotten: cold, idle, settled, and past any grant it could still accept.
    Forget,
    /// Left as it is: nothing to plan, or an unchanged book not due for re-assertion.
    Leave,
    /// Planned, and its book to be written.
    Write,
}

impl<C: Clock> Node<C> {
    /// Plans every engaged key and re-asserts its book. With `sample`, this is a round:
    /// demand is read first, newly active keys join and forgotten ones leave.
    pub(super) fn refresh(&mut self, store: &mut dyn LeaseStore, now: LocalUs, sample: bool) {
        let links = self.links(now);
        let names: Vec<String> = self.policies.keys().cloned().collect();
        // Read once for every policy: the store reports a failover once.
        let reassert_all = sample && store.take_failover();
        let sweep = Sweep {
            now,
            sample,
            reassert_all,
            links: &links,
        };
        for name in &names {
            self.finish_transition(name, &links, store);
            let mut ps = self.policies.remove(name).expect("listed above");
            self.refresh_policy(&mut ps, name, sweep, store);
            self.policies.insert(name.clone(), ps);
        }
    }

    /// One policy in a refresh: its default escrow re-asserted, its keys refreshed (see
    /// [`Self::refresh_key`]), the books that need it written in one batch, and the
    /// forgotten keys dropped.
    fn refresh_policy(
        &self,
        ps: &mut PolicyState,
        name: &str,
        sweep: Sweep,
        store: &mut dyn LeaseStore,
    ) {
        let escrow_now = self.escrow_in_force(ps);
        // Re-assert the default escrow too: a failover may have lost it.
        ps.default_durable = store.set_default_escrow(name, escrow_now);
        let counters = if sweep.sample {
            self.sample(ps, name, escrow_now, store)
        } else {
            Vec::new()
        };
        let pass = PolicySweep {
            sweep,
            policy: &ps.policy,
            escrow_now,
        };
        let mut drop = Vec::new();
        let mut writes = Vec::new();
        for (i, (key, ks)) in ps.keys.iter_mut().enumerate() {
            match self.refresh_key(key, ks, counters.get(i), &pass) {
                Fate::Forget => drop.push(key.clone()),
                Fate::Leave => {}
                Fate::Write => writes.push(key.clone()),
            }
        }
        ps.write_and_announce(store, name, writes.iter().map(String::as_str), self.round);
        for key in drop {
            ps.keys.remove(&key);
        }
    }

    /// A round's reading of the store for one policy: the keys active since the last round
    /// join (with their stored books) and are marked active; returns the counters of every
    /// tracked key, in order, read in one batch.
    fn sample(
        &self,
        ps: &mut PolicyState,
        name: &str,
        escrow_now: f64,
        store: &mut dyn LeaseStore,
    ) -> Vec<Counters> {
        let active = store.take_active(name);
        let keys: Vec<&str> = active.iter().map(String::as_str).collect();
        ps.track(store, name, &keys, escrow_now, self.peers.len());
        for key in &active {
            if let Some(ks) = ps.keys.get_mut(key) {
                ks.active_round = Some(self.round);
            }
        }
        let keys: Vec<&str> = ps.keys.keys().map(String::as_str).collect();
        store.counters_of(name, &keys)
    }

    /// One key in a refresh: its demand (from `counters`, in a round), then, unless it is
    /// forgotten or left as it is, a plan and its book re-asserted in memory at the escrow
    /// in force. Unchanged books are written only in their turn, so that a takeover's
    /// books do not all come due in one round.
    fn refresh_key(
        &self,
        key: &str,
        ks: &mut KeyState,
        counters: Option<&Counters>,
        pass: &PolicySweep,
    ) -> Fate {
        let (round, me, p) = (self.round, self.me.index(), &self.params);
        let Sweep { now, sample, .. } = pass.sweep;
        if let Some(c) = counters {
            let d = ks.demand.observe(now, *c, pass.policy.rho, p);
            if d >= p.hot_fraction * pass.policy.escrow[me] {
                ks.hot_round = Some(round);
            }
        }
        ks.book.prune(now);
        // Durably at the escrow in force: nothing to re-assert for an idle book.
        let settled = !ks.dirty && ks.book.escrow == pass.escrow_now;
        if sample
            && settled
            && !ks.relevant(round, p)
            && ks.book.is_idle(now)
            && now >= ks.asked_until.saturating_add(p.step_tolerance_us())
        {
            return Fate::Forget;
        }
        if settled && !ks.engaged(round, p, now) {
            // Cold everywhere and unleased: the escrow split already serves it and
            // nothing needs writing. Only its demand is watched (above).
            return Fate::Leave;
        }
        let _ = plan(ks, pass.policy, self.me, pass.sweep.links, round, p, now);
        // Re-assert: the escrow in force, and everything in memory, every round.
        let escrow = effective_escrow(pass.escrow_now, &ks.book, now);
        ks.book.escrow = escrow;
        ks.book.high_water = ks.book.high_water.max(now);
        // Each unchanged book's re-assertion comes in a round of its own (by its
        // key), so that a takeover's books do not all come due in one round.
        let due = round % REASSERT_ROUNDS == key_slot(key);
        let unchanged = !ks.dirty
            && ks.book.borrowed.is_empty()
            && ks
                .written
                .is_some_and(|w| w.digest == ks.book.digest() && round < w.round + REASSERT_ROUNDS);
        if unchanged && !due && !pass.sweep.reassert_all {
            return Fate::Leave;
        }
        Fate::Write
    }

    /// Between rounds (every [`Params::sense_us`]): demand read again for every engaged key
    /// (at most `max_exchange_keys`, the hottest), and each that moved beyond noise
    /// planned again, so that a step in demand moves loans within a fraction of a round
    /// rather than at the next one. Nothing joins or leaves, and only books the plan
    /// changed (a give-back) are written. What should not wait becomes news for the peer
    /// concerned, sent by [`Self::early_exchanges`]:
    /// - as a borrower: a lender to ask for more than it holds and than it was last asked;
    /// - as a lender: capacity freed (its own target fell) for a borrower granted short;
    /// - this region's demand moved by [`Params::sense_change`] of ρ since the peer heard it.
    pub fn sense(&mut self, store: &mut dyn LeaseStore) {
        let now = self.observe_clock(store);
        self.tick += 1;
        let links = self.links(now);
        let names: Vec<String> = self.policies.keys().cloned().collect();
        for name in &names {
            let mut ps = self.policies.remove(name).expect("listed above");
            self.sense_policy(&mut ps, name, &links, now, store);
            self.policies.insert(name.clone(), ps);
        }
    }

    /// One policy's part of [`Self::sense`].
    fn sense_policy(
        &mut self,
        ps: &mut PolicyState,
        name: &str,
        links: &[Link],
        now: LocalUs,
        store: &mut dyn LeaseStore,
    ) {
        let (round, p, me) = (self.round, self.params, self.me.index());
        let mut engaged: Vec<(&String, f64)> = ps
            .keys
            .iter()
            .filter(|(_, ks)| ks.engaged(round, &p, now))
            .map(|(k, ks)| (k, ks.demand.value()))
            .collect();
        if engaged.is_empty() {
            return;
        }
        // Bounded like an exchange: the hottest keys (in key order among equals), so that
        // a sense costs the store at most `max_exchange_keys` reads however many are hot.
        if engaged.len() > p.max_exchange_keys {
            engaged.sort_by(|a, b| b.1.total_cmp(&a.1));
            engaged.truncate(p.max_exchange_keys);
        }
        let keys: Vec<String> = engaged.into_iter().map(|(k, _)| k.clone()).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let counters = store.counters_of(name, &refs);
        let n = self.peers.len();
        let hysteresis = ps.policy.lender_hysteresis(&p, n);
        let change = p.sense_change * ps.policy.rho;
        let mut writes = Vec::new();
        for (key, c) in keys.iter().zip(&counters) {
            let ks = ps.keys.get_mut(key).expect("listed above");
            if !ks
                .demand
                .observe_if_moved(now, *c, ps.policy.rho, change, &p)
            {
                continue;
            }
            let target_before = ks.target_self;
            let gave_back = plan(ks, &ps.policy, self.me, links, round, &p, now);
            let freed = target_before - ks.target_self >= hysteresis;
            let demand = ks.demand.value();
            for j in (0..n).filter(|&j| j != me && links[j] == Link::Connected) {
                let held = ks
                    .book
                    .loan_from(RegionId(j as u16), now)
                    .map_or(0.0, |l| l.amount);
                let kp = &mut ks.peers[j];
                let more = kp.lender.want >= held.max(kp.lender.asked) + hysteresis;
                let moved = (demand - f64::from(kp.told)).abs() >= change;
                let frees = freed && kp.short;
                kp.freed |= frees;
                if more || moved || frees || gave_back[j] {
                    kp.early = true;
                    self.peers[j].news = true;
                }
            }
            if ks.dirty {
                writes.push(key.clone());
            }
        }
        ps.write_and_announce(store, name, writes.iter().map(String::as_str), round);
    }

    /// Ends a re-split once every peer reports the new version applied.
    fn finish_transition(&mut self, name: &str, links: &[Link], store: &mut dyn LeaseStore) {
        let me = self.me.index();
        let Some(ps) = self.policies.get_mut(name) else {
            return;
        };
        if ps.previous_escrow.is_none() {
            return;
        }
        let v = ps.policy.version;
        // Exactly v: a peer that reports a newer version has lowered to *that* version's
        // escrow, which may be above its escrow in v; this region waits for that version.
        let all = (0..links.len()).all(|j| j == me || ps.peer_applied[j] == v);
        // Only once this region has itself applied the decrease everywhere (durably).
        let own = ps.applied_version(me) == v;
        if all && own {
            ps.previous_escrow = None;
            ps.applied = v;
            let e = ps.policy.escrow[me];
            ps.default_durable = store.set_default_escrow(name, e);
            // Raise the books of forgotten keys too (they would stay at the lower escrow).
            ps.adopt_books(store, links.len());
        }
    }
}

/// The round (modulo [`REASSERT_ROUNDS`]) in which an unchanged book is re-asserted.
fn key_slot(key: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    key.hash(&mut h);
    h.finish() % REASSERT_ROUNDS
}

/// Whether round `r` is within the linger window of round `round`.
fn recent(round: u64, r: u64, p: &Params) -> bool {
    round.saturating_sub(r) <= p.linger_rounds as u64
}

impl KeyState {
    /// Hot here or mentioned by a peer within the linger window, or leased: the keys that
    /// are planned and exchanged (the others are served by the escrow split as they are).
    fn engaged(&self, round: u64, p: &Params, now: LocalUs) -> bool {
        let within = |r: u64| recent(round, r, p);
        self.hot_round.is_some_and(within)
            || self.mentioned_within(within)
            || !self.book.is_idle(now)
    }

    /// Whether this key goes into an exchange for peer `j`, and how pressing it is (lower
    /// first): a lease with `j` or news for it (a lease not renewed ends, news not sent
    /// waits), then what `j` asked about, then keys hot here (the hottest first, by the
    /// caller). `None`: not for this exchange.
    pub(super) fn urgency(
        &self,
        j: usize,
        round: u64,
        p: &Params,
        now: LocalUs,
        news_only: bool,
    ) -> Option<u8> {
        let news = self.peers[j].early;
        if news_only {
            return news.then_some(0);
        }
        let leased = self.book.reserved.iter().any(|r| r.borrower.index() == j)
            || self.book.loan_from(RegionId(j as u16), now).is_some();
        let mentioned = self.peers[j]
            .demand
            .is_some_and(|d| recent(round, d.round, p));
        let hot = self.hot_round.is_some_and(|r| recent(round, r, p));
        if leased || news {
            Some(0)
        } else if mentioned {
            Some(1)
        } else if hot {
            Some(2)
        } else {
            None
        }
    }

    /// Hot here, active here, or mentioned by a peer within the linger window.
    fn relevant(&self, round: u64, p: &Params) -> bool {
        let within = |r: u64| recent(round, r, p);
        self.hot_round.is_some_and(within)
            || self.active_round.is_some_and(within)
            || self.mentioned_within(within)
    }

    /// Whether some peer reported demand for this key in a round that `within` accepts.
    fn mentioned_within(&self, within: impl Fn(u64) -> bool) -> bool {
        self.peers
            .iter()
            .filter_map(|peer| peer.demand)
            .any(|d| within(d.round))
    }
}

/// Plans one key from this region's view and sets what to ask each lender for; per
/// lender, whether it gave part of a loan back (the book is lower and not yet written).
pub(super) fn plan(
    ks: &mut KeyState,
    policy: &GlobalPolicy,
    me: RegionId,
    links: &[Link],
    round: u64,
    p: &Params,
    now: LocalUs,
) -> Vec<bool> {
    let n = links.len();
    let mut gave_back = vec![false; n];
    let me = me.index();
    let mut demand = vec![0.0; n];
    let mut pinned = vec![false; n];
    for j in 0..n {
        if j == me {
            demand[j] = ks.demand.value();
        } else if links[j] != Link::Connected {
            pinned[j] = true;
        } else {
            demand[j] = match ks.peers[j].demand {
                Some(d) if recent(round, d.round, p) => d.demand,
                // Cold there (it would report the key otherwise): at most the hot threshold.
                _ => p.hot_fraction * policy.escrow[j],
            };
        }
    }
    let target = policy.allocate(p, &demand, &pinned);
    let loans = allocation::loans_to(&policy.escrow, &target, me);
    ks.target_self = target[me];
    ks.planned = Some(round);
    for j in 0..n {
        if j == me || links[j] != Link::Connected {
            // Not asked; a loan from a silent lender is kept until it ends.
            ks.peers[j].lender.want = 0.0;
            continue;
        }
        let wanted = floor_milli(loans[j]);
        let lender = RegionId(j as u16);
        let held = ks.book.loan_from(lender, now).map_or(0.0, |l| l.amount);
        let want = if held > 0.0 && (wanted - held).abs() < policy.lender_hysteresis(p, n) {
            held
        } else {
            wanted
        };
        ks.peers[j].lender.want = want;
        if want < held {
            // Give back at once (decrease first): the book counts less from now on, and
            // once that is durable the lender hears `held` and lowers its reservation,
            // a round earlier than a smaller grant plus a release would free it.
            for l in ks.book.borrowed.iter_mut().filter(|l| l.lender == lender) {
                l.amount = l.amount.min(want);
            }
            ks.dirty = true;
            ks.peers[j].early = true;
            gave_back[j] = true;
        }
    }
    gave_back
}

/// The escrow written into a book: during a re-split min(old, new), but never below what
/// is still reserved (a reservation granted under the old split holds until it ends).
fn effective_escrow(in_force: f64, book: &LeaseBook, now: LocalUs) -> f64 {
    // Whatever the transition state: a book is never cut below what it still reserves
    // (the rate would be clamped at zero while the borrower counts the whole loan), and
    // never raised above what it had except to the escrow in force.
    in_force.max(book.reserved_total(now).min(book.escrow))
}
