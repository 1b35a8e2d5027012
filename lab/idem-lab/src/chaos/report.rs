//! The report of a chaos run: the exact numbers, collected before everything is stopped, the
//! verdict drawn from them, and the report printed for a person.

use std::path::Path;
use std::time::Duration;

use super::inject::Injected;
use super::procs::{Proc, Role};
use super::secure;
use super::settle::{Pipeline, Settled};
use super::topology::Topology;
use super::verdict::{self, Numbers};
use super::{ChaosArgs, ChaosReport, crash_counts, topic, windows};

/// The numbers only the topic and the processes can give, read while they still run.
struct Exact {
    inbox_duplicate_deliveries: i64,
    topic_duplicates: i64,
    unconsumed: std::collections::BTreeMap<String, u64>,
    hostile_rows: std::collections::BTreeMap<String, String>,
    hostile_violations: Vec<String>,
    panics: Vec<String>,
    unexpected_exits: Vec<String>,
    overlapping_executions: i64,
    duplicate_deliveries: u64,
    duplicate_skips: u64,
    republishes: u64,
}

/// The run's place: its topology and its logs' directory.
pub(super) struct Run<'a> {
    /// What the processes connected to, and how.
    pub topology: &'a Topology,
    /// The logs.
    pub dir: &'a Path,
    /// Where armed crash points logged that they fired.
    pub crash_log: &'a Path,
}

/// Collects the exact numbers, stops every process, and draws the verdict; a secured run's
/// logs, complete once every process has stopped, are then searched for its passwords.
pub(super) async fn report(
    args: &ChaosArgs,
    pipe: &Pipeline<'_>,
    procs: &mut [Proc],
    run: &Run<'_>,
    injected: Injected,
    settled: Settled,
) -> anyhow::Result<ChaosReport> {
    let exact = exact(pipe, procs, injected.hostile_violations).await?;
    let backends = match &run.topology.secure {
        Some(s) => Some(s.backends(pipe.dbs).await?),
        None => None,
    };
    for p in procs.iter_mut().filter(|p| p.role != Role::Broker) {
        p.stop(Duration::from_secs(10));
    }
    for p in procs.iter_mut().filter(|p| p.role == Role::Broker) {
        p.stop(Duration::from_secs(10));
    }
    let tls = run
        .topology
        .secure
        .as_ref()
        .zip(backends)
        .map(|(s, b)| s.report(pipe.kafka, &run.topology.api_base(), b, run.dir));
    let crash_log = run.crash_log;
    let crash_points_fired = crash_counts(crash_log, super::schedule::run_points(args.cdc));
    let verify = settled.verify;
    let numbers = Numbers {
        live: settled.live,
        settle_deadline: args.settle_deadline,
        seconds: args.seconds,
        overlapping_executions: exact.overlapping_executions,
        hostile_violations: exact.hostile_violations,
        burst: injected.burst.shortfall(),
        panics: exact.panics,
        unconsumed: exact.unconsumed,
        verify_clean: verify.clean,
        verify_lost: verify.lost(),
        duplicate_effects: verify.duplicate_effects(),
        other_violations: verdict::other_violations(&verify),
        crash_points_fired,
        duplicate_deliveries: exact.duplicate_deliveries,
        inbox_duplicate_deliveries: exact.inbox_duplicate_deliveries,
        unsecured: tls.as_ref().map(secure::shortfalls).unwrap_or_default(),
    };
    let failures: Vec<String> = verdict::verdict(&numbers)
        .iter()
        .map(ToString::to_string)
        .collect();
    Ok(ChaosReport {
        ok: failures.is_empty(),
        failures,
        seed: args.seed,
        seconds: args.seconds,
        negative_control: args.break_mechanism.map(|m| m.to_string()),
        orders: pipe
            .dbs
            .orders
            .scalar("SELECT count(*) FROM orders")
            .await?,
        faults: injected.faults,
        crash_points_fired: numbers.crash_points_fired.clone(),
        duplicate_deliveries: exact.duplicate_deliveries,
        duplicate_skips: exact.duplicate_skips,
        republishes: exact.republishes,
        inbox_duplicate_deliveries: exact.inbox_duplicate_deliveries,
        topic_duplicates: exact.topic_duplicates,
        settle_seconds: settled.seconds,
        lost: numbers.lost(),
        unconsumed: numbers.unconsumed,
        duplicate_effects: verify.duplicate_effects(),
        hostile_rows: exact.hostile_rows,
        burst: injected.burst,
        panics: numbers.panics,
        unexpected_exits: exact.unexpected_exits,
        overlapping_executions: exact.overlapping_executions,
        tls,
        logs: None,
        verify,
    })
}

/// The exact numbers, before stopping everything; `hostile_violations` (from the injection)
/// gain the stored hostile rows left uncontained.
async fn exact(
    pipe: &Pipeline<'_>,
    procs: &[Proc],
    mut hostile_violations: Vec<String>,
) -> anyhow::Result<Exact> {
    let dbs = pipe.dbs;
    let inbox_duplicate_deliveries = dbs
        .settlement
        .scalar("SELECT COALESCE(sum(delivery_count - 1), 0)::bigint FROM idem_inbox")
        .await?;
    let records = topic::read(pipe.kafka, pipe.topic).await?;
    let (topic_duplicates, unconsumed) = match &records {
        Ok(records) => (
            topic::duplicates(records),
            // Offsets the broker does not answer for leave every missing effect counted lost.
            topic::unconsumed(pipe.kafka, pipe.topic, records, dbs)
                .await?
                .unwrap_or_default(),
        ),
        Err(_) => (-1, std::collections::BTreeMap::new()),
    };
    let fates = super::hostile::fates(
        &dbs.orders,
        &dbs.settlement,
        &super::hostile::reference_groups(),
        pipe.hostile,
    )
    .await?;
    let (hostile_rows, uncontained) =
        verdict::hostile_rows(&fates, &super::hostile::reference_groups());
    hostile_violations.extend(uncontained);
    let panics: Vec<String> = procs.iter().flat_map(Proc::panics).collect();
    let unexpected_exits: Vec<String> = procs
        .iter()
        .flat_map(|p| p.unexpected_exits.iter().cloned())
        .collect();
    let overlapping_executions = windows::overlapping_executions(&dbs.points).await?;
    let sum = |name: &str| crate::num::whole(procs.iter().map(|p| p.total(name)).sum::<f64>());
    Ok(Exact {
        inbox_duplicate_deliveries,
        topic_duplicates,
        unconsumed,
        hostile_rows,
        hostile_violations,
        panics,
        unexpected_exits,
        overlapping_executions,
        duplicate_deliveries: sum("idem_duplicate_delivery_total"),
        duplicate_skips: sum("idem_duplicate_skip_total"),
        republishes: sum("idem_outbox_republish_total"),
    })
}

/// Prints the report for a person.
pub(super) fn print(r: &ChaosReport) {
    println!();
    println!(
        "idem chaos (seed {}, {} s{}): {}",
        r.seed,
        r.seconds,
        r.negative_control
            .as_deref()
            .map(|b| format!(", negative control {b}"))
            .unwrap_or_default(),
        if r.ok { "OK" } else { "FAILED" }
    );
    println!("  orders                         {}", r.orders);
    println!(
        "  burst before the relays        {} events, {}",
        r.burst.rows,
        match (r.burst.drained_seconds, r.burst.rate()) {
            (Some(s), Some(rate)) => format!("drained in {s:.1} s ({rate:.0} rows/s)"),
            _ => "not drained during the injection".to_owned(),
        }
    );
    for (k, v) in &r.faults {
        println!("  fault {k:<40} {v}");
    }
    for (k, v) in &r.crash_points_fired {
        println!("  crash point fired {k:<45} {v}");
    }
    println!(
        "  duplicate deliveries (metrics) {}",
        r.duplicate_deliveries
    );
    println!("  duplicate skips (metrics)      {}", r.duplicate_skips);
    println!("  republishes (metrics)          {}", r.republishes);
    println!(
        "  duplicates in the inboxes      {}",
        r.inbox_duplicate_deliveries
    );
    println!("  duplicate copies in the topic  {}", r.topic_duplicates);
    println!("  settled after                  {:.1} s", r.settle_seconds);
    for (c, n) in &r.unconsumed {
        println!("  not yet consumed ({c:<11})     {n}");
    }
    println!("  lost effects                   {}", r.lost);
    println!("  duplicate effects              {}", r.duplicate_effects);
    println!(
        "  overlapping key executions     {}",
        r.overlapping_executions
    );
    let contained = r.hostile_rows.len();
    println!("  hostile rows stored, contained {contained} (see --json for each one's fate)");
    if let Some(t) = &r.tls {
        println!("  Kafka                          {}", t.kafka);
        println!(
            "  PostgreSQL                     {} ({} backends, {} in clear, {} of other roles)",
            t.postgres, t.pg_backends.all, t.pg_backends.in_clear, t.pg_backends.other_roles
        );
        println!("  points API                     {}", t.points_api);
        println!(
            "  SCRAM principal in broker log  {}",
            if t.scram_principal_logged {
                "yes"
            } else {
                "no"
            }
        );
        let s = &t.secret_search;
        println!(
            "  passwords in the logs          {} ({} passwords searched in {} lines of {} files)",
            s.hits.len(),
            s.secrets,
            s.lines,
            s.files
        );
    }
    if !r.verify.clean {
        println!();
        print!("{}", r.verify.table());
    }
    for f in &r.failures {
        println!("  FAILED: {f}");
    }
    if let Some(l) = &r.logs {
        println!("  logs: {l}");
    }
}
