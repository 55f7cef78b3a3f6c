//! Hot reload: SIGHUP, or a change of the config file seen on disk (checked every second),
//! reloads the policies, their per-key overrides, forward-auth settings and Envoy
//! descriptors without a restart. Keys keep their state: it lives in the store, under
//! names that do not change.
//!
//! A new file is validated exactly as `quotad validate` does; with errors it is refused,
//! each error logged with file, line and field, and the running config stays. A valid
//! file that changes what cannot change live (listen addresses and other `[server]`
//! settings, `[store]`, the region, peers and coordinator, a global policy's rate, or a
//! re-split without a new version) is refused with the reason. A re-split with a higher
//! `policy.global.version` goes to the coordinator, which applies it decrease-first.
//! Every attempt is counted in `quotad_config_reloads_total{result}`; the loaded file's
//! hash is in `GET /v1/policies`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use crate::config::{Descriptors, ForwardAuths, Settings};
use crate::metrics::Metrics;
use crate::policy::Policies;

/// How often the file's modification time and length are looked at.
const POLL: Duration = Duration::from_secs(1);

/// What a reload replaces: read by every request.
pub struct Live {
    pub policies: Policies,
    pub forward_auth: ForwardAuths,
    /// `[[descriptor]]`: what the gRPC service maps Envoy's descriptors to.
    pub descriptors: Descriptors,
    /// SHA-256 of the config file (hex); "builtin" without one.
    pub hash: String,
}

impl Live {
    pub fn from_settings(settings: &Settings, hash: String) -> Live {
        Live {
            policies: policies(settings),
            forward_auth: settings.forward_auth.clone(),
            descriptors: settings.descriptors.clone(),
            hash,
        }
    }
}

/// The policies of `settings` with their per-key overrides, as a reload puts them in force.
pub fn policies(settings: &Settings) -> Policies {
    Policies::new(settings.policies.iter().cloned()).with_overrides(settings.overrides.clone())
}

/// The live config, swapped whole by a reload. A std RwLock: held only to clone the Arc.
pub struct LiveConfig(RwLock<Arc<Live>>);

impl LiveConfig {
    pub fn new(live: Live) -> Self {
        LiveConfig(RwLock::new(Arc::new(live)))
    }

    pub fn get(&self) -> Arc<Live> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn set(&self, live: Live) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(live);
    }
}

/// SHA-256 of a config file's bytes, hex.
pub fn hash(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Why `new` cannot replace `old` in a running daemon; `None` when it can.
pub fn refusal(old: &Settings, new: &Settings) -> Option<String> {
    let same =
        |a: &dyn std::fmt::Debug, b: &dyn std::fmt::Debug| format!("{a:?}") == format!("{b:?}");
    let timing = |s: &Settings| {
        s.global
            .as_ref()
            .map(|g| (g.params.lease_us, g.params.round_us))
    };
    let fixed: [(&str, bool); 5] = [
        ("region", old.region == new.region),
        ("[server]", same(&old.server, &new.server)),
        (
            "[store]",
            same(&old.store, &new.store)
                && old.key_prefix == new.key_prefix
                && old.memory_max_keys == new.memory_max_keys,
        ),
        // Set in [policy.global] but one for the whole coordinator: named as written.
        (
            "a global policy's lease and round",
            timing(old) == timing(new),
        ),
        ("[coordinator] and [[peer]]", same(&old.global, &new.global)),
    ];
    fixed
        .iter()
        .find(|(_, ok)| !ok)
        .map(|(what, _)| format!("{what} cannot change without a restart"))
        .or_else(|| global_refusal(old, new))
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

fn stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

/// Told of every config a reload put in force (the coordinator installs new versions of
/// global policies from it).
pub type OnReload = Box<dyn Fn(&Live) + Send + Sync>;

/// Reloads on SIGHUP and when the file at `path` changes, until `stop`. `running` is the
/// config the daemon was started with, then the last one reloaded (what cannot change,
/// and global policies' versions, are compared against it).
pub async fn watch(
    path: PathBuf,
    mut running: Settings,
    live: Arc<LiveConfig>,
    metrics: Arc<Metrics>,
    on_reload: OnReload,
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
    let mut seen = stamp(&path);
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
        let now = stamp(&path);
        if asked || now != seen {
            seen = now;
            if let Some(new) = reload(&path, &running, &live, &metrics, asked) {
                on_reload(&live.get());
                running = new;
            }
        }
    }
}

/// One reload attempt; the settings put in force, if any.
fn reload(
    path: &Path,
    running: &Settings,
    live: &LiveConfig,
    metrics: &Metrics,
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
    if h == live.get().hash {
        if asked {
            tracing::info!("config reload: the file is unchanged");
        }
        return None;
    }
    let text = String::from_utf8_lossy(&bytes);
    match Settings::parse(&path.display().to_string(), &text) {
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
        Ok(new) => match refusal(running, &new) {
            Some(why) => {
                tracing::warn!("config reload refused: {why}; the running config stays");
                count("refused");
                None
            }
            None => {
                live.set(Live::from_settings(&new, h));
                tracing::info!(policies = new.policies.len(), "config reloaded");
                count("ok");
                Some(new)
            }
        },
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
}
