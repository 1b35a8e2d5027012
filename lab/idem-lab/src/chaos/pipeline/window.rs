//! Components' windows (`[[component.window]]`): whiles in which a component's replicas run
//! with more environment. When one opens, every replica is SIGKILLed and started with the
//! window's environment, and is left alone by the other faults — signals, crash points and
//! its own network links — until it closes: a pause or a partition longer than what the window
//! makes slow would turn the window's condition into another one (a key lock that cannot be
//! renewed while the process is stopped or cut from its store lets a retry in legitimately).
//! When it closes, the replicas are SIGKILLed and started as before.

use std::time::Instant;

use super::file::{PipelineFile, Window};
use crate::chaos::procs::Proc;

/// A window of one component, and when it next opens or closes.
pub(super) struct Timed {
    component: String,
    window: Window,
    next: Instant,
    open_until: Option<Instant>,
}

/// What a tick did, for the counts and the timeline.
#[derive(Debug, PartialEq)]
pub(super) enum Moved {
    Opened { key: String, what: String },
    Closed { what: String },
}

/// Every window of `file`'s components, the first of each due `first` after `start`.
pub(super) fn all(file: &PipelineFile, start: Instant) -> Vec<Timed> {
    file.components
        .iter()
        .flat_map(|c| {
            c.windows.iter().map(|w| Timed {
                component: c.name.clone(),
                window: w.clone(),
                next: start + w.first,
                open_until: None,
            })
        })
        .collect()
}

impl Timed {
    /// Is process `name` one of this window's component's replicas?
    pub(super) fn covers(&self, name: &str) -> bool {
        name.strip_prefix(&self.component)
            .and_then(|rest| rest.strip_prefix('-'))
            .is_some_and(|replica| replica.parse::<usize>().is_ok())
    }

    /// Does it hold every other fault of the run while it is open?
    pub(super) fn quiet(&self) -> bool {
        self.window.quiet
    }

    /// Until when the window holds other faults off its replicas, when it is open.
    pub(super) fn open_until(&self) -> Option<Instant> {
        self.open_until
    }

    /// Opens the window when it is due and fits before `end`, closes it when it is over.
    pub(super) fn tick(
        &mut self,
        now: Instant,
        end: Instant,
        procs: &mut [Proc],
    ) -> anyhow::Result<Option<Moved>> {
        if let Some(until) = self.open_until {
            if now < until {
                return Ok(None);
            }
            self.restart(procs, &[], None)?;
            self.open_until = None;
            let what = format!("window_{} of {} closed", self.window.name, self.component);
            return Ok(Some(Moved::Closed { what }));
        }
        if now < self.next || now + self.window.lasts >= end {
            return Ok(None);
        }
        let until = now + self.window.lasts;
        let env: Vec<(&str, String)> = (self.window.env.iter())
            .map(|(k, v)| (k.as_str(), v.clone()))
            .collect();
        self.restart(procs, &env, Some(until))?;
        self.open_until = Some(until);
        self.next = now + self.window.every;
        Ok(Some(Moved::Opened {
            key: format!("window_{}", self.window.name),
            what: format!(
                "window_{} of {} for {:.1} s: {:?}",
                self.window.name,
                self.component,
                self.window.lasts.as_secs_f64(),
                self.window.env
            ),
        }))
    }

    /// Closes the window if it is open (the faults are over).
    pub(super) fn close(&mut self, procs: &mut [Proc]) -> anyhow::Result<()> {
        if self.open_until.take().is_some() {
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
    use std::time::Duration;

    fn timed(component: &str) -> Timed {
        Timed {
            component: component.to_owned(),
            window: Window {
                name: "slow".into(),
                env: [("DELAY".to_owned(), "10s".to_owned())].into(),
                first: Duration::from_secs(8),
                every: Duration::from_secs(40),
                lasts: Duration::from_secs(15),
                quiet: false,
            },
            next: Instant::now(),
            open_until: None,
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
        assert_eq!(w.tick(now, end, &mut []).unwrap(), None);
        assert_eq!(w.open_until(), None);
        let later_end = now + Duration::from_secs(60);
        let opened = w.tick(now, later_end, &mut []).unwrap();
        assert!(matches!(opened, Some(Moved::Opened { ref key, .. }) if key == "window_slow"));
        assert_eq!(w.open_until(), Some(now + Duration::from_secs(15)));
        let closed = w
            .tick(now + Duration::from_secs(15), later_end, &mut [])
            .unwrap();
        assert!(matches!(closed, Some(Moved::Closed { .. })));
        assert_eq!(w.next, now + Duration::from_secs(40));
    }
}
