//! The demo's components share one stop signal; each runs under [`supervise`], which restarts
//! it in-process when a crash point "kills" it, and counts the restarts.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use idem_core::Error;
use tokio::sync::watch;

/// The components that restart, as counted in the report.
pub(super) const COMPONENTS: [&str; 3] = ["relay", "settlement", "dispatcher"];

/// Shared stop signal and restart counters.
#[derive(Clone)]
pub(super) struct Ctl {
    stop: watch::Receiver<bool>,
    restarts: Arc<BTreeMap<&'static str, AtomicU64>>,
}

/// Stops every component of the [`Ctl`] it came with.
pub(super) struct Stop(watch::Sender<bool>);

impl Stop {
    /// Tells every component to stop.
    pub(super) fn stop(&self) {
        let _ = self.0.send(true);
    }
}

impl Ctl {
    /// A running control and its stop switch; restarts are counted per [`COMPONENTS`].
    pub(super) fn new() -> (Ctl, Stop) {
        let (tx, stop) = watch::channel(false);
        let restarts = COMPONENTS.iter().map(|c| (*c, AtomicU64::new(0))).collect();
        let ctl = Ctl {
            stop,
            restarts: Arc::new(restarts),
        };
        (ctl, Stop(tx))
    }

    /// Completes when the components are told to stop.
    pub(super) fn shutdown(&self) -> impl Future<Output = ()> + Send + use<> {
        let mut rx = self.stop.clone();
        async move {
            let _ = rx.wait_for(|v| *v).await;
        }
    }

    fn stopped(&self) -> bool {
        *self.stop.borrow()
    }

    fn restarted(&self, component: &'static str) {
        if let Some(c) = self.restarts.get(component) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Restarts so far, all components together.
    pub(super) fn total_restarts(&self) -> u64 {
        self.restarts
            .values()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }

    /// Restarts so far per component.
    pub(super) fn restarts(&self) -> BTreeMap<String, u64> {
        self.restarts
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.load(Ordering::Relaxed)))
            .collect()
    }
}

/// Runs `attempt` until it ends without an error; a crash point "kills" the component (its
/// state is dropped, nothing is cleaned up) and a new instance starts. Any other error (a
/// database busy past its timeout on a loaded machine, a broker hiccup) ends a real process,
/// which its supervisor restarts: here it is logged and the component restarts after a short
/// pause, as a new process would, instead of the demo waiting out its deadline with a stage
/// silently gone.
pub(super) async fn supervise<F, Fut>(
    ctl: Ctl,
    component: &'static str,
    mut attempt: F,
) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = idem_core::Result<()>>,
{
    loop {
        match attempt().await {
            Ok(()) => return Ok(()),
            Err(Error::CrashPoint(point)) => {
                tracing::info!(
                    component,
                    point = point.as_str(),
                    "crash point fired; restarting the component"
                );
                ctl.restarted(component);
                if ctl.stopped() {
                    return Ok(());
                }
            }
            Err(e) => {
                tracing::warn!(component, error = %e, "component failed; restarting it, as a supervisor would");
                eprintln!("idem demo: {component} failed ({e}); restarting it");
                ctl.restarted(component);
                if ctl.stopped() {
                    return Ok(());
                }
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    /// A dispatcher whose store is busy past its timeout once: before, `supervise` returned the
    /// error and the stage was gone until the demo's deadline; now it restarts and finishes.
    #[tokio::test]
    async fn a_component_that_fails_with_an_error_is_restarted_and_runs_on() {
        let (ctl, _stop) = Ctl::new();
        let calls = AtomicU32::new(0);
        let result = supervise(ctl.clone(), "dispatcher", || {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            async move {
                if n == 0 {
                    Err(Error::Config("database is locked".to_owned()))
                } else {
                    Ok(())
                }
            }
        })
        .await;
        assert!(result.is_ok(), "{result:?}");
        assert_eq!(calls.load(Ordering::SeqCst), 2, "ran again after the error");
        assert_eq!(ctl.restarts()["dispatcher"], 1);
    }

    #[tokio::test]
    async fn a_stopped_run_does_not_restart_a_failed_component() {
        let (ctl, stop) = Ctl::new();
        stop.stop();
        let calls = AtomicU32::new(0);
        let result = supervise(ctl, "relay", || {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Err(Error::Config("broker gone".to_owned())) }
        })
        .await;
        assert!(result.is_ok());
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }
}
