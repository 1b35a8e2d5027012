//! Crash points in a pipeline run. A component that lists `crash_points` is, now and then,
//! SIGKILLed and restarted with one armed (`IDEM_CRASH_POINTS=point@hit`): the process aborts
//! at that point's `hit`th reach, and writes it to the run's crash log (`IDEM_CRASH_LOG`).
//! The choice is the reference schedule's: every other fault while some listed point never
//! fired (each is armed until it has), three in ten after that, and with `--break` the window
//! the broken mechanism opens every other time. The decisions are pure; `drive.rs` carries
//! them out.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use idem_core::crash::{CrashPoint, Mechanism};

use crate::chaos::procs::Rng;
use crate::chaos::schedule::{armed_key, choose_point, first_round, window_of};

/// The crash points of a run and the schedule's state between them.
pub(super) struct Arming {
    /// Every point some component lists, once each, in the file's order.
    points: Vec<CrashPoint>,
    /// The same points in a seeded order: each is armed early until it has fired once.
    first_round: Vec<CrashPoint>,
    /// The window a negative control's broken mechanism opens, when a component lists it.
    focus: Option<CrashPoint>,
    /// Faults drawn so far.
    tick: u64,
    /// Where armed processes write the points that fired.
    log: PathBuf,
}

impl Arming {
    /// The arming of a run whose components list `listed`, breaking `mechanism` if any, with
    /// the crash log at `log`.
    pub(super) fn new(
        listed: impl IntoIterator<Item = CrashPoint>,
        mechanism: Option<Mechanism>,
        log: &Path,
        rng: &mut Rng,
    ) -> Self {
        let mut points: Vec<CrashPoint> = vec![];
        for p in listed {
            if !points.contains(&p) {
                points.push(p);
            }
        }
        let focus = mechanism.and_then(window_of).filter(|f| points.contains(f));
        Arming {
            first_round: first_round(rng, &points),
            points,
            focus,
            tick: 0,
            log: log.to_path_buf(),
        }
    }

    /// Per listed point, how often it fired (from the crash log; none yet when it cannot be
    /// read).
    pub(super) fn fired(&self) -> BTreeMap<String, u64> {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        fired(&text, &self.points)
    }

    /// The point to arm with the next fault, if the next one arms a point: every other fault
    /// while a listed point never fired, then three in ten.
    pub(super) fn next(
        &mut self,
        faults: &BTreeMap<String, u64>,
        rng: &mut Rng,
    ) -> Option<CrashPoint> {
        if self.points.is_empty() {
            return None;
        }
        self.tick += 1;
        let fired = self.fired();
        let unfired: Vec<CrashPoint> = self
            .first_round
            .iter()
            .copied()
            .filter(|p| fired.get(p.as_str()).copied().unwrap_or(0) == 0)
            .collect();
        let roll = rng.below(100);
        if !((!unfired.is_empty() && self.tick % 2 == 1) || roll < 30) {
            return None;
        }
        Some(choose_point(
            self.focus,
            &unfired,
            faults,
            &self.points,
            rng,
        ))
    }
}

/// How a process is restarted to arm `point` at its `hit`th reach, and the name the report
/// counts it under.
pub(super) fn arm_env(point: CrashPoint, hit: u64) -> ((&'static str, String), String) {
    (
        ("IDEM_CRASH_POINTS", format!("{point}@{hit}")),
        armed_key(point),
    )
}

/// Per crash point, how often the crash log `text` (one fired point a line) says it fired.
fn fired(text: &str, points: &[CrashPoint]) -> BTreeMap<String, u64> {
    let mut out: BTreeMap<String, u64> = points.iter().map(|p| (p.to_string(), 0)).collect();
    for line in text.lines() {
        if let Some(n) = out.get_mut(line.trim()) {
            *n += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_crash_log_counts_every_point_and_ignores_other_lines() {
        let points = CrashPoint::POLLING_PIPELINE;
        let text = format!("{p}\n  {p}  \nnot a point\n", p = points[0]);
        let counts = fired(&text, points);
        assert_eq!(counts.len(), points.len());
        assert_eq!(counts[points[0].as_str()], 2);
        assert_eq!(counts.values().sum::<u64>(), 2);
    }

    fn arming(points: &[CrashPoint], mechanism: Option<Mechanism>) -> (Arming, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("crashes.log");
        let a = Arming::new(points.iter().copied(), mechanism, &log, &mut Rng::new(5));
        (a, dir)
    }

    #[test]
    fn a_run_without_listed_points_never_arms_one() {
        let (mut a, _dir) = arming(&[], Some(Mechanism::OffsetBeforeCommit));
        let mut rng = Rng::new(1);
        assert!((0..100).all(|_| a.next(&BTreeMap::new(), &mut rng).is_none()));
        assert_eq!(a.fired(), BTreeMap::new());
    }

    #[test]
    fn every_other_fault_arms_a_point_that_never_fired_and_only_listed_ones() {
        let listed = [
            CrashPoint::RelayAfterPublishBeforeMark,
            CrashPoint::EffectBeforeHttp,
        ];
        let (mut a, _dir) = arming(&listed, None);
        let mut rng = Rng::new(2);
        let drawn: Vec<Option<CrashPoint>> = (0..20)
            .map(|_| a.next(&BTreeMap::new(), &mut rng))
            .collect();
        for (i, d) in drawn.iter().enumerate() {
            if i % 2 == 0 {
                assert!(d.is_some(), "fault {i} armed nothing: {drawn:?}");
            }
            assert!(d.is_none_or(|p| listed.contains(&p)), "{drawn:?}");
        }
    }

    #[test]
    fn a_broken_mechanism_aims_at_its_window_once_every_point_fired() {
        let listed = [
            CrashPoint::ConsumerAfterDedupBeforeHandler,
            CrashPoint::EffectBeforeHttp,
        ];
        let (mut a, _dir) = arming(&listed, Some(Mechanism::OffsetBeforeCommit));
        let log: String = listed.iter().map(|p| format!("{p}\n")).collect();
        std::fs::write(&a.log, log).unwrap();
        assert_eq!(a.fired().values().sum::<u64>(), 2);
        let mut rng = Rng::new(3);
        let drawn: Vec<CrashPoint> = (0..200)
            .filter_map(|_| a.next(&BTreeMap::new(), &mut rng))
            .collect();
        assert!(!drawn.is_empty());
        assert!(
            drawn
                .iter()
                .all(|p| *p == CrashPoint::ConsumerAfterDedupBeforeHandler),
            "{drawn:?}"
        );
    }

    #[test]
    fn a_window_no_component_lists_is_no_focus() {
        let (a, _dir) = arming(
            &[CrashPoint::EffectBeforeHttp],
            Some(Mechanism::OffsetBeforeCommit),
        );
        assert_eq!(a.focus, None);
    }

    #[test]
    fn arming_restarts_with_the_point_and_its_hit() {
        let ((k, v), counted) = arm_env(CrashPoint::EffectBeforeHttp, 2);
        assert_eq!(
            (k, v.as_str()),
            ("IDEM_CRASH_POINTS", "effect.before_http@2")
        );
        assert_eq!(counted, "crash_point_armed:effect.before_http");
    }
}
