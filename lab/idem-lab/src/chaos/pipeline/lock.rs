//! Tables locked for a while (`[[lock]]`): the runner holds `LOCK TABLE … IN ACCESS EXCLUSIVE
//! MODE` in a transaction of its own, as a migration or an operator's maintenance does, then
//! rolls it back. Every statement on the table waits meanwhile, or fails at its own
//! `lock_timeout`: a handler that writes to it fails transiently until the lock is gone, and
//! must not give up on an event for that.

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
    held: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
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
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .test_before_acquire(true)
            .connect(url)
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
            let how = match task.await {
                Ok(Ok(())) => "released".to_owned(),
                Ok(Err(e)) => format!("lost before its time: {e:#}"),
                Err(e) => format!("lost before its time: {e}"),
            };
            let what = format!("lock_{} of {} {how}", self.lock.name, self.lock.table);
            return Some(Moved::Released { what });
        }
        let until = self.period.opens(now, end, may)?;
        let sql = format!("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE", self.lock.table);
        let lasts = self.lock.period.lasts;
        self.held = Some(tokio::spawn(hold(self.pool.clone(), sql, lasts)));
        Some(Moved::Taken {
            key: format!("lock_{}", self.lock.name),
            what: format!(
                "lock_{} of {} for {:.1} s",
                self.lock.name,
                self.lock.table,
                self.lock.period.lasts.as_secs_f64()
            ),
            until,
        })
    }

    /// Waits until the lock is released, if it is held (the faults are over).
    pub(super) async fn release(&mut self) {
        if let Some(task) = self.held.take() {
            let _ = task.await;
        }
        self.period.closes(None);
    }
}

/// Holds the lock `sql` takes for `hold`, then rolls back. (The table name is checked when the
/// file is read: a plain identifier, or two.)
async fn hold(pool: sqlx::PgPool, sql: String, hold: Duration) -> anyhow::Result<()> {
    let mut tx = pool.begin().await?;
    sqlx::query(&sql).execute(&mut *tx).await?;
    // The fault itself: the lock, held for this long.
    tokio::time::sleep(hold).await;
    tx.rollback().await?;
    Ok(())
}
