//! The Lua limiter scripts: one file per algorithm in `lua/`, each prefixed at build time
//! with `lua/helpers.lua` (TTLs, replies) and `lua/prelude.lua` (argument parsing and the
//! clock), kept in one place. The composite script (`lua/composite.lua`) runs the same
//! algorithm files, each wrapped at build time in a function whose parameters are the
//! prelude's names, so there is no second copy of any algorithm.
//!
//! The SHA1 of each script is computed here, so quotad can `EVALSHA` straight away and
//! `SCRIPT LOAD` only when Redis says NOSCRIPT (first use, `SCRIPT FLUSH`, a restart).

use quotad_core::algorithm::{Algorithm, Limits};

/// A reader's numbers as the scripts take them for the transition rule
/// (`lua/helpers.lua`, `quotad_core::algorithm::frame`): the frame, `limit:window_us:burst`,
/// compared whole with a key's; and since when they are in force, zero-padded, so that a
/// newer one compares greater as a string.
pub fn frame_args(l: &Limits) -> (String, String) {
    (
        format!("{}:{}:{}", l.limit, l.window_us, l.burst),
        format!("{:020}{:013}", l.since.version, l.since.at_ms),
    )
}

macro_rules! script {
    ($file:literal) => {
        concat!(
            include_str!("../../lua/helpers.lua"),
            include_str!("../../lua/prelude.lua"),
            include_str!(concat!("../../lua/", $file))
        )
    };
}

/// An algorithm's file as a Lua function of the prelude's names.
macro_rules! algorithm_function {
    ($name:literal) => {
        concat!(
            "local function ",
            $name,
            "(key, refund, limit, window, burst, cost, member, now, write, eval_cost, charge, F, V)\n",
            include_str!(concat!("../../lua/", $name, ".lua")),
            "\nend\n"
        )
    };
}

/// The all-or-nothing script of a co-location group (see `lua/composite.lua`).
pub const COMPOSITE: &str = concat!(
    include_str!("../../lua/helpers.lua"),
    algorithm_function!("fixed_window"),
    algorithm_function!("sliding_log"),
    algorithm_function!("sliding_window"),
    algorithm_function!("token_bucket"),
    algorithm_function!("gcra"),
    include_str!("../../lua/composite.lua"),
);

/// Reservations of an estimated cost and their settlement at the real one (see
/// `lua/settle.lua`; the model is `quotad_core::settlement`), over the algorithms that can
/// hold a debt, wrapped as for the composite script.
pub const SETTLE: &str = concat!(
    include_str!("../../lua/helpers.lua"),
    algorithm_function!("fixed_window"),
    algorithm_function!("token_bucket"),
    algorithm_function!("gcra"),
    include_str!("../../lua/settle.lua"),
);

/// A reset: the key's state forgotten and the invalidation published, atomically (see
/// `lua/reset.lua`).
pub const RESET: &str = include_str!("../../lua/reset.lua");

/// Hot-key slices of a fixed window: takes and returns (see `lua/slice.lua`).
pub const SLICE: &str = concat!(
    include_str!("../../lua/helpers.lua"),
    algorithm_function!("fixed_window"),
    include_str!("../../lua/slice.lua")
);

/// Hot-key slices of a token bucket or GCRA key: takes and returns (see
/// `lua/bucket_slice.lua`).
pub const BUCKET_SLICE: &str = concat!(
    include_str!("../../lua/helpers.lua"),
    algorithm_function!("token_bucket"),
    algorithm_function!("gcra"),
    include_str!("../../lua/bucket_slice.lua")
);

/// Concurrency limits: acquire, release, extend and peek of leases (see
/// `lua/concurrency.lua`; its reference model is `quotad_core::concurrency`).
pub const CONCURRENCY: &str = concat!(
    include_str!("../../lua/helpers.lua"),
    include_str!("../../lua/concurrency.lua")
);

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

macro_rules! global_script {
    ($file:literal) => {
        concat!(
            include_str!("../../lua/global/common.lua"),
            include_str!(concat!("../../lua/global/", $file))
        )
    };
}

/// The scripts of global policies (`lua/global/`), each prefixed with `common.lua`: the
/// decision, and the coordinator's writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Global {
    Check,
    WriteBook,
    DropLoans,
    SetDefault,
}

impl Global {
    pub const ALL: [Global; 4] = [
        Global::Check,
        Global::WriteBook,
        Global::DropLoans,
        Global::SetDefault,
    ];

    pub fn source(self) -> &'static str {
        match self {
            Global::Check => global_script!("check.lua"),
            Global::WriteBook => global_script!("write_book.lua"),
            Global::DropLoans => global_script!("drop_loans.lua"),
            Global::SetDefault => global_script!("set_default.lua"),
        }
    }

    pub fn script(self) -> redis::Script {
        redis::Script::new(self.source())
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
