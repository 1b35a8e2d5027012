//! Tables locked for a while (`[[lock]]`): the runner holds `LOCK TABLE … IN ACCESS EXCLUSIVE
//! MODE` in a transaction of its own, as a migration or an operator's maintenance does, then
//! rolls it back. Every statement on the table waits meanwhile, or fails at its own
//! `lock_timeout`: a handler that writes to it fails transiently until the lock is gone, and
//! must not give up on an event for that.
//!
//! With `rows = true` the runner locks the table's rows instead (`SELECT … FOR UPDATE`):
//! inserts go on, updates and deletes of the rows wait. With `end_waiters = true` it then ends
//! the sessions waiting on its lock before releasing it, as an operator ending blocked
//! sessions does: on the outbox, a relay's mark of what it published fails, the rows are
//! published again once its lease runs out, and the inboxes absorb the copies.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context;

use super::file::Lock;
use super::window::Period;

/// One `[[lock]]` of a run.
pub(super) struct Timed {
    lock: Lock,
    pool: sqlx::PgPool,
    period: Period,
    held: Option<tokio::task::JoinHandle<anyhow::Result<u64>>>,
}

/// What a tick did, for the counts and the timeline.
pub(super) enum Moved {
    Taken {
        key: String,
        what: String,
        until: Instant,
    },
    Released {
        what: String,
        /// What to count: `lock_<name>_waiters_ended` and the sessions it ended
        /// (`end_waiters`), or `lock_<name>_lost` once when it ended before its time.
        count: Option<(String, u64)>,
    },
}

/// Connects to the database of every lock of `locks` (`databases`: URLs by name, reached
/// directly); the first of each is due `first` after `start`.
pub(super) async fn all(
    locks: &[Lock],
    databases: &BTreeMap<String, String>,
    start: Instant,
) -> anyhow::Result<Vec<Timed>> {
    let mut out = vec![];
    for l in locks {
        let url = databases
            .get(&l.database)
            .with_context(|| format!("lock {}: database {} has no URL", l.name, l.database))?;
        let pool = super::postgres::runner_pool(url, 1)
            .await
            .with_context(|| format!("lock {}: connecting to database {}", l.name, l.database))?;
        out.push(Timed {
            period: Period::of(start, l.period),
            lock: l.clone(),
            pool,
            held: None,
        });
    }
    Ok(out)
}

impl Timed {
    /// When it is taken and released.
    pub(super) fn period(&self) -> &Period {
        &self.period
    }

    /// Takes the lock when it is due, fits before `end` and `may` be taken; notes its release.
    pub(super) async fn tick(
        &mut self,
        (now, end, may): (Instant, Instant, bool),
    ) -> Option<Moved> {
        if let Some(task) = &self.held
            && task.is_finished()
            && let Some(task) = self.held.take()
        {
            self.period.closes(None);
            let name = &self.lock.name;
            let lost = (format!("lock_{name}_lost"), 1);
            let (how, count) = match task.await {
                Ok(Ok(n)) if self.lock.end_waiters => {
                    let key = format!("lock_{name}_waiters_ended");
                    (
                        format!("released, {n} waiting sessions ended"),
                        Some((key, n)),
                    )
                }
                Ok(Ok(_)) => ("released".to_owned(), None),
                Ok(Err(e)) => (format!("lost before its time: {e:#}"), Some(lost)),
                Err(e) => (format!("lost before its time: {e}"), Some(lost)),
            };
            let what = format!("lock_{name} of {} {how}", self.what());
            return Some(Moved::Released { what, count });
        }
        let until = self.period.opens(now, end, may)?;
        let held = Held {
            sql: lock_sql(&self.lock),
            lasts: self.lock.period.lasts,
            end_waiters: self.lock.end_waiters,
        };
        self.held = Some(tokio::spawn(hold(self.pool.clone(), held)));
        Some(Moved::Taken {
            key: format!("lock_{}", self.lock.name),
            what: format!(
                "lock_{} of {} for {:.1} s",
                self.lock.name,
                self.what(),
                self.lock.period.lasts.as_secs_f64()
            ),
            until,
        })
    }

    /// What it locks, for the timeline.
    fn what(&self) -> String {
        match self.lock.rows {
            true => format!("the rows of {}", self.lock.table),
            false => self.lock.table.clone(),
        }
    }

    /// Waits until the lock is released, if it is held (the faults are over).
    pub(super) async fn release(&mut self) {
        if let Some(task) = self.held.take() {
            let _ = task.await;
        }
        self.period.closes(None);
    }
}

/// The statement that takes `lock`. (The table name is checked when the file is read: a
/// plain identifier, or two.)
fn lock_sql(lock: &Lock) -> String {
    match lock.rows {
        true => format!(
            "SELECT count(*) FROM (SELECT 1 FROM {} FOR UPDATE) AS locked",
            lock.table
        ),
        false => format!("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE", lock.table),
    }
}

/// A lock to hold: the statement that takes it, for how long, and whether the sessions
/// waiting on it are ended before its release.
struct Held {
    sql: String,
    lasts: Duration,
    end_waiters: bool,
}

/// The sessions waiting on a lock this session holds, ended: how many. The runner's own
/// sessions (its foreign writer, its burst watch, its other locks) are spared: the fault is
/// the pipeline's.
const END_WAITERS: &str = "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) \
                           FROM pg_stat_activity \
                           WHERE pg_backend_pid() = ANY (pg_blocking_pids(pid)) \
                           AND application_name IS DISTINCT FROM $1";

/// Holds the lock for its time, ends its waiters when asked (how many), then rolls back.
async fn hold(pool: sqlx::PgPool, held: Held) -> anyhow::Result<u64> {
    let mut tx = pool.begin().await?;
    sqlx::query(&held.sql).execute(&mut *tx).await?;
    // The fault itself: the lock, held for this long.
    tokio::time::sleep(held.lasts).await;
    let mut ended = 0;
    if held.end_waiters {
        let n: i64 = sqlx::query_scalar(END_WAITERS)
            .bind(super::postgres::RUNNER)
            .fetch_one(&mut *tx)
            .await?;
        ended = u64::try_from(n).unwrap_or(0);
    }
    tx.rollback().await?;
    Ok(ended)
}
