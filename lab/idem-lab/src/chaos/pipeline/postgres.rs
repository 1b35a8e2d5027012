//! The PostgreSQL server a pipeline file asks the runner to start (`{ start = true }`
//! databases): created with its databases and their setup commands before the components, and
//! crashed (`pg_ctl stop -m immediate`, then start) at 40 % and 70 % of the run: every
//! component loses its sessions and whatever the server had not flushed. With `[postgres]
//! failover = true` it has a synchronous standby and fails over to it at 40 % instead.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use idem_conformance::private_pg::PrivatePg;
use sqlx::postgres::PgPool;

use super::file::{PipelineFile, Places, expand};

/// The runner's own server and the URL of each database it created on it.
pub(super) struct Server {
    pg: PrivatePg,
    /// `postgres://postgres@127.0.0.1:PORT/NAME` by database name.
    pub urls: BTreeMap<String, String>,
}

/// Starts the server and creates the file's `start = true` databases, each set up by its
/// command; `None` when the file has none.
pub(super) async fn start(file: &PipelineFile, dir: &Path) -> anyhow::Result<Option<Server>> {
    if file.started().next().is_none() {
        return Ok(None);
    }
    let pg = tokio::task::spawn_blocking(PrivatePg::try_start)
        .await?
        .context("starting the run's PostgreSQL server (initdb, pg_ctl)")?;
    let admin = PgPool::connect(&pg.url()).await?;
    let mut urls = BTreeMap::new();
    for (name, _) in file.started() {
        // The name is checked (letters, digits, `-`, `_`) and quoted.
        sqlx::query(&format!("CREATE DATABASE \"{name}\""))
            .execute(&admin)
            .await
            .with_context(|| format!("creating database {name} on the run's server"))?;
        urls.insert(name.to_owned(), database_url(&pg.url(), name));
    }
    admin.close().await;
    let places = Places {
        databases: file.urls(&urls),
        dir: dir.display().to_string(),
        ..Places::default()
    };
    for (name, started) in file.started() {
        set_up(name, &started.setup, &places)?;
    }
    if file.postgres.failover {
        tokio::task::block_in_place(|| pg.try_add_standby())
            .context("adding the run's server a synchronous standby (pg_basebackup)")?;
    }
    Ok(Some(Server { pg, urls }))
}

/// The `application_name` of the runner's own sessions (a lock's `end_waiters` spares them).
pub(super) const RUNNER: &str = "idem-lab chaos runner";

/// A pool of the runner's own on `url`, of at most `max` sessions named [`RUNNER`], each
/// tested before use (the server may have restarted since).
pub(super) async fn runner_pool(url: &str, max: u32) -> anyhow::Result<PgPool> {
    let options = url
        .parse::<sqlx::postgres::PgConnectOptions>()
        .with_context(|| format!("reading the URL {}", idem_sql::redact(url)))?
        .application_name(RUNNER);
    Ok(sqlx::postgres::PgPoolOptions::new()
        .max_connections(max)
        .test_before_acquire(true)
        .connect_with(options)
        .await?)
}

/// `url` (a server's URL, `…/postgres`) naming database `name` instead.
fn database_url(url: &str, name: &str) -> String {
    let server = url.rsplit_once('/').map_or(url, |(server, _)| server);
    format!("{server}/{name}")
}

/// Runs a database's setup command (none: nothing to do), refusing the run when it fails.
fn set_up(name: &str, setup: &[String], places: &Places) -> anyhow::Result<()> {
    let Some((program, args)) = setup.split_first() else {
        return Ok(());
    };
    // Checked when the file was read: every placeholder is defined.
    let fill = |t: &String| expand(t, places).unwrap_or_else(|_| t.clone());
    let out = Command::new(fill(program))
        .args(args.iter().map(fill))
        .output()
        .with_context(|| format!("running the setup of database {name} ({program})"))?;
    if !out.status.success() {
        bail!(
            "the setup of database {name} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// What the runner does to its server.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum ServerFault {
    /// `pg_ctl stop -m immediate`, then start.
    Crash,
    /// The primary stopped as a crash would, its synchronous standby promoted in its place.
    Failover,
}

/// When the server takes which fault: at 40 % (a crash, or with `failover` the failover) and
/// 70 % (a crash) of a run of `seconds`; latest first, popped from the end.
pub(super) fn server_faults(
    started: Instant,
    seconds: u64,
    failover: bool,
) -> Vec<(Instant, ServerFault)> {
    let at = |pct: u64| started + Duration::from_millis(seconds * 10 * pct);
    let first = match failover {
        true => ServerFault::Failover,
        false => ServerFault::Crash,
    };
    vec![(at(70), ServerFault::Crash), (at(40), first)]
}

/// Fails the server over to its standby, proving that a promoted standby answers: the
/// timeline of its last checkpoint, read through connections of this function's own, moved.
pub(super) async fn fail_over(server: &Server) -> anyhow::Result<()> {
    const TIMELINE: &str = "SELECT timeline_id::bigint FROM pg_control_checkpoint()";
    let url = server.pg.url();
    let before = one_value(&url, TIMELINE).await?;
    let log = server.pg.log();
    tokio::task::block_in_place(|| server.pg.try_fail_over())
        .map_err(|e| anyhow::anyhow!("{e} (server log {})", log.display()))?;
    let after = answer_within_60s(&url, TIMELINE, "its failover").await?;
    if after <= before {
        bail!("the server's timeline did not move ({before} → {after}): no standby was promoted");
    }
    Ok(())
}

/// Crashes the server and starts it again, proving that it restarted (its start time moved).
pub(super) async fn crash_and_restart(server: &Server) -> anyhow::Result<()> {
    crash_and_restart_proven(&server.pg).await
}

/// Crashes `pg` (`pg_ctl stop -m immediate`) and starts it again, proving that it restarted:
/// its start time, read through connections of this function's own, moved.
pub(crate) async fn crash_and_restart_proven(pg: &PrivatePg) -> anyhow::Result<()> {
    let started_at = "SELECT (extract(epoch FROM pg_postmaster_start_time()) * 1000000)::bigint";
    let before = one_value(&pg.url(), started_at).await?;
    let log = pg.log();
    tokio::task::block_in_place(|| pg.try_crash_and_restart())
        .map_err(|e| anyhow::anyhow!("{e} (server log {})", log.display()))?;
    let after = answer_within_60s(&pg.url(), started_at, "its restart").await?;
    if after <= before {
        bail!("PostgreSQL's start time did not move ({before} → {after} µs): it never restarted");
    }
    Ok(())
}

/// The answer to `sql` once the server at `url` gives one, within 60 s (of `what`).
async fn answer_within_60s(url: &str, sql: &str, what: &str) -> anyhow::Result<i64> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match one_value(url, sql).await {
            Ok(v) => return Ok(v),
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => bail!("PostgreSQL did not answer within 60 s of {what}: {e}"),
        }
    }
}

/// The one value `sql` returns, through a connection of its own.
async fn one_value(url: &str, sql: &str) -> anyhow::Result<i64> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(url).await?;
    let t = sqlx::query_scalar(sql).fetch_one(&mut conn).await?;
    conn.close().await?;
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_created_database_is_named_in_the_servers_url() {
        assert_eq!(
            database_url("postgres://postgres@127.0.0.1:5499/postgres", "shop-orders"),
            "postgres://postgres@127.0.0.1:5499/shop-orders"
        );
    }

    #[test]
    fn the_server_crashes_at_forty_and_seventy_percent() {
        let t0 = Instant::now();
        let mut times = server_faults(t0, 100, false);
        assert_eq!(
            times.pop(),
            Some((t0 + Duration::from_secs(40), ServerFault::Crash))
        );
        assert_eq!(
            times.pop(),
            Some((t0 + Duration::from_secs(70), ServerFault::Crash))
        );
        assert_eq!(times.pop(), None);
    }

    #[test]
    fn a_server_with_a_standby_fails_over_at_forty_percent_and_crashes_at_seventy() {
        let t0 = Instant::now();
        let mut times = server_faults(t0, 100, true);
        assert_eq!(
            times.pop(),
            Some((t0 + Duration::from_secs(40), ServerFault::Failover))
        );
        assert_eq!(
            times.pop(),
            Some((t0 + Duration::from_secs(70), ServerFault::Crash))
        );
        assert_eq!(times.pop(), None);
    }
}
