//! Counts as the floating-point figures a measurement reports, and back.
//!
//! Rates, ratios and megabytes divide counts as `f64`. The counts a run reaches stay far below
//! 2^53, where `f64` holds every whole number exactly, so these conversions lose nothing; they
//! live here so that every other line of the lab converts without a bare `as`.

use std::time::Duration;

/// A count as `f64`; a negative or oversized count (a bug upstream) is `NaN`, which every
/// report prints as such instead of a plausible number.
pub(crate) fn float<N: TryInto<u64>>(n: N) -> f64 {
    n.try_into().map_or(f64::NAN, exact)
}

#[expect(
    clippy::cast_precision_loss,
    reason = "a run's counts stay below 2^53, where f64 is exact"
)]
fn exact(n: u64) -> f64 {
    n as f64
}

/// `n` per second of `elapsed` (an instant counts as a nanosecond).
pub(crate) fn per_second<N: TryInto<u64>>(n: N, elapsed: Duration) -> f64 {
    float(n) / elapsed.as_secs_f64().max(1e-9)
}

/// `bytes` in MiB.
pub(crate) fn mib(bytes: u64) -> f64 {
    float(bytes) / 1_048_576.0
}

/// A whole, non-negative number carried as `f64` (a Prometheus counter's value, a rounded
/// rank): negative and `NaN` are 0, beyond `u64::MAX` saturates.
#[expect(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "`as` saturates and maps NaN to 0, which is the intent for these values"
)]
pub(crate) fn whole(value: f64) -> u64 {
    value.round() as u64
}

/// The nearest-rank index of quantile `q` (0..=1) in a sorted slice of `len` items.
pub(crate) fn rank(len: usize, q: f64) -> usize {
    let last = len.saturating_sub(1);
    usize::try_from(whole(float(last) * q.clamp(0.0, 1.0))).map_or(last, |i| i.min(last))
}

/// A command-line duration (`500ms`, `40s`, `10m`, the one syntax of every flag) in seconds.
pub(crate) fn seconds(text: &str) -> Result<f64, String> {
    idem_cli::util::parse_duration(text).map(|d| d.as_secs_f64())
}

/// A command-line duration in whole seconds, at least one.
pub(crate) fn whole_seconds(text: &str) -> Result<u64, String> {
    let d = idem_cli::util::parse_duration(text)?;
    match (d.as_secs(), d.subsec_nanos()) {
        (s, 0) if s > 0 => Ok(s),
        _ => Err(format!(
            "{text:?} is not a whole number of seconds: give e.g. 40s or 10m"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_length_is_whole_seconds() {
        assert_eq!(whole_seconds("40s"), Ok(40));
        assert_eq!(whole_seconds("2m"), Ok(120));
        for refused in ["1500ms", "500ms", "0s", "forty"] {
            assert!(whole_seconds(refused).is_err(), "{refused}");
        }
        assert_eq!(seconds("500ms"), Ok(0.5));
    }

    #[test]
    fn conversions_keep_whole_numbers_and_flag_what_is_not_a_count() {
        assert_eq!(float(42u64), 42.0);
        assert!(float(-1i64).is_nan());
        assert_eq!(whole(3.0), 3);
        assert_eq!(whole(-2.0), 0);
        assert_eq!(whole(f64::NAN), 0);
        assert_eq!(per_second(10u64, Duration::from_secs(2)), 5.0);
        assert_eq!(mib(3 * 1_048_576), 3.0);
    }

    #[test]
    fn rank_picks_the_nearest_index_inside_the_slice() {
        assert_eq!(rank(101, 0.5), 50);
        assert_eq!(rank(101, 0.99), 99);
        assert_eq!(rank(1, 0.99), 0);
        assert_eq!(rank(0, 0.5), 0);
        assert_eq!(rank(10, 2.0), 9);
    }
}
