//! The state of a stored effect intent, as a type. The stores hand it over as text
//! (`IntentStore::get`, `StuckIntent::status`); this is where the text is parsed.

use std::fmt;
use std::str::FromStr;

/// Where an effect intent is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IntentStatus {
    /// Waiting for (another) attempt.
    Pending,
    /// Delivered; the response is stored.
    Done,
    /// Stopped for a person (a 422, another 4xx, a remote that kept refusing).
    Parked,
    /// Nobody can tell whether the effect happened (a remote that ignores keys).
    Unknown,
}

impl IntentStatus {
    /// The stored text: `pending`, `done`, `parked`, `unknown`.
    pub fn as_str(self) -> &'static str {
        match self {
            IntentStatus::Pending => "pending",
            IntentStatus::Done => "done",
            IntentStatus::Parked => "parked",
            IntentStatus::Unknown => "unknown",
        }
    }

    /// Parked or unknown: settled only by a person or a compensation.
    pub fn is_stuck(self) -> bool {
        matches!(self, IntentStatus::Parked | IntentStatus::Unknown)
    }
}

impl fmt::Display for IntentStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A stored status that is none of `pending`, `done`, `parked`, `unknown`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the effect intent status {0:?} is not one of pending, done, parked, unknown: \
     was the table written by a newer idem? run the matching `idem migrate`"
)]
pub struct UnknownStatus(pub String);

impl FromStr for IntentStatus {
    type Err = UnknownStatus;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "pending" => Ok(IntentStatus::Pending),
            "done" => Ok(IntentStatus::Done),
            "parked" => Ok(IntentStatus::Parked),
            "unknown" => Ok(IntentStatus::Unknown),
            other => Err(UnknownStatus(other.to_owned())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_round_trip_through_their_stored_text() {
        for s in [
            IntentStatus::Pending,
            IntentStatus::Done,
            IntentStatus::Parked,
            IntentStatus::Unknown,
        ] {
            assert_eq!(s.as_str().parse::<IntentStatus>(), Ok(s));
            assert_eq!(s.to_string(), s.as_str());
        }
        assert_eq!(
            "sending".parse::<IntentStatus>(),
            Err(UnknownStatus("sending".into()))
        );
        assert!(IntentStatus::Parked.is_stuck() && IntentStatus::Unknown.is_stuck());
        assert!(!IntentStatus::Pending.is_stuck() && !IntentStatus::Done.is_stuck());
    }
}
