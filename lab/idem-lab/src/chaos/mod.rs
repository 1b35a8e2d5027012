//! `idem-lab chaos`: the reference pipeline as separate OS processes against PostgreSQL and Apache
//! Kafka (one node, or a 3-node cluster with `--kafka-nodes 3`) — two order writers, two relays, two settlement consumers in one group, an audit
//! consumer group, the effect dispatcher and the points API — while a seeded schedule kills
//! them (SIGKILL), pauses them (SIGSTOP/SIGCONT), restarts them with named crash points armed,
//! and kills and restarts brokers (with three nodes: the leader of a partition in use, and pauses
//! a follower). Then it stops injecting, waits for the pipeline to settle
//! (a deadline: missing it is a liveness failure), runs `idem verify`, and reports.
//!
//! `--break MECHANISM` runs a negative control: one mechanism deliberately broken, which the
//! run must report as a violation.

mod hostile;
pub mod kafka;
pub mod kafka_txn;
mod procs;
mod windows;

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use idem_core::TableNames;
use idem_core::crash::{BREAKABLE, CRASH_POINTS};
use serde::Serialize;

use crate::demo::world::Databases;
use procs::{Proc, Rng, Role};

#[derive(Args, Debug, Clone)]
pub struct ChaosArgs {
    /// How long to inject faults.
    #[arg(long, default_value_t = 120)]
    pub seconds: u64,
    /// Seed of the fault schedule (the same seed, the same schedule).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// PostgreSQL server URL: the run creates (and drops) its own databases on it.
    #[arg(
        long,
        env = "IDEM_CHAOS_PG",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    pub db: String,
    /// Kafka nodes: 1, or 3 (replication 3, `min.insync.replicas=2`; the leader of a partition
    /// in use is killed and followers are paused).
    #[arg(long, default_value_t = 1, value_parser = parse_nodes)]
    pub kafka_nodes: usize,
    /// Orders per second, per writer.
    #[arg(long, default_value_t = 25.0)]
    pub rate: f64,
    /// Break one mechanism on purpose (a negative control): the run must report a violation.
    #[arg(long = "break", value_parser = negative_controls())]
    pub break_mechanism: Option<String>,
    /// How long the pipeline may take to settle after the faults stop.
    #[arg(long, default_value = "180s", value_parser = idem_cli::util::parse_duration)]
    pub settle_deadline: Duration,
    /// Keep the databases and logs afterwards.
    #[arg(long)]
    pub keep: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// The report.
#[derive(Debug, Serialize)]
pub struct ChaosReport {
    pub ok: bool,
    pub failures: Vec<String>,
    pub seed: u64,
    pub seconds: u64,
    pub kafka_nodes: usize,
    pub negative_control: Option<String>,
    pub orders: i64,
    pub faults: BTreeMap<String, u64>,
    pub crash_points_fired: BTreeMap<String, u64>,
    /// Counted by the consumers' metrics (lower bound: a killed process loses what it counted
    /// since its last scrape).
    pub duplicate_deliveries: u64,
    pub duplicate_skips: u64,
    /// Counted by the relays' metrics (lower bound, as above).
    pub republishes: u64,
    /// Deliveries beyond the first, from the inboxes (exact).
    pub inbox_duplicate_deliveries: i64,
    /// Copies in the topic beyond the first per event id (exact).
    pub topic_duplicates: i64,
    pub settle_seconds: f64,
    /// Missing effects whose event is still in the topic at or beyond its consumer group's
    /// committed offset, per check: the group has not read past it, so it is not lost but
    /// late — a liveness failure (the broker left the group without a working
    /// assignment), reported apart from losses.
    pub unconsumed: BTreeMap<String, u64>,
    /// Missing effects that are not `unconsumed`: the event never reached the topic, or its
    /// group read past it without applying it.
    pub lost: u64,
    pub duplicate_effects: u64,
    /// Hostile rows written through the SQL contract: per row (name and event id), where it
    /// ended; refused rows are counted in `faults` (`hostile_rows_refused`).
    pub hostile_rows: BTreeMap<String, String>,
    /// Panics in any process's log (a process a foreign writer or a remote can panic).
    pub panics: Vec<String>,
    /// Executions of one Idempotency-Key that overlapped in the points API during slow
    /// windows (`points_lab_overlaps`): each is an effect the key failed to make once.
    pub overlapping_executions: i64,
    pub logs: Option<String>,
    pub verify: idem_verify::Report,
}

/// The negative controls: the mechanisms idem can break (`IDEM_BREAK`). One of them,
/// [`KAFKA_TRANSACTIONS`], replaces the settlement consumers' inbox with Kafka transactions
/// (read_committed, offsets committed in a transaction after the database commit): "we turned
/// on Kafka exactly-once" does not make a database side effect happen once.
///
/// `skip-sending-mark` is left out: the run's points route honours keys, so breaking the mark
/// for keyless remotes would go unnoticed — a control that cannot fail. The battery catches it
/// (`without_the_sending_mark_the_same_crash_awards_twice`, real processes killed).
fn negative_controls() -> Vec<&'static str> {
    BREAKABLE
        .iter()
        .copied()
        .filter(|b| *b != idem_core::crash::BREAK_SKIP_SENDING_MARK)
        .collect()
}

use idem_core::crash::BREAK_KAFKA_TRANSACTIONS as KAFKA_TRANSACTIONS;

fn parse_nodes(s: &str) -> Result<usize, String> {
    match s {
        "1" => Ok(1),
        "3" => Ok(3),
        _ => Err(format!("{s}: a chaos cluster has 1 or 3 Kafka nodes")),
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn idem_cmd(args: &[&str], env: &[(&str, String)]) -> anyhow::Result<Command> {
    let mut cmd = Command::new(std::env::current_exe().context("locating the idem binary")?);
    cmd.args(args)
        .env("RUST_LOG", "warn,idem=info")
        .env_remove("IDEM_CRASH_POINTS")
        .env_remove("IDEM_LAB_AWARD_DELAY")
        .env_remove("IDEM_POINTS_KEY_LOCK")
        .env_remove("IDEM_LAB_SLOW_ONE_IN");
    for (k, v) in env {
        cmd.env(k, v);
    }
    Ok(cmd)
}

fn crash_counts(log: &Path) -> BTreeMap<String, u64> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut out: BTreeMap<String, u64> =
        CRASH_POINTS.iter().map(|p| ((*p).to_owned(), 0)).collect();
    for line in text.lines() {
        if let Some(n) = out.get_mut(line.trim()) {
            *n += 1;
        }
    }
    out
}

fn role_of_point(point: &str) -> Role {
    if point.starts_with("relay.") {
        Role::Relay
    } else if point.starts_with("consumer.") {
        Role::Settlement
    } else {
        Role::Dispatcher
    }
}

/// The crash point whose window a broken mechanism turns into a violation.
fn window_of(mechanism: &str) -> Option<&'static str> {
    use idem_core::crash as c;
    match mechanism {
        c::BREAK_MARK_BEFORE_REPORT => Some(c::RELAY_AFTER_CLAIM_BEFORE_PUBLISH),
        c::BREAK_OFFSET_BEFORE_COMMIT => Some(c::CONSUMER_AFTER_DEDUP_BEFORE_HANDLER),
        c::BREAK_SELECT_THEN_INSERT => Some(c::CONSUMER_AFTER_DB_COMMIT_BEFORE_OFFSET_COMMIT),
        c::BREAK_NEW_KEY_PER_RETRY => Some(c::EFFECT_AFTER_HTTP_SUCCESS_BEFORE_RECORD),
        KAFKA_TRANSACTIONS => Some(c::CONSUMER_AFTER_DB_COMMIT_BEFORE_OFFSET_COMMIT),
        _ => None,
    }
}

/// The checks of a chaos run: the reference pipeline's, plus the audit group's log.
fn verify_config(urls: &[String; 3]) -> idem_verify::VerifyConfig {
    let mut config = idem_verify::VerifyConfig::reference(&urls[0], &urls[1], Some(&urls[2]));
    config.checks.push(idem_verify::Check {
        name: "audit".to_owned(),
        event_type: Some("order.paid".to_owned()),
        source: idem_verify::Side {
            db: urls[0].clone(),
            query: "SELECT payment_id, amount_minor, order_id FROM orders".to_owned(),
            key: "payment_id".to_owned(),
            amount: Some("amount_minor".to_owned()),
            event_type_column: None,
            aggregate_id: Some("order_id".to_owned()),
        },
        target: idem_verify::Side {
            db: urls[1].clone(),
            query: "SELECT payment_id, amount_minor FROM audit_log".to_owned(),
            key: "payment_id".to_owned(),
            amount: Some("amount_minor".to_owned()),
            event_type_column: None,
            aggregate_id: None,
        },
        locate: Some(idem_verify::Locate {
            outbox_db: None,
            aggregate_type: "order".to_owned(),
            event_type: "order.paid".to_owned(),
            inbox_db: urls[1].clone(),
            consumer_group: "audit".to_owned(),
            intents_db: None,
            effect: None,
        }),
    });
    config
}

pub async fn run(args: ChaosArgs) -> anyhow::Result<()> {
    if !idem_core::crash::ENABLED {
        bail!("this idem binary was built without crash points (the `failpoints` feature)");
    }
    let run = format!("c{}{}", args.seed, std::process::id());
    let tables = TableNames::default();
    let dbs = Databases::create(Some(&args.db), None, &run, &tables).await?;
    let dir = tempfile::Builder::new().prefix("idem-chaos-").tempdir()?;
    // Ctrl-C or SIGTERM ends the run: dropping `drive` kills every process it started, brokers
    // included (`Proc` kills its child on drop), and the databases are still dropped.
    let interrupted = idem_cli::util::shutdown_signal()?;
    let result = tokio::select! {
        r = drive(&args, &dbs, dir.path(), &run) => r,
        () = interrupted => Err(anyhow::anyhow!(
            "interrupted: every process of the run was killed and its databases are dropped"
        )),
    };
    let cleanup = dbs.cleanup(args.keep).await;
    let mut report = result?;
    cleanup?;
    if args.keep || !report.ok {
        let kept = dir.keep();
        report.logs = Some(kept.display().to_string());
    }
    idem_cli::verify_cmd::emit(&report, args.json, report.ok, print_report)
}

#[allow(clippy::too_many_lines)]
async fn drive(
    args: &ChaosArgs,
    dbs: &Databases,
    dir: &Path,
    run: &str,
) -> anyhow::Result<ChaosReport> {
    let mut rng = Rng::new(args.seed);
    let crash_log = dir.join("crashes.log");
    let mut env: Vec<(&str, String)> = vec![("IDEM_CRASH_LOG", crash_log.display().to_string())];
    let kafka_transactions = args.break_mechanism.as_deref() == Some(KAFKA_TRANSACTIONS);
    if let Some(b) = &args.break_mechanism {
        env.push(("IDEM_BREAK", b.clone()));
    }
    let api_port = free_port()?;
    let prefix = format!("chaos-{run}.");
    let topic = format!("{prefix}order");
    let [orders_url, settle_url, points_url] = dbs.urls.clone();
    let target = format!("http://127.0.0.1:{api_port}/awards");

    // The brokers first (procs[..kafka_nodes]), each node a child of this runner.
    let prepared = kafka::prepare(args.kafka_nodes, dir)?;
    let brokers = prepared.bootstrap.clone();
    let mut procs: Vec<Proc> = prepared.nodes;
    let mut add = |role: Role, name: String, argv: Vec<String>| -> anyhow::Result<()> {
        let env = env.clone();
        // Fail now on an unusable binary path rather than inside the closure.
        idem_cmd(&[], &[])?;
        procs.push(Proc::new(
            role,
            name,
            dir,
            Box::new(move |n| {
                let argv: Vec<String> = argv
                    .iter()
                    .map(|a| a.replace("{n}", &n.to_string()))
                    .collect();
                let refs: Vec<&str> = argv.iter().map(String::as_str).collect();
                idem_cmd(&refs, &env).unwrap_or_else(|_| Command::new("false"))
            }),
        ));
        Ok(())
    };
    let s = |v: &[&str]| v.iter().map(|x| (*x).to_owned()).collect::<Vec<_>>();
    add(
        Role::Api,
        "points-api".to_owned(),
        s(&[
            "points-api",
            "--db",
            &points_url,
            "--listen",
            &format!("127.0.0.1:{api_port}"),
        ]),
    )?;
    for i in 0..2 {
        let mut argv = s(&[
            "orders",
            "--db",
            &orders_url,
            "--count",
            "100000000",
            "--rate",
            &args.rate.to_string(),
            "--prefix",
            &format!("w{i}-{{n}}-"),
        ]);
        if i == 1 {
            // Slow transactions: rows committed after rows with higher ids.
            argv.extend(s(&["--slow-every", "5", "--slow-ms", "400"]));
        }
        add(Role::Writer, format!("writer-{i}"), argv)?;
    }
    for i in 0..2 {
        add(
            Role::Relay,
            format!("relay-{i}"),
            s(&[
                "relay",
                "--db",
                &orders_url,
                "--brokers",
                &brokers,
                "--topic-prefix",
                &prefix,
                // A claim plus one publish (2 × 2 s) must fit: claims under load take seconds.
                "--lease",
                "8s",
                "--producer-config",
                "message.timeout.ms=2000",
                "--batch-size",
                "100",
                "--no-prune",
                "--metrics-addr",
                "127.0.0.1:0",
            ]),
        )?;
    }
    // Static group membership: a restarted consumer takes its predecessor's place (and
    // partitions) in the group at once, instead of waiting for a dead member to expire.
    // The kafka-transactions control replaces the settlement group's consumers (not the audit
    // group's) with one that has no inbox and commits offsets in Kafka transactions.
    let consumer = |group: &str, handler: &str, member: &str| {
        let mut v = s(&[
            "--db",
            &settle_url,
            "--brokers",
            &brokers,
            "--group",
            group,
            "--topic",
            &topic,
        ]);
        if kafka_transactions && handler == "settlement" {
            v.insert(0, "kafka-txn-settlement".to_owned());
        } else {
            v.insert(0, "settlement".to_owned());
            v.extend(s(&["--handler", handler, "--metrics-addr", "127.0.0.1:0"]));
            if handler == "settlement" {
                // The long-lock window: a locked settlements table fails handlers fast.
                v.extend(s(&["--lock-timeout-ms", windows::LOCK_TIMEOUT_MS]));
            }
        }
        v.extend(s(&[
            "--batch-size",
            "50",
            "--consumer-config",
            "session.timeout.ms=10000",
            "--consumer-config",
            "max.poll.interval.ms=10000",
            "--consumer-config",
            "heartbeat.interval.ms=1000",
            "--consumer-config",
            &format!("group.instance.id={member}"),
        ]));
        if handler == "settlement" {
            v.extend(s(&["--points-url", &target]));
        }
        v
    };
    for i in 0..2 {
        add(
            Role::Settlement,
            format!("settlement-{i}"),
            consumer("settlement", "settlement", &format!("settlement-{i}")),
        )?;
    }
    add(
        Role::Audit,
        "audit".to_owned(),
        consumer("audit", "audit", "audit-0"),
    )?;
    add(
        Role::Dispatcher,
        "dispatcher".to_owned(),
        s(&[
            "effects",
            "dispatch",
            "--db",
            &settle_url,
            "--authorization",
            "Bearer settlement",
            "--timeout",
            "2s",
            // Spare capacity: in a slow window a slow award holds its claim until the timeout,
            // and its retry must not queue behind a backlog (windows.rs).
            "--concurrency",
            "64",
            "--metrics-addr",
            "127.0.0.1:0",
        ]),
    )?;

    // Start: the brokers, the topic, then everything else.
    let nodes = args.kafka_nodes;
    for p in procs.iter_mut().filter(|p| p.role == Role::Broker) {
        p.start(&[])?;
    }
    kafka::wait_ready(&brokers, nodes, Duration::from_secs(120))
        .await
        .with_context(|| format!("starting Kafka (see {})", dir.display()))?;
    // Replicated as production topics should be: min(3, nodes) copies.
    let replication = i32::try_from(nodes.min(3))?;
    idem_kafka::ensure_topics(&brokers, std::slice::from_ref(&topic), 4, replication)
        .await
        .context("creating the topic")?;
    for p in procs.iter_mut().filter(|p| p.role != Role::Broker) {
        p.start(&[])?;
    }
    eprintln!(
        "idem chaos: seed {} for {} s; {}; Kafka ({nodes} node(s)) on {brokers}; logs in {}{}",
        args.seed,
        args.seconds,
        dbs.location,
        dir.display(),
        args.break_mechanism
            .as_deref()
            .map(|b| format!("; NEGATIVE CONTROL: {b} broken"))
            .unwrap_or_default()
    );

    // The fault schedule: every crash point armed once early (in a seeded order), then a mix.
    let mut faults: BTreeMap<String, u64> = BTreeMap::new();
    let mut first_round: Vec<&str> = CRASH_POINTS.to_vec();
    for i in (1..first_round.len()).rev() {
        first_round.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let focus = args.break_mechanism.as_deref().and_then(window_of);
    let started = Instant::now();
    let end = started + Duration::from_secs(args.seconds);
    let mut next_fault = started + Duration::from_secs(2);
    let mut last_broker_kill = started;
    let mut last_scrape = started;
    let mut last_progress = started;
    let counters = [
        "idem_duplicate_delivery_total",
        "idem_duplicate_skip_total",
        "idem_outbox_republish_total",
    ];
    let mut tick: u64 = 0;
    let mut hostile_round: u64 = 0;
    let mut next_hostile = started + Duration::from_secs(5);
    let mut hostile_accepted: Vec<hostile::Accepted> = vec![];
    let mut hostile_violations: Vec<String> = vec![];
    let mut windows = windows::Windows::new(started);
    while Instant::now() < end {
        supervise(&mut procs, &mut rng);
        let now = Instant::now();
        windows
            .tick(now, end, &mut procs, &dbs.settlement, &mut faults)
            .await?;
        if now >= next_hostile {
            // A foreign writer's round of hostile rows, every 20 to 40 s.
            hostile_round += 1;
            let round = hostile::insert_round(&dbs.orders, hostile_round).await?;
            *faults.entry("hostile_rows".to_owned()).or_default() +=
                (round.accepted.len() + round.refused) as u64;
            *faults.entry("hostile_rows_refused".to_owned()).or_default() += round.refused as u64;
            hostile_accepted.extend(round.accepted);
            hostile_violations.extend(round.violations);
            next_hostile = now + rng.between(Duration::from_secs(20), Duration::from_secs(40));
        }
        if now >= last_scrape + Duration::from_secs(1) {
            for p in procs.iter_mut().filter(|p| p.role != Role::Broker) {
                p.scrape(&counters);
            }
            last_scrape = now;
        }
        if now >= next_fault {
            tick += 1;
            let fired = crash_counts(&crash_log);
            let unfired: Vec<&str> = first_round
                .iter()
                .copied()
                .filter(|p| fired.get(*p).copied().unwrap_or(0) == 0)
                .collect();
            let roll = rng.below(100);
            let broker_due = now >= last_broker_kill + Duration::from_secs(15);
            let no_broker_fault_yet = !faults.keys().any(|k| is_broker_fault(k));
            // The first broker fault is not left to the dice: every run of 15 s or more has one.
            let kind = if broker_due && no_broker_fault_yet {
                "broker"
            } else if (!unfired.is_empty() && tick % 2 == 1) || roll < 30 {
                "crash_point"
            } else if roll < 60 {
                "sigkill"
            } else if roll < 80 {
                "sigstop"
            } else if roll < 90 && broker_due {
                "broker"
            } else {
                "sigterm_restart"
            };
            match kind {
                "crash_point" => {
                    // The unfired point armed least often so far, else any; a negative control
                    // also aims at the window its broken mechanism opens, every other time.
                    let point = match focus {
                        Some(f) if unfired.is_empty() || rng.below(2) == 0 => f,
                        _ => unfired
                            .iter()
                            .copied()
                            .min_by_key(|p| {
                                faults
                                    .get(&format!("crash_point_armed:{p}"))
                                    .copied()
                                    .unwrap_or(0)
                            })
                            .unwrap_or(CRASH_POINTS[rng.below(CRASH_POINTS.len() as u64) as usize]),
                    };
                    let role = role_of_point(point);
                    let candidates: Vec<usize> = (0..procs.len())
                        .filter(|i| procs[*i].role == role && !procs[*i].armed(now))
                        .collect();
                    if candidates.is_empty() {
                        continue;
                    }
                    let i = candidates[rng.below(candidates.len() as u64) as usize];
                    let hit = 1 + rng.below(3);
                    procs[i].kill9();
                    procs[i].start(&[("IDEM_CRASH_POINTS", format!("{point}@{hit}"))])?;
                    // Left alone for a while, so that the point has work to reach it.
                    procs[i].armed_until = Some(now + Duration::from_secs(8));
                    *faults
                        .entry(format!("crash_point_armed:{point}"))
                        .or_default() += 1;
                }
                "broker" => {
                    let partition = if nodes > 1 {
                        let (b, t) = (brokers.clone(), topic.clone());
                        let parts = tokio::task::spawn_blocking(move || {
                            idem_kafka::admin::partitions(
                                &idem_kafka::admin::connection(&b),
                                &t,
                                Duration::from_secs(2),
                            )
                        })
                        .await?
                        .unwrap_or_default();
                        let n = parts.len().max(1) as u64;
                        parts.get(rng.below(n) as usize).cloned()
                    } else {
                        None
                    };
                    let all_up = procs
                        .iter_mut()
                        .filter(|p| p.role == Role::Broker)
                        .all(|p| p.running() && p.paused_until.is_none());
                    let Some(fault) =
                        kafka::choose(nodes, rng.next(), no_broker_fault_yet, partition.as_ref())
                            .filter(|_| all_up)
                    else {
                        next_fault = now + Duration::from_millis(500);
                        continue;
                    };
                    let (kafka::BrokerFault::Kill(id)
                    | kafka::BrokerFault::LeaderKill(id)
                    | kafka::BrokerFault::FollowerPause(id)
                    | kafka::BrokerFault::Pause(id)) = fault;
                    let Some(node) = procs.iter_mut().find(|p| p.name == format!("kafka-{id}"))
                    else {
                        bail!("the cluster reported broker {id}, which this run did not start");
                    };
                    match fault {
                        kafka::BrokerFault::Kill(_) | kafka::BrokerFault::LeaderKill(_) => {
                            node.kill9();
                            node.restart_at = Some(
                                now + rng.between(Duration::from_secs(1), Duration::from_secs(4)),
                            );
                        }
                        kafka::BrokerFault::FollowerPause(_) | kafka::BrokerFault::Pause(_) => {
                            node.signal(19);
                            node.paused_until = Some(
                                now + rng.between(Duration::from_secs(1), Duration::from_secs(3)),
                            );
                        }
                    }
                    last_broker_kill = now;
                    *faults.entry(fault.kind().to_owned()).or_default() += 1;
                }
                _ => {
                    // Any process but the brokers.
                    let others: Vec<usize> = (0..procs.len())
                        .filter(|i| procs[*i].role != Role::Broker)
                        .collect();
                    let i = others[rng.below(others.len() as u64) as usize];
                    if !procs[i].running() || procs[i].paused_until.is_some() || procs[i].armed(now)
                    {
                        next_fault = now + Duration::from_millis(100);
                        continue;
                    }
                    match kind {
                        "sigkill" => {
                            procs[i].kill9();
                            procs[i].restart_at = Some(
                                now + rng.between(
                                    Duration::from_millis(200),
                                    Duration::from_millis(1500),
                                ),
                            );
                        }
                        "sigstop" => {
                            procs[i].signal(19);
                            procs[i].paused_until = Some(
                                now + rng.between(Duration::from_secs(1), Duration::from_secs(4)),
                            );
                        }
                        _ => {
                            procs[i].stop(Duration::from_secs(10));
                            procs[i].restart_at = Some(now + Duration::from_millis(200));
                        }
                    }
                    *faults.entry(kind.to_owned()).or_default() += 1;
                }
            }
            next_fault = now + rng.between(Duration::from_millis(400), Duration::from_millis(1600));
        }
        if now >= last_progress + Duration::from_secs(5) {
            let fired: u64 = crash_counts(&crash_log).values().sum();
            eprintln!(
                "idem chaos: {:>4} s  orders {}  settled {}  awarded {}  faults {}  crash points fired {fired}",
                started.elapsed().as_secs(),
                dbs.orders
                    .scalar("SELECT count(*) FROM orders")
                    .await
                    .unwrap_or(-1),
                dbs.settlement
                    .scalar("SELECT count(*) FROM settlements")
                    .await
                    .unwrap_or(-1),
                dbs.points
                    .scalar("SELECT count(*) FROM points_awards")
                    .await
                    .unwrap_or(-1),
                faults.values().sum::<u64>(),
            );
            last_progress = now;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Stop injecting: close the windows, resume the paused, restart the dead, stop the writers.
    eprintln!("idem chaos: faults stopped; waiting for the pipeline to settle");
    windows.close(&mut procs).await?;
    for p in procs.iter_mut() {
        if p.paused_until.take().is_some() {
            p.signal(18);
        }
    }
    for p in procs.iter_mut().filter(|p| p.role == Role::Writer) {
        p.stop(Duration::from_secs(10));
    }
    for p in procs.iter_mut().filter(|p| p.role != Role::Writer) {
        if !p.running() {
            p.start(&[])?;
        }
    }
    let settle_started = Instant::now();
    let config = verify_config(&dbs.urls);
    // Progress checks skip the localisation (it costs point queries per missing key); the
    // final verification locates.
    let quick = idem_verify::Options { locate_limit: 0 };
    let mut last: Option<(u64, u64, i64, i64, i64, usize)> = None;
    let mut stable = 0;
    let mut live = false;
    let mut verify = idem_verify::verify(&config, &quick).await?;
    while settle_started.elapsed() < args.settle_deadline {
        for p in procs.iter_mut().filter(|p| p.role != Role::Writer) {
            if !p.running() {
                p.start(&[])?;
            }
            p.scrape(&counters);
        }
        verify = idem_verify::verify(&config, &quick).await?;
        let hostile_open = hostile::fates(&dbs.orders, &dbs.settlement, &hostile_accepted)
            .await?
            .iter()
            .filter(|(_, f)| hostile::contained(f).is_err())
            .count();
        if verify.clean && hostile_open == 0 {
            live = true;
            break;
        }
        // A broken mechanism never converges: settled means nothing moves any more.
        let unpublished = dbs
            .orders
            .scalar("SELECT count(*) FROM idem_outbox WHERE status = 'pending'")
            .await?;
        let pending_effects = dbs
            .settlement
            .scalar("SELECT count(*) FROM idem_effect_intents WHERE status = 'pending'")
            .await?;
        let applied = dbs
            .settlement
            .scalar("SELECT (SELECT count(*) FROM settlement_applications) + (SELECT count(*) FROM audit_log)")
            .await?;
        let now = (
            verify.lost(),
            verify.duplicate_effects(),
            unpublished,
            pending_effects,
            applied,
            hostile_open,
        );
        if last == Some(now) {
            stable += 1;
        } else {
            stable = 0;
        }
        last = Some(now);
        if stable >= 5 && unpublished == 0 && pending_effects == 0 {
            // Nothing moved for five checks. What is missing stays missing — unless some of it
            // waits in the topic for a group that has not consumed it yet: a consumer coming
            // back from a broker fault (reconnect backoff, session and poll timeouts of 10 s
            // each) can take longer than five checks. Then wait on, up to the deadline.
            let waiting: u64 = match read_topic(&brokers, &topic).await? {
                Ok(records) => unconsumed(&brokers, &topic, &records, dbs)
                    .await?
                    .values()
                    .sum(),
                Err(_) => 0,
            };
            if waiting == 0 {
                live = true;
                break;
            }
            stable = 0;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let settle_seconds = settle_started.elapsed().as_secs_f64();
    if !verify.clean {
        verify = idem_verify::verify(&config, &idem_verify::Options::default()).await?;
    }

    // The exact numbers, before stopping everything.
    let inbox_dups = dbs
        .settlement
        .scalar("SELECT COALESCE(sum(delivery_count - 1), 0)::bigint FROM idem_inbox")
        .await?;
    let records = read_topic(&brokers, &topic).await?;
    let topic_duplicates = match &records {
        Ok(records) => {
            let ids: std::collections::HashSet<&str> =
                records.iter().filter_map(|r| r.header("ce_id")).collect();
            records.len() as i64 - ids.len() as i64
        }
        Err(_) => -1,
    };
    let unconsumed = match &records {
        Ok(records) => unconsumed(&brokers, &topic, records, dbs).await?,
        Err(_) => BTreeMap::new(),
    };
    let mut hostile_rows = BTreeMap::new();
    for (a, fate) in hostile::fates(&dbs.orders, &dbs.settlement, &hostile_accepted).await? {
        let key = format!("{} {}", a.name, a.event_id);
        match hostile::contained(&fate) {
            Ok(how) => {
                hostile_rows.insert(key, how);
            }
            Err(open) => {
                hostile_violations.push(format!("hostile row {key}: {open}"));
                hostile_rows.insert(key, open);
            }
        }
    }
    let panics: Vec<String> = procs.iter().flat_map(Proc::panics).collect();
    let overlapping_executions = windows::overlapping_executions(&dbs.points).await?;
    let sum = |name: &str| -> u64 { procs.iter().map(|p| p.total(name)).sum::<f64>() as u64 };
    let (dup_deliveries, dup_skips, republishes) = (
        sum("idem_duplicate_delivery_total"),
        sum("idem_duplicate_skip_total"),
        sum("idem_outbox_republish_total"),
    );
    for p in procs.iter_mut().filter(|p| p.role != Role::Broker) {
        p.stop(Duration::from_secs(10));
    }
    for p in procs.iter_mut().filter(|p| p.role == Role::Broker) {
        p.stop(Duration::from_secs(10));
    }

    let crash_points_fired = crash_counts(&crash_log);
    let mut failures = vec![];
    if !live {
        failures.push(format!(
            "liveness: the pipeline did not settle within {:?} after the faults stopped",
            args.settle_deadline
        ));
    }
    if overlapping_executions > 0 {
        failures.push(format!(
            "duplicate execution: {overlapping_executions} overlapping executions of one Idempotency-Key in the slow points API"
        ));
    }
    failures.extend(hostile_violations);
    if !panics.is_empty() {
        failures.push(format!(
            "{} panic(s) in process logs, first: {}",
            panics.len(),
            panics[0]
        ));
    }
    let unconsumed_total: u64 = unconsumed.values().sum();
    let lost = verify.lost().saturating_sub(unconsumed_total);
    // Violations other than missing effects (duplicates, amount mismatches, unexpected rows).
    let other_violations: u64 = verify
        .checks
        .iter()
        .flat_map(|c| &c.by_event_type)
        .map(|t| t.unexpected + t.duplicate_effects + t.amount_mismatches + t.duplicate_source_keys)
        .sum::<u64>()
        + verify.unique.iter().map(|u| u.duplicated_keys).sum::<u64>();
    if unconsumed_total > 0 {
        failures.push(format!(
            "liveness: {unconsumed_total} missing effects wait for events still in the topic at or beyond their group's committed offset ({}); not lost — the group resumes from there — but the broker gave them to no live consumer",
            unconsumed
                .iter()
                .map(|(c, n)| format!("check {c}: {n}"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    if !verify.clean && (lost > 0 || other_violations > 0) {
        failures.push(format!(
            "verification: {lost} lost, {} duplicate effects (see the report)",
            verify.duplicate_effects()
        ));
    }
    if args.seconds >= 120 {
        for (point, n) in &crash_points_fired {
            if *n == 0 {
                failures.push(format!("crash point {point} never fired"));
            }
        }
    }
    if dup_deliveries == 0 && inbox_dups == 0 {
        failures.push("vacuous: no duplicate delivery happened, so nothing was proved".to_owned());
    }
    Ok(ChaosReport {
        ok: failures.is_empty(),
        failures,
        seed: args.seed,
        seconds: args.seconds,
        kafka_nodes: args.kafka_nodes,
        negative_control: args.break_mechanism.clone(),
        orders: dbs.orders.scalar("SELECT count(*) FROM orders").await?,
        faults,
        crash_points_fired,
        duplicate_deliveries: dup_deliveries,
        duplicate_skips: dup_skips,
        republishes,
        inbox_duplicate_deliveries: inbox_dups,
        topic_duplicates,
        settle_seconds,
        unconsumed,
        lost,
        duplicate_effects: verify.duplicate_effects(),
        hostile_rows,
        panics,
        overlapping_executions,
        logs: None,
        verify,
    })
}

/// Whether a `faults` key counts a broker fault.
fn is_broker_fault(kind: &str) -> bool {
    matches!(
        kind,
        "broker_kill" | "broker_pause" | "leader_kill" | "follower_pause"
    )
}

/// Every record of the run's topic (an error when the topic cannot be read).
async fn read_topic(
    brokers: &str,
    topic: &str,
) -> anyhow::Result<idem_core::Result<Vec<idem_kafka::inspect::Record>>> {
    let (brokers, topic) = (brokers.to_owned(), topic.to_owned());
    Ok(tokio::task::spawn_blocking(move || {
        idem_kafka::inspect::read_all(&brokers, &topic, Duration::from_secs(60))
    })
    .await?)
}

/// Per check, the missing effects whose events their group has not consumed yet. A points
/// award is downstream of the settlement group (the settlement handler records its intent).
async fn unconsumed(
    brokers: &str,
    topic: &str,
    records: &[idem_kafka::inspect::Record],
    dbs: &Databases,
) -> anyhow::Result<BTreeMap<String, u64>> {
    let not_settled = unconsumed_missing(
        brokers,
        topic,
        "settlement",
        records,
        &dbs.settlement,
        "settlements",
    )
    .await
    .context("counting what group settlement has not consumed")?;
    let not_awarded = missing_in(&dbs.points, "points_awards", not_settled.clone()).await?;
    let not_audited = unconsumed_missing(
        brokers,
        topic,
        "audit",
        records,
        &dbs.settlement,
        "audit_log",
    )
    .await
    .context("counting what group audit has not consumed")?;
    let mut counts = BTreeMap::new();
    for (check, list) in [
        ("settlements", not_settled),
        ("points", not_awarded),
        ("audit", not_audited),
    ] {
        if !list.is_empty() {
            counts.insert(check.to_owned(), list.len() as u64);
        }
    }
    Ok(counts)
}

/// The payment ids of the events of `records` that sit at or beyond `group`'s committed offset
/// in their partition (or in a partition where the group committed nothing) and have no row in
/// `table`: events the group has not consumed yet, as opposed to events it read past.
async fn unconsumed_missing(
    brokers: &str,
    topic: &str,
    group: &str,
    records: &[idem_kafka::inspect::Record],
    db: &crate::demo::world::Pool,
    table: &str,
) -> anyhow::Result<Vec<String>> {
    let committed: std::collections::HashMap<i32, i64> = {
        let (brokers, topic, group) = (brokers.to_owned(), topic.to_owned(), group.to_owned());
        tokio::task::spawn_blocking(move || {
            idem_kafka::inspect::committed_offsets(
                &brokers,
                &group,
                &topic,
                Duration::from_secs(30),
            )
        })
        .await??
        .into_iter()
        .collect()
    };
    missing_in(db, table, not_read_past(records, &committed)).await
}

/// The payment ids of the records a group has not read past: at or beyond its committed offset
/// (the next offset it will read) in their partition, or anywhere in a partition where it
/// committed nothing.
fn not_read_past(
    records: &[idem_kafka::inspect::Record],
    committed: &std::collections::HashMap<i32, i64>,
) -> Vec<String> {
    records
        .iter()
        .filter(|r| r.offset >= committed.get(&r.partition).copied().unwrap_or(0))
        .filter_map(|r| r.payload.as_deref())
        .filter_map(|p| serde_json::from_str::<serde_json::Value>(p).ok())
        .filter_map(|v| v.get("payment_id")?.as_str().map(str::to_owned))
        .collect()
}

/// The payment ids of `payments` without a row in `table` (one of the reference pipeline's
/// tables, never input), sorted and without repeats.
async fn missing_in(
    db: &crate::demo::world::Pool,
    table: &str,
    mut payments: Vec<String>,
) -> anyhow::Result<Vec<String>> {
    payments.sort();
    payments.dedup();
    if payments.is_empty() {
        return Ok(payments);
    }
    let crate::demo::world::Pool::Pg(pool) = db else {
        bail!("chaos runs on PostgreSQL only");
    };
    let sql = format!(
        "SELECT k.payment_id FROM unnest($1::text[]) AS k(payment_id) \
         WHERE NOT EXISTS (SELECT 1 FROM {table} t WHERE t.payment_id = k.payment_id) \
         ORDER BY 1"
    );
    Ok(sqlx::query_scalar(&sql)
        .bind(payments)
        .fetch_all(pool)
        .await?)
}

/// Resumes paused processes and restarts dead ones when their time comes. A process that
/// died by itself (an armed crash point) is restarted shortly, without the crash point.
fn supervise(procs: &mut [Proc], rng: &mut Rng) {
    let now = Instant::now();
    for p in procs.iter_mut() {
        if let Some(t) = p.paused_until
            && now >= t
        {
            p.signal(18);
            p.paused_until = None;
        }
        if !p.running() {
            match p.restart_at {
                Some(t) if now >= t => {
                    if let Err(e) = p.start(&[]) {
                        tracing::error!(error = %e, process = %p.name, "restart failed");
                    }
                }
                Some(_) => {}
                None => {
                    p.restart_at = Some(
                        now + rng.between(Duration::from_millis(200), Duration::from_millis(800)),
                    );
                }
            }
        }
    }
}

fn print_report(r: &ChaosReport) {
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

#[cfg(test)]
mod tests {
    use super::procs::Role;
    use super::{not_read_past, role_of_point};
    use idem_kafka::inspect::Record;

    fn record(partition: i32, offset: i64, payment: &str) -> Record {
        Record {
            partition,
            offset,
            key: None,
            payload: Some(format!(r#"{{"payment_id":"{payment}","amount":"1.00"}}"#)),
            headers: vec![],
        }
    }

    #[test]
    fn only_records_the_group_has_not_read_past_count_as_unconsumed() {
        let records = [
            record(0, 0, "p0"),
            record(0, 1, "p1"),
            record(0, 2, "p2"),
            record(1, 0, "q0"),
            record(1, 1, "q1"),
            record(2, 0, "r0"),
        ];
        // Partition 0: offset 2 is the next to read; partition 1: everything read;
        // partition 2: nothing committed.
        let committed = [(0, 2), (1, 2)].into_iter().collect();
        assert_eq!(not_read_past(&records, &committed), vec!["p2", "r0"]);
        // A group that committed nothing has read past nothing.
        let none = Default::default();
        assert_eq!(not_read_past(&records, &none).len(), records.len());
    }

    #[test]
    fn every_crash_point_has_a_process_that_reaches_it() {
        for p in idem_core::crash::CRASH_POINTS {
            let role = role_of_point(p);
            assert!(matches!(
                role,
                Role::Relay | Role::Settlement | Role::Dispatcher
            ));
        }
    }
}
