//! `idem effects dispatch | stuck | retry`: the effect dispatcher as its own process.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Subcommand;
use idem_core::idempotency::IntentStore;
use idem_effects::{Dispatcher, DispatcherConfig, EffectMetrics};

use crate::DbArgs;
use crate::db::{self, Store};

#[derive(Subcommand, Debug)]
pub enum EffectsCommand {
    /// Deliver effect intents until SIGTERM, the same Idempotency-Key on every attempt.
    Dispatch {
        #[command(flatten)]
        db: DbArgs,
        /// `Authorization` header sent to the remote (it scopes keys per client).
        #[arg(long, env = "IDEM_EFFECT_AUTHORIZATION")]
        authorization: Option<String>,
        /// Per-request timeout.
        #[arg(long, default_value = "10s", value_parser = crate::relay_cmd::parse_duration)]
        timeout: Duration,
        /// Serve Prometheus metrics on this address.
        #[arg(long)]
        metrics_addr: Option<SocketAddr>,
    },
    /// List parked and unknown intents with their reasons.
    Stuck {
        #[command(flatten)]
        db: DbArgs,
    },
    /// Return parked and unknown intents to pending (same key).
    Retry {
        #[command(flatten)]
        db: DbArgs,
        /// Only these intent ids (repeatable); default all.
        #[arg(long = "id")]
        ids: Vec<i64>,
    },
}

async fn dispatch<S: IntentStore>(
    store: S,
    config: DispatcherConfig,
    metrics: EffectMetrics,
) -> anyhow::Result<()> {
    let shutdown = crate::relay_cmd::shutdown_signal()?;
    tokio::pin!(shutdown);
    let d = Dispatcher::new(store, config, metrics)?;
    let mut idle = Duration::from_millis(5);
    loop {
        let sent = d.run_once().await?;
        let wait = if sent > 0 {
            idle = Duration::from_millis(5);
            Duration::ZERO
        } else {
            idle = (idle * 2).min(Duration::from_millis(200));
            idle
        };
        tokio::select! {
            biased;
            () = &mut shutdown => return Ok(()),
            () = tokio::time::sleep(wait) => {}
        }
    }
}

pub async fn run(cmd: EffectsCommand) -> anyhow::Result<()> {
    match cmd {
        EffectsCommand::Dispatch {
            db,
            authorization,
            timeout,
            metrics_addr,
        } => {
            let store = db::open(&db, 2).await?;
            let tables = db::tables(&db)?;
            let registry = prometheus::Registry::new();
            let metrics = EffectMetrics::new(&registry)?;
            if let Some(addr) = metrics_addr {
                let bound = crate::metrics_server::serve(addr, registry.clone()).await?;
                eprintln!("idem effects: metrics on http://{bound}/metrics");
            }
            let config = DispatcherConfig {
                timeout,
                lease: timeout.saturating_mul(3),
                authorization,
                ..DispatcherConfig::default()
            };
            eprintln!("idem effects: dispatching");
            match store {
                Store::Postgres(s) => {
                    dispatch(
                        idem_postgres::PgIntents::new(s.pool().clone(), tables),
                        config,
                        metrics,
                    )
                    .await?
                }
                Store::Sqlite(s) => {
                    dispatch(
                        idem_sqlite::SqliteIntents::new(s.pool().clone(), tables),
                        config,
                        metrics,
                    )
                    .await?
                }
            }
            eprintln!("idem effects: stopped cleanly");
        }
        EffectsCommand::Stuck { db } => {
            let store = db::open(&db, 1).await?;
            let tables = db::tables(&db)?;
            let rows = match store {
                Store::Postgres(s) => {
                    idem_postgres::PgIntents::new(s.pool().clone(), tables)
                        .stuck(1000)
                        .await?
                }
                Store::Sqlite(s) => {
                    idem_sqlite::SqliteIntents::new(s.pool().clone(), tables)
                        .stuck(1000)
                        .await?
                }
            };
            if rows.is_empty() {
                println!("no parked or unknown intents");
            }
            for r in rows {
                println!(
                    "{}  {}  {}  {}  attempts={}  reason: {}",
                    r.id,
                    r.status,
                    r.effect,
                    r.key,
                    r.attempts,
                    r.reason.unwrap_or_default()
                );
            }
        }
        EffectsCommand::Retry { db, ids } => {
            let store = db::open(&db, 1).await?;
            let tables = db::tables(&db)?;
            let ids = (!ids.is_empty()).then_some(ids.as_slice());
            let n = match store {
                Store::Postgres(s) => {
                    idem_postgres::PgIntents::new(s.pool().clone(), tables)
                        .retry_stuck(ids)
                        .await?
                }
                Store::Sqlite(s) => {
                    idem_sqlite::SqliteIntents::new(s.pool().clone(), tables)
                        .retry_stuck(ids)
                        .await?
                }
            };
            println!("returned {n} intent(s) to pending");
        }
    }
    Ok(())
}
