//! The statements of a dialect, rendered once per [`TableNames`] and shared.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, OnceLock};

use idem_core::{Result, TableNames};
use sqlx::Pool;

use crate::Dialect;

/// Names the statements of a query set, once: the raw text per dialect ([`SqlSet`]) and the
/// rendered set ([`Queries`]) have the same fields.
macro_rules! statements {
    ($($name:ident),* $(,)?) => {
        /// The raw statements of one dialect, `{table}` placeholders unrendered.
        #[derive(Debug)]
        pub struct SqlSet {
            $(pub(crate) $name: &'static str,)*
        }

        /// The statements of one dialect rendered for one set of tables.
        #[derive(Debug)]
        pub(crate) struct Queries {
            $(pub(crate) $name: String,)*
        }

        impl Queries {
            fn render(set: &SqlSet, t: &TableNames, bases: &[&str]) -> Self {
                Queries { $($name: without_comments(&t.render(set.$name, bases)),)* }
            }

            #[cfg(test)]
            pub(crate) fn all(&self) -> Vec<&str> {
                vec![$(self.$name.as_str(),)*]
            }
        }
    };
}

statements!(
    enqueue,
    claim,
    mark_published,
    release,
    prune_delete,
    prune_archive,
    status,
    backlog,
    parked,
    retry_parked,
    retry_parked_one,
    inbox_record,
    dead_letter,
    dead_letters,
    inbox_dead_lettered,
    inbox_replay,
    dead_letters_open,
    dead_letter_replayed,
    dead_letter_find,
    dead_letters_request,
    dead_letters_requested,
    inbox_prune,
    key_claim,
    key_get,
    key_renew,
    key_complete,
    key_release,
    key_sweep,
    intent_record,
    intent_record_all,
    intent_claim,
    intent_finish,
    intent_stuck,
    intent_retry,
    intent_retry_one,
    intent_get,
    intent_resolve,
    intent_mark_sending,
    intent_prune,
    schema_version,
);

/// The statements of dialect directory `$dir` (`sql/$dir/*.sql`; identical text in
/// `sql/common/`), with `$mark`/`$release` the files that mark rows published and release failed
/// ones (one file for both where the dialect does both in one statement), and
/// `$one_parked`/`$one_intent` the per-id forms where the dialect has no arrays (the set form
/// otherwise).
macro_rules! sql_set {
    ($dir:literal, $mark:literal, $release:literal, $retry_parked_one:literal, $intent_retry_one:literal) => {
        $crate::queries::SqlSet {
            enqueue: include_str!(concat!("../../sql/", $dir, "/enqueue.sql")),
            claim: include_str!(concat!("../../sql/", $dir, "/claim.sql")),
            mark_published: include_str!(concat!("../../sql/", $dir, "/", $mark)),
            release: include_str!(concat!("../../sql/", $dir, "/", $release)),
            prune_delete: include_str!(concat!("../../sql/", $dir, "/prune_delete.sql")),
            prune_archive: include_str!(concat!("../../sql/", $dir, "/prune_archive.sql")),
            status: include_str!(concat!("../../sql/", $dir, "/status.sql")),
            backlog: include_str!(concat!("../../sql/", $dir, "/backlog.sql")),
            parked: include_str!("../../sql/common/parked.sql"),
            retry_parked: include_str!(concat!("../../sql/", $dir, "/retry_parked.sql")),
            retry_parked_one: include_str!(concat!("../../sql/", $dir, "/", $retry_parked_one)),
            inbox_record: include_str!(concat!("../../sql/", $dir, "/inbox_record.sql")),
            dead_letter: include_str!(concat!("../../sql/", $dir, "/dead_letter.sql")),
            dead_letters: include_str!(concat!("../../sql/", $dir, "/dead_letters.sql")),
            inbox_dead_lettered: include_str!(concat!(
                "../../sql/",
                $dir,
                "/inbox_dead_lettered.sql"
            )),
            inbox_replay: include_str!(concat!("../../sql/", $dir, "/inbox_replay.sql")),
            dead_letters_open: include_str!(concat!("../../sql/", $dir, "/dead_letters_open.sql")),
            dead_letter_replayed: include_str!(concat!(
                "../../sql/",
                $dir,
                "/dead_letter_replayed.sql"
            )),
            dead_letter_find: include_str!(concat!("../../sql/", $dir, "/dead_letter_find.sql")),
            dead_letters_request: include_str!(concat!(
                "../../sql/",
                $dir,
                "/dead_letters_request.sql"
            )),
            dead_letters_requested: include_str!(concat!(
                "../../sql/",
                $dir,
                "/dead_letters_requested.sql"
            )),
            inbox_prune: include_str!(concat!("../../sql/", $dir, "/inbox_prune.sql")),
            key_claim: include_str!(concat!("../../sql/", $dir, "/key_claim.sql")),
            key_get: include_str!("../../sql/common/key_get.sql"),
            key_renew: include_str!(concat!("../../sql/", $dir, "/key_renew.sql")),
            key_complete: include_str!(concat!("../../sql/", $dir, "/key_complete.sql")),
            key_release: include_str!("../../sql/common/key_release.sql"),
            key_sweep: include_str!(concat!("../../sql/", $dir, "/key_sweep.sql")),
            intent_record: include_str!(concat!("../../sql/", $dir, "/intent_record.sql")),
            intent_record_all: include_str!(concat!("../../sql/", $dir, "/intent_record_all.sql")),
            intent_claim: include_str!(concat!("../../sql/", $dir, "/intent_claim.sql")),
            intent_finish: include_str!(concat!("../../sql/", $dir, "/intent_finish.sql")),
            intent_stuck: include_str!("../../sql/common/intent_stuck.sql"),
            intent_retry: include_str!(concat!("../../sql/", $dir, "/intent_retry.sql")),
            intent_retry_one: include_str!(concat!("../../sql/", $dir, "/", $intent_retry_one)),
            intent_get: include_str!(concat!("../../sql/", $dir, "/intent_get.sql")),
            intent_resolve: include_str!(concat!("../../sql/", $dir, "/intent_resolve.sql")),
            intent_mark_sending: include_str!(concat!(
                "../../sql/",
                $dir,
                "/intent_mark_sending.sql"
            )),
            intent_prune: include_str!(concat!("../../sql/", $dir, "/intent_prune.sql")),
            schema_version: include_str!("../../sql/common/schema_version.sql"),
        }
    };
}
pub(crate) use sql_set;

/// A pool and the statements for its tables: what every store holds.
#[derive(Debug)]
pub(crate) struct Handle<DB: Dialect> {
    pub(crate) pool: Pool<DB>,
    pub(crate) queries: Arc<Queries>,
}

impl<DB: Dialect> Clone for Handle<DB> {
    fn clone(&self) -> Self {
        Handle {
            pool: self.pool.clone(),
            queries: Arc::clone(&self.queries),
        }
    }
}

impl<DB: Dialect> Handle<DB> {
    pub(crate) fn new(pool: Pool<DB>, tables: &TableNames) -> Self {
        Handle {
            pool,
            queries: shared::<DB>(tables),
        }
    }

    /// A connection of the pool; `context` names what it is for in the error.
    pub(crate) async fn conn(&self, context: &str) -> Result<sqlx::pool::PoolConnection<DB>> {
        self.pool
            .acquire()
            .await
            .map_err(|e| crate::dialect::db_error(context.to_owned(), e))
    }
}

type Cache = Mutex<HashMap<(&'static str, Option<String>, String), Arc<Queries>>>;

/// The statements of `DB` for `tables`, rendered on first use and shared by every store of the
/// process over the same tables.
pub(crate) fn shared<DB: Dialect>(tables: &TableNames) -> Arc<Queries> {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let key = (
        DB::NAME,
        tables.schema().map(str::to_owned),
        tables.prefix().to_owned(),
    );
    memoized(&CACHE, key, || {
        Queries::render(DB::sql(), tables, DB::bases())
    })
}

/// The value cached under `key`, made by `make` on first use and shared after: statement sets
/// are rendered once per process and table names.
pub(crate) fn memoized<K: Eq + Hash, T>(
    cache: &OnceLock<Mutex<HashMap<K, Arc<T>>>>,
    key: K,
    make: impl FnOnce() -> T,
) -> Arc<T> {
    let mut cache = cache
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    Arc::clone(cache.entry(key).or_insert_with(|| Arc::new(make())))
}

/// `sql` with its dialect tokens replaced: `{::text}`, `{::uuid}` and `{::bigint}` are casts on
/// PostgreSQL and nothing on SQLite (whose values carry their own type), so that statements
/// that differ only by a cast are one file in `sql/common/`.
pub(crate) fn for_scheme(sql: &str, scheme: crate::Scheme) -> String {
    let mut out = sql.to_owned();
    for token in ["::text", "::uuid", "::bigint"] {
        let cast = match scheme {
            crate::Scheme::Postgres => token,
            crate::Scheme::Sqlite => "",
        };
        out = out.replace(&format!("{{{token}}}"), cast);
    }
    out
}

/// `sql` without its comment lines (a line whose first non-blank characters are `--`): the
/// files explain each statement at length, and that text would otherwise travel with every
/// execution and fill sqlx's slow-statement warnings. No statement has a string literal that
/// spans lines.
pub(crate) fn without_comments(sql: &str) -> String {
    sql.lines()
        .filter(|l| !l.trim_start().starts_with("--"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comment_lines_are_left_out_and_the_statement_kept() {
        let sql = "-- Claims rows.\n--\nWITH heads AS (\n    -- the heads\n    SELECT 1 -- one\n)\nSELECT '--' FROM heads";
        assert_eq!(
            without_comments(sql),
            "WITH heads AS (\n    SELECT 1 -- one\n)\nSELECT '--' FROM heads"
        );
    }

    /// No statement keeps a comment line, and none is empty without them.
    #[cfg(feature = "postgres")]
    #[test]
    fn the_statements_travel_without_their_comments() {
        let q = shared::<sqlx::Postgres>(&TableNames::default());
        for sql in q.all() {
            assert!(!sql.trim().is_empty());
            assert!(
                !sql.lines().any(|l| l.trim_start().starts_with("--")),
                "{sql}"
            );
        }
    }

    fn every_placeholder_is_rendered_for<DB: Dialect>() {
        let t = TableNames::default();
        let q = shared::<DB>(&t);
        let migrations: Vec<String> = DB::migrations()
            .iter()
            .map(|m| t.render(m.2, DB::bases()))
            .collect();
        for sql in q
            .all()
            .into_iter()
            .chain(migrations.iter().map(String::as_str))
        {
            for base in DB::bases() {
                assert!(
                    !sql.contains(&format!("{{{base}}}"))
                        && !sql.contains(&format!("{{bare:{base}}}")),
                    "unrendered {base} in {sql}"
                );
            }
        }
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn every_placeholder_is_rendered_on_postgres() {
        every_placeholder_is_rendered_for::<sqlx::Postgres>();
    }

    #[cfg(feature = "sqlite")]
    #[test]
    fn every_placeholder_is_rendered_on_sqlite() {
        every_placeholder_is_rendered_for::<sqlx::Sqlite>();
    }

    #[cfg(feature = "sqlite")]
    #[test]
    fn one_set_of_tables_is_rendered_once() {
        let t = TableNames::new(None, "once_").unwrap();
        assert!(Arc::ptr_eq(
            &shared::<sqlx::Sqlite>(&t),
            &shared::<sqlx::Sqlite>(&t)
        ));
    }
}
