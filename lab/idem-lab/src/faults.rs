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

use idem_core::crash::{self, Action};
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

/// Parses `name[@hit],...` into (point, hit) pairs (hit 1 = the first). Names are checked when
/// armed.
pub(crate) fn crash_points(spec: &str) -> Result<Vec<(&str, u64)>> {
    items(spec)
        .map(|item| match item.split_once('@') {
            Some((name, hit)) => hit.parse::<u64>().map(|h| (name, h)).map_err(|_| {
                Error::Config(format!(
                    "{CRASH_POINTS_VAR}: {item:?}: the hit after '@' must be a positive number"
                ))
            }),
            None => Ok((item, 1)),
        })
        .collect()
}

/// Parses a comma-separated list of mechanisms, each one of [`crash::BREAKABLE`].
pub(crate) fn mechanisms(spec: &str) -> Result<Vec<&str>> {
    items(spec)
        .map(|name| {
            if crash::BREAKABLE.contains(&name) {
                Ok(name)
            } else {
                Err(Error::Config(format!(
                    "{BREAK_VAR}: unknown mechanism {name:?}; known: {}",
                    crash::BREAKABLE.join(", ")
                )))
            }
        })
        .collect()
}

/// Breaks the mechanisms in `IDEM_BREAK` (saying so on standard error), arms the points in
/// `IDEM_CRASH_POINTS` in abort mode, and records fired points in `IDEM_CRASH_LOG`.
pub(crate) fn arm_from_env() -> Result<()> {
    if let Ok(spec) = std::env::var(BREAK_VAR) {
        for name in mechanisms(&spec)? {
            if !crash::ENABLED {
                return Err(Error::Config(format!(
                    "{BREAK_VAR} needs a build with the `failpoints` feature"
                )));
            }
            crash::break_mechanism(name)?;
            eprintln!("idem: NEGATIVE CONTROL: this process deliberately breaks {name}");
        }
    }
    crash::set_crash_log(std::env::var_os(CRASH_LOG_VAR).map(Into::into));
    let Ok(spec) = std::env::var(CRASH_POINTS_VAR) else {
        return Ok(());
    };
    for (name, hit) in crash_points(&spec)? {
        crash::arm(name, Action::Abort, hit)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crash_point_lists_parse_with_and_without_a_hit() {
        assert_eq!(
            crash_points(" a, b@2 ,,").unwrap(),
            vec![("a", 1), ("b", 2)]
        );
        assert!(crash_points("").unwrap().is_empty());
        let e = crash_points("a@x").unwrap_err().to_string();
        assert!(e.contains("must be a positive number"), "{e}");
    }

    #[test]
    fn only_known_mechanisms_parse() {
        assert_eq!(
            mechanisms("never-park, id-watermark").unwrap(),
            vec![crash::BREAK_NEVER_PARK, crash::BREAK_ID_WATERMARK]
        );
        let e = mechanisms("never-park,nope").unwrap_err().to_string();
        assert!(e.contains("unknown mechanism \"nope\""), "{e}");
    }
}
