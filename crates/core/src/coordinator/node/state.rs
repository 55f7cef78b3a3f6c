//! What the node keeps per policy and per key, and how a key's book goes to and from the
//! store.
//!
//! Why apart: the lender, the borrower and planning all work on the same key state; the
//! rules of its bookkeeping (a book tracked with what the store holds, a write taken in
//! with what the store did, a lease announced only once durably written) live once, here.

use std::collections::BTreeMap;

use super::{LeaseStore, Written};
use crate::coordinator::demand::DemandEstimator;
use crate::coordinator::lease::LeaseBook;
use crate::coordinator::{GlobalPolicy, LocalUs};

#[derive(Debug, Clone)]
pub(super) struct PolicyState {
    pub(super) policy: GlobalPolicy,
    /// While a re-split is in flight: this region's escrow before it. The region enforces
    /// min(old, new) until every peer reports the new version applied (decrease first).
    pub(super) previous_escrow: Option<f64>,
    /// The newest version whose escrow this region is durably at or below (0: none).
    pub(super) applied: u64,
    /// Per peer: the version it last reported applied.
    pub(super) peer_applied: Vec<u64>,
    /// Whether the store acknowledged the escrow in force for keys without a book (a
    /// failover could bring back the old one otherwise; re-asserted every round).
    pub(super) default_durable: bool,
    /// Until when (our clock) the policy lends nothing: a start that found none of its
    /// state in the store (see [`super::Node::set_policy`]).
    pub(super) learning_until: LocalUs,
    pub(super) keys: BTreeMap<String, KeyState>,
}

#[derive(Debug, Clone)]
pub(super) struct KeyState {
    pub(super) book: LeaseBook,
    pub(super) demand: DemandEstimator,
    /// Last round this key was hot here.
    pub(super) hot_round: Option<u64>,
    /// Last round this key had traffic here (kept that long so its demand can be measured:
    /// an estimate needs two readings).
    pub(super) active_round: Option<u64>,
    /// This region's own target from the latest plan, and the round of that plan.
    pub(super) target_self: f64,
    pub(super) planned: Option<u64>,
    /// Whether the book has changes the store has not durably taken.
    pub(super) dirty: bool,
    /// Until when (our clock) a grant for a loan this key asked for could still be
    /// accepted: the key is not forgotten before, or it would forget what it accepted.
    pub(super) asked_until: LocalUs,
    /// The digest of the book the store last took durably, and the round it did.
    pub(super) written: Option<DurableWrite>,
    /// Per peer: this key as it concerns that peer.
    pub(super) peers: Vec<KeyPeer>,
}

/// One key as it concerns one peer: what the peer reported, this region as its borrower,
/// and what this region has to tell it.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct KeyPeer {
    /// Last reported demand and the round it arrived in.
    pub(super) demand: Option<Reported>,
    /// This region as the peer's borrower (the peer as lender).
    pub(super) lender: FromLender,
    /// This key has news for the peer that should not wait for the next round (a
    /// give-back to announce, a re-ask, capacity freed for it).
    pub(super) early: bool,
    /// As a borrower, its last request was granted less than it asked for (by more than
    /// the hysteresis), so freed capacity is worth telling it about.
    pub(super) short: bool,
    /// As a borrower, capacity was freed since it was granted short (sent as `freed`).
    pub(super) freed: bool,
    /// The demand this region last reported to the peer.
    pub(super) told: f32,
}

/// A peer's reported demand for a key, and the round it arrived in.
#[derive(Debug, Clone, Copy)]
pub(super) struct Reported {
    pub(super) demand: f64,
    pub(super) round: u64,
}

/// The digest of a book the store took durably, and the round it did.
#[derive(Debug, Clone, Copy)]
pub(super) struct DurableWrite {
    pub(super) digest: u64,
    pub(super) round: u64,
}

/// A grant as a borrower names it: the lender's incarnation and the grant's seq (seqs
/// start over with each incarnation; zero: none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct GrantId {
    pub(super) incarnation: u64,
    pub(super) seq: u64,
}

/// A region as the borrower of one lender, for one key.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct FromLender {
    /// The newest grant accepted, and the amount it granted.
    pub(super) accepted: GrantId,
    pub(super) granted: f64,
    /// The newest lease durably written: the release watermark this region may announce,
    /// and what its durable book counts of that lease when that is less than granted.
    pub(super) release: GrantId,
    pub(super) held: Option<f64>,
    /// The loan to ask for in the next exchange.
    pub(super) want: f64,
    /// The loan last asked for (a sense asks again only for more than this).
    pub(super) asked: f64,
}

impl PolicyState {
    /// Starts tracking those of `keys` not tracked yet, with their stored books (read in
    /// one batch) or a fresh book at `escrow`.
    pub(super) fn track(
        &mut self,
        store: &mut dyn LeaseStore,
        name: &str,
        keys: &[&str],
        escrow: f64,
        n: usize,
    ) {
        let mut new: Vec<&str> = keys
            .iter()
            .copied()
            .filter(|k| !self.keys.contains_key(*k))
            .collect();
        new.sort_unstable();
        new.dedup();
        let books = store.read_books(name, &new);
        for (key, book) in new.into_iter().zip(books) {
            let book = book.unwrap_or_else(|| LeaseBook::new(escrow));
            self.keys.insert(key.to_owned(), KeyState::new(book, n));
        }
    }

    /// Writes the books of `keys` (each once, in one batch: a key may be listed twice, and
    /// one not tracked is skipped) and takes in what the store did; returns the keys whose
    /// write is durable, sorted.
    pub(super) fn write<'k>(
        &mut self,
        store: &mut dyn LeaseStore,
        name: &str,
        keys: impl IntoIterator<Item = &'k str>,
        round: u64,
    ) -> Vec<&'k str> {
        self.write_with(store, name, keys, round, |_| {})
    }

    /// [`Self::write`], then what each durably written book holds may be announced to the
    /// lenders (see [`KeyState::durable_written`]).
    pub(super) fn write_and_announce<'k>(
        &mut self,
        store: &mut dyn LeaseStore,
        name: &str,
        keys: impl IntoIterator<Item = &'k str>,
        round: u64,
    ) {
        self.write_with(store, name, keys, round, KeyState::durable_written);
    }

    /// [`Self::write`], calling `durable` on each key whose write the store took durably.
    /// Two lookups of each key and no copy of its name: this runs for every key of every
    /// exchange.
    fn write_with<'k>(
        &mut self,
        store: &mut dyn LeaseStore,
        name: &str,
        keys: impl IntoIterator<Item = &'k str>,
        round: u64,
        mut durable: impl FnMut(&mut KeyState),
    ) -> Vec<&'k str> {
        let mut keys: Vec<&'k str> = keys.into_iter().collect();
        keys.sort_unstable();
        keys.dedup();
        let (keys, books): (Vec<&'k str>, Vec<(&str, &LeaseBook)>) = keys
            .into_iter()
            .filter_map(|k| Some((k, (k, &self.keys.get(k)?.book))))
            .unzip();
        let written = store.write_books(name, &books);
        keys.into_iter()
            .zip(written)
            .filter(|(key, w)| {
                let Some(ks) = self.keys.get_mut(*key) else {
                    return false;
                };
                let taken = ks.taken(*w, round);
                if taken {
                    durable(ks);
                }
                taken
            })
            .map(|(key, _)| key)
            .collect()
    }

    /// Takes every book in the store that is not tracked yet (a start, a restart, a new
    /// policy version): the next refresh re-asserts it at the escrow in force.
    pub(super) fn adopt_books(&mut self, store: &mut dyn LeaseStore, n: usize) {
        for (key, book) in store.books(&self.policy.name) {
            self.keys.entry(key).or_insert_with(|| {
                let mut ks = KeyState::new(book, n);
                for l in &ks.book.borrowed {
                    let from = &mut ks.peers[l.lender.index()].lender;
                    from.accepted = GrantId {
                        incarnation: l.lender_incarnation,
                        seq: l.seq,
                    };
                    from.granted = l.amount;
                }
                // Announce nothing (no release watermark, no give-back) before this life
                // has written the book durably itself: what the store holds now may be an
                // unacknowledged write that a failover would undo.
                ks.dirty = true;
                ks
            });
        }
    }

    /// The escrow this region may count on (and lend from) for keys without reservations:
    /// during a re-split the smaller of old and new.
    pub(super) fn escrow_in_force(&self, me: usize) -> f64 {
        let cur = self.policy.escrow[me];
        self.previous_escrow.map_or(cur, |prev| prev.min(cur))
    }

    /// Peer `j` reports version `applied` of the policy applied.
    pub(super) fn peer_applies(&mut self, j: usize, applied: u64) {
        self.peer_applied[j] = self.peer_applied[j].max(applied);
    }

    /// The version this region reports as applied: this one once the default escrow and
    /// every book are durably at or below the escrow in force, else the last one that was.
    /// Computed from the books whatever the transition state: a book may stay above the
    /// escrow (to cover reservations granted under an older split) even when this version
    /// did not change this region's escrow.
    pub(super) fn applied_version(&self, me: usize) -> u64 {
        let in_force = self.escrow_in_force(me);
        let done = self.default_durable
            && self
                .keys
                .values()
                .all(|ks| !ks.dirty && ks.book.escrow <= in_force + 1e-9);
        if done {
            self.policy.version
        } else {
            self.applied
        }
    }
}

impl KeyState {
    pub(super) fn new(book: LeaseBook, n: usize) -> Self {
        KeyState {
            book,
            demand: DemandEstimator::default(),
            hot_round: None,
            active_round: None,
            target_self: 0.0,
            planned: None,
            dirty: false,
            asked_until: LocalUs::MIN,
            written: None,
            peers: vec![KeyPeer::default(); n],
        }
    }

    /// Takes in what the store did with this key's book; returns whether the write is
    /// durable. A store that had dropped the loans (a backward step it saw first) keeps
    /// them out, and so does this copy.
    fn taken(&mut self, w: Written, round: u64) -> bool {
        if w.epoch > self.book.epoch {
            self.book.borrowed.clear();
            self.book.epoch = w.epoch;
        }
        self.written = w.durable.then(|| DurableWrite {
            digest: self.book.digest(),
            round,
        });
        self.dirty = !w.durable;
        w.durable
    }

    /// The book was durably written: what it holds may now be announced to the lenders.
    pub(super) fn durable_written(&mut self) {
        for (j, peer) in self.peers.iter_mut().enumerate() {
            let from = &mut peer.lender;
            from.release = from.accepted;
            let GrantId { incarnation, seq } = from.accepted;
            let counted = self
                .book
                .borrowed
                .iter()
                .find(|l| {
                    l.lender.index() == j && l.lender_incarnation == incarnation && l.seq == seq
                })
                .map_or(0.0, |l| l.amount);
            from.held = (seq > 0 && counted < from.granted).then_some(counted);
        }
    }
}
