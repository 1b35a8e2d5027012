//! `idem outbox status | parked | retry | enqueue`.

use anyhow::bail;
use clap::Subcommand;
use idem_core::store::OutboxStore;
use idem_core::{Event, EventId};

use crate::DbArgs;
use crate::audit::Audited;
use crate::db;

#[derive(Subcommand, Debug)]
pub enum OutboxCommand {
    /// Pending, parked and published counts, and the age of the oldest pending row.
    Status {
        #[command(flatten)]
        db: DbArgs,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List parked rows with the reason they were parked.
    Parked {
        #[command(flatten)]
        db: DbArgs,
        /// At most this many rows.
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Return parked rows to pending so the relay tries them again.
    Retry {
        #[command(flatten)]
        db: DbArgs,
        /// Only these event ids (repeatable).
        #[arg(long = "event-id", required_unless_present = "all")]
        event_ids: Vec<EventId>,
        /// Every parked row.
        #[arg(long, conflicts_with = "event_ids")]
        all: bool,
        /// Why (kept in the audit table with who ran it).
        #[arg(long, default_value = "returned to pending with idem outbox retry")]
        reason: String,
    },
    /// Enqueue one event in its own transaction (for scripts and tests).
    Enqueue {
        #[command(flatten)]
        db: DbArgs,
        /// Aggregate type (names the topic).
        #[arg(long)]
        aggregate_type: String,
        /// Aggregate id (the Kafka key).
        #[arg(long)]
        aggregate_id: String,
        /// Event type.
        #[arg(long)]
        event_type: String,
        /// JSON payload.
        #[arg(long)]
        payload: String,
        /// Event id (default: a new UUIDv7).
        #[arg(long)]
        event_id: Option<EventId>,
        /// Header NAME=VALUE (repeatable).
        #[arg(long = "header", value_parser = idem_kafka::parse_setting)]
        headers: Vec<(String, String)>,
        /// Enqueue this many copies with fresh ids (payload unchanged), in one transaction.
        #[arg(long, default_value_t = 1)]
        count: u32,
    },
}

pub(crate) async fn run(cmd: OutboxCommand) -> anyhow::Result<()> {
    match cmd {
        OutboxCommand::Status { db, json } => {
            let store = db::open(&db, 1).await?;
            let s = idem_sql::with_store!(&store, s => s.relay().status().await)?;
            let slots = match store.pool() {
                idem_sql::AnyPool::Postgres(pool) => idem_cdc::slots_here(&pool).await?,
                _ => Vec::new(),
            };
            if json {
                let mut v = serde_json::to_value(&s)?;
                if let Some(o) = v.as_object_mut() {
                    o.insert("cdc_slots".to_owned(), serde_json::to_value(&slots)?);
                }
                println!("{v}");
            } else {
                println!("pending    {}", s.pending);
                println!("parked     {}", s.parked);
                println!("published  {}", s.published);
                match s.oldest_pending_age_seconds {
                    Some(a) => println!("oldest pending age  {a:.3}s"),
                    None => println!("oldest pending age  -"),
                }
                for slot in &slots {
                    crate::cdc_cmd::print_slot(slot);
                }
            }
        }
        OutboxCommand::Parked { db, limit, json } => {
            let store = db::open(&db, 1).await?;
            let rows = idem_sql::with_store!(&store, s => s.relay().parked(limit).await)?;
            if json {
                println!("{}", serde_json::to_string(&rows)?);
            } else if rows.is_empty() {
                println!("no parked rows");
            } else {
                for r in rows {
                    println!(
                        "{}  {}/{}  {}  attempts={}  reason: {}",
                        r.event_id,
                        r.aggregate_type,
                        r.aggregate_id,
                        r.event_type,
                        r.attempts,
                        r.last_error.unwrap_or_default()
                    );
                }
            }
        }
        OutboxCommand::Retry {
            db,
            event_ids,
            all,
            reason,
        } => retry(&db, &event_ids, all, reason).await?,
        OutboxCommand::Enqueue {
            db,
            aggregate_type,
            aggregate_id,
            event_type,
            payload,
            event_id,
            headers,
            count,
        } => {
            if count > 1 && event_id.is_some() {
                bail!("--event-id and --count > 1 cannot be combined: event ids are unique");
            }
            let mut events = Vec::with_capacity(usize::try_from(count).unwrap_or(0));
            for _ in 0..count.max(1) {
                let mut b = Event::builder(&aggregate_type, &aggregate_id, &event_type)
                    .payload_json(payload.clone());
                if let Some(id) = event_id {
                    b = b.id(id);
                }
                for (k, v) in &headers {
                    b = b.header(k, v);
                }
                events.push(b.build()?);
            }
            let store = db::open(&db, 1).await?;
            idem_sql::with_store!(store, s => {
                let mut tx = s.pool().begin().await?;
                s.outbox().enqueue_all(&mut tx, &events).await?;
                tx.commit().await?;
            });
            for e in &events {
                println!("{}", e.id());
            }
        }
    }
    Ok(())
}

/// `idem outbox retry`, audited.
async fn retry(
    db: &DbArgs,
    event_ids: &[EventId],
    all: bool,
    reason: String,
) -> anyhow::Result<()> {
    let store = db::open(db, 1).await?;
    let ids = (!all).then_some(event_ids);
    let n = idem_sql::with_store!(&store, s => s.relay().retry_parked(ids).await)?;
    println!("returned {n} parked row(s) to pending");
    let target = if all {
        "every parked outbox row".to_owned()
    } else {
        let ids: Vec<String> = event_ids.iter().map(ToString::to_string).collect();
        format!("outbox events {}", ids.join(", "))
    };
    let done = Audited {
        action: "outbox.retry",
        target,
        reason,
        affected: n,
        outcome: "done".to_owned(),
    };
    crate::audit::record(&store, None, done).await;
    Ok(())
}
