//! Per-peer link state: which incarnation of each peer is current, when it was last heard
//! from, the round trips that completed, and the [`Link`] that follows from them; also
//! what is pending for a peer between rounds (a heal to answer with a whole exchange, news
//! for an early one).
//!
//! Why apart: liveness decides what planning may count on (a suspect peer is planned at
//! its escrow, a disconnected one holds no lease) and whether a lender may lend; it is one
//! rule on one clock, and the lender and the borrower side both go through it here.

use serde::Serialize;

use super::Node;
use crate::clock::Clock;
use crate::coordinator::{LocalUs, Params, RegionId};

/// How a peer is reached, as the node sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Link {
    /// Heard from (an exchange or a reply) within `suspect_rounds` rounds.
    Connected,
    /// Nothing heard for `suspect_rounds` rounds: planned at its escrow, not lent to.
    Suspect,
    /// Nothing heard for D(1+ε)+m: every lease with it has expired on both sides.
    Disconnected,
}

/// One peer as this region sees it: everything the node keeps per peer (the per-key state
/// for a peer is in the key's `KeyPeer`).
#[derive(Debug, Clone, Default)]
pub(super) struct Peer {
    /// The newest incarnation of the peer heard from: messages of older ones are dropped.
    pub(super) incarnation: u64,
    /// When (our clock) a message of the peer last arrived. Liveness, not round trips:
    /// on a slow WAN (seconds of one-way delay) replies arrive every round but each
    /// answers a request several seconds old, and the peer is very much alive.
    last_heard: Option<LocalUs>,
    /// `t_req` of the newest request whose reply arrived (a round trip that completed).
    last_round_trip: Option<LocalUs>,
    rtt_us: Option<i64>,
    /// Heard from since the last round while its link was not connected before.
    pub(super) link_up: bool,
    /// The tick (a round or a sense) in which the last early exchange (news for a few
    /// keys, between rounds) went to it. At most one per peer per tick; the rest waits.
    pub(super) early_tick: u64,
    /// When (our clock) the last early exchange went to it: the next waits a round trip,
    /// so that on a slow link news does not pile up behind answers still on the way.
    pub(super) early_at: Option<LocalUs>,
    /// Some key has news for it since the last exchange to it (the keys' `early` flags),
    /// so that checking for early exchanges costs nothing per key.
    pub(super) news: bool,
    /// `t_req` of the newest exchange taken from its current incarnation: one sent
    /// before it and delayed past it is out of order (see [`Node::in_order`]).
    newest_exchange: Option<LocalUs>,
}

impl Peer {
    /// The link at `now`, for a node started at `started`.
    fn link(&self, now: LocalUs, started: LocalUs, p: &Params) -> Link {
        let since = match self.last_heard {
            Some(t) => now - t,
            None => {
                return if now - started >= p.lender_hold_us() {
                    Link::Disconnected
                } else {
                    Link::Suspect
                };
            }
        };
        if since >= p.lender_hold_us() {
            Link::Disconnected
        } else if since > p.suspect_rounds as i64 * p.round_us {
            Link::Suspect
        } else {
            Link::Connected
        }
    }
}

impl<C: Clock> Node<C> {
    /// How `peer` is reached now.
    pub fn link(&self, peer: RegionId) -> Link {
        self.link_at(peer.index(), self.clock.now_us())
    }

    /// The last round trip to `peer`, when one completed.
    pub fn rtt_us(&self, peer: RegionId) -> Option<i64> {
        self.peers.get(peer.index()).and_then(|p| p.rtt_us)
    }

    /// Whether an early exchange may go to peer `j` at `now`: not twice in one tick, and
    /// not within a round trip of the last one.
    pub(super) fn early_due(&self, j: usize, now: LocalUs) -> bool {
        let peer = &self.peers[j];
        peer.early_tick != self.tick
            && peer
                .early_at
                .is_none_or(|t| now - t >= peer.rtt_us.unwrap_or(0))
    }

    pub(super) fn link_at(&self, j: usize, now: LocalUs) -> Link {
        self.peers[j].link(now, self.started, &self.params)
    }

    /// Every peer's link at `now`, by index (this region's own entry is never read).
    pub(super) fn links(&self, now: LocalUs) -> Vec<Link> {
        (0..self.peers.len())
            .map(|j| self.link_at(j, now))
            .collect()
    }

    /// A message of `from` (incarnation `incarnation`) arrived: its index, once the peer
    /// is known to be that incarnation and heard from; `None` for a message of no peer
    /// (out of range, or this region's own) or of a previous life of the peer, delayed,
    /// which must change nothing.
    pub(super) fn accept(
        &mut self,
        from: RegionId,
        incarnation: u64,
        now: LocalUs,
    ) -> Option<usize> {
        let j = from.index();
        if j >= self.peers.len() || j == self.me.index() {
            return None;
        }
        if incarnation < self.peers[j].incarnation {
            return None; // a previous life of that peer, delayed
        }
        if incarnation > self.peers[j].incarnation {
            self.peers[j].newest_exchange = None;
        }
        self.peers[j].incarnation = incarnation;
        self.heard(j, now);
        Some(j)
    }

    /// Whether an exchange of peer `j` (its current incarnation, sent at `t_req` on its
    /// clock) is not older than one already taken: messages overtake each other on a WAN
    /// (separate connections, retries), and an older exchange carries an older demand and
    /// ask. Answering its ask would grant, under a newer seq, what the peer wanted before:
    /// the peer would replace a larger loan with it while this region still reserved the
    /// larger one, capacity neither side uses until the reservation ends.
    ///
    /// One older by more than a lease is taken as the newest: the peer's clock stepped
    /// back (a message delayed that long answers nothing the peer still counts), and its
    /// asks must not go unanswered until its clock is back where it was.
    pub(super) fn in_order(&mut self, j: usize, t_req: LocalUs) -> bool {
        let lease = self.params.lease_us;
        let newest = &mut self.peers[j].newest_exchange;
        if newest.is_some_and(|t| t_req < t && t.saturating_sub(t_req) <= lease) {
            return false;
        }
        *newest = Some(t_req);
        true
    }

    /// A message of peer `j` arrived.
    fn heard(&mut self, j: usize, now: LocalUs) {
        if self.link_at(j, now) != Link::Connected {
            self.peers[j].link_up = true;
        }
        self.peers[j].last_heard = Some(now);
    }

    /// A reply of peer `j` to the request sent at `t_req` arrived: a round trip completed.
    /// Only a request newer than the last completed one counts (replies may come out of
    /// order), and none from this clock's future.
    pub(super) fn round_trip(&mut self, j: usize, t_req: LocalUs, now: LocalUs) {
        let peer = &mut self.peers[j];
        if t_req <= now && peer.last_round_trip.is_none_or(|t| t_req > t) {
            peer.last_round_trip = Some(t_req);
            peer.rtt_us = Some(now - t_req);
        }
    }

    /// A round begins, or the heals since the last one were answered: no peer is pending.
    pub(super) fn clear_link_up(&mut self) {
        for peer in &mut self.peers {
            peer.link_up = false;
        }
    }
}
