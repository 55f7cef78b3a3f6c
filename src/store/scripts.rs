//! The Lua limiter scripts: one file per algorithm in `lua/`, each prefixed at build time
//! with `lua/prelude.lua` (argument parsing and the clock, kept in one place).
//!
//! The SHA1 of each script is computed here, so quotad can `EVALSHA` straight away and
//! `SCRIPT LOAD` only when Redis says NOSCRIPT (first use, `SCRIPT FLUSH`, a restart).

use crate::algorithm::Algorithm;

macro_rules! script {
    ($file:literal) => {
        concat!(
            include_str!("../../lua/prelude.lua"),
            include_str!(concat!("../../lua/", $file))
        )
    };
}

/// The full source sent to Redis for `algorithm`.
pub fn source(algorithm: Algorithm) -> &'static str {
    match algorithm {
        Algorithm::FixedWindow => script!("fixed_window.lua"),
        Algorithm::SlidingLog => script!("sliding_log.lua"),
        Algorithm::SlidingWindow => script!("sliding_window.lua"),
        Algorithm::TokenBucket => script!("token_bucket.lua"),
        Algorithm::Gcra => script!("gcra.lua"),
    }
}

/// Every script with its SHA1, built once at start-up.
#[derive(Debug)]
pub struct Scripts {
    /// Indexed like [`Algorithm::ALL`].
    scripts: [redis::Script; 5],
}

impl Default for Scripts {
    fn default() -> Self {
        Scripts {
            scripts: Algorithm::ALL.map(|a| redis::Script::new(source(a))),
        }
    }
}

impl Scripts {
    pub fn sha(&self, algorithm: Algorithm) -> &str {
        self.scripts[algorithm.index()].get_hash()
    }
}
