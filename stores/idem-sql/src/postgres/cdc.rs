//! The CDC relay's statements over the outbox (table mode): marking what Kafka acknowledged,
//! parking what cannot be published, and the session-start drain of rows written before the
//! slot's confirmed position.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use idem_core::TableNames;

use crate::queries::without_comments;

/// The CDC relay's statements, rendered for one set of tables ([`CdcStatements::shared`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct CdcStatements {
    /// Parks row `$1` with reason `$2` (while it is pending).
    pub park: String,
    /// Marks the pending rows `$1` (`bigint[]`) published; returns `marked`.
    pub mark_published: String,
    /// Deletes the pending rows `$1` (`bigint[]`) instead of marking them; returns `marked`.
    pub delete_published: String,
    /// Deletes the rows `$1` the session-start drain has just marked published.
    pub delete_drained: String,
    /// Ends the leases relay `$1`'s drain still holds.
    pub release_drain_leases: String,
    /// The newest pending row written before position `$1` (text LSN, NULL: any).
    pub pending_max: String,
    /// How many rows up to id `$1` are pending and written before position `$2`.
    pub pending_up_to: String,
}

type Cache = Mutex<HashMap<(Option<String>, String), Arc<CdcStatements>>>;

impl CdcStatements {
    /// The statements over `tables`, rendered on first use and shared by every caller of the
    /// process over the same tables.
    pub fn shared(tables: &TableNames) -> Arc<CdcStatements> {
        static CACHE: OnceLock<Cache> = OnceLock::new();
        let key = (
            tables.schema().map(str::to_owned),
            tables.prefix().to_owned(),
        );
        crate::queries::memoized(&CACHE, key, || CdcStatements::render(tables))
    }

    fn render(tables: &TableNames) -> CdcStatements {
        let r = |sql: &str| without_comments(&tables.render(sql, &["outbox"]));
        CdcStatements {
            park: r(include_str!("../../sql/postgres/cdc_park.sql")),
            mark_published: r(include_str!("../../sql/postgres/cdc_mark_published.sql")),
            delete_published: r(include_str!("../../sql/postgres/cdc_delete_published.sql")),
            delete_drained: r(include_str!("../../sql/postgres/cdc_delete_drained.sql")),
            release_drain_leases: r(include_str!(
                "../../sql/postgres/cdc_release_drain_leases.sql"
            )),
            pending_max: r(include_str!("../../sql/postgres/cdc_pending_max.sql")),
            pending_up_to: r(include_str!("../../sql/postgres/cdc_pending_up_to.sql")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_statements_name_the_configured_outbox_and_are_shared() {
        let tables = TableNames::new(Some("billing"), "acme_").unwrap();
        let s = CdcStatements::shared(&tables);
        assert!(s.park.contains(r#""billing"."acme_outbox""#), "{}", s.park);
        assert!(!s.mark_published.contains("--"), "{}", s.mark_published);
        assert!(Arc::ptr_eq(&s, &CdcStatements::shared(&tables)));
    }
}
