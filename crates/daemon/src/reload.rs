//! Hot reload: SIGHUP, or a change of the config file seen on disk (checked every second),
//! reloads the policies, their per-key overrides, forward-auth settings and Envoy
//! descriptors without a
//! restart. Keys keep their state: it lives in the store, under names that do not change.
//!
//! A new file is validated exactly as `quotad validate` does; with errors it is refused,
//! each error logged with file, line and field, and the running config stays. A valid
//! file that changes what cannot change live (listen addresses and other `[server]`
//! settings, `[store]`, the region, peers and coordinator, or a global policy) is refused
//! with the reason. Every attempt is counted in `quotad_config_reloads_total{result}`;
//! the loaded file's hash is in `GET /v1/policies`.

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
            policies: Policies::new(settings.policies.iter().cloned())
                .with_overrides(settings.overrides.clone()),
            forward_auth: settings.forward_auth.clone(),
            descriptors: settings.descriptors.clone(),
            hash,
        }
    }
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
    let globals = |s: &Settings| {
        s.policies
            .iter()
            .filter(|p| p.global.is_some())
            .map(|p| format!("{p:?}"))
            .collect::<Vec<_>>()
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
        ("[coordinator] and [[peer]]", same(&old.global, &new.global)),
        (
            "global policies (change them through a restart with a new version)",
            globals(old) == globals(new),
        ),
    ];
    fixed
        .iter()
        .find(|(_, ok)| !ok)
        .map(|(what, _)| format!("{what} cannot change without a restart"))
}

fn stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

/// Reloads on SIGHUP and when the file at `path` changes, until `stop`. `running` is the
/// config the daemon was started with (what cannot change is compared against it).
pub async fn watch(
    path: PathBuf,
    running: Settings,
    live: Arc<LiveConfig>,
    metrics: Arc<Metrics>,
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
            reload(&path, &running, &live, &metrics, asked);
        }
    }
}

fn reload(path: &Path, running: &Settings, live: &LiveConfig, metrics: &Metrics, asked: bool) {
    let count = |result: &str| metrics.config_reloads.with_label_values(&[result]).inc();
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!(file = %path.display(), "config reload: cannot read the file: {e}; the running config stays");
            count("invalid");
            return;
        }
    };
    let h = hash(&bytes);
    if h == live.get().hash {
        if asked {
            tracing::info!("config reload: the file is unchanged");
        }
        return;
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
        }
        Ok(new) => match refusal(running, &new) {
            Some(why) => {
                tracing::warn!("config reload refused: {why}; the running config stays");
                count("refused");
            }
            None => {
                live.set(Live::from_settings(&new, h));
                tracing::info!(policies = new.policies.len(), "config reloaded");
                count("ok");
            }
        },
    }
}
