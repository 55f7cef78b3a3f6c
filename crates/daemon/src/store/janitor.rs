//! The TTL janitor's judgement: what TTL a key found without one should get. Every key
//! quotad writes carries a TTL, set by the same script call that writes it; a key without
//! one was touched by something else (a PERSIST, a restore, an operator) and would stay
//! forever. The scan that finds such keys and applies the repair is the region's janitor
//! task; this module is the part that decides, and it decides from the key's name alone.

use crate::store::layout::{KeyOwner, Layouts};

/// A key of a policy that is no longer configured: nothing will read it again, so it may
/// go soon; not at once, so a config rolled back within the minute finds its state.
pub const ORPHAN_TTL_MS: i64 = 60_000;

/// The TTL (ms) to give `key`, found without one; None to leave it as it is: keys that are
/// not quotad's, and the coordinator's, whose fencing counter must never expire.
pub fn repair_ttl_ms(layouts: &Layouts, key: &str) -> Option<i64> {
    match layouts.layout().owner_of(key) {
        KeyOwner::Foreign | KeyOwner::Coordinator => None,
        KeyOwner::Policy(name) => Some(
            layouts
                .by_name(name)
                .map_or(ORPHAN_TTL_MS, |l| l.repair_ttl_ms),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{FailMode, GlobalSpec, Policy, PolicySpec};
    use crate::store::layout::{GLOBAL_KEEP_MS, Layout, RegionPlace};
    use quotad_core::algorithm::Algorithm;
    use quotad_core::coordinator::{Mode, RegionId};
    use std::time::Duration;

    fn policy(
        name: &str,
        algorithm: Algorithm,
        limit: u64,
        window_s: u64,
        burst: Option<u64>,
        global: bool,
    ) -> Policy {
        Policy::new(PolicySpec {
            name,
            algorithm,
            limit,
            window: Duration::from_secs(window_s),
            burst,
            on_store_error: FailMode::Open,
            shadow: false,
            global: global.then(|| GlobalSpec {
                version: 1,
                weights: vec![1.0, 1.0],
                mode: Mode::Proportional,
            }),
        })
        .expect("a valid policy")
    }

    fn layouts() -> Layouts {
        let policies = [
            policy("sw", Algorithm::SlidingWindow, 10, 60, None, false),
            policy("tb", Algorithm::TokenBucket, 10, 1, Some(50), false),
            policy("g", Algorithm::Gcra, 100, 1, None, true),
        ];
        let place = RegionPlace {
            me: RegionId(0),
            step_tolerance_us: 0,
        };
        Layouts::new(Layout::new("rl"), &policies, Some(&place))
    }

    #[test]
    fn a_key_gets_the_longest_ttl_its_policy_writes_plus_grace() {
        let l = layouts();
        // Two windows for the sliding counter; a whole burst's refill for the bucket.
        assert_eq!(repair_ttl_ms(&l, "rl:sw:sw:{alice}"), Some(120_000 + 1000));
        assert_eq!(repair_ttl_ms(&l, "rl:tb:tb:{alice}"), Some(5_000 + 1000));
        assert_eq!(repair_ttl_ms(&l, "rl:g:g:{alice}"), Some(GLOBAL_KEEP_MS));
        assert_eq!(repair_ttl_ms(&l, "rl:g:g:active"), Some(GLOBAL_KEEP_MS));
    }

    #[test]
    fn orphans_go_soon_and_the_coordinator_and_strangers_are_left_alone() {
        let l = layouts();
        assert_eq!(repair_ttl_ms(&l, "rl:gone:fw:{alice}"), Some(ORPHAN_TTL_MS));
        assert_eq!(repair_ttl_ms(&l, &l.layout().fence_key()), None);
        assert_eq!(repair_ttl_ms(&l, &l.layout().replid_key()), None);
        assert_eq!(repair_ttl_ms(&l, "session:42"), None);
        assert_eq!(repair_ttl_ms(&l, "rlx:tb:tb:{a}"), None, "another prefix");
        assert_eq!(repair_ttl_ms(&l, "rl"), None);
    }
}
