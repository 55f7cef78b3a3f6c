//! The lender side: answering a peer's exchange, and lending to it.
//!
//! Why apart: this is where the safety rule's step 2 lives (a reservation held until
//! `now + D(1+ε) + m`, written, and a grant only for a book the store took durably), and
//! where a borrower's releases and give-backs free capacity. Every key's decision is made
//! in memory first and its book written after, all of a policy's in one batch.

use super::planning::plan;
use super::state::{KeyState, PolicyState, Reported};
use super::{LeaseStore, Link, Node, floor_milli, peer_demand, sanitize};
use crate::clock::Clock;
use crate::coordinator::lease::Reservation;
use crate::coordinator::message::{
    Exchange, ExchangeReply, Grant, KeyReply, KeyReport, PolicyReply, PolicyReport,
};
use crate::coordinator::{GlobalPolicy, LocalUs};

/// A peer's exchange as this region answers it.
struct Request<'a> {
    msg: &'a Exchange,
    /// The sender's index.
    j: usize,
    /// Every link, as it stands once the sender was heard from.
    links: Vec<Link>,
    /// The sender connected: what is lendable may be granted, past a policy's learning
    /// period (otherwise every grant is zero).
    connected: bool,
    /// Not older than an exchange already taken from the sender (see [`Node::in_order`]):
    /// otherwise only its releases are taken, and nothing is granted.
    in_order: bool,
    now: LocalUs,
}

/// What [`Node::lend`] decided for one key, before its book is written.
#[derive(Debug, Default)]
struct Answer {
    /// The book changed and must be written.
    write: bool,
    /// The grant, if the write is durable.
    grant: Option<Grant>,
    /// This region gave part of a loan back (announced once durable).
    gave_back: bool,
}

impl<C: Clock> Node<C> {
    /// Lender side: answer a peer's exchange. Every key's decisions are made first, its
    /// book written after (all of a policy's in one batch), and a grant leaves only for a
    /// book the store took durably.
    pub fn on_exchange(
        &mut self,
        msg: &Exchange,
        store: &mut dyn LeaseStore,
    ) -> Option<ExchangeReply> {
        let now = self.observe_clock(store);
        let j = self.accept(msg.from, msg.incarnation, now)?;
        let links = self.links(now);
        let connected = links[j] == Link::Connected;
        let in_order = self.in_order(j, msg.t_req);
        if !in_order {
            self.stats.stale_exchanges += 1;
        }
        let request = Request {
            msg,
            j,
            links,
            connected,
            in_order,
            now,
        };
        let replies = msg
            .policies
            .iter()
            .filter_map(|block| self.answer_policy(&request, block, store))
            .collect();
        Some(self.reply(msg, replies))
    }

    /// One policy of the exchange (`None` for a policy this region does not run): take in
    /// what the peer tells of it, decide every key in memory, write the changed books in
    /// one batch, and answer each key.
    fn answer_policy(
        &mut self,
        request: &Request,
        block: &PolicyReport,
        store: &mut dyn LeaseStore,
    ) -> Option<PolicyReply> {
        let mut ps = self.policies.remove(&block.name)?;
        self.take_report(&mut ps, request.j, block, store);
        let answers: Vec<Answer> = block
            .keys
            .iter()
            .map(|report| self.lend(&mut ps, request, report))
            .collect();
        let durable = self.write_answered(&mut ps, block, &answers, store);
        let keys = self.settle(&mut ps, block, answers, &durable);
        let reply = PolicyReply {
            name: block.name.clone(),
            applied: ps.applied_version(self.me.index()),
            keys,
        };
        self.policies.insert(block.name.clone(), ps);
        Some(reply)
    }

    /// What the peer tells of a policy before any key: the version it has applied (a
    /// re-split ends once every peer has), and the keys it speaks of, tracked from now on
    /// (with their stored books) so that each can be answered.
    fn take_report(
        &self,
        ps: &mut PolicyState,
        j: usize,
        block: &PolicyReport,
        store: &mut dyn LeaseStore,
    ) {
        ps.peer_applies(j, block.applied);
        let base = ps.escrow_in_force(self.me.index());
        let keys: Vec<&str> = block.keys.iter().map(|r| r.key.as_str()).collect();
        ps.track(store, &block.name, &keys, base, self.peers.len());
    }

    /// Writes the books the answers changed, in one batch; returns the keys the store took
    /// durably, sorted: only those may carry a grant or announce a give-back.
    fn write_answered<'b>(
        &self,
        ps: &mut PolicyState,
        block: &'b PolicyReport,
        answers: &[Answer],
        store: &mut dyn LeaseStore,
    ) -> Vec<&'b str> {
        let to_write = answers
            .iter()
            .zip(&block.keys)
            .filter(|(a, _)| a.write)
            .map(|(_, r)| r.key.as_str());
        ps.write(store, &block.name, to_write, self.round)
    }

    /// The reply's keys, once the books are written: a grant leaves only if its key's book
    /// is in `durable` (counted as withheld otherwise: a failover could lose the
    /// reservation), and a give-back durably written may now be announced.
    fn settle(
        &mut self,
        ps: &mut PolicyState,
        block: &PolicyReport,
        answers: Vec<Answer>,
        durable: &[&str],
    ) -> Vec<KeyReply> {
        let mut keys = Vec::new();
        for (a, report) in answers.into_iter().zip(&block.keys) {
            let durable = a.write && durable.binary_search(&report.key.as_str()).is_ok();
            let Some(ks) = ps.keys.get_mut(&report.key) else {
                continue;
            };
            let grant = match a.grant {
                Some(g) if durable => {
                    self.stats.grants += 1;
                    Some(g)
                }
                Some(_) => {
                    self.stats.grants_withheld += 1;
                    None
                }
                None => None,
            };
            // A give-back is written now, and once durable announced (early).
            if a.gave_back && durable {
                ks.durable_written();
            }
            keys.push(KeyReply {
                key: report.key.clone(),
                demand: ks.demand.value() as f32,
                grant,
            });
        }
        keys
    }

    /// The reply to `msg`: it names the sender's incarnation (a reply to a previous life
    /// of it is dropped there) and echoes `t_req`, from which the borrower counts a grant.
    fn reply(&self, msg: &Exchange, policies: Vec<PolicyReply>) -> ExchangeReply {
        ExchangeReply {
            from: self.me,
            incarnation: self.incarnation,
            to_incarnation: msg.incarnation,
            t_req: msg.t_req,
            lease_us: self.params.lease_us,
            policies,
        }
    }

    /// One key of a peer's exchange, in memory: its demand, a fresh plan, releases and
    /// give-backs it announces, and the reservation for what it asks (granted once the
    /// book is durably written).
    fn lend(&mut self, ps: &mut PolicyState, request: &Request, report: &KeyReport) -> Answer {
        let base = ps.escrow_in_force(self.me.index());
        let lending = request.connected && request.now >= ps.learning_until;
        let Some(ks) = ps.keys.get_mut(&report.key) else {
            return Answer::default();
        };
        if !request.in_order {
            return Answer {
                write: self.take_release(ks, request, report),
                grant: None,
                gave_back: false,
            };
        }
        let gave_back = self.replan(ks, &ps.policy, request, report);
        let changed = self.take_release(ks, request, report);
        let Some(want) = report.want else {
            return Answer {
                write: changed || gave_back,
                grant: None,
                gave_back,
            };
        };
        let grant = self.reserve(ks, &ps.policy, base, request, lending, want);
        Answer {
            write: true,
            grant: Some(grant),
            gave_back,
        }
    }

    /// The sender's demand for the key, and a plan with it; returns whether this region
    /// gave part of a loan back (news for that lender). A sender that is a lender this
    /// region wants more from, and that freed capacity since it granted short, is asked
    /// again now.
    fn replan(
        &mut self,
        ks: &mut KeyState,
        policy: &GlobalPolicy,
        request: &Request,
        report: &KeyReport,
    ) -> bool {
        let (j, now, round, p) = (request.j, request.now, self.round, self.params);
        ks.peers[j].demand = Some(Reported {
            demand: peer_demand(report.demand, policy, &p),
            round,
        });
        // Plan again with the demand just reported (and the link just heard from): what
        // may be lent follows the freshest view, not the last round's.
        let gave_back = plan(ks, policy, self.me, &request.links, round, &p, now);
        for (peer, &gave) in self.peers.iter_mut().zip(&gave_back) {
            peer.news |= gave;
        }
        // The sender is a lender this region wants more from than it holds, and it freed
        // capacity since it granted short: ask again now.
        let held_from_j = ks
            .book
            .loan_from(request.msg.from, now)
            .map_or(0.0, |l| l.amount);
        let hysteresis = policy.lender_hysteresis(&p, self.peers.len());
        if report.freed && ks.peers[j].lender.want >= held_from_j + hysteresis {
            ks.peers[j].early = true;
            self.peers[j].news = true;
        }
        gave_back.contains(&true)
    }

    /// A release watermark from the sender (with what its durable book still holds of
    /// that lease): the reservations it moved past end now, and capacity freed so is news
    /// for every other borrower granted short. Returns whether the book changed.
    fn take_release(&mut self, ks: &mut KeyState, request: &Request, report: &KeyReport) -> bool {
        let (msg, j, now) = (request.msg, request.j, request.now);
        let mut changed = false;
        // A watermark above every seq this life issued is no release of ours.
        if let Some(upto) = report.release
            && msg.to_incarnation == self.incarnation
            && upto <= self.next_seq
        {
            let reserved_before = ks.book.reserved_total(now);
            changed |= ks.book.release(msg.from, upto);
            if let Some(held) = report.held {
                changed |= ks.book.lower(msg.from, upto, sanitize(held));
            }
            if ks.book.reserved_total(now) < reserved_before {
                // Capacity freed: tell the borrowers granted short.
                for (b, (kp, peer)) in ks.peers.iter_mut().zip(&mut self.peers).enumerate() {
                    if b != j && kp.short {
                        kp.early = true;
                        kp.freed = true;
                        peer.news = true;
                    }
                }
            }
        }
        changed
    }

    /// The reservation for what the sender asks: as much of `want` as is lendable (the
    /// escrow in force less this region's own target and what others hold; nothing unless
    /// `lending`: the policy past its learning period and the sender connected), held until `now + D(1+ε) + m`. Notes
    /// whether the sender was granted short, so that freed capacity is worth telling it.
    fn reserve(
        &mut self,
        ks: &mut KeyState,
        policy: &GlobalPolicy,
        base: f64,
        request: &Request,
        lending: bool,
        want: f64,
    ) -> Grant {
        let (msg, j, now, p) = (request.msg, request.j, request.now, self.params);
        let lendable = if lending {
            let others: f64 = ks.book.reserved_total(now) - ks.book.reserved_for(msg.from, now);
            base - ks.target_self.min(base) - others
        } else {
            0.0
        };
        let amount = floor_milli(sanitize(want).min(lendable.max(0.0)));
        ks.peers[j].short =
            sanitize(want) - amount >= policy.lender_hysteresis(&p, self.peers.len());
        let seq = self.next_seq;
        self.next_seq += 1;
        ks.book.reserved.push(Reservation {
            borrower: msg.from,
            seq,
            amount,
            until: now + p.lender_hold_us(),
        });
        ks.book.high_water = ks.book.high_water.max(now);
        Grant { seq, amount }
    }
}
