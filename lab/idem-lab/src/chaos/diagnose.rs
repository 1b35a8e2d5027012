//! When a run does not settle: what every process and database was doing, written to
//! `diagnosis.txt` in the run's logs before anything is stopped, so that a liveness failure
//! seen once (in CI) can be explained from its logs alone.

use std::fmt::Write as _;
use std::path::Path;

use super::procs::Proc;
use super::settle::Pipeline;

/// Queries whose rows are printed as they are (text columns only).
const SETTLEMENT_QUERIES: &[(&str, &str)] = &[
    (
        "pending effect intents (the first 30)",
        "SELECT 'id=' || id || ' attempts=' || attempts || ' created=' || created_at::text \
         || ' next_attempt=' || next_attempt_at::text \
         || ' claimed_until=' || COALESCE(claimed_until::text, '-') \
         || ' sending_attempt=' || COALESCE(sending_attempt::text, '-') \
         FROM idem_effect_intents WHERE status = 'pending' ORDER BY id LIMIT 30",
    ),
    (
        "effect intents by status",
        "SELECT status || ' attempts=' || attempts || ' n=' || count(*) \
         || ' leased=' || count(*) FILTER (WHERE claimed_until > clock_timestamp()) \
         || ' due=' || count(*) FILTER (WHERE next_attempt_at <= now()) \
         || ' last_error=' || COALESCE(left(min(last_error), 60), '-') \
         FROM idem_effect_intents GROUP BY status, attempts ORDER BY status, attempts",
    ),
    (
        "sessions on the run's databases",
        "SELECT datname || ' pid=' || pid || ' ' || COALESCE(application_name, '') || ' state=' \
         || COALESCE(state, '-') || ' wait=' || COALESCE(wait_event_type || ':' || wait_event, '-') \
         || ' xact_age=' || COALESCE((clock_timestamp() - xact_start)::text, '-') \
         || ' query=' || left(regexp_replace(query, '\\s+', ' ', 'g'), 120) \
         FROM pg_stat_activity WHERE datname LIKE current_database() || '%' \
            OR datname LIKE regexp_replace(current_database(), '_settlement$', '') || '%'",
    ),
];

/// Writes the diagnosis; a failure to write it is logged, never fatal.
pub(super) async fn write(pipe: &Pipeline<'_>, procs: &mut [Proc], dir: &Path) {
    let mut out = String::new();
    let _ = writeln!(out, "== processes");
    for p in procs.iter_mut() {
        let _ = writeln!(out, "{}", process_line(p));
    }
    for p in procs.iter_mut() {
        if let Some(metrics) = p.idem_metrics() {
            let _ = writeln!(
                out,
                "== {} incarnation {} metrics\n{metrics}",
                p.name, p.incarnation
            );
        }
    }
    for p in procs.iter_mut().filter(|p| p.name == "dispatcher") {
        if let Some(pid) = p.pid() {
            let _ = writeln!(out, "== {} threads\n{}", p.name, backtrace(pid).await);
        }
    }
    for (title, sql) in SETTLEMENT_QUERIES {
        let _ = writeln!(out, "== {title}");
        match texts(&pipe.dbs.settlement, sql).await {
            Ok(rows) => rows.iter().for_each(|r| {
                let _ = writeln!(out, "{r}");
            }),
            Err(e) => {
                let _ = writeln!(out, "(failed: {e})");
            }
        }
    }
    let path = dir.join("diagnosis.txt");
    if let Err(e) = std::fs::write(&path, out) {
        tracing::warn!(error = %e, path = %path.display(), "cannot write the diagnosis");
    }
}

/// Every thread's stack of process `pid` (`gdb -batch`, at most 20 s), or why there is none.
async fn backtrace(pid: i32) -> String {
    let gdb = tokio::process::Command::new("gdb")
        .args([
            "-p",
            &pid.to_string(),
            "-batch",
            "-ex",
            "thread apply all bt 30",
        ])
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(std::time::Duration::from_secs(20), gdb).await {
        Ok(Ok(o)) => String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter(|l| l.starts_with('#') || l.starts_with("Thread"))
            .collect::<Vec<_>>()
            .join("\n"),
        Ok(Err(e)) => format!("(gdb: {e})"),
        Err(_) => "(gdb took longer than 20 s)".to_owned(),
    }
}

/// The rows of a one-text-column query (PostgreSQL only: the chaos runner's databases).
async fn texts(pool: &idem_sql::AnyPool, sql: &str) -> anyhow::Result<Vec<String>> {
    let idem_sql::AnyPool::Postgres(pool) = pool else {
        anyhow::bail!("the diagnosis reads PostgreSQL only");
    };
    Ok(sqlx::query_scalar::<_, String>(sql).fetch_all(pool).await?)
}

/// One process: its incarnation, pid, kernel state (`T` is stopped by a signal), whether the
/// runner thinks it is paused, and its last scraped counters.
fn process_line(p: &mut Proc) -> String {
    let running = p.running();
    let pid = p.pid();
    let state = pid
        .and_then(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
        .and_then(|s| {
            // pid (comm) STATE ...: the state follows the last ')'.
            s.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next().map(str::to_owned))
        })
        .unwrap_or_else(|| "-".to_owned());
    let counters = p
        .scraped
        .get(&p.incarnation)
        .map(|m| {
            m.iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default();
    format!(
        "{} incarnation={} pid={pid:?} running={running} state={state} paused={} {counters}",
        p.name,
        p.incarnation,
        p.paused_until.is_some()
    )
}
