//! Virtual time: one real (simulated) timeline shared by a run, and per region a local
//! clock that is offset from it, runs fast or slow by a drift, and can be stepped.
//!
//! The coordinator and the region's store read the same local clock (the daemon and its
//! Redis on one host), through [`quotad_core::clock::Clock`], exactly as the daemon reads the
//! system clock. Real time advances only when the engine pops an event, so a run is a pure
//! function of its seed.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use quotad_core::clock::Clock;

/// Real time of a run, in microseconds. The engine is the only writer.
#[derive(Debug, Clone, Default)]
pub struct RealTime(Arc<AtomicI64>);

impl RealTime {
    pub fn new(us: i64) -> Self {
        RealTime(Arc::new(AtomicI64::new(us)))
    }
    pub fn get(&self) -> i64 {
        self.0.load(Ordering::Relaxed)
    }
    pub fn set(&self, us: i64) {
        self.0.store(us, Ordering::Relaxed);
    }
}

/// A region's clock: `local = real + offset + drift·(real − origin)`.
///
/// Cloning shares the offset, so a step applied through one handle (the engine's) is seen
/// by the node and the store that hold the others.
#[derive(Debug, Clone)]
pub struct SimClock {
    real: RealTime,
    offset: Arc<AtomicI64>,
    /// Rate error, e.g. 1e-4 = 100 ppm fast.
    drift: f64,
    origin: i64,
}

impl SimClock {
    pub fn new(real: RealTime, offset_us: i64, drift: f64) -> Self {
        let origin = real.get();
        SimClock {
            real,
            offset: Arc::new(AtomicI64::new(offset_us)),
            drift,
            origin,
        }
    }

    /// The local reading at real time `t`.
    pub fn local_at(&self, t: i64) -> i64 {
        let skew = ((t - self.origin) as f64 * self.drift).round() as i64;
        t + self.offset.load(Ordering::Relaxed) + skew
    }

    /// The first real time at which this clock reads at least `local` (with the offset as
    /// it is now; a later step moves it, and the engine then checks again anyway).
    pub fn real_at(&self, local: i64) -> i64 {
        let off = self.offset.load(Ordering::Relaxed);
        let guess =
            self.origin + ((local - off - self.origin) as f64 / (1.0 + self.drift)).floor() as i64;
        let mut t = guess;
        while self.local_at(t - 1) >= local {
            t -= 1;
        }
        while self.local_at(t) < local {
            t += 1;
        }
        t
    }

    /// Moves the clock by `by_us` (negative: backwards) from now on.
    pub fn step(&self, by_us: i64) {
        self.offset.fetch_add(by_us, Ordering::Relaxed);
    }
}

impl Clock for SimClock {
    fn now_us(&self) -> i64 {
        self.local_at(self.real.get())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drift_offset_step_and_inverse() {
        let real = RealTime::new(1_000_000);
        let c = SimClock::new(real.clone(), -2_000_000, 1e-4);
        real.set(11_000_000);
        // 10 s of real time at +100 ppm: 1 ms ahead, and the -2 s offset.
        assert_eq!(c.now_us(), 11_000_000 - 2_000_000 + 1_000);
        for local in [c.now_us(), c.now_us() + 1, c.now_us() + 7_777_777] {
            let t = c.real_at(local);
            assert!(c.local_at(t) >= local && c.local_at(t - 1) < local);
        }
        let before = c.now_us();
        c.step(-1_000_000);
        assert_eq!(c.now_us(), before - 1_000_000);
    }
}
