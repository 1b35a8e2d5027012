//! `idem-lab chaos`: the chaos runner. It runs a pipeline a file describes (`--pipeline FILE`,
//! `pipeline/`), or without one the reference pipeline's own file (`pipelines/reference`):
//! order writers, relays, settlement consumers in one group, an audit consumer group, the
//! effect dispatcher and the points API as separate OS processes against PostgreSQL and Apache
//! Kafka, while a seeded schedule kills them (SIGKILL), pauses them (SIGSTOP/SIGCONT), restarts
//! them with named crash points armed, kills and restarts the broker, crashes PostgreSQL, cuts
//! and slows their connections, writes hostile rows through the SQL contract and opens slow
//! windows (a locked table, a slow remote). Then it stops injecting, waits for the pipeline to
//! settle (a deadline: missing it is a liveness failure), runs `idem verify`, and reports.
//!
//! `--break MECHANISM` runs a negative control: one mechanism deliberately broken, which the
//! run must report as a violation.

mod burst;
mod hostile;
pub(crate) mod kafka;
pub(crate) mod kafka_txn;
mod network;
mod pipeline;
pub(crate) use hostile::install_business_rule;
mod procs;
mod schedule;
mod timeline;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use idem_core::crash::Mechanism;

#[derive(Args, Debug, Clone)]
pub(crate) struct ChaosArgs {
    /// How long to inject faults (`40s`, `10m`; whole seconds).
    #[arg(long = "duration", default_value = "2m", value_parser = crate::num::whole_seconds)]
    pub seconds: u64,
    /// Seed of the fault schedule (the same seed, the same schedule).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// The pipeline file to run: its databases, Kafka, its components as command lines, the
    /// verify config (`docs/operating/chaos-your-pipeline.md`). Without it, the reference
    /// pipeline's file (`lab/idem-lab/pipelines/reference`, built into this binary, its
    /// programs this `idem-lab`).
    #[arg(long)]
    pub pipeline: Option<PathBuf>,
    /// Break one mechanism on purpose (a negative control): the run must report a violation.
    /// Its variable is `IDEM_CHAOS_BREAK`: `IDEM_BREAK` is the fault the runner hands its
    /// processes.
    #[arg(long = "break", env = "IDEM_CHAOS_BREAK", value_parser = negative_controls())]
    pub break_mechanism: Option<Mechanism>,
    /// How long the pipeline may take to settle after the faults stop.
    #[arg(long, default_value = "180s", value_parser = idem_cli::util::parse_duration)]
    pub settle_deadline: Duration,
    /// Keep the logs afterwards (a failed run always keeps them).
    #[arg(long)]
    pub keep: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// The negative controls: the mechanisms idem can break (`IDEM_BREAK`). One of them,
/// [`Mechanism::KafkaTransactions`], replaces the settlement consumers' inbox with Kafka transactions
/// (read_committed, offsets committed in a transaction after the database commit): "we turned
/// on Kafka exactly-once" does not make a database side effect happen once.
///
/// `skip-sending-mark` is left out: the run's points route honours keys, so breaking the mark
/// for keyless remotes would go unnoticed — a control that cannot fail. The battery catches it
/// (`without_the_sending_mark_the_same_crash_awards_twice`, real processes killed).
fn negative_controls() -> impl clap::builder::TypedValueParser<Value = Mechanism> {
    use clap::builder::TypedValueParser as _;
    let names = Mechanism::ALL
        .iter()
        .filter(|m| **m != Mechanism::SkipSendingMark)
        .map(|m| m.as_str());
    clap::builder::PossibleValuesParser::new(names).try_map(|name| name.parse::<Mechanism>())
}

/// The reference pipeline's file and its verify config, built in.
const REFERENCE: &str = include_str!("../../pipelines/reference/pipeline.toml");
const REFERENCE_VERIFY: &str = include_str!("../../pipelines/reference/verify.toml");

pub(crate) async fn run(args: ChaosArgs) -> anyhow::Result<()> {
    if let Some(file) = &args.pipeline {
        return pipeline::run(&args, file).await;
    }
    let dir = tempfile::Builder::new()
        .prefix("idem-reference-pipeline-")
        .tempdir()?;
    let file = reference_in(dir.path())?;
    pipeline::run(&args, &file).await
}

/// Writes the reference pipeline's file into `dir`, its programs this binary, beside its
/// verify config: the file's path.
fn reference_in(dir: &Path) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("finding this idem-lab binary")?;
    // A brace in the path is a literal one to the runner's placeholders.
    let path = exe
        .display()
        .to_string()
        .replace('{', "{{")
        .replace('}', "}}");
    let program = toml::Value::String(path).to_string();
    let text = REFERENCE.replace("[\"idem-lab\", ", &format!("[{program}, "));
    std::fs::write(dir.join("verify.toml"), REFERENCE_VERIFY)?;
    let file = dir.join("pipeline.toml");
    std::fs::write(&file, text)?;
    Ok(file)
}

/// Denies `user` every operation on `topic` with an ACL on the secured cluster in `dir`
/// (`scripts/kafka deny`).
fn deny_topic(dir: &Path, user: &str, topic: &str) -> anyhow::Result<()> {
    let out = std::process::Command::new(crate::broker::script())
        .arg("deny")
        .arg(dir)
        .args([&format!("User:{user}"), topic])
        .output()?;
    if !out.status.success() {
        bail!(
            "scripts/kafka deny: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_built_in_reference_runs_this_binary_beside_its_verify_config() {
        let dir = tempfile::tempdir().unwrap();
        let file = reference_in(dir.path()).unwrap();
        let text = std::fs::read_to_string(&file).unwrap();
        let parsed: toml::Value = toml::from_str(&text).unwrap();
        let exe = std::env::current_exe().unwrap().display().to_string();
        let sections = ["component", "load"].map(|k| parsed[k].as_array().unwrap().clone());
        let programs: Vec<&str> = sections
            .iter()
            .flatten()
            .map(|c| c["command"][0].as_str().unwrap())
            .collect();
        assert!(programs.len() >= 7, "{programs:?}");
        assert!(programs.iter().all(|p| *p == exe), "{programs:?}");
        assert!(!text.contains("[\"idem-lab\", "), "{text}");
        let verify = std::fs::read_to_string(dir.path().join("verify.toml")).unwrap();
        assert_eq!(verify, REFERENCE_VERIFY);
    }
}
