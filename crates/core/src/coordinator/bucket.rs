//! A region's bucket for one key of a global policy: the state the region's store keeps for
//! the key and what every touch of it does. This is the reference model of
//! `lua/global/*.lua` (the differential test runs both on the same inputs), and the
//! simulator's store runs it as is.
//!
//! Per key the store keeps a token bucket, the lease book (when the coordinator wrote one)
//! and cumulative admitted / locally rejected counters. The bucket refills at the rate the
//! book gives on the store's clock, *piecewise*: a lease that ends between two touches
//! changes the rate at that instant, and each stretch is credited at its own rate and
//! capacity B·R/ρ. Keys without a book run on the policy's default escrow
//! ([`DefaultEscrow`]).

use serde::{Deserialize, Serialize};

use super::LocalUs;
use super::demand::Counters;
use super::lease::LeaseBook;
use crate::algorithm::{self, BucketRate, Op, State, Verdict, Write};

/// The policy-wide numbers a bucket needs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    /// The global rate ρ, units per second.
    pub rho: f64,
    /// The global capacity B; a region holds at most B·R/ρ.
    pub burst: f64,
    /// A clock reading this far below the book's high-water mark is a backward step.
    pub step_tolerance: i64,
}

impl Shape {
    /// The regional token bucket at enforced rate `rate`: capacity B·rate/ρ.
    pub fn bucket_rate(&self, rate: f64) -> BucketRate {
        let cap = if self.rho > 0.0 {
            self.burst * rate / self.rho
        } else {
            0.0
        };
        BucketRate::per_second(rate, cap)
    }
}

/// A key's own numbers in a global policy (a runtime limit): the rate ρ_K and burst B_K it
/// has instead of the policy's ρ and B. The coordinator's books stay in policy units (its
/// share R of ρ); the key's bucket runs at R·ρ_K/ρ with capacity B_K·R/ρ, so the regions
/// together admit at most ρ_K·ΣR/ρ ≤ ρ_K. While a change spreads, each region runs under
/// the numbers it has, and together they admit at most the larger of them
/// (docs/global-budgets.md, runtime limits).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct KeyLimit {
    /// ρ_K, units per second.
    pub rate: f64,
    /// B_K.
    pub burst: f64,
}

/// The escrow a region applies to keys without a book, and what it was before the last
/// change. Stores change it without touching every key (Redis cannot enumerate them
/// cheaply), so a key settles lazily: a stretch before `since` is credited at `before`,
/// the smallest default ever in force before `since` (never more than was in force).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DefaultEscrow {
    /// The escrow in force since `since`.
    pub escrow: f64,
    /// The smallest default in force before `since`.
    pub before: f64,
    /// When `escrow` came into force (store time).
    pub since: LocalUs,
}

impl DefaultEscrow {
    /// A default of `escrow` since ever.
    pub fn new(escrow: f64) -> Self {
        DefaultEscrow {
            escrow,
            before: escrow,
            since: LocalUs::MIN,
        }
    }

    /// Changes the escrow at store time `now`; returns whether it changed.
    pub fn change(&mut self, escrow: f64, now: LocalUs) -> bool {
        if escrow == self.escrow {
            return false;
        }
        self.before = self.before.min(self.escrow);
        self.escrow = escrow;
        self.since = now;
        true
    }

    fn during(&self, t: LocalUs) -> f64 {
        if t < self.since {
            self.before.min(self.escrow)
        } else {
            self.escrow
        }
    }
}

/// What a book write did: the key's step epoch after it, and whether the stored book
/// changed (its rate may have).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BookWritten {
    /// The key's step epoch after the write.
    pub epoch: u64,
    /// Whether the stored book changed.
    pub changed: bool,
}

/// What the store holds for one key.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KeySlot {
    /// The key's lease book, if it has one.
    pub book: Option<LeaseBook>,
    /// The regional bucket's state.
    pub bucket: Option<State>,
    /// Admissions and rejections counted in the region, in the key's units.
    pub counters: Counters,
    /// The key's own numbers its bucket runs under (none: the policy's): set by a decision
    /// that carries other numbers ([`Self::set_limit`]), read by every other touch.
    pub limit: Option<KeyLimit>,
}

/// What a key of a global policy holds in this region, read without changing it: the
/// check script's `usage` mode (`GET /v1/usage`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RegionUsage {
    /// A peek's verdict on the regional bucket.
    pub verdict: Verdict,
    /// The rate this region enforces now, R_i = escrow − lent + borrowed (at least 0),
    /// units per second.
    pub rate: f64,
    /// The region's escrow for the key (its book's, or the policy's default).
    pub escrow: f64,
    /// Lent to other regions and not yet ended.
    pub lent: f64,
    /// Borrowed from other regions and not yet ended.
    pub borrowed: f64,
    /// The regional bucket's capacity, B·R_i/ρ (B_K·R_i/ρ under the key's own numbers).
    pub capacity: f64,
}

impl KeySlot {
    /// What the key holds at store time `now` ([`RegionUsage`]): touched and settled on a
    /// copy, so nothing of the slot changes.
    /// The numbers the caller has for the key (`limit`) are applied as a decision would.
    pub fn usage(
        &self,
        default: &DefaultEscrow,
        shape: &Shape,
        now: LocalUs,
        limit: Option<KeyLimit>,
    ) -> RegionUsage {
        let mut s = self.clone();
        s.set_limit(default, shape, now, limit);
        let rate = s.rate(default, shape, now);
        let bucket = s.bucket_rate(shape, rate);
        let peek = Op::Check { cost: 0 };
        let verdict = algorithm::token_bucket_at(&bucket, s.bucket.as_ref(), now, peek).verdict;
        let (escrow, lent, borrowed) = match &s.book {
            Some(b) => (
                b.escrow,
                b.reserved_total(now),
                b.borrowed_total(now, shape.step_tolerance),
            ),
            None => (default.escrow, 0.0, 0.0),
        };
        RegionUsage {
            verdict,
            rate,
            escrow,
            lent: lent + 0.0,
            borrowed: borrowed + 0.0,
            capacity: bucket.capacity,
        }
    }

    /// The regional bucket at enforced rate `rate` (policy units): the policy's
    /// ([`Shape::bucket_rate`]), or under the key's own numbers rate·ρ_K/ρ with capacity
    /// B_K·rate/ρ.
    pub fn bucket_rate(&self, shape: &Shape, rate: f64) -> BucketRate {
        match self.limit {
            None => shape.bucket_rate(rate),
            Some(_) if shape.rho <= 0.0 => BucketRate::per_second(0.0, 0.0),
            Some(k) => {
                BucketRate::per_second(rate * k.rate / shape.rho, k.burst * rate / shape.rho)
            }
        }
    }

    /// A decision carries the key's numbers as its caller has them (`limit`): when they
    /// differ from the bucket's, the bucket is brought to `now` under the numbers it ran
    /// under and runs under the new ones from then (the refill until `now` is the old
    /// numbers'; what the key used carries over, clamped to the new capacity at once).
    /// Touches and settles first, as every decision does; returns whether the numbers
    /// changed.
    pub fn set_limit(
        &mut self,
        default: &DefaultEscrow,
        shape: &Shape,
        now: LocalUs,
        limit: Option<KeyLimit>,
    ) -> bool {
        self.touch(default, shape, now);
        self.settle(default, shape, now);
        let changed = self.limit != limit;
        if changed {
            self.limit = limit;
            self.clamp(default, shape, now);
        }
        changed
    }

    /// The rate in force at store time `now`.
    pub fn rate(&self, default: &DefaultEscrow, shape: &Shape, now: LocalUs) -> f64 {
        match &self.book {
            Some(book) => book.rate(now, shape.step_tolerance),
            None => default.escrow,
        }
    }

    /// The rate in force at `t`, a time of a stretch being settled.
    fn rate_during(&self, default: &DefaultEscrow, t: LocalUs) -> f64 {
        match &self.book {
            Some(book) => book.rate_during(t),
            None => default.during(t),
        }
    }

    /// Every touch starts here: a reading more than the tolerance below the book's
    /// high-water mark is a backward step, and the key's loans are dropped for good (the
    /// step epoch rises so that no stale copy brings them back) and the bucket is clamped
    /// to the smaller share. Returns whether the book changed that way.
    pub fn touch(&mut self, default: &DefaultEscrow, shape: &Shape, now: LocalUs) -> bool {
        let stepped = match &mut self.book {
            Some(book) => book.observe_time(now, shape.step_tolerance),
            None => false,
        };
        if stepped {
            self.clamp(default, shape, now);
        }
        stepped
    }

    /// Brings the bucket to `now` at the rates in force since it was last written, stretch
    /// by stretch (a lease that ends mid-way, a default that changed).
    pub fn settle(&mut self, default: &DefaultEscrow, shape: &Shape, now: LocalUs) {
        let Some(State::Bucket { ts, .. }) = self.bucket else {
            return;
        };
        // Stretch by stretch, each from one change of rate to the next (found one at a
        // time: most settles cross none, and this runs on every decision).
        let mut from = ts;
        loop {
            let next = match &self.book {
                Some(b) => b.next_expiry(from).filter(|&t| t <= now),
                None => (default.since > from && default.since <= now).then_some(default.since),
            };
            let at = next.unwrap_or(now);
            if at > from {
                let rate = self.bucket_rate(shape, self.rate_during(default, from));
                self.put(algorithm::token_bucket_at(
                    &rate,
                    self.bucket.as_ref(),
                    at,
                    Op::Refund { cost: 0 },
                ));
                from = at;
            }
            if next.is_none() {
                return;
            }
        }
    }

    /// After a rate change: the bucket holds at most the new capacity share.
    pub fn clamp(&mut self, default: &DefaultEscrow, shape: &Shape, now: LocalUs) {
        if self.bucket.is_some() {
            let rate = self.bucket_rate(shape, self.rate(default, shape, now));
            self.put(algorithm::token_bucket_at(
                &rate,
                self.bucket.as_ref(),
                now,
                Op::Refund { cost: 0 },
            ));
        }
    }

    fn put(&mut self, out: algorithm::Outcome) {
        if let Write::Put { state, .. } = out.write {
            self.bucket = Some(state);
        }
    }

    /// One decision at store time `now` with the key's numbers as the caller has them
    /// (`limit`, [`Self::set_limit`]): touch, settle, then the token bucket at the rate
    /// and capacity share in force. A check counts its cost as admitted or rejected
    /// (offered load); a peek (cost 0) and a refund count nothing.
    pub fn decide(
        &mut self,
        default: &DefaultEscrow,
        shape: &Shape,
        now: LocalUs,
        op: Op,
        limit: Option<KeyLimit>,
    ) -> Verdict {
        self.set_limit(default, shape, now, limit);
        let rate = self.bucket_rate(shape, self.rate(default, shape, now));
        let out = algorithm::token_bucket_at(&rate, self.bucket.as_ref(), now, op);
        if let Op::Check { cost } = op {
            if out.verdict.allowed {
                self.counters.admitted += cost;
            } else {
                self.counters.rejected += cost;
            }
        }
        let verdict = out.verdict;
        self.put(out);
        verdict
    }

    /// The coordinator writes `incoming`: the bucket settles at the old rate first, the
    /// store's high-water mark only rises, loans from before a step the store saw stay out,
    /// and the bucket is clamped to the new share.
    pub fn write_book(
        &mut self,
        default: &DefaultEscrow,
        shape: &Shape,
        now: LocalUs,
        incoming: &LeaseBook,
    ) -> BookWritten {
        let high_water = self.book.as_ref().map(|b| b.high_water);
        let stepped = self.touch(default, shape, now);
        self.settle(default, shape, now);
        let written = match &mut self.book {
            Some(book) => {
                let rose = high_water != Some(book.high_water);
                let changed = book.take_write(incoming) || stepped || rose;
                BookWritten {
                    epoch: book.epoch,
                    changed,
                }
            }
            None => {
                self.book = Some(incoming.clone());
                BookWritten {
                    epoch: incoming.epoch,
                    changed: true,
                }
            }
        };
        self.clamp(default, shape, now);
        written
    }

    /// A failover promoted a replica: every loan goes (the promoted copy may hold loans the
    /// old primary had dropped, and dropping a loan is always safe), the epoch rises.
    /// Returns whether the book changed.
    pub fn drop_loans(&mut self, default: &DefaultEscrow, shape: &Shape, now: LocalUs) -> bool {
        self.settle(default, shape, now);
        let dropped = match &mut self.book {
            Some(b) if !b.borrowed.is_empty() => {
                b.borrowed.clear();
                b.epoch += 1;
                true
            }
            _ => false,
        };
        if dropped {
            self.clamp(default, shape, now);
        }
        dropped
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coordinator::RegionId;
    use crate::coordinator::lease::{Loan, Reservation};

    const SHAPE: Shape = Shape {
        rho: 100.0,
        burst: 100.0,
        step_tolerance: 50_000,
    };

    fn loan(amount: f64, until: LocalUs) -> Loan {
        Loan {
            lender: RegionId(1),
            lender_incarnation: 1,
            seq: 1,
            amount,
            until,
        }
    }

    fn admit(slot: &mut KeySlot, d: &DefaultEscrow, now: LocalUs, n: u64) -> u64 {
        let peek = slot.decide(d, &SHAPE, now, Op::Check { cost: 0 }, None);
        let take = n.min(peek.remaining);
        if take > 0 {
            assert!(
                slot.decide(d, &SHAPE, now, Op::Check { cost: take }, None)
                    .allowed
            );
        }
        take
    }

    /// A loan of 30/s that ends 1 s into a 2 s gap adds 30 tokens, not 60.
    #[test]
    fn refill_is_piecewise_across_lease_expiries() {
        let d = DefaultEscrow::new(50.0);
        let mut slot = KeySlot::default();
        assert_eq!(admit(&mut slot, &d, 0, 1000), 50, "capacity B·E/ρ = 50");
        let mut book = LeaseBook::new(50.0);
        book.borrowed.push(loan(30.0, 1_000_000));
        slot.write_book(&d, &SHAPE, 0, &book);
        // 1 s at 80/s (capacity 80) then 1 s at 50/s (capacity 50): clamped to 50.
        assert_eq!(admit(&mut slot, &d, 2_000_000, 1000), 50);
        assert_eq!(admit(&mut slot, &d, 2_500_000, 1000), 25);
    }

    /// Two leases that end inside one gap: each stretch is credited at its own rate.
    #[test]
    fn refill_crosses_every_expiry_in_a_gap() {
        let d = DefaultEscrow::new(10.0);
        let mut slot = KeySlot::default();
        assert_eq!(admit(&mut slot, &d, 0, 1000), 10, "capacity B·E/ρ = 10");
        let mut book = LeaseBook::new(10.0);
        book.borrowed.push(loan(60.0, 100_000));
        book.borrowed.push(Loan {
            lender: RegionId(2),
            until: 300_000,
            ..loan(20.0, 0)
        });
        slot.write_book(&d, &SHAPE, 0, &book);
        // 0.1 s at 90/s, 0.2 s at 30/s, 0.1 s at 10/s: 9 + 6 + 1 = 16, capacity 10.
        assert_eq!(admit(&mut slot, &d, 400_000, 1000), 10);
        // Within the capacity: 0.05 s at 90/s, 0.2 s at 30/s, 0.05 s at 10/s.
        let mut slot = KeySlot::default();
        assert_eq!(admit(&mut slot, &d, 0, 1000), 10);
        book.borrowed[0].until = 50_000;
        book.borrowed[1].until = 250_000;
        slot.write_book(&d, &SHAPE, 0, &book);
        assert_eq!(admit(&mut slot, &d, 120_000, 1000), 6, "4.5 + 2.1 tokens");
    }

    /// What the store tells its caller of a write: the book changed, or not. The simulator
    /// checks the bound only for keys whose books changed, so a write reported unchanged
    /// that did change would hide a breach.
    #[test]
    fn a_book_write_says_whether_the_stored_book_changed() {
        let d = DefaultEscrow::new(50.0);
        let mut slot = KeySlot::default();
        let mut book = LeaseBook::new(50.0);
        book.high_water = 1_000_000;
        assert!(
            slot.write_book(&d, &SHAPE, 1_000_000, &book).changed,
            "a first book"
        );
        assert!(
            !slot.write_book(&d, &SHAPE, 1_000_000, &book).changed,
            "the same book"
        );
        assert!(
            slot.write_book(&d, &SHAPE, 2_000_000, &book).changed,
            "the store's high-water mark rose"
        );
        book.borrowed.push(loan(10.0, 9_000_000));
        assert!(
            slot.write_book(&d, &SHAPE, 2_000_000, &book).changed,
            "a loan"
        );
        book.escrow = 40.0;
        assert!(
            slot.write_book(&d, &SHAPE, 2_000_000, &book).changed,
            "the escrow"
        );
        book.reserved.push(Reservation {
            borrower: RegionId(2),
            seq: 1,
            amount: 5.0,
            until: 9_000_000,
        });
        assert!(
            slot.write_book(&d, &SHAPE, 2_000_000, &book).changed,
            "a reservation"
        );
        assert!(!slot.write_book(&d, &SHAPE, 2_000_000, &book).changed);
        // A step back the store sees: the loans go (the epoch rises), and a write of the
        // old book cannot bring them back, so nothing else changes on the second write.
        assert!(
            slot.write_book(&d, &SHAPE, 100_000, &book).changed,
            "the step"
        );
        let stored = slot.book.clone().expect("written");
        assert!(stored.borrowed.is_empty());
        assert_eq!(stored.epoch, 1);
        let again = slot.write_book(&d, &SHAPE, 100_000, &book);
        assert_eq!(again.epoch, 1);
        assert!(!again.changed, "the old book's loans stay out");
    }

    /// A reservation lowers the rate and the capacity at once.
    #[test]
    fn a_reservation_clamps_the_bucket() {
        let d = DefaultEscrow::new(50.0);
        let mut slot = KeySlot::default();
        assert_eq!(admit(&mut slot, &d, 0, 10), 10);
        let mut book = LeaseBook::new(50.0);
        book.reserved.push(Reservation {
            borrower: RegionId(1),
            seq: 1,
            amount: 40.0,
            until: 10_000_000,
        });
        slot.write_book(&d, &SHAPE, 0, &book);
        assert_eq!(slot.rate(&d, &SHAPE, 0), 10.0);
        assert_eq!(admit(&mut slot, &d, 0, 1000), 10);
        assert_eq!(slot.counters.admitted, 20);
        assert_eq!(slot.counters.rejected, 0);
        assert!(
            !slot
                .decide(&d, &SHAPE, 0, Op::Check { cost: 1 }, None)
                .allowed
        );
        assert_eq!(slot.counters.rejected, 1);
    }

    /// A default that changes between touches: the stretch before the change is credited
    /// at the smaller of the two, after it at the new one.
    #[test]
    fn a_changed_default_settles_lazily_and_never_over_credits() {
        let mut d = DefaultEscrow::new(50.0);
        let mut slot = KeySlot::default();
        assert_eq!(admit(&mut slot, &d, 0, 1000), 50);
        d.change(80.0, 500_000);
        // 0.5 s at min(50, 80) = 25 tokens, then 0.25 s at 80 = 20 tokens.
        assert_eq!(admit(&mut slot, &d, 750_000, 1000), 45);
        d.change(10.0, 1_000_000);
        // 0.25 s at min(50, 80, 10) = 2.5, then 1 s at 10 = 10, capacity 10.
        assert_eq!(admit(&mut slot, &d, 2_000_000, 1000), 10);
    }

    /// A key's own numbers scale its bucket: at R = ρ/2 a key with ρ_K = 10 and
    /// B_K = 20 holds 10 and refills at 5/s; the books stay in policy units.
    #[test]
    fn a_keys_own_numbers_scale_its_share_of_the_bucket() {
        let d = DefaultEscrow::new(50.0);
        let own = Some(KeyLimit {
            rate: 10.0,
            burst: 20.0,
        });
        let mut slot = KeySlot::default();
        let take = |slot: &mut KeySlot, now, cost| {
            slot.decide(&d, &SHAPE, now, Op::Check { cost }, own)
                .allowed
        };
        assert!(take(&mut slot, 0, 10), "capacity B_K·R/ρ = 10");
        assert!(!take(&mut slot, 0, 1));
        assert!(take(&mut slot, 1_000_000, 5), "5/s: R·ρ_K/ρ");
        assert!(!take(&mut slot, 1_000_000, 1));
        assert_eq!(slot.rate(&d, &SHAPE, 1_000_000), 50.0, "policy units");
        assert_eq!(slot.counters.admitted, 15, "the key's units");
    }

    /// A lowered limit: the stretch before the first decision that carries it refills at
    /// the old numbers, and what is left is clamped to the new capacity at once.
    #[test]
    fn new_numbers_apply_from_the_decision_that_carries_them() {
        let d = DefaultEscrow::new(50.0);
        let (high, low) = (
            Some(KeyLimit {
                rate: 100.0,
                burst: 100.0,
            }),
            Some(KeyLimit {
                rate: 10.0,
                burst: 10.0,
            }),
        );
        let mut slot = KeySlot::default();
        let peek = |slot: &mut KeySlot, now, limit| {
            slot.decide(&d, &SHAPE, now, Op::Check { cost: 0 }, limit)
                .remaining
        };
        assert!(
            slot.decide(&d, &SHAPE, 0, Op::Check { cost: 50 }, high)
                .allowed
        );
        // 0.2 s at 50/s under the old numbers: 10 back, then at most the new capacity 5.
        assert_eq!(peek(&mut slot, 200_000, low), 5);
        assert_eq!(slot.limit, low);
        // From then on at 5/s: 1 s later full again at 5, never the old 50.
        assert_eq!(peek(&mut slot, 1_200_000, low), 5);
        // Back to the policy's numbers: the bucket refills at 50/s to 50.
        assert_eq!(peek(&mut slot, 2_200_000, None), 5);
        assert_eq!(peek(&mut slot, 3_200_000, None), 50);
    }

    #[test]
    fn a_backward_step_drops_loans_and_clamps() {
        let d = DefaultEscrow::new(50.0);
        let mut slot = KeySlot::default();
        let mut book = LeaseBook::new(50.0);
        book.borrowed.push(loan(50.0, 10_000_000));
        book.high_water = 2_000_000;
        assert_eq!(slot.write_book(&d, &SHAPE, 2_000_000, &book).epoch, 0);
        assert_eq!(slot.rate(&d, &SHAPE, 2_000_000), 100.0);
        assert!(slot.touch(&d, &SHAPE, 1_000_000), "1 s back");
        assert_eq!(slot.rate(&d, &SHAPE, 3_000_000), 50.0);
        // A stale copy of the book cannot bring the loan back.
        assert_eq!(slot.write_book(&d, &SHAPE, 3_000_000, &book).epoch, 1);
        assert_eq!(slot.rate(&d, &SHAPE, 3_000_000), 50.0);
    }
}
