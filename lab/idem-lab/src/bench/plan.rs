//! The bench's phase plan and its pure arithmetic, apart from any I/O: the phases in order and
//! their titles, the child processes' command lines, and the rates drawn from counts.

use std::time::Duration;

use super::RunArgs;
use super::report::LOADS;

/// One step of a run, in the order [`PHASES`] runs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Starting the broker and creating the databases.
    Setup,
    /// Durable single-row inserts on one connection.
    Inserts1,
    /// Durable single-row inserts on `--connections`.
    InsertsN,
    /// Business transactions alone, with the outbox and with a plain row, on one connection.
    Business1,
    /// The same on `--connections`.
    BusinessN,
    /// The consumer's SQL called directly.
    ConsumerSql,
    /// The relay's claim-and-mark SQL called directly.
    RelaySql,
    /// Raw rdkafka produce.
    Produce,
    /// Raw rdkafka consume.
    Consume,
    /// Writing the backlog of paid orders.
    Backlog,
    /// The relay drains the backlog.
    RelayDrain,
    /// The settlement consumer drains the topic.
    ConsumerDrain,
    /// The same consumer without its inbox.
    NoInboxDrain,
    /// Every event published a second time.
    Republish,
    /// The consumer drains the duplicates.
    Duplicates,
    /// Writers as fast as they can, relay and consumer running.
    Sustained,
    /// Open-loop latency runs.
    Latency,
}

/// Every phase, in order.
pub const PHASES: [Phase; 17] = [
    Phase::Setup,
    Phase::Inserts1,
    Phase::InsertsN,
    Phase::Business1,
    Phase::BusinessN,
    Phase::ConsumerSql,
    Phase::RelaySql,
    Phase::Produce,
    Phase::Consume,
    Phase::Backlog,
    Phase::RelayDrain,
    Phase::ConsumerDrain,
    Phase::NoInboxDrain,
    Phase::Republish,
    Phase::Duplicates,
    Phase::Sustained,
    Phase::Latency,
];

impl Phase {
    /// The progress line's title for a run with `args`.
    pub fn title(self, args: &RunArgs) -> String {
        let n = connections(args);
        let business = |conns: u32| {
            format!(
                "business transactions: alone, with the outbox insert, with a plain second row; {conns} connection(s)"
            )
        };
        match self {
            Phase::Setup => "starting the broker and creating the databases".to_owned(),
            Phase::Inserts1 => "baseline: durable single-row inserts, 1 connection".to_owned(),
            Phase::InsertsN => {
                format!("baseline: durable single-row inserts, {n} connections")
            }
            Phase::Business1 => business(1),
            Phase::BusinessN => business(n),
            Phase::ConsumerSql => format!(
                "baseline: the consumer's SQL directly (inbox insert + settlement), batches of {}",
                args.batch_size
            ),
            Phase::RelaySql => format!(
                "baseline: the relay's claim-and-mark SQL directly, {} rows, batches of {}",
                args.backlog, args.relay_batch_size
            ),
            Phase::Produce => format!(
                "baseline: raw rdkafka produce of {} records of {} bytes",
                args.backlog, args.message_size
            ),
            Phase::Consume => "baseline: raw rdkafka consume of the same records".to_owned(),
            Phase::Backlog => format!("writing a backlog of {} paid orders", args.backlog),
            Phase::RelayDrain => "relay drain (idem relay as a child process)".to_owned(),
            Phase::ConsumerDrain => {
                "consumer drain (idem settlement as a child process)".to_owned()
            }
            Phase::NoInboxDrain => {
                "consumer drain without the inbox (same consumer, inbox insert left out)".to_owned()
            }
            Phase::Republish => {
                "republishing the whole backlog (every event a second time)".to_owned()
            }
            Phase::Duplicates => "consumer drain of 100 % redelivered duplicates".to_owned(),
            Phase::Sustained => format!(
                "sustained end to end: {n} writers as fast as they can, relay and consumer running"
            ),
            Phase::Latency => {
                "commit → settlement latency, open-loop arrivals at 25, 50 and 80 % of the sustained rate"
                    .to_owned()
            }
        }
    }
}

/// Connections of the many-connection phases (at least one).
pub fn connections(args: &RunArgs) -> u32 {
    args.connections.max(1)
}

/// How long a drain may take before the bench gives up.
pub fn drain_timeout(args: &RunArgs) -> Duration {
    Duration::from_secs(120 + args.backlog / 100)
}

/// Owned command-line arguments.
pub fn args_of(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| (*s).to_owned()).collect()
}

/// `KEY=VALUE` settings as repeated `flag` arguments.
fn settings(flag: &str, settings: &[(String, String)]) -> Vec<String> {
    settings
        .iter()
        .flat_map(|(k, v)| [flag.to_owned(), format!("{k}={v}")])
        .collect()
}

/// `idem relay` over the orders database `db`, publishing under `topic_prefix`.
pub fn relay_args(args: &RunArgs, db: &str, brokers: &str, topic_prefix: &str) -> Vec<String> {
    let mut v = args_of(&[
        "relay",
        "--db",
        db,
        "--brokers",
        brokers,
        "--topic-prefix",
        topic_prefix,
        "--batch-size",
        &args.relay_batch_size.to_string(),
        "--no-prune",
    ]);
    v.extend(settings("--producer-config", &args.producer_config));
    v
}

/// A settlement consumer's arguments after `command` (`settlement`, or `bench
/// no-inbox-consumer`): database `db`, `topic`, `group`, the batch size and consumer settings.
pub fn consumer_args(
    args: &RunArgs,
    command: &[&str],
    db: &str,
    brokers: &str,
    topic: &str,
    group: &str,
) -> Vec<String> {
    let mut v = args_of(command);
    let batch = args.batch_size.to_string();
    v.extend(args_of(&[
        "--db",
        db,
        "--brokers",
        brokers,
        "--topic",
        topic,
        "--group",
        group,
        "--batch-size",
        &batch,
    ]));
    v.extend(settings("--consumer-config", &args.consumer_config));
    v
}

/// Events per second: `delta` over `elapsed` (never a division by zero).
pub fn rate(delta: u64, elapsed: Duration) -> f64 {
    delta as f64 / elapsed.as_secs_f64().max(1e-9)
}

/// The open-loop arrival rates: each load of [`LOADS`] and its share of `sustained`.
pub fn open_loop_rates(sustained: f64) -> [(u32, f64); 3] {
    LOADS.map(|pct| (pct, sustained * f64::from(pct) / 100.0))
}

/// A small run's arguments, for unit tests.
#[cfg(test)]
pub fn sample_args() -> RunArgs {
    RunArgs {
        db: "postgres://h/db".to_owned(),
        brokers: "embedded".to_owned(),
        backlog: 2_000,
        batch_size: 200,
        relay_batch_size: 500,
        message_size: 256,
        seconds: 1.0,
        connections: 4,
        partitions: 3,
        consumer_config: vec![("fetch.wait.max.ms".to_owned(), "5".to_owned())],
        producer_config: vec![("linger.ms".to_owned(), "1".to_owned())],
        json: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> RunArgs {
        sample_args()
    }

    #[test]
    fn the_plan_has_seventeen_distinct_phases_with_their_titles() {
        let a = args();
        let titles: Vec<String> = PHASES.iter().map(|p| p.title(&a)).collect();
        assert_eq!(titles.len(), 17);
        for (i, t) in titles.iter().enumerate() {
            assert!(!titles[..i].contains(t), "{t} twice");
        }
        assert_eq!(
            Phase::InsertsN.title(&a),
            "baseline: durable single-row inserts, 4 connections"
        );
        assert!(Phase::Business1.title(&a).ends_with("; 1 connection(s)"));
        assert!(Phase::BusinessN.title(&a).ends_with("; 4 connection(s)"));
        assert_eq!(
            Phase::RelaySql.title(&a),
            "baseline: the relay's claim-and-mark SQL directly, 2000 rows, batches of 500"
        );
    }

    #[test]
    fn children_get_the_run_s_settings() {
        let a = args();
        assert_eq!(
            relay_args(&a, "postgres://o", "b:9092", "p."),
            args_of(&[
                "relay",
                "--db",
                "postgres://o",
                "--brokers",
                "b:9092",
                "--topic-prefix",
                "p.",
                "--batch-size",
                "500",
                "--no-prune",
                "--producer-config",
                "linger.ms=1",
            ])
        );
        assert_eq!(
            consumer_args(&a, &["bench", "no-inbox-consumer"], "d", "b", "t", "g"),
            args_of(&[
                "bench",
                "no-inbox-consumer",
                "--db",
                "d",
                "--brokers",
                "b",
                "--topic",
                "t",
                "--group",
                "g",
                "--batch-size",
                "200",
                "--consumer-config",
                "fetch.wait.max.ms=5",
            ])
        );
    }

    #[test]
    fn rates_and_timeouts_follow_the_numbers() {
        assert_eq!(rate(500, Duration::from_secs(2)), 250.0);
        assert!(rate(1, Duration::ZERO).is_finite());
        assert_eq!(
            open_loop_rates(1000.0),
            [(25, 250.0), (50, 500.0), (80, 800.0)]
        );
        assert_eq!(drain_timeout(&args()), Duration::from_secs(140));
        assert_eq!(connections(&args()), 4);
        let none = RunArgs {
            connections: 0,
            ..args()
        };
        assert_eq!(connections(&none), 1);
    }
}
