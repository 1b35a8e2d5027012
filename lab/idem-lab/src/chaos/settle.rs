//! Settling, after the faults stop: resume the paused, restart the dead, stop the writers, and
//! wait until the pipeline is clean or nothing moves any more (a broken mechanism never
//! converges), up to the deadline. The settle condition is the pure [`Settler`].

use std::time::{Duration, Instant};

use super::hostile;
use super::procs::{Proc, Role};
use super::topic;
use super::windows::Windows;
use crate::demo::world::Databases;

/// Checks in a row without movement before the pipeline counts as quiet.
const QUIET_CHECKS: u32 = 5;

/// What moves while the pipeline settles: when none of it changes, nothing will.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Progress {
    /// Missing effects (quick verification).
    pub lost: u64,
    /// Duplicate effects (quick verification).
    pub duplicate_effects: u64,
    /// Outbox rows not yet published.
    pub unpublished: i64,
    /// Effect intents not yet dispatched.
    pub pending_effects: i64,
    /// Events the settlement and audit groups applied.
    pub applied: i64,
    /// Hostile rows not yet contained.
    pub hostile_open: usize,
}

/// What one settle check found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SettleStep {
    /// Still moving (or not quiet long enough): check again.
    Moving,
    /// Nothing moved for [`QUIET_CHECKS`] checks and nothing is pending: settled, unless some
    /// missing effect still waits in the topic for its group ([`Settler::waiting`] decides).
    Quiet,
    /// Settled.
    Settled,
}

/// The settle condition: clean, or quiet with nothing waiting.
#[derive(Debug, Default)]
pub(super) struct Settler {
    last: Option<Progress>,
    stable: u32,
}

impl Settler {
    /// A clean verification with every hostile row contained has settled.
    pub(super) fn clean(verify_clean: bool, hostile_open: usize) -> bool {
        verify_clean && hostile_open == 0
    }

    /// One check of a pipeline that is not clean yet.
    pub(super) fn observe(&mut self, p: Progress) -> SettleStep {
        if self.last == Some(p) {
            self.stable += 1;
        } else {
            self.stable = 0;
        }
        self.last = Some(p);
        if self.stable >= QUIET_CHECKS && p.unpublished == 0 && p.pending_effects == 0 {
            SettleStep::Quiet
        } else {
            SettleStep::Moving
        }
    }

    /// After [`SettleStep::Quiet`]: `waiting` missing effects whose events are still in the
    /// topic for a group that has not consumed them, or `None` when the broker cannot tell (it
    /// is down or restarting). A consumer coming back from a broker fault (reconnect backoff,
    /// session and poll timeouts of 10 s each) can take longer than the quiet checks, and a
    /// broker that does not answer may still hold unconsumed events: either way, wait on, up to
    /// the deadline.
    pub(super) fn waiting(&mut self, waiting: Option<u64>) -> SettleStep {
        if waiting == Some(0) {
            SettleStep::Settled
        } else {
            self.stable = 0;
            SettleStep::Moving
        }
    }
}

/// Stops injecting: closes the windows, resumes the paused, stops the writers, restarts the
/// dead.
pub(super) async fn stop_faults(windows: &mut Windows, procs: &mut [Proc]) -> anyhow::Result<()> {
    eprintln!("idem chaos: faults stopped; waiting for the pipeline to settle");
    windows.close(procs).await?;
    for p in procs.iter_mut() {
        if p.paused_until.take().is_some() {
            p.signal(18);
        }
    }
    for p in procs.iter_mut().filter(|p| p.role == Role::Writer) {
        p.stop(Duration::from_secs(10));
    }
    restart_dead(procs)
}

/// Starts every process but the writers that is not running.
fn restart_dead(procs: &mut [Proc]) -> anyhow::Result<()> {
    for p in procs.iter_mut().filter(|p| p.role != Role::Writer) {
        if !p.running() {
            p.start(&[])?;
        }
    }
    Ok(())
}

/// The run's pipeline, as the settle phase sees it.
pub(super) struct Pipeline<'a> {
    /// The databases.
    pub dbs: &'a Databases,
    /// The brokers' bootstrap address and security.
    pub kafka: &'a idem_kafka::Connection,
    /// The run's topic.
    pub topic: &'a str,
    /// The checks of the run.
    pub config: &'a idem_verify::VerifyConfig,
    /// The hostile rows stored during the run.
    pub hostile: &'a [hostile::Accepted],
    /// The metrics scraped from the processes.
    pub counters: &'a [&'a str],
}

/// How settling ended.
pub(super) struct Settled {
    /// It settled before the deadline.
    pub live: bool,
    /// How long it took (or the deadline).
    pub seconds: f64,
    /// The last quick verification.
    pub verify: idem_verify::Report,
}

/// Waits until the pipeline settles, up to `deadline`.
pub(super) async fn settle(
    pipe: &Pipeline<'_>,
    procs: &mut [Proc],
    deadline: Duration,
) -> anyhow::Result<Settled> {
    let started = Instant::now();
    // Progress checks skip the localisation (it costs point queries per missing key); the
    // final verification locates.
    let quick = idem_verify::Options { locate_limit: 0 };
    let mut settler = Settler::default();
    let mut live = false;
    let mut verify = idem_verify::verify(pipe.config, &quick).await?;
    while started.elapsed() < deadline {
        for p in procs.iter_mut().filter(|p| p.role != Role::Writer) {
            if !p.running() {
                p.start(&[])?;
            }
            p.scrape(pipe.counters);
        }
        verify = idem_verify::verify(pipe.config, &quick).await?;
        if check(pipe, &verify, &mut settler).await? == SettleStep::Settled {
            live = true;
            break;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    Ok(Settled {
        live,
        seconds: started.elapsed().as_secs_f64(),
        verify,
    })
}

/// One settle check after a quick verification.
async fn check(
    pipe: &Pipeline<'_>,
    verify: &idem_verify::Report,
    settler: &mut Settler,
) -> anyhow::Result<SettleStep> {
    let groups = hostile::reference_groups();
    let hostile_open = hostile::fates(
        &pipe.dbs.orders,
        &pipe.dbs.settlement,
        &groups,
        pipe.hostile,
    )
    .await?
    .iter()
    .filter(|(_, f)| hostile::contained(f, &groups).is_err())
    .count();
    if Settler::clean(verify.clean, hostile_open) {
        return Ok(SettleStep::Settled);
    }
    let progress = Progress {
        lost: verify.lost(),
        duplicate_effects: verify.duplicate_effects(),
        unpublished: pipe
            .dbs
            .orders
            .scalar("SELECT count(*) FROM idem_outbox WHERE status = 'pending'")
            .await?,
        pending_effects: pipe
            .dbs
            .settlement
            .scalar("SELECT count(*) FROM idem_effect_intents WHERE status = 'pending'")
            .await?,
        applied: pipe
            .dbs
            .settlement
            .scalar("SELECT (SELECT count(*) FROM settlement_applications) + (SELECT count(*) FROM audit_log)")
            .await?,
        hostile_open,
    };
    match settler.observe(progress) {
        SettleStep::Quiet => {
            let waiting = topic::waiting(pipe.kafka, pipe.topic, pipe.dbs).await?;
            Ok(settler.waiting(waiting))
        }
        step => Ok(step),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn progress(applied: i64) -> Progress {
        Progress {
            lost: 1,
            duplicate_effects: 0,
            unpublished: 0,
            pending_effects: 0,
            applied,
            hostile_open: 0,
        }
    }

    #[test]
    fn clean_is_settled_only_with_every_hostile_row_contained() {
        assert!(Settler::clean(true, 0));
        assert!(!Settler::clean(true, 1));
        assert!(!Settler::clean(false, 0));
    }

    #[test]
    fn five_checks_without_movement_are_quiet() {
        let mut s = Settler::default();
        // The first sighting, then five unchanged ones.
        for _ in 0..QUIET_CHECKS {
            assert_eq!(s.observe(progress(7)), SettleStep::Moving);
        }
        assert_eq!(s.observe(progress(7)), SettleStep::Quiet);
        assert_eq!(s.waiting(Some(0)), SettleStep::Settled);
    }

    #[test]
    fn movement_or_pending_work_is_never_quiet() {
        let mut s = Settler::default();
        for i in 0..20 {
            assert_eq!(s.observe(progress(i)), SettleStep::Moving);
        }
        let pending = Progress {
            unpublished: 3,
            ..progress(0)
        };
        for _ in 0..20 {
            assert_eq!(s.observe(pending), SettleStep::Moving);
        }
    }

    #[test]
    fn effects_waiting_in_the_topic_restart_the_quiet_count() {
        let mut s = Settler::default();
        for _ in 0..=QUIET_CHECKS {
            s.observe(progress(7));
        }
        assert_eq!(s.waiting(Some(2)), SettleStep::Moving);
        for _ in 0..QUIET_CHECKS - 1 {
            assert_eq!(s.observe(progress(7)), SettleStep::Moving);
        }
        assert_eq!(s.observe(progress(7)), SettleStep::Quiet);
    }

    #[test]
    fn a_broker_that_cannot_tell_what_waits_is_never_settled() {
        let mut s = Settler::default();
        for _ in 0..=QUIET_CHECKS {
            s.observe(progress(7));
        }
        assert_eq!(s.waiting(None), SettleStep::Moving);
        for _ in 0..QUIET_CHECKS - 1 {
            assert_eq!(s.observe(progress(7)), SettleStep::Moving);
        }
        assert_eq!(s.observe(progress(7)), SettleStep::Quiet);
        assert_eq!(s.waiting(Some(0)), SettleStep::Settled);
    }
}
