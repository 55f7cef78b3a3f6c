//! The network between regions: base one-way delay (half the RTT), jitter, loss,
//! duplication, reordering and cuts (one-way, symmetric, flapping).
//!
//! Every decision draws from the run's network RNG in a fixed order, so a run is
//! reproducible from its seed; the load RNG is separate, so every mode of a scenario sees
//! identical offered load however many messages it sends.

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Exp, Pareto};
use serde::{Deserialize, Serialize};

/// Extra one-way delay on top of RTT/2.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Jitter {
    None,
    /// Exponential with this mean (µs).
    Exp {
        mean_us: f64,
    },
    /// Pareto with scale `scale_us` and shape `shape`, capped at `cap_us` (a slow WAN: the
    /// minimum is `scale_us`, with a heavy tail).
    Pareto {
        scale_us: f64,
        shape: f64,
        cap_us: f64,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NetModel {
    /// Round-trip times between regions, ms (symmetric; the diagonal is unused).
    pub rtt_ms: Vec<Vec<f64>>,
    pub jitter: Jitter,
    /// Probability that a message is lost.
    pub loss: f64,
    /// Probability that a message is delivered twice (with independent delays).
    pub dup: f64,
    /// Probability that a message is held back by up to one RTT (overtaken by later ones).
    pub reorder: f64,
}

/// A link that does not carry messages from `from` to `to` during `[start, end)` (real
/// µs). With `period`, the cut flaps: down for the first half of every period, up for the
/// second half.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cut {
    pub from: usize,
    pub to: usize,
    pub start: i64,
    pub end: i64,
    pub period: Option<i64>,
}

impl Cut {
    pub fn blocks(&self, from: usize, to: usize, t: i64) -> bool {
        if from != self.from || to != self.to || t < self.start || t >= self.end {
            return false;
        }
        match self.period {
            None => true,
            Some(p) => (t - self.start).rem_euclid(p) < p / 2,
        }
    }
}

pub struct Network {
    model: NetModel,
    cuts: Vec<Cut>,
    exp: Option<Exp<f64>>,
    pareto: Option<(Pareto<f64>, f64)>,
}

impl Network {
    pub fn new(model: NetModel, cuts: Vec<Cut>) -> Self {
        let exp = match model.jitter {
            Jitter::Exp { mean_us } if mean_us > 0.0 => Exp::new(1.0 / mean_us).ok(),
            _ => None,
        };
        let pareto = match model.jitter {
            Jitter::Pareto {
                scale_us,
                shape,
                cap_us,
            } => Pareto::new(scale_us, shape).ok().map(|d| (d, cap_us)),
            _ => None,
        };
        Network {
            model,
            cuts,
            exp,
            pareto,
        }
    }

    pub fn is_cut(&self, from: usize, to: usize, t: i64) -> bool {
        self.cuts.iter().any(|c| c.blocks(from, to, t))
    }

    /// Real times at which a message sent now from `from` to `to` arrives (none: lost or
    /// cut; two: duplicated).
    pub fn send(&self, from: usize, to: usize, now: i64, rng: &mut ChaCha8Rng) -> Vec<i64> {
        // Draw the same number of values whatever the outcome, so that one message's fate
        // does not shift the random stream of the next.
        let lost = rng.random::<f64>() < self.model.loss;
        let dup = rng.random::<f64>() < self.model.dup;
        let first = self.delay(from, to, rng);
        let second = self.delay(from, to, rng);
        if lost || self.is_cut(from, to, now) {
            return Vec::new();
        }
        let mut out = vec![now + first];
        if dup {
            out.push(now + second);
        }
        out
    }

    fn delay(&self, from: usize, to: usize, rng: &mut ChaCha8Rng) -> i64 {
        let rtt_us = self.model.rtt_ms[from][to] * 1000.0;
        let jitter = match (self.model.jitter, &self.exp, &self.pareto) {
            (Jitter::Exp { .. }, Some(d), _) => d.sample(rng),
            (Jitter::Pareto { .. }, _, Some((d, cap))) => d.sample(rng).min(*cap),
            _ => 0.0,
        };
        let held = if rng.random::<f64>() < self.model.reorder {
            rng.random::<f64>() * rtt_us
        } else {
            0.0
        };
        (rtt_us / 2.0 + jitter + held).round().max(1.0) as i64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn cuts_flap_and_one_way_cuts_block_one_direction() {
        let c = Cut {
            from: 0,
            to: 1,
            start: 100,
            end: 500,
            period: Some(100),
        };
        assert!(c.blocks(0, 1, 100) && c.blocks(0, 1, 149));
        assert!(!c.blocks(0, 1, 150) && c.blocks(0, 1, 200));
        assert!(!c.blocks(1, 0, 120) && !c.blocks(0, 1, 500));
        let net = Network::new(
            NetModel {
                rtt_ms: vec![vec![0.0, 80.0], vec![80.0, 0.0]],
                jitter: Jitter::None,
                loss: 0.0,
                dup: 0.0,
                reorder: 0.0,
            },
            vec![c],
        );
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        assert_eq!(net.send(1, 0, 120, &mut rng), vec![120 + 40_000]);
        assert!(net.send(0, 1, 120, &mut rng).is_empty());
    }
}
