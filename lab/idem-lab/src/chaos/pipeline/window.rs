//! Components' windows (`[[component.window]]`): whiles in which a component's replicas run
//! with more environment. When one opens, every replica is SIGKILLed and started with the
//! window's environment, and is left alone by the other faults — signals, crash points, its
//! own network links and crashes of the runner's PostgreSQL server when it uses a database
//! there — until it closes: a pause or a partition longer than what the window
//! makes slow would turn the window's condition into another one (a key lock that cannot be
//! renewed while the process is stopped or cut from its store lets a retry in legitimately).
//! When it closes, the replicas are SIGKILLed and started as before.

use std::time::{Duration, Instant};

use super::file::{PeriodSection, PipelineFile, Window};
use crate::chaos::procs::Proc;

/// When a recurring while opens and closes: at `first` after the start, then every `every`,
/// for `lasts`, never past the end of the faults.
#[derive(Debug)]
pub(super) struct Period {
    every: Duration,
    lasts: Duration,
    quiet: bool,
    next: Instant,
    open_until: Option<Instant>,
}

impl Period {
    pub(super) fn new(start: Instant, first: Duration, every: Duration, lasts: Duration) -> Self {
        Period {
            every,
            lasts,
            quiet: false,
            next: start + first,
            open_until: None,
        }
    }

    /// The period a file's section describes.
    pub(super) fn of(start: Instant, p: PeriodSection) -> Self {
        Period::new(start, p.first, p.every, p.lasts).quiet(p.quiet)
    }

    /// The same, holding every other fault while open.
    pub(super) fn quiet(mut self, quiet: bool) -> Self {
        self.quiet = quiet;
        self
    }

    /// Is it due and does it fit before `end`, not open yet?
    fn due(&self, now: Instant, end: Instant) -> bool {
        self.open_until.is_none() && now >= self.next && now + self.lasts < end
    }

    /// Opens it when it is due, fits before `end` and `may` (a quiet one once the run is calm,
    /// another while no quiet one holds the faults): until when it is open.
    pub(super) fn opens(&mut self, now: Instant, end: Instant, may: bool) -> Option<Instant> {
        if !self.due(now, end) || !may {
            return None;
        }
        self.next = now + self.every;
        self.open_until = Some(now + self.lasts);
        self.open_until
    }

    /// Closes it when it is open and over (`now` past its end), or with `now` `None`, at once:
    /// whether it closed.
    pub(super) fn closes(&mut self, now: Option<Instant>) -> bool {
        let over = match (self.open_until, now) {
            (Some(until), Some(now)) => now >= until,
            (Some(_), None) => true,
            (None, _) => false,
        };
        if over {
            self.open_until = None;
        }
        over
    }

    /// Does it hold every other fault while it waits and while it is open?
    pub(super) fn is_quiet(&self) -> bool {
        self.quiet
    }

    /// Is it open now?
    pub(super) fn is_open(&self, now: Instant) -> bool {
        self.open_until.is_some_and(|until| now < until)
    }

    /// Does it hold every other fault of the run now: a quiet one while it is open, and while
    /// it is due and waits for the run to calm down?
    pub(super) fn holds_all(&self, now: Instant, end: Instant) -> bool {
        self.quiet && (self.is_open(now) || self.due(now, end))
    }
}

/// How long every process must have run, unpaused and with no crash point armed, with no fault
/// injected, before a quiet window opens: a restarted broker serves seconds after its process
/// starts, and consumers rejoin their group after that.
pub(super) const CALM_FOR: Duration = Duration::from_secs(8);

/// Since when the run has been calm: every process up and no new fault counted.
#[derive(Debug, Default)]
pub(super) struct Calm {
    since: Option<Instant>,
    faults: u64,
}

impl Calm {
    /// Notes the run at `now` (`all_up`: every process runs unpaused with nothing armed;
    /// `faults`: the faults counted so far): whether it has been calm for [`CALM_FOR`].
    pub(super) fn observe(&mut self, now: Instant, all_up: bool, faults: u64) -> bool {
        let fault = faults != self.faults;
        self.faults = faults;
        self.since = match (all_up, fault) {
            (false, _) => None,
            (true, true) => Some(now),
            (true, false) => self.since.or(Some(now)),
        };
        self.since.is_some_and(|t| now >= t + CALM_FOR)
    }
}

/// A window of one component, and when it next opens or closes.
pub(super) struct Timed {
    component: String,
    window: Window,
    period: Period,
    /// Does the component use a database on the runner's own server?
    uses_server: bool,
}

/// What a tick did, for the counts and the timeline.
#[derive(Debug, PartialEq)]
pub(super) enum Moved {
    Opened {
        key: String,
        what: String,
        until: Instant,
    },
    Closed {
        what: String,
    },
}

/// Every window of `file`'s components, the first of each due `first` after `start`.
pub(super) fn all(file: &PipelineFile, start: Instant) -> Vec<Timed> {
    file.components
        .iter()
        .flat_map(|c| {
            let uses_server = file.started().any(|(db, _)| c.uses(&format!("db.{db}")));
            c.windows.iter().map(move |w| Timed {
                component: c.name.clone(),
                window: w.clone(),
                period: Period::of(start, w.period),
                uses_server,
            })
        })
        .collect()
}

/// Is process `name` a replica of `component` (`COMPONENT-N`)?
pub(super) fn is_replica(name: &str, component: &str) -> bool {
    name.strip_prefix(component)
        .and_then(|rest| rest.strip_prefix('-'))
        .is_some_and(|replica| replica.parse::<usize>().is_ok())
}

impl Timed {
    /// Is process `name` one of this window's component's replicas?
    pub(super) fn covers(&self, name: &str) -> bool {
        is_replica(name, &self.component)
    }

    /// When it opens and closes.
    pub(super) fn period(&self) -> &Period {
        &self.period
    }

    /// Does its component use a database on the runner's own server (which then does not
    /// crash while the window is open)?
    pub(super) fn uses_server(&self) -> bool {
        self.uses_server
    }

    /// Opens the window when it is due, fits before `end` and may open, closes it when it is
    /// over.
    pub(super) fn tick(
        &mut self,
        (now, end, may_open): (Instant, Instant, bool),
        procs: &mut [Proc],
    ) -> anyhow::Result<Option<Moved>> {
        if self.period.closes(Some(now)) {
            self.restart(procs, &[], None)?;
            let what = format!("window_{} of {} closed", self.window.name, self.component);
            return Ok(Some(Moved::Closed { what }));
        }
        let Some(until) = self.period.opens(now, end, may_open) else {
            return Ok(None);
        };
        let env: Vec<(&str, String)> = (self.window.env.iter())
            .map(|(k, v)| (k.as_str(), v.clone()))
            .collect();
        self.restart(procs, &env, Some(until))?;
        Ok(Some(Moved::Opened {
            key: format!("window_{}", self.window.name),
            what: format!(
                "window_{} of {} for {:.1} s: {:?}",
                self.window.name,
                self.component,
                self.window.period.lasts.as_secs_f64(),
                self.window.env
            ),
            until,
        }))
    }

    /// Closes the window if it is open (the faults are over).
    pub(super) fn close(&mut self, procs: &mut [Proc]) -> anyhow::Result<()> {
        if self.period.closes(None) {
            self.restart(procs, &[], None)?;
        }
        Ok(())
    }

    fn restart(
        &self,
        procs: &mut [Proc],
        env: &[(&str, String)],
        until: Option<Instant>,
    ) -> anyhow::Result<()> {
        for p in procs.iter_mut().filter(|p| self.covers(&p.name)) {
            if p.paused_until.take().is_some() {
                p.signal(18);
            }
            p.kill9();
            p.start(env)?;
            p.armed_until = until;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quiet_period_holds_every_fault_while_it_waits_and_while_it_is_open() {
        let start = Instant::now();
        let s = Duration::from_secs;
        let mut p = Period::new(start, s(8), s(40), s(15)).quiet(true);
        let end = start + s(120);
        assert_eq!(p.opens(start + s(7), end, true), None);
        assert!(!p.holds_all(start + s(7), end));
        assert_eq!(p.opens(start + s(8), end, false), None, "it waits for calm");
        assert!(
            p.holds_all(start + s(8), end),
            "and holds the faults meanwhile"
        );
        assert_eq!(p.opens(start + s(9), end, true), Some(start + s(24)));
        assert!(p.holds_all(start + s(23), end) && !p.holds_all(start + s(24), end));
        assert!(!p.closes(Some(start + s(23))) && p.closes(Some(start + s(24))));
        assert_eq!(p.opens(start + s(48), end, true), None);
        assert_eq!(p.opens(start + s(49), end, true), Some(start + s(64)));
        assert!(p.closes(None) && !p.holds_all(start + s(50), end));
        let late = p.opens(start + s(110), end, true);
        assert_eq!(late, None, "it would outlast the faults");
        assert!(!p.holds_all(start + s(110), end));
        let mut loud = Period::new(start, s(8), s(40), s(15));
        assert!(
            !loud.holds_all(start + s(8), end),
            "one that is not quiet holds nothing"
        );
        assert_eq!(
            loud.opens(start + s(8), end, false),
            None,
            "and may be held"
        );
        assert!(loud.opens(start + s(9), end, true).is_some());
        assert!(!loud.holds_all(start + s(10), end));
    }

    #[test]
    fn the_run_is_calm_after_8_s_up_with_no_new_fault() {
        let start = Instant::now();
        let s = Duration::from_secs;
        let mut calm = Calm::default();
        assert!(!calm.observe(start, true, 0));
        assert!(!calm.observe(start + s(7), true, 0));
        assert!(calm.observe(start + s(8), true, 0));
        assert!(
            !calm.observe(start + s(9), true, 1),
            "a fault starts it again"
        );
        assert!(!calm.observe(start + s(16), true, 1));
        assert!(calm.observe(start + s(17), true, 1));
        let down = calm.observe(start + s(18), false, 1);
        assert!(!down, "a process down starts it again");
        assert!(!calm.observe(start + s(25), true, 1));
        assert!(calm.observe(start + s(33), true, 1));
    }

    fn timed(component: &str) -> Timed {
        Timed {
            component: component.to_owned(),
            window: Window {
                name: "slow".into(),
                env: [("DELAY".to_owned(), "10s".to_owned())].into(),
                period: PeriodSection {
                    first: Duration::from_secs(8),
                    every: Duration::from_secs(40),
                    lasts: Duration::from_secs(15),
                    quiet: false,
                },
            },
            period: Period::new(
                Instant::now(),
                Duration::ZERO,
                Duration::from_secs(40),
                Duration::from_secs(15),
            ),
            uses_server: false,
        }
    }

    #[test]
    fn a_window_covers_its_components_replicas_only() {
        let w = timed("points-api");
        assert!(w.covers("points-api-0") && w.covers("points-api-12"));
        assert!(!w.covers("points-api") && !w.covers("points-api-x"));
        assert!(!w.covers("points-api-2-0"));
        assert!(!timed("points").covers("points-api-0"));
    }

    #[test]
    fn a_window_that_would_outlast_the_faults_does_not_open() {
        let mut w = timed("api");
        let now = Instant::now();
        let end = now + Duration::from_secs(10);
        assert_eq!(w.tick((now, end, true), &mut []).unwrap(), None);
        let later_end = now + Duration::from_secs(60);
        let until = now + Duration::from_secs(15);
        match w.tick((now, later_end, true), &mut []).unwrap() {
            Some(Moved::Opened { key, until: u, .. }) => {
                assert_eq!((key.as_str(), u), ("window_slow", until))
            }
            other => panic!("not opened: {other:?}"),
        }
        let before = until - Duration::from_secs(1);
        assert_eq!(w.tick((before, later_end, true), &mut []).unwrap(), None);
        let closed = w.tick((until, later_end, true), &mut []).unwrap();
        assert!(matches!(closed, Some(Moved::Closed { .. })));
        assert_eq!(w.period.next, now + Duration::from_secs(40));
    }
}
