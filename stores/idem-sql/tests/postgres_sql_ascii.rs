//! A `SQL_ASCII` database stores any byte. Outbox text that is not UTF-8 cannot be sent to the
//! relays (their client encoding is UTF8): one such row failed every claim of the polling relay
//! and every session of the CDC relay, for every aggregate. The contract refuses it at insert
//! and update (schema 17), rows stored before are parked by the migration, and the others flow.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use idem_conformance::pg::TestDb;
use idem_core::TableNames;
use idem_core::outbox::ClaimRequest;
use idem_core::store::OutboxStore;
type PgStore = idem_sql::RelayStore<sqlx::Postgres>;

const SQL_ASCII: &str = "ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0";

/// `0xff`, a byte that is never UTF-8, as text of the database.
const FF: &str = "convert_from('\\xff'::bytea, 'SQL_ASCII')";

async fn sql_ascii_db() -> (TestDb, PgStore) {
    let db = TestDb::create_with(SQL_ASCII).await;
    let encoding: String = sqlx::query_scalar("SELECT getdatabaseencoding()::text")
        .fetch_one(db.pool())
        .await
        .unwrap();
    assert_eq!(encoding, "SQL_ASCII");
    let tables = TableNames::default();
    idem_sql::migrate(db.pool(), &tables).await.unwrap();
    let store = PgStore::new(db.pool().clone(), tables);
    (db, store)
}

fn insert(aggregate_id: &str, payload: &str, headers: &str, traceparent: &str) -> String {
    format!(
        "INSERT INTO idem_outbox (event_id, aggregate_type, aggregate_id, event_type, payload, headers, traceparent) \
         VALUES (gen_random_uuid(), 'order', {aggregate_id}, 'order.paid', {payload}, {headers}, {traceparent})"
    )
}

async fn claim(store: &PgStore) -> idem_core::outbox::Claim {
    store
        .claim(&ClaimRequest {
            relay_id: "r".to_owned(),
            batch_size: 100,
            lease: Duration::from_secs(60),
        })
        .await
        .unwrap()
}

#[tokio::test]
async fn text_that_is_not_utf8_is_refused_at_insert_and_update_and_the_others_flow() {
    let (db, store) = sql_ascii_db().await;
    let in_json = format!("('{{\"a\": \"' || {FF} || '\"}}')::jsonb");
    let in_key = format!("('{{\"' || {FF} || '\": \"v\"}}')::jsonb");
    let bad_id = format!("'o-' || {FF}");
    let cases = [
        ("aggregate_id", insert(&bad_id, "'{}'", "'{}'", "NULL")),
        ("payload", insert("'o-1'", &in_json, "'{}'", "NULL")),
        ("headers", insert("'o-1'", "'{}'", &in_json, "NULL")),
        ("headers", insert("'o-1'", "'{}'", &in_key, "NULL")),
        ("traceparent", insert("'o-1'", "'{}'", "'{}'", &bad_id)),
    ];
    for (column, sql) in &cases {
        let err = sqlx::query(sql)
            .execute(db.pool())
            .await
            .expect_err(column)
            .to_string();
        assert!(
            err.contains(&format!("idem_outbox_{column}_check")),
            "{column}: {err}"
        );
    }
    // Valid UTF-8 beyond ASCII is accepted: 'o-é', and a payload with 'é'.
    let e_acute = "convert_from('\\xc3a9'::bytea, 'SQL_ASCII')";
    let good = insert(
        &format!("'o-' || {e_acute}"),
        &format!("('{{\"a\": \"' || {e_acute} || '\"}}')::jsonb"),
        "'{}'",
        "NULL",
    );
    sqlx::query(&good).execute(db.pool()).await.unwrap();
    for (column, value) in [
        ("payload", in_json.as_str()),
        ("traceparent", bad_id.as_str()),
    ] {
        let err = sqlx::query(&format!("UPDATE idem_outbox SET {column} = {value}"))
            .execute(db.pool())
            .await
            .expect_err(column)
            .to_string();
        assert!(
            err.contains(&format!("idem_outbox_{column}_check")),
            "{column}: {err}"
        );
    }
    let claimed = claim(&store).await;
    let ids: Vec<&str> = claimed
        .records
        .iter()
        .map(|r| r.aggregate_id.as_str())
        .collect();
    assert_eq!(ids, vec!["o-é"]);
    assert_eq!(claimed.records[0].payload, r#"{"a": "é"}"#);
}

#[tokio::test]
async fn rows_stored_before_the_rule_are_parked_by_the_migration_and_the_others_flow() {
    let (db, store) = sql_ascii_db().await;
    // Written with the rules off, as a database upgraded from version 16 holds them.
    sqlx::query("ALTER TABLE idem_outbox DISABLE TRIGGER idem_outbox_accept")
        .execute(db.pool())
        .await
        .unwrap();
    let bad_id = format!("'o-' || {FF}");
    sqlx::query(&insert(&bad_id, "'{}'", "'{}'", "NULL"))
        .execute(db.pool())
        .await
        .unwrap();
    sqlx::query(&insert("'o-2'", "'{}'", "'{}'", "NULL"))
        .execute(db.pool())
        .await
        .unwrap();
    sqlx::query("ALTER TABLE idem_outbox ENABLE TRIGGER idem_outbox_accept")
        .execute(db.pool())
        .await
        .unwrap();
    // Back to version 16: the migrator applies every version past the newest recorded one,
    // so the versions after 17 are forgotten too (each of them runs again unchanged).
    sqlx::query("DELETE FROM idem_schema_migrations WHERE version >= 17")
        .execute(db.pool())
        .await
        .unwrap();
    let again = idem_sql::migrate(db.pool(), &TableNames::default())
        .await
        .unwrap();
    assert_eq!(again.applied.first(), Some(&17), "{:?}", again.applied);
    let (status, why): (String, String) =
        sqlx::query_as("SELECT status, last_error FROM idem_outbox WHERE aggregate_id <> 'o-2'")
            .fetch_one(db.pool())
            .await
            .unwrap();
    assert_eq!(status, "parked");
    assert!(
        why.contains("aggregate_id does not convert to UTF-8"),
        "{why}"
    );
    let claimed = claim(&store).await;
    let ids: Vec<&str> = claimed
        .records
        .iter()
        .map(|r| r.aggregate_id.as_str())
        .collect();
    assert_eq!(ids, vec!["o-2"]);
}
