//! Fault windows: conditions that last for seconds, unlike a kill.
//!
//! * **slow points API** — the points API is restarted with one key in [`SLOW_ONE_IN`] taking
//!   [`AWARD_DELAY`] per award, longer than the dispatcher's 2 s timeout and than its key lock
//!   ([`KEY_LOCK`]): the dispatcher's retries arrive while the first execution still runs, and
//!   only the layer's lock renewal keeps them from executing beside it. An award outlasts the
//!   timeout by 8 s and the dispatcher runs 64 requests at once, so a retry lands while the
//!   first execution still runs. (Measured: with every key slow, or 8 requests at once, the
//!   claims held by slow awards let retries queue behind the backlog until the first execution
//!   had ended, and the negative control missed.) Overlapping executions
//!   of one key are counted by the API in `points_lab_overlaps` and must stay 0.
//! * **long lock** — the runner holds `LOCK TABLE settlements IN ACCESS EXCLUSIVE MODE` for
//!   [`LOCK_HOLD`]; the settlement consumers run with a 50 ms `lock_timeout`, so every handler
//!   call fails transiently until it is released. Nothing may be dead-lettered for it.
//!
//! The first window of each kind is due at a fixed time, so every run of 30 s or more has one
//! (the negative controls `key-lock-renewal` and `transient-dead-letters` need them). The long
//! lock opens only once every process but the writers runs unpaused, no settlement consumer
//! carries a crash point yet to fire, and the settlement handlers are seen applying events (a
//! restarted broker runs as a process seconds before it serves). Other faults wait while it is
//! due (for at most [`QUIESCE`]) and while it is held: events must reach the handlers during
//! it, or the negative control has nothing to dead-letter (a broker kill or a paused consumer
//! during the window leaves the handlers idle). Whether they did is measured, not
//! assumed: the settlement consumers' `idem_consumer_retry_total`, scraped as the lock is taken
//! and after it is released, must have risen past the negative control's budget (one event
//! failing [`LOCK_FAILURES_WANTED`] times), and no settlement consumer may have restarted
//! during it (a crash point the retries reached ends the process that counted an event's
//! failures). A window that failed either (the handlers had no event to fail on, as right
//! after a broker kill, or one aborted: the negative control missed so) is counted as
//! `long_lock_idle`, written to `faults.log` with what the consumers did meanwhile, and the
//! lock is taken again as soon as a window fits before the faults end.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::procs::{Proc, Role};
use idem_sql::AnyPool;

/// How long a slow award takes in a slow window.
pub(super) const AWARD_DELAY: &str = "10s";
/// One key in this many is slow: the API keeps up with the rest, so a slow award's retries
/// come within a second or two of the dispatcher's timeout instead of queueing behind a
/// backlog of slow awards (which made the negative control miss: retries after the first
/// execution ended found its stored response).
pub(super) const SLOW_ONE_IN: &str = "8";
/// The points API's key lock in a slow window (renewed every third of it).
pub(super) const KEY_LOCK: &str = "2s";
/// How long a slow window lasts.
const SLOW_FOR: Duration = Duration::from_secs(15);
/// How long the settlements table stays locked: under the consumers' 10 s
/// `max.poll.interval.ms`, so a stalled member keeps its partitions.
const LOCK_HOLD: Duration = Duration::from_secs(5);
/// The settlement consumers' `--lock-timeout`.
pub(super) const LOCK_TIMEOUT: &str = "50ms";
/// Transient handler failures a long lock must cause to have tested anything: one event
/// failing past the `transient-dead-letters` negative control's budget.
pub(super) const LOCK_FAILURES_WANTED: f64 = (idem_core::crash::BROKEN_TRANSIENT_BUDGET + 1) as f64;
/// How long a due long lock holds other faults back while it waits for the pipeline.
const QUIESCE: Duration = Duration::from_secs(20);
/// When the first long lock is due, after the start.
const FIRST_LOCK: Duration = Duration::from_secs(12);
/// How far apart the samples are that tell events reach the settlement handlers.
const FLOW_SAMPLE: Duration = Duration::from_millis(500);
/// The settlement consumers' counters a long lock is judged by.
const RETRIES: &str = "idem_consumer_retry_total";
const PROCESSED: &str = "idem_consumer_processed_total";

pub(super) struct Windows {
    next_slow: Instant,
    slow_until: Option<Instant>,
    next_lock: Instant,
    lock: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    /// The settlement consumers' (retries, processed) when the lock was taken.
    lock_baseline: (f64, f64),
    /// Their incarnations then.
    lock_incarnations: Vec<u32>,
    /// The settlement consumers' applied events when last sampled for [`Windows::events_flow`].
    flow_sample: Option<(Instant, f64)>,
    /// The fault timeline (`faults.log`).
    timeline: PathBuf,
}

impl Windows {
    pub(super) fn new(started: Instant, timeline: PathBuf) -> Self {
        Windows {
            next_slow: started + Duration::from_secs(8),
            slow_until: None,
            next_lock: started + FIRST_LOCK,
            lock: None,
            lock_baseline: (0.0, 0.0),
            lock_incarnations: Vec::new(),
            flow_sample: None,
            timeline,
        }
    }

    /// Opens and closes windows that are due; `end` is when faults stop (no window outlives it).
    pub(super) async fn tick(
        &mut self,
        now: Instant,
        end: Instant,
        procs: &mut [Proc],
        settlement: &AnyPool,
        faults: &mut std::collections::BTreeMap<String, u64>,
    ) -> anyhow::Result<()> {
        if let Some(until) = self.slow_until
            && now >= until
        {
            self.close_slow(procs)?;
        }
        if self.slow_until.is_none() && now >= self.next_slow && now + SLOW_FOR < end {
            if let Some(api) = procs.iter_mut().find(|p| p.role == Role::Api) {
                api.kill9();
                api.start(&[
                    ("IDEM_LAB_AWARD_DELAY", AWARD_DELAY.to_owned()),
                    ("IDEM_POINTS_KEY_LOCK", KEY_LOCK.to_owned()),
                    ("IDEM_LAB_SLOW_ONE_IN", SLOW_ONE_IN.to_owned()),
                ])?;
                // Left alone while slow: a pause longer than the key lock would let a retry
                // take over a live execution legitimately (the layer cannot renew while stopped).
                api.armed_until = Some(now + SLOW_FOR);
                self.slow_until = Some(now + SLOW_FOR);
                *faults.entry("slow_points_api".to_owned()).or_default() += 1;
            }
            self.next_slow = now + Duration::from_secs(40);
        }
        if let Some(task) = &self.lock
            && task.is_finished()
            && let Some(task) = self.lock.take()
        {
            task.await??;
            self.lock_released(now, procs, faults);
        }
        if self.lock.is_none()
            && now >= self.next_lock
            && now + LOCK_HOLD < end
            && pipeline_up(procs)
            && self.events_flow(now, procs)
        {
            let AnyPool::Postgres(pool) = settlement.clone() else {
                anyhow::bail!("the long-lock window needs the PostgreSQL settlement database");
            };
            self.lock_baseline = settlement_counters(procs);
            self.lock_incarnations = settlement_incarnations(procs);
            let paused = paused_writers(procs);
            self.lock = Some(tokio::spawn(hold_lock(pool, LOCK_HOLD)));
            *faults.entry("long_lock".to_owned()).or_default() += 1;
            self.next_lock = now + Duration::from_secs(30);
            let what = format!("long_lock taken for {LOCK_HOLD:?}; writers paused: {paused:?}");
            super::inject::append_timeline(&self.timeline, &what);
        }
        Ok(())
    }

    /// The lock was released: did the settlement handlers fail on it? If not, it is taken
    /// again as soon as a window fits.
    fn lock_released(
        &mut self,
        now: Instant,
        procs: &mut [Proc],
        faults: &mut std::collections::BTreeMap<String, u64>,
    ) {
        let (retries, processed) = settlement_counters(procs);
        let failed = retries - self.lock_baseline.0;
        let applied = processed - self.lock_baseline.1;
        let restarted = settlement_incarnations(procs) != self.lock_incarnations;
        let idle = failed < LOCK_FAILURES_WANTED || restarted;
        if idle {
            *faults.entry("long_lock_idle".to_owned()).or_default() += 1;
            self.next_lock = now;
        }
        let what = format!(
            "long_lock released{}: settlement handler failures +{failed}, events applied \
             +{applied}, a settlement consumer restarted in it: {restarted}",
            if idle { " IDLE (taken again)" } else { "" }
        );
        super::inject::append_timeline(&self.timeline, &what);
    }

    /// Whether the settlement handlers are applying events now: their applied count rose
    /// between two samples [`FLOW_SAMPLE`] apart, the later one just taken. A broker that was
    /// restarted runs as a process seconds before it serves (a JVM starting, the group
    /// rejoining), and a lock taken then finds the handlers idle.
    fn events_flow(&mut self, now: Instant, procs: &mut [Proc]) -> bool {
        if let Some((at, _)) = self.flow_sample
            && now < at + FLOW_SAMPLE
        {
            return false;
        }
        let (_, applied) = settlement_counters(procs);
        let before = self.flow_sample.replace((now, applied));
        before.is_some_and(|(at, was)| now < at + 2 * FLOW_SAMPLE && applied > was)
    }

    /// Whether the long lock is held: no other fault is injected meanwhile, so that events keep
    /// reaching the settlement handlers and fail on the lock for the whole window (a broker
    /// killed or a consumer paused during it would leave the `transient-dead-letters` negative
    /// control nothing to dead-letter, and the run would miss it).
    pub(super) fn lock_open(&self) -> bool {
        self.lock.is_some()
    }

    /// Whether other faults wait: while the long lock is held, and for up to [`QUIESCE`] after
    /// it is due (it opens once the pipeline is up and events flow, which faults injected
    /// meanwhile would keep putting off: under the schedule's pace some process is always
    /// paused, killed or armed). Past that, faults resume and the lock opens when it can.
    pub(super) fn holds_faults(&self, now: Instant, end: Instant) -> bool {
        self.lock_open()
            || (now >= self.next_lock && now < self.next_lock + QUIESCE && now + LOCK_HOLD < end)
    }

    /// Ends every open window (the API back to normal speed, the lock released).
    pub(super) async fn close(&mut self, procs: &mut [Proc]) -> anyhow::Result<()> {
        if self.slow_until.is_some() {
            self.close_slow(procs)?;
        }
        if let Some(task) = self.lock.take() {
            task.await??;
        }
        Ok(())
    }

    fn close_slow(&mut self, procs: &mut [Proc]) -> anyhow::Result<()> {
        if let Some(api) = procs.iter_mut().find(|p| p.role == Role::Api) {
            // Slow awards in flight die unstored (as in any SIGKILL); their keys' locks lapse and
            // the next attempt executes them.
            api.kill9();
            api.armed_until = None;
            api.start(&[])?;
        }
        self.slow_until = None;
        Ok(())
    }
}

/// Every process but the writers runs and is not paused, and no settlement consumer carries a
/// crash point that has yet to fire (its handlers' retries on the lock would reach it, and the
/// restart would end the count of an event's failures). The long-lock window waits for that
/// before it opens.
fn pipeline_up(procs: &mut [Proc]) -> bool {
    procs
        .iter_mut()
        .filter(|p| p.role != Role::Writer)
        .all(|p| {
            p.running()
                && p.paused_until.is_none()
                && !(p.role == Role::Settlement && p.crash_point_pending)
        })
}

/// The settlement consumers' incarnations: one that changed during a window was restarted
/// in it (a crash point the handlers' retries reached), and the failures it counted for an
/// event died with it.
fn settlement_incarnations(procs: &[Proc]) -> Vec<u32> {
    procs
        .iter()
        .filter(|p| p.role == Role::Settlement)
        .map(|p| p.incarnation)
        .collect()
}

/// The settlement consumers' retries and applied events, summed over their incarnations,
/// scraped now.
fn settlement_counters(procs: &mut [Proc]) -> (f64, f64) {
    let mut sum = (0.0, 0.0);
    for p in procs.iter_mut().filter(|p| p.role == Role::Settlement) {
        p.scrape(&super::inject::COUNTERS);
        sum.0 += p.total(RETRIES);
        sum.1 += p.total(PROCESSED);
    }
    sum
}

fn paused_writers(procs: &mut [Proc]) -> Vec<String> {
    procs
        .iter_mut()
        .filter(|p| p.role == Role::Writer)
        .filter_map(|p| (p.paused_until.is_some() || !p.running()).then(|| p.name.clone()))
        .collect()
}

async fn hold_lock(pool: sqlx::PgPool, hold: Duration) -> anyhow::Result<()> {
    let mut tx = pool.begin().await?;
    sqlx::query("LOCK TABLE settlements IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *tx)
        .await?;
    // The window itself: the lock is the fault, held for this long.
    tokio::time::sleep(hold).await;
    tx.rollback().await?;
    Ok(())
}

/// Executions of one Idempotency-Key that overlapped in the points API (slow windows only).
pub(super) async fn overlapping_executions(points: &AnyPool) -> anyhow::Result<i64> {
    Ok(points
        .scalar("SELECT count(*) FROM points_lab_overlaps")
        .await?)
}
