//! The lease book: what a region's store holds for one key of a global policy, and the
//! enforced rate it implies.
//!
//! This is the state the Lua token bucket reads (issue 4 moves it into the key's hash):
//! the region's escrow, the reservations it holds for loans it granted, and the loans it
//! holds. The enforced rate is a function of the book and the *store's* clock alone, so a
//! crashed or wedged daemon can never extend a loan: expired entries stop counting by
//! themselves. Lenders count only the largest live reservation per borrower, because a
//! borrower holds exactly one lease per lender at a time (the newest it accepted); older,
//! larger ones stay reserved until the borrower announces that it has moved past them.

use serde::{Deserialize, Serialize};

use super::{LocalUs, RegionId};

/// A reservation the lender holds for a loan it granted (or was about to grant).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Reservation {
    /// The region the loan went to.
    pub borrower: RegionId,
    /// The loan's sequence number (per borrower and key).
    pub seq: u64,
    /// Units per second lent.
    pub amount: f64,
    /// Lender's clock: grant time + D(1+ε) + m.
    pub until: LocalUs,
}

/// A loan the borrower counts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Loan {
    /// The region that lent.
    pub lender: RegionId,
    /// The lender's incarnation when it granted.
    pub lender_incarnation: u64,
    /// The lender's sequence number of the loan.
    pub seq: u64,
    /// Units per second borrowed.
    pub amount: f64,
    /// Borrower's clock: t_req + D(1−ε).
    pub until: LocalUs,
}

/// What a region holds for one key of a global policy: its escrow, what it reserved for
/// loans to others and what it borrowed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeaseBook {
    /// The region's effective escrow for this key's policy (see `node` on re-splits).
    pub escrow: f64,
    /// Loans to other regions, held until they end.
    pub reserved: Vec<Reservation>,
    /// Loans from other regions, counted until they end.
    pub borrowed: Vec<Loan>,
    /// Highest store time seen by a write or a decision: a reading well below it is a
    /// backward clock step, and loans stop counting (their validity would stretch).
    pub high_water: LocalUs,
    /// Backward steps after which the store dropped this key's loans. A write that
    /// carries an older epoch cannot bring those loans back: the daemon may not have seen
    /// the step (its own readings were too far apart) and re-asserts what it remembers.
    #[serde(default)]
    pub epoch: u64,
}

impl LeaseBook {
    /// A digest of everything but the high-water mark: two books with the same one hold
    /// the same escrow, reservations, loans and epoch (up to a 64-bit collision).
    pub fn digest(&self) -> u64 {
        use std::hash::{BuildHasher, Hash, Hasher};
        // A fixed seed: the same book gives the same digest in every run. In memory only
        // (never stored or sent), so the hash may change between versions.
        let mut h = foldhash::fast::FixedState::with_seed(0).build_hasher();
        self.escrow.to_bits().hash(&mut h);
        self.epoch.hash(&mut h);
        for r in &self.reserved {
            (r.borrower.0, r.seq, r.amount.to_bits(), r.until).hash(&mut h);
        }
        0xffu8.hash(&mut h);
        for l in &self.borrowed {
            (
                l.lender.0,
                l.lender_incarnation,
                l.seq,
                l.amount.to_bits(),
                l.until,
            )
                .hash(&mut h);
        }
        h.finish()
    }

    /// A book with `escrow` and no loans.
    pub fn new(escrow: f64) -> Self {
        LeaseBook {
            escrow,
            reserved: Vec::new(),
            borrowed: Vec::new(),
            high_water: LocalUs::MIN,
            epoch: 0,
        }
    }

    /// The rate the region enforces at store time `now`: E − Σ_peers max live reservation
    /// + Σ live loans (loans not at all after a backward step beyond `step_tolerance`).
    pub fn rate(&self, now: LocalUs, step_tolerance: i64) -> f64 {
        self.net_rate(now, step_tolerance).max(0.0)
    }

    /// [`Self::rate`] before the clamp at zero. Below zero the book reserves more than it
    /// has, and the clamp would admit what a borrower also counts: the simulator treats
    /// that as a breach of the invariant.
    pub fn net_rate(&self, now: LocalUs, step_tolerance: i64) -> f64 {
        self.escrow - self.reserved_total(now) + self.borrowed_total(now, step_tolerance)
    }

    /// The rate in force at store time `t` of a stretch the bucket is being settled over
    /// (a refill from its last write up to now). No step check: that stretch lies below the
    /// high-water mark by construction, and a backward step is caught on the current
    /// reading ([`Self::observe_time`], before settling), which drops the loans for good.
    /// Checking here instead would refill every past stretch of a borrower without its
    /// loans.
    pub fn rate_during(&self, t: LocalUs) -> f64 {
        (self.escrow - self.reserved_total(t) + self.borrowed_total(t, i64::MAX / 4)).max(0.0)
    }

    fn stepped_back(&self, now: LocalUs, tolerance: i64) -> bool {
        now.saturating_add(tolerance) < self.high_water
    }

    /// The largest live reservation for one borrower.
    pub fn reserved_for(&self, borrower: RegionId, now: LocalUs) -> f64 {
        self.reserved
            .iter()
            .filter(|r| r.borrower == borrower && now < r.until)
            .map(|r| r.amount)
            .fold(0.0, f64::max)
    }

    /// Σ over borrowers of [`Self::reserved_for`], summed in the order the borrowers
    /// first appear in the book. One pass: with ten regions a lender's book holds tens of
    /// reservations, and this is read for every decision and every lent key.
    pub fn reserved_total(&self, now: LocalUs) -> f64 {
        // Each borrower's largest live reservation, by region number, and the borrowers in
        // order of first appearance; a book with a region numbered past the array is
        // summed the long way.
        const KEPT: usize = 16;
        let mut largest = [0.0f64; KEPT];
        let mut order = [0usize; KEPT];
        let mut seen = 0u32;
        let mut n = 0;
        for r in &self.reserved {
            let b = usize::from(r.borrower.0);
            if b >= KEPT {
                return self.reserved_total_slow(now);
            }
            let live = if now < r.until { r.amount } else { 0.0 };
            if seen & (1 << b) == 0 {
                seen |= 1 << b;
                order[n] = b;
                n += 1;
                largest[b] = 0.0f64.max(live);
            } else {
                largest[b] = largest[b].max(live);
            }
        }
        order[..n].iter().fold(0.0, |total, &b| total + largest[b])
    }

    fn reserved_total_slow(&self, now: LocalUs) -> f64 {
        let mut seen: Vec<RegionId> = Vec::new();
        let mut total = 0.0;
        for r in &self.reserved {
            if !seen.contains(&r.borrower) {
                seen.push(r.borrower);
                total += self.reserved_for(r.borrower, now);
            }
        }
        total
    }

    /// The live loan from one lender, if any.
    pub fn loan_from(&self, lender: RegionId, now: LocalUs) -> Option<&Loan> {
        self.borrowed
            .iter()
            .find(|l| l.lender == lender && now < l.until)
    }

    /// Units per second borrowed and still valid at `now` (none after a backward clock
    /// step beyond `step_tolerance`).
    pub fn borrowed_total(&self, now: LocalUs, step_tolerance: i64) -> f64 {
        if self.stepped_back(now, step_tolerance) {
            return 0.0;
        }
        self.borrowed
            .iter()
            .filter(|l| now < l.until)
            .map(|l| l.amount)
            .sum()
    }

    /// What the store does on every touch: detect a backward step (drop every loan for
    /// good, and bump the epoch so that no stale copy brings them back; returns true) and
    /// raise the high-water mark.
    pub fn observe_time(&mut self, now: LocalUs, step_tolerance: i64) -> bool {
        let stepped = self.stepped_back(now, step_tolerance) && !self.borrowed.is_empty();
        if stepped {
            self.borrowed.clear();
            self.epoch += 1;
        }
        self.high_water = self.high_water.max(now);
        stepped
    }

    /// What the store does with a write of `incoming` over this book, in place: the
    /// high-water mark only rises, and loans from before a step this store detected stay
    /// out. Returns whether the book changed. In place (no new book per write): the
    /// coordinator writes every engaged key's book each round, and a simulated region
    /// with 100,000 keys takes a million writes a minute.
    pub fn take_write(&mut self, incoming: &LeaseBook) -> bool {
        let high_water = incoming.high_water.max(self.high_water);
        let (borrowed, epoch): (&[Loan], u64) = if incoming.epoch < self.epoch {
            (&[], self.epoch)
        } else {
            (&incoming.borrowed, incoming.epoch)
        };
        let changed = self.escrow != incoming.escrow
            || self.reserved != incoming.reserved
            || self.borrowed != borrowed
            || self.high_water != high_water
            || self.epoch != epoch;
        if changed {
            self.escrow = incoming.escrow;
            self.reserved.clone_from(&incoming.reserved);
            self.borrowed.clear();
            self.borrowed.extend_from_slice(borrowed);
            self.high_water = high_water;
            self.epoch = epoch;
        }
        changed
    }

    /// Drops entries that no longer count (garbage collection; changes no rate).
    pub fn prune(&mut self, now: LocalUs) {
        self.reserved.retain(|r| now < r.until);
        self.borrowed.retain(|l| now < l.until);
    }

    /// The borrower has moved to a lease with seq ≥ `upto`: older reservations can go.
    /// Returns whether any went.
    pub fn release(&mut self, borrower: RegionId, upto: u64) -> bool {
        let before = self.reserved.len();
        self.reserved
            .retain(|r| r.borrower != borrower || r.seq >= upto);
        self.reserved.len() != before
    }

    /// The borrower durably counts at most `amount` of lease `seq`: its reservation can
    /// shrink to that (never grow). Returns whether it shrank.
    pub fn lower(&mut self, borrower: RegionId, seq: u64, amount: f64) -> bool {
        let mut lowered = false;
        for r in self
            .reserved
            .iter_mut()
            .filter(|r| r.borrower == borrower && r.seq == seq)
        {
            if amount < r.amount {
                r.amount = amount;
                lowered = true;
            }
        }
        lowered
    }

    /// The first store time after `after` at which the rate changes by itself (an entry
    /// expires), if any. A token bucket that refills over a stretch credits each piece
    /// between these at its own rate.
    pub fn next_expiry(&self, after: LocalUs) -> Option<LocalUs> {
        let reserved = self.reserved.iter().map(|r| r.until);
        let borrowed = self.borrowed.iter().map(|l| l.until);
        reserved.chain(borrowed).filter(|&t| t > after).min()
    }

    /// Nothing lent or borrowed that still counts.
    pub fn is_idle(&self, now: LocalUs) -> bool {
        self.reserved.iter().all(|r| now >= r.until) && self.borrowed.iter().all(|l| now >= l.until)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_counts_the_largest_live_reservation_per_borrower_and_live_loans() {
        let mut b = LeaseBook::new(60.0);
        b.reserved.push(Reservation {
            borrower: RegionId(1),
            seq: 1,
            amount: 20.0,
            until: 100,
        });
        b.reserved.push(Reservation {
            borrower: RegionId(1),
            seq: 2,
            amount: 5.0,
            until: 200,
        });
        b.reserved.push(Reservation {
            borrower: RegionId(2),
            seq: 3,
            amount: 10.0,
            until: 150,
        });
        b.borrowed.push(Loan {
            lender: RegionId(3),
            lender_incarnation: 1,
            seq: 9,
            amount: 7.0,
            until: 120,
        });
        assert_eq!(b.rate(50, 0), 60.0 - 20.0 - 10.0 + 7.0);
        assert_eq!(b.rate(110, 0), 60.0 - 5.0 - 10.0 + 7.0);
        assert_eq!(b.rate(130, 0), 60.0 - 5.0 - 10.0);
        assert_eq!(b.rate(200, 0), 60.0);
        b.release(RegionId(1), 2);
        assert_eq!(b.rate(50, 0), 60.0 - 5.0 - 10.0 + 7.0);
        assert_eq!(b.next_expiry(0), Some(120));
        assert_eq!(b.next_expiry(120), Some(150));
    }

    #[test]
    fn the_total_reserved_is_the_sum_of_each_borrowers_largest_live_reservation() {
        // Books with up to twenty borrowers (numbered past what the one-pass total keeps):
        // the total is what summing `reserved_for` over the borrowers gives, bit for bit.
        let mut x: u64 = 7;
        let mut next = |m: u64| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) % m
        };
        for borrowers in [1, 3, 10, 16, 17, 20] {
            let mut b = LeaseBook::new(100.0);
            for seq in 0..60 {
                b.reserved.push(Reservation {
                    borrower: RegionId(next(borrowers) as u16),
                    seq,
                    amount: next(1_000) as f64 / 7.0,
                    until: next(200) as i64,
                });
            }
            for now in [0, 50, 100, 150, 199, 250] {
                let mut seen = Vec::new();
                let mut expected = 0.0;
                for r in &b.reserved {
                    if !seen.contains(&r.borrower) {
                        seen.push(r.borrower);
                        expected += b.reserved_for(r.borrower, now);
                    }
                }
                assert_eq!(
                    b.reserved_total(now).to_bits(),
                    f64::to_bits(expected),
                    "{borrowers} borrowers at {now}"
                );
            }
        }
    }

    #[test]
    fn a_backward_step_drops_loans() {
        let mut b = LeaseBook::new(10.0);
        b.borrowed.push(Loan {
            lender: RegionId(1),
            lender_incarnation: 1,
            seq: 1,
            amount: 5.0,
            until: 10_000,
        });
        assert!(!b.observe_time(5_000, 100));
        assert!(!b.observe_time(4_950, 100), "within tolerance");
        assert_eq!(
            b.rate(2_000, 100),
            10.0,
            "a reading far below the high water"
        );
        assert!(b.observe_time(2_000, 100));
        assert!(b.borrowed.is_empty());
        assert_eq!(b.rate(9_000, 100), 10.0);
    }
}
