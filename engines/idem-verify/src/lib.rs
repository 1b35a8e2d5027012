#![doc = include_str!("../../../docs/operating/verify.md")]

pub mod config;
mod db;
mod merge;
mod metrics;
pub mod report;

use idem_core::TableNames;
use idem_core::idempotency::IdempotencyKey;
use tokio::sync::oneshot;

pub use config::{
    Check, CurrencyColumns, EmptyCheck, Locate, Side, Tables, UniqueCheck, VerifyConfig,
};
pub use metrics::{GapGauge, WatchMetrics, gap_values};
pub use report::{Loss, Report, Stage};

use crate::db::{Db, Pools, SideQuery, counts, lookup_text, redact, stream_side};
use crate::merge::{Cursor, Tally, merge, repeats};
use crate::report::{EffectAttempts, EmptyReport, InboxAttempts, OutboxAttempts, UniqueReport};

/// Why verification could not run (a finding is never an error: it is in the [`Report`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VerifyError {
    /// The configuration is unusable.
    #[error("verify config: {0}")]
    Config(String),
    /// The gauge's metrics could not be registered (a registry that already holds them).
    #[error("registering {what}: {source}")]
    Metrics {
        /// The metric.
        what: &'static str,
        /// The registry's error.
        #[source]
        source: prometheus::Error,
    },
    /// A database refused a query or a connection.
    #[error("{context} on {db}: {source}")]
    Database {
        /// The database (password hidden).
        db: String,
        /// What was being done.
        context: String,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// A database could not be reached (an unreadable URL, a TLS or authentication refusal).
    #[error("{0}")]
    Connect(#[source] idem_core::Error),
    /// A key column held NULL.
    #[error("a row read from {db} has a NULL key; filter NULL keys out in the query")]
    NullKey {
        /// The database (password hidden).
        db: String,
    },
    /// A side's rows did not arrive in key order (the comparison would be wrong).
    #[error(
        "the {side} rows are not in key order at {key:?}: the ordering query must sort keys as bytes"
    )]
    Unordered {
        /// `source`, `target` or `unique`.
        side: &'static str,
        /// Where it was noticed.
        key: String,
    },
}

/// Settings of one run.
#[derive(Clone, Debug)]
pub struct Options {
    /// Missing keys to locate per check (each costs a few point queries).
    pub locate_limit: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options { locate_limit: 1000 }
    }
}

/// Runs every check of `config` once.
pub async fn verify(config: &VerifyConfig, options: &Options) -> Result<Report, VerifyError> {
    config.validate()?;
    let tables = TableNames::new(
        config.tables.schema.as_deref(),
        config.tables.prefix.as_deref().unwrap_or("idem_"),
    )
    .map_err(|e| VerifyError::Config(e.to_string()))?;
    let mut pools = Pools::default();
    let mut report = Report::default();
    for check in &config.checks {
        let currency = config.currency_of(&check.name);
        let mut checked = run_check(&mut pools, check, currency, options).await?;
        if let Some(l) = &check.locate {
            locate(&mut pools, &tables, check, l, &mut checked).await?;
        }
        report.checks.push(checked.report);
    }
    for u in &config.unique {
        report.unique.push(run_unique(&mut pools, u).await?);
    }
    for e in &config.empty {
        report.empty.push(run_empty(&mut pools, e).await?);
    }
    report.attempts = attempts(&mut pools, &tables, config).await?;
    report.settle();
    Ok(report)
}

struct Checked {
    report: report::CheckReport,
    losses: Vec<Loss>,
}

async fn run_check(
    pools: &mut Pools,
    check: &Check,
    currency: Option<&CurrencyColumns>,
    options: &Options,
) -> Result<Checked, VerifyError> {
    let (sdb, tdb) = (
        pools.get(&check.source.db).await?,
        pools.get(&check.target.db).await?,
    );
    // The target's snapshot first: a fact committed in between is seen at the source only,
    // and reads as in flight (missing), never as an effect without a cause (unexpected).
    let (t_ready, t_wait) = oneshot::channel();
    let t_query = side(&check.target, currency.map(|c| c.target.as_str()));
    let trx = stream_side(tdb, check.target.db.clone(), t_query, t_ready)?;
    let mut target = Cursor::new(trx, "target");
    // An error before the snapshot surfaces through the cursor.
    let _ = t_wait.await;
    let (s_ready, _s_wait) = oneshot::channel();
    let s_query = side(&check.source, currency.map(|c| c.source.as_str()));
    let srx = stream_side(sdb, check.source.db.clone(), s_query, s_ready)?;
    let mut source = Cursor::new(srx, "source");
    let default_type = check.event_type.as_deref().unwrap_or(&check.name);
    let mut tally = Tally::new(&check.name, default_type, options.locate_limit);
    tally.compare_currency = currency.is_some();
    merge(&mut source, &mut target, &mut tally).await?;
    let (mut report, losses) = tally.finish();
    let missing = report.total().missing;
    if check.locate.is_none() {
        report.losses = losses;
        return Ok(Checked {
            report,
            losses: Vec::new(),
        });
    }
    tracing::debug!(check = %check.name, missing, "locating missing effects");
    Ok(Checked { report, losses })
}

fn side<'a>(s: &'a Side, currency: Option<&'a str>) -> SideQuery<'a> {
    SideQuery {
        query: &s.query,
        key: &s.key,
        amount: s.amount.as_deref(),
        event_type: s.event_type_column.as_deref(),
        aggregate_id: s.aggregate_id.as_deref(),
        currency,
    }
}

async fn run_unique(pools: &mut Pools, u: &UniqueCheck) -> Result<UniqueReport, VerifyError> {
    let mut cursor = keys_of(pools, &u.db, &u.query, &u.key, "unique").await?;
    let mut report = UniqueReport {
        name: u.name.clone(),
        ..UniqueReport::default()
    };
    repeats(&mut cursor, &mut report).await?;
    Ok(report)
}

async fn run_empty(pools: &mut Pools, e: &EmptyCheck) -> Result<EmptyReport, VerifyError> {
    let mut cursor = keys_of(pools, &e.db, &e.query, &e.key, "empty").await?;
    let mut report = EmptyReport {
        name: e.name.clone(),
        ..EmptyReport::default()
    };
    merge::rows(&mut cursor, &mut report).await?;
    Ok(report)
}

/// The rows of `query` on database `db` by their `key` column, in key order.
async fn keys_of(
    pools: &mut Pools,
    db: &str,
    query: &str,
    key: &str,
    what: &'static str,
) -> Result<Cursor, VerifyError> {
    let pool = pools.get(db).await?;
    let (ready, _wait) = oneshot::channel();
    let query = SideQuery {
        query,
        key,
        amount: None,
        event_type: None,
        aggregate_id: None,
        currency: None,
    };
    let rx = stream_side(pool, db.to_owned(), query, ready)?;
    Ok(Cursor::new(rx, what))
}

/// Follows each missing key back: outbox → inbox / dead letters → effect intent.
async fn locate(
    pools: &mut Pools,
    tables: &TableNames,
    check: &Check,
    l: &Locate,
    checked: &mut Checked,
) -> Result<(), VerifyError> {
    let outbox_url = l.outbox_db.as_deref().unwrap_or(&check.source.db);
    let outbox = pools.get(outbox_url).await?;
    let inbox = pools.get(&l.inbox_db).await?;
    let intents = match &l.intents_db {
        Some(url) => Some((pools.get(url).await?, url.as_str())),
        None => None,
    };
    let (oq, iq) = (
        db::lookups_for(&outbox, tables),
        db::lookups_for(&inbox, tables),
    );
    for mut loss in std::mem::take(&mut checked.losses) {
        let Some(aggregate_id) = loss.aggregate_id.clone() else {
            checked.report.losses.push(loss);
            continue;
        };
        let args = [l.aggregate_type.as_str(), &aggregate_id, &l.event_type];
        let row = lookup_text(&outbox, outbox_url, &oq.outbox_row, &args, 3).await?;
        let (event_id, status, error) = match row {
            Some(r) => (r[0].clone(), r[1].clone(), r[2].clone()),
            None => {
                // Pruned in archive mode: published.
                let archived = lookup_text(&outbox, outbox_url, &oq.archive_row, &args, 1)
                    .await
                    .ok()
                    .flatten();
                match archived {
                    Some(r) => (r[0].clone(), Some("published".to_owned()), None),
                    None => (None, None, None),
                }
            }
        };
        loss.event_id = event_id.clone();
        (loss.stage, loss.detail) = match (status.as_deref(), event_id) {
            (None, _) | (_, None) => (Stage::NeverInOutbox, None),
            (Some("pending"), _) => (Stage::PendingInOutbox, error),
            (Some("parked"), _) => (Stage::ParkedInOutbox, error),
            (Some(_), Some(event_id)) => {
                after_publish(
                    &inbox,
                    &l.inbox_db,
                    &iq,
                    l,
                    &event_id,
                    intents.as_ref(),
                    tables,
                )
                .await?
            }
        };
        checked.report.losses.push(loss);
    }
    Ok(())
}

async fn after_publish(
    inbox: &Db,
    inbox_url: &str,
    q: &db::Lookups,
    l: &Locate,
    event_id: &str,
    intents: Option<&(Db, &str)>,
    tables: &TableNames,
) -> Result<(Stage, Option<String>), VerifyError> {
    let args = [l.consumer_group.as_str(), event_id];
    let status = lookup_text(inbox, inbox_url, &q.inbox_row, &args, 1).await?;
    let dead = || async {
        lookup_text(inbox, inbox_url, &q.dead_letter_row, &args, 1)
            .await
            .map(|r| r.and_then(|r| r[0].clone()))
    };
    match status.and_then(|r| r[0].clone()).as_deref() {
        None => match dead().await? {
            Some(reason) => Ok((Stage::DeadLettered, Some(reason))),
            None => Ok((Stage::PublishedButNotProcessed, None)),
        },
        Some("dead_lettered") => Ok((Stage::DeadLettered, dead().await?)),
        Some(_) => {
            let (Some((db, url)), Some(effect)) = (intents, l.effect.as_deref()) else {
                return Ok((Stage::ProcessedWithoutEffect, None));
            };
            let key = event_id
                .parse()
                .ok()
                .and_then(|id| IdempotencyKey::for_effect(id, effect).ok());
            let Some(key) = key else {
                return Ok((Stage::ProcessedWithoutEffect, None));
            };
            let q = db::lookups_for(db, tables);
            let row = lookup_text(db, url, &q.intent_row, &[key.as_str()], 2).await?;
            Ok(match row {
                None => (
                    Stage::ProcessedWithoutEffect,
                    Some(format!("no intent {}", key.as_str())),
                ),
                Some(r) => {
                    let stage = match r[0].as_deref() {
                        Some("pending") => Stage::EffectPending,
                        Some("parked") => Stage::EffectParked,
                        Some("unknown") => Stage::EffectUnknown,
                        _ => Stage::EffectDoneButMissing,
                    };
                    (stage, r[1].clone())
                }
            })
        }
    }
}

/// Duplicate attempts absorbed: outbox publish attempts, inbox deliveries, effect attempts.
async fn attempts(
    pools: &mut Pools,
    tables: &TableNames,
    config: &VerifyConfig,
) -> Result<report::Attempts, VerifyError> {
    let mut out = report::Attempts::default();
    for check in &config.checks {
        let Some(l) = &check.locate else { continue };
        let outbox_url = l.outbox_db.as_deref().unwrap_or(&check.source.db);
        let (db, name) = (pools.get(outbox_url).await?, redact(outbox_url));
        if !out.outbox.iter().any(|o| {
            o.db == name && o.aggregate_type == l.aggregate_type && o.event_type == l.event_type
        }) {
            let q = db::lookups_for(&db, tables);
            let c = counts(
                &db,
                outbox_url,
                &q.outbox_stats,
                &[&l.aggregate_type, &l.event_type],
                5,
            )
            .await?;
            out.outbox.push(OutboxAttempts {
                db: name,
                aggregate_type: l.aggregate_type.clone(),
                event_type: l.event_type.clone(),
                rows: c[0],
                pending: c[1],
                published: c[2],
                parked: c[3],
                attempts: c[4],
            });
        }
        let (db, name) = (pools.get(&l.inbox_db).await?, redact(&l.inbox_db));
        if !out
            .inbox
            .iter()
            .any(|i| i.db == name && i.consumer_group == l.consumer_group)
        {
            let q = db::lookups_for(&db, tables);
            let c = counts(&db, &l.inbox_db, &q.inbox_stats, &[&l.consumer_group], 3).await?;
            out.inbox.push(InboxAttempts {
                db: name,
                consumer_group: l.consumer_group.clone(),
                events: c[0],
                deliveries: c[1],
                duplicate_deliveries: c[1] - c[0],
                dead_lettered: c[2],
            });
        }
        if let (Some(url), Some(effect)) = (&l.intents_db, &l.effect) {
            let (db, name) = (pools.get(url).await?, redact(url));
            if !out
                .effects
                .iter()
                .any(|e| e.db == name && &e.effect == effect)
            {
                let q = db::lookups_for(&db, tables);
                let c = counts(&db, url, &q.intent_stats, &[effect], 6).await?;
                out.effects.push(EffectAttempts {
                    db: name,
                    effect: effect.clone(),
                    intents: c[0],
                    attempts: c[1],
                    repeated_attempts: (c[1] - c[0]).max(0),
                    done: c[2],
                    pending: c[3],
                    parked: c[4],
                    unknown: c[5],
                });
            }
        }
    }
    Ok(out)
}
