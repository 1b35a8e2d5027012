//! `idem`: migrate the outbox, run the relay, inspect the outbox and topics.

mod bench;
mod broker;
mod chaos;
mod db;
mod demo;
mod effects_cmd;
mod faults;
mod lab_consumer;
mod metrics_server;
mod outbox_cmd;
mod prune_cmd;
mod reference_cmd;
mod relay_cmd;
mod topic_cmd;
mod verify_cmd;

use clap::{Args, Parser, Subcommand};

/// Effectively-once business effects on top of at-least-once delivery.
#[derive(Parser, Debug)]
#[command(name = "idem", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the whole reference pipeline in one process — SQLite, an in-process broker, the
    /// points API — with every crash point fired and duplicates injected, then verify it.
    Demo(demo::DemoArgs),
    /// Run the reference pipeline as OS processes against PostgreSQL and Apache Kafka while
    /// killing, pausing and crashing them (and the brokers) on a seeded schedule; then check
    /// nothing was lost or doubled.
    Chaos(chaos::ChaosArgs),
    /// The chaos runner's `kafka-transactions` negative control: a settlement consumer with
    /// Kafka transactions and no inbox (it applies effects twice; never use it).
    #[command(hide = true)]
    KafkaTxnSettlement(chaos::kafka_txn::KafkaTxnArgs),
    /// Create or upgrade idem's tables (PostgreSQL or sqlite:// URL).
    Migrate(DbArgs),
    /// Publish outbox rows to Kafka, at least once, in per-aggregate commit order.
    Relay(relay_cmd::RelayArgs),
    /// Inspect and repair the outbox.
    Outbox {
        #[command(subcommand)]
        command: outbox_cmd::OutboxCommand,
    },
    /// Reference order service: write paid orders with their order.paid events.
    Orders(reference_cmd::OrdersArgs),
    /// Reference settlement service: consume order.paid events into one settlement per payment.
    Settlement(reference_cmd::SettlementArgs),
    /// List a consumer group's dead letters with their reasons (`replay`: re-apply them).
    #[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
    DeadLetters(reference_cmd::DeadLettersArgs),
    /// Reference points API: awards points per request, behind the Idempotency-Key layer.
    PointsApi(reference_cmd::PointsApiArgs),
    /// Deliver, list and retry effect intents (external HTTP calls).
    Effects {
        #[command(subcommand)]
        command: effects_cmd::EffectsCommand,
    },
    /// Delete old processed inbox rows and done effect intents, never inside the redelivery
    /// horizon (the topic's retention): a younger inbox row still stops a duplicate.
    Prune(prune_cmd::PruneArgs),
    /// Check that every fact has exactly one effect: lost, duplicated and mismatched effects,
    /// with where each lost one stopped (exit 0 clean, 1 violations, 2 could not verify).
    Verify(verify_cmd::VerifyArgs),
    /// Measure what idem costs on this hardware against same-run baselines (`bench verify`: memory of `idem verify`).
    Bench(bench::BenchArgs),
    /// Create and read topics.
    Topic {
        #[command(subcommand)]
        command: topic_cmd::TopicCommand,
    },
}

/// Where idem's tables are.
#[derive(Args, Debug, Clone)]
pub struct DbArgs {
    /// Database URL: postgres://… or sqlite://path (sqlite::memory: is not useful across processes).
    #[arg(long, env = "IDEM_DB")]
    pub db: String,
    /// PostgreSQL schema of idem's tables (default: the search path).
    #[arg(long, env = "IDEM_SCHEMA")]
    pub schema: Option<String>,
    /// Prefix of idem's table names.
    #[arg(long, env = "IDEM_TABLE_PREFIX", default_value = "idem_")]
    pub table_prefix: String,
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new("info,sqlx::postgres::notice=warn")
            }),
        )
        .init();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("idem: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) if e.downcast_ref::<verify_cmd::ExitWith>().is_some() => {
            let code = e.downcast_ref::<verify_cmd::ExitWith>().map_or(1, |x| x.0);
            std::process::ExitCode::from(code)
        }
        Err(e) => {
            // Library errors already carry their cause in their message: print each cause once.
            let mut msg = String::new();
            for cause in e.chain() {
                let text = cause.to_string();
                if !msg.contains(&text) {
                    if !msg.is_empty() {
                        msg.push_str(": ");
                    }
                    msg.push_str(&text);
                }
            }
            eprintln!("idem: error: {msg}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    faults::arm_from_env()?;
    match cli.command {
        Command::Migrate(args) => db::migrate(&args).await,
        Command::Relay(args) => relay_cmd::run(args).await,
        Command::Outbox { command } => outbox_cmd::run(command).await,
        Command::Topic { command } => topic_cmd::run(command).await,
        Command::Orders(args) => reference_cmd::orders(args).await,
        Command::Settlement(args) => reference_cmd::settlement(args).await,
        Command::DeadLetters(args) => reference_cmd::dead_letters(args).await,
        Command::PointsApi(args) => reference_cmd::points_api(args).await,
        Command::Effects { command } => effects_cmd::run(command).await,
        Command::Verify(args) => verify_cmd::run(args).await,
        Command::Prune(args) => prune_cmd::run(args).await,
        Command::Demo(args) => demo::run(args).await,
        Command::Chaos(args) => chaos::run(args).await,
        Command::KafkaTxnSettlement(args) => chaos::kafka_txn::run(args).await,
        Command::Bench(args) => bench::run(args).await,
    }
}
