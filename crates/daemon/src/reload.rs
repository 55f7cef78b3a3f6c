//! Hot reload: SIGHUP, or a change of the config file seen on disk (checked every second,
//! applied once the file has stayed unchanged for [`SETTLE`]), reloads the policies,
//! their per-key overrides, forward-auth settings and Envoy descriptors without a
//! restart. Keys keep their state: it lives in the store, under names that do not change,
//! and a change that would alter what that state means (a local policy's algorithm or a
//! window) applies only with a higher `policy.version` ([`refusal`]).
//!
//! A new file is validated exactly as `quotad validate` does; with errors it is refused,
//! each error logged with file, line and field, and the running config stays. A valid
//! file that changes what cannot change live (listen addresses and other `[server]`
//! settings, `[store]` and its credentials, the region, peers and coordinator and their
//! secrets, a global policy's rate, or a re-split without a new version) is refused with
//! the reason. A re-split with a higher `policy.global.version` goes to the coordinator,
//! which applies it decrease-first. Every attempt is counted in
//! `quotad_config_reloads_total{result}`; the loaded file's hash is in `GET /v1/policies`.
//!
//! Nothing derived from the old config outlives it: a remembered denial answers only a
//! check under the same numbers (`store::redis::deny_cache`), and layouts for the janitor are
//! built from the config in force. docs/architecture.md lists every such pair.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use crate::config::{
    AdminSettings, Descriptors, ForwardAuths, GlobalSettings, LogSettings, Secret, Settings,
    StoreBackend, sample_every,
};
use crate::metrics::Metrics;
use crate::policy::Policies;
use crate::policy::{KeyMatch, Policy};
use crate::runtime_limits::RuntimeLimits;
use crate::store::StoreError;
use crate::store::Target;
use quotad_core::algorithm::{Algorithm, Since};

/// How often the file's modification time and length are looked at.
const POLL: Duration = Duration::from_secs(1);

/// How long a changed file must stay unchanged before the watcher applies it: a file
/// written in place passes through prefixes that may parse (2 of 13 policies), and one
/// of those must never serve. A SIGHUP applies the file at once (the operator says it is
/// whole); an atomic rename (what a ConfigMap does) is whole at once too, and settles.
pub(crate) const SETTLE: Duration = Duration::from_secs(2);

/// What a reload replaces: read by every request.
pub(crate) struct Live {
    pub(crate) policies: Policies,
    pub(crate) forward_auth: ForwardAuths,
    /// `[[descriptor]]`: what the gRPC service maps Envoy's descriptors to.
    pub(crate) descriptors: Descriptors,
    /// `[admin]`: who may change limits (a token file read again at every reload).
    pub(crate) admin: AdminSettings,
    /// SHA-256 of the config file (hex); "builtin" without one.
    pub(crate) hash: String,
    /// The parts of that file a reload did not apply (they need a restart), each with
    /// its reason: `GET /v1/policies` shows them.
    pub(crate) kept: Vec<String>,
}

impl Live {
    pub(crate) fn from_settings(settings: &Settings, hash: String) -> Live {
        Live {
            policies: policies(settings),
            forward_auth: settings.forward_auth.clone(),
            descriptors: settings.descriptors.clone(),
            admin: settings.admin.clone(),
            hash,
            kept: Vec::new(),
        }
    }
}

/// The policies of `settings` with their per-key overrides, as a reload puts them in force.
pub(crate) fn policies(settings: &Settings) -> Policies {
    Policies::new(settings.policies.iter().cloned())
        .with_overrides(settings.overrides.clone())
        .with_concurrency(settings.concurrency.iter().cloned())
}

/// The live config, swapped whole by a reload. A std RwLock: held only to clone the Arc.
pub(crate) struct LiveConfig {
    live: RwLock<Arc<Live>>,
    /// `[log] requests` as "every Nth request" (`config::sample_every`): read by every
    /// answer, so kept apart from the lock.
    request_every: AtomicU64,
    /// The instance's copy of the runtime limits, which every config's policies read.
    runtime: Arc<RuntimeLimits>,
}

impl LiveConfig {
    pub(crate) fn new(mut live: Live, log: &LogSettings, runtime: Arc<RuntimeLimits>) -> Self {
        live.policies = live.policies.with_runtime(runtime.clone());
        LiveConfig {
            live: RwLock::new(Arc::new(live)),
            request_every: AtomicU64::new(sample_every(log.requests)),
            runtime,
        }
    }

    /// The instance's copy of the runtime limits.
    pub(crate) fn runtime(&self) -> &Arc<RuntimeLimits> {
        &self.runtime
    }

    pub(crate) fn get(&self) -> Arc<Live> {
        self.live.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Every how many requests one goes to the request log (0: none).
    pub(crate) fn request_every(&self) -> u64 {
        self.request_every.load(Ordering::Relaxed)
    }

    fn set(&self, mut live: Live, log: &LogSettings) {
        live.policies = live.policies.with_runtime(self.runtime.clone());
        *self.live.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(live);
        self.request_every
            .store(sample_every(log.requests), Ordering::Relaxed);
    }
}

/// SHA-256 of a config file's bytes, hex.
pub(crate) fn hash(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// The parts of a config that cannot change in a running daemon, each with whether `old`
/// and `new` agree on it. Settings are compared by value, secrets included (their
/// `Debug` text hides them): a rotated password or secret is named, never reported
/// applied while the old one stays in use.
fn fixed_parts(old: &Settings, new: &Settings) -> [(&'static str, bool); 8] {
    let timing = |s: &Settings| {
        s.global
            .as_ref()
            .map(|g| (g.params.lease_us, g.params.round_us))
    };
    [
        ("region", old.region == new.region),
        ("[log] format", old.log.format == new.log.format),
        ("[server]", old.server == new.server),
        // Named apart: the message must say a rotation did not happen.
        (
            "[store] credentials (username, password, TLS files)",
            store(old) == store(new) || without_credentials(old) != without_credentials(new),
        ),
        ("[store]", store(old) == store(new)),
        // Set in [policy.global] but one for the whole coordinator: named as written.
        (
            "a global policy's lease and round",
            timing(old) == timing(new),
        ),
        (
            "the [coordinator] and [[peer]] secrets",
            old.global == new.global || without_secrets(old) != without_secrets(new),
        ),
        ("[coordinator] and [[peer]]", old.global == new.global),
    ]
}

/// Why `new` cannot replace `old` whole in a running daemon; `None` when it can (the
/// tests' summary of what `review` applies and keeps).
#[cfg(test)]
pub(crate) fn refusal(old: &Settings, new: &Settings) -> Option<String> {
    fixed_parts(old, new)
        .iter()
        .find(|(_, ok)| !ok)
        .map(|(what, _)| format!("{what} cannot change without a restart"))
        .or_else(|| global_refusal(old, new))
        .or_else(|| state_refusal(old, new))
}

/// What a reload puts in force of a new file.
#[derive(Debug)]
pub(crate) struct Review {
    /// The settings to put in force: the new file, with every part that cannot change
    /// live as it runs. `None`: nothing of the file applies.
    pub(crate) apply: Option<Settings>,
    /// The parts of the file that did not apply, each with its reason.
    pub(crate) kept: Vec<String>,
    /// Why nothing applies, when nothing does.
    pub(crate) refused: Option<String>,
}

/// What of `new` a daemon running `old` puts in force: everything that can change live
/// (the policies with their overrides, forward-auth and descriptors, the request log's
/// sample), while a part that cannot (a rotated credential, `[server]`, the region, the
/// coordinator and peers) stays as it runs and is named in [`Review::kept`]. A change of
/// the policies that cannot apply live (a window without a higher version, a global
/// policy's rate) refuses the reload whole: the policies go in together.
pub(crate) fn review(old: &Settings, new: &Settings) -> Review {
    let parts = fixed_parts(old, new);
    let kept: Vec<String> = parts
        .iter()
        .filter(|(_, ok)| !ok)
        .map(|(what, _)| format!("{what} cannot change without a restart"))
        .collect();
    let mut adjusted = new.clone();
    if !kept.is_empty() {
        adjusted.region = old.region.clone();
        adjusted.log.format = old.log.format;
        adjusted.server = old.server.clone();
        adjusted.store = old.store.clone();
        adjusted.key_prefix = old.key_prefix.clone();
        adjusted.memory_max_keys = old.memory_max_keys;
        if old.global.is_some() && new.global.is_some() {
            adjusted.global = old.global.clone();
        }
    }
    if let Some(why) = global_refusal(old, &adjusted).or_else(|| state_refusal(old, &adjusted)) {
        return Review {
            apply: None,
            kept,
            refused: Some(why),
        };
    }
    if !kept.is_empty() && adjusted == *old {
        let why = kept.join("; ");
        return Review {
            apply: None,
            kept,
            refused: Some(why),
        };
    }
    Review {
        apply: Some(adjusted),
        kept,
        refused: None,
    }
}

/// `[store]`, its key prefix and the embedded store's bound.
fn store(s: &Settings) -> (&StoreBackend, &String, usize) {
    (&s.store, &s.key_prefix, s.memory_max_keys)
}

/// [`store`] with the credentials blanked: equal for two settings that differ in those
/// alone.
fn without_credentials(s: &Settings) -> (StoreBackend, &String, usize) {
    let mut backend = s.store.clone();
    if let StoreBackend::Redis(r) = &mut backend {
        r.target.username = None;
        r.target.password = None;
        r.target.tls = Default::default();
    }
    (backend, &s.key_prefix, s.memory_max_keys)
}

/// `[coordinator]` and `[[peer]]` with every secret blanked.
fn without_secrets(s: &Settings) -> Option<GlobalSettings> {
    let mut g = s.global.clone()?;
    for p in &mut g.peers {
        p.secret = Secret(Vec::new());
    }
    Some(g)
}

/// What the stored state of a local policy's keys means: its algorithm and window (a
/// calendar period's kind and time zone), and the keys an override gives another window. A reload that changes it would move or
/// reset state (another algorithm's keys start empty; a shorter sliding log drops its
/// history for good; a fixed window's count is read against another window), so it
/// applies only with a higher `policy.version`: the operator's word that this is meant.
type StateMeaning = (
    Algorithm,
    Duration,
    Option<(&'static str, String)>,
    Vec<(KeyMatch, Duration)>,
);

fn state_meaning(s: &Settings, p: &Policy) -> StateMeaning {
    let windowed = s
        .overrides
        .get(&p.name)
        .into_iter()
        .flatten()
        .filter(|o| o.policy.window != p.window)
        .map(|o| (o.keys.clone(), o.policy.window))
        .collect();
    // A calendar period's kind and zone: another zone moves every period's bounds.
    let calendar = p.calendar.as_ref().map(|c| {
        let c = c.calendar();
        (c.period().name(), c.zone().to_owned())
    });
    (p.algorithm, p.window, calendar, windowed)
}

/// Why a local policy of `new` cannot replace its namesake in `old` (see
/// [`state_meaning`]).
fn state_refusal(old: &Settings, new: &Settings) -> Option<String> {
    let version = |s: &Settings, name: &str| s.versions.get(name).copied().unwrap_or(1);
    for n in new.policies.iter().filter(|p| p.global.is_none()) {
        let Some(o) = old
            .policies
            .iter()
            .find(|o| o.name == n.name && o.global.is_none())
        else {
            continue;
        };
        let (ov, nv) = (version(old, &o.name), version(new, &n.name));
        let name = &n.name;
        if nv < ov {
            return Some(format!(
                "policy `{name}`: version {nv} is below the running {ov}"
            ));
        }
        if nv == ov && state_meaning(old, o) != state_meaning(new, n) {
            return Some(format!(
                "policy `{name}`: a new algorithm, window or time zone (its own or an override's) changes what its keys' stored counts mean (another algorithm starts every key empty; a shorter window drops or misreads history); raise policy.version above {ov} to apply it anyway"
            ));
        }
    }
    None
}

/// Why the global policies of `new` cannot replace those of `old` live. A re-split (new
/// weights) applies live with a higher `policy.global.version`, as the coordinator's
/// protocol expects: decreases at once, increases once every region applied it. What the
/// protocol does not cover live is refused: adding or removing a global policy, and a
/// change of its rate, burst, algorithm or mode (the request path's scripts and the
/// coordinator's escrow would disagree while they roll out).
fn global_refusal(old: &Settings, new: &Settings) -> Option<String> {
    let globals = |s: &Settings| -> std::collections::BTreeMap<String, crate::policy::Policy> {
        s.policies
            .iter()
            .filter(|p| p.global.is_some())
            .map(|p| (p.name.clone(), p.clone()))
            .collect()
    };
    let (old, new) = (globals(old), globals(new));
    if let Some(name) = new.keys().find(|n| !old.contains_key(*n)) {
        return Some(format!(
            "global policy `{name}` is new: adding a global policy needs a restart"
        ));
    }
    for (name, o) in &old {
        let Some(n) = new.get(name) else {
            return Some(format!(
                "global policy `{name}` is gone or no longer global: that needs a restart"
            ));
        };
        let (og, ng) = (o.global.as_ref()?, n.global.as_ref()?);
        let shape = |p: &crate::policy::Policy| {
            let mode = p.global.as_ref().map(|g| g.mode);
            (p.algorithm, p.limit, p.window, p.burst, mode)
        };
        if shape(o) != shape(n) {
            return Some(format!(
                "global policy `{name}`: its algorithm, limit, window, burst and mode change only through a restart of every region (with a new version)"
            ));
        }
        if ng.version < og.version {
            return Some(format!(
                "global policy `{name}`: version {} is below the running {}",
                ng.version, og.version
            ));
        }
        if ng.weights != og.weights && ng.version == og.version {
            return Some(format!(
                "global policy `{name}`: a new escrow split needs a higher policy.global.version (running {})",
                og.version
            ));
        }
    }
    None
}

/// Stamps each local policy of `new`, and each of its overrides, with when its numbers
/// came into force on this instance (`Policy::since`): its `policy.version`, and the
/// instant of `previous` (the config in force before) where the version and numbers
/// (limit, window, burst) are unchanged, else `at_ms`. A key's state written under other
/// numbers is read by this order (`quotad_core::algorithm::frame`): the newer config
/// takes it over, the older one is held to both. Global policies keep `Since::ZERO`:
/// their numbers change only through a restart of every region.
pub(crate) fn stamp_since(new: &mut Settings, previous: Option<&Settings>, at_ms: u64) {
    let since = |p: &Policy, before: Option<&Policy>, version: u64| {
        let numbers = |p: &Policy| (p.algorithm, p.limit, p.window, p.burst);
        match before {
            Some(b) if numbers(b) == numbers(p) && b.since.version == version => b.since,
            _ => Since { version, at_ms },
        }
    };
    let version = |name: &str| new.versions.get(name).copied().unwrap_or(1);
    for p in new.policies.iter_mut().filter(|p| p.global.is_none()) {
        let before = previous.and_then(|s| s.policies.iter().find(|o| o.name == p.name));
        p.since = since(p, before, version(&p.name));
    }
    for (name, list) in new.overrides.iter_mut() {
        let v = new.versions.get(name).copied().unwrap_or(1);
        let old = previous.and_then(|s| s.overrides.get(name));
        for o in list.iter_mut() {
            let before = old.and_then(|l| l.iter().find(|b| b.keys == o.keys));
            let s = since(&o.policy, before.map(|b| b.policy.as_ref()), v);
            Arc::make_mut(&mut o.policy).since = s;
        }
    }
}

/// Now, in ms since the Unix epoch (the instant numbers come into force).
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

type Stamp = Option<(SystemTime, u64)>;

fn stamp(path: &Path) -> Stamp {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

/// The stamps of the config file and of the secret files it names (a rotated
/// `password_file` is a change as much as an edited config).
fn stamps(path: &Path, running: &Settings) -> Vec<Stamp> {
    std::iter::once(path)
        .chain(running.secret_files.iter().map(PathBuf::as_path))
        .map(stamp)
        .collect()
}

/// Told of every config a reload put in force (the coordinator installs new versions of
/// global policies from it).
pub(crate) type OnReload = Box<dyn Fn(&Live) + Send + Sync>;

/// Puts new `[store]` credentials (username, password, TLS files) in force live, if they
/// authenticate (`RedisStore::rotate`): every connection opened after uses them, those
/// open already finish what they carry. The log names why not by its kind, never a secret.
pub(crate) type Rotate = Arc<
    dyn Fn(Target) -> futures_util::future::BoxFuture<'static, Result<(), StoreError>>
        + Send
        + Sync,
>;

/// The new `[store]` target when `new` differs from `old` in its credentials alone.
fn rotated_credentials(old: &Settings, new: &Settings) -> Option<Target> {
    if store(old) == store(new) || without_credentials(old) != without_credentials(new) {
        return None;
    }
    match &new.store {
        StoreBackend::Redis(r) => Some(r.target.clone()),
        StoreBackend::Memory => None,
    }
}

/// Reloads on SIGHUP and when the file at `path` changes, until `stop`. `running` is the
/// config the daemon was started with, then the last one reloaded (what cannot change,
/// and global policies' versions, are compared against it).
pub(crate) async fn watch(
    path: PathBuf,
    mut running: Settings,
    live: Arc<LiveConfig>,
    metrics: Arc<Metrics>,
    on_reload: OnReload,
    rotate: Option<Rotate>,
    stop: CancellationToken,
) {
    #[cfg(unix)]
    let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::error!(
                "cannot install the SIGHUP handler: {e}; reloading on file changes only"
            );
            None
        }
    };
    // `seen`: the stamp of the file last read. `latest`: the stamp at the last poll, and
    // since when it has not changed.
    let mut seen = stamps(&path, &running);
    let mut latest = (seen.clone(), tokio::time::Instant::now());
    loop {
        #[cfg(unix)]
        let hangup = async {
            match hup.as_mut() {
                Some(s) => s.recv().await,
                None => std::future::pending().await,
            }
        };
        #[cfg(not(unix))]
        let hangup = std::future::pending::<Option<()>>();
        let asked = tokio::select! {
            _ = stop.cancelled() => return,
            _ = hangup => true,
            _ = tokio::time::sleep(POLL) => false,
        };
        let now = stamps(&path, &running);
        if now != latest.0 {
            latest = (now.clone(), tokio::time::Instant::now());
        }
        let settled = now != seen && latest.1.elapsed() >= SETTLE;
        if asked || settled {
            let rotate = rotate.as_ref();
            if let Some(new) = reload(&path, &running, &live, &metrics, rotate, asked).await {
                on_reload(&live.get());
                running = new;
            }
            // After a reload the secret files may be others: stamp what is watched now.
            seen = stamps(&path, &running);
            latest = (seen.clone(), tokio::time::Instant::now());
        }
    }
}

/// One reload attempt; the settings put in force, if any.
async fn reload(
    path: &Path,
    running: &Settings,
    live: &LiveConfig,
    metrics: &Metrics,
    rotate: Option<&Rotate>,
    asked: bool,
) -> Option<Settings> {
    let count = |result: &str| metrics.config_reloads.with_label_values(&[result]).inc();
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!(file = %path.display(), "config reload: cannot read the file: {e}; the running config stays");
            count("invalid");
            return None;
        }
    };
    let h = hash(&bytes);
    let text = String::from_utf8_lossy(&bytes);
    // Parsed even when the file's hash is the one in force: the secret files it names are
    // read again, and a rotated one is a change (the hash, which `/v1/policies` shows,
    // covers the config file alone and never a secret).
    let parsed = Settings::parse(&path.display().to_string(), &text).map(|mut s| {
        s.source = Some(path.to_owned());
        stamp_since(&mut s, Some(running), now_ms());
        s
    });
    if h == live.get().hash && parsed.as_ref().is_ok_and(|new| new == running) {
        if asked {
            tracing::info!("config reload: the file and its secrets are unchanged");
        }
        return None;
    }
    match parsed {
        Err(errors) => {
            for e in &errors.0 {
                tracing::warn!("config reload refused: {e}");
            }
            tracing::warn!(
                "config reload: {} error(s); the running config stays",
                errors.0.len()
            );
            count("invalid");
            None
        }
        Ok(new) => {
            let rotated = rotated(running, &new, rotate).await;
            let r = review(rotated.as_ref().unwrap_or(running), &new);
            let Some(applied) = r.apply else {
                let why = r.refused.unwrap_or_default();
                tracing::warn!("config reload refused: {why}; the running config stays");
                count("refused");
                return None;
            };
            let mut next = Live::from_settings(&applied, h);
            next.kept = r.kept.clone();
            live.set(next, &applied.log);
            if r.kept.is_empty() {
                tracing::info!(policies = applied.policies.len(), "config reloaded");
                count("ok");
            } else {
                tracing::warn!(
                    policies = applied.policies.len(),
                    "config reloaded in part: the policies, overrides, forward-auth and descriptors applied; not applied, running as before: {}",
                    r.kept.join("; ")
                );
                count("partial");
            }
            Some(applied)
        }
    }
}

/// New credentials alone in `[store]`, beside policies that may apply, are tried live
/// first: if they authenticate they are in force, and the running settings with them
/// are what the rest is reviewed against; if not (`None`), they stay named among what
/// needs a restart.
async fn rotated(running: &Settings, new: &Settings, rotate: Option<&Rotate>) -> Option<Settings> {
    let policies_apply =
        global_refusal(running, new).is_none() && state_refusal(running, new).is_none();
    let (Some(rotate), Some(target), true) =
        (rotate, rotated_credentials(running, new), policies_apply)
    else {
        return None;
    };
    match rotate(target).await {
        Ok(()) => {
            tracing::info!(
                "config reload: the new [store] credentials authenticated and are in force"
            );
            let mut now_running = running.clone();
            now_running.store = new.store.clone();
            Some(now_running)
        }
        Err(e) => {
            tracing::warn!(
                "config reload: the new [store] credentials did not authenticate ({}); the old ones stay in use",
                e.kind()
            );
            None
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Region `eu` with peer `us` and global policy `g` (limit 100/s, burst `burst`,
    /// `escrow` lines in its `[policy.global]`, `version`), its `[[policy]]` ending with
    /// `extra` lines; `more` after it all (another policy).
    pub(crate) fn config(
        burst: u64,
        escrow: &str,
        version: u64,
        extra: &str,
        more: &str,
    ) -> Settings {
        let text = format!(
            r#"
region = "eu"
[store]
redis = "redis://127.0.0.1:6379"
[coordinator]
secret = "0123456789abcdef0123456789abcdef"
[[peer]]
region = "us"
url = "http://127.0.0.1:9"
[[policy]]
name = "g"
algorithm = "token_bucket"
limit = 100
window = "1s"
burst = {burst}
on_store_error = "closed"
{extra}
[policy.global]
{escrow}
version = {version}
{more}
"#
        );
        Settings::parse("t.toml", &text).unwrap_or_else(|e| panic!("{e}"))
    }

    fn split(escrow: &str, version: u64) -> Settings {
        config(100, escrow, version, "", "")
    }

    const EVEN: &str = "escrow = { eu = 1, us = 1 }";
    const SKEWED: &str = "escrow = { eu = 4, us = 1 }";

    #[test]
    fn a_resplit_applies_live_only_with_a_higher_version() {
        let old = split(EVEN, 1);
        assert_eq!(refusal(&old, &split(SKEWED, 2)), None);
        assert_eq!(refusal(&old, &split(EVEN, 2)), None, "a bump alone");
        let shadow = config(100, EVEN, 1, "shadow = true", "");
        assert_eq!(
            refusal(&old, &shadow),
            None,
            "shadow mode is the request path's"
        );
        let same_version = refusal(&old, &split(SKEWED, 1)).unwrap();
        assert!(
            same_version.contains("needs a higher policy.global.version (running 1)"),
            "{same_version}"
        );
        let back = refusal(&split(SKEWED, 3), &split(EVEN, 2)).unwrap();
        assert!(back.contains("version 2 is below the running 3"), "{back}");
    }

    #[test]
    fn a_global_rate_or_burst_and_the_set_of_global_policies_need_a_restart() {
        let old = split(EVEN, 1);
        let burst = refusal(&old, &config(50, EVEN, 2, "", "")).unwrap();
        assert!(burst.contains("only through a restart"), "{burst}");
        let lease = format!("{EVEN}\nlease = \"20s\"");
        let timing = refusal(&old, &config(100, &lease, 2, "", "")).unwrap();
        assert!(
            timing.starts_with("a global policy's lease and round"),
            "{timing}"
        );
        let maxmin = format!("{EVEN}\nallocation = \"maxmin\"");
        let mode = refusal(&old, &config(100, &maxmin, 2, "", "")).unwrap();
        assert!(mode.contains("only through a restart"), "{mode}");
        let another = r#"
[[policy]]
name = "h"
algorithm = "gcra"
limit = 10
window = "1s"
on_store_error = "closed"
[policy.global]
escrow = { eu = 1, us = 1 }
version = 1
"#;
        let added = refusal(&old, &config(100, EVEN, 1, "", another)).unwrap();
        assert!(added.contains("`h` is new"), "{added}");
        let removed = refusal(&config(100, EVEN, 1, "", another), &old).unwrap();
        assert!(removed.contains("`h` is gone"), "{removed}");
    }

    fn local(text: &str) -> Settings {
        Settings::parse("t.toml", text).unwrap_or_else(|e| panic!("{e}"))
    }

    const STORE: &str = "[store]\nredis = \"redis://127.0.0.1:6379\"\n";

    #[test]
    fn a_credential_change_is_refused_by_name_not_reported_applied() {
        let policy = "[[policy]]\nname = \"p\"\nalgorithm = \"gcra\"\nlimit = 5\nwindow = \"1s\"\n";
        let with = |extra: &str| local(&format!("{STORE}{extra}\n{policy}"));
        let old = with("password = \"one\"");
        assert_eq!(refusal(&old, &with("password = \"one\"")), None);
        for new in [
            with("password = \"two\""),
            with("password = \"one\"\nusername = \"u\""),
        ] {
            let why = refusal(&old, &new).expect("refused");
            assert!(why.starts_with("[store] credentials"), "{why}");
            assert!(
                !why.contains("one") && !why.contains("two"),
                "no secret in the reason: {why}"
            );
        }
        let other = with("password = \"one\"\ntimeout = \"70ms\"");
        assert!(refusal(&old, &other).unwrap().starts_with("[store] cannot"));
        // A peer's secret: named as a secret.
        let rotated = config(100, "escrow = { eu = 1, us = 1 }", 1, "", "").clone();
        let mut rotated_secret = rotated.clone();
        if let Some(g) = rotated_secret.global.as_mut() {
            g.peers[0].secret = Secret(b"another-secret-of-32-bytes-length".to_vec());
        }
        let why = refusal(&rotated, &rotated_secret).expect("refused");
        assert!(
            why.starts_with("the [coordinator] and [[peer]] secrets"),
            "{why}"
        );
    }

    /// A file applies in parts: what cannot change live (here `[log] format`, `[server]`)
    /// stays as it runs and is named, while the policies go in; a file that changes only
    /// such parts applies nothing.
    #[test]
    fn a_reload_applies_what_it_can_and_names_what_it_cannot() {
        let file = |format: &str, limit: u64| {
            local(&format!(
                "{STORE}[log]\nformat = \"{format}\"\n[[policy]]\nname = \"p\"\nalgorithm = \"fixed_window\"\nlimit = {limit}\nwindow = \"1h\"\n"
            ))
        };
        let old = file("text", 5);
        let only_fixed = review(&old, &file("json", 5));
        assert!(only_fixed.apply.is_none(), "{only_fixed:?}");
        assert!(
            only_fixed
                .refused
                .as_deref()
                .unwrap_or_default()
                .contains("[log] format"),
            "{only_fixed:?}"
        );
        let both = review(&old, &file("json", 9));
        let applied = both.apply.expect("the policies apply");
        assert_eq!(applied.policies[0].limit.get(), 9);
        assert_eq!(applied.log.format, old.log.format, "kept as it runs");
        assert_eq!(both.kept.len(), 1, "{:?}", both.kept);
        assert!(both.kept[0].contains("[log] format cannot change without a restart"));
        let whole = review(&old, &file("text", 9));
        assert!(whole.apply.is_some() && whole.kept.is_empty(), "{whole:?}");
    }

    #[test]
    fn what_a_keys_state_means_changes_only_with_a_higher_version() {
        let p = |alg: &str, window: &str, extra: &str| {
            local(&format!(
                "{STORE}[[policy]]\nname = \"p\"\nalgorithm = \"{alg}\"\nlimit = 5\nwindow = \"{window}\"\n{extra}"
            ))
        };
        let old = p("sliding_log", "1h", "");
        assert_eq!(refusal(&old, &p("sliding_log", "1h", "")), None);
        let limit = local(&format!(
            "{STORE}[[policy]]\nname = \"p\"\nalgorithm = \"sliding_log\"\nlimit = 9\nwindow = \"1h\"\n"
        ));
        assert_eq!(
            refusal(&old, &limit),
            None,
            "a limit keeps the state's meaning"
        );
        for new in [p("fixed_window", "1h", ""), p("sliding_log", "1m", "")] {
            let why = refusal(&old, &new).expect("refused");
            assert!(why.contains("raise policy.version above 1"), "{why}");
        }
        assert_eq!(refusal(&old, &p("sliding_log", "1m", "version = 2")), None);
        let v2 = p("sliding_log", "1m", "version = 2");
        let back = refusal(&v2, &p("sliding_log", "1m", "")).expect("refused");
        assert!(back.contains("version 1 is below the running 2"), "{back}");
        // An override with its own window: adding, changing or removing it is the same.
        let windowed = "[[policy.override]]\nkey = \"vip\"\nlimit = 50\nwindow = \"1m\"";
        assert!(refusal(&old, &p("sliding_log", "1h", windowed)).is_some());
        assert!(refusal(&p("sliding_log", "1h", windowed), &old).is_some());
        let same_window = "[[policy.override]]\nkey = \"vip\"\nlimit = 50";
        assert_eq!(refusal(&old, &p("sliding_log", "1h", same_window)), None);
        // A calendar period: another zone moves every period's bounds, another period or
        // a fixed window reads its counts in another window.
        let berlin = p("fixed_window", "month", "time_zone = \"Europe/Berlin\"");
        let tokyo = p("fixed_window", "month", "time_zone = \"Asia/Tokyo\"");
        assert_eq!(refusal(&berlin, &berlin), None);
        for new in [&tokyo, &p("fixed_window", "30d", "")] {
            let why = refusal(&berlin, new).expect("refused");
            assert!(why.contains("time zone"), "{why}");
        }
        let v2 = p(
            "fixed_window",
            "month",
            "time_zone = \"Asia/Tokyo\"\nversion = 2",
        );
        assert_eq!(refusal(&berlin, &v2), None);
    }
}
