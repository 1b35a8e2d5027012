//! The verification report: what is allowed (duplicate attempts) and what is a violation
//! (lost effects, duplicate effects, amount gaps).

use std::fmt::Write as _;

use serde::Serialize;

/// Samples kept per kind of violation (the counts are always complete).
pub const SAMPLES: usize = 100;

/// Everything one run found.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct Report {
    /// True when no check found a violation or a gap.
    pub clean: bool,
    /// One per `[[check]]`.
    pub checks: Vec<CheckReport>,
    /// One per `[[unique]]`.
    pub unique: Vec<UniqueReport>,
    /// One per `[[empty]]`.
    pub empty: Vec<EmptyReport>,
    /// Duplicate attempts absorbed along the way (allowed, reported).
    pub attempts: Attempts,
}

/// Totals of one event type within a check.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct TypeTotals {
    /// The event type.
    pub event_type: String,
    /// Source rows.
    pub source_rows: u64,
    /// Sum of source amounts (minor units).
    pub source_sum: i128,
    /// Target rows.
    pub target_rows: u64,
    /// Sum of target amounts.
    pub target_sum: i128,
    /// Source keys with no target row (lost effects, or still in flight).
    pub missing: u64,
    /// Target keys with no source row.
    pub unexpected: u64,
    /// Keys with more than one target row (duplicate business effects).
    pub duplicate_effects: u64,
    /// Keys whose target amount differs from the source amount.
    pub amount_mismatches: u64,
    /// Keys that appear more than once in the source.
    pub duplicate_source_keys: u64,
    /// Keys with a target row in another currency than the source row (checks with a
    /// `[[currency]]`).
    pub currency_mismatches: u64,
}

impl TypeTotals {
    /// Any gap or violation?
    pub fn violations(&self) -> u64 {
        self.missing
            + self.unexpected
            + self.duplicate_effects
            + self.amount_mismatches
            + self.duplicate_source_keys
            + self.currency_mismatches
            + u64::from(self.source_sum != self.target_sum)
    }
}

/// Where a missing effect's event stopped.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// No outbox row: the writer never enqueued it (or its row was pruned without an archive).
    NeverInOutbox,
    /// The outbox row waits for the relay.
    PendingInOutbox,
    /// The relay parked the row (`idem outbox parked`).
    ParkedInOutbox,
    /// Published, but the consumer group has no inbox row for it.
    PublishedButNotProcessed,
    /// The consumer dead-lettered it (`idem dead-letters`).
    DeadLettered,
    /// The consumer processed it, but neither a target row nor an effect intent exists.
    ProcessedWithoutEffect,
    /// The effect intent waits for the dispatcher.
    EffectPending,
    /// The effect intent is parked (`idem effects stuck`).
    EffectParked,
    /// The effect's outcome is unknown (`idem effects stuck`, `idem effects resolve`).
    EffectUnknown,
    /// The dispatcher recorded the effect done, yet the remote has no row for it.
    EffectDoneButMissing,
    /// Not followed (no `locate` section, or beyond the localisation limit).
    NotLocated,
}

impl Stage {
    /// Words for the table.
    pub fn describe(self) -> &'static str {
        match self {
            Stage::NeverInOutbox => "never in the outbox",
            Stage::PendingInOutbox => "pending in the outbox",
            Stage::ParkedInOutbox => "parked in the outbox",
            Stage::PublishedButNotProcessed => "published but not processed",
            Stage::DeadLettered => "dead-lettered",
            Stage::ProcessedWithoutEffect => "processed, but no effect recorded",
            Stage::EffectPending => "effect pending at the dispatcher",
            Stage::EffectParked => "effect parked",
            Stage::EffectUnknown => "effect outcome unknown",
            Stage::EffectDoneButMissing => "effect done, yet missing at the target",
            Stage::NotLocated => "not located",
        }
    }
}

/// One missing effect and where its event stopped.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Loss {
    /// The business key.
    pub key: String,
    /// Its aggregate id in the source.
    pub aggregate_id: Option<String>,
    /// The event id, when an outbox row was found.
    pub event_id: Option<String>,
    /// Where it stopped.
    pub stage: Stage,
    /// The reason recorded there (a dead letter's reason, a parked row's error).
    pub detail: Option<String>,
}

/// A key with more than one target row.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Duplicate {
    /// The key.
    pub key: String,
    /// How many rows.
    pub rows: u64,
}

/// A key whose amounts differ.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Mismatch {
    /// The key.
    pub key: String,
    /// Source amount.
    pub source: i128,
    /// Target amount (all its rows).
    pub target: i128,
}

/// A key settled in another currency.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct CurrencyMismatch {
    /// The key.
    pub key: String,
    /// The source row's currency.
    pub source: Option<String>,
    /// The currency of each target row.
    pub target: Vec<Option<String>>,
}

/// One reconciliation's results.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct CheckReport {
    /// The check.
    pub name: String,
    /// Totals per event type (sorted).
    pub by_event_type: Vec<TypeTotals>,
    /// Missing effects with their localisation (the first ones).
    pub losses: Vec<Loss>,
    /// Duplicate effects (the first ones).
    pub duplicates: Vec<Duplicate>,
    /// Amount mismatches (the first ones).
    pub mismatches: Vec<Mismatch>,
    /// Currency mismatches (the first ones).
    pub currency_mismatches: Vec<CurrencyMismatch>,
    /// Target keys without a source row (the first ones).
    pub unexpected: Vec<String>,
}

impl CheckReport {
    /// All event types together.
    pub fn total(&self) -> TypeTotals {
        let mut t = TypeTotals {
            event_type: "all".to_owned(),
            ..TypeTotals::default()
        };
        for e in &self.by_event_type {
            t.source_rows += e.source_rows;
            t.source_sum += e.source_sum;
            t.target_rows += e.target_rows;
            t.target_sum += e.target_sum;
            t.missing += e.missing;
            t.unexpected += e.unexpected;
            t.duplicate_effects += e.duplicate_effects;
            t.amount_mismatches += e.amount_mismatches;
            t.duplicate_source_keys += e.duplicate_source_keys;
            t.currency_mismatches += e.currency_mismatches;
        }
        t
    }
}

/// A uniqueness check's results.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct UniqueReport {
    /// The check.
    pub name: String,
    /// Rows read.
    pub rows: u64,
    /// Keys seen more than once.
    pub duplicated_keys: u64,
    /// The first ones.
    pub duplicates: Vec<Duplicate>,
}

/// The results of a query that must return no row.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct EmptyReport {
    /// The check.
    pub name: String,
    /// Rows it returned: each a violation.
    pub rows: u64,
    /// The first ones' keys.
    pub keys: Vec<String>,
}

/// Attempts that the pipeline absorbed (allowed; shown so that "no duplicate effects" is seen
/// next to "this many duplicate attempts").
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct Attempts {
    /// Outbox rows per (database, aggregate type, event type).
    pub outbox: Vec<OutboxAttempts>,
    /// Inbox deliveries per (database, consumer group).
    pub inbox: Vec<InboxAttempts>,
    /// Effect attempts per (database, effect).
    pub effects: Vec<EffectAttempts>,
}

/// The outbox of one event type.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct OutboxAttempts {
    /// Database (password hidden).
    pub db: String,
    /// Aggregate type.
    pub aggregate_type: String,
    /// Event type.
    pub event_type: String,
    /// Rows.
    pub rows: i64,
    /// Published.
    pub published: i64,
    /// Pending.
    pub pending: i64,
    /// Parked.
    pub parked: i64,
    /// Publish attempts (claims) in all.
    pub attempts: i64,
}

/// One consumer group's inbox.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct InboxAttempts {
    /// Database (password hidden).
    pub db: String,
    /// Consumer group.
    pub consumer_group: String,
    /// Distinct events.
    pub events: i64,
    /// Deliveries, duplicates included.
    pub deliveries: i64,
    /// Deliveries beyond the first: duplicates the inbox skipped.
    pub duplicate_deliveries: i64,
    /// Dead-lettered events.
    pub dead_lettered: i64,
}

/// One effect's intents.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct EffectAttempts {
    /// Database (password hidden).
    pub db: String,
    /// Effect name.
    pub effect: String,
    /// Intents.
    pub intents: i64,
    /// HTTP attempts, repeats included.
    pub attempts: i64,
    /// Attempts beyond the first (same key each time).
    pub repeated_attempts: i64,
    /// Done.
    pub done: i64,
    /// Pending.
    pub pending: i64,
    /// Parked.
    pub parked: i64,
    /// Unknown.
    pub unknown: i64,
}

impl Report {
    /// Sets `clean` from the findings.
    pub(crate) fn settle(&mut self) {
        self.clean = self
            .checks
            .iter()
            .all(|c| c.by_event_type.iter().all(|t| t.violations() == 0))
            && self.unique.iter().all(|u| u.duplicated_keys == 0)
            && self.invariant_violations() == 0;
    }

    /// Rows the `[[empty]]` checks returned.
    pub fn invariant_violations(&self) -> u64 {
        self.empty.iter().map(|e| e.rows).sum()
    }

    /// Lost effects over all checks.
    pub fn lost(&self) -> u64 {
        self.checks.iter().map(|c| c.total().missing).sum()
    }

    /// Duplicate effects over all checks and uniqueness checks.
    pub fn duplicate_effects(&self) -> u64 {
        self.checks
            .iter()
            .map(|c| c.total().duplicate_effects)
            .sum::<u64>()
            + self.unique.iter().map(|u| u.duplicated_keys).sum::<u64>()
    }

    /// The human-readable table.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "idem verify: {}",
            if self.clean {
                "CLEAN (no lost effect, no duplicate effect, no gap)"
            } else {
                "VIOLATIONS FOUND"
            }
        );
        let _ = writeln!(out);
        self.write_counts(&mut out);
        self.attempts.write(&mut out);
        for c in &self.checks {
            c.write_findings(&mut out);
        }
        for u in &self.unique {
            for d in &u.duplicates {
                let _ = writeln!(
                    out,
                    "DUPLICATE unique {:?} key {}: {} rows",
                    u.name, d.key, d.rows
                );
            }
        }
        for e in &self.empty {
            for key in &e.keys {
                let _ = writeln!(out, "NOT EMPTY {:?}: row {key}", e.name);
            }
        }
        out
    }

    /// One line per check and event type, then the uniqueness checks.
    fn write_counts(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "{:<14} {:<14} {:>10} {:>14} {:>10} {:>14} {:>8} {:>10} {:>10} {:>8} {:>8}",
            "check",
            "event type",
            "source",
            "source sum",
            "target",
            "target sum",
            "missing",
            "unexpected",
            "duplicate",
            "amount",
            "currency"
        );
        for c in &self.checks {
            for t in &c.by_event_type {
                let _ = writeln!(
                    out,
                    "{:<14} {:<14} {:>10} {:>14} {:>10} {:>14} {:>8} {:>10} {:>10} {:>8} {:>8}",
                    c.name,
                    t.event_type,
                    t.source_rows,
                    t.source_sum,
                    t.target_rows,
                    t.target_sum,
                    t.missing,
                    t.unexpected,
                    t.duplicate_effects,
                    t.amount_mismatches,
                    t.currency_mismatches
                );
            }
        }
        for u in &self.unique {
            let _ = writeln!(
                out,
                "unique {:?}: {} rows, {} duplicated keys",
                u.name, u.rows, u.duplicated_keys
            );
        }
        for e in &self.empty {
            let _ = writeln!(out, "empty {:?}: {} rows", e.name, e.rows);
        }
    }
}

impl Attempts {
    /// The attempts section: duplicates absorbed, which are allowed.
    fn write(&self, out: &mut String) {
        let a = self;
        if !(a.outbox.is_empty() && a.inbox.is_empty() && a.effects.is_empty()) {
            let _ = writeln!(out, "\nattempts (duplicates absorbed, allowed):");
        }
        for o in &a.outbox {
            let _ = writeln!(
                out,
                "  outbox {}/{} @ {}: {} rows, {} published, {} pending, {} parked, {} publish attempts",
                o.aggregate_type,
                o.event_type,
                o.db,
                o.rows,
                o.published,
                o.pending,
                o.parked,
                o.attempts
            );
        }
        for i in &a.inbox {
            let _ = writeln!(
                out,
                "  inbox {} @ {}: {} events, {} deliveries ({} duplicate), {} dead-lettered",
                i.consumer_group,
                i.db,
                i.events,
                i.deliveries,
                i.duplicate_deliveries,
                i.dead_lettered
            );
        }
        for e in &a.effects {
            let _ = writeln!(
                out,
                "  effect {} @ {}: {} intents, {} attempts ({} repeated, same key), {} done, {} pending, {} parked, {} unknown",
                e.effect,
                e.db,
                e.intents,
                e.attempts,
                e.repeated_attempts,
                e.done,
                e.pending,
                e.parked,
                e.unknown
            );
        }
    }
}

impl CheckReport {
    /// The table's lines for each finding of this check (lost, duplicate, amount, currency,
    /// unexpected, sum gap).
    fn write_findings(&self, out: &mut String) {
        let c = self;
        for l in &c.losses {
            let _ = writeln!(
                out,
                "LOST      {:<14} key {} (aggregate {}, event {}): {}{}",
                c.name,
                l.key,
                l.aggregate_id.as_deref().unwrap_or("-"),
                l.event_id.as_deref().unwrap_or("-"),
                l.stage.describe(),
                l.detail
                    .as_deref()
                    .map(|d| format!(": {d}"))
                    .unwrap_or_default()
            );
        }
        for d in &c.duplicates {
            let _ = writeln!(
                out,
                "DUPLICATE {:<14} key {}: {} target rows",
                c.name, d.key, d.rows
            );
        }
        for m in &c.mismatches {
            let _ = writeln!(
                out,
                "AMOUNT    {:<14} key {}: source {} target {}",
                c.name, m.key, m.source, m.target
            );
        }
        for m in &c.currency_mismatches {
            let _ = writeln!(
                out,
                "CURRENCY  {:<14} key {}: source {} target {}",
                c.name,
                m.key,
                m.source.as_deref().unwrap_or("NULL"),
                m.target
                    .iter()
                    .map(|t| t.as_deref().unwrap_or("NULL"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        for k in &c.unexpected {
            let _ = writeln!(out, "UNEXPECTED {:<13} key {}: no source row", c.name, k);
        }
        let t = c.total();
        if t.source_sum != t.target_sum {
            let _ = writeln!(
                out,
                "SUM GAP   {:<14} source {} target {} (difference {})",
                c.name,
                t.source_sum,
                t.target_sum,
                t.source_sum - t.target_sum
            );
        }
    }
}
