//! The one exponential backoff of every stage: a wait that starts at `first`, doubles with each
//! failure in a row and never exceeds `max`.

use std::time::Duration;

/// Exponential backoff: `first`, doubling per failure in a row, at most `max` (`max` wins
/// where `first` is larger). Saturating: no wait overflows, whatever the attempt count.
///
/// ```
/// use std::time::Duration;
/// use idem_core::backoff::Backoff;
/// let b = Backoff::new(Duration::from_millis(200), Duration::from_secs(1));
/// assert_eq!(b.after(1), Duration::from_millis(200));
/// assert_eq!(b.after(3), Duration::from_millis(800));
/// assert_eq!(b.after(40), Duration::from_secs(1));
/// assert_eq!(b.next(Duration::from_millis(800)), Duration::from_secs(1));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// The wait after the first failure.
    pub first: Duration,
    /// The longest wait.
    pub max: Duration,
}

impl Backoff {
    /// `first`, doubling, at most `max`.
    pub const fn new(first: Duration, max: Duration) -> Self {
        Backoff { first, max }
    }

    /// The wait after failure number `attempt` in a row (1 = the first; 0 counts as 1).
    pub fn after(&self, attempt: u32) -> Duration {
        let exp = attempt.saturating_sub(1).min(31);
        self.first.saturating_mul(1u32 << exp).min(self.max)
    }

    /// The wait after the next failure, `previous` being the wait after the one before: twice
    /// `previous`, at least `first`, at most `max`.
    pub fn next(&self, previous: Duration) -> Duration {
        previous.saturating_mul(2).max(self.first).min(self.max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_double_from_first_up_to_max_and_never_overflow() {
        let ms = Duration::from_millis;
        let b = Backoff::new(ms(100), ms(1000));
        let waits: Vec<Duration> = (0..=6).map(|n| b.after(n)).collect();
        assert_eq!(
            waits,
            [
                ms(100),
                ms(100),
                ms(200),
                ms(400),
                ms(800),
                ms(1000),
                ms(1000)
            ]
        );
        assert_eq!(b.after(u32::MAX), ms(1000));
        let mut w = Duration::ZERO;
        let mut seen = vec![];
        for _ in 0..6 {
            w = b.next(w);
            seen.push(w);
        }
        assert_eq!(
            seen,
            [ms(100), ms(200), ms(400), ms(800), ms(1000), ms(1000)]
        );
        let huge = Backoff::new(Duration::MAX, Duration::MAX);
        assert_eq!(huge.after(9), Duration::MAX);
        assert_eq!(huge.next(Duration::MAX), Duration::MAX);
        let inverted = Backoff::new(ms(500), ms(50));
        assert_eq!((inverted.after(1), inverted.next(ms(1))), (ms(50), ms(50)));
    }
}
