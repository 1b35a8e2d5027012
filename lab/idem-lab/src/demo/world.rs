//! The demo's databases and broker: SQLite files and librdkafka's mock cluster by default, or a
//! PostgreSQL server (three fresh databases per run) and real brokers.

use std::path::PathBuf;

use anyhow::{Context, bail};
use idem_core::TableNames;
use idem_sql::{AnyPool, Scheme};

/// The three databases.
pub(crate) struct Databases {
    pub orders: AnyPool,
    pub settlement: AnyPool,
    pub points: AnyPool,
    /// URLs, for `idem verify`.
    pub urls: [String; 3],
    /// PostgreSQL: the server to drop the databases from, and their names.
    drop_on_exit: Option<(String, Vec<String>)>,
    /// SQLite: the directory (deleted on drop unless kept).
    _dir: Option<tempfile::TempDir>,
    pub location: String,
}

/// Connections of each SQLite file's pool, by role ([`ROLES`]): the points API's file has one, so
/// that its award transactions (each holding the write lock from the key's claim to the commit)
/// queue in the pool instead of sleeping in SQLite's busy handler; the others keep idem's
/// default of four (there, with one, the order writer queued behind the relays' claims and
/// the progress counts, and wrote fewer orders per second).
const SQLITE_POOLS: [u32; 3] = [4, 4, 1];

/// The three database roles, in the order of [`Databases::urls`].
const ROLES: [&str; 3] = ["orders", "settlement", "points"];

fn pg_url_with_db(server: &str, db: &str) -> anyhow::Result<String> {
    // postgres://user@host:port/dbname?params → swap dbname.
    let (head, params) = match server.split_once('?') {
        Some((h, p)) => (h, Some(p)),
        None => (server, None),
    };
    let scheme_end = head.find("://").context("a postgres:// URL")? + 3;
    let base = match head[scheme_end..].find('/') {
        Some(slash) => &head[..scheme_end + slash],
        None => head,
    };
    Ok(match params {
        Some(p) => format!("{base}/{db}?{p}"),
        None => format!("{base}/{db}"),
    })
}

/// Whom a run's PostgreSQL databases are given to: a role, and the URL of that role on a
/// database (by name).
pub(crate) struct Owner<'a> {
    /// The role.
    pub role: &'a str,
    /// The role's URL on a database.
    pub url_of: &'a dyn Fn(&str) -> anyhow::Result<String>,
}

impl Databases {
    /// Fresh databases: SQLite files under `dir` (or a temporary directory), or three new
    /// databases on the PostgreSQL server of `pg`.
    pub(crate) async fn create(
        pg: Option<&str>,
        dir: Option<PathBuf>,
        run: &str,
        tables: &TableNames,
    ) -> anyhow::Result<Self> {
        match pg {
            Some(server) => Self::create_postgres(server, run, tables).await,
            None => Self::create_sqlite(dir, run, tables).await,
        }
    }

    /// Three new databases on the PostgreSQL server `server`, migrated.
    async fn create_postgres(server: &str, run: &str, tables: &TableNames) -> anyhow::Result<Self> {
        Self::create_postgres_for(server, run, tables, None).await
    }

    /// Three new databases on the PostgreSQL server `server`, whose user creates (and drops)
    /// them; with an `owner` — a role and the URL of that role on a database — each is given
    /// to the role (`ALTER DATABASE … OWNER TO`), then migrated and used through the role's URL,
    /// so that the role owns every table.
    pub(crate) async fn create_postgres_for(
        server: &str,
        run: &str,
        tables: &TableNames,
        owner: Option<Owner<'_>>,
    ) -> anyhow::Result<Self> {
        if Scheme::of(server).ok() != Some(Scheme::Postgres) {
            bail!("--db must be a postgres:// URL (the SQLite default needs no --db)");
        }
        let admin = idem_sql::postgres::connect(server, 1).await?;
        let mut names = vec![];
        let mut urls = vec![];
        for role in ROLES {
            let name = format!("idem_demo_{run}_{role}");
            sqlx::query(&format!("CREATE DATABASE \"{name}\""))
                .execute(&admin)
                .await
                .with_context(|| format!("creating database {name}"))?;
            match &owner {
                Some(Owner {
                    role: owner,
                    url_of,
                }) => {
                    sqlx::query(&format!("ALTER DATABASE \"{name}\" OWNER TO \"{owner}\""))
                        .execute(&admin)
                        .await
                        .with_context(|| format!("giving database {name} to {owner}"))?;
                    urls.push(url_of(&name)?);
                }
                None => urls.push(pg_url_with_db(server, &name)?),
            }
            names.push(name);
        }
        admin.close().await;
        let mut pools = vec![];
        for url in &urls {
            let pool = idem_sql::postgres::connect(url, 8).await?;
            idem_sql::postgres::migrate(&pool, tables).await?;
            idem_reference::ensure_schema_postgres(&pool).await?;
            pools.push(AnyPool::Postgres(pool));
        }
        Databases::assemble(
            pools,
            urls,
            format!("PostgreSQL databases idem_demo_{run}_*"),
            Some((server.to_owned(), names)),
            None,
        )
    }

    /// Three SQLite files under `dir` (or a temporary directory), migrated.
    async fn create_sqlite(
        dir: Option<PathBuf>,
        run: &str,
        tables: &TableNames,
    ) -> anyhow::Result<Self> {
        let (path, temp) = match dir {
            Some(d) => {
                std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
                (d, None)
            }
            None => {
                let t = tempfile::Builder::new().prefix("idem-demo-").tempdir()?;
                (t.path().to_owned(), Some(t))
            }
        };
        let mut pools = vec![];
        let mut urls = vec![];
        for (role, size) in ROLES.into_iter().zip(SQLITE_POOLS) {
            let file = path.join(format!("{role}-{run}.db"));
            let url = format!("sqlite://{}", file.display());
            let pool = idem_sql::sqlite::connect_with_pool_size(&url, size).await?;
            idem_sql::sqlite::migrate(&pool, tables).await?;
            idem_reference::ensure_schema_sqlite(&pool).await?;
            pools.push(AnyPool::Sqlite(pool));
            urls.push(url);
        }
        Databases::assemble(
            pools,
            urls,
            format!("SQLite files in {}", path.display()),
            None,
            temp,
        )
    }

    /// The orders, settlement and points pools and URLs, in that order.
    fn assemble(
        pools: Vec<AnyPool>,
        urls: Vec<String>,
        location: String,
        drop_on_exit: Option<(String, Vec<String>)>,
        dir: Option<tempfile::TempDir>,
    ) -> anyhow::Result<Self> {
        let [orders, settlement, points]: [AnyPool; 3] = pools
            .try_into()
            .map_err(|_| anyhow::anyhow!("three pools"))?;
        Ok(Databases {
            orders,
            settlement,
            points,
            urls: urls.try_into().map_err(|_| anyhow::anyhow!("three URLs"))?,
            drop_on_exit,
            _dir: dir,
            location,
        })
    }

    /// Drops the PostgreSQL databases (SQLite files go with their temporary directory).
    pub(crate) async fn cleanup(self, keep: bool) -> anyhow::Result<()> {
        for p in [&self.orders, &self.settlement, &self.points] {
            p.close().await;
        }
        if keep {
            if let Some(dir) = self._dir {
                let kept = dir.keep();
                eprintln!("idem demo: kept the databases in {}", kept.display());
            } else {
                eprintln!("idem demo: kept the {}", self.location);
            }
            return Ok(());
        }
        if let Some((server, names)) = self.drop_on_exit {
            let admin = idem_sql::postgres::connect(&server, 1).await?;
            for name in names {
                sqlx::query(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
                    .execute(&admin)
                    .await
                    .with_context(|| format!("dropping database {name}"))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The points file's award transactions queue in a pool of one; the other files keep
    /// idem's four connections.
    #[tokio::test]
    async fn the_points_file_has_one_connection_and_the_others_four() {
        let dbs = Databases::create(None, None, "pools", &TableNames::default())
            .await
            .unwrap();
        let size = |p: &AnyPool| match p {
            AnyPool::Sqlite(p) => p.options().get_max_connections(),
            AnyPool::Postgres(_) => 0,
        };
        let sizes = [size(&dbs.orders), size(&dbs.settlement), size(&dbs.points)];
        dbs.cleanup(false).await.unwrap();
        assert_eq!(sizes, [4, 4, 1]);
    }

    #[test]
    fn database_names_are_swapped_into_the_server_url() {
        assert_eq!(
            pg_url_with_db("postgres://u@h:5432/postgres", "x").unwrap(),
            "postgres://u@h:5432/x"
        );
        assert_eq!(
            pg_url_with_db("postgres://u@h?sslmode=disable", "x").unwrap(),
            "postgres://u@h/x?sslmode=disable"
        );
    }
}
