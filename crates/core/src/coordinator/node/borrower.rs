//! The borrower side: building the exchange for a peer (what this region asks of it and
//! announces to it), and taking in its reply.
//!
//! Why apart: this is where the safety rule's steps 1 and 3 live: the request carries
//! `t_req` read before it was built, a grant counts only until `t_req + D(1−ε)` and only
//! if newer than every grant accepted from that lender incarnation, and a release
//! watermark is announced only for a lease the durable book holds.

use std::collections::BTreeMap;

use super::state::{GrantId, KeyState, Reported};
use super::{LeaseStore, Node, peer_demand, sanitize};
use crate::clock::Clock;
use crate::coordinator::lease::Loan;
use crate::coordinator::message::{
    Exchange, ExchangeReply, Grant, KeyReport, PolicyReply, PolicyReport,
};
use crate::coordinator::{LocalUs, Params, RegionId};

/// A key that qualifies for an exchange, with how pressing it is.
struct Candidate {
    /// `(urgency, −demand)`: lower first (see [`KeyState::urgency`]), then the hottest.
    rank: (u8, f64),
    /// Its place among every tracked key, policy by policy, in order.
    at: usize,
}

/// Whether a tracked key goes into an exchange.
#[derive(Clone, Copy)]
enum Send {
    /// It does not qualify.
    No,
    /// It qualifies but more pressing keys fill the exchange: it keeps its flags.
    Deferred,
    Yes,
}

/// A peer's reply as this region takes it in.
struct Response<'a> {
    reply: &'a ExchangeReply,
    /// The sender's index.
    j: usize,
    /// Until when (our clock) a grant in the reply counts: `t_req + D(1−ε)`.
    until: LocalUs,
    now: LocalUs,
}

impl<C: Clock> Node<C> {
    /// The exchange for peer `j`: every key hot here, leased with it, or mentioned by it;
    /// with `news_only`, only the keys with news for it (see [`Self::early_exchanges`]).
    /// At most `max_exchange_keys` keys: beyond, the most pressing ones (see
    /// [`KeyState::urgency`]); the others keep their flags for the next exchange.
    pub(super) fn exchange_for(&mut self, j: usize, now: LocalUs, news_only: bool) -> Exchange {
        self.peers[j].news = false;
        let me = self.me.index();
        let p = self.params;
        let peer_inc = self.peers[j].incarnation;
        let sent = self.to_send(j, now, news_only);
        let mut policies = Vec::new();
        let mut at = 0;
        for (name, ps) in &mut self.policies {
            let mut keys = Vec::new();
            for (key, ks) in &mut ps.keys {
                let send = sent[at];
                at += 1;
                match send {
                    Send::No => {}
                    Send::Deferred => self.stats.keys_deferred += 1,
                    Send::Yes => keys.push(ks.report_for(key, j, peer_inc, &p, now)),
                }
            }
            self.stats.key_reports += keys.len() as u64;
            policies.push(PolicyReport {
                name: name.clone(),
                applied: ps.applied_version(me),
                keys,
            });
        }
        Exchange {
            from: self.me,
            incarnation: self.incarnation,
            to_incarnation: peer_inc,
            t_req: now,
            policies,
        }
    }

    /// For every tracked key (policy by policy, in order): whether it goes into the
    /// exchange for peer `j`. When more keys qualify than one exchange may carry, the most
    /// pressing go (by urgency, then the hottest; in key order among equals) and the
    /// others are deferred. Each key's urgency is read once.
    fn to_send(&self, j: usize, now: LocalUs, news_only: bool) -> Vec<Send> {
        let (round, p) = (self.round, &self.params);
        let mut sent = Vec::new();
        let mut ranked: Vec<Candidate> = Vec::new();
        for ks in self.policies.values().flat_map(|ps| ps.keys.values()) {
            match ks.urgency(j, round, p, now, news_only) {
                Some(u) => {
                    ranked.push(Candidate {
                        rank: (u, -ks.demand.value()),
                        at: sent.len(),
                    });
                    sent.push(Send::Yes);
                }
                None => sent.push(Send::No),
            }
        }
        if ranked.len() > p.max_exchange_keys {
            // Stable: among equal ranks, the first in key order goes.
            ranked.sort_by(|a, b| {
                a.rank
                    .partial_cmp(&b.rank)
                    .unwrap_or(std::cmp::Ordering::Equal)
            });
            for c in &ranked[p.max_exchange_keys..] {
                sent[c.at] = Send::Deferred;
            }
        }
        sent
    }

    /// Borrower side: take a peer's reply (grants and demand).
    pub fn on_reply(&mut self, reply: &ExchangeReply, store: &mut dyn LeaseStore) {
        self.on_replies(std::slice::from_ref(reply), store);
    }

    /// Borrower side: take several peers' replies at once, as [`Self::on_reply`] would
    /// one after the other, except that each book with grants accepted is written once,
    /// after all of them: a round's replies from its lenders arrive together, and each
    /// would otherwise rewrite the same books (in Redis, most of a region's writes).
    pub fn on_replies(&mut self, replies: &[ExchangeReply], store: &mut dyn LeaseStore) {
        let now = self.observe_clock(store);
        let mut accepted: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for reply in replies {
            // An answer to a previous life of ours, or from a previous life of theirs:
            // dropped.
            if reply.to_incarnation != self.incarnation {
                continue;
            }
            let Some(j) = self.accept(reply.from, reply.incarnation, now) else {
                continue;
            };
            self.round_trip(j, reply.t_req, now);
            let p = self.params;
            let lease = reply.lease_us.min(p.lease_us).max(0);
            let until = reply.t_req + p.borrower_valid_us(lease);
            let response = Response {
                reply,
                j,
                until,
                now,
            };
            for block in &reply.policies {
                let keys = self.take_policy_reply(&response, block);
                accepted.entry(block.name.clone()).or_default().extend(keys);
            }
        }
        for (name, keys) in accepted {
            let Some(mut ps) = self.policies.remove(&name) else {
                continue;
            };
            ps.write_and_announce(store, &name, keys.iter().map(String::as_str), self.round);
            self.policies.insert(name, ps);
        }
    }

    /// One policy of a reply: the version the peer applied, each key's demand there, and
    /// its grants (see [`Self::accept_grant`]); returns the keys whose grants were
    /// accepted, for the caller to write in one batch (once durable, their leases may be
    /// announced).
    fn take_policy_reply(&mut self, response: &Response, block: &PolicyReply) -> Vec<String> {
        let Some(mut ps) = self.policies.remove(&block.name) else {
            return Vec::new();
        };
        let (j, p, round) = (response.j, self.params, self.round);
        ps.peer_applies(j, block.applied);
        let mut accepted = Vec::new();
        for kr in &block.keys {
            let Some(ks) = ps.keys.get_mut(&kr.key) else {
                continue; // we stopped tracking it; a grant for it is simply not used
            };
            ks.peers[j].demand = Some(Reported {
                demand: peer_demand(kr.demand, &ps.policy, &p),
                round,
            });
            let Some(g) = kr.grant else { continue };
            if self.accept_grant(ks, response, g) {
                accepted.push(kr.key.clone());
            }
        }
        self.policies.insert(block.name.clone(), ps);
        accepted
    }

    /// One grant: it counts only if newer than every grant accepted from that lender
    /// incarnation (hence never below a watermark this region announced), still valid, and
    /// not from before a backward clock step; it replaces the lender's previous loan.
    /// Returns whether it was accepted (a stale grant otherwise).
    fn accept_grant(&mut self, ks: &mut KeyState, response: &Response, g: Grant) -> bool {
        let Response {
            reply,
            j,
            until,
            now,
        } = *response;
        let tol = self.params.step_tolerance_us();
        let last = ks.peers[j].lender.accepted;
        let newer = reply.incarnation > last.incarnation
            || (reply.incarnation == last.incarnation && g.seq > last.seq);
        if !newer || until <= now || now + tol < ks.book.high_water {
            self.stats.stale_grants += 1;
            return false;
        }
        ks.book.borrowed.retain(|l| l.lender != reply.from);
        let amount = sanitize(g.amount);
        if amount > 0.0 {
            ks.book.borrowed.push(Loan {
                lender: reply.from,
                lender_incarnation: reply.incarnation,
                seq: g.seq,
                amount,
                until,
            });
        }
        ks.peers[j].lender.accepted = GrantId {
            incarnation: reply.incarnation,
            seq: g.seq,
        };
        ks.peers[j].lender.granted = amount;
        ks.book.high_water = ks.book.high_water.max(now);
        self.stats.loans_accepted += 1;
        true
    }
}

impl KeyState {
    /// This key's report in the exchange for peer `j` (incarnation `peer_inc`): its demand
    /// here, the loan to ask `j` for (also a zero while a loan from `j` is held, so that
    /// `j` can free it), and, for `j`'s current life, the release watermark and what the
    /// durable book holds of that lease. Taking the key's news flags for `j` with it.
    fn report_for(
        &mut self,
        key: &str,
        j: usize,
        peer_inc: u64,
        p: &Params,
        now: LocalUs,
    ) -> KeyReport {
        self.peers[j].early = false;
        let freed = std::mem::take(&mut self.peers[j].freed);
        let holds = self.book.loan_from(RegionId(j as u16), now).is_some();
        let from = &self.peers[j].lender;
        let want = (from.want > 0.0 || holds).then_some(from.want);
        if want.is_some() {
            let until = now + p.borrower_valid_us(p.lease_us);
            self.asked_until = self.asked_until.max(until);
        }
        let mine = from.release.incarnation == peer_inc && peer_inc != 0;
        let demand = self.demand.value() as f32;
        let report = KeyReport {
            key: key.to_owned(),
            demand,
            want,
            release: mine.then_some(from.release.seq),
            held: from.held.filter(|_| mine),
            freed,
        };
        self.peers[j].told = demand;
        self.peers[j].lender.asked = want.unwrap_or(0.0);
        report
    }
}
