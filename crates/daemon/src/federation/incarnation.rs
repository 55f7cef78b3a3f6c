//! A region's incarnation: the number its coordinator's messages carry, so that peers can
//! tell a new life of the region from a delayed message of an old one. Every takeover must
//! draw one above every incarnation a peer may have accepted from the region, and a peer
//! refuses one later than the message's signed timestamp plus `coordinator.max_skew` (A),
//! so that no value can wedge its "newer than" checks for good.
//!
//! The incarnation is therefore drawn from the clock messages are signed with, the
//! daemon's own wall clock, never Redis's: a Redis clock that jumped ahead cannot make the
//! region's messages "from the future" (the fencing token, which only the region's Redis
//! compares, still follows Redis's clock). The last one drawn is kept in the region's
//! Redis (`<prefix>:coordinator:incarnation`), so a takeover by another instance goes on
//! above it. The rule, [`next`]:
//!
//! - above the last one and not below the wall clock: `max(last + 1, wall)`;
//! - but never past `wall + 2A + 1`: a last value beyond that came from a clock that was
//!   ahead when it was drawn (a host whose clock jumped). No peer accepted it (a peer takes
//!   at most its sender's signing time + A, and a region's instances keep their clocks
//!   within A of each other), so the region starts again just above anything a peer may
//!   have accepted: `wall + 2A + 1`. Peers accept that within A of the takeover.
//!
//! A coordinator that took over while its host's clock was ahead keeps an incarnation from
//! the future once the clock is put right: [`from_the_future`] tells it to step down and
//! take over again (a restart to its peers), so the lock-out ends within A and a round of
//! the clock being right, instead of when real time catches up with the jump.

/// What a takeover drew.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Drawn {
    pub(crate) incarnation: u64,
    /// The last incarnation was from the future and this one is below it.
    pub(crate) rebased: bool,
}

/// The incarnation a takeover draws after `last` (the region's last, if it has one) at
/// wall-clock `wall_ms`, with peers allowing `max_skew_ms` of skew.
pub(crate) fn next(last: Option<u64>, wall_ms: u64, max_skew_ms: u64) -> Drawn {
    let ceiling = ceiling(wall_ms, max_skew_ms);
    let above = last.map_or(0, |l| l.saturating_add(1));
    let incarnation = above.max(wall_ms).min(ceiling).max(1);
    Drawn {
        incarnation,
        rebased: last.is_some_and(|l| incarnation <= l),
    }
}

/// The wall clock incarnations are drawn and judged by, in ms: the one exchanges are
/// signed with ([`super::auth::wall_ms`]), which is what peers compare them to.
pub fn now_ms() -> u64 {
    super::auth::wall_ms().max(0) as u64
}

/// Whether a coordinator with incarnation `incarnation` must take over again: at
/// wall-clock `wall_ms` it is past what any takeover now could draw (its host's clock went
/// back by more than the skew since it drew it), so peers would refuse it for as long.
pub(crate) fn from_the_future(incarnation: u64, wall_ms: u64, max_skew_ms: u64) -> bool {
    incarnation > ceiling(wall_ms, max_skew_ms)
}

/// Where [`next`] rebases to: above every incarnation a peer may have accepted from a
/// region whose instances' clocks agree within the skew.
fn ceiling(wall_ms: u64, max_skew_ms: u64) -> u64 {
    wall_ms
        .saturating_add(max_skew_ms.saturating_mul(2))
        .saturating_add(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: u64 = 30_000;
    const NOW: u64 = 1_800_000_000_000;

    /// The incarnation drawn, and whether it was a rebase.
    fn draw(last: Option<u64>, wall_ms: u64) -> (u64, bool) {
        let d = next(last, wall_ms, A);
        (d.incarnation, d.rebased)
    }

    #[test]
    fn a_takeover_goes_above_the_last_incarnation_and_the_wall_clock() {
        assert_eq!(draw(None, NOW), (NOW, false));
        assert_eq!(draw(Some(NOW - 5_000), NOW), (NOW, false));
        // Several takeovers within a millisecond still grow.
        assert_eq!(draw(Some(NOW), NOW), (NOW + 1, false));
        assert_eq!(draw(Some(NOW + 40_000), NOW), (NOW + 40_001, false));
    }

    #[test]
    fn a_last_incarnation_no_peer_can_have_accepted_is_left_behind() {
        // Drawn while a clock was an hour ahead: the region starts again within 2A + 1.
        assert_eq!(draw(Some(NOW + 3_600_000), NOW), (NOW + 2 * A + 1, true));
        assert_eq!(draw(Some(u64::MAX), NOW), (NOW + 2 * A + 1, true));
        // What a rebase draws is itself not from the future, and the next takeover,
        // a millisecond later, goes on above it.
        let (rebased, _) = draw(Some(NOW + 3_600_000), NOW);
        assert!(!from_the_future(rebased, NOW, A));
        assert_eq!(draw(Some(rebased), NOW + 1), (rebased + 1, false));
    }

    #[test]
    fn a_running_incarnation_is_from_the_future_only_past_the_ceiling() {
        assert!(!from_the_future(NOW, NOW, A));
        assert!(!from_the_future(NOW + 2 * A + 1, NOW, A));
        assert!(from_the_future(NOW + 2 * A + 2, NOW, A));
        assert!(from_the_future(NOW + 3_600_000, NOW, A));
    }
}
