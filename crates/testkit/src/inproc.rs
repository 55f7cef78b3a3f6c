//! A daemon served inside the test process: `quotad_daemon::serve` on a listener the
//! kit bound, in a runtime thread of its own, stopped through its shutdown token.
//!
//! It runs the same composition root as `quotad serve`, against the same real
//! `redis-server`; what it does not have is a process boundary (no signals, no SIGKILL),
//! which is why tests of those spawn the binary instead.

use std::net::TcpListener;
use std::sync::{Mutex, Once};
use std::thread::JoinHandle;
use std::time::Duration;

use quotad_daemon::Settings;
use tokio_util::sync::CancellationToken;

pub struct InProcess {
    stop: CancellationToken,
    thread: Option<JoinHandle<()>>,
}

/// Panic messages seen in this process since the kit's hook was installed.
static PANICS: Mutex<Vec<String>> = Mutex::new(Vec::new());
static HOOK: Once = Once::new();

/// Records every panic (a handler task's panic does not fail the test by itself: tokio
/// contains it), then lets the default hook print it; and sends the daemon's log to the
/// test's output.
fn record_panics() {
    HOOK.call_once(|| {
        // The daemon's warnings (a janitor's failed sweep, a refused reload) in the test's
        // captured output, which the runner prints when the test fails. `RUST_LOG` widens it.
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_test_writer()
            .try_init();
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if let Ok(mut p) = PANICS.lock() {
                p.push(format!("panicked: {info}"));
            }
            previous(info);
        }));
    });
}

/// The panics recorded so far, one per line.
pub fn panics() -> String {
    PANICS.lock().map(|p| p.join("\n")).unwrap_or_default()
}

impl InProcess {
    /// Parses `config` (panicking with its errors if it is invalid: a test's config is
    /// part of the test) and serves it on `listener`.
    pub fn start(config: &str, listener: TcpListener) -> InProcess {
        record_panics();
        // No load balancer to tell: a test's daemon stops at once.
        let settings = Settings::parse("test.toml", config)
            .unwrap_or_else(|e| panic!("invalid test config:\n{e}\n{config}"))
            .without_shutdown_delay();
        listener.set_nonblocking(true).expect("nonblocking");
        let stop = CancellationToken::new();
        let token = stop.clone();
        let thread = std::thread::Builder::new()
            .name("quotad-in-process".into())
            .spawn(move || {
                let rt = crate::runtime();
                rt.block_on(async move {
                    let listener =
                        tokio::net::TcpListener::from_std(listener).expect("tokio listener");
                    if let Err(e) = quotad_daemon::serve(settings, listener, token).await {
                        panic!("the in-process daemon failed: {e}");
                    }
                });
                rt.shutdown_timeout(Duration::from_secs(1));
            })
            .expect("spawn the daemon's thread");
        InProcess {
            stop,
            thread: Some(thread),
        }
    }

    /// Shuts the daemon down as SIGTERM would (without the delay) and waits for it.
    pub fn stop(mut self) {
        self.stop.cancel();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
