//! Global budgets: the pure core of the multi-region coordinator.
//!
//! A global policy has one rate ρ for all regions. Each region owns a fixed escrow share
//! `E_i` (Σ E_i = ρ) and enforces `R_i = E_i − lent_i + borrowed_i`; unused share moves
//! between regions as *leases*, never as counts (see docs/global-budgets.md).
//! This module owns the arithmetic and the state machines, and nothing that does I/O:
//!
//! - [`demand`]: offered load from cumulative counters, smoothed (fast up, slow down), clamped.
//! - [`allocation`]: who should enforce how much, given demand (proportional with floors,
//!   max-min, owner-first), and the loans that realise it.
//! - [`bucket`]: what the region's store does with one key on every touch (the reference
//!   model of the Lua scripts).
//! - [`lease`]: the per-key lease book the region's store holds, and the enforced rate it
//!   implies at a given store time (the input of the token bucket).
//! - [`message`]: the exchange messages (serde types; they travel over HTTP in the daemon).
//! - [`node`]: one region's coordinator: rounds, link states, the lender and borrower rules.
//! - [`wire`]: the binary form of the messages (key numbers per peer, varints).
//!
//! Time comes from a [`crate::clock::Clock`] that the node owns; the store and the transport
//! are the caller's (the node returns messages and writes through [`node::LeaseStore`]). The
//! simulator (the `quotad-sim` crate) drives exactly this code with virtual clocks and a faulty
//! network, and checks the safety invariant after every event.

pub mod allocation;
pub mod bucket;
pub mod demand;
pub mod lease;
pub mod message;
pub mod node;
pub mod wire;

use serde::{Deserialize, Serialize};

pub use allocation::Mode;

/// A region's index in the policy's region list (sorted by name in the config layer), so
/// that every region numbers the others the same way and messages stay small.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RegionId(pub u16);

impl RegionId {
    /// The index into per-region vectors.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// Microseconds on some region's clock (the daemon's and its Redis's; see [`Params`]).
pub type LocalUs = i64;

/// Protocol timings and tuning. One set per deployment: every region must use the same
/// lease duration, drift bound and margin, because the safety argument compares them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Params {
    /// Interval between exchange rounds.
    pub round_us: i64,
    /// Lease duration D.
    pub lease_us: i64,
    /// Bound ε on the clock *rate* error of any region (1e-3 = 1 ms per second).
    pub epsilon: f64,
    /// Margin m the lender adds to its hold, covering backward clock steps up to m/2 and
    /// the time between reading the clock and the write landing.
    pub margin_us: i64,
    /// Rounds without a completed round trip before a peer is suspect (pinned, not lent to).
    pub suspect_rounds: u32,
    /// Smoothing of demand: weight of a one-round sample when it is above / below the
    /// estimate (a shorter sample weighs less, see `demand`). Tuned with the simulator
    /// (`quotad sim`): after a step the old owner's estimate must fall for its share to
    /// move. 0.7 / 0.3 took 8 s to settle in S2, 0.9 / 0.8 4.0 s; with sensing between
    /// rounds, 0.9 / 0.95 settles in 2.7 s (0.8: 3.5 s; 0.9: 3.0 s; 0.99, with every
    /// reading between rounds taken: 2.4 s, but S8's worst seed at 20% loss took 8.4 s).
    pub ewma_up: f64,
    /// The weight of a sample below the estimate (see `ewma_up`).
    pub ewma_down: f64,
    /// A sample moves the estimate by those weights in full only when its interval held
    /// at least this many arrivals, and in proportion below (0: always in full). Tuned
    /// with the simulator: with the weights in full, a key offered a few units a second
    /// per region moved its share on Poisson noise, and coordination admitted less than a
    /// static split (S18 at 1,000 keys: η 0.756 against 0.901; S17 at 10,000: 0.439
    /// against 0.818). At 10: 0.950 and 0.862; 5 and 20 gave 0.940-0.942 in S18.
    #[serde(default = "default_demand_events")]
    pub demand_events: f64,
    /// Demand is clamped to this multiple of ρ (retry storms must not swamp the split).
    pub demand_clamp: f64,
    /// In proportional mode a region always keeps this fraction of its escrow.
    pub floor: f64,
    /// In underload a region is allocated its demand × (1 + headroom). 0.3 absorbs the
    /// growth of demand between rounds: false rejections in S4 went from 0.77% at 0.1 to
    /// 0.2%; underload means the spare exists.
    pub headroom: f64,
    /// A borrower asks a lender for a new amount only when it differs from what it holds
    /// by more than this fraction of ρ, split over its lenders (renewals keep the old
    /// amount: fewer changes, fewer writes); see [`GlobalPolicy::lender_hysteresis`].
    pub hysteresis: f64,
    /// A key is hot in a region when its demand is at least this fraction of the region's
    /// escrow; keys cold everywhere and without loans are neither exchanged nor planned.
    pub hot_fraction: f64,
    /// Rounds a key stays in the exchange after it was last hot or mentioned by a peer.
    pub linger_rounds: u32,
    /// Keys one exchange (or reply) may list, summed over its policies. A region with more
    /// keys to report sends the most pressing ones (leases and news, then what peers asked
    /// about, then the hottest); the rest run on their escrow until there is room, which is
    /// safe. A receiver refuses a message over the bound before its coordinator sees it.
    #[serde(default = "default_max_exchange_keys")]
    pub max_exchange_keys: usize,
    /// Between rounds, demand is read again this often (0: only in rounds); a key whose
    /// demand moved beyond noise is planned again, and what changed goes to the peers
    /// concerned at once, in an early exchange, instead of at the next round. See
    /// [`node::Node::sense`]. With the simulator at ewma_down 0.8: S2 settled in 3.5 s at
    /// 250 ms against 4.0 s without.
    #[serde(default = "default_sense_us")]
    pub sense_us: i64,
    /// A sense takes a key's demand only when it moved by at least this fraction of ρ
    /// (and beyond Poisson noise), and then tells a peer when it moved by as much since
    /// the peer last heard it. At ewma_down 0.8, 0.05 settled S2 in 3.7 s, 0.02 in 3.5 s.
    #[serde(default = "default_sense_change")]
    pub sense_change: f64,
}

fn default_sense_us() -> i64 {
    Params::default().sense_us
}

fn default_sense_change() -> f64 {
    Params::default().sense_change
}

fn default_demand_events() -> f64 {
    Params::default().demand_events
}

fn default_max_exchange_keys() -> usize {
    Params::default().max_exchange_keys
}

/// Largest seq number or incarnation a message may carry: 2^53 (exact in a double, in
/// JSON and in Lua). No live region gets there (2^53 grants at a million per second take
/// 285 years); a value beyond is a bug or forgery and is refused, so it cannot wedge the
/// "newer than" checks against a peer.
pub const MAX_SEQ: u64 = 1 << 53;

impl Default for Params {
    fn default() -> Self {
        Params {
            round_us: 1_000_000,
            lease_us: 10_000_000,
            epsilon: 1e-3,
            margin_us: 100_000,
            suspect_rounds: 3,
            ewma_up: 0.9,
            ewma_down: 0.95,
            demand_events: 10.0,
            demand_clamp: 4.0,
            floor: 0.05,
            headroom: 0.3,
            hysteresis: 0.01,
            hot_fraction: 0.5,
            linger_rounds: 5,
            max_exchange_keys: 10_000,
            sense_us: 250_000,
            sense_change: 0.02,
        }
    }
}

impl Params {
    /// How long a lender holds a reservation after granting, by its own clock: D(1+ε)+m.
    pub fn lender_hold_us(&self) -> i64 {
        (self.lease_us as f64 * (1.0 + self.epsilon)).ceil() as i64 + self.margin_us
    }

    /// How long after `t_req` a borrower counts a grant, by its own clock: D(1−ε).
    pub fn borrower_valid_us(&self, lease_us: i64) -> i64 {
        (lease_us as f64 * (1.0 - self.epsilon)).floor() as i64
    }

    /// A store clock reading this far below the highest one seen is a backward step: the
    /// borrowed amounts are dropped (their validity would stretch by the step). Half the
    /// margin, because the lender's margin must cover the undetected part of a step.
    pub fn step_tolerance_us(&self) -> i64 {
        self.margin_us / 2
    }

    /// The time after which a cut-off region is back on exactly its escrow: every lease it
    /// holds or granted has expired on both sides (in real time, with drift at most ε).
    pub fn fallback_bound_us(&self) -> i64 {
        self.lender_hold_us()
    }

    /// Rejects timings under which the safety argument does not hold or rounds cannot work.
    pub fn validate(&self) -> Result<(), String> {
        if self.round_us <= 0 {
            return Err("round must be positive".into());
        }
        if self.lease_us <= self.round_us {
            return Err("lease must be longer than round".into());
        }
        if !(0.0..0.1).contains(&self.epsilon) {
            return Err("epsilon must be in [0, 0.1)".into());
        }
        if !(0..self.round_us).contains(&self.sense_us) {
            return Err("sense must be shorter than round (0: off)".into());
        }
        if self.sense_change.is_nan() || self.sense_change < 0.0 {
            return Err("sense_change must not be negative".into());
        }
        if self.margin_us < 0 {
            return Err("margin must not be negative".into());
        }
        for (name, v) in [
            ("ewma_up", self.ewma_up),
            ("ewma_down", self.ewma_down),
            ("floor", self.floor),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return Err(format!("{name} must be in [0, 1]"));
            }
        }
        if self.demand_clamp < 1.0
            || self.headroom < 0.0
            || self.hysteresis < 0.0
            || self.demand_events.is_nan()
            || self.demand_events < 0.0
        {
            return Err(
                "demand_clamp >= 1, headroom >= 0, hysteresis >= 0 and demand_events >= 0".into(),
            );
        }
        Ok(())
    }
}

/// A global policy as the coordinator sees it: rate, burst and the escrow split.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GlobalPolicy {
    /// The policy's name.
    pub name: String,
    /// Bumped on every change of `rho`, `burst` or `escrow`; see [`node`] for how a re-split
    /// is applied decrease-first.
    pub version: u64,
    /// The global rate ρ, units per second.
    pub rho: f64,
    /// The global bucket capacity B; a region's bucket holds at most B·R_i/ρ.
    pub burst: f64,
    /// E_i per region, units per second; sums to `rho`.
    pub escrow: Vec<f64>,
    /// How a contended rate is split.
    pub mode: Mode,
}

/// Region `i`'s escrow of a rate `rho` split by `weights` (0 past the last region).
pub fn escrow_share(rho: f64, weights: &[f64], i: usize) -> f64 {
    let total: f64 = weights.iter().sum();
    weights.get(i).map_or(0.0, |w| rho * w / total)
}

impl GlobalPolicy {
    /// Escrow from weights (`{us-east = 6, eu-west = 3, ap-south = 1}` in the config).
    pub fn from_weights(
        name: &str,
        version: u64,
        rho: f64,
        burst: f64,
        weights: &[f64],
        mode: Mode,
    ) -> Self {
        GlobalPolicy {
            name: name.to_owned(),
            version,
            rho,
            burst,
            escrow: (0..weights.len())
                .map(|i| escrow_share(rho, weights, i))
                .collect(),
            mode,
        }
    }

    /// The allocation targets for one key given each region's demand (`pinned` regions
    /// planned at exactly their escrow), with the tuning in `p`.
    pub fn allocate(&self, p: &Params, demand: &[f64], pinned: &[bool]) -> Vec<f64> {
        allocation::allocate(
            self.mode,
            &allocation::Input {
                rho: self.rho,
                escrow: &self.escrow,
                demand,
                pinned,
                floor: p.floor,
                headroom: p.headroom,
            },
        )
    }

    /// How far a loan from one lender may be from its plan before the borrower asks for
    /// the difference: the hysteresis's share of ρ, split over the `regions − 1` lenders
    /// so that a borrower's loans together stay within it (with nine lenders, a whole
    /// fraction each left 9% of ρ unasked for).
    pub fn lender_hysteresis(&self, p: &Params, regions: usize) -> f64 {
        p.hysteresis * self.rho / regions.saturating_sub(1).max(1) as f64
    }

    /// The bucket capacity that goes with an enforced rate.
    pub fn capacity_for(&self, rate: f64) -> f64 {
        if self.rho <= 0.0 {
            0.0
        } else {
            self.burst * rate / self.rho
        }
    }
}
