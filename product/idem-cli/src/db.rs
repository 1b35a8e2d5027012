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

/// How long a service waits at start for a database it cannot reach.
pub const OPEN_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

/// [`open`] for a service: while the database cannot be reached (a server starting,
/// restarting, or cut off by the network) it tries again, logging each failed try, for up to
/// [`OPEN_WAIT`], so that a service restarted while its database is down waits for it instead
/// of exiting. A refusal (credentials, TLS, a missing database) is returned at once.
pub async fn open_waiting(args: &DbArgs, max_connections: u32) -> anyhow::Result<Store> {
    open_checked(args, max_connections, |_| async { Ok(()) }).await
}

/// [`open_waiting`], with the service's start-up `check` of the opened database (its tables)
/// in the same wait: a check the network cuts short opens and checks again.
pub async fn open_checked<F, Fut>(
    args: &DbArgs,
    max_connections: u32,
    check: F,
) -> anyhow::Result<Store>
where
    F: Fn(Store) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let started = std::time::Instant::now();
    let mut pause = std::time::Duration::from_millis(250);
    loop {
        let e = match open(args, max_connections).await {
            Ok(store) => match check(store.clone()).await {
                Ok(()) => return Ok(store),
                Err(e) => e,
            },
            Err(e) => e,
        };
        if !unreachable(&e) || started.elapsed() + pause > OPEN_WAIT {
            return Err(e);
        }
        tracing::warn!(error = %format!("{e:#}"), "the database cannot be reached; trying again");
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(std::time::Duration::from_secs(5));
    }
}

/// What sqlx says of a server that closes the connection before it answers the SSLRequest (a
/// server starting, stopping or crashing, or a proxy whose upstream is gone): it reads the end
/// of the stream as a zero byte.
const CLOSED_BEFORE_THE_SSL_ANSWER: &str = "unexpected response from SSLRequest: 0x00";

/// Whether `e` says the database could not be reached — the connection refused, reset, closed
/// or timed out, or the server starting up or shutting down — as opposed to refusing this
/// client (credentials, TLS, a missing database), which waiting does not change.
fn unreachable(e: &anyhow::Error) -> bool {
    let network = |io: &std::io::Error| {
        use std::io::ErrorKind::*;
        matches!(
            io.kind(),
            ConnectionRefused
                | ConnectionReset
                | ConnectionAborted
                | TimedOut
                | UnexpectedEof
                | BrokenPipe
                | NotConnected
        )
    };
    e.chain()
        .any(|cause| match cause.downcast_ref::<sqlx::Error>() {
            Some(sqlx::Error::Io(io)) => network(io),
            Some(sqlx::Error::PoolTimedOut) => true,
            Some(sqlx::Error::Protocol(m)) => m.contains(CLOSED_BEFORE_THE_SSL_ANSWER),
            Some(sqlx::Error::Database(d)) => d
                .code()
                .is_some_and(|c| c.starts_with("08") || c.starts_with("57P")),
            Some(_) => false,
            None => cause.downcast_ref::<std::io::Error>().is_some_and(network),
        })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn io(kind: std::io::ErrorKind) -> anyhow::Error {
        let e = sqlx::Error::Io(std::io::Error::from(kind));
        anyhow::Error::new(idem_core::Error::database("connecting", e))
    }

    #[test]
    fn only_a_database_out_of_reach_is_waited_for() {
        use std::io::ErrorKind::*;
        for kind in [ConnectionRefused, ConnectionReset, TimedOut, UnexpectedEof] {
            assert!(unreachable(&io(kind)), "{kind:?}");
        }
        assert!(!unreachable(&io(InvalidData)));
        let tls = sqlx::Error::Tls("invalid peer certificate: UnknownIssuer".into());
        assert!(!unreachable(&anyhow::Error::new(
            idem_core::Error::database("connecting", tls)
        )));
        assert!(!unreachable(&anyhow::anyhow!("--schema is for PostgreSQL")));
    }

    /// A listener at a loopback port that reads the SSLRequest of its first `closed`
    /// connections and closes them unanswered, as a server starting or crashing does, and
    /// forwards the others to `upstream`.
    async fn closing_then_forwarding(upstream: &str, closed: usize) -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let upstream = upstream.to_owned();
        tokio::spawn(async move {
            let mut n = 0;
            while let Ok((mut client, _)) = listener.accept().await {
                n += 1;
                if n <= closed {
                    use tokio::io::AsyncReadExt;
                    // Read, so that closing sends a FIN and not a reset.
                    let mut request = [0u8; 8];
                    let _ = client.read_exact(&mut request).await;
                    drop(client);
                    continue;
                }
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    if let Ok(mut server) = tokio::net::TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
            }
        });
        addr
    }

    fn args(url: String) -> DbArgs {
        DbArgs {
            db: url,
            schema: None,
            table_prefix: "idem_".to_owned(),
        }
    }

    /// A server that closes the connection before it answers the SSLRequest is out of reach
    /// for now: a service started while its server restarts waits for it, and opens it once
    /// the server answers.
    #[tokio::test]
    async fn a_server_closing_connections_unanswered_is_waited_for() {
        let db = idem_conformance::pg::TestDb::create().await;
        // postgres://USER@HOST:PORT/NAME
        let (user, rest) = db.url().split_once('@').unwrap();
        let (upstream, name) = rest.split_once('/').unwrap();
        let through = |addr: std::net::SocketAddr| format!("{user}@{addr}/{name}");
        let closing = closing_then_forwarding(upstream, usize::MAX).await;
        let e = open(&args(through(closing)), 1).await.err().unwrap();
        assert!(unreachable(&e), "{e:#}");

        let healing = closing_then_forwarding(upstream, 2).await;
        let store = open_waiting(&args(through(healing)), 1).await;
        assert!(store.is_ok(), "{:#}", store.err().unwrap());
    }
}
