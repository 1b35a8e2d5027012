//! Reading each side in one consistent snapshot, in key order, without holding it in memory.

use std::collections::HashMap;
use std::time::Duration;

use futures::TryStreamExt;
use idem_core::TableNames;
use idem_sql::{AnyPool, Scheme};
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use sqlx::{ConnectOptions, Connection, Executor, Row};
use tokio::sync::{mpsc, oneshot};

use crate::VerifyError;
use crate::config::{column, one_statement};

/// Rows per message from a reader task to the merge.
const BATCH: usize = 1024;
/// Messages buffered per side: memory stays bounded whatever the table size.
const DEPTH: usize = 4;

/// One database, PostgreSQL or SQLite.
pub(crate) type Db = AnyPool;

pub(crate) use idem_sql::redact;

fn db_error(url: &str, context: &str, e: sqlx::Error) -> VerifyError {
    VerifyError::Database {
        db: redact(url),
        context: context.to_owned(),
        source: e,
    }
}

/// One row of a side, as the merge sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct KeyRow {
    pub key: String,
    pub amount: Option<i64>,
    pub event_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub currency: Option<String>,
}

/// What a reader task sends.
pub(crate) type Batch = Result<Vec<KeyRow>, VerifyError>;

/// The columns to read from one side.
pub(crate) struct SideQuery<'a> {
    pub query: &'a str,
    pub key: &'a str,
    pub amount: Option<&'a str>,
    pub event_type: Option<&'a str>,
    pub aggregate_id: Option<&'a str>,
    pub currency: Option<&'a str>,
}

/// Open databases, shared by URL.
#[derive(Default)]
pub(crate) struct Pools {
    open: HashMap<String, Db>,
}

impl Pools {
    pub(crate) async fn get(&mut self, url: &str) -> Result<Db, VerifyError> {
        if let Some(db) = self.open.get(url) {
            return Ok(db.clone());
        }
        let db = match Scheme::of(url) {
            Ok(Scheme::Postgres) => {
                let target = idem_sql::postgres::PgUrl::parse(url).map_err(VerifyError::Connect)?;
                let opts = target.connect_options().map_err(VerifyError::Connect)?;
                // Full-table reads are slow by design: do not log them as slow statements.
                let opts = opts.log_slow_statements(log::LevelFilter::Off, Duration::ZERO);
                AnyPool::Postgres(
                    PgPoolOptions::new()
                        .max_connections(4)
                        .connect_with(opts)
                        .await
                        .map_err(|e| {
                            VerifyError::Connect(idem_sql::postgres::connect_error(&target, e))
                        })?,
                )
            }
            Ok(Scheme::Sqlite) => {
                let opts: SqliteConnectOptions = url
                    .parse()
                    .map_err(|e| db_error(url, "reading the SQLite URL", e))?;
                AnyPool::Sqlite(
                    SqlitePoolOptions::new()
                        .max_connections(4)
                        .connect_with(
                            opts.create_if_missing(false)
                                .read_only(true)
                                .log_slow_statements(log::LevelFilter::Off, Duration::ZERO),
                        )
                        .await
                        .map_err(|e| db_error(url, "opening", e))?,
                )
            }
            Err(_) => {
                return Err(VerifyError::Config(format!(
                    "database URL {} is neither postgres:// nor sqlite://",
                    redact(url)
                )));
            }
        };
        self.open.insert(url.to_owned(), db.clone());
        Ok(db)
    }
}

fn wrap(db: &Db, q: &SideQuery<'_>) -> Result<String, VerifyError> {
    let query = one_statement(q.query, "query")?;
    let key = column(q.key, "key column")?;
    let pg = db.scheme() == Scheme::Postgres;
    let (text, int) = if pg {
        ("text", "bigint")
    } else {
        ("TEXT", "INTEGER")
    };
    let col = |c: Option<&str>, ty: &str| -> Result<String, VerifyError> {
        Ok(match c {
            Some(c) => format!("CAST(q.{} AS {ty})", column(c, "column")?),
            None => format!("CAST(NULL AS {ty})"),
        })
    };
    let order = if pg {
        format!("CAST(q.{key} AS text) COLLATE \"C\"")
    } else {
        "k".to_owned()
    };
    Ok(format!(
        "SELECT CAST(q.{key} AS {text}) AS k, {} AS a, {} AS t, {} AS g, {} AS c FROM ({query}) AS q ORDER BY {order}",
        col(q.amount, int)?,
        col(q.event_type, text)?,
        col(q.aggregate_id, text)?,
        col(q.currency, text)?,
    ))
}

fn decode<R: Row>(r: &R, url: &str) -> Result<KeyRow, VerifyError>
where
    for<'a> Option<String>: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
    for<'a> Option<i64>: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
    for<'a> &'a str: sqlx::ColumnIndex<R>,
{
    let dec = |e| db_error(url, "decoding a row", e);
    let key: Option<String> = r.try_get("k").map_err(dec)?;
    Ok(KeyRow {
        key: key.ok_or_else(|| VerifyError::NullKey { db: redact(url) })?,
        amount: r.try_get("a").map_err(dec)?,
        event_type: r.try_get("t").map_err(dec)?,
        aggregate_id: r.try_get("g").map_err(dec)?,
        currency: r.try_get("c").map_err(dec)?,
    })
}

/// Starts reading one side in a snapshot. `ready` fires once the snapshot is taken; rows then
/// arrive in key order (byte order of the key as text) in bounded batches.
pub(crate) fn stream_side(
    db: Db,
    url: String,
    q: SideQuery<'_>,
    ready: oneshot::Sender<()>,
) -> Result<mpsc::Receiver<Batch>, VerifyError> {
    let sql = wrap(&db, &q)?;
    let (tx, rx) = mpsc::channel::<Batch>(DEPTH);
    tokio::spawn(async move {
        let result = read_snapshot(&db, &url, &sql, ready, &tx).await;
        if let Err(e) = result {
            let _ = tx.send(Err(e)).await;
        }
    });
    Ok(rx)
}

async fn read_snapshot(
    db: &Db,
    url: &str,
    sql: &str,
    ready: oneshot::Sender<()>,
    tx: &mpsc::Sender<Batch>,
) -> Result<(), VerifyError> {
    let err = |context: &'static str| move |e| db_error(url, context, e);
    let mut batch = Vec::with_capacity(BATCH);
    macro_rules! pump {
        ($conn:expr) => {{
            let mut rows = sqlx::query(sql).fetch(&mut *$conn);
            while let Some(r) = rows.try_next().await.map_err(err("reading rows"))? {
                batch.push(decode(&r, url)?);
                if batch.len() == BATCH {
                    let full = std::mem::replace(&mut batch, Vec::with_capacity(BATCH));
                    if tx.send(Ok(full)).await.is_err() {
                        return Ok(()); // the merge stopped
                    }
                }
            }
        }};
    }
    match db {
        AnyPool::Postgres(pool) => {
            let mut conn = pool.acquire().await.map_err(err("connecting"))?;
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                .await
                .map_err(err("opening a snapshot"))?;
            // The snapshot is taken by the first statement, not by BEGIN.
            conn.execute("SELECT 1")
                .await
                .map_err(err("opening a snapshot"))?;
            let _ = ready.send(());
            pump!(conn);
            conn.execute("COMMIT")
                .await
                .map_err(err("closing the snapshot"))?;
        }
        AnyPool::Sqlite(pool) => {
            let mut conn = pool.acquire().await.map_err(err("connecting"))?;
            let mut read = conn.begin().await.map_err(err("opening a snapshot"))?;
            // SQLite (WAL) fixes the read snapshot at the first read.
            read.execute("SELECT count(*) FROM sqlite_master")
                .await
                .map_err(err("opening a snapshot"))?;
            let _ = ready.send(());
            pump!(read);
            read.commit().await.map_err(err("closing the snapshot"))?;
        }
    }
    if !batch.is_empty() {
        let _ = tx.send(Ok(batch)).await;
    }
    Ok(())
}

/// The rendered lookup and count statements of one database (`idem_sql`'s).
pub(crate) type Lookups = idem_sql::VerifyStatements;

/// The statements for `db`'s dialect over `tables`.
pub(crate) fn lookups_for(db: &Db, tables: &TableNames) -> Lookups {
    idem_sql::VerifyStatements::new(db.scheme(), tables)
}

/// Runs a lookup returning at most one row of `n` text columns.
pub(crate) async fn lookup_text(
    db: &Db,
    url: &str,
    sql: &str,
    args: &[&str],
    n: usize,
) -> Result<Option<Vec<Option<String>>>, VerifyError> {
    let err = |e| db_error(url, "looking up where an event stopped", e);
    macro_rules! run {
        ($pool:expr) => {{
            let mut q = sqlx::query(sql);
            for a in args {
                q = q.bind(*a);
            }
            match q.fetch_optional($pool).await.map_err(err)? {
                None => None,
                Some(row) => Some(
                    (0..n)
                        .map(|i| row.try_get::<Option<String>, _>(i))
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(err)?,
                ),
            }
        }};
    }
    Ok(idem_sql::with_pool!(db, p => run!(p)))
}

/// Runs a query returning one row of `n` integer columns.
pub(crate) async fn counts(
    db: &Db,
    url: &str,
    sql: &str,
    args: &[&str],
    n: usize,
) -> Result<Vec<i64>, VerifyError> {
    let err = |e| db_error(url, "counting attempts", e);
    macro_rules! run {
        ($pool:expr) => {{
            let mut q = sqlx::query(sql);
            for a in args {
                q = q.bind(*a);
            }
            let row = q.fetch_one($pool).await.map_err(err)?;
            (0..n)
                .map(|i| row.try_get::<i64, _>(i))
                .collect::<Result<Vec<_>, _>>()
                .map_err(err)?
        }};
    }
    Ok(idem_sql::with_pool!(db, p => run!(p)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_hidden() {
        assert_eq!(redact("postgres://u:pw@h/db"), "postgres://u:***@h/db");
        assert_eq!(redact("sqlite:///tmp/a.db"), "sqlite:///tmp/a.db");
    }
}
