//! The operator commands of `idem` as a library: migrate, relay, outbox, verify, effects,
//! dead-letters, prune and topic ([`Command`], run by [`run`]), and the helpers they share.
//!
//! The binary `idem` parses [`Command`] and runs it. The lab binary `idem-lab` (lab/idem-lab)
//! flattens [`Command`] beside its own commands (demo, chaos, bench, the reference services),
//! so that the processes it starts run the very same operator code with faults armed. This crate
//! has no crash points and no negative controls: it never enables idem-core's `failpoints`
//! feature and reads no fault from the environment.

mod cdc_cmd;
mod effects_cmd;
mod outbox_cmd;
mod prune_cmd;
mod relay_cmd;
mod topic_cmd;

mod audit;
pub mod console_cmd;
pub mod db;
pub mod dead_letters_cmd;
pub mod kafka_args;
pub mod metrics_server;
pub mod readiness;
pub mod settings;
pub mod util;
pub mod verify_cmd;

pub use db::DbArgs;

use clap::Subcommand;

/// The operator commands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Create or upgrade idem's tables (PostgreSQL or sqlite:// URL).
    Migrate(DbArgs),
    /// Publish outbox rows to Kafka, at least once, in per-aggregate commit order.
    Relay(relay_cmd::RelayArgs),
    /// The change-data-capture relay for PostgreSQL (logical replication) and its slot.
    Cdc {
        /// What to do.
        #[command(subcommand)]
        command: cdc_cmd::CdcCommand,
    },
    /// Inspect and repair the outbox.
    Outbox {
        /// What to do with the outbox.
        #[command(subcommand)]
        command: outbox_cmd::OutboxCommand,
    },
    /// List a consumer group's dead letters with their reasons, and replay them through the
    /// group's running consumer.
    DeadLetters(dead_letters_cmd::DeadLettersArgs),
    /// Serve the operator console: the pipeline's stages, parked rows, dead letters, effects,
    /// verification, and audited actions behind a token.
    Console(Box<console_cmd::ConsoleArgs>),
    /// Deliver, list and retry effect intents (external HTTP calls).
    Effects {
        /// What to do with the effect intents.
        #[command(subcommand)]
        command: effects_cmd::EffectsCommand,
    },
    /// Delete old processed inbox rows and done effect intents, never inside the redelivery
    /// horizon (the topic's retention): a younger inbox row still stops a duplicate.
    Prune(prune_cmd::PruneArgs),
    /// Check that every fact has exactly one effect: lost, duplicated and mismatched effects,
    /// with where each lost one stopped (exit 0 clean, 1 violations, 2 could not verify).
    Verify(verify_cmd::VerifyArgs),
    /// Create and read topics.
    Topic {
        /// What to do with topics.
        #[command(subcommand)]
        command: topic_cmd::TopicCommand,
    },
}

/// Runs an operator command to its end.
pub async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Migrate(args) => db::migrate(&args).await,
        Command::Relay(args) => relay_cmd::run(args).await,
        Command::Cdc { command } => cdc_cmd::run(command).await,
        Command::Outbox { command } => outbox_cmd::run(command).await,
        Command::Topic { command } => topic_cmd::run(command).await,
        Command::DeadLetters(args) => dead_letters_cmd::run(args).await,
        Command::Console(args) => console_cmd::run(*args).await,
        Command::Effects { command } => effects_cmd::run(command).await,
        Command::Verify(args) => verify_cmd::run(args).await,
        Command::Prune(args) => prune_cmd::run(args).await,
    }
}

/// The log filter of a command without `RUST_LOG`.
pub const DEFAULT_LOG_FILTER: &str = "info,sqlx::postgres::notice=warn";

/// A binary's `main`: logs to standard error (`RUST_LOG`, default [`DEFAULT_LOG_FILTER`]) in
/// `log`'s format, runs `program` on a multi-threaded runtime, and turns its result into the
/// exit status: the status of a [`verify_cmd::ExitWith`], else 1 with `BIN: error: …` (each
/// cause printed once).
pub fn main_with<F>(bin: &str, log: settings::LogFormat, program: F) -> std::process::ExitCode
where
    F: std::future::Future<Output = anyhow::Result<()>>,
{
    main_with_logs(bin, log, DEFAULT_LOG_FILTER, program)
}

/// [`main_with`], logging what `default_filter` lets through when `RUST_LOG` is not set (a
/// program whose own output is the report, as the lab's demo, logs errors only).
pub fn main_with_logs<F>(
    bin: &str,
    log: settings::LogFormat,
    default_filter: &str,
    program: F,
) -> std::process::ExitCode
where
    F: std::future::Future<Output = anyhow::Result<()>>,
{
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let fmt = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter);
    match log {
        settings::LogFormat::Text => fmt.init(),
        settings::LogFormat::Json => fmt
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .flatten_event(true)
            .init(),
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{bin}: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(program) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) if e.downcast_ref::<verify_cmd::ExitWith>().is_some() => {
            let code = e.downcast_ref::<verify_cmd::ExitWith>().map_or(1, |x| x.0);
            std::process::ExitCode::from(code)
        }
        Err(e) => {
            let message = error_message(&e);
            match log {
                settings::LogFormat::Text => eprintln!("{bin}: error: {message}"),
                settings::LogFormat::Json => eprintln!(
                    "{}",
                    serde_json::json!({"level": "ERROR", "target": bin, "message": message})
                ),
            }
            std::process::ExitCode::FAILURE
        }
    }
}

/// Library errors already carry their cause in their message: each cause once, `: `-separated.
fn error_message(e: &anyhow::Error) -> String {
    let mut msg = String::new();
    for cause in e.chain() {
        let text = cdc_cmd::with_flag_names(&kafka_args::with_flag_names(&cause.to_string()));
        if !msg.contains(&text) {
            if !msg.is_empty() {
                msg.push_str(": ");
            }
            msg.push_str(&text);
        }
    }
    msg
}
