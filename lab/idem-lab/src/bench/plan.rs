//! The bench's phase plan and its pure arithmetic, apart from any I/O: the phases in order and
//! their titles, the child processes' command lines, and the rates drawn from counts.

use std::time::Duration;

use super::RunArgs;
use super::figures::LOADS;

/// One step of a run, in the order [`PHASES`] runs them. A ceiling runs just before and just
/// after the system phase it bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
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
    /// Writing the backlog of paid orders.
    Backlog,
    /// The relay's ceilings (lean claim-and-mark, raw produce), before its drain.
    RelayCeilingBefore,
    /// The relay drains the backlog.
    RelayDrain,
    /// The relay's ceilings again, after its drain.
    RelayCeilingAfter,
    /// The CDC relay's ceiling (raw produce), before its drain.
    CdcCeilingBefore,
    /// The CDC relay streams a backlog written while it was stopped.
    CdcDrain,
    /// The CDC relay's ceiling again, after its drain.
    CdcCeilingAfter,
    /// Raw rdkafka consume.
    Consume,
    /// The consumer's ceilings (set-based batch on one connection and on one per partition),
    /// before its drain.
    ConsumerCeilingBefore,
    /// The settlement consumer drains the topic.
    ConsumerDrain,
    /// The consumer's ceilings again, after its drain.
    ConsumerCeilingAfter,
    /// The same consumer without its inbox.
    NoInboxDrain,
    /// Every event published a second time.
    Republish,
    /// The consumer drains the duplicates.
    Duplicates,
    /// Writers alone (no events flowing), before the sustained run.
    WritersBefore,
    /// Writers as fast as they can, relay and consumer running.
    Sustained,
    /// Writers alone again, after it.
    WritersAfter,
    /// Open-loop latency runs.
    Latency,
}

/// Every phase, in order.
pub(super) const PHASES: [Phase; 23] = [
    Phase::Setup,
    Phase::Inserts1,
    Phase::InsertsN,
    Phase::Business1,
    Phase::BusinessN,
    Phase::Backlog,
    Phase::RelayCeilingBefore,
    Phase::RelayDrain,
    Phase::RelayCeilingAfter,
    Phase::CdcCeilingBefore,
    Phase::CdcDrain,
    Phase::CdcCeilingAfter,
    Phase::Consume,
    Phase::ConsumerCeilingBefore,
    Phase::ConsumerDrain,
    Phase::ConsumerCeilingAfter,
    Phase::NoInboxDrain,
    Phase::Republish,
    Phase::Duplicates,
    Phase::WritersBefore,
    Phase::Sustained,
    Phase::WritersAfter,
    Phase::Latency,
];

/// The relay drain between the runs of its ceilings.
pub(super) const RELAY: [Phase; 3] = [
    Phase::RelayCeilingBefore,
    Phase::RelayDrain,
    Phase::RelayCeilingAfter,
];

/// The CDC relay's drain between the runs of its ceiling.
pub(super) const CDC: [Phase; 3] = [
    Phase::CdcCeilingBefore,
    Phase::CdcDrain,
    Phase::CdcCeilingAfter,
];

/// The consumer drain between the runs of its ceilings.
pub(super) const CONSUMER: [Phase; 3] = [
    Phase::ConsumerCeilingBefore,
    Phase::ConsumerDrain,
    Phase::ConsumerCeilingAfter,
];

/// The sustained run between the runs of its ceiling, the writers alone.
pub(super) const WRITERS: [Phase; 3] =
    [Phase::WritersBefore, Phase::Sustained, Phase::WritersAfter];

impl Phase {
    /// The phase's key in the report's `phases`.
    pub(super) fn key(self) -> &'static str {
        match self {
            Phase::Setup => "setup",
            Phase::Inserts1 => "inserts_1conn",
            Phase::InsertsN => "inserts_nconn",
            Phase::Business1 => "business_1conn",
            Phase::BusinessN => "business_nconn",
            Phase::Backlog => "backlog",
            Phase::RelayCeilingBefore => "relay_ceiling_before",
            Phase::RelayDrain => "relay_drain",
            Phase::RelayCeilingAfter => "relay_ceiling_after",
            Phase::CdcCeilingBefore => "cdc_ceiling_before",
            Phase::CdcDrain => "cdc_drain",
            Phase::CdcCeilingAfter => "cdc_ceiling_after",
            Phase::Consume => "raw_consume",
            Phase::ConsumerCeilingBefore => "consumer_ceiling_before",
            Phase::ConsumerDrain => "consumer_drain",
            Phase::ConsumerCeilingAfter => "consumer_ceiling_after",
            Phase::NoInboxDrain => "no_inbox_drain",
            Phase::Republish => "republish",
            Phase::Duplicates => "duplicates",
            Phase::WritersBefore => "writers_before",
            Phase::Sustained => "sustained",
            Phase::WritersAfter => "writers_after",
            Phase::Latency => "latency",
        }
    }

    /// The phases that must have ended well for this one to run: a drain needs what it
    /// drains, the duplicates need the inbox and the republished topic, the latency runs need
    /// the sustained rate.
    pub(super) fn needs(self) -> &'static [Phase] {
        match self {
            Phase::RelayDrain => &[Phase::Backlog],
            Phase::ConsumerDrain | Phase::NoInboxDrain | Phase::Republish => &[Phase::RelayDrain],
            Phase::Duplicates => &[Phase::ConsumerDrain, Phase::Republish],
            Phase::Sustained => &[Phase::ConsumerDrain],
            Phase::Latency => &[Phase::Sustained],
            _ => &[],
        }
    }

    /// How long the phase may run before it is stopped and reported as timed out: a timed
    /// phase its runs plus two minutes, a drain [`drain_timeout`] (each ceiling run refills
    /// and drains a backlog).
    pub(super) fn deadline(self, args: &RunArgs) -> Duration {
        let secs = Duration::from_secs_f64(args.seconds.max(0.0));
        let runs = ceiling_runs(args);
        let margin = Duration::from_secs(120);
        match self {
            Phase::Setup | Phase::Inserts1 | Phase::InsertsN => secs + margin,
            Phase::Business1 | Phase::BusinessN => secs * 4 + margin,
            Phase::ConsumerCeilingBefore | Phase::ConsumerCeilingAfter => secs * 2 * runs + margin,
            Phase::WritersBefore | Phase::WritersAfter => secs * runs + margin,
            Phase::RelayCeilingBefore
            | Phase::RelayCeilingAfter
            | Phase::CdcCeilingBefore
            | Phase::CdcCeilingAfter => drain_timeout(args) * runs,
            // Writing the backlog, then streaming it.
            Phase::CdcDrain => drain_timeout(args) * 2,
            Phase::Sustained => secs + drain_timeout(args),
            Phase::Latency => (secs + Duration::from_secs(40)) * 3 + margin,
            Phase::Backlog
            | Phase::RelayDrain
            | Phase::Consume
            | Phase::ConsumerDrain
            | Phase::NoInboxDrain
            | Phase::Republish
            | Phase::Duplicates => drain_timeout(args),
        }
    }

    /// The progress line's title for a run with `args`.
    pub(super) fn title(self, args: &RunArgs) -> String {
        let n = connections(args);
        let business = |conns: u32| {
            format!(
                "business transactions: alone, with the outbox insert, with a plain second row, with a logical decoding message, alternating; {conns} connection(s)"
            )
        };
        let relay_ceiling = |when: &str| {
            format!(
                "ceiling {when} the relay drain: lean claim-and-mark of {} rows in batches of {}, raw produce, SELECT 1",
                args.backlog, args.relay_batch_size
            )
        };
        let cdc_ceiling = |when: &str| {
            format!(
                "ceiling {when} the CDC relay drain: pgoutput decode of {} rows, raw produce, SELECT 1",
                args.backlog
            )
        };
        let consumer_ceiling = |when: &str| {
            format!(
                "ceiling {when} the consumer drain: set-based inbox + settlement, batches of {}, 1 and {} connection(s), SELECT 1",
                args.batch_size,
                partitions(args)
            )
        };
        let writers = |when: &str| {
            format!(
                "ceiling {when} the sustained run: {n} writers alone (no events flowing), SELECT 1"
            )
        };
        match self {
            Phase::Setup => "starting the broker and creating the databases".to_owned(),
            Phase::Inserts1 => "durable single-row inserts, 1 connection".to_owned(),
            Phase::InsertsN => format!("durable single-row inserts, {n} connections"),
            Phase::Business1 => business(1),
            Phase::BusinessN => business(n),
            Phase::Backlog => format!("writing a backlog of {} paid orders", args.backlog),
            Phase::RelayCeilingBefore => relay_ceiling("before"),
            Phase::RelayDrain => "relay drain (idem relay as a child process)".to_owned(),
            Phase::RelayCeilingAfter => relay_ceiling("after"),
            Phase::CdcCeilingBefore => cdc_ceiling("before"),
            Phase::CdcDrain => format!(
                "CDC relay drain: {} rows written in transactions of {} while it was stopped, streamed from its slot (idem cdc relay as a child process)",
                args.backlog, args.relay_batch_size
            ),
            Phase::CdcCeilingAfter => cdc_ceiling("after"),
            Phase::Consume => "raw rdkafka consume of the relay's records".to_owned(),
            Phase::ConsumerCeilingBefore => consumer_ceiling("before"),
            Phase::ConsumerDrain => {
                "consumer drain (idem-lab settlement as a child process)".to_owned()
            }
            Phase::ConsumerCeilingAfter => consumer_ceiling("after"),
            Phase::NoInboxDrain => {
                "consumer drain without the inbox (same consumer, inbox insert left out)".to_owned()
            }
            Phase::Republish => {
                "republishing the whole backlog (every event a second time)".to_owned()
            }
            Phase::Duplicates => "consumer drain of 100 % redelivered duplicates".to_owned(),
            Phase::WritersBefore => writers("before"),
            Phase::Sustained => format!(
                "sustained end to end: {n} writers as fast as they can, relay and consumer running"
            ),
            Phase::WritersAfter => writers("after"),
            Phase::Latency => {
                "commit → settlement latency, open-loop arrivals at 25, 50 and 80 % of the sustained rate"
                    .to_owned()
            }
        }
    }
}

/// Runs of each ceiling on each side of the phase it bounds (at least one).
pub(super) fn ceiling_runs(args: &RunArgs) -> u32 {
    args.ceiling_runs.max(1)
}

/// Partitions of the run's topics, the consumer ceiling's second connection count.
pub(super) fn partitions(args: &RunArgs) -> u32 {
    u32::try_from(args.partitions).unwrap_or(1).max(1)
}

/// How long a drain's count may stand still before the drain is called stuck.
pub(super) fn stall_limit(args: &RunArgs) -> Duration {
    Duration::from_secs_f64(args.stall_seconds.max(0.1))
}

/// Connections of the many-connection phases (at least one).
pub(super) fn connections(args: &RunArgs) -> u32 {
    args.connections.max(1)
}

/// How long a drain may take before the bench gives up.
pub(super) fn drain_timeout(args: &RunArgs) -> Duration {
    Duration::from_secs(120 + args.backlog / 100)
}

/// Owned command-line arguments.
pub(super) fn args_of(args: &[&str]) -> Vec<String> {
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
pub(super) fn relay_args(
    args: &RunArgs,
    db: &str,
    brokers: &str,
    topic_prefix: &str,
) -> Vec<String> {
    publisher_args(args, &["relay", "--no-prune"], db, brokers, topic_prefix)
}

/// `idem cdc relay` (table mode) over database `db` on `slot` (its publication `<slot>_pub`),
/// publishing under `topic_prefix`.
pub(super) fn cdc_relay_args(
    args: &RunArgs,
    db: &str,
    brokers: &str,
    topic_prefix: &str,
    slot: &str,
) -> Vec<String> {
    let publication = format!("{slot}_pub");
    let command = [
        "cdc",
        "relay",
        "--slot",
        slot,
        "--publication",
        &publication,
    ];
    publisher_args(args, &command, db, brokers, topic_prefix)
}

/// `command`, then a relay's common arguments: database, brokers, topic prefix, batch size and
/// producer settings.
fn publisher_args(
    args: &RunArgs,
    command: &[&str],
    db: &str,
    brokers: &str,
    topic_prefix: &str,
) -> Vec<String> {
    let mut v = args_of(command);
    let batch = args.relay_batch_size.to_string();
    let common = [
        "--db",
        db,
        "--brokers",
        brokers,
        "--topic-prefix",
        topic_prefix,
        "--batch-size",
        &batch,
    ];
    v.extend(args_of(&common));
    v.extend(settings("--producer-config", &args.producer_config));
    v
}

/// A settlement consumer's arguments after `command` (`settlement`, or `bench
/// no-inbox-consumer`): database `db`, `topic`, `group`, the batch size and consumer settings.
pub(super) fn consumer_args(
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
pub(super) fn rate(delta: u64, elapsed: Duration) -> f64 {
    crate::num::per_second(delta, elapsed)
}

/// The open-loop arrival rates: each load of [`LOADS`] and its share of `sustained`.
pub(super) fn open_loop_rates(sustained: f64) -> [(u32, f64); 3] {
    LOADS.map(|pct| (pct, sustained * f64::from(pct) / 100.0))
}

/// A small run's arguments, for unit tests.
#[cfg(test)]
pub(super) fn sample_args() -> RunArgs {
    RunArgs {
        db: "postgres://h/db".to_owned(),
        brokers: "embedded".to_owned(),
        broker_security: None,
        kafka: Box::default(),
        backlog: 2_000,
        batch_size: 200,
        relay_batch_size: 500,
        message_size: 256,
        seconds: 1.0,
        connections: 4,
        partitions: 3,
        consumer_config: vec![("fetch.wait.max.ms".to_owned(), "5".to_owned())],
        producer_config: vec![("linger.ms".to_owned(), "1".to_owned())],
        ceiling_runs: 2,
        stall_seconds: 60.0,
        lock_outbox_during_republish: false,
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
    fn the_plan_has_distinct_phases_with_their_titles_and_keys() {
        let a = args();
        let titles: Vec<String> = PHASES.iter().map(|p| p.title(&a)).collect();
        let keys: Vec<&str> = PHASES.iter().map(|p| p.key()).collect();
        for (i, (t, k)) in titles.iter().zip(&keys).enumerate() {
            assert!(!titles[..i].contains(t), "{t} twice");
            assert!(!keys[..i].contains(k), "{k} twice");
        }
        assert_eq!(
            Phase::InsertsN.title(&a),
            "durable single-row inserts, 4 connections"
        );
        assert!(Phase::Business1.title(&a).ends_with("; 1 connection(s)"));
        assert!(Phase::BusinessN.title(&a).ends_with("; 4 connection(s)"));
        assert_eq!(
            Phase::RelayCeilingAfter.title(&a),
            "ceiling after the relay drain: lean claim-and-mark of 2000 rows in batches of 500, raw produce, SELECT 1"
        );
        assert!(
            Phase::ConsumerCeilingBefore
                .title(&a)
                .contains("1 and 3 connection(s)")
        );
    }

    #[test]
    fn each_ceiling_brackets_the_phase_it_bounds() {
        let at = |p: Phase| PHASES.iter().position(|q| *q == p).unwrap();
        for [before, phase, after] in [RELAY, CDC, CONSUMER, WRITERS] {
            assert_eq!(at(before) + 1, at(phase), "{phase:?}");
            assert_eq!(at(phase) + 1, at(after), "{phase:?}");
        }
        // A phase only needs phases that run before it.
        for p in PHASES {
            for n in p.needs() {
                assert!(at(*n) < at(p), "{p:?} needs {n:?}");
            }
        }
    }

    #[test]
    fn every_phase_has_a_finite_deadline_longer_than_its_work() {
        let a = args();
        for p in PHASES {
            let d = p.deadline(&a);
            assert!(d >= Duration::from_secs(60), "{p:?}: {d:?}");
            assert!(d <= Duration::from_secs(3_600), "{p:?}: {d:?}");
        }
        assert_eq!(Phase::RelayDrain.deadline(&a), drain_timeout(&a));
        assert_eq!(stall_limit(&a), Duration::from_secs(60));
        let one = RunArgs {
            ceiling_runs: 0,
            partitions: 0,
            ..args()
        };
        assert_eq!((ceiling_runs(&one), partitions(&one)), (1, 1));
    }

    #[test]
    fn children_get_the_run_s_settings() {
        let a = args();
        assert_eq!(
            relay_args(&a, "postgres://o", "b:9092", "p."),
            args_of(&[
                "relay",
                "--no-prune",
                "--db",
                "postgres://o",
                "--brokers",
                "b:9092",
                "--topic-prefix",
                "p.",
                "--batch-size",
                "500",
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
