//! `idem`, the operator tool: migrate idem's tables, run the relay, inspect and repair the
//! outbox, deliver effect intents, list dead letters, prune, verify, and create and read topics.
//! (The demo, chaos runs, benchmarks and reference services are the lab's: `idem-lab`.)

use clap::{CommandFactory, FromArgMatches, Parser};

/// Effectively-once business effects on top of at-least-once delivery.
#[derive(Parser, Debug)]
#[command(name = "idem", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: idem_cli::Command,
}

fn main() -> std::process::ExitCode {
    let (matches, log) = idem_cli::settings::matches(Cli::command());
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    idem_cli::main_with("idem", log, idem_cli::run(cli.command))
}
