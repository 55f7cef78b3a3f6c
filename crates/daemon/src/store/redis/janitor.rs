//! The TTL janitor's judgement: what TTL a key found without one should get. Every key
//! quotad writes carries a TTL, set by the same script call that writes it; a key without
//! one was touched by something else (a PERSIST, a restore, an operator) and would stay
//! forever. [`repair_ttl_ms`] decides, from the key's name alone; [`sweep`] walks one
//! Redis node with SCAN (never KEYS) in small, paced steps and applies the repairs.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redis::aio::ConnectionLike;
use tokio_util::sync::CancellationToken;

use crate::layout::{KeyOwner, Layouts};
use crate::metrics::Metrics;
use crate::store::redis::connect::{SharedTarget, Target};

/// Bound on connecting to a node (and on each reply while connected).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Pause between SCAN steps: at most 10,000 keys a second, so a sweep never competes
/// with decisions for Redis.
pub(crate) const STEP_PAUSE: Duration = Duration::from_millis(10);

/// Keys per SCAN step: small enough that no step shows in SLOWLOG.
pub const SCAN_COUNT: usize = 100;

/// A key of a policy that is no longer configured: nothing will read it again, so it may
/// go soon; not at once, so a config rolled back within the minute finds its state.
pub const ORPHAN_TTL_MS: i64 = 60_000;

/// The TTL (ms) to give `key`, found without one; None to leave it as it is: keys that are
/// not quotad's, and the coordinator's, whose fencing counter must never expire.
pub(crate) fn repair_ttl_ms(layouts: &Layouts, key: &str) -> Option<i64> {
    match layouts.layout().owner_of(key) {
        KeyOwner::Foreign | KeyOwner::Coordinator | KeyOwner::RuntimeLimits => None,
        KeyOwner::Policy(name) => Some(
            layouts
                .by_name(name)
                .map_or(ORPHAN_TTL_MS, |l| l.repair_ttl_ms),
        ),
    }
}

/// What one pass over a node found and did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// quotad keys seen (under the prefix).
    pub scanned: u64,
    /// Of those, keys without a TTL that the janitor may repair.
    pub without_ttl: u64,
    /// TTLs set (a key may have gained one meanwhile, or gone: then nothing is set).
    pub repaired: u64,
}

/// The name the janitor gives its connection (`CLIENT SETNAME`), so its commands are
/// recognisable in `CLIENT LIST` and `SLOWLOG`.
pub const CLIENT_NAME: &str = "quotad-janitor";

/// One full SCAN of the node behind `conn` for `<prefix>:*`, `SCAN_COUNT` keys per step
/// and `pause` between steps; every key without a TTL gets [`repair_ttl_ms`] with
/// `PEXPIRE … NX`, so a TTL a script set in the meantime is never replaced. Names the
/// connection [`CLIENT_NAME`] first.
pub async fn sweep<C: ConnectionLike + Send>(
    conn: &mut C,
    layouts: &Layouts,
    pause: Duration,
) -> redis::RedisResult<SweepReport> {
    // Best effort: CLIENT may be renamed or disabled (managed Redis).
    let _: redis::RedisResult<()> = redis::cmd("CLIENT")
        .arg("SETNAME")
        .arg(CLIENT_NAME)
        .query_async(conn)
        .await;
    let pattern = format!("{}:*", layouts.layout().prefix());
    let mut report = SweepReport::default();
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(SCAN_COUNT)
            .query_async(conn)
            .await?;
        report.scanned += keys.len() as u64;
        repair(conn, layouts, &keys, &mut report).await?;
        if next == 0 {
            return Ok(report);
        }
        cursor = next;
        tokio::time::sleep(pause).await;
    }
}

/// PTTL for a step's keys in one pipeline, then PEXPIRE NX for those without a TTL. A step
/// may find none of quotad's keys (a Redis shared with other applications, or a SCAN step
/// that visits empty buckets): nothing to send, and an empty pipeline is an error to the
/// client library.
async fn repair<C: ConnectionLike + Send>(
    conn: &mut C,
    layouts: &Layouts,
    keys: &[String],
    report: &mut SweepReport,
) -> redis::RedisResult<()> {
    if keys.is_empty() {
        return Ok(());
    }
    let mut pttl = redis::pipe();
    for k in keys {
        pttl.cmd("PTTL").arg(k);
    }
    let ttls: Vec<i64> = pttl.query_async(conn).await?;
    let mut expire = redis::pipe();
    let mut n = 0;
    for (k, ttl) in keys.iter().zip(ttls) {
        let Some(ms) = (ttl == -1).then(|| repair_ttl_ms(layouts, k)).flatten() else {
            continue;
        };
        expire.cmd("PEXPIRE").arg(k).arg(ms).arg("NX");
        n += 1;
    }
    report.without_ttl += n;
    if n > 0 {
        let set: Vec<i64> = expire.query_async(conn).await?;
        report.repaired += set.iter().filter(|s| **s == 1).count() as u64;
    }
    Ok(())
}

/// The region's janitor, run by every instance against the region's Redis: each
/// interval, the instance that takes the interval's claim (`SET NX PX interval` on
/// [`Layout::janitor_key`](crate::layout::Layout::janitor_key)) sweeps, and the
/// others skip it; one that dies mid-sweep leaves the next interval to whoever claims it.
/// Errors are logged and retried the next interval: a janitor never stops the daemon.
///
/// `layouts` lays out the config in force and is asked again before each sweep: a reload
/// may add a policy or lengthen a window since the start, and a key repaired with the
/// start-up layouts would get the orphan's minute or the old, shorter window's TTL, and
/// expire while its policy still counts on it.
pub(crate) async fn run(
    target: SharedTarget,
    layouts: impl Fn() -> Layouts + Send + 'static,
    interval: Duration,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
) {
    let me = format!("{:016x}", rand::random::<u64>());
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        let in_force = layouts();
        // The target in force now: credentials rotated live reach the next sweep.
        let current = target.get();
        let swept = tokio::select! {
            _ = stop.cancelled() => return,
            r = claim_and_sweep(&current, &in_force, interval, &me) => r,
        };
        let result = match &swept {
            Ok(None) => "skipped",
            Ok(Some(_)) => "swept",
            Err(_) => "failed",
        };
        metrics.janitor_sweeps.with_label_values(&[result]).inc();
        match swept {
            Ok(None) => {}
            Ok(Some(report)) => {
                metrics.keys_without_ttl.set(report.without_ttl as i64);
                metrics.janitor_repaired.inc_by(report.repaired);
                let now = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or_default();
                metrics.janitor_last_scan.set(now.as_secs() as i64);
                if report.repaired > 0 {
                    tracing::warn!(
                        scanned = report.scanned,
                        repaired = report.repaired,
                        "janitor: quotad keys without a TTL got one back"
                    );
                }
            }
            Err(e) => tracing::warn!(error = %e, "janitor: sweep failed; retrying next interval"),
        }
    }
}

/// Sweeps every master if this instance wins this interval's claim; `None` when another
/// did. Masters are swept one after the other, so the load stays that of one sweep.
async fn claim_and_sweep(
    target: &Target,
    layouts: &Layouts,
    interval: Duration,
    me: &str,
) -> redis::RedisResult<Option<SweepReport>> {
    let mut conn = target.connect(CONNECT_TIMEOUT, CONNECT_TIMEOUT).await?;
    let claimed: Option<String> = redis::cmd("SET")
        .arg(layouts.layout().janitor_key())
        .arg(me)
        .arg("NX")
        .arg("PX")
        .arg(interval.as_millis() as u64)
        .query_async(&mut conn)
        .await?;
    if claimed.is_none() {
        return Ok(None);
    }
    let mut total = SweepReport::default();
    // The same bounds as the claim's connection (the crate's default reply bound is
    // 500 ms, which a loaded machine's Redis can pass on a pipeline of 100 PTTLs).
    let node_config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_response_timeout(Some(CONNECT_TIMEOUT));
    for master in target.masters(CONNECT_TIMEOUT).await? {
        let mut node = master
            .get_multiplexed_async_connection_with_config(&node_config)
            .await?;
        let r = sweep(&mut node, layouts, STEP_PAUSE).await?;
        total.scanned += r.scanned;
        total.without_ttl += r.without_ttl;
        total.repaired += r.repaired;
    }
    Ok(Some(total))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{GLOBAL_KEEP_MS, Layout, RegionPlace};
    use crate::policy::{FailMode, GlobalSpec, Policy, PolicySpec};
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
        assert_eq!(
            repair_ttl_ms(&l, "rl:g:g:{rl:g}:{alice}"),
            Some(GLOBAL_KEEP_MS)
        );
        assert_eq!(
            repair_ttl_ms(&l, "rl:g:g:{rl:g}:active"),
            Some(GLOBAL_KEEP_MS)
        );
    }

    /// A key of a calendar period lives until its period's end: a repair never gives it
    /// less than the longest period of its kind (a 31-day month with a clock change).
    #[test]
    fn a_calendar_periods_key_is_repaired_to_outlive_its_longest_period() {
        use quotad_core::calendar::{Calendar, Period};
        let mut p = policy("plan", Algorithm::FixedWindow, 1000, 1, None, false);
        p.window = Duration::from_micros(Period::Month.nominal_us() as u64);
        let month = Calendar::new(Period::Month, "Europe/Berlin").unwrap();
        p.calendar = Some(std::sync::Arc::new(crate::policy::CalendarWindow::new(
            month,
        )));
        let l = Layouts::new(Layout::new("rl"), [&p], None);
        let longest_ms = (31 * 24 + 1) * 3_600_000;
        assert_eq!(
            repair_ttl_ms(&l, "rl:plan:fw:{acme}"),
            Some(longest_ms + 1000)
        );
    }

    /// A policy's runtime limits are the operator's data: never given a TTL.
    #[test]
    fn runtime_limits_are_never_expired() {
        let l = layouts();
        for k in ["h", "v", "x", "d"] {
            let key = format!("rl:sw:limits:{{sw}}:{k}");
            assert_eq!(repair_ttl_ms(&l, &key), None, "{key}");
        }
        let keys = l.layout().runtime_limit_keys("sw", 0, false);
        assert_eq!(keys.entries, "rl:sw:limits:{sw}:h");
        assert_eq!(
            repair_ttl_ms(&l, "rl:sw:sw:{limits:x}"),
            Some(120_000 + 1000)
        );
    }

    /// A policy that takes settlements: its keys may be in debt for up to a year of
    /// refill, and its reservations wait `settle_within`; a repaired TTL forgives neither.
    #[test]
    fn a_settling_policys_keys_and_reservations_keep_their_debt_and_wait() {
        let mut p = policy("llm", Algorithm::TokenBucket, 10, 1, Some(50), false);
        p.settle_within = Some(Duration::from_secs(600));
        let l = Layouts::new(Layout::new("rl"), [&p], None);
        let year_ms = crate::policy::MAX_WINDOW.as_millis() as i64;
        assert_eq!(repair_ttl_ms(&l, "rl:llm:tb:{alice}"), Some(year_ms + 1000));
        let reservation = format!("rl:llm:tb:{{alice}}:r:{}", "0".repeat(32));
        assert_eq!(repair_ttl_ms(&l, &reservation), Some(year_ms + 1000));
    }

    /// A concurrency limit's key lives until its latest lease ends: at most a lease.
    #[test]
    fn a_concurrency_limits_key_gets_its_lease_plus_grace() {
        let c = crate::policy::ConcurrencyPolicy {
            name: "jobs".into(),
            limit: std::num::NonZeroU64::new(5).unwrap(),
            lease: Duration::from_secs(30),
            on_store_error: FailMode::Open,
        };
        let l = Layouts::new(Layout::new("rl"), [], None).with_concurrency([&c]);
        assert_eq!(repair_ttl_ms(&l, "rl:jobs:cc:{alice}"), Some(30_000 + 1000));
    }

    #[test]
    fn orphans_go_soon_and_the_coordinator_and_strangers_are_left_alone() {
        let l = layouts();
        assert_eq!(repair_ttl_ms(&l, "rl:gone:fw:{alice}"), Some(ORPHAN_TTL_MS));
        assert_eq!(repair_ttl_ms(&l, &l.layout().fence_key()), None);
        assert_eq!(
            repair_ttl_ms(&l, "rl:g:g:{rl:g}:fence"),
            None,
            "a policy's fence"
        );
        assert_eq!(repair_ttl_ms(&l, "session:42"), None);
        assert_eq!(repair_ttl_ms(&l, "rlx:tb:tb:{a}"), None, "another prefix");
        assert_eq!(repair_ttl_ms(&l, "rl"), None);
    }
}
