//! `[[policy]]` and `[policy.global]`: each policy's algorithm and rates, and for a global
//! one its escrow weights, lease and round, and allocation.

use std::collections::BTreeSet;
use std::num::NonZeroU64;
use std::time::Duration;

use toml::Spanned;

use super::{ConfigError, NAME_RULE, Validator, raw};
use crate::layout::GLOBAL_KEEP_MS;
use crate::policy::{
    self, CalendarWindow, ConcurrencyPolicy, FailMode, GlobalSpec, KeyMatch, LimitSource, Override,
    Policy, PolicySpec, RuntimeSpec,
};
use quotad_core::algorithm::Algorithm;
use quotad_core::calendar::{Calendar, Period};
use quotad_core::coordinator::Mode;

/// Leases longer than this would outlive the keep time of global keys in Redis.
pub(crate) const MAX_LEASE: Duration = Duration::from_secs(600);
// Every Redis key of a global policy lives `GLOBAL_KEEP_MS` after its last touch: a lease
// must end well before, so a book never expires while it still counts.
const _: () = assert!(MAX_LEASE.as_millis() * 2 < GLOBAL_KEEP_MS as u128);
/// A sliding log stores one entry per admission (about 100 KB per key at limit 1,000, and a
/// cost-N check writes N entries inside one script): above this, the sliding_window counter
/// is the right tool.
pub(crate) const MAX_SLIDING_LOG_LIMIT: i64 = policy::MAX_SLIDING_LOG_LIMIT as i64;

/// The lease and round every global policy shares (one coordinator per daemon), and the
/// first policy that set them, for the message when another differs.
#[derive(Debug, Clone, Copy)]
pub(super) struct Timing {
    pub(super) lease: Duration,
    pub(super) round: Duration,
    pub(super) first: usize,
}

fn policy_field(i: usize, name: &str) -> String {
    format!("policy[{i}].{name}")
}

fn global_field(i: usize, name: &str) -> String {
    format!("policy[{i}].global.{name}")
}

/// What `[[policy]]` compiles to.
pub(super) struct Compiled {
    pub(super) policies: Vec<Policy>,
    pub(super) concurrency: Vec<ConcurrencyPolicy>,
    /// The lease and round of the global policies, if any.
    pub(super) timing: Option<Timing>,
    pub(super) overrides: Overrides,
}

/// Whether `[[policy]]` `p` is a concurrency limit (`config::concurrency`).
pub(super) fn is_concurrency(p: &raw::Policy) -> bool {
    p.algorithm.get_ref() == "concurrency"
}

/// Per-key overrides by policy name.
pub(crate) type Overrides = std::collections::BTreeMap<String, Vec<Override>>;

/// Overrides a policy may have: each is a policy of its own in memory, matched per check.
pub(crate) const MAX_OVERRIDES: usize = 10_000;

impl Validator<'_> {
    /// `[[policy.override]]` of policy `i` (valid as `base`): each a copy of the policy
    /// with its own limit, window and burst, for the keys it names.
    pub(super) fn overrides(&mut self, i: usize, p: &raw::Policy, base: &Policy) -> Vec<Override> {
        let field = |j: usize, k: &str| format!("policy[{i}].override[{j}].{k}");
        if let (Some(first), Some(_)) = (p.overrides.first(), &base.global) {
            let why = "a global policy's budget is split between regions per key: per-key overrides would break the bound; use a separate global policy";
            self.error(&first.limit, &field(0, "limit"), why);
            return Vec::new();
        }
        if p.overrides.len() > MAX_OVERRIDES {
            let why = format!("at most {MAX_OVERRIDES} overrides per policy");
            self.error(
                &p.overrides[MAX_OVERRIDES].limit,
                &field(MAX_OVERRIDES, "limit"),
                why,
            );
        }
        let mut seen = std::collections::BTreeMap::new();
        p.overrides
            .iter()
            .enumerate()
            .take(MAX_OVERRIDES)
            .filter_map(|(j, o)| self.an_override(i, j, o, p, base, &mut seen))
            .collect()
    }

    /// Override `j` of policy `i`, or `None` with its errors recorded.
    fn an_override<'p>(
        &mut self,
        i: usize,
        j: usize,
        o: &'p raw::Override,
        p: &raw::Policy,
        base: &Policy,
        seen: &mut std::collections::BTreeMap<(&'static str, &'p str), usize>,
    ) -> Option<Override> {
        let field = |k: &str| format!("policy[{i}].override[{j}].{k}");
        let errors_before = self.errors.len();
        let keys = self.override_keys(i, j, o, seen)?;
        let limit = self.integer(
            Some(&o.limit),
            &field("limit"),
            1,
            1,
            policy::MAX_LIMIT as i64,
        );
        let window = match (&o.window, &base.calendar) {
            (Some(w), Some(_)) => {
                self.error(
                    w,
                    &field("window"),
                    "an override of a calendar period keeps the policy's period: set its limit only",
                );
                base.window
            }
            _ => self.duration(
                o.window.as_ref(),
                &field("window"),
                base.window,
                policy::MIN_WINDOW,
                policy::MAX_WINDOW,
            ),
        };
        let burst = self.override_burst(i, j, o, p, base);
        if self.errors.len() > errors_before {
            return None;
        }
        let capacity = burst.unwrap_or(limit as u64);
        if let Err(why) = policy::check_rates(base.algorithm, limit as u64, window, capacity) {
            self.error(&o.limit, &field("limit"), why);
            return None;
        }
        let spec = PolicySpec {
            name: &base.name,
            algorithm: base.algorithm,
            limit: limit as u64,
            window,
            burst,
            on_store_error: base.on_store_error,
            shadow: base.shadow,
            global: None,
        };
        let Some(mut policy) = Policy::new(spec) else {
            self.error(&o.limit, &field("limit"), "override is invalid");
            return None;
        };
        // An overridden key is as hot as any other of the policy.
        policy.hot_key_rate = base.hot_key_rate;
        policy.settle_within = base.settle_within;
        policy.calendar = base.calendar.clone();
        // A key an override names may have a runtime limit as well (over the override's).
        policy.runtime = base.runtime;
        policy.limit_from = LimitSource::Override;
        Some(Override {
            keys,
            policy: std::sync::Arc::new(policy),
        })
    }

    /// The keys override `j` of policy `i` names: exactly one of key, prefix or glob, not
    /// empty, and not named by an earlier override (`seen`).
    fn override_keys<'p>(
        &mut self,
        i: usize,
        j: usize,
        o: &'p raw::Override,
        seen: &mut std::collections::BTreeMap<(&'static str, &'p str), usize>,
    ) -> Option<KeyMatch> {
        let field = |k: &str| format!("policy[{i}].override[{j}].{k}");
        let named = [("key", &o.key), ("prefix", &o.prefix), ("glob", &o.glob)];
        if let Some((kind, v)) = named.iter().find_map(|(k, v)| Some((*k, v.as_ref()?))) {
            // An empty key matches no request (a prefix or glob "" every one): a typo
            // either way. Two for the same keys: the second would never apply.
            if v.get_ref().is_empty() {
                self.error(v, &field(kind), "must not be empty");
            } else if let Some(first) = seen.insert((kind, v.get_ref().as_str()), j) {
                // The value is not repeated: an exact key may be an API key.
                let why = format!(
                    "duplicate override: override[{first}] names the same {kind}; this one would never apply"
                );
                self.error(v, &field(kind), why);
                seen.insert((kind, v.get_ref().as_str()), first);
            }
        }
        match (&o.key, &o.prefix, &o.glob) {
            (Some(k), None, None) => Some(KeyMatch::Exact(k.get_ref().clone())),
            (None, Some(k), None) => Some(KeyMatch::Prefix(k.get_ref().clone())),
            (None, None, Some(k)) => Some(KeyMatch::Glob(k.get_ref().clone())),
            _ => {
                let why = "name exactly one of key, prefix or glob";
                let at = [&o.key, &o.prefix, &o.glob].into_iter().flatten().nth(1);
                let at = at.map_or(o.limit.span().start, |v| v.span().start);
                self.error_at(at, &field("key"), why);
                None
            }
        }
    }

    /// Override `j`'s burst: its own (token_bucket and gcra only), else the policy's when
    /// it sets one (docs/api.md: a premium key must not burst less than an ordinary one);
    /// without either, burst is the limit at both levels, so the override's own (`None`).
    fn override_burst(
        &mut self,
        i: usize,
        j: usize,
        o: &raw::Override,
        p: &raw::Policy,
        base: &Policy,
    ) -> Option<u64> {
        let field = format!("policy[{i}].override[{j}].burst");
        match (&o.burst, base.algorithm.has_burst()) {
            (Some(b), false) => {
                self.error(b, &field, "burst applies only to token_bucket and gcra");
                None
            }
            (Some(b), true) => {
                Some(self.integer(Some(b), &field, 1, 1, policy::MAX_LIMIT as i64) as u64)
            }
            (None, true) => p.burst.as_ref().map(|_| base.burst.get()),
            (None, false) => None,
        }
    }

    /// Every `[[policy]]` (at least one, names unique), and the timing of the global ones.
    pub(super) fn policies(
        &mut self,
        raw: &[raw::Policy],
        regions: &[String],
        has_peers: bool,
    ) -> Compiled {
        let mut timing = None;
        let mut policies = Vec::new();
        let mut concurrency = Vec::new();
        let mut overrides = Overrides::new();
        let mut names = BTreeSet::new();
        if raw.is_empty() {
            self.errors.push(ConfigError {
                file: self.file.to_owned(),
                line: 1,
                field: "policy".into(),
                message: "no [[policy]] is defined; quotad needs at least one".into(),
            });
        }
        for (i, p) in raw.iter().enumerate() {
            if is_concurrency(p) {
                if let Some(c) = self.concurrency_policy(i, p) {
                    if names.insert(c.name.clone()) {
                        concurrency.push(c);
                    } else {
                        let why = format!("duplicate policy name \"{}\"", c.name);
                        self.error(&p.name, &policy_field(i, "name"), why);
                    }
                }
                continue;
            }
            let global = p
                .global
                .as_ref()
                .and_then(|g| self.global_policy(i, p, g, regions, has_peers, &mut timing));
            if let Some(policy) = self.policy(i, p, global) {
                if !names.insert(policy.name.clone()) {
                    self.error(
                        &p.name,
                        &policy_field(i, "name"),
                        format!("duplicate policy name \"{}\"", policy.name),
                    );
                } else {
                    let o = self.overrides(i, p, &policy);
                    if !o.is_empty() {
                        overrides.insert(policy.name.clone(), o);
                    }
                    policies.push(policy);
                }
            }
        }
        Compiled {
            policies,
            concurrency,
            timing,
            overrides,
        }
    }

    /// One `[[policy]]`: each field on its own, then the rates together (only when every
    /// field is valid, so that one mistake is not reported twice).
    fn policy(&mut self, i: usize, p: &raw::Policy, global: Option<GlobalSpec>) -> Option<Policy> {
        let errors_before = self.errors.len();
        let name = p.name.get_ref();
        if !policy::valid_name(name) {
            self.error(&p.name, &policy_field(i, "name"), NAME_RULE);
        } else if let Some(why) = crate::layout::reserved_name(name) {
            self.error(&p.name, &policy_field(i, "name"), why);
        }
        let algorithm = self.algorithm(i, &p.algorithm);
        let limit = self.limit(i, &p.limit, algorithm);
        let (window, calendar) = self.window(i, p, algorithm);
        let burst = self.burst(i, p.burst.as_ref(), algorithm);
        let on_store_error = self.on_store_error(i, p.on_store_error.as_ref());
        let hot_key_rate = self.hot_key_rate(i, p.hot_key_rate.as_ref(), algorithm);
        if let (Some(rate), Some(_)) = (&p.hot_key_rate, &calendar) {
            self.error(
                rate,
                &policy_field(i, "hot_key_rate"),
                "hot-key slices are not taken from calendar periods: an instance spends a slice until its window's end by its own clock, which counts fixed windows of real time, not a calendar's",
            );
        }
        let settle_within = self.settle_within(i, p, algorithm);
        let runtime = self.runtime_limits(i, p);
        if self.errors.len() == errors_before {
            if let Some(a) = algorithm {
                if let Err(why) =
                    policy::check_rates(a, limit as u64, window, burst.unwrap_or(limit as u64))
                {
                    self.error(&p.limit, &policy_field(i, "limit"), why);
                }
            }
        }
        if self.errors.len() > errors_before {
            return None;
        }
        let policy = Policy::new(PolicySpec {
            name,
            algorithm: algorithm?,
            limit: limit as u64,
            window,
            burst,
            on_store_error,
            shadow: p.shadow.as_ref().is_some_and(|s| *s.get_ref()),
            global,
        });
        if policy.is_none() {
            self.error(&p.name, &policy_field(i, "name"), "policy is invalid");
        }
        policy.map(|mut p| {
            p.hot_key_rate = hot_key_rate.and_then(NonZeroU64::new);
            p.settle_within = settle_within;
            p.calendar = calendar.map(|c| std::sync::Arc::new(CalendarWindow::new(c)));
            p.runtime = runtime;
            p
        })
    }

    /// `[policy.runtime_limits]`: how many keys may have their own limit, and the largest
    /// one may be given.
    fn runtime_limits(&mut self, i: usize, p: &raw::Policy) -> Option<RuntimeSpec> {
        let r = p.runtime_limits.as_ref()?;
        let field = |k: &str| policy_field(i, &format!("runtime_limits.{k}"));
        let max_keys = self.integer(
            Some(&r.max_keys),
            &field("max_keys"),
            1,
            1,
            policy::MAX_RUNTIME_KEYS as i64,
        );
        let max_limit = self.integer(
            r.max_limit.as_ref(),
            &field("max_limit"),
            policy::MAX_LIMIT as i64,
            1,
            policy::MAX_LIMIT as i64,
        );
        Some(RuntimeSpec {
            max_keys: max_keys as u64,
            max_limit: max_limit as u64,
        })
    }

    /// A policy's `window`: a duration, or a calendar period (`"day"`, `"week"`,
    /// `"month"`, `"year"`) in its `time_zone`, which only a fixed window counts in. A
    /// calendar period's window is its nominal length: the fixed window it is in period
    /// time (`quotad_core::calendar::Periods`).
    fn window(
        &mut self,
        i: usize,
        p: &raw::Policy,
        algorithm: Option<Algorithm>,
    ) -> (Duration, Option<Calendar>) {
        let field = policy_field(i, "window");
        let fallback = (Duration::from_secs(1), None);
        let Some(period) = Period::named(p.window.get_ref()) else {
            if let Some(zone) = &p.time_zone {
                self.error(
                    zone,
                    &policy_field(i, "time_zone"),
                    "a time zone places calendar periods: set window to \"day\", \"week\", \"month\" or \"year\", or remove time_zone",
                );
            }
            let window = self.duration(
                Some(&p.window),
                &field,
                Duration::from_secs(1),
                policy::MIN_WINDOW,
                policy::MAX_WINDOW,
            );
            return (window, None);
        };
        if let Some(a) = algorithm.filter(|a| *a != Algorithm::FixedWindow) {
            let why = match a {
                Algorithm::SlidingWindow => {
                    "a sliding window weighs the window before by how much of it still overlaps one window's length back from now, and a calendar period has no one length"
                }
                Algorithm::SlidingLog => {
                    "a sliding log counts the admissions of one window's length back from now, which is never a calendar period"
                }
                _ => {
                    "a bucket refills continuously, at limit per window; a count that starts over when the period does is a fixed window"
                }
            };
            self.error(
                &p.window,
                &field,
                format!(
                    "a calendar period needs fixed_window, not {}: {why}",
                    a.name()
                ),
            );
            return fallback;
        }
        let Some(zone) = &p.time_zone else {
            self.error(
                &p.window,
                &field,
                format!(
                    "window = \"{}\" needs time_zone, where its periods start at midnight: an IANA name such as \"UTC\" or \"Europe/Berlin\"",
                    period.name()
                ),
            );
            return fallback;
        };
        match Calendar::new(period, zone.get_ref()) {
            Ok(c) => (Duration::from_micros(period.nominal_us() as u64), Some(c)),
            Err(e) => {
                self.error(zone, &policy_field(i, "time_zone"), e);
                fallback
            }
        }
    }

    /// `settle_within`: how long a reservation waits for its settlement. Only where a
    /// debt has a meaning and keeps the bound: a token bucket, GCRA or fixed window
    /// (`Algorithm::holds_debt`) of a local policy that admits from Redis alone.
    fn settle_within(
        &mut self,
        i: usize,
        p: &raw::Policy,
        algorithm: Option<Algorithm>,
    ) -> Option<Duration> {
        let value = p.settle_within.as_ref()?;
        let field = policy_field(i, "settle_within");
        let refusal = match algorithm {
            None => return None,
            Some(a) if !a.holds_debt() => Some(format!(
                "settlement needs token_bucket, gcra or fixed_window, not {}: a sliding window or log forgets a charge as it slides out, so a debt would not hold (docs/api.md, Settlement)",
                a.name()
            )),
            Some(_) if p.global.is_some() => Some(
                "a global policy cannot take settlements: a debt is work done beyond what the region's share held, so the regions together could spend more than the budget in a window, which a global policy promises never happens (docs/global-budgets.md)".to_owned(),
            ),
            Some(_) if p.hot_key_rate.is_some() => Some(
                "settlement and hot_key_rate do not mix: a hot key admits from slices taken beforehand, which a debt settled meanwhile cannot reach; drop one of them".to_owned(),
            ),
            Some(_) => None,
        };
        if let Some(why) = refusal {
            self.error(value, &field, why);
            return None;
        }
        Some(self.duration(
            Some(value),
            &field,
            policy::MAX_SETTLE_WITHIN,
            policy::MIN_SETTLE_WITHIN,
            policy::MAX_SETTLE_WITHIN,
        ))
    }

    /// `hot_key_rate`: checks per second of one key on one instance from which the key
    /// takes slices of its quota; fixed windows, token buckets and GCRA only (see
    /// `store::redis::hot` for why).
    fn hot_key_rate(
        &mut self,
        i: usize,
        rate: Option<&Spanned<i64>>,
        algorithm: Option<Algorithm>,
    ) -> Option<u64> {
        let rate = rate?;
        match algorithm {
            Some(a) if crate::store::takes_slices(a) => {}
            Some(a) => {
                self.error(
                    rate,
                    &policy_field(i, "hot_key_rate"),
                    format!(
                        "hot-key slices need fixed_window, token_bucket or gcra, not {}: a sliding window or log weighs each admission by when it happened, and a slice's units are taken before they are spent (docs/architecture.md)",
                        a.name()
                    ),
                );
                return None;
            }
            None => return None,
        }
        let n = self.integer(
            Some(rate),
            &policy_field(i, "hot_key_rate"),
            1,
            1,
            policy::MAX_LIMIT as i64,
        );
        Some(n as u64)
    }

    /// `algorithm`: one of the five by name (`None` when unknown).
    fn algorithm(&mut self, i: usize, algorithm: &Spanned<String>) -> Option<Algorithm> {
        match algorithm.get_ref().as_str() {
            "fixed_window" => Some(Algorithm::FixedWindow),
            "sliding_log" => Some(Algorithm::SlidingLog),
            "sliding_window" => Some(Algorithm::SlidingWindow),
            "token_bucket" => Some(Algorithm::TokenBucket),
            "gcra" => Some(Algorithm::Gcra),
            other => {
                self.error(
                    algorithm,
                    &policy_field(i, "algorithm"),
                    format!("unknown algorithm \"{other}\"; expected one of fixed_window, sliding_log, sliding_window, token_bucket, gcra"),
                );
                None
            }
        }
    }

    /// `limit`, and the lower ceiling of sliding logs, whose memory grows with it.
    fn limit(&mut self, i: usize, limit: &Spanned<i64>, algorithm: Option<Algorithm>) -> i64 {
        let n = self.integer(
            Some(limit),
            &policy_field(i, "limit"),
            1,
            1,
            policy::MAX_LIMIT as i64,
        );
        if algorithm == Some(Algorithm::SlidingLog) && n > MAX_SLIDING_LOG_LIMIT {
            self.error(
                limit,
                &policy_field(i, "limit"),
                format!("sliding_log keeps one entry per admission; limits above {MAX_SLIDING_LOG_LIMIT} cost a megabyte per key and stall Redis on large costs: use sliding_window"),
            );
        }
        n
    }

    /// `burst`: only the algorithms that have one accept it.
    fn burst(
        &mut self,
        i: usize,
        burst: Option<&Spanned<i64>>,
        algorithm: Option<Algorithm>,
    ) -> Option<u64> {
        match (burst, algorithm) {
            (Some(b), Some(a)) if !a.has_burst() => {
                self.error(
                    b,
                    &policy_field(i, "burst"),
                    format!(
                        "burst applies only to token_bucket and gcra, not {}",
                        a.name()
                    ),
                );
                None
            }
            (Some(b), _) => {
                let n = self.integer(
                    Some(b),
                    &policy_field(i, "burst"),
                    1,
                    1,
                    policy::MAX_LIMIT as i64,
                );
                Some(n as u64)
            }
            (None, _) => None,
        }
    }

    /// `on_store_error`: what a check answers while the store is unusable (open by default).
    pub(super) fn on_store_error(&mut self, i: usize, mode: Option<&Spanned<String>>) -> FailMode {
        match mode.map(|s| (s, s.get_ref().as_str())) {
            None => FailMode::Open,
            Some((_, "open")) => FailMode::Open,
            Some((_, "closed")) => FailMode::Closed,
            Some((_, "local")) => FailMode::Local,
            Some((s, other)) => {
                self.error(
                    s,
                    &policy_field(i, "on_store_error"),
                    format!("unknown mode \"{other}\"; expected open, closed or local"),
                );
                FailMode::Open
            }
        }
    }

    /// `[policy.global]`: the escrow names exactly this region and its peers, the lease is
    /// longer than the round, and every global policy shares one lease and round.
    fn global_policy(
        &mut self,
        i: usize,
        p: &raw::Policy,
        g: &raw::Global,
        regions: &[String],
        has_peers: bool,
        timing: &mut Option<Timing>,
    ) -> Option<GlobalSpec> {
        let before = self.errors.len();
        self.global_restrictions(i, p);
        let weights = self.escrow_weights(i, g, regions, has_peers, before);
        if self.errors.len() == before {
            self.escrow_holds_a_unit(i, p, g, regions, &weights);
        }
        let (lease, round) = self.lease_and_round(i, g);
        self.same_timing(i, g, lease, round, timing);
        let mode = self.allocation(i, g);
        let version = self.integer(
            g.version.as_ref(),
            &global_field(i, "version"),
            1,
            1,
            i64::MAX,
        ) as u64;
        (self.errors.len() == before).then_some(GlobalSpec {
            version,
            weights,
            mode,
        })
    }

    /// What a global policy cannot be: a window algorithm (budget moves as rates), or
    /// `local` on store errors (its lease state is in Redis).
    fn global_restrictions(&mut self, i: usize, p: &raw::Policy) {
        match p.algorithm.get_ref().as_str() {
            "token_bucket" | "gcra" => {}
            "fixed_window" | "sliding_log" | "sliding_window" => self.error(
                &p.algorithm,
                &policy_field(i, "algorithm"),
                "a global policy must be token_bucket or gcra: budget moves between regions as rates (leases); window algorithms would need per-window loans, which quotad does not implement (see docs/global-budgets.md)",
            ),
            _ => {}
        }
        if let Some(mode) = &p.on_store_error {
            if mode.get_ref() == "local" {
                self.error(mode, &policy_field(i, "on_store_error"), "\"local\" cannot keep a global budget (the region's lease state is in Redis): use \"closed\" to keep the bound or \"open\"");
            }
        }
    }

    /// `escrow`: a weight >= 0 for every region (and for no other), not all 0, in the order
    /// of `regions`. `before` counts the errors before this `[policy.global]`: the sum is
    /// only judged when nothing else is wrong with it.
    fn escrow_weights(
        &mut self,
        i: usize,
        g: &raw::Global,
        regions: &[String],
        has_peers: bool,
        before: usize,
    ) -> Vec<f64> {
        let f = |name: &str| global_field(i, name);
        if !has_peers {
            self.error(
                &g.escrow,
                &f("escrow"),
                "a global policy needs at least one [[peer]] region",
            );
        }
        let names = g.escrow.get_ref();
        for (name, w) in names {
            if !regions.contains(name) {
                self.error(
                    w,
                    &f("escrow"),
                    format!("\"{name}\" is neither this region nor a [[peer]]"),
                );
            } else if !(w.get_ref().is_finite() && *w.get_ref() >= 0.0) {
                self.error(
                    w,
                    &f("escrow"),
                    format!("weight of \"{name}\" must be a number >= 0"),
                );
            }
        }
        for r in regions {
            if has_peers && !names.contains_key(r) {
                self.error(
                    &g.escrow,
                    &f("escrow"),
                    format!("no weight for region \"{r}\" (every region needs one, 0 allowed)"),
                );
            }
        }
        let weights: Vec<f64> = regions
            .iter()
            .map(|r| names.get(r).map_or(0.0, |w| *w.get_ref()))
            .collect();
        if has_peers && self.errors.len() == before && weights.iter().sum::<f64>() <= 0.0 {
            self.error(&g.escrow, &f("escrow"), "the weights must not all be 0");
        }
        weights
    }

    /// A region's bucket holds the burst (the limit without one) times its share of the
    /// budget, which is its escrow while it neither lends nor borrows: when that is below
    /// one unit, the region cut off from its peers admits nothing, and as a lender below
    /// its escrow it holds budget it can never spend (docs/global-budgets.md, "Size the
    /// burst for the number of regions"). A region with weight 0 only ever borrows.
    fn escrow_holds_a_unit(
        &mut self,
        i: usize,
        p: &raw::Policy,
        g: &raw::Global,
        regions: &[String],
        weights: &[f64],
    ) {
        let capacity = *p.burst.as_ref().unwrap_or(&p.limit).get_ref();
        let total: f64 = weights.iter().sum();
        // An invalid burst or limit is the policy's own error (reported with its fields).
        if capacity < 1 || total <= 0.0 {
            return;
        }
        let size = if p.burst.is_some() {
            "burst"
        } else {
            "limit (the burst)"
        };
        for (region, &w) in regions.iter().zip(weights) {
            let held = capacity as f64 * w / total;
            if w > 0.0 && held < 1.0 {
                let need = (total / w).ceil();
                let at = g
                    .escrow
                    .get_ref()
                    .get(region)
                    .map_or(g.escrow.span().start, |w| w.span().start);
                self.error_at(
                    at,
                    &global_field(i, "escrow"),
                    format!(
                        "\"{region}\" would hold {held:.2} units at its escrow ({size} {capacity} \
                         times weight {w} of {total}): less than one, so cut off from its \
                         peers it admits nothing; raise the {size} to at least {need}, or \
                         this weight"
                    ),
                );
            }
        }
    }

    /// `round` and `lease`: a loan must outlast the exchange interval that renews it.
    fn lease_and_round(&mut self, i: usize, g: &raw::Global) -> (Duration, Duration) {
        let round = self.duration(
            g.round.as_ref(),
            &global_field(i, "round"),
            Duration::from_secs(1),
            Duration::from_millis(100),
            Duration::from_secs(60),
        );
        let lease = self.duration(
            g.lease.as_ref(),
            &global_field(i, "lease"),
            Duration::from_secs(10),
            Duration::from_millis(200),
            MAX_LEASE,
        );
        if lease <= round {
            let at = g
                .lease
                .as_ref()
                .map_or(g.escrow.span().start, |l| l.span().start);
            self.error_at(
                at,
                &global_field(i, "lease"),
                format!(
                    "must be longer than round ({})",
                    humantime::format_duration(round)
                ),
            );
        }
        (lease, round)
    }

    /// The first global policy sets the daemon's lease and round; any other must match it,
    /// as one coordinator runs them all.
    fn same_timing(
        &mut self,
        i: usize,
        g: &raw::Global,
        lease: Duration,
        round: Duration,
        timing: &mut Option<Timing>,
    ) {
        match timing {
            Some(t) if (t.lease, t.round) != (lease, round) => {
                let at = g
                    .lease
                    .as_ref()
                    .or(g.round.as_ref())
                    .map_or(g.escrow.span().start, |x| x.span().start);
                let msg = format!(
                    "every global policy must use the same lease and round (one coordinator per daemon); policy[{}] uses lease {} and round {}",
                    t.first,
                    humantime::format_duration(t.lease),
                    humantime::format_duration(t.round)
                );
                self.error_at(at, &global_field(i, "lease"), msg);
            }
            Some(_) => {}
            None => {
                *timing = Some(Timing {
                    lease,
                    round,
                    first: i,
                })
            }
        }
    }

    /// `allocation`: how the coordinator shares spare budget (proportional by default).
    fn allocation(&mut self, i: usize, g: &raw::Global) -> Mode {
        let Some(a) = g.allocation.as_ref() else {
            return Mode::Proportional;
        };
        match Mode::ALL.into_iter().find(|m| m.name() == a.get_ref()) {
            Some(m) => m,
            None => {
                self.error(
                    a,
                    &global_field(i, "allocation"),
                    format!(
                        "unknown allocation \"{}\"; expected proportional, maxmin or owner_first",
                        a.get_ref()
                    ),
                );
                Mode::Proportional
            }
        }
    }
}
