//! Where idem's tables are (`--db`, `--schema`, `--table-prefix`) and the URL dispatch:
//! PostgreSQL or SQLite.

use anyhow::{Context, bail};
use idem_core::TableNames;
use idem_postgres::PgStore;
use idem_sqlite::SqliteStore;

use clap::Args;

/// Where idem's tables are.
#[derive(Args, Debug, Clone)]
pub struct DbArgs {
    /// Database URL: postgres://… or sqlite://path (sqlite::memory: is not useful across processes).
    #[arg(long, env = "IDEM_DB")]
    pub db: String,
    /// PostgreSQL schema of idem's tables (default: the search path).
    #[arg(long, env = "IDEM_SCHEMA")]
    pub schema: Option<String>,
    /// Prefix of idem's table names.
    #[arg(long, env = "IDEM_TABLE_PREFIX", default_value = "idem_")]
    pub table_prefix: String,
}

/// An opened store of either kind.
pub enum Store {
    /// PostgreSQL.
    Postgres(PgStore),
    /// SQLite.
    Sqlite(SqliteStore),
}

/// Runs `$body` with `$s` bound to the concrete store.
#[macro_export]
macro_rules! with_store {
    ($store:expr, $s:ident => $body:expr) => {
        match $store {
            $crate::db::Store::Postgres($s) => $body,
            $crate::db::Store::Sqlite($s) => $body,
        }
    };
}

/// The table names `args` give.
pub fn tables(args: &DbArgs) -> anyhow::Result<TableNames> {
    Ok(TableNames::new(args.schema.as_deref(), &args.table_prefix)?)
}

fn is_postgres(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

/// Opens the database `args` name with a pool of at most `max_connections`.
pub async fn open(args: &DbArgs, max_connections: u32) -> anyhow::Result<Store> {
    let tables = tables(args)?;
    if is_postgres(&args.db) {
        let pool = idem_postgres::connect(&args.db, max_connections).await?;
        Ok(Store::Postgres(PgStore::new(pool, tables)))
    } else if args.db.starts_with("sqlite:") {
        if tables.schema().is_some() {
            bail!("--schema is for PostgreSQL; SQLite has no schemas");
        }
        let pool = idem_sqlite::connect(&args.db).await?;
        Ok(Store::Sqlite(SqliteStore::new(pool, tables)))
    } else {
        bail!(
            "unsupported database URL {:?}: use postgres://… or sqlite://path",
            idem_postgres::redact(&args.db)
        )
    }
}

/// `idem migrate`: creates or upgrades idem's tables and says what it did.
pub async fn migrate(args: &DbArgs) -> anyhow::Result<()> {
    let tables = tables(args)?;
    let (applied, current) = match open(args, 2).await? {
        Store::Postgres(s) => {
            let r = idem_postgres::migrate(s.pool(), &tables)
                .await
                .context("migrating PostgreSQL")?;
            (r.applied, r.current)
        }
        Store::Sqlite(s) => {
            let r = idem_sqlite::migrate(s.pool(), &tables)
                .await
                .context("migrating SQLite")?;
            (r.applied, r.current)
        }
    };
    if applied.is_empty() {
        println!("idem migrate: schema is up to date (version {current})");
    } else {
        println!("idem migrate: applied {applied:?}; schema is at version {current}");
    }
    Ok(())
}
