//! Hostile rows: a foreign writer that inserts into the outbox with plain SQL (the documented
//! contract, no idem library) values the contract must refuse, and values it accepts that the
//! pipeline must contain — parked at the relay, or dead-lettered (or handled) by every consumer
//! group, each with its reason — while the other events keep flowing and no process panics.
//!
//! A round inserts the whole catalogue with fresh event ids and aggregate ids of its own, so a
//! contained row holds back nothing but itself. Besides single statements, a round runs writers
//! of more than one statement ([`TRANSACTIONS`]): an ORM's insert-then-update, a park-edit-unpark
//! in the inserting transaction, and a writer with its own search_path shadowing what the
//! outbox's triggers use. One row names a topic that does not exist (the run's brokers create
//! none: the relays park it), one is refused by a business rule of the consumers' database
//! ([`BUSINESS_RULE`]: both groups dead-letter it).

use std::collections::BTreeMap;

use idem_sql::AnyPool;

/// What the contract should do with a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expect {
    /// A CHECK, a type or a unique constraint refuses it at insert.
    Refused,
    /// Stored; then parked or dead-lettered.
    Contained,
    /// Either is right (PostgreSQL may or may not store it, depending on its limits).
    Either,
}

struct Row {
    name: &'static str,
    expect: Expect,
    /// Extra columns, and their values (SQL), after the common ones.
    columns: &'static str,
    values: &'static str,
    /// Event type and payload (SQL).
    event_type: &'static str,
    payload: &'static str,
}

use Expect::{Contained, Either, Refused};

/// (name, expected, extra columns, their values, event type, payload).
#[rustfmt::skip]
const CATALOGUE: &[(&str, Expect, &str, &str, &str, &str)] = &[
    // Refused by the contract's CHECKs (migration 6 for the timestamps).
    ("infinite_occurred_at", Refused, ", occurred_at", ", 'infinity'", "{event_type}", "'{}'"),
    ("year_262144_created_at", Refused, ", created_at", ", '262144-01-01'", "{event_type}", "'{}'"),
    ("topic_with_a_space", Refused, ", topic", ", 'bad topic'", "{event_type}", "'{}'"),
    ("headers_not_an_object", Refused, ", headers", ", '[1, 2]'", "{event_type}", "'{}'"),
    ("event_type_with_sql", Refused, "", "", "order'; DROP TABLE orders; --", "'{}'"),
    ("reused_event_id", Refused, "", "", "{event_type}", "'{}'"),
    // Stored, then contained.
    ("payload_over_a_megabyte", Contained, "", "", "{event_type}",
        "jsonb_build_object('order_id', 'h', 'payment_id', 'h', 'blob', repeat('x', 1100000))"),
    ("payload_with_wrong_types", Contained, "", "", "{event_type}",
        r#"'{"order_id": 1, "payment_id": [], "amount_minor": "NaN"}'"#),
    ("payload_json_null", Contained, "", "", "{event_type}", "'null'"),
    ("unknown_event_type", Contained, "", "", "idem.chaos.hostile", "'{}'"),
    ("headers_with_non_string_values", Contained, ", headers",
        r#", '{"x": 5, "ce_id": "forged", "idem_aggregate_seq": {"n": 1}}'"#, "{event_type}", "'{}'"),
    ("traceparent_of_5000_bytes", Contained, ", traceparent", ", repeat('z', 5000)", "{event_type}", "'{}'"),
    ("earliest_occurred_at", Contained, ", occurred_at", ", '0001-01-01T00:00:00Z'", "{event_type}", "'{}'"),
    ("unicode_aggregate_id", Contained, "", "", "{event_type}", "'null'"),
    ("payload_nested_5000_deep", Either, "", "", "{event_type}",
        "(repeat('[', 5000) || repeat(']', 5000))::jsonb"),
    // A byte that is not UTF-8: the run's databases are UTF8, whose input refuses it (a
    // SQL_ASCII database stores it, and the outbox's own check refuses it there: schema 17).
    ("text_that_is_not_utf8", Refused, ", traceparent", r", E'\xff'", "{event_type}", "'{}'"),
    // Parked by the relays once the cluster says the topic does not exist.
    ("topic_that_does_not_exist", Contained, ", topic", ", 'chaos-no-such-topic'", "{event_type}",
        "'{}'"),
    // A well-formed event the consumers' database refuses (RAISE EXCEPTION, SQLSTATE P0001).
];

/// The row [`BUSINESS_RULE`] refuses, when the consumers' database has it.
const REFUSED_BY_RULE: (&str, Expect, &str, &str, &str, &str) = (
    "refused_by_a_business_rule",
    Contained,
    "",
    "",
    "{event_type}",
    r#"jsonb_build_object('order_id', 'hostile-{round}', 'payment_id', 'refused-by-rule-{round}', 'amount', '1.00', 'currency', 'EUR')"#,
);

/// The topic an ACL denies the run's principal in a secured run (`--tls`): the relays must
/// park its row as one they may not write.
pub(super) const DENIED_TOPIC: &str = "chaos-denied-topic";

/// The consumers' business rule: payments named `refused-by-rule-…` are refused with `RAISE
/// EXCEPTION` (P0001), by the settlement and the audit tables alike.
pub(super) const BUSINESS_RULE: &str = r"
CREATE OR REPLACE FUNCTION chaos_business_rule() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.payment_id LIKE 'refused-by-rule-%' THEN
        RAISE EXCEPTION 'payment % is refused by a business rule', NEW.payment_id;
    END IF;
    RETURN NEW;
END
$$;
CREATE OR REPLACE TRIGGER chaos_business_rule BEFORE INSERT ON settlements
    FOR EACH ROW EXECUTE FUNCTION chaos_business_rule();
CREATE OR REPLACE TRIGGER chaos_business_rule BEFORE INSERT ON audit_log
    FOR EACH ROW EXECUTE FUNCTION chaos_business_rule();
";

/// Installs [`BUSINESS_RULE`] in the consumers' database (again: it replaces itself).
pub(crate) async fn install_business_rule(settlement: &sqlx::PgPool) -> anyhow::Result<()> {
    sqlx::raw_sql(BUSINESS_RULE)
        .execute(settlement)
        .await
        .map_err(|e| anyhow::anyhow!("installing the business rule: {e}"))?;
    Ok(())
}

/// Writers of more than one statement, each in one transaction: (name, expected, statements,
/// a check after the commit that must return true). `{insert}` is an insert of an event of the
/// writer's own aggregate `{aggregate}`.
#[rustfmt::skip]
const TRANSACTIONS: &[(&str, Expect, &[&str], Option<&str>)] = &[
    // An ORM's flush-then-update: the CDC relay streams the INSERT, so the outbox refuses it.
    ("orm_insert_then_update", Refused, &[
        "{insert}",
        "UPDATE idem_outbox SET payload = '{\"edited\": true}' WHERE aggregate_id = {aggregate}",
    ], None),
    // The same through a park in the inserting transaction (schema 20).
    ("park_edit_unpark_in_one_transaction", Refused, &[
        "{insert}",
        "UPDATE idem_outbox SET status = 'parked', last_error = 'x' WHERE aggregate_id = {aggregate}",
        "UPDATE idem_outbox SET payload = '{\"edited\": true}' WHERE aggregate_id = {aggregate}",
        "UPDATE idem_outbox SET status = 'pending' WHERE aggregate_id = {aggregate}",
    ], None),
    // A TEMP table named like the aggregates' counter and a function named like the one that
    // stamps the WAL position, first on the writer's search_path: the triggers use neither.
    ("writer_with_its_own_search_path", Contained, &[
        "CREATE SCHEMA IF NOT EXISTS chaos_hostile",
        "CREATE OR REPLACE FUNCTION chaos_hostile.pg_current_wal_insert_lsn() RETURNS pg_lsn \
         LANGUAGE sql AS $$ SELECT 'FFFFFFFF/FFFFFFFF'::pg_lsn $$",
        "CREATE TEMP TABLE idem_outbox_aggregates (aggregate_type text, aggregate_id text, \
         last_seq bigint, PRIMARY KEY (aggregate_type, aggregate_id)) ON COMMIT DROP",
        "INSERT INTO pg_temp.idem_outbox_aggregates VALUES ({aggregate_type}, {aggregate}, 41)",
        "SET LOCAL search_path = chaos_hostile, pg_temp, pg_catalog, public",
        "{insert}",
        "{insert}",
    ], Some(
        "SELECT array_agg(aggregate_seq::bigint ORDER BY id) = ARRAY[1, 2]::bigint[] \
           AND bool_and(written_lsn <= pg_current_wal_insert_lsn()) \
         FROM public.idem_outbox WHERE aggregate_type = {aggregate_type} \
         AND aggregate_id = {aggregate}",
    )),
];

/// What a round writes and who must account for what it stores: the aggregate type and event
/// type of the pipeline's events, the consumer groups that read their topic, and which of the
/// rows that only some pipelines contain it holds.
#[derive(Clone, Debug)]
pub(crate) struct Shape {
    pub aggregate_type: String,
    pub event_type: String,
    pub groups: Vec<String>,
    /// The consumers' database has [`BUSINESS_RULE`]: a row it refuses is written too.
    pub business_rule: bool,
    /// The run has [`DENIED_TOPIC`]: a row names it.
    pub denied: bool,
}

impl Shape {
    fn fill(&self, sql: &str) -> String {
        sql.replace("{aggregate_type}", &literal(&self.aggregate_type))
            .replace("{event_type}", &self.event_type)
    }
}

/// `text` as a SQL string literal.
fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

fn catalogue(shape: &Shape) -> Vec<Row> {
    let mut rows: Vec<Row> = CATALOGUE.iter().map(row).collect();
    if shape.business_rule {
        rows.push(row(&REFUSED_BY_RULE));
    }
    if shape.denied {
        rows.push(Row {
            name: "topic_the_relay_may_not_write",
            expect: Contained,
            columns: ", topic",
            values: ", 'chaos-denied-topic'",
            event_type: "{event_type}",
            payload: "'{}'",
        });
    }
    rows
}

fn row(
    &(name, expect, columns, values, event_type, payload): &(
        &'static str,
        Expect,
        &'static str,
        &'static str,
        &'static str,
        &'static str,
    ),
) -> Row {
    Row {
        name,
        expect,
        columns,
        values,
        event_type,
        payload,
    }
}

fn insert_sql(round: u64, r: &Row, shape: &Shape) -> String {
    let event_id = if r.name == "reused_event_id" {
        "(SELECT event_id FROM idem_outbox ORDER BY id LIMIT 1)"
    } else {
        "gen_random_uuid()"
    };
    let aggregate_id = if r.name == "unicode_aggregate_id" {
        "repeat('한', 170)".to_owned()
    } else {
        format!("'hostile-{round}-{}'", r.name)
    };
    format!(
        "INSERT INTO idem_outbox (event_id, aggregate_type, aggregate_id, event_type, payload{}) \
         VALUES ({event_id}, {}, {aggregate_id}, {}, {}{}) RETURNING event_id::text",
        r.columns,
        literal(&shape.aggregate_type),
        literal(&shape.fill(r.event_type)),
        r.payload.replace("{round}", &round.to_string()),
        r.values
    )
}

/// The statements of a writer of more than one statement, placeholders filled in.
fn transaction_sql(round: u64, name: &str, statements: &[&str], shape: &Shape) -> Vec<String> {
    let aggregate = format!("'hostile-{round}-{name}'");
    let insert = format!(
        "INSERT INTO public.idem_outbox (event_id, aggregate_type, aggregate_id, event_type, \
         payload) VALUES (gen_random_uuid(), {}, {aggregate}, {}, '{{}}') \
         RETURNING event_id::text",
        literal(&shape.aggregate_type),
        literal(&shape.event_type)
    );
    statements
        .iter()
        .map(|s| {
            shape
                .fill(s)
                .replace("{insert}", &insert)
                .replace("{aggregate}", &aggregate)
        })
        .collect()
}

/// Runs one writer of more than one statement in a transaction: the event ids it stored, or
/// the first refusal.
async fn run_transaction(
    pool: &sqlx::PgPool,
    statements: &[String],
    check: Option<&str>,
) -> Result<(Vec<String>, bool), sqlx::Error> {
    let mut tx = pool.begin().await?;
    let mut stored = vec![];
    for sql in statements {
        stored.extend(
            sqlx::query_scalar::<_, String>(sql)
                .fetch_all(&mut *tx)
                .await?,
        );
    }
    tx.commit().await?;
    let held = match check {
        Some(sql) => sqlx::query_scalar::<_, bool>(sql).fetch_one(pool).await?,
        None => true,
    };
    Ok((stored, held))
}

/// A stored hostile row, to be accounted for when the run settles.
#[derive(Clone, Debug)]
pub(crate) struct Accepted {
    pub name: String,
    pub event_id: String,
}

/// One round's result.
#[derive(Debug, Default)]
pub(crate) struct Round {
    pub accepted: Vec<Accepted>,
    pub refused: usize,
    /// Rows the contract treated otherwise than it should.
    pub violations: Vec<String>,
}

/// Inserts one round of the catalogue, in `shape`, into the outbox's database (PostgreSQL).
pub(crate) async fn insert_round(
    outbox: &AnyPool,
    round: u64,
    shape: &Shape,
) -> anyhow::Result<Round> {
    let AnyPool::Postgres(pool) = outbox else {
        anyhow::bail!("hostile rows are written with PostgreSQL's SQL");
    };
    let mut out = Round::default();
    for r in catalogue(shape) {
        let sql = insert_sql(round, &r, shape);
        let stored = sqlx::query_scalar::<_, String>(&sql).fetch_one(pool).await;
        match (stored, r.expect) {
            (Ok(event_id), expect) => {
                if expect == Expect::Refused {
                    out.violations.push(format!(
                        "hostile row {}: the outbox contract accepted it (event {event_id})",
                        r.name
                    ));
                }
                out.accepted.push(Accepted {
                    name: r.name.to_owned(),
                    event_id,
                });
            }
            (Err(e), Expect::Contained) => out.violations.push(format!(
                "hostile row {}: expected PostgreSQL to store it (the harness would test nothing), got: {e}",
                r.name
            )),
            (Err(_), _) => out.refused += 1,
        }
    }
    for &(name, expect, statements, check) in TRANSACTIONS {
        let statements = transaction_sql(round, name, statements, shape);
        let aggregate = format!("'hostile-{round}-{name}'");
        let check = check.map(|c| shape.fill(c).replace("{aggregate}", &aggregate));
        match (
            run_transaction(pool, &statements, check.as_deref()).await,
            expect,
        ) {
            (Ok((stored, held)), expect) => {
                if expect == Expect::Refused {
                    out.violations.push(format!(
                        "hostile writer {name}: the outbox contract accepted it (events {stored:?})"
                    ));
                }
                if !held {
                    out.violations.push(format!(
                        "hostile writer {name}: its events are not what the outbox's triggers \
                         must make of them (aggregate_seq 1, 2 and a WAL position already \
                         written)"
                    ));
                }
                out.accepted
                    .extend(stored.into_iter().map(|event_id| Accepted {
                        name: name.to_owned(),
                        event_id,
                    }));
            }
            (Err(e), Expect::Contained) => out.violations.push(format!(
                "hostile writer {name}: expected PostgreSQL to store it, got: {e}"
            )),
            (Err(_), _) => out.refused += 1,
        }
    }
    Ok(out)
}

/// Where a stored hostile row ended.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Fate {
    /// `pending`, `published` or `parked`.
    pub status: String,
    /// The relay's reason, when parked.
    pub last_error: Option<String>,
    /// Per group: `Some(reason)` when dead-lettered, `Some("")` when the inbox has it.
    pub groups: BTreeMap<String, Option<String>>,
}

/// Whether a row's fate is final and contained, every one of `groups` accounting for it when
/// it was published; `Err` says what is still open.
pub(crate) fn contained(f: &Fate, groups: &[String]) -> Result<String, String> {
    match f.status.as_str() {
        "parked" => match &f.last_error {
            Some(reason) if !reason.is_empty() => Ok(format!("parked: {reason}")),
            _ => Err("parked without a reason".to_owned()),
        },
        "published" => {
            let open: Vec<&str> = groups
                .iter()
                .map(String::as_str)
                .filter(|g| f.groups.get(*g).is_none_or(Option::is_none))
                .collect();
            if open.is_empty() {
                Ok(format!("published; {}", describe_groups(f)))
            } else {
                Err(format!(
                    "published, but group(s) {} neither applied nor dead-lettered it",
                    open.join(", ")
                ))
            }
        }
        other => Err(format!("still {other} (a hostile row must not wedge)")),
    }
}

fn describe_groups(f: &Fate) -> String {
    f.groups
        .iter()
        .map(|(g, r)| match r.as_deref() {
            Some("") => format!("{g}: handled"),
            Some(reason) => format!("{g}: dead-lettered ({reason})"),
            None => format!("{g}: open"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Reads where each accepted row ended: its status in the outbox's database, and what each of
/// `groups` recorded of it in the consumers' database.
pub(crate) async fn fates(
    outbox: &AnyPool,
    consumers: &AnyPool,
    groups: &[String],
    accepted: &[Accepted],
) -> anyhow::Result<Vec<(Accepted, Fate)>> {
    let (AnyPool::Postgres(orders), AnyPool::Postgres(settlement)) = (outbox, consumers) else {
        anyhow::bail!("hostile rows are accounted with PostgreSQL's SQL");
    };
    let mut out = Vec::with_capacity(accepted.len());
    for a in accepted {
        let (status, last_error): (String, Option<String>) =
            sqlx::query_as("SELECT status, last_error FROM idem_outbox WHERE event_id = $1::uuid")
                .bind(&a.event_id)
                .fetch_one(orders)
                .await?;
        let mut by_group = BTreeMap::new();
        for g in groups {
            let letter: Option<String> = sqlx::query_scalar(
                "SELECT reason FROM idem_dead_letters WHERE consumer_group = $1 AND event_id = $2::uuid \
                 ORDER BY id DESC LIMIT 1",
            )
            .bind(g)
            .bind(&a.event_id)
            .fetch_optional(settlement)
            .await?;
            let handled: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM idem_inbox WHERE consumer_group = $1 AND event_id = $2::uuid \
                 AND status = 'processed')",
            )
            .bind(g)
            .bind(&a.event_id)
            .fetch_one(settlement)
            .await?;
            let state = letter.or_else(|| handled.then(String::new));
            by_group.insert(g.to_owned(), state);
        }
        out.push((
            a.clone(),
            Fate {
                status,
                last_error,
                groups: by_group,
            },
        ));
    }
    Ok(out)
}

/// Where each stored hostile row ended (keyed by name and event id), and the rows not
/// contained by `groups`, as violations.
pub(crate) fn hostile_rows(
    fates: &[(Accepted, Fate)],
    groups: &[String],
) -> (BTreeMap<String, String>, Vec<String>) {
    let mut rows = BTreeMap::new();
    let mut violations = vec![];
    for (a, fate) in fates {
        let key = format!("{} {}", a.name, a.event_id);
        match contained(fate, groups) {
            Ok(how) => {
                rows.insert(key, how);
            }
            Err(open) => {
                violations.push(format!("hostile row {key}: {open}"));
                rows.insert(key, open);
            }
        }
    }
    (rows, violations)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference pipeline's groups: each must account for a published row.
    fn reference_groups() -> Vec<String> {
        vec!["settlement".to_owned(), "audit".to_owned()]
    }

    /// The reference pipeline's rows: `order.paid` events of `order` aggregates, read by the
    /// settlement and audit groups, the business rule installed, a topic denied.
    fn reference_shape() -> Shape {
        Shape {
            aggregate_type: "order".into(),
            event_type: "order.paid".into(),
            groups: reference_groups(),
            business_rule: true,
            denied: true,
        }
    }

    fn fate(status: &str, last_error: Option<&str>, groups: &[(&str, Option<&str>)]) -> Fate {
        Fate {
            status: status.to_owned(),
            last_error: last_error.map(str::to_owned),
            groups: groups
                .iter()
                .map(|(g, r)| ((*g).to_owned(), r.map(str::to_owned)))
                .collect(),
        }
    }

    #[test]
    fn only_a_parked_row_with_a_reason_or_one_every_group_settled_is_contained() {
        let g = reference_groups();
        assert!(contained(&fate("parked", Some("too large"), &[]), &g).is_ok());
        assert!(contained(&fate("parked", None, &[]), &g).is_err());
        assert!(contained(&fate("pending", None, &[]), &g).is_err());
        let both = [("settlement", Some("bad payload")), ("audit", Some(""))];
        assert!(contained(&fate("published", None, &both), &g).is_ok());
        let one = [("settlement", Some("bad payload")), ("audit", None)];
        let open = contained(&fate("published", None, &one), &g).unwrap_err();
        assert!(open.contains("audit"), "{open}");
        assert!(contained(&fate("published", None, &[("settlement", Some("x"))]), &g).is_err());
    }

    #[test]
    fn every_row_of_the_catalogue_is_one_statement_with_its_own_aggregate() {
        let shape = reference_shape();
        let rows = catalogue(&shape);
        let mut seen = std::collections::BTreeSet::new();
        for r in &rows {
            assert!(seen.insert(r.name), "{} twice", r.name);
            let sql = insert_sql(7, r, &shape);
            assert!(sql.ends_with("RETURNING event_id::text"), "{sql}");
            assert_eq!(sql.matches("INSERT").count(), 1, "{sql}");
        }
        assert!(rows.iter().any(|r| r.expect == Expect::Refused));
        assert!(rows.iter().any(|r| r.expect == Expect::Contained));
    }
}
