//! The console bench's tables: idem's, filled with set-based statements (`sql/console_*.sql`)
//! the way writers, relays, consumers and operators leave them, then analyzed.

use std::time::Instant;

use anyhow::Context;
use sqlx::PgPool;

use super::ConsoleBenchArgs;

const OUTBOX: &str = include_str!("../sql/console_outbox.sql");
const INBOX: &str = include_str!("../sql/console_inbox.sql");
const DEAD_LETTERS: &str = include_str!("../sql/console_dead_letters.sql");
const INTENTS: &str = include_str!("../sql/console_intents.sql");
const AUDIT: &str = include_str!("../sql/console_audit.sql");
const TARGETS: &str = include_str!("../sql/console_targets.sql");

/// How long each table took to fill, in seconds, in the order filled (`analyze` last).
pub(super) type FillTimes = Vec<(&'static str, f64)>;

/// Fills every table of `pool`'s database as `args` says and analyzes it; progress on stderr.
pub(super) async fn fill(pool: &PgPool, args: &ConsoleBenchArgs) -> anyhow::Result<FillTimes> {
    let n = |v: u64| i64::try_from(v).context("a row count beyond i64");
    let steps: [(&'static str, &str, Vec<i64>); 5] = [
        (
            "outbox",
            OUTBOX,
            vec![
                n(args.outbox_rows)?,
                n(args.pending_rows)?,
                n(args.parked_rows)?,
            ],
        ),
        ("inbox", INBOX, vec![n(args.inbox_rows)?]),
        ("dead_letters", DEAD_LETTERS, vec![n(args.dead_letters)?]),
        (
            "effect_intents",
            INTENTS,
            vec![
                n(args.effect_intents)?,
                n(args.unknown_intents)?,
                n(args.parked_intents)?,
            ],
        ),
        ("audit", AUDIT, vec![n(args.audit_rows)?]),
    ];
    let mut times = vec![];
    for (table, sql, binds) in steps {
        times.push((
            table,
            timed(table, fill_one(pool, table, sql, &binds)).await?,
        ));
    }
    let analyze = sqlx::query("ANALYZE").execute(pool);
    times.push(("analyze", timed("analyze", analyze).await?));
    Ok(times)
}

/// Runs one fill statement with its counts bound in order.
async fn fill_one(pool: &PgPool, table: &str, sql: &str, binds: &[i64]) -> anyhow::Result<()> {
    eprintln!("idem bench console: filling {table}");
    let query = binds.iter().fold(sqlx::query(sql), |q, b| q.bind(*b));
    query
        .execute(pool)
        .await
        .with_context(|| format!("filling {table}"))?;
    Ok(())
}

/// Awaits `step`, says how long it took on stderr, and returns that in seconds.
async fn timed<T, E>(what: &str, step: impl Future<Output = Result<T, E>>) -> anyhow::Result<f64>
where
    E: Into<anyhow::Error>,
{
    let started = Instant::now();
    step.await.map_err(Into::into)?;
    let seconds = started.elapsed().as_secs_f64();
    eprintln!("idem bench console: {what} done in {seconds:.1} s");
    Ok(seconds)
}

/// What the filtered pages ask for, read from the filled tables.
#[derive(Clone, Debug, Default, sqlx::FromRow)]
pub(super) struct Targets {
    /// The rarest reason of the parked outbox rows.
    pub(super) parked_reason: Option<String>,
    /// An outbox id 90 % into the table.
    pub(super) outbox_after: i64,
    /// The consumer group with the most open dead letters.
    pub(super) letter_group: Option<String>,
    /// That group's rarest open reason.
    pub(super) letter_reason: Option<String>,
    /// A dead-letter id 90 % into that group's letters.
    pub(super) letters_after: Option<i64>,
}

impl Targets {
    /// Reads them from `pool`'s filled tables.
    pub(super) async fn read(pool: &PgPool) -> anyhow::Result<Self> {
        sqlx::query_as(TARGETS)
            .fetch_one(pool)
            .await
            .context("choosing the filtered pages' parameters")
    }
}
