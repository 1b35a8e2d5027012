//! Pure decisions of a run, apart from any I/O: the spread of a ceiling's samples, when a drain
//! is stuck, and how a phase ended.

use std::time::{Duration, Instant};

/// Smallest, median and largest of a ceiling's samples.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Spread {
    /// Smallest sample.
    pub min: f64,
    /// Median (the mean of the two middle samples when their count is even): what the ratios
    /// divide by.
    pub median: f64,
    /// Largest sample.
    pub max: f64,
}

impl Spread {
    /// The spread of the finite `samples` (`None` when there is none).
    pub(super) fn of(samples: &[f64]) -> Option<Self> {
        let mut v: Vec<f64> = samples.iter().copied().filter(|s| s.is_finite()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let mid = v.len() / 2;
        let median = if v.len().is_multiple_of(2) {
            f64::midpoint(v[mid - 1], v[mid])
        } else {
            v[mid]
        };
        Some(Spread {
            min: v[0],
            median,
            max: v[v.len() - 1],
        })
    }
}

/// Watches a drain's count: stuck when it has not moved for `limit`.
#[derive(Debug)]
pub(super) struct Stall {
    last: Option<u64>,
    since: Instant,
    limit: Duration,
}

impl Stall {
    /// A watch that calls a drain stuck after `limit` without progress.
    pub(super) fn new(limit: Duration, now: Instant) -> Self {
        Stall {
            last: None,
            since: now,
            limit,
        }
    }

    /// Notes `count` seen at `now`; returns how long it has not moved once that reaches the
    /// limit (the drain is stuck), `None` while it moves or has not been still for long.
    pub(super) fn observe(&mut self, count: u64, now: Instant) -> Option<Duration> {
        if self.last != Some(count) {
            self.last = Some(count);
            self.since = now;
            return None;
        }
        let still = now.saturating_duration_since(self.since);
        (still >= self.limit).then_some(still)
    }
}

/// How a phase ended.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Outcome {
    /// It ran to its end; its figures are in the report.
    Done,
    /// It failed (a child exited, a statement failed, a drain stopped moving); its figures are
    /// missing.
    Failed(String),
    /// It was still running at its deadline and was stopped; its figures are missing.
    TimedOut(Duration),
    /// It did not run because a phase it needs did not end well.
    Skipped(String),
}

impl Outcome {
    /// The status word of the report.
    pub(super) fn status(&self) -> &'static str {
        match self {
            Outcome::Done => "done",
            Outcome::Failed(_) => "failed",
            Outcome::TimedOut(_) => "timed out",
            Outcome::Skipped(_) => "skipped",
        }
    }

    /// Why its figures are missing (`None` when done).
    pub(super) fn reason(&self) -> Option<String> {
        match self {
            Outcome::Done => None,
            Outcome::Failed(why) | Outcome::Skipped(why) => Some(why.clone()),
            Outcome::TimedOut(after) => Some(format!(
                "still running at its deadline of {:.0} s; stopped",
                after.as_secs_f64()
            )),
        }
    }
}

/// Runs `phase` for at most `limit`: its value, or how it ended instead (the future is
/// dropped at the deadline, which kills the children it owns).
pub(super) async fn within<T>(
    limit: Duration,
    phase: impl Future<Output = anyhow::Result<T>>,
) -> Result<T, Outcome> {
    match tokio::time::timeout(limit, phase).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(Outcome::Failed(format!("{e:#}"))),
        Err(_) => Err(Outcome::TimedOut(limit)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spread_is_min_median_max_of_the_finite_samples() {
        let s = Spread::of(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.min, s.median, s.max), (1.0, 2.0, 3.0));
        let s = Spread::of(&[4.0, 1.0, f64::NAN, 2.0, 10.0]).unwrap();
        assert_eq!((s.min, s.median, s.max), (1.0, 3.0, 10.0));
        assert_eq!(Spread::of(&[5.0]).unwrap().median, 5.0);
        assert_eq!(Spread::of(&[]), None);
        assert_eq!(Spread::of(&[f64::INFINITY]), None);
    }

    #[test]
    fn a_drain_is_stuck_only_after_its_count_stood_still_for_the_limit() {
        let t0 = Instant::now();
        let s = |secs| t0 + Duration::from_secs(secs);
        let mut stall = Stall::new(Duration::from_secs(10), t0);
        assert_eq!(stall.observe(0, s(0)), None);
        assert_eq!(stall.observe(0, s(9)), None);
        // Progress restarts the clock.
        assert_eq!(stall.observe(5, s(9)), None);
        assert_eq!(stall.observe(5, s(18)), None);
        assert_eq!(stall.observe(5, s(19)), Some(Duration::from_secs(10)));
        assert_eq!(stall.observe(6, s(40)), None);
    }

    #[tokio::test]
    async fn a_phase_past_its_deadline_is_stopped_and_reported_and_the_next_one_runs() {
        let stuck = within(
            Duration::from_millis(20),
            std::future::pending::<anyhow::Result<()>>(),
        );
        let ended = stuck.await.unwrap_err();
        assert_eq!(ended, Outcome::TimedOut(Duration::from_millis(20)));
        assert_eq!(ended.status(), "timed out");
        assert!(ended.reason().unwrap().contains("deadline"));
        let failed = within(Duration::from_secs(5), async {
            anyhow::Result::<()>::Err(anyhow::anyhow!("relay exited early"))
        })
        .await
        .unwrap_err();
        assert_eq!(failed.status(), "failed");
        assert_eq!(failed.reason().as_deref(), Some("relay exited early"));
        let next = within(Duration::from_secs(5), async { anyhow::Ok(7) }).await;
        assert_eq!(next, Ok(7));
        assert_eq!(Outcome::Done.reason(), None);
    }
}
