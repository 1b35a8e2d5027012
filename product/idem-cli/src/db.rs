//! Where idem's tables are (`--db`, `--schema`, `--table-prefix`) and the URL dispatch:
//! PostgreSQL or SQLite.

use anyhow::{Context, bail};
use idem_core::TableNames;
use idem_sql::Scheme;

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

/// An opened store of either kind, chosen by the URL's scheme ([`idem_sql::AnyStore`]).
/// `idem_sql::with_store!(store, s => …)` runs code written once over the dialect.
pub use idem_sql::AnyStore as Store;

/// The table names `args` give.
pub fn tables(args: &DbArgs) -> anyhow::Result<TableNames> {
    Ok(TableNames::new(args.schema.as_deref(), &args.table_prefix)?)
}

/// Opens the database `args` name with a pool of at most `max_connections`.
pub async fn open(args: &DbArgs, max_connections: u32) -> anyhow::Result<Store> {
    let tables = tables(args)?;
    if tables.schema().is_some() && Scheme::of(&args.db)? == Scheme::Sqlite {
        bail!("--schema is for PostgreSQL; SQLite has no schemas");
    }
    Ok(Store::connect(&args.db, max_connections, tables).await?)
}

/// `idem migrate`: creates or upgrades idem's tables and says what it did.
pub async fn migrate(args: &DbArgs) -> anyhow::Result<()> {
    let store = open(args, 2).await?;
    let r = idem_sql::with_store!(&store, s => s.migrate().await)
        .with_context(|| format!("migrating {}", store_kind(&store)))?;
    if r.applied.is_empty() {
        println!("idem migrate: schema is up to date (version {})", r.current);
    } else {
        println!(
            "idem migrate: applied {:?}; schema is at version {}",
            r.applied, r.current
        );
    }
    Ok(())
}

/// The database's name, for messages.
fn store_kind(store: &Store) -> &'static str {
    match store.pool().scheme() {
        Scheme::Postgres => "PostgreSQL",
        Scheme::Sqlite => "SQLite",
    }
}
