//! The statements `idem verify` reads idem's tables with: where a lost event stopped (its
//! outbox, archive, inbox, dead-letter and intent rows) and the attempts behind each stage.

use idem_core::TableNames;

use crate::Scheme;
use crate::queries::{for_scheme, without_comments};

/// Table bases the statements name.
const BASES: &[&str] = &[
    "outbox_archive",
    "outbox",
    "inbox",
    "dead_letters",
    "effect_intents",
];

/// `idem verify`'s statements over idem's tables, rendered for one database and one set of
/// tables. Each binds its parameters as `$1, $2, …` in order, as text.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct VerifyStatements {
    /// The newest outbox row of (aggregate type, aggregate id, event type): `event_id`,
    /// `status`, `last_error`.
    pub outbox_row: String,
    /// An archived row of (aggregate type, aggregate id, event type): `event_id`.
    pub archive_row: String,
    /// The inbox row of (consumer group, event id): `status`.
    pub inbox_row: String,
    /// The newest dead letter of (consumer group, event id): `reason`.
    pub dead_letter_row: String,
    /// The intent of an idempotency key: `status`, `last_error`.
    pub intent_row: String,
    /// Outbox rows of (aggregate type, event type): `total`, `pending`, `published`,
    /// `parked`, `attempts`.
    pub outbox_stats: String,
    /// A consumer group's inbox: `events`, `deliveries`, `dead_lettered`.
    pub inbox_stats: String,
    /// An effect's intents: `intents`, `attempts`, `done`, `pending`, `parked`, `unknown`.
    pub intent_stats: String,
}

impl VerifyStatements {
    /// The statements for `scheme`'s database over `tables`.
    pub fn new(scheme: Scheme, tables: &TableNames) -> Self {
        let r = |sql: &str| without_comments(&for_scheme(&tables.render(sql, BASES), scheme));
        VerifyStatements {
            outbox_row: r(include_str!("../sql/common/verify_outbox_row.sql")),
            archive_row: r(include_str!("../sql/common/verify_archive_row.sql")),
            inbox_row: r(include_str!("../sql/common/verify_inbox_row.sql")),
            dead_letter_row: r(include_str!("../sql/common/verify_dead_letter_row.sql")),
            intent_row: r(include_str!("../sql/common/verify_intent_row.sql")),
            outbox_stats: r(include_str!("../sql/common/verify_outbox_stats.sql")),
            inbox_stats: r(include_str!("../sql/common/verify_inbox_stats.sql")),
            intent_stats: r(include_str!("../sql/common/verify_intent_stats.sql")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dialect_tokens_become_casts_on_postgres_and_nothing_on_sqlite() {
        let t = TableNames::default();
        let pg = VerifyStatements::new(Scheme::Postgres, &t);
        let lite = VerifyStatements::new(Scheme::Sqlite, &t);
        assert!(
            pg.inbox_row.contains("event_id = $2::uuid"),
            "{}",
            pg.inbox_row
        );
        assert!(
            lite.inbox_row.contains("event_id = $2"),
            "{}",
            lite.inbox_row
        );
        assert!(!lite.inbox_row.contains("::"), "{}", lite.inbox_row);
        assert!(pg.outbox_stats.contains("count(*)::bigint AS total"));
        for sql in [&pg.outbox_stats, &lite.intent_stats, &lite.outbox_row] {
            assert!(!sql.contains('{'), "an unrendered token: {sql}");
        }
    }
}
