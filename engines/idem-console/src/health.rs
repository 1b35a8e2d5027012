//! A stage's health colour, by the rules of `deploy/prometheus/idem-alerts.yml` applied to what
//! the console samples. Pure: numbers in, a colour and the reasons out.

use idem_sql::ops::{CdcSlot, IntentCounts, OutboxSummary};

/// `IdemOutboxOldestPendingAgeHigh`: the oldest pending row is older than this (seconds).
pub(crate) const OLDEST_PENDING_AGE: f64 = 300.0;
/// `IdemConsumerLagHigh`: a group is this many records behind on a topic.
pub(crate) const CONSUMER_LAG: i64 = 10_000;
/// `IdemConsumerStalled`: a group's batch has failed transiently for this long (seconds).
pub(crate) const STALLED_FOR: f64 = 300.0;
/// `IdemCdcSlotLagHigh`: a slot holds this many bytes of WAL.
pub(crate) const SLOT_WAL_HELD: i64 = 1_073_741_824;

/// How a stage is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Colour {
    /// Nothing measured yet.
    Grey,
    /// Nothing to do.
    Green,
    /// Something waits for a person (parked rows, dead letters, unknown effects).
    Amber,
    /// An alert of `idem-alerts.yml` would fire.
    Red,
}

impl Colour {
    /// The CSS class and the word a screen reader says.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Colour::Grey => "grey",
            Colour::Green => "green",
            Colour::Amber => "amber",
            Colour::Red => "red",
        }
    }
}

/// A colour and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Health {
    /// The worst colour a rule gave.
    pub(crate) colour: Colour,
    /// One line per rule that gave a colour other than green, with its alert's name.
    pub(crate) reasons: Vec<String>,
}

impl Health {
    fn green() -> Self {
        Health {
            colour: Colour::Green,
            reasons: vec![],
        }
    }

    fn raise(&mut self, colour: Colour, reason: String) {
        self.colour = self.colour.max(colour);
        self.reasons.push(reason);
    }
}

/// The outbox: red when its oldest pending row waited too long, amber with parked rows.
pub(crate) fn outbox(s: &OutboxSummary) -> Health {
    let mut h = Health::green();
    if let Some(age) = s.oldest_pending_age.filter(|a| *a > OLDEST_PENDING_AGE) {
        h.raise(
            Colour::Red,
            format!("the oldest pending row waits for {age:.0} s (IdemOutboxOldestPendingAgeHigh above {OLDEST_PENDING_AGE:.0} s)"),
        );
    }
    if s.parked > 0 {
        h.raise(
            Colour::Amber,
            format!(
                "{} parked row(s) wait for a person (IdemOutboxRowsParked)",
                s.parked
            ),
        );
    }
    h
}

/// The CDC slots: red when one holds too much WAL, amber when one has no reader.
pub(crate) fn slots(slots: &[CdcSlot]) -> Health {
    let mut h = Health::green();
    for s in slots {
        if let Some(held) = s.wal_held.filter(|b| *b > SLOT_WAL_HELD) {
            h.raise(
                Colour::Red,
                format!(
                    "slot {} holds {held} bytes of WAL (IdemCdcSlotLagHigh above 1 GiB)",
                    s.name
                ),
            );
        }
        if !s.active {
            h.raise(Colour::Amber, format!("slot {} has no reader", s.name));
        }
    }
    h
}

/// A consumer group: red when it lags or is stalled too long, amber with open dead letters.
pub(crate) fn consumer(lag: Option<i64>, stalled_for: Option<f64>, open_letters: i64) -> Health {
    let mut h = Health::green();
    if let Some(lag) = lag.filter(|l| *l > CONSUMER_LAG) {
        h.raise(
            Colour::Red,
            format!("{lag} records behind (IdemConsumerLagHigh above {CONSUMER_LAG})"),
        );
    }
    if let Some(s) = stalled_for.filter(|s| *s > STALLED_FOR) {
        h.raise(
            Colour::Red,
            format!("stalled for {s:.0} s (IdemConsumerStalled above {STALLED_FOR:.0} s)"),
        );
    }
    if open_letters > 0 {
        h.raise(
            Colour::Amber,
            format!("{open_letters} open dead letter(s) (IdemConsumerDeadLettered)"),
        );
    }
    h
}

/// The effects: amber with parked or unknown intents.
pub(crate) fn effects(c: &IntentCounts) -> Health {
    let mut h = Health::green();
    if c.unknown > 0 {
        h.raise(
            Colour::Amber,
            format!(
                "{} effect(s) of unknown outcome (IdemEffectOutcomeUnknown)",
                c.unknown
            ),
        );
    }
    if c.parked > 0 {
        h.raise(
            Colour::Amber,
            format!("{} parked effect(s) (IdemEffectParked)", c.parked),
        );
    }
    h
}

/// The proof: red when the last verification found violations, grey before the first one.
pub(crate) fn proof(violations: Option<u64>) -> Health {
    match violations {
        None => Health {
            colour: Colour::Grey,
            reasons: vec!["not verified yet".to_owned()],
        },
        Some(0) => Health::green(),
        Some(n) => Health {
            colour: Colour::Red,
            reasons: vec![format!("{n} violation(s) (IdemReconciliationGap)")],
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALERTS: &str = include_str!("../../../deploy/prometheus/idem-alerts.yml");

    /// The expression of alert `name` in `idem-alerts.yml`.
    fn expr(name: &str) -> String {
        let at = ALERTS
            .find(&format!("alert: {name}\n"))
            .unwrap_or_else(|| panic!("no alert {name}"));
        let rest = &ALERTS[at..];
        let line = rest
            .lines()
            .find(|l| l.trim_start().starts_with("expr:"))
            .unwrap_or_else(|| panic!("{name} has no expr"));
        line.to_owned()
    }

    #[test]
    fn the_thresholds_are_the_alerts_thresholds() {
        assert!(expr("IdemOutboxOldestPendingAgeHigh").ends_with("> 300"));
        assert!(expr("IdemConsumerLagHigh").ends_with("> 10000"));
        assert!(expr("IdemConsumerStalled").contains("> 300)"));
        assert!(expr("IdemCdcSlotLagHigh").ends_with("> 1073741824"));
        assert_eq!(OLDEST_PENDING_AGE, 300.0);
        assert_eq!(CONSUMER_LAG, 10_000);
        assert_eq!(STALLED_FOR, 300.0);
        assert_eq!(SLOT_WAL_HELD, 1_073_741_824);
    }

    #[test]
    fn each_rule_colours_past_its_threshold_only() {
        let mut s = OutboxSummary {
            oldest_pending_age: Some(OLDEST_PENDING_AGE),
            ..OutboxSummary::default()
        };
        assert_eq!(outbox(&s).colour, Colour::Green);
        s.parked = 1;
        assert_eq!(outbox(&s).colour, Colour::Amber);
        s.oldest_pending_age = Some(OLDEST_PENDING_AGE + 1.0);
        let h = outbox(&s);
        assert_eq!(h.colour, Colour::Red);
        assert_eq!(h.reasons.len(), 2);
        assert_eq!(
            consumer(Some(CONSUMER_LAG), Some(STALLED_FOR), 0).colour,
            Colour::Green
        );
        assert_eq!(
            consumer(Some(CONSUMER_LAG + 1), None, 0).colour,
            Colour::Red
        );
        assert_eq!(
            consumer(None, Some(STALLED_FOR + 1.0), 0).colour,
            Colour::Red
        );
        assert_eq!(consumer(None, None, 3).colour, Colour::Amber);
        let c = IntentCounts {
            unknown: 1,
            ..IntentCounts::default()
        };
        assert_eq!(effects(&c).colour, Colour::Amber);
        assert_eq!(effects(&IntentCounts::default()).colour, Colour::Green);
        assert_eq!(proof(None).colour, Colour::Grey);
        assert_eq!(proof(Some(0)).colour, Colour::Green);
        assert_eq!(proof(Some(2)).colour, Colour::Red);
        let slot = |active, wal_held| CdcSlot {
            name: "idem".into(),
            plugin: "pgoutput".into(),
            active,
            confirmed: None,
            wal_held: Some(wal_held),
        };
        assert_eq!(slots(&[slot(true, SLOT_WAL_HELD)]).colour, Colour::Green);
        assert_eq!(slots(&[slot(false, 0)]).colour, Colour::Amber);
        assert_eq!(slots(&[slot(true, SLOT_WAL_HELD + 1)]).colour, Colour::Red);
    }
}
