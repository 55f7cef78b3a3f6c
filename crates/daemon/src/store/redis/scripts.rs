//! The Lua limiter scripts: one file per algorithm in `lua/`, each prefixed at build time
//! with `lua/helpers.lua` (TTLs, replies) and `lua/prelude.lua` (argument parsing and the
//! clock), kept in one place. The composite script (`lua/composite.lua`) runs the same
//! algorithm files, each wrapped at build time in a function whose parameters are the
//! prelude's names, so there is no second copy of any algorithm.
//!
//! The SHA1 of each script is computed here, so quotad can `EVALSHA` straight away and
//! `SCRIPT LOAD` only when Redis says NOSCRIPT (first use, `SCRIPT FLUSH`, a restart).

use std::fmt;

use quotad_core::algorithm::{Algorithm, Limits};
use quotad_core::calendar::Periods;

/// A reader's numbers as the scripts take them for the transition rule
/// (`lua/helpers.lua`, `quotad_core::algorithm::frame`): the frame, `limit:window_us:burst`,
/// compared whole with a key's; and since when they are in force, its version and instant
/// each written as its digits after a letter that counts them (`b1n1765432100000`), so
/// that a newer one compares greater as a string. Every key keeps one: 16 bytes for
/// version 1 today, where zero-padding took 33.
pub fn frame_args(l: &Limits) -> (String, String) {
    (
        format!("{}:{}:{}", l.limit, l.window_us, l.burst),
        format!("{}{}", ordered(l.since.version), ordered(l.since.at_ms)),
    )
}

/// A script's window argument (`lua/prelude.lua`, ARGV[3]): the window in µs, or a fixed
/// window's calendar periods around now (`lua/helpers.lua`, `window_enter`).
#[derive(Debug, Clone)]
pub enum WindowArg {
    /// A window or refill period of fixed length, µs.
    Fixed(i64),
    /// A fixed window of calendar periods: [`Periods::script_arg`].
    Calendar(String),
}

/// The window argument of a call with `l` and `periods`.
pub fn window_arg(l: &Limits, periods: Option<&Periods>) -> WindowArg {
    match periods {
        Some(p) => WindowArg::Calendar(p.script_arg()),
        None => WindowArg::Fixed(l.window_us),
    }
}

impl fmt::Display for WindowArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WindowArg::Fixed(us) => write!(f, "{us}"),
            WindowArg::Calendar(table) => f.write_str(table),
        }
    }
}

impl redis::ToRedisArgs for WindowArg {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + redis::RedisWrite,
    {
        match self {
            WindowArg::Fixed(us) => us.write_redis_args(out),
            WindowArg::Calendar(table) => table.write_redis_args(out),
        }
    }
}

/// `n`'s digits after a letter for how many there are (`b` for one, up to `u` for twenty):
/// equal-length numbers compare as their digits do, and a shorter one is smaller, so the
/// strings order as the numbers.
fn ordered(n: u64) -> String {
    let digits = n.to_string();
    let count = char::from(b'a' + digits.len() as u8);
    format!("{count}{digits}")
}

/// A file of the top-level `lua/` folder, compiled in.
macro_rules! lua {
    ($($part:literal),+) => {
        include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../lua/", $($part),+))
    };
}

macro_rules! script {
    ($file:literal) => {
        concat!(lua!("helpers.lua"), lua!("prelude.lua"), lua!($file))
    };
}

/// An algorithm's file as a Lua function of the prelude's names.
macro_rules! algorithm_function {
    ($name:literal) => {
        concat!(
            "local function ",
            $name,
            "(key, refund, limit, window, burst, cost, member, now, write, eval_cost, charge, F, V)\n",
            lua!($name, ".lua"),
            "\nend\n"
        )
    };
}

/// The all-or-nothing script of a co-location group (see `lua/composite.lua`).
pub const COMPOSITE: &str = concat!(
    lua!("helpers.lua"),
    algorithm_function!("fixed_window"),
    algorithm_function!("sliding_log"),
    algorithm_function!("sliding_window"),
    algorithm_function!("token_bucket"),
    algorithm_function!("gcra"),
    lua!("composite.lua"),
);

/// Reservations of an estimated cost and their settlement at the real one (see
/// `lua/settle.lua`; the model is `quotad_core::settlement`), over the algorithms that can
/// hold a debt, wrapped as for the composite script.
pub const SETTLE: &str = concat!(
    lua!("helpers.lua"),
    algorithm_function!("fixed_window"),
    algorithm_function!("token_bucket"),
    algorithm_function!("gcra"),
    lua!("settle.lua"),
);

/// A reset: the key's state forgotten and the invalidation published, atomically (see
/// `lua/reset.lua`).
pub(crate) const RESET: &str = lua!("reset.lua");

/// Changes of a policy's runtime limits (see `lua/runtime_limit.lua`).
pub(crate) const RUNTIME_LIMIT: &str = lua!("runtime_limit.lua");

/// Hot-key slices of a fixed window: takes and returns (see `lua/slice.lua`).
pub const SLICE: &str = concat!(
    lua!("helpers.lua"),
    algorithm_function!("fixed_window"),
    lua!("slice.lua")
);

/// Hot-key slices of a token bucket or GCRA key: takes and returns (see
/// `lua/bucket_slice.lua`).
pub const BUCKET_SLICE: &str = concat!(
    lua!("helpers.lua"),
    algorithm_function!("token_bucket"),
    algorithm_function!("gcra"),
    lua!("bucket_slice.lua")
);

/// Concurrency limits: acquire, release, extend and peek of leases (see
/// `lua/concurrency.lua`; its reference model is `quotad_core::concurrency`).
pub const CONCURRENCY: &str = concat!(lua!("helpers.lua"), lua!("concurrency.lua"));

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
        concat!(lua!("global/common.lua"), lua!("global/", $file))
    };
}

/// The scripts of global policies (`lua/global/`), each prefixed with `common.lua`: the
/// decision, and the coordinator's writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Global {
    /// A decision on a global policy's key.
    Check,
    /// The coordinator's write of lease books.
    WriteBook,
    /// The coordinator's drop of a region's loans.
    DropLoans,
    /// The coordinator's write of the default escrow.
    SetDefault,
}

impl Global {
    /// Every script, for the tests that load them all.
    #[cfg(feature = "testing")]
    pub const ALL: [Global; 4] = [
        Global::Check,
        Global::WriteBook,
        Global::DropLoans,
        Global::SetDefault,
    ];

    /// The full source sent to Redis.
    pub fn source(self) -> &'static str {
        match self {
            Global::Check => global_script!("check.lua"),
            Global::WriteBook => global_script!("write_book.lua"),
            Global::DropLoans => global_script!("drop_loans.lua"),
            Global::SetDefault => global_script!("set_default.lua"),
        }
    }

    /// The script, to load or invoke.
    pub fn script(self) -> redis::Script {
        redis::Script::new(self.source())
    }
}

/// Every script with its SHA1, built once at start-up.
#[derive(Debug)]
pub(crate) struct Scripts {
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
    pub(crate) fn sha(&self, algorithm: Algorithm) -> &str {
        self.scripts[algorithm.index()].get_hash()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use quotad_core::algorithm::Since;

    /// What the scripts compare as strings orders as `Since` does, at the edges of every
    /// digit count and for the instants a clock gives.
    #[test]
    fn a_since_compares_as_a_string_as_it_does_as_numbers() {
        let edges = [
            0,
            1,
            9,
            10,
            99,
            100,
            1_765_432_100_000,
            9_999_999_999_999,
            u64::MAX,
        ];
        let sinces: Vec<Since> = edges
            .iter()
            .flat_map(|&version| edges.iter().map(move |&at_ms| Since { version, at_ms }))
            .collect();
        let text = |s: &Since| {
            let l = Limits {
                limit: 1,
                window_us: 1,
                burst: 1,
                since: *s,
            };
            frame_args(&l).1
        };
        for a in &sinces {
            for b in &sinces {
                assert_eq!(text(a).cmp(&text(b)), a.cmp(b), "{a:?} against {b:?}");
            }
        }
        assert_eq!(
            text(&Since {
                version: 1,
                at_ms: 1_765_432_100_000
            }),
            "b1n1765432100000"
        );
    }
}
