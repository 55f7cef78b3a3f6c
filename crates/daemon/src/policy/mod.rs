//! Compiled policies: what the limiter enforces, in types that cannot be built invalid.
//!
//! Policies are built only by [`crate::config`] after validation ([`Policy::new`] re-checks
//! the invariants it relies on), then shared read-only as a [`Policies`] snapshot. They
//! are domain values: where their state lives in Redis is the store's business
//! ([`crate::layout`]).

use std::collections::BTreeMap;
use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use quotad_core::algorithm::{Algorithm, Limits, Since};
use quotad_core::calendar::{Calendar, Periods};

use crate::runtime_limits::{RuntimeLimits, Slot};
use quotad_core::coordinator::{GlobalPolicy, Mode};

/// What a policy does when its store cannot answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum FailMode {
    /// Allow, unenforced (outcome `fail_open`): availability over strictness.
    Open,
    /// Deny (outcome `fail_closed`): for login attempts and expensive operations.
    Closed,
    /// Decide with the embedded in-process limiter (outcome `local`): enforced per daemon.
    Local,
}

impl FailMode {
    pub(crate) fn name(self) -> &'static str {
        match self {
            FailMode::Open => "open",
            FailMode::Closed => "closed",
            FailMode::Local => "local",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    pub name: String,
    pub algorithm: Algorithm,
    pub(crate) limit: NonZeroU64,
    pub(crate) window: Duration,
    pub burst: NonZeroU64,
    pub(crate) on_store_error: FailMode,
    pub(crate) shadow: bool,
    /// A global budget: `limit` per `window` is the rate ρ for all regions together.
    pub global: Option<GlobalSpec>,
    /// Checks per second of one key on one instance from which the key takes slices of
    /// its quota and is admitted from them in memory (`store::redis::hot`); fixed windows, token
    /// buckets and GCRA only (`store::redis::hot::Taker`).
    pub(crate) hot_key_rate: Option<NonZeroU64>,
    /// Checks of this policy may reserve an estimated cost, settled at the real one
    /// within this long (`quotad_core::settlement`); `None`: no reservations. Token
    /// buckets, GCRA and fixed windows of local policies only (config validation).
    pub(crate) settle_within: Option<Duration>,
    /// When its numbers came into force on this instance (`policy.version`, then the
    /// instant): how a key's state written under other numbers is read
    /// (`quotad_core::algorithm::frame`). Set by the daemon when a config is put in
    /// force (`reload::stamp_since`); `Since::ZERO` as parsed, and for global policies.
    pub(crate) since: Since,
    /// Where these numbers come from: the policy's own, or a `[[policy.override]]`.
    pub(crate) limit_from: LimitSource,
    /// A fixed window of calendar periods (`window = "month"`, `time_zone`): `window` is
    /// then the period's nominal length, the fixed window it is in period time
    /// (`quotad_core::calendar::Periods`).
    pub(crate) calendar: Option<Arc<CalendarWindow>>,
    /// Keys may have their own limit, set at runtime (`[policy.runtime_limits]`,
    /// `crate::runtime_limits`); `None`: refused.
    pub(crate) runtime: Option<RuntimeSpec>,
}

/// What a policy allows of runtime limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RuntimeSpec {
    /// How many keys may have their own limit at once.
    pub(crate) max_keys: u64,
    /// The largest limit (and burst) one may be given.
    pub(crate) max_limit: u64,
}

/// The most keys a policy's runtime limits may hold, and the default of `max_limit`.
pub(crate) const MAX_RUNTIME_KEYS: u64 = 10_000_000;

/// A policy's calendar, with the periods around now that its calls carry (derived from
/// the calendar and the clock: rebuilt when the clock leaves the current period).
#[derive(Debug)]
pub(crate) struct CalendarWindow {
    calendar: Calendar,
    around: std::sync::Mutex<Option<Periods>>,
}

impl PartialEq for CalendarWindow {
    fn eq(&self, other: &Self) -> bool {
        self.calendar == other.calendar
    }
}

impl CalendarWindow {
    pub(crate) fn new(calendar: Calendar) -> CalendarWindow {
        CalendarWindow {
            calendar,
            around: std::sync::Mutex::new(None),
        }
    }

    pub(crate) fn calendar(&self) -> &Calendar {
        &self.calendar
    }

    /// The periods around `now_us` (this instance's clock).
    pub(crate) fn periods(&self, now_us: i64) -> Periods {
        let mut around = self.around.lock().unwrap_or_else(|p| p.into_inner());
        match *around {
            Some(p) if p.current_at(now_us) => p,
            _ => {
                let p = self.calendar.periods(now_us);
                *around = Some(p);
                p
            }
        }
    }
}

/// Where a key's limit comes from, as every decision reports it (`limit_source`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LimitSource {
    /// The policy's own numbers in the config.
    Config,
    /// A `[[policy.override]]` of the config that names the key (exactly, by prefix or glob).
    Override,
    /// The key's own limit, set at runtime (`crate::runtime_limits`).
    Runtime,
}

impl LimitSource {
    /// The API's name of it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            LimitSource::Config => "config",
            LimitSource::Override => "override",
            LimitSource::Runtime => "runtime",
        }
    }
}

/// A concurrency limit (`algorithm = "concurrency"`): at most `limit` units of a key held
/// at once, each lease ending at most `lease` after it was acquired or last extended,
/// by the store's clock (`quotad_core::concurrency`). A local policy of its own kind:
/// it is acquired and released (`/v1/acquire`, `/v1/release`, `/v1/extend`), never
/// checked, and has no burst, overrides, global budget, hot keys or settlement.
#[derive(Debug, Clone, PartialEq)]
pub struct ConcurrencyPolicy {
    pub name: String,
    pub(crate) limit: NonZeroU64,
    /// The longest a lease lasts without an extend (the policy's `window`), and the hold
    /// of an acquire or extend that names none.
    pub(crate) lease: Duration,
    pub(crate) on_store_error: FailMode,
}

/// Units a concurrency limit may hold at once: one sorted-set entry each.
pub(crate) const MAX_CONCURRENCY: u64 = 10_000;
/// The shortest and longest lease of a concurrency limit.
pub(crate) const MIN_LEASE: Duration = Duration::from_millis(100);
pub(crate) const MAX_LEASE: Duration = Duration::from_secs(86_400);

/// How a global policy splits its budget (validated by the config layer).
#[derive(Debug, Clone, PartialEq)]
pub struct GlobalSpec {
    /// Bumped by the operator on every re-split; see `coordinator::node`.
    pub version: u64,
    /// Escrow weights, by region index (regions sorted by name).
    pub(crate) weights: Vec<f64>,
    pub(crate) mode: Mode,
}

/// Smallest window: the scripts' clock resolution is 1 us, but windows below 1 ms make no
/// sense for a network service and would make TTLs round to nothing.
pub(crate) const MIN_WINDOW: Duration = Duration::from_millis(1);
/// Largest window: keeps every microsecond product far inside a double's exact range.
pub(crate) const MAX_WINDOW: Duration = Duration::from_secs(31_557_600); // humantime's "1year"
pub(crate) const MAX_LIMIT: u64 = 1_000_000_000;
/// The shortest and longest time a reservation may wait for its settlement
/// (`settle_within`): a request's work, from a second to a day.
pub(crate) const MIN_SETTLE_WITHIN: Duration = Duration::from_secs(1);
pub(crate) const MAX_SETTLE_WITHIN: Duration = Duration::from_secs(86_400);
/// See `config::MAX_SLIDING_LOG_LIMIT`.
pub(crate) const MAX_SLIDING_LOG_LIMIT: u64 = 10_000;

/// The limits on rates that keep the scripts' double arithmetic exact (microsecond
/// timestamps are about 2^51, so a double resolves about 0.25 us there):
/// - GCRA's emission interval `window / limit` must be at least 1 us, or the theoretical
///   arrival time cannot advance and the limit never bites (rates above 1,000,000/s);
/// - for token_bucket and gcra, refilling the whole burst (`burst * window / limit`) must
///   take at most [`MAX_WINDOW`], so every TTL stays far inside the exact range;
/// - a sliding log holds at most [`MAX_SLIDING_LOG_LIMIT`] entries.
pub(crate) fn check_rates(
    algorithm: Algorithm,
    limit: u64,
    window: Duration,
    burst: u64,
) -> Result<(), RateError> {
    let window_us = window.as_micros();
    match algorithm {
        Algorithm::Gcra if window_us < limit as u128 => {
            return Err(RateError::GcraTooFast { limit, window });
        }
        Algorithm::SlidingLog if limit > MAX_SLIDING_LOG_LIMIT => {
            return Err(RateError::SlidingLogTooLong);
        }
        _ => {}
    }
    if algorithm.has_burst() && burst as u128 * window_us / limit as u128 > MAX_WINDOW.as_micros() {
        return Err(RateError::RefillTooSlow {
            burst,
            limit,
            window,
        });
    }
    Ok(())
}

/// Why numbers are outside what [`check_rates`] lets a policy take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum RateError {
    #[error(
        "gcra needs window / limit of at least 1us (at most 1000000 per second); {limit} per {} is faster",
        humantime::format_duration(*window)
    )]
    GcraTooFast { limit: u64, window: Duration },
    #[error("sliding_log allows at most {MAX_SLIDING_LOG_LIMIT} per window")]
    SlidingLogTooLong,
    #[error(
        "refilling burst {burst} at {limit} per {} takes longer than a year",
        humantime::format_duration(*window)
    )]
    RefillTooSlow {
        burst: u64,
        limit: u64,
        window: Duration,
    },
}

/// What a config entry asks for; [`Policy::new`] checks it.
#[derive(Debug, Clone)]
pub(crate) struct PolicySpec<'a> {
    pub(crate) name: &'a str,
    pub(crate) algorithm: Algorithm,
    pub(crate) limit: u64,
    pub(crate) window: Duration,
    /// Capacity for token_bucket / gcra; `None` means `limit`.
    pub(crate) burst: Option<u64>,
    pub(crate) on_store_error: FailMode,
    pub(crate) shadow: bool,
    pub(crate) global: Option<GlobalSpec>,
}

impl Policy {
    /// Builds a policy; `None` if an invariant fails (config validation reports why first).
    pub(crate) fn new(spec: PolicySpec<'_>) -> Option<Policy> {
        let PolicySpec {
            name,
            algorithm,
            limit,
            window,
            burst,
            on_store_error,
            shadow,
            global,
        } = spec;
        let limit = NonZeroU64::new(limit).filter(|l| l.get() <= MAX_LIMIT)?;
        let burst = match (algorithm.has_burst(), burst) {
            (true, Some(b)) => NonZeroU64::new(b).filter(|b| b.get() <= MAX_LIMIT)?,
            (_, None) => limit,
            (false, Some(_)) => return None,
        };
        if !(MIN_WINDOW..=MAX_WINDOW).contains(&window)
            || !valid_name(name)
            || check_rates(algorithm, limit.get(), window, burst.get()).is_err()
        {
            return None;
        }
        Some(Policy {
            name: name.to_owned(),
            algorithm,
            limit,
            window,
            burst,
            on_store_error,
            shadow,
            global,
            hot_key_rate: None,
            settle_within: None,
            since: Since::ZERO,
            limit_from: LimitSource::Config,
            calendar: None,
            runtime: None,
        })
    }

    /// The rate as units per second (a global policy's ρ).
    pub(crate) fn rate_per_second(&self) -> f64 {
        self.limit.get() as f64 / self.window.as_secs_f64()
    }

    /// A global policy's key under its own numbers (a runtime limit): its rate and burst,
    /// which its regional bucket scales the region's share by; `None` under the config's.
    pub(crate) fn key_limit(&self) -> Option<quotad_core::coordinator::bucket::KeyLimit> {
        (self.global.is_some() && self.limit_from == LimitSource::Runtime).then(|| {
            quotad_core::coordinator::bucket::KeyLimit {
                rate: self.rate_per_second(),
                burst: self.burst.get() as f64,
            }
        })
    }

    /// The coordinator's view of a global policy.
    pub(crate) fn global_policy(&self) -> Option<GlobalPolicy> {
        let g = self.global.as_ref()?;
        Some(GlobalPolicy::from_weights(
            &self.name,
            g.version,
            self.rate_per_second(),
            self.burst.get() as f64,
            &g.weights,
            g.mode,
        ))
    }

    pub fn limits(&self) -> Limits {
        Limits {
            limit: self.limit.get(),
            window_us: self.window.as_micros() as i64,
            burst: self.burst.get(),
            since: self.since,
        }
    }

    /// The policy with `limit` and `burst` instead of its own (burst 0, or an algorithm
    /// without one: the limit), when its window allows them (`check_rates`); `false`, and
    /// unchanged, otherwise.
    pub(crate) fn set_numbers(&mut self, limit: u64, burst: u64) -> bool {
        let burst = if burst == 0 || !self.algorithm.has_burst() {
            limit
        } else {
            burst
        };
        let (Some(l), Some(b)) = (NonZeroU64::new(limit), NonZeroU64::new(burst)) else {
            return false;
        };
        if l.get() > MAX_LIMIT
            || b.get() > MAX_LIMIT
            || check_rates(self.algorithm, l.get(), self.window, b.get()).is_err()
        {
            return false;
        }
        (self.limit, self.burst) = (l, b);
        true
    }

    /// The periods around now of a calendar window, which its calls carry (`None`: any
    /// other window).
    pub(crate) fn periods(&self) -> Option<Periods> {
        let c = self.calendar.as_ref()?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as i64);
        Some(c.periods(now))
    }

    /// The largest cost a single request may ask for.
    pub(crate) fn capacity(&self) -> u64 {
        self.limits().capacity(self.algorithm)
    }

    /// The largest real cost a settlement (or a charge) may carry: what the policy
    /// refills in [`MAX_WINDOW`], so a debt is paid within a year and every time the
    /// scripts compute from it stays inside a double's exact range. Never below the
    /// capacity.
    pub(crate) fn max_settle_cost(&self) -> u64 {
        let per_year =
            u128::from(self.limit.get()) * MAX_WINDOW.as_micros() / self.window.as_micros().max(1);
        u64::try_from(per_year)
            .unwrap_or(u64::MAX)
            .max(self.capacity())
    }

    /// The time over which the capacity (the quota `remaining` counts against) is
    /// allocated, in whole seconds, when it is a whole, non-zero number of them: the window
    /// for the window algorithms; for token_bucket and gcra the time to refill the whole
    /// burst, `burst * window / limit`, so that capacity / this is the sustained rate. `None`
    /// otherwise (a sub-second window, 2.5 s): the RateLimit-Policy `w` is an integer number
    /// of seconds, and a rounded one would advertise another rate than the one enforced.
    pub(crate) fn quota_window_secs(&self) -> Option<u64> {
        if self.calendar.is_some() {
            // A month is not a number of seconds.
            return None;
        }
        // For the window algorithms burst == limit, so one formula serves all five.
        let num = self.window.as_nanos() * u128::from(self.capacity());
        let den = u128::from(self.limit.get()) * 1_000_000_000;
        (num % den == 0 && num > 0)
            .then(|| u64::try_from(num / den).ok())
            .flatten()
    }
}

/// Policy names: 1-64 of `[A-Za-z0-9_.-]` (they appear in keys, metrics labels and URLs).
pub(crate) fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

/// Key prefixes follow the same rule as names.
pub(crate) fn valid_prefix(prefix: &str) -> bool {
    valid_name(prefix)
}

/// The loaded policies, by name. Shared read-only; a reload would swap the whole snapshot.
#[derive(Debug, Clone, Default)]
pub(crate) struct Policies {
    by_name: BTreeMap<String, Arc<Policy>>,
    /// Per-key overrides, by policy name, in config order.
    overrides: BTreeMap<String, Vec<Override>>,
    /// The exact-key overrides, by (policy, key): a check finds its own in O(1), however
    /// many a policy has; only prefixes and globs are scanned.
    exact: BTreeMap<String, std::collections::HashMap<String, Arc<Policy>>>,
    /// The prefix and glob overrides, by policy name, in config order.
    patterns: BTreeMap<String, Vec<Override>>,
    /// Concurrency limits, by name (no rate policy has the same name).
    concurrency: BTreeMap<String, Arc<ConcurrencyPolicy>>,
    /// Keys' own limits set at runtime: the instance's copy, the same across reloads.
    runtime: Option<Arc<RuntimeLimits>>,
}

/// Which keys an override applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeyMatch {
    Exact(String),
    Prefix(String),
    /// `*` any run of characters, `?` one character.
    Glob(String),
}

impl KeyMatch {
    pub(crate) fn matches(&self, key: &str) -> bool {
        match self {
            KeyMatch::Exact(k) => k == key,
            KeyMatch::Prefix(p) => key.starts_with(p.as_str()),
            KeyMatch::Glob(g) => glob(g.as_bytes(), key.as_bytes()),
        }
    }
}

/// A policy's own limits for some keys (a premium customer): the same policy (name,
/// algorithm, fail mode, keys in the store) with another limit, window or burst.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Override {
    pub(crate) keys: KeyMatch,
    pub(crate) policy: Arc<Policy>,
}

impl Policies {
    pub(crate) fn new(policies: impl IntoIterator<Item = Policy>) -> Self {
        Policies {
            by_name: policies
                .into_iter()
                .map(|p| (p.name.clone(), Arc::new(p)))
                .collect(),
            overrides: BTreeMap::new(),
            exact: BTreeMap::new(),
            patterns: BTreeMap::new(),
            concurrency: BTreeMap::new(),
            runtime: None,
        }
    }

    /// With concurrency limits (names validated unique by the config).
    pub(crate) fn with_concurrency(
        mut self,
        limits: impl IntoIterator<Item = ConcurrencyPolicy>,
    ) -> Self {
        self.concurrency = limits
            .into_iter()
            .map(|p| (p.name.clone(), Arc::new(p)))
            .collect();
        self
    }

    /// The concurrency limit named `name`.
    pub(crate) fn concurrency(&self, name: &str) -> Option<&Arc<ConcurrencyPolicy>> {
        self.concurrency.get(name)
    }

    pub(crate) fn concurrency_limits(&self) -> impl Iterator<Item = &Arc<ConcurrencyPolicy>> {
        self.concurrency.values()
    }

    /// With per-key overrides, by policy name (validated by the config).
    pub(crate) fn with_overrides(mut self, overrides: BTreeMap<String, Vec<Override>>) -> Self {
        for (name, list) in &overrides {
            for o in list {
                match &o.keys {
                    KeyMatch::Exact(k) => {
                        // The first of two for one key wins, as in a scan in file order.
                        self.exact
                            .entry(name.clone())
                            .or_default()
                            .entry(k.clone())
                            .or_insert_with(|| o.policy.clone());
                    }
                    _ => self
                        .patterns
                        .entry(name.clone())
                        .or_default()
                        .push(o.clone()),
                }
            }
        }
        self.overrides = overrides;
        self
    }

    pub(crate) fn get(&self, name: &str) -> Option<&Arc<Policy>> {
        self.by_name.get(name)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &Arc<Policy>> {
        self.by_name.values()
    }

    /// The overrides of the policy named `name`, in config order.
    pub(crate) fn overrides(&self, name: &str) -> &[Override] {
        self.overrides.get(name).map_or(&[], Vec::as_slice)
    }

    /// With the instance's copy of the runtime limits.
    pub(crate) fn with_runtime(mut self, runtime: Arc<RuntimeLimits>) -> Self {
        self.runtime = Some(runtime);
        self
    }

    /// The policy as it applies to `key`: its runtime limit over what the config gives
    /// it, which is an exact override first, then the first prefix or glob that matches,
    /// else `policy` itself.
    pub(crate) fn for_key(&self, policy: &Arc<Policy>, key: &str) -> Arc<Policy> {
        let configured = self.configured_for_key(policy, key);
        match &self.runtime {
            Some(runtime) if configured.runtime.is_some() => {
                with_runtime_limit(configured, runtime.slot(&policy.name, key))
            }
            _ => configured,
        }
    }

    /// What the config alone gives `key` of `policy`.
    pub(crate) fn configured_for_key(&self, policy: &Arc<Policy>, key: &str) -> Arc<Policy> {
        if let Some(p) = self.exact.get(&policy.name).and_then(|m| m.get(key)) {
            return p.clone();
        }
        self.patterns
            .get(&policy.name)
            .and_then(|list| list.iter().find(|o| o.keys.matches(key)))
            .map_or_else(|| policy.clone(), |o| o.policy.clone())
    }
}

/// `configured` (what the config gives a key) under the key's runtime limit `slot`: its
/// own limit and burst while it lasts, with the instant it came into force; after it went
/// (deleted or expired), the config's numbers again, in force since then for this key
/// (the transition rule reads the key's state by these instants).
fn with_runtime_limit(configured: Arc<Policy>, slot: Option<Slot>) -> Arc<Policy> {
    let Some(slot) = slot else {
        return configured;
    };
    let now = crate::runtime_limits::now_ms();
    let since_ms = |ms: i64| Since {
        version: configured.since.version,
        at_ms: ms.max(0) as u64,
    };
    let mut p = (*configured).clone();
    match slot {
        // (Numbers the config's window no longer allows, after a reload: the config's.)
        Slot::Set(e) if e.live_at(now) => {
            if !p.set_numbers(e.limit, e.burst) {
                return configured;
            }
            p.since = since_ms(e.since_ms);
            p.limit_from = LimitSource::Runtime;
        }
        Slot::Set(e) => p.since = p.since.max(since_ms(e.expires_ms)),
        Slot::Gone { since_ms: at } => p.since = p.since.max(since_ms(at)),
    }
    Arc::new(p)
}

/// `*` and `?` over bytes, iteratively (no recursion, linear in practice: the last `*`
/// is the only one that may be retried).
fn glob(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        match pattern.get(p) {
            Some(b'*') => {
                star = Some((p, t));
                p += 1;
            }
            Some(&c) if c == b'?' || c == text[t] => {
                p += 1;
                t += 1;
            }
            _ => match star {
                Some((sp, st)) => {
                    p = sp + 1;
                    t = st + 1;
                    star = Some((sp, st + 1));
                }
                None => return false,
            },
        }
    }
    pattern[p..].iter().all(|&c| c == b'*')
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The periods a calendar policy's calls carry are the ones around the clock: kept
    /// while it stays in the period they were built in, built again once it leaves.
    #[test]
    fn a_calendar_windows_periods_follow_the_clock_across_its_boundaries() {
        use quotad_core::calendar::Period;
        let days = Calendar::new(Period::Day, "Europe/Berlin").unwrap();
        let w = CalendarWindow::new(days.clone());
        let now = 1_800_000_000_000_000;
        let today = days.containing(now);
        let first = w.periods(now);
        assert_eq!(first, days.periods(now));
        assert_eq!(w.periods(today.end_us - 1), first, "the same day");
        let tomorrow = w.periods(today.end_us);
        assert_eq!(
            tomorrow,
            days.periods(today.end_us),
            "built again at midnight"
        );
        assert_ne!(tomorrow, first);
        // A clock that steps back builds them again too.
        assert_eq!(
            w.periods(today.start_us - 1),
            days.periods(today.start_us - 1)
        );
    }

    #[test]
    fn globs_match_star_and_question_mark() {
        let g = |p: &str, t: &str| glob(p.as_bytes(), t.as_bytes());
        assert!(g("premium-*", "premium-42"));
        assert!(g("*-eu", "acme-eu"));
        assert!(g("a?c*", "abcdef"));
        assert!(g("*", ""));
        assert!(!g("premium-*", "free-1"));
        assert!(!g("a?c", "ac"));
        assert!(g("*a*b*", "xxaxxbxx"));
        assert!(!g("*a*b", "xxaxxbxx"));
    }

    fn spec(
        name: &str,
        algorithm: Algorithm,
        limit: u64,
        window: Duration,
        burst: Option<u64>,
    ) -> PolicySpec<'_> {
        PolicySpec {
            name,
            algorithm,
            limit,
            window,
            burst,
            on_store_error: FailMode::Open,
            shadow: false,
            global: None,
        }
    }

    #[test]
    fn invalid_policies_cannot_be_built() {
        let mk = |limit, window, burst, alg| Policy::new(spec("p", alg, limit, window, burst));
        let s = Duration::from_secs(1);
        assert!(mk(0, s, None, Algorithm::FixedWindow).is_none());
        assert!(mk(1, Duration::ZERO, None, Algorithm::FixedWindow).is_none());
        assert!(mk(1, s, Some(5), Algorithm::FixedWindow).is_none());
        assert!(mk(1, s, Some(0), Algorithm::TokenBucket).is_none());
        assert!(Policy::new(spec("a:b", Algorithm::Gcra, 1, s, None)).is_none());
        // GCRA faster than 1 unit per microsecond; a burst that takes over a year to refill;
        // a sliding log over its cap.
        assert!(mk(10_000, Duration::from_millis(1), Some(1), Algorithm::Gcra).is_none());
        assert!(mk(1_000, Duration::from_millis(1), Some(1), Algorithm::Gcra).is_some());
        assert!(mk(1, MAX_WINDOW, Some(2), Algorithm::TokenBucket).is_none());
        assert!(mk(10_001, s, None, Algorithm::SlidingLog).is_none());
        assert_eq!(
            mk(2, s, Some(5), Algorithm::TokenBucket)
                .unwrap()
                .capacity(),
            5
        );
    }

    #[test]
    fn the_quota_window_is_whole_seconds_or_none() {
        let w = |limit, window_ms, burst, alg| {
            Policy::new(spec(
                "p",
                alg,
                limit,
                Duration::from_millis(window_ms),
                burst,
            ))
            .unwrap()
            .quota_window_secs()
        };
        assert_eq!(w(100, 60_000, None, Algorithm::FixedWindow), Some(60));
        assert_eq!(w(3, 1_000, None, Algorithm::SlidingLog), Some(1));
        assert_eq!(w(10, 100, None, Algorithm::SlidingWindow), None);
        assert_eq!(w(10, 1_500, None, Algorithm::FixedWindow), None);
        // Bucket and GCRA: the time to refill the whole burst.
        assert_eq!(w(2, 1_000, Some(4), Algorithm::TokenBucket), Some(2));
        assert_eq!(w(2, 1_000, Some(5), Algorithm::TokenBucket), None); // 2.5 s
        assert_eq!(w(10, 1_000, None, Algorithm::Gcra), Some(1));
        assert_eq!(w(10, 500, Some(20), Algorithm::Gcra), Some(1));
    }
}
