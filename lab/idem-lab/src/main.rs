//! `idem-lab`: the lab that proves idem's guarantees. The demo, chaos runs and benchmarks, the
//! reference services they run (orders, settlement, points API), and every operator command of
//! `idem`, in one binary with crash points and negative controls
//! compiled in and armed from the environment (`IDEM_CRASH_POINTS`, `IDEM_BREAK`,
//! `IDEM_CRASH_LOG`; see docs/reference/crash-points.md). Never deploy it: ship `idem`.

mod bench;
mod broker;
mod chaos;
mod demo;
mod faults;
mod lab_consumer;
mod num;
mod reference_cmd;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

/// The idem lab: demo, chaos, bench and the reference services, with faults compiled in.
#[derive(Parser, Debug)]
#[command(name = "idem-lab", version, about, long_about = None)]
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
    /// Reference order service: write paid orders with their order.paid events.
    Orders(reference_cmd::OrdersArgs),
    /// Reference settlement service: consume order.paid events into one settlement per payment.
    Settlement(reference_cmd::SettlementArgs),
    /// Reference points API: awards points per request, behind the Idempotency-Key layer.
    PointsApi(reference_cmd::PointsApiArgs),
    /// Create idem's tables and the reference tables in a database (the reference services
    /// create none: they refuse a database not set up).
    Setup(reference_cmd::SetupArgs),
    /// Write the reference pipeline's checks as a config for `idem verify --config` (TOML).
    VerifyConfig(reference_cmd::VerifyConfigArgs),
    /// Measure what idem costs on this hardware against same-run baselines (`bench verify`: memory of `idem verify`; `bench console`: time per console page).
    Bench(bench::BenchArgs),
    /// The operator commands of `idem`.
    #[command(flatten)]
    Product(idem_cli::Command),
}

fn main() -> std::process::ExitCode {
    let (matches, log) = idem_cli::settings::matches(Cli::command());
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // The demo's output is its progress and its verdict; its components' logs (crashes it
    // fires on purpose among them) show with RUST_LOG=info.
    let filter = match &cli.command {
        Command::Demo(_) => "error",
        _ => idem_cli::DEFAULT_LOG_FILTER,
    };
    idem_cli::main_with_logs("idem-lab", log, filter, run(cli.command))
}

async fn run(command: Command) -> anyhow::Result<()> {
    faults::arm_from_env()?;
    match command {
        Command::Orders(args) => reference_cmd::orders(args).await,
        Command::Settlement(args) => reference_cmd::settlement(args).await,
        Command::PointsApi(args) => reference_cmd::points_api(args).await,
        Command::Demo(args) => demo::run(args).await,
        Command::Chaos(args) => chaos::run(args).await,
        Command::KafkaTxnSettlement(args) => chaos::kafka_txn::run(args).await,
        Command::Bench(args) => bench::run(args).await,
        Command::VerifyConfig(args) => reference_cmd::verify_config(&args),
        Command::Setup(args) => reference_cmd::setup(args).await,
        Command::Product(command) => idem_cli::run(command).await,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_command_line_is_consistent() {
        <super::Cli as clap::CommandFactory>::command().debug_assert();
    }
}
