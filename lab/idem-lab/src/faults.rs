//! Faults armed from the environment at start: crash points (`IDEM_CRASH_POINTS`), negative
//! controls (`IDEM_BREAK`) and the crash log (`IDEM_CRASH_LOG`). The parsing is pure
//! ([`crash_points`], [`mechanisms`]); [`arm_from_env`] reads the variables and arms
//! `idem_core::crash` through its setters.
//!
//! ```text
//! IDEM_CRASH_POINTS=relay.after_publish_before_mark          # abort on the first hit
//! IDEM_CRASH_POINTS=relay.after_publish_before_mark@3        # abort on the third hit
//! IDEM_CRASH_POINTS=a,b@2                                    # several points
//! IDEM_BREAK=mark-before-report                              # a negative control
//! IDEM_CRASH_LOG=/path/crashes.log                           # where fired points are recorded
//! ```

use idem_core::crash::{self, Action, CrashPoint, Mechanism};
use idem_core::{Error, Result};

/// Crash points named in the environment.
const CRASH_POINTS_VAR: &str = "IDEM_CRASH_POINTS";
/// Negative controls named in the environment.
const BREAK_VAR: &str = "IDEM_BREAK";
/// Where fired crash points are recorded.
const CRASH_LOG_VAR: &str = "IDEM_CRASH_LOG";

/// The items of a comma-separated list, trimmed, empty ones skipped.
fn items(spec: &str) -> impl Iterator<Item = &str> {
    spec.split(',').map(str::trim).filter(|s| !s.is_empty())
}

/// Parses `name[@hit],...` into (point, hit) pairs (hit 1 = the first).
pub(crate) fn crash_points(spec: &str) -> Result<Vec<(CrashPoint, u64)>> {
    items(spec)
        .map(|item| {
            let (name, hit) = match item.split_once('@') {
                Some((name, hit)) => (name, hit.parse::<u64>().ok().filter(|h| *h > 0)),
                None => (item, Some(1)),
            };
            let hit = hit.ok_or_else(|| {
                Error::Config(format!(
                    "{CRASH_POINTS_VAR}: {item:?}: the hit after '@' must be a positive number"
                ))
            })?;
            Ok((name.parse().map_err(|e| named(CRASH_POINTS_VAR, e))?, hit))
        })
        .collect()
}

/// Parses a comma-separated list of mechanisms.
pub(crate) fn mechanisms(spec: &str) -> Result<Vec<Mechanism>> {
    items(spec)
        .map(|name| name.parse().map_err(|e| named(BREAK_VAR, e)))
        .collect()
}

/// `e`, refusing a value of the variable `var`, with the variable's name in front.
fn named(var: &str, e: Error) -> Error {
    Error::Config(format!("{var}: {e}"))
}

/// Breaks the mechanisms in `IDEM_BREAK` (saying so on standard error), arms the points in
/// `IDEM_CRASH_POINTS` in abort mode, and records fired points in `IDEM_CRASH_LOG`.
pub(crate) fn arm_from_env() -> Result<()> {
    if let Ok(spec) = std::env::var(BREAK_VAR) {
        for mechanism in mechanisms(&spec)? {
            if !crash::ENABLED {
                return Err(Error::Config(format!(
                    "{BREAK_VAR} needs a build with the `failpoints` feature"
                )));
            }
            crash::break_mechanism(mechanism)?;
            eprintln!("idem: NEGATIVE CONTROL: this process deliberately breaks {mechanism}");
        }
    }
    crash::set_crash_log(std::env::var_os(CRASH_LOG_VAR).map(Into::into));
    let Ok(spec) = std::env::var(CRASH_POINTS_VAR) else {
        return Ok(());
    };
    for (point, hit) in crash_points(&spec)? {
        crash::arm(point, Action::Abort, hit)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crash_point_lists_parse_with_and_without_a_hit() {
        assert_eq!(
            crash_points(" relay.after_publish_before_mark, effect.before_http@2 ,,").unwrap(),
            vec![
                (CrashPoint::RelayAfterPublishBeforeMark, 1),
                (CrashPoint::EffectBeforeHttp, 2)
            ]
        );
        assert!(crash_points("").unwrap().is_empty());
        for bad in ["effect.before_http@x", "effect.before_http@0"] {
            let e = crash_points(bad).unwrap_err().to_string();
            assert!(e.contains("must be a positive number"), "{e}");
        }
        let e = crash_points("relay.nowhere").unwrap_err().to_string();
        assert!(
            e.contains("IDEM_CRASH_POINTS: invalid crash point: \"relay.nowhere\""),
            "{e}"
        );
    }

    #[test]
    fn only_known_mechanisms_parse() {
        assert_eq!(
            mechanisms("never-park, id-watermark").unwrap(),
            vec![Mechanism::NeverPark, Mechanism::IdWatermark]
        );
        let e = mechanisms("never-park,nope").unwrap_err().to_string();
        assert!(
            e.contains("IDEM_BREAK: invalid mechanism")
                && e.contains("invalid mechanism: \"nope\""),
            "{e}"
        );
    }
}
