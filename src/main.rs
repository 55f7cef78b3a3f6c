//! The `quotad` binary: parse the command line, set up logging, hand over to the library.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use quotad::algorithm::Algorithm;
use quotad::config::Settings;

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
    /// Check a config file: exit 0 if valid, else print every error and exit 1.
    Validate { path: PathBuf },
    /// Print the Lua script quotad sends to Redis for an algorithm (for redis-benchmark).
    Script {
        #[arg(value_parser = parse_algorithm)]
        algorithm: Algorithm,
    },
}

fn parse_algorithm(s: &str) -> Result<Algorithm, String> {
    Algorithm::ALL
        .into_iter()
        .find(|a| a.name() == s)
        .ok_or_else(|| {
            "expected fixed_window, sliding_log, sliding_window, token_bucket or gcra".to_owned()
        })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Validate { path } => match Settings::load(&path) {
            Ok(s) => {
                println!("{}: ok ({} policies)", path.display(), s.policies.len());
                ExitCode::SUCCESS
            }
            Err(errors) => {
                eprintln!("{errors}");
                ExitCode::FAILURE
            }
        },
        Command::Script { algorithm } => {
            print!("{}", quotad::store::scripts::source(algorithm));
            ExitCode::SUCCESS
        }
        Command::Serve { config } => {
            init_tracing();
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
            serve(settings)
        }
    }
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr)
        .init();
}

fn serve(settings: Settings) -> ExitCode {
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
        let shutdown = CancellationToken::new();
        tokio::spawn(on_signal(shutdown.clone()));
        match quotad::app::run(settings, shutdown).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!("{e}");
                ExitCode::FAILURE
            }
        }
    })
}

/// Cancels `shutdown` on SIGTERM or SIGINT.
async fn on_signal(shutdown: CancellationToken) {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!("cannot install the SIGTERM handler: {e}");
                    let _ = ctrl_c.await;
                    shutdown.cancel();
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
    shutdown.cancel();
}
