//! One migration runner over the dialects' primitives (the lock, the migrations table).

use idem_core::{Error, Result, TableNames};
use sqlx::Pool;

use crate::Dialect;
use crate::dialect::{Stmt, get};

/// What [`migrate`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MigrationReport {
    /// Versions applied by this call.
    pub applied: Vec<i64>,
    /// Highest version now in the database.
    pub current: i64,
}

/// Migrations of one dialect: (version, description, SQL).
pub(crate) type Migrations = &'static [(i64, &'static str, &'static str)];

/// The migrations shipped for a dialect directory (`migrations/$dir/NNNN_*.sql`).
macro_rules! migrations {
    (
        $dir:literal,
        $tenth:literal,
        $eleventh:literal,
        $twelfth:literal,
        $thirteenth:literal,
        $fourteenth:literal,
        $fifteenth:literal,
        $sixteenth:literal,
        $seventeenth:literal,
        $eighteenth:literal,
        $nineteenth:literal,
        $twentieth:literal,
        $twentyfirst:literal,
        $twentysecond:literal,
        $last:literal
    ) => {
        &[
            (
                1,
                "outbox",
                include_str!(concat!("../../migrations/", $dir, "/0001_outbox.sql")),
            ),
            (
                2,
                "inbox",
                include_str!(concat!("../../migrations/", $dir, "/0002_inbox.sql")),
            ),
            (
                3,
                "idempotency keys",
                include_str!(concat!(
                    "../../migrations/",
                    $dir,
                    "/0003_idempotency_keys.sql"
                )),
            ),
            (
                4,
                "effect intents",
                include_str!(concat!(
                    "../../migrations/",
                    $dir,
                    "/0004_effect_intents.sql"
                )),
            ),
            (
                5,
                "outbox name checks",
                include_str!(concat!(
                    "../../migrations/",
                    $dir,
                    "/0005_outbox_name_checks.sql"
                )),
            ),
            (
                6,
                "outbox timestamp checks",
                include_str!(concat!(
                    "../../migrations/",
                    $dir,
                    "/0006_outbox_timestamp_checks.sql"
                )),
            ),
            (
                7,
                "idempotency claim tokens",
                include_str!(concat!(
                    "../../migrations/",
                    $dir,
                    "/0007_idempotency_claim_tokens.sql"
                )),
            ),
            (
                8,
                "effect intent sending mark",
                include_str!(concat!(
                    "../../migrations/",
                    $dir,
                    "/0008_intent_sending_mark.sql"
                )),
            ),
            (
                9,
                "dead-letter replay",
                include_str!(concat!(
                    "../../migrations/",
                    $dir,
                    "/0009_dead_letter_replay.sql"
                )),
            ),
            (
                10,
                $tenth,
                include_str!(concat!(
                    "../../migrations/",
                    $dir,
                    "/0010_outbox_seq_inserted_only.sql"
                )),
            ),
            (
                11,
                $eleventh,
                include_str!(concat!(
                    "../../migrations/",
                    $dir,
                    "/0011_outbox_hot_lease.sql"
                )),
            ),
            (
                12,
                $twelfth,
                include_str!(concat!(
                    "../../migrations/",
                    $dir,
                    "/0012_outbox_rules_in_trigger.sql"
                )),
            ),
            (
                13,
                $thirteenth,
                include_str!(concat!(
                    "../../migrations/",
                    $dir,
                    "/0013_emit_message_revoked.sql"
                )),
            ),
            (
                14,
                $fourteenth,
                include_str!(concat!(
                    "../../migrations/",
                    $dir,
                    "/0014_outbox_written_lsn.sql"
                )),
            ),
            (
                15,
                $fifteenth,
                include_str!(concat!(
                    "../../migrations/",
                    $dir,
                    "/0015_outbox_written_lsn_kept.sql"
                )),
            ),
            (
                16,
                $sixteenth,
                include_str!(concat!(
                    "../../migrations/",
                    $dir,
                    "/0016_outbox_triggers_own_search_path.sql"
                )),
            ),
            (
                17,
                $seventeenth,
                include_str!(concat!(
                    "../../migrations/",
                    $dir,
                    "/0017_outbox_text_converts_to_utf8.sql"
                )),
            ),
            (
                18,
                $eighteenth,
                include_str!(concat!(
                    "../../migrations/",
                    $dir,
                    "/0018_outbox_id_generated_always.sql"
                )),
            ),
            (
                19,
                $nineteenth,
                include_str!(concat!(
                    "../../migrations/",
                    $dir,
                    "/0019_outbox_events_written_once.sql"
                )),
            ),
            (
                20,
                $twentieth,
                include_str!(concat!(
                    "../../migrations/",
                    $dir,
                    "/0020_outbox_parked_edits_after_commit.sql"
                )),
            ),
            (
                21,
                $twentyfirst,
                include_str!(concat!(
                    "../../migrations/",
                    $dir,
                    "/0021_outbox_unpark_checked.sql"
                )),
            ),
            (
                22,
                $twentysecond,
                include_str!(concat!(
                    "../../migrations/",
                    $dir,
                    "/0022_dead_letter_replay_requests.sql"
                )),
            ),
            (
                23,
                $last,
                include_str!(concat!(
                    "../../migrations/",
                    $dir,
                    "/0023_operator_console.sql"
                )),
            ),
        ]
    };
}
pub(crate) use migrations;

/// Creates or upgrades idem's tables. Safe to run concurrently (the dialect's migration lock
/// serializes migrators: an advisory lock on PostgreSQL, `BEGIN IMMEDIATE` on SQLite) and
/// repeatedly (applied versions are recorded in `<prefix>schema_migrations`), all in one
/// transaction.
pub async fn migrate<DB: Dialect>(pool: &Pool<DB>, tables: &TableNames) -> Result<MigrationReport> {
    let mut conn = pool
        .acquire()
        .await
        .map_err(|e| crate::dialect::db_error("connecting to migrate", e))?;
    let mut tx = DB::begin_migration(&mut conn, tables).await?;
    let mig = tables.qualified("schema_migrations");
    let ddl = DB::migrations_table(&mig);
    Stmt::<DB>::new(&ddl)
        .execute(&mut tx)
        .await
        .map_err(|e| crate::dialect::db_error("creating the migrations table", e))?;
    let select = format!("SELECT max(version) AS version FROM {mig}");
    let current: Option<i64> = match Stmt::<DB>::new(&select).fetch_optional(&mut tx).await {
        Ok(Some(row)) => get::<DB, _>(&row, "version"),
        Ok(None) => Ok(None),
        Err(e) => Err(e),
    }
    .map_err(|e| crate::dialect::db_error("reading the schema version", e))?;
    let mut report = plan(current.unwrap_or(0), DB::migrations())?;
    let insert = format!("INSERT INTO {mig} (version, description) VALUES ($1, $2)");
    for (version, description, sql) in DB::migrations().iter().filter(|m| m.0 > report.current) {
        let sql = tables.render(sql, DB::bases());
        DB::execute_raw(&mut tx, &sql).await.map_err(|e| {
            crate::dialect::db_error(format!("running migration {version} ({description})"), e)
        })?;
        Stmt::<DB>::new(&insert)
            .bind(*version)
            .bind(*description)
            .execute(&mut tx)
            .await
            .map_err(|e| crate::dialect::db_error("recording the migration", e))?;
        report.applied.push(*version);
    }
    report.current = report.applied.last().copied().unwrap_or(report.current);
    tx.commit()
        .await
        .map_err(|e| crate::dialect::db_error("committing the migration", e))?;
    Ok(report)
}

/// Checks, before a component starts its work, that idem's tables are migrated: at least at
/// the version this build ships ([`Error::SchemaTooOld`] below it, version 0 when no migration
/// ever ran). A newer schema passes: migrations keep the tables an older build uses, so its
/// processes go on through a rolling upgrade (only [`migrate`] refuses a schema newer than its
/// build).
pub async fn check_schema<DB: Dialect>(pool: &Pool<DB>, tables: &TableNames) -> Result<()> {
    check_schema_with(pool, &crate::queries::shared::<DB>(tables)).await
}

/// [`check_schema`] with the statements of the tables already rendered.
pub(crate) async fn check_schema_with<DB: Dialect>(
    pool: &Pool<DB>,
    queries: &crate::queries::Queries,
) -> Result<()> {
    let mut conn = pool
        .acquire()
        .await
        .map_err(|e| crate::dialect::db_error("connecting to read the schema version", e))?;
    let found = match Stmt::<DB>::new(&queries.schema_version)
        .fetch_optional(&mut *conn)
        .await
    {
        Ok(Some(row)) => get::<DB, Option<i64>>(&row, "version")
            .map_err(|e| crate::dialect::db_error("reading the schema version", e))?
            .unwrap_or(0),
        Ok(None) => 0,
        Err(e) => match crate::dialect::db_error("reading the schema version", e) {
            // No migrations table: idem's tables were never created here.
            e if e.kind() == idem_core::ErrorKind::NotMigrated => 0,
            e => return Err(e),
        },
    };
    old_schema(found, DB::migrations())
}

/// Refuses a schema at `found` older than the newest of `shipped`.
fn old_schema(found: i64, shipped: Migrations) -> Result<()> {
    let needed = shipped.last().map_or(0, |m| m.0);
    if found < needed {
        return Err(Error::SchemaTooOld { found, needed });
    }
    Ok(())
}

/// What to do at schema version `current`: refuse a schema newer than this build, or start
/// the report there.
fn plan(current: i64, shipped: Migrations) -> Result<MigrationReport> {
    let supported = shipped.last().map_or(0, |m| m.0);
    if current > supported {
        return Err(Error::SchemaTooNew {
            found: current,
            supported,
        });
    }
    Ok(MigrationReport {
        applied: vec![],
        current,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHIPPED: Migrations = &[(1, "a", ""), (2, "b", "")];

    #[test]
    fn a_component_refuses_an_older_schema_and_runs_on_a_newer_one() {
        assert!(matches!(
            old_schema(0, SHIPPED),
            Err(Error::SchemaTooOld {
                found: 0,
                needed: 2
            })
        ));
        assert!(matches!(
            old_schema(1, SHIPPED),
            Err(Error::SchemaTooOld {
                found: 1,
                needed: 2
            })
        ));
        assert!(old_schema(2, SHIPPED).is_ok());
        assert!(
            old_schema(3, SHIPPED).is_ok(),
            "a rolling upgrade's newer schema"
        );
    }

    #[test]
    fn a_newer_schema_is_refused_and_an_older_one_starts_where_it_is() {
        assert!(matches!(
            plan(3, SHIPPED),
            Err(Error::SchemaTooNew {
                found: 3,
                supported: 2
            })
        ));
        assert_eq!(plan(1, SHIPPED).unwrap().current, 1);
        assert_eq!(plan(0, SHIPPED).unwrap().applied, Vec::<i64>::new());
    }
}
