//! Allocation: how much of a global rate each region should enforce, given demand.
//!
//! Every region runs this same deterministic function on its own (slightly stale) view each
//! round. The result is only a *target*: safety never depends on it, because a region can
//! raise its rate only by a lease some other region has already reserved. So views may
//! disagree and the worst outcome is a loan that is smaller or later than ideal.
//!
//! - **Underload** (Σ demand fits): every region gets its demand plus headroom, and the spare
//!   stays with its owners: a borrower's excess is taken from lenders in proportion to their
//!   surplus, so nobody lends more than needed and an owner whose demand returns finds its
//!   share at home.
//! - **Contention**, by [`Mode`]: `proportional` splits in proportion to demand (what one
//!   central bucket does: every request sees the same admission probability) with a floor of
//!   a fraction of each escrow (at most the region's demand plus headroom); `max_min` is exact water-filling (protects small regions);
//!   `owner_first` gives each region up to its escrow first, then splits the spare in
//!   proportion to unmet demand (isolation up to E_i).
//! - **Pinned** regions (silent peers) get exactly their escrow: that is what they fall back
//!   to on their own, so planning around anything else would plan with budget that is not
//!   there.

use serde::{Deserialize, Serialize};

/// How a contended rate is split between regions (the policy's `mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// In proportion to demand, with a floor of a fraction of each escrow.
    Proportional,
    /// Exact water-filling: small regions first.
    #[serde(rename = "maxmin")]
    MaxMin,
    /// Each region up to its escrow first, then the spare by unmet demand.
    OwnerFirst,
}

impl Mode {
    /// Every mode, in declaration order.
    pub const ALL: [Mode; 3] = [Mode::Proportional, Mode::MaxMin, Mode::OwnerFirst];

    /// The config name.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Proportional => "proportional",
            Mode::MaxMin => "maxmin",
            Mode::OwnerFirst => "owner_first",
        }
    }
}

/// One region's view of a key, as the allocation needs it.
#[derive(Debug, Clone, Copy)]
pub struct Input<'a> {
    /// The global rate ρ, units per second.
    pub rho: f64,
    /// E_i per region.
    pub escrow: &'a [f64],
    /// Smoothed offered load per region, units per second.
    pub demand: &'a [f64],
    /// Regions to plan at exactly their escrow.
    pub pinned: &'a [bool],
    /// Proportional mode: fraction of its escrow a region always keeps.
    pub floor: f64,
    /// Underload: demand × (1 + headroom) is allocated when it fits.
    pub headroom: f64,
}

/// Target enforced rate per region. Σ targets ≤ ρ, each ≥ 0.
pub fn allocate(mode: Mode, inp: &Input) -> Vec<f64> {
    let n = inp.escrow.len();
    debug_assert!(inp.demand.len() == n && inp.pinned.len() == n);
    let mut target = vec![0.0; n];
    let mut budget = inp.rho;
    let mut free = Vec::with_capacity(n);
    for (i, t) in target.iter_mut().enumerate() {
        if inp.pinned[i] {
            *t = inp.escrow[i];
            budget -= inp.escrow[i];
        } else {
            free.push(i);
        }
    }
    let budget = budget.max(0.0);
    let demand = |i: usize| sanitize(inp.demand[i]);
    let total: f64 = free.iter().map(|&i| demand(i)).sum();

    if total <= budget {
        // Headroom as far as the spare allows, then spare back to owners.
        let spare = budget - total;
        let scale = if total > 0.0 {
            (spare / (total * inp.headroom)).min(1.0)
        } else {
            0.0
        };
        let want: Vec<f64> = (0..n)
            .map(|i| demand(i) * (1.0 + inp.headroom * scale.max(0.0)))
            .collect();
        underload(inp, &free, &want, &mut target);
    } else {
        match mode {
            Mode::Proportional => {
                // A floor protects a small region's demand from the big ones' shares; it
                // does not hold budget for demand that is not there (that would strand it:
                // 3% of ρ for a 60% region gone quiet, in the follow-the-sun scenario).
                let floors: Vec<f64> = free
                    .iter()
                    .map(|&i| (inp.floor * inp.escrow[i]).min(demand(i) * (1.0 + inp.headroom)))
                    .collect();
                let weights: Vec<f64> = free.iter().map(|&i| demand(i)).collect();
                let share = fill_proportional(budget, &weights, &floors);
                for (k, &i) in free.iter().enumerate() {
                    target[i] = share[k];
                }
            }
            Mode::MaxMin => {
                let caps: Vec<f64> = free.iter().map(|&i| demand(i)).collect();
                let share = water_fill(budget, &caps);
                for (k, &i) in free.iter().enumerate() {
                    target[i] = share[k];
                }
            }
            Mode::OwnerFirst => {
                let mut spare = budget;
                let mut unmet = Vec::with_capacity(free.len());
                for &i in &free {
                    target[i] = demand(i).min(inp.escrow[i]);
                    spare -= target[i];
                    unmet.push(demand(i) - target[i]);
                }
                let unmet_total: f64 = unmet.iter().sum();
                if spare > 0.0 && unmet_total > 0.0 {
                    for (k, &i) in free.iter().enumerate() {
                        target[i] += spare * unmet[k] / unmet_total;
                    }
                }
            }
        }
    }
    target
}

/// Underload split: borrowers (want above escrow) get their want, taken from lenders in
/// proportion to surplus; lenders keep the rest of their escrow (at least the floor).
fn underload(inp: &Input, free: &[usize], want: &[f64], target: &mut [f64]) {
    let mut need = 0.0;
    let mut surplus_total = 0.0;
    let mut surplus = vec![0.0; inp.escrow.len()];
    for &i in free {
        let e = inp.escrow[i];
        if want[i] > e {
            need += want[i] - e;
        } else {
            surplus[i] = (e - want[i].max(inp.floor * e)).max(0.0);
            surplus_total += surplus[i];
        }
    }
    // Floors can make the lenders' surplus smaller than the need: borrowers then share it.
    let given = need.min(surplus_total);
    for &i in free {
        let e = inp.escrow[i];
        target[i] = if want[i] > e {
            e + (want[i] - e) * ratio(given, need)
        } else {
            e - surplus[i] * ratio(given, surplus_total)
        };
    }
}

/// Proportional to `weights`, but never below `floors` (scaled down if the floors alone do
/// not fit). Water-filling over the floor constraint: at most n passes.
fn fill_proportional(budget: f64, weights: &[f64], floors: &[f64]) -> Vec<f64> {
    let n = weights.len();
    let floor_total: f64 = floors.iter().sum();
    if floor_total >= budget {
        return floors
            .iter()
            .map(|f| f * ratio(budget, floor_total))
            .collect();
    }
    let mut fixed = vec![false; n];
    let mut out = vec![0.0; n];
    loop {
        let left = budget - (0..n).filter(|&k| fixed[k]).map(|k| floors[k]).sum::<f64>();
        let w: f64 = (0..n).filter(|&k| !fixed[k]).map(|k| weights[k]).sum();
        let mut changed = false;
        for k in 0..n {
            if fixed[k] {
                out[k] = floors[k];
                continue;
            }
            out[k] = if w > 0.0 {
                left * weights[k] / w
            } else {
                left / (0..n).filter(|&k| !fixed[k]).count() as f64
            };
            if out[k] < floors[k] {
                fixed[k] = true;
                changed = true;
            }
        }
        if !changed {
            return out;
        }
    }
}

/// Max-min fair shares of `budget` among claims `caps` (each gets at most its cap; what a
/// small claimant leaves is shared by the rest).
fn water_fill(budget: f64, caps: &[f64]) -> Vec<f64> {
    let n = caps.len();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| caps[a].total_cmp(&caps[b]));
    let mut out = vec![0.0; n];
    let mut left = budget;
    for (pos, &k) in order.iter().enumerate() {
        let level = left / (n - pos) as f64;
        out[k] = caps[k].min(level);
        left -= out[k];
    }
    out
}

/// The loans that move the escrow split to `target`, to one borrower: `loans_to(..)[lender]`.
/// Each borrower's excess over its escrow is taken from the lenders in proportion to their
/// surplus, so every region that computes this from the same targets gets the same plan.
/// A region plans only what it borrows, so only its column of the lender × borrower plan
/// is computed (a key's plan is made for every exchange, with every region).
pub fn loans_to(escrow: &[f64], target: &[f64], borrower: usize) -> Vec<f64> {
    let n = escrow.len();
    let surplus = |i: usize| (escrow[i] - target[i]).max(0.0);
    let need = |i: usize| (target[i] - escrow[i]).max(0.0);
    let surplus_total: f64 = (0..n).map(surplus).sum();
    let need_total: f64 = (0..n).map(need).sum();
    if surplus_total <= 0.0 || need_total <= 0.0 {
        return vec![0.0; n];
    }
    // Never plan to move more than is spare (targets from a stale view may over-ask).
    let moved = need_total.min(surplus_total);
    let share = need(borrower) / need_total;
    (0..n)
        .map(|l| moved * (surplus(l) / surplus_total) * share)
        .collect()
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { (a / b).min(1.0) } else { 0.0 }
}

fn sanitize(x: f64) -> f64 {
    if x.is_finite() && x > 0.0 { x } else { 0.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The worked example of docs/global-budgets.md: 10,000/min split 60/30/10, demand 2k/20k/2k per min.
    fn example(mode: Mode) -> Vec<f64> {
        let escrow = [6000.0, 3000.0, 1000.0];
        let demand = [2000.0, 20000.0, 2000.0];
        allocate(
            mode,
            &Input {
                rho: 10000.0,
                escrow: &escrow,
                demand: &demand,
                pinned: &[false; 3],
                floor: 0.05,
                headroom: 0.1,
            },
        )
    }

    fn assert_close(got: &[f64], want: &[f64]) {
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1.0, "got {got:?}, want {want:?}");
        }
    }

    #[test]
    fn proportional_worked_example() {
        assert_close(&example(Mode::Proportional), &[833.3, 8333.3, 833.3]);
    }

    #[test]
    fn owner_first_worked_example() {
        assert_close(&example(Mode::OwnerFirst), &[2000.0, 6777.8, 1222.2]);
    }

    #[test]
    fn maxmin_worked_example() {
        assert_close(&example(Mode::MaxMin), &[2000.0, 6000.0, 2000.0]);
    }

    #[test]
    fn underload_keeps_spare_with_owners() {
        // ρ 100, escrow 60/30/10, demand 10/20/30: ap needs 30·1.1 − 10 = 23 from the others.
        let t = allocate(
            Mode::Proportional,
            &Input {
                rho: 100.0,
                escrow: &[60.0, 30.0, 10.0],
                demand: &[10.0, 20.0, 30.0],
                pinned: &[false; 3],
                floor: 0.05,
                headroom: 0.1,
            },
        );
        assert!((t[2] - 33.0).abs() < 1e-9, "{t:?}");
        // Surplus us 60 − 11 = 49, eu 30 − 22 = 8: the 23 comes 49:8 from them.
        assert!((t[0] - (60.0 - 23.0 * 49.0 / 57.0)).abs() < 1e-9, "{t:?}");
        assert!((t.iter().sum::<f64>() - 100.0).abs() < 1e-9);
    }

    #[test]
    fn pinned_regions_get_exactly_their_escrow() {
        let t = allocate(
            Mode::Proportional,
            &Input {
                rho: 100.0,
                escrow: &[60.0, 30.0, 10.0],
                demand: &[0.0, 500.0, 500.0],
                pinned: &[true, false, false],
                floor: 0.05,
                headroom: 0.1,
            },
        );
        assert_eq!(t[0], 60.0);
        assert!(
            (t[1] - 20.0).abs() < 1e-9 && (t[2] - 20.0).abs() < 1e-9,
            "{t:?}"
        );
    }

    /// Floors protect small demand from big regions' shares, up to that demand: a quiet
    /// region keeps nothing it would not use.
    #[test]
    fn floors_hold_under_contention_up_to_demand() {
        let t = allocate(
            Mode::Proportional,
            &Input {
                rho: 100.0,
                escrow: &[60.0, 30.0, 10.0],
                demand: &[1.0, 1000.0, 0.2],
                pinned: &[false; 3],
                floor: 0.05,
                headroom: 0.1,
            },
        );
        assert!(
            (t[0] - 1.1).abs() < 1e-9 && (t[2] - 0.22).abs() < 1e-9,
            "{t:?}"
        );
        assert!((t[1] - 98.68).abs() < 1e-9, "{t:?}");
        let quiet = allocate(
            Mode::Proportional,
            &Input {
                rho: 100.0,
                escrow: &[60.0, 30.0, 10.0],
                demand: &[0.0, 1000.0, 0.0],
                pinned: &[false; 3],
                floor: 0.05,
                headroom: 0.1,
            },
        );
        assert_eq!(quiet, vec![0.0, 100.0, 0.0]);
    }

    #[test]
    fn loans_realise_the_targets() {
        let escrow = [6000.0, 3000.0, 1000.0];
        let target = example(Mode::Proportional);
        let to: Vec<Vec<f64>> = (0..3).map(|b| loans_to(&escrow, &target, b)).collect();
        for i in 0..3 {
            let lent: f64 = (0..3).map(|b| to[b][i]).sum();
            let borrowed: f64 = to[i].iter().sum();
            assert!((escrow[i] - lent + borrowed - target[i]).abs() < 1e-6);
        }
    }

    proptest::proptest! {
        /// Whatever the (possibly garbage) view, targets are finite, non-negative and never
        /// sum above ρ, and loans never exceed a lender's escrow.
        #[test]
        fn targets_fit_the_budget(
            weights in proptest::collection::vec(0.01f64..10.0, 1..6),
            demand_seed in proptest::collection::vec(-10.0f64..1e6, 6),
            pinned_seed in proptest::collection::vec(proptest::bool::ANY, 6),
            mode_ix in 0usize..3,
        ) {
            let n = weights.len();
            let total: f64 = weights.iter().sum();
            let escrow: Vec<f64> = weights.iter().map(|w| 1000.0 * w / total).collect();
            let demand = &demand_seed[..n];
            let pinned = &pinned_seed[..n];
            let t = allocate(Mode::ALL[mode_ix], &Input {
                rho: 1000.0, escrow: &escrow, demand, pinned, floor: 0.05, headroom: 0.1,
            });
            proptest::prop_assert!(t.iter().all(|x| x.is_finite() && *x >= 0.0));
            proptest::prop_assert!(t.iter().sum::<f64>() <= 1000.0 * (1.0 + 1e-12));
            let to: Vec<Vec<f64>> = (0..n).map(|b| loans_to(&escrow, &t, b)).collect();
            for (i, e) in escrow.iter().enumerate() {
                let lent: f64 = (0..n).map(|b| to[b][i]).sum();
                proptest::prop_assert!(lent <= e * (1.0 + 1e-12));
            }
        }
    }
}
