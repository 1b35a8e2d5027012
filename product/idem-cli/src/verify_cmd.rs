//! `idem verify`: reconciliation of a pipeline described in a config file; exit status 0 clean,
//! 1 violations or gaps, 2 could not verify.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use idem_verify::{Options, VerifyConfig, WatchMetrics};

/// Ends the process with this status, after the command printed what it had to say.
#[derive(Debug)]
pub struct ExitWith(pub u8);

impl std::fmt::Display for ExitWith {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "exit status {}", self.0)
    }
}

impl std::error::Error for ExitWith {}

/// Prints a command's report (JSON, or `table` for people) and ends with status 1 unless `ok`.
pub fn emit<R: serde::Serialize>(
    report: &R,
    json: bool,
    ok: bool,
    table: impl FnOnce(&R),
) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(report)?);
    } else {
        table(report);
    }
    if ok { Ok(()) } else { Err(ExitWith(1).into()) }
}

/// `idem verify`: what to check, and how to report it.
#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// A TOML file naming the pipeline's checks: its databases, the query of each side, the
    /// keys and amounts (see docs/operating/verify.md).
    #[arg(long)]
    config: PathBuf,
    /// PostgreSQL schema of idem's tables.
    #[arg(long)]
    schema: Option<String>,
    /// Prefix of idem's table names.
    #[arg(long)]
    table_prefix: Option<String>,
    /// Missing keys to locate per check.
    #[arg(long, default_value_t = 1000)]
    locate_limit: usize,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Keep verifying at this interval, exporting idem_reconciliation_gap, idem_reconciliation_up
    /// and idem_reconciliation_last_success_timestamp_seconds (Ctrl-C stops).
    #[arg(long, value_parser = crate::util::parse_duration)]
    watch: Option<Duration>,
    /// Serve Prometheus metrics here (with --watch).
    #[arg(long, requires = "watch")]
    metrics_addr: Option<SocketAddr>,
    /// Negative control for `idem-lab chaos`: leave the metrics of the last good run in place when
    /// a run fails (a stale proof). Never use it.
    #[arg(long, hide = true, requires = "watch")]
    lab_keep_stale_metrics: bool,
}

fn config(args: &VerifyArgs) -> anyhow::Result<VerifyConfig> {
    let path = &args.config;
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut config = VerifyConfig::from_toml(&text)
        .with_context(|| format!("reading the checks of {}", path.display()))?;
    if args.schema.is_some() {
        config.tables.schema.clone_from(&args.schema);
    }
    if args.table_prefix.is_some() {
        config.tables.prefix.clone_from(&args.table_prefix);
    }
    Ok(config)
}

fn print(report: &idem_verify::Report, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(report)?);
    } else {
        print!("{}", report.table());
    }
    Ok(())
}

/// Runs `idem verify` (once, or `--watch`).
pub async fn run(args: VerifyArgs) -> anyhow::Result<()> {
    let config = match config(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("idem verify: {e:#}");
            return Err(ExitWith(2).into());
        }
    };
    let options = Options {
        locate_limit: args.locate_limit,
    };
    let Some(interval) = args.watch else {
        return match idem_verify::verify(&config, &options).await {
            Ok(report) => {
                print(&report, args.json)?;
                if report.clean {
                    Ok(())
                } else {
                    Err(ExitWith(1).into())
                }
            }
            Err(e) => {
                eprintln!("idem verify: could not verify: {e}");
                Err(ExitWith(2).into())
            }
        };
    };
    let registry = prometheus::Registry::new();
    let metrics = WatchMetrics::new(&registry)?;
    if let Some(addr) = args.metrics_addr {
        let bound = crate::metrics_server::serve(addr, registry.clone()).await?;
        eprintln!("idem verify: metrics on http://{bound}/metrics");
    }
    let shutdown = crate::util::shutdown_signal()?;
    tokio::pin!(shutdown);
    loop {
        match idem_verify::verify(&config, &options).await {
            Ok(report) => {
                metrics.verified(&report, unix_now());
                eprintln!(
                    "idem verify: {}: lost {}, duplicate effects {}",
                    if report.clean { "clean" } else { "VIOLATIONS" },
                    report.lost(),
                    report.duplicate_effects()
                );
                if !report.clean {
                    print(&report, args.json)?;
                }
            }
            Err(e) => {
                if !args.lab_keep_stale_metrics {
                    metrics.failed();
                }
                eprintln!("idem verify: could not verify: {e}");
            }
        }
        tokio::select! {
            () = &mut shutdown => return Ok(()),
            () = tokio::time::sleep(interval) => {}
        }
    }
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
