//! The `quotad` binary: parse the command line, set up logging, hand over to the library.

#[cfg(feature = "demo")]
mod demo;
mod healthcheck;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use quotad_core::algorithm::Algorithm;
use quotad_daemon::{LogFormat, Settings};

/// Every request allocates a little (JSON, keys, headers): glibc's malloc was ~15% of the
/// daemon's CPU under load in perf; mimalloc's thread-local free lists cost a fraction.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "quotad",
    version,
    about = "Rate limits in Redis, decided atomically by Lua, over local HTTP"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon (no --config: embedded store on 127.0.0.1:8686, policy "default").
    Serve {
        #[arg(long, value_name = "PATH")]
        config: Option<PathBuf>,
    },
    /// Regions on this machine sharing one global budget: a redis-server each (the
    /// embedded store if none is on PATH), moving demand, a cut and a heal, a live table.
    #[cfg(feature = "demo")]
    Demo {
        /// How many regions (2 to 10).
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(2..=demo::MAX_REGIONS as i64))]
        regions: u16,
        /// Use the embedded store even when redis-server is on PATH.
        #[arg(long)]
        embedded: bool,
        /// Also offer this many keys of a second global policy (`bulk`), spread over the
        /// regions, and print what their exchange cost at the end (0 to 100,000).
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=demo::MAX_KEYS as i64))]
        keys: u32,
        /// Stop after this long (the script takes about 85 s).
        #[arg(long, default_value = "85s", value_parser = humantime::parse_duration)]
        duration: std::time::Duration,
    },
    /// Check a config file: exit 0 if valid, else print every error and exit 1.
    Validate { path: PathBuf },
    /// Ask the daemon this config describes for GET /healthz: exit 0 if it answers 200
    /// within 2 s, else 1 (the container image's health check).
    Healthcheck {
        #[arg(long, value_name = "PATH")]
        config: PathBuf,
    },
    /// Simulate global budgets: quotad's leases against the baselines, scenarios S1-S18 of
    /// docs/simulator.md, invariant S checked after every event (exit 1 if it breaks).
    Sim(SimArgs),
    /// Print the Lua script quotad sends to Redis for an algorithm (for redis-benchmark).
    Script {
        #[arg(value_parser = parse_algorithm)]
        algorithm: Algorithm,
    },
}

#[derive(clap::Args)]
struct SimArgs {
    /// Every scenario, S1 to S16 (S17 and S18, heavy, only by name).
    #[arg(long, conflicts_with = "scenario")]
    all: bool,
    /// Scenarios to run (S1 ... S18); repeatable.
    #[arg(long, value_name = "ID")]
    scenario: Vec<String>,
    /// Seeds per scenario.
    #[arg(long, default_value_t = 30)]
    seeds: u64,
    /// Run the Zipf scenarios (S14, S17, S18) with this many keys, their total demand
    /// scaled with it (S18 at 100,000 keys: `--scenario S18 --keys 100000`).
    #[arg(long)]
    keys: Option<u32>,
    /// The first seed (seeds run from here up).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Modes to run, comma-separated (central is always run: figures are relative to it).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "central,lease,static,independent,count_sharing,naive",
        value_parser = parse_mode
    )]
    modes: Vec<quotad_sim::ModeKind>,
    /// Also write the rows as a JSON array to PATH.
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
    /// Also write one SVG per scenario (enforced share vs demand, lease, first seed) to DIR.
    #[arg(long, value_name = "DIR")]
    plot: Option<PathBuf>,
    /// Worker threads (default: the number of CPUs).
    #[arg(long)]
    threads: Option<usize>,
}

fn parse_mode(s: &str) -> Result<quotad_sim::ModeKind, String> {
    quotad_sim::ModeKind::parse(s).ok_or_else(|| {
        "expected central, lease, static, independent, count_sharing or naive".to_owned()
    })
}

fn sim(args: SimArgs) -> ExitCode {
    use quotad_sim::{Scenario, SuiteOptions, report};
    let scenarios = if args.all || args.scenario.is_empty() {
        Scenario::all()
    } else {
        let mut out = Vec::new();
        for id in &args.scenario {
            match Scenario::by_id(id) {
                Some(s) => out.push(s),
                None => {
                    eprintln!("unknown scenario {id:?}: expected S1 ... S18");
                    return ExitCode::FAILURE;
                }
            }
        }
        out
    };
    let scenarios = match args.keys {
        None => scenarios,
        Some(keys) => match scenarios
            .into_iter()
            .map(|s| s.with_keys(keys))
            .collect::<Result<Vec<_>, _>>()
        {
            Ok(s) => s,
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
        },
    };
    if args.seeds == 0 {
        eprintln!("--seeds must be at least 1");
        return ExitCode::FAILURE;
    }
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let started = std::time::Instant::now();
    let suite = quotad_sim::run_suite(&SuiteOptions {
        scenarios,
        modes: args.modes,
        first_seed: args.seed,
        seeds: args.seeds,
        threads,
    });
    let elapsed = started.elapsed();
    print!("{}", report::table(&suite.rows));
    eprintln!(
        "{} runs in {:.1} s on {threads} threads",
        suite
            .rows
            .iter()
            .map(|r| r.seeds + r.violations)
            .sum::<u64>(),
        elapsed.as_secs_f64()
    );
    if let Some(path) = &args.json
        && let Err(e) = std::fs::write(path, report::json(&suite.rows))
    {
        eprintln!("cannot write {}: {e}", path.display());
        return ExitCode::FAILURE;
    }
    if let Some(dir) = &args.plot {
        if let Err(e) = std::fs::create_dir_all(dir) {
            eprintln!("cannot create {}: {e}", dir.display());
            return ExitCode::FAILURE;
        }
        for (sc, samples) in &suite.plots {
            let path = dir.join(format!("{}.svg", sc.id));
            if let Err(e) = std::fs::write(&path, report::svg(sc, samples)) {
                eprintln!("cannot write {}: {e}", path.display());
                return ExitCode::FAILURE;
            }
        }
    }
    let broken: Vec<_> = suite
        .violations
        .iter()
        .filter(|v| v.mode.promises_bound())
        .collect();
    for v in broken.iter().take(3) {
        eprintln!("{v}");
    }
    if broken.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!("{} runs broke invariant S", broken.len());
        ExitCode::FAILURE
    }
}

fn parse_algorithm(s: &str) -> Result<Algorithm, String> {
    Algorithm::ALL
        .into_iter()
        .find(|a| a.name() == s)
        .ok_or_else(|| {
            "expected fixed_window, sliding_log, sliding_window, token_bucket or gcra".to_owned()
        })
}

/// What `validate` found, in English: "1 policy", "N policies" ("1 policies" read as a
/// typo in operators' CI logs).
fn policies_found(n: usize) -> String {
    match n {
        1 => "1 policy".to_owned(),
        n => format!("{n} policies"),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Validate { path } => match Settings::load(&path) {
            Ok(s) => {
                println!(
                    "{}: ok ({})",
                    path.display(),
                    policies_found(s.policy_count())
                );
                ExitCode::SUCCESS
            }
            Err(errors) => {
                eprintln!("{errors}");
                ExitCode::FAILURE
            }
        },
        Command::Healthcheck { config } => match Settings::load(&config) {
            Ok(s) => match healthcheck::probe(s.listen()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("unhealthy: {e}");
                    ExitCode::FAILURE
                }
            },
            Err(errors) => {
                eprintln!("{errors}");
                ExitCode::FAILURE
            }
        },
        Command::Sim(args) => sim(args),
        #[cfg(feature = "demo")]
        Command::Demo {
            regions,
            embedded,
            keys,
            duration,
        } => demo(usize::from(regions), embedded, keys as usize, duration),
        Command::Script { algorithm } => {
            print!("{}", quotad_daemon::script_source(algorithm));
            ExitCode::SUCCESS
        }
        Command::Serve { config } => {
            // Errors that stop the start are printed before the log exists (its format is
            // in the file being read).
            let settings = match config {
                None => Settings::builtin(),
                Some(path) => match Settings::load(&path) {
                    Ok(s) => s,
                    Err(errors) => {
                        eprintln!("{errors}");
                        return ExitCode::FAILURE;
                    }
                },
            };
            init_tracing_at("info", settings.log_format());
            serve(settings)
        }
    }
}

#[cfg(feature = "demo")]
fn demo(regions: usize, embedded: bool, keys: usize, duration: std::time::Duration) -> ExitCode {
    // The table is the output: daemons log warnings only (RUST_LOG overrides).
    init_tracing_at("warn", LogFormat::Text);
    until_signal(|stop| async move {
        let demo = demo::Demo {
            regions,
            embedded,
            keys,
            duration,
        };
        tokio::task::spawn_blocking(move || demo::run(demo, stop))
            .await
            .map_err(|e| eprintln!("demo failed: {e}"))?
            .map_err(|e| eprintln!("demo failed: {e}"))
    })
}

/// Runs `f` on a multi-threaded runtime with a token that SIGTERM / SIGINT cancel.
fn until_signal<F, Fut>(f: F) -> ExitCode
where
    F: FnOnce(CancellationToken) -> Fut,
    Fut: std::future::Future<Output = Result<(), ()>>,
{
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let token = CancellationToken::new();
        tokio::spawn(on_signal(token.clone()));
        match f(token).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(()) => ExitCode::FAILURE,
        }
    })
}

/// The log on stderr at `default` level (RUST_LOG overrides), as text or one JSON object
/// per line (`[log] format`).
fn init_tracing_at(default: &str, format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let log = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => log
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
        // {"timestamp":..,"level":..,"message":..,<fields>,"target":..}: the event's
        // fields beside the message, where log pipelines look for them.
        LogFormat::Json => log.json().flatten_event(true).init(),
    }
}

fn serve(settings: Settings) -> ExitCode {
    let _ = quotad_daemon::REVISION.set(env!("QUOTAD_REVISION"));
    until_signal(|shutdown| async move {
        quotad_daemon::run(settings, shutdown)
            .await
            .map_err(|e| tracing::error!("{e}"))
    })
}

/// Cancels `shutdown` on SIGTERM or SIGINT; a second one exits at once (an operator who
/// does not want to wait for the drain). SIGHUP reloads the config file (the daemon's
/// reload task has its own handler); SIGUSR1 and SIGUSR2 are logged and ignored. All three
/// are caught here so that their default action, which would kill the daemon without a
/// drain, never runs (not even without a config file to reload).
async fn on_signal(shutdown: CancellationToken) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut ignored = Vec::new();
        for (kind, name) in [
            (SignalKind::hangup(), "SIGHUP"),
            (SignalKind::user_defined1(), "SIGUSR1"),
            (SignalKind::user_defined2(), "SIGUSR2"),
        ] {
            match signal(kind) {
                Ok(s) => ignored.push((s, name)),
                Err(e) => tracing::error!("cannot install the {name} handler: {e}"),
            }
        }
        for (mut s, name) in ignored {
            tokio::spawn(async move {
                while s.recv().await.is_some() {
                    if name != "SIGHUP" {
                        tracing::info!(signal = name, "signal received and ignored");
                    }
                }
            });
        }
        let mut term = match signal(SignalKind::terminate()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::error!("cannot install the SIGTERM handler: {e}");
                None
            }
        };
        let mut int = signal(SignalKind::interrupt()).ok();
        let first = stop_signal(&mut term, &mut int).await;
        tracing::info!(signal = first, "shutdown requested");
        shutdown.cancel();
        let second = stop_signal(&mut term, &mut int).await;
        tracing::warn!(
            signal = second,
            "second signal: exiting now without draining"
        );
        std::process::exit(1);
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
        shutdown.cancel();
    }
}

/// The next SIGTERM or SIGINT (whichever handlers could be installed).
#[cfg(unix)]
async fn stop_signal(
    term: &mut Option<tokio::signal::unix::Signal>,
    int: &mut Option<tokio::signal::unix::Signal>,
) -> &'static str {
    async fn recv(s: &mut Option<tokio::signal::unix::Signal>) {
        let received = match s {
            Some(s) => s.recv().await.is_some(),
            None => false,
        };
        if !received {
            std::future::pending::<()>().await;
        }
    }
    tokio::select! {
        _ = recv(term) => "SIGTERM",
        _ = recv(int) => "SIGINT",
    }
}
