//! `idem cdc`: the change-data-capture relay for PostgreSQL (logical replication, pgoutput),
//! and its slot.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Subcommand};
use idem_cdc::{CdcConfig, CdcError, CdcRelay, Mode, Name};

use crate::db::{self, DbArgs};
use crate::util::{duration_text, parse_duration, shutdown_signal};

/// What to do with the CDC relay.
#[derive(Debug, Subcommand)]
pub enum CdcCommand {
    /// Publish the outbox from PostgreSQL's logical replication: inserts into the outbox table
    /// (default) or `pg_logical_emit_message` messages (`--messages`), in commit order, at
    /// least once; the slot confirms a transaction only once Kafka acknowledged it and every
    /// earlier one. Needs wal_level = logical and a role with REPLICATION.
    Relay(Box<CdcRelayArgs>),
    /// Show the slot: whether a relay reads it, its confirmed position, the WAL it holds.
    Status {
        #[command(flatten)]
        db: DbArgs,
        /// The replication slot.
        #[arg(long, default_value = idem_cdc::DEFAULT_SLOT)]
        slot: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Drop the slot (no relay may be reading it): the WAL it holds is released, and what was
    /// committed after its confirmed position will never be streamed. Its publication forgets
    /// it too, so a relay started later under that name makes it as on a first start.
    DropSlot {
        #[command(flatten)]
        db: DbArgs,
        /// The replication slot.
        #[arg(long)]
        slot: String,
    },
    /// Publish again the records message mode dead-lettered whole because their topic was
    /// missing or not writable, once it takes records: each to the topic it was meant for, as
    /// it was (key, value, headers). At least once: the consumers' inboxes absorb a record
    /// replayed twice. Letters that are excerpts (a record refused for itself) are counted,
    /// never published.
    ReplayDeadLetters(Box<ReplayArgs>),
}

/// `idem cdc replay-dead-letters`.
#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// Kafka bootstrap servers (host:port,...).
    #[arg(long, env = "IDEM_BROKERS")]
    brokers: String,
    /// The relay's dead-letter topic.
    #[arg(long, default_value = idem_cdc::DEFAULT_DEAD_LETTER_TOPIC)]
    dead_letter_topic: String,
    /// Replay only the records meant for this topic (repeatable; default: every topic).
    #[arg(long = "topic")]
    topics: Vec<String>,
    /// Give up reading the dead-letter topic after this long.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    timeout: Duration,
    #[command(flatten)]
    producer: crate::relay_cmd::ProducerArgs,
}

/// `idem cdc relay`.
#[derive(Debug, Args)]
pub struct CdcRelayArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Kafka bootstrap servers (host:port,...), or `embedded` for librdkafka's mock cluster.
    #[arg(long, env = "IDEM_BROKERS")]
    brokers: String,
    /// The logical replication slot (made on a first start; one relay reads it at a time, the
    /// others wait and take over). A slot its publication records but the server lacks (a
    /// failover, a drop) stops the relay: see --create-slot.
    #[arg(long, default_value = idem_cdc::DEFAULT_SLOT)]
    slot: String,
    /// Make the slot even though its publication records that it existed (after a failover to a
    /// server without it, or a drop), once. Table mode then publishes every pending row; message
    /// mode goes on without the events committed since the old slot's confirmed position.
    #[arg(long)]
    create_slot: bool,
    /// The publication the slot reads (created when missing: the outbox table's inserts, or no
    /// table in message mode).
    #[arg(long)]
    publication: Option<String>,
    /// Message mode: relay `pg_logical_emit_message(true, PREFIX, …)` messages (written with
    /// `MessageOutbox`) instead of the outbox table's rows; PREFIX defaults to `idem.outbox`.
    #[arg(long, value_name = "PREFIX", num_args = 0..=1, default_missing_value = idem_core::envelope::DEFAULT_PREFIX)]
    messages: Option<String>,
    /// Serve Prometheus metrics on this address (e.g. 127.0.0.1:9464; port 0 picks one).
    #[arg(long, env = "IDEM_METRICS_ADDR")]
    metrics_addr: Option<SocketAddr>,
    /// Messages per publish call (a batch holds whole transactions).
    #[arg(long, default_value_t = CdcConfig::default().batch_size)]
    batch_size: usize,
    /// The longest a committed transaction waits for others before its batch is published.
    #[arg(long, default_value = duration_text(CdcConfig::default().linger), value_parser = parse_duration)]
    linger: Duration,
    /// Topic prefix before the aggregate type.
    #[arg(long, default_value = idem_core::wire::DEFAULT_TOPIC_PREFIX)]
    topic_prefix: String,
    /// Topic for an aggregate type: AGGREGATE_TYPE=TOPIC (repeatable).
    #[arg(long = "topic", value_parser = idem_kafka::parse_setting)]
    topics: Vec<(String, String)>,
    /// CloudEvents `ce_source` (default /idem/AGGREGATE_TYPE).
    #[arg(long)]
    source: Option<String>,
    /// Where events that cannot be published are dead-lettered, with the reason in a header.
    #[arg(long, default_value = idem_cdc::DEFAULT_DEAD_LETTER_TOPIC)]
    dead_letter_topic: String,
    /// Table mode: delete the rows it published instead of marking them `published` (the table
    /// keeps only pending and parked rows; `idem outbox status` and `idem verify`'s locate no
    /// longer see published ones).
    #[arg(long, conflicts_with = "messages")]
    delete_published: bool,
    /// How long messages to one topic may fail without a success before the relay asks the
    /// cluster about it; a topic it says does not exist or may not be written has its rows
    /// parked (table mode) or its records dead-lettered whole (message mode: `idem cdc
    /// replay-dead-letters` once the topic takes records), so that the others flow.
    #[arg(long, default_value = duration_text(CdcConfig::default().unwritable_topic_grace), value_parser = parse_duration)]
    unwritable_topic_grace: Duration,
    #[command(flatten)]
    producer: crate::relay_cmd::ProducerArgs,
}

/// Runs `idem cdc …`.
pub(crate) async fn run(cmd: CdcCommand) -> anyhow::Result<()> {
    match cmd {
        CdcCommand::Relay(args) => relay(*args).await,
        CdcCommand::ReplayDeadLetters(args) => replay_dead_letters(*args).await,
        CdcCommand::Status { db, slot, json } => {
            let pool = pool(&db).await?;
            let state = idem_cdc::slot_state(&pool, &Name::new("slot", &slot)?).await?;
            print_status(&slot, state.as_ref(), json)
        }
        CdcCommand::DropSlot { db, slot } => {
            let pool = pool(&db).await?;
            let name = Name::new("slot", &slot)?;
            let present = idem_cdc::slot_state(&pool, &name).await?.is_some();
            if present {
                idem_cdc::drop_slot(&pool, &name).await?;
            }
            // After a failover the slot is gone already; its record still stops the relay.
            idem_cdc::forget_slot(&pool, &name)
                .await
                .context("the slot's record on its publication (make the role its owner)")?;
            if present {
                println!("dropped replication slot {slot}");
            } else {
                println!("replication slot {slot}: none to drop; its publication forgets it");
            }
            Ok(())
        }
    }
}

/// `idem cdc replay-dead-letters`: reads the dead-letter topic whole and republishes.
async fn replay_dead_letters(args: ReplayArgs) -> anyhow::Result<()> {
    const BIN: &str = "idem cdc replay-dead-letters";
    let kafka = crate::relay_cmd::Kafka::connect(&args.brokers, &args.producer, BIN).await?;
    let conn = args
        .producer
        .kafka
        .connection(&args.brokers)?
        .client_config();
    let (topic, timeout) = (args.dead_letter_topic.clone(), args.timeout);
    let records = tokio::task::spawn_blocking(move || {
        idem_kafka::inspect::read_all_with(&conn, &topic, timeout)
    })
    .await??;
    let letters: Vec<idem_core::publish::Message> = records
        .into_iter()
        .map(|r| idem_core::publish::Message {
            topic: args.dead_letter_topic.clone(),
            key: r.key.unwrap_or_default(),
            payload: r.payload.unwrap_or_default(),
            headers: r.headers,
        })
        .collect();
    let done = idem_cdc::replay::replay(&kafka.publisher, &letters, &args.topics).await;
    println!(
        "{BIN}: {} of {} letters published again ({} excerpts, {} for other topics)",
        done.published,
        letters.len(),
        done.excerpts,
        done.other_topics
    );
    for (topic, why) in &done.failed {
        eprintln!("{BIN}: a record for {topic} was not published: {why}");
    }
    if !done.failed.is_empty() {
        anyhow::bail!(
            "{} records were not published; their letters stay: fix the cause and run it again",
            done.failed.len()
        );
    }
    Ok(())
}

fn print_status(slot: &str, state: Option<&idem_cdc::SlotState>, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(&state)?);
        return Ok(());
    }
    match state {
        Some(s) => print_slot(s),
        None => println!("replication slot {slot}: none"),
    }
    Ok(())
}

/// One line per slot: who reads it, where it confirmed, the WAL it holds, and a loud mark
/// when it is lost.
pub(crate) fn print_slot(s: &idem_cdc::SlotState) {
    println!(
        "replication slot {}: {}, confirmed {}, holds {} bytes of WAL, wal_status {}{}",
        s.slot,
        if s.active {
            "read by a relay"
        } else {
            "not read"
        },
        s.confirmed_flush_lsn.as_deref().unwrap_or("-"),
        s.lag_bytes.unwrap_or(0),
        s.wal_status.as_deref().unwrap_or("-"),
        if s.is_lost() {
            " — LOST: events committed after the confirmed position will never be streamed"
        } else {
            ""
        }
    );
}

async fn pool(db: &DbArgs) -> anyhow::Result<sqlx::PgPool> {
    if !db.db.starts_with("postgres") {
        anyhow::bail!("the CDC relay reads PostgreSQL only: --db must be a postgres:// URL");
    }
    Ok(idem_sql::postgres::connect(&db.db, 2).await?)
}

/// Message mode with a valid prefix (`--messages [PREFIX]`), else table mode in `tables`.
fn mode(messages: Option<&str>, tables: idem_core::TableNames) -> anyhow::Result<Mode> {
    Ok(match messages {
        Some(prefix) => Mode::Messages {
            prefix: idem_core::envelope::Prefix::new(prefix)?.to_string(),
        },
        None => Mode::Table(tables),
    })
}

/// The CDC relay's settings from its flags, whose defaults are [`CdcConfig::default`]'s.
fn cdc_config(
    args: &CdcRelayArgs,
    mode: Mode,
    topics: idem_core::wire::TopicNaming,
) -> anyhow::Result<CdcConfig> {
    let default_publication = match mode {
        Mode::Table(_) => idem_cdc::DEFAULT_TABLE_PUBLICATION,
        Mode::Messages { .. } => idem_cdc::DEFAULT_MESSAGES_PUBLICATION,
    };
    let mut config = CdcConfig::new(
        Name::new("slot", &args.slot)?,
        Name::new(
            "publication",
            args.publication.as_deref().unwrap_or(default_publication),
        )?,
        mode,
    );
    config.topics = topics;
    config.source = args.source.clone();
    config.batch_size = args.batch_size.max(1);
    config.linger = args.linger;
    config.dead_letter_topic = args.dead_letter_topic.clone();
    config.delete_published = args.delete_published;
    config.create_slot = args.create_slot;
    config.unwritable_topic_grace = args.unwritable_topic_grace;
    Ok(config)
}

async fn relay(args: CdcRelayArgs) -> anyhow::Result<()> {
    let shutdown = shutdown_signal()?;
    let naming = crate::kafka_args::topic_naming(&args.topic_prefix, &args.topics)?;
    let mode = mode(args.messages.as_deref(), db::tables(&args.db)?)?;
    let pool = pool(&args.db).await?;
    let config = cdc_config(&args, mode, naming)?;

    let kafka =
        crate::relay_cmd::Kafka::connect(&args.brokers, &args.producer, "idem cdc relay").await?;
    let (_embedded, brokers, publisher) = (kafka.embedded, kafka.brokers, kafka.publisher);
    let publisher = std::sync::Arc::new(publisher);
    let registry = prometheus::Registry::new();
    let health = idem_core::health::Health::new();
    crate::readiness::watch_broker(publisher.config(), &health);
    if let Some(addr) = args.metrics_addr {
        let bound =
            crate::metrics_server::serve_with(addr, registry.clone(), health.clone()).await?;
        eprintln!("idem cdc relay: metrics on http://{bound}/metrics (probes /healthz, /readyz)");
    }
    let relay = CdcRelay::builder(&args.db.db, pool, publisher.clone())
        .config(config)
        .registry(&registry)
        .health(health.clone())
        .build()?;
    let (ran, stage) = match relay.prepare().await {
        Ok(state) => {
            eprintln!(
                "idem cdc relay: slot {} (confirmed {}) → {brokers}",
                state.slot,
                state.confirmed_flush_lsn.as_deref().unwrap_or("-")
            );
            (relay.run(shutdown).await, "streaming from the slot")
        }
        Err(e) => (Err(e), "preparing the publication and the slot"),
    };
    match ran {
        Err(e @ (CdcError::SlotMissing { .. } | CdcError::SlotLost { .. }))
            if args.metrics_addr.is_some() =>
        {
            return Err(hold_for_operator(e, &health).await);
        }
        ran => ran.context(stage)?,
    }
    if let Err(e) = publisher.flush(Duration::from_secs(5)) {
        tracing::warn!(error = %e, "producer flush at shutdown");
    }
    eprintln!("idem cdc relay: stopped cleanly");
    Ok(())
}

/// A slot that is gone needs an operator (`--create-slot`, or `idem cdc drop-slot`): the relay
/// stops streaming but keeps serving `/metrics` (`idem_cdc_slot_lost` 1) and `/readyz` (not
/// ready, saying why) until it is told to stop, so that the alert on the gauge fires; a process
/// that exited at once would take the gauge with it.
async fn hold_for_operator(e: CdcError, health: &idem_core::health::Health) -> anyhow::Error {
    let shown = with_flag_names(&e.to_string());
    health.failed(idem_cdc::relay::SLOT, &shown);
    eprintln!(
        "idem cdc relay: {shown}\nidem cdc relay: stopped streaming; serving /metrics \
         (idem_cdc_slot_lost 1) and /readyz until told to stop"
    );
    match shutdown_signal() {
        Ok(stop) => stop.await,
        Err(err) => return anyhow::Error::new(e).context(format!("waiting for a signal: {err}")),
    }
    anyhow::Error::new(e)
}

/// The CDC relay's settings its messages name, and the flags that set them here.
const FLAG_OF_SETTING: &[(&str, &str)] = &[
    ("`CdcConfig::create_slot`", "--create-slot"),
    ("`CdcConfig::publication`", "--publication"),
    ("`CdcConfig::slot`", "--slot"),
];

/// `message` with each CDC relay setting it names replaced by the flag that sets it on this
/// command line.
pub(crate) fn with_flag_names(message: &str) -> String {
    FLAG_OF_SETTING
        .iter()
        .fold(message.to_owned(), |m, (setting, flag)| {
            m.replace(setting, flag)
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        command: CdcCommand,
    }

    fn messages(args: &[&str]) -> Option<String> {
        let base = ["idem", "relay", "--db", "postgres://h/db", "--brokers", "b"];
        let cli = Cli::try_parse_from(base.iter().chain(args)).unwrap();
        match cli.command {
            CdcCommand::Relay(a) => a.messages,
            _ => panic!("not relay"),
        }
    }

    #[test]
    fn the_flags_default_to_the_library_defaults() {
        let base = ["idem", "relay", "--db", "postgres://h/db", "--brokers", "b"];
        let cli = Cli::try_parse_from(base).unwrap();
        let CdcCommand::Relay(args) = cli.command else {
            panic!("not relay");
        };
        let topics = idem_core::wire::TopicNaming::default();
        let tables = idem_core::TableNames::default();
        let from_flags = cdc_config(&args, Mode::Table(tables), topics).unwrap();
        assert_eq!(
            format!("{from_flags:?}"),
            format!("{:?}", CdcConfig::default())
        );
    }

    #[test]
    fn the_cdc_settings_a_message_names_become_the_flags_that_set_them() {
        let library = [
            include_str!("../../../engines/idem-cdc/src/error.rs"),
            include_str!("../../../engines/idem-cdc/src/slot.rs"),
        ]
        .concat();
        let named: Vec<&str> = library
            .split("`CdcConfig::")
            .skip(1)
            .filter_map(|rest| rest.split_once('`').map(|(field, _)| field))
            .collect();
        assert!(named.contains(&"create_slot"), "{named:?}");
        let cmd = <CdcRelayArgs as clap::Args>::augment_args(clap::Command::new("relay"));
        for field in named {
            let shown = with_flag_names(&format!("`CdcConfig::{field}`"));
            let flag = shown.trim_start_matches("--");
            assert!(
                shown.starts_with("--") && cmd.get_arguments().any(|a| a.get_long() == Some(flag)),
                "`CdcConfig::{field}` has no flag of `idem cdc relay`: {shown}"
            );
        }
    }

    #[test]
    fn messages_defaults_to_the_writer_s_prefix_and_a_bad_prefix_is_refused() {
        assert_eq!(messages(&[]), None);
        assert_eq!(messages(&["--messages"]).as_deref(), Some("idem.outbox"));
        assert_eq!(
            messages(&["--messages", "--slot", "s"]).as_deref(),
            Some("idem.outbox")
        );
        assert_eq!(
            messages(&["--messages", "billing.v1"]).as_deref(),
            Some("billing.v1")
        );
        let tables = idem_core::TableNames::default();
        assert!(matches!(
            mode(Some("billing.v1"), tables.clone()).unwrap(),
            Mode::Messages { prefix } if prefix == "billing.v1"
        ));
        assert!(matches!(
            mode(None, tables.clone()).unwrap(),
            Mode::Table(_)
        ));
        let refused = mode(Some("a b"), tables).unwrap_err().to_string();
        assert!(refused.contains("message prefix"), "{refused}");
    }
}
