//! The store conformance suite against a real PostgreSQL server (`IDEM_TEST_PG_URL`).

use idem_conformance::backend::{Backend, OpenTx, Pg};
use idem_conformance::scenarios;
use idem_core::TableNames;
use idem_core::store::OutboxStore;

idem_conformance::conformance_tests!(Pg::new().await);

#[tokio::test]
async fn tables_in_a_named_schema() {
    let pg = Pg::new().await;
    let billing = pg.with_tables(TableNames::new(Some("billing"), "idem_").unwrap());
    assert_eq!(
        billing.migrate().await.unwrap(),
        vec![
            1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23
        ]
    );
    let mut tx = billing.begin().await;
    tx.enqueue(&[scenarios::event("o-1", 0)]).await.unwrap();
    tx.commit().await;
    assert_eq!(
        pg.scalar("SELECT count(*) FROM billing.idem_outbox").await,
        1
    );
    assert_eq!(pg.store().status().await.unwrap().pending, 0);
}

#[tokio::test]
async fn concurrent_migrations_apply_once() {
    let pg = Pg::new().await;
    let other = pg.with_tables(TableNames::new(None, "twice_").unwrap());
    let again = pg.with_tables(TableNames::new(None, "twice_").unwrap());
    let (a, b) = tokio::join!(other.migrate(), again.migrate());
    let mut applied = [a.unwrap(), b.unwrap()];
    applied.sort();
    assert_eq!(
        applied,
        [
            vec![],
            vec![
                1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23
            ]
        ]
    );
}

/// Timestamps PostgreSQL stores and no client library holds: refused since version 6.
const HOSTILE_TIMES: &[&str] = &[
    "infinity",
    "-infinity",
    "270000-01-01 00:00:00+00",
    "10000-01-01 00:00:00+00",
];
/// Those of them chrono cannot hold either (it ends at year 262142).
const UNDECODABLE_TIMES: &[&str] = &["infinity", "-infinity", "270000-01-01 00:00:00+00"];

/// A row written through the SQL contract, as a foreign writer would.
fn foreign_insert(
    aggregate_id: &str,
    occurred_at: &str,
) -> sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(
        "INSERT INTO idem_outbox (event_id, aggregate_type, aggregate_id, event_type, payload, occurred_at) \
         VALUES (gen_random_uuid(), 'order', $1, 'order.paid', '{}', $2::timestamptz)",
    )
    .bind(aggregate_id.to_owned())
    .bind(occurred_at.to_owned())
}

/// `occurred_at` = 'infinity' (or a year no client can hold) would panic sqlx's decoder in
/// every relay that claims the row, after the claim committed, so that no aggregate moves any
/// more. The contract refuses such values at insert, and a row stored before that rule is
/// claimed as corrupt (the relay parks it) while the rows of other aggregates are claimed as
/// usual.
#[tokio::test]
async fn timestamps_no_client_can_hold_are_refused_and_old_ones_parked_not_panicked() {
    let pg = Pg::new().await;
    for t in HOSTILE_TIMES {
        let e = foreign_insert("refused", t)
            .execute(pg.pool())
            .await
            .expect_err(t);
        assert!(e.to_string().contains("occurred_at_check"), "{t}: {e}");
    }

    // Rows stored before version 6 added the rule: written with the rules off, then claimed with
    // them in force again, as a database upgraded from version 5 holds them. (Before version 12
    // the rule was a NOT VALID constraint, which PostgreSQL checks on every update of such a
    // row: the claim that should park it failed instead, at every attempt.)
    rules(&pg, "DISABLE").await;
    for (i, t) in UNDECODABLE_TIMES.iter().enumerate() {
        foreign_insert(&format!("hostile-{i}"), t)
            .execute(pg.pool())
            .await
            .unwrap();
        foreign_insert(&format!("good-{i}"), "2026-12-01 10:00:00+00")
            .execute(pg.pool())
            .await
            .unwrap();
    }
    rules(&pg, "ENABLE").await;
    let claim = pg
        .store()
        .claim(&idem_core::outbox::ClaimRequest {
            relay_id: "r".to_owned(),
            batch_size: 100,
            lease: std::time::Duration::from_secs(60),
        })
        .await
        .unwrap();
    let good: Vec<&str> = claim
        .records
        .iter()
        .map(|r| r.aggregate_id.as_str())
        .collect();
    assert_eq!(good.len(), UNDECODABLE_TIMES.len(), "{good:?}");
    assert!(good.iter().all(|a| a.starts_with("good-")), "{good:?}");
    assert_eq!(
        claim.corrupt.len(),
        UNDECODABLE_TIMES.len(),
        "{:?}",
        claim.corrupt
    );
    assert!(
        claim
            .corrupt
            .iter()
            .any(|(_, why)| why.contains("'infinity'")),
        "{:?}",
        claim.corrupt
    );
}

/// Switches the trigger that checks the writer's rules off or on.
async fn rules(pg: &Pg, how: &str) {
    let sql = format!("ALTER TABLE idem_outbox {how} TRIGGER idem_outbox_accept");
    let done = pg.exec(&sql).await;
    assert!(done.is_ok(), "{sql}: {done:?}");
}

/// Each rule of the SQL contract refuses a row that breaks it, at insert and at an update that
/// sets the column, with SQLSTATE 23514 and the constraint name the rule had when it was a
/// CHECK constraint (before version 12).
#[tokio::test]
async fn the_writer_rules_refuse_bad_rows_at_insert_and_update_with_their_constraint_names() {
    let pg = Pg::new().await;
    let cases = [
        ("aggregate_type", "'bad type'"),
        ("aggregate_type", "repeat('a', 201)"),
        ("event_type", "'-leading-dash'"),
        ("event_type", "repeat('e', 256)"),
        ("aggregate_id", "''"),
        ("aggregate_id", "E'tab\\there'"),
        ("aggregate_id", "repeat('i', 513)"),
        ("headers", "'[]'::jsonb"),
        ("topic", "'bad topic'"),
        ("topic", "''"),
        ("occurred_at", "'infinity'::timestamptz"),
        ("created_at", "'10000-01-01 00:00:00+00'::timestamptz"),
    ];
    foreign_insert("kept", "2026-12-01 10:00:00+00")
        .execute(pg.pool())
        .await
        .unwrap();
    for (column, value) in cases {
        let row = [
            ("event_id", "gen_random_uuid()"),
            ("aggregate_type", "'order'"),
            ("aggregate_id", "'a-1'"),
            ("event_type", "'order.paid'"),
            ("payload", "'{}'::jsonb"),
            ("headers", "'{}'::jsonb"),
            ("topic", "NULL::text"),
            ("occurred_at", "now()"),
            ("created_at", "now()"),
        ];
        let names: Vec<&str> = row.iter().map(|(c, _)| *c).collect();
        let values: Vec<&str> = row
            .iter()
            .map(|(c, v)| if *c == column { value } else { *v })
            .collect();
        let insert = format!(
            "INSERT INTO idem_outbox ({}) VALUES ({})",
            names.join(", "),
            values.join(", ")
        );
        let update = format!("UPDATE idem_outbox SET {column} = {value}");
        for sql in [insert, update] {
            let e = sqlx::query(&sql).execute(pg.pool()).await.expect_err(&sql);
            let db = e.as_database_error().expect("a database error");
            assert_eq!(db.code().as_deref(), Some("23514"), "{sql}: {e}");
            let name = format!("idem_outbox_{column}_check");
            assert_eq!(db.constraint(), Some(name.as_str()), "{sql}: {e}");
            assert!(e.to_string().contains(&name), "{sql}: {e}");
        }
    }
    assert_eq!(pg.scalar("SELECT count(*) FROM idem_outbox").await, 1);
    // The rules are checked before the numbering: the refused rows of aggregate a-1 took none.
    foreign_insert("a-1", "2026-12-01 10:00:00+00")
        .execute(pg.pool())
        .await
        .unwrap();
    assert_eq!(
        pg.scalar("SELECT aggregate_seq FROM idem_outbox WHERE aggregate_id = 'a-1'")
            .await,
        1
    );
    assert_eq!(
        pg.scalar(
            "SELECT count(*) FROM pg_constraint \
             WHERE conrelid = 'idem_outbox'::regclass AND contype = 'c'"
        )
        .await,
        1,
        "only the status check is left a constraint"
    );
    let s = pg.store().status().await.unwrap();
    assert_eq!(s.pending, 2, "the good rows are pending as usual");
}

/// Waits until `n` sessions of this database wait for a lock.
async fn lock_waiters(pg: &Pg, n: i64) {
    let sql = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
               AND wait_event_type = 'Lock'";
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while pg.scalar(sql).await != n {
        assert!(
            std::time::Instant::now() < deadline,
            "{n} session(s) never waited for a lock"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// Two relays must never hold rows of one aggregate at once. The claim locks only the heads,
/// so it re-checks each other row's lease as committed before it takes the row.
/// Interleaving, made deterministic with a row lock: relay B claims head 2 of an aggregate
/// whose row 1 is parked, and is held before it commits; `idem outbox retry` makes row 1
/// pending; relay C claims head 1 and waits for B's rows 2 and 3; B commits. C re-checks the
/// lease on the committed rows and leaves 2 and 3 to B (taking them would publish them twice).
#[tokio::test]
async fn a_claim_never_takes_rows_another_claim_just_leased_after_a_retry() {
    let pg = aggregate_with_its_first_row_parked().await;
    let row3: i64 = pg
        .scalar("SELECT id FROM idem_outbox WHERE aggregate_seq = 3")
        .await;

    // Hold row 3, so that B's claim stops after leasing row 2.
    let mut holder = pg.pool().begin().await.unwrap();
    sqlx::query("SELECT 1 FROM idem_outbox WHERE id = $1 FOR UPDATE")
        .bind(row3)
        .execute(&mut *holder)
        .await
        .unwrap();
    let store_b = pg.store().clone();
    let b = tokio::spawn(async move { store_b.claim(&req(10)).await });
    lock_waiters(&pg, 1).await;

    // The operator retries row 1; C claims while B has not committed.
    assert_eq!(pg.store().retry_parked(None).await.unwrap(), 1);
    let store_c = pg.store().clone();
    let c = tokio::spawn(async move { store_c.claim(&req(10)).await });
    lock_waiters(&pg, 2).await;
    holder.rollback().await.unwrap();

    let (b, c) = (b.await.unwrap().unwrap(), c.await.unwrap().unwrap());
    let seqs = |claim: &idem_core::outbox::Claim| -> Vec<i64> {
        claim.records.iter().map(|r| r.aggregate_seq).collect()
    };
    assert_eq!(seqs(&b), vec![2, 3], "B leased rows 2 and 3");
    assert!(
        seqs(&c).iter().all(|s| !seqs(&b).contains(s)),
        "B and C both hold rows of one aggregate: B {:?}, C {:?}",
        seqs(&b),
        seqs(&c)
    );
}

/// The row id is the database's: a writer that names `id` is refused (GENERATED ALWAYS, schema
/// 18). Before, an id of 0 or less was published by the CDC relay and never marked (it is the
/// relay's "no row"), and an id ahead of the sequence failed another writer's insert later.
#[tokio::test]
async fn a_writer_cannot_choose_the_row_id() {
    let pg = Pg::new().await;
    let insert = |id: &str| {
        format!(
            "INSERT INTO idem_outbox (id, event_id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ({id}, gen_random_uuid(), 'order', 'o-1', 'order.paid', '{{}}')"
        )
    };
    for id in ["0", "-1", "2"] {
        let err = pg.exec(&insert(id)).await.unwrap_err();
        assert!(
            err.contains("cannot insert a non-DEFAULT value into column \"id\""),
            "{id}: {err}"
        );
    }
    for aggregate in ["a-1", "a-2", "a-3"] {
        foreign_insert(aggregate, "2026-12-01 10:00:00+00")
            .execute(pg.pool())
            .await
            .unwrap();
    }
    let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM idem_outbox ORDER BY id")
        .fetch_all(pg.pool())
        .await
        .unwrap();
    assert_eq!(ids, vec![1, 2, 3]);
}

/// A parked row's event columns change only after the park commits: INSERT, park, edit and
/// unpark in one transaction would commit one event while the CDC relay streams the INSERT's,
/// subtransactions included; a row parked by an earlier transaction is corrected as before.
#[tokio::test]
async fn a_parked_row_is_corrected_only_after_the_park_commits() {
    let pg = Pg::new().await;
    let insert = "INSERT INTO idem_outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
                  VALUES (gen_random_uuid(), 'order', 'o-1', 'order.paid', '{\"n\": 1}')";
    let park = "UPDATE idem_outbox SET status = 'parked', last_error = 'held'";
    let edit = "UPDATE idem_outbox SET payload = '{\"n\": 2}'";
    for savepoint in [false, true] {
        let mut tx = pg.begin().await;
        if savepoint {
            tx.exec("SAVEPOINT s").await.unwrap();
        }
        tx.exec(insert).await.unwrap();
        if savepoint {
            tx.exec("RELEASE SAVEPOINT s").await.unwrap();
            tx.exec("SAVEPOINT t").await.unwrap();
        }
        tx.exec(park).await.unwrap();
        let err = tx
            .exec(edit)
            .await
            .expect_err("an edit of a row parked by its own writer");
        assert!(err.contains("written_once_check"), "{err}");
    }

    // Written and parked by earlier transactions: corrected and retried.
    pg.exec(insert).await.unwrap();
    let mut tx = pg.begin().await;
    tx.exec(park).await.unwrap();
    let err = tx
        .exec(edit)
        .await
        .expect_err("an edit in the parking transaction");
    assert!(err.contains("written_once_check"), "{err}");
    drop(tx);
    pg.exec(park).await.unwrap();
    pg.exec("UPDATE idem_outbox SET payload = '{\"n\": 2}', status = 'pending'")
        .await
        .unwrap();
    let payload: String = sqlx::query_scalar("SELECT payload::text FROM idem_outbox")
        .fetch_one(pg.pool())
        .await
        .unwrap();
    assert_eq!(payload, "{\"n\": 2}");
}

/// A parked row returns to pending only if the writer's rules accept it: one stored before a
/// rule (an infinite `occurred_at`, written with the rules off as a database upgraded from
/// version 5 holds it) stays parked, and `retry --all` says which rule refuses it instead of
/// handing every relay a row none can read. `aggregate_seq` never changes after the INSERT.
#[tokio::test]
async fn a_parked_row_the_rules_refuse_stays_parked_and_the_seq_never_changes() {
    let pg = Pg::new().await;
    rules(&pg, "DISABLE").await;
    foreign_insert("hostile", "infinity")
        .execute(pg.pool())
        .await
        .unwrap();
    rules(&pg, "ENABLE").await;
    pg.exec("UPDATE idem_outbox SET status = 'parked', last_error = 'infinite'")
        .await
        .unwrap();
    let err = pg
        .store()
        .retry_parked(None)
        .await
        .expect_err("a row the rules refuse returned to pending");
    assert!(err.to_string().contains("occurred_at_check"), "{err}");
    let status: String = sqlx::query_scalar("SELECT status FROM idem_outbox")
        .fetch_one(pg.pool())
        .await
        .unwrap();
    assert_eq!(status, "parked");
    // Corrected, it is retried.
    pg.exec("UPDATE idem_outbox SET occurred_at = now()")
        .await
        .unwrap();
    assert_eq!(pg.store().retry_parked(None).await.unwrap(), 1);

    let err = pg
        .exec("UPDATE idem_outbox SET aggregate_seq = aggregate_seq + 1")
        .await
        .expect_err("aggregate_seq changed");
    assert!(err.contains("written_once_check"), "{err}");
    let mut tx = pg.begin().await;
    tx.enqueue(&[idem_core::Event::builder("order", "o-2", "order.paid")
        .payload(&serde_json::json!({"n": 2}))
        .build()
        .unwrap()])
        .await
        .unwrap();
    let err = tx
        .exec("UPDATE idem_outbox SET aggregate_seq = 7 WHERE aggregate_id = 'o-2'")
        .await
        .expect_err("aggregate_seq changed in the inserting transaction");
    assert!(err.contains("written_once_check"), "{err}");
}

/// A row numbered 0 or below (a writer could name the id before schema 18, and still can with
/// `OVERRIDING SYSTEM VALUE`) is pending like any other: the claim's walk starts below every id.
#[tokio::test]
async fn a_row_numbered_zero_or_below_is_claimed() {
    use idem_core::outbox::{ClaimOutcome, ClaimRequest};
    let pg = Pg::new().await;
    for (id, aggregate) in [("-5", "legacy"), ("0", "zero")] {
        pg.exec(&format!(
            "INSERT INTO idem_outbox (id, event_id, aggregate_type, aggregate_id, event_type, payload) \
             OVERRIDING SYSTEM VALUE \
             VALUES ({id}, gen_random_uuid(), 'order', '{aggregate}', 'order.paid', '{{}}')"
        ))
        .await
        .unwrap();
    }
    let mut tx = pg.begin().await;
    tx.enqueue(&[scenarios::event("x", 1)]).await.unwrap();
    tx.commit().await;
    let request = ClaimRequest {
        relay_id: "r".to_owned(),
        batch_size: 10,
        lease: std::time::Duration::from_secs(60),
    };
    let mut claimed = vec![];
    loop {
        let claim = pg.store().claim(&request).await.unwrap();
        if claim.records.is_empty() {
            break;
        }
        claimed.extend(claim.records.iter().map(|r| r.id));
        let outcome = ClaimOutcome {
            published: claim.records.iter().map(|r| r.id).collect(),
            failed: vec![],
        };
        pg.store().complete(&claim, &outcome).await.unwrap();
    }
    claimed.sort_unstable();
    assert_eq!(claimed.len(), 3, "{claimed:?}");
    assert_eq!(&claimed[..2], &[-5, 0]);
}

/// A claim never takes an aggregate's rows on both sides of a row another claim holds.
/// Interleaving: row 1 of an aggregate is parked; claim X (its own transaction, held open) leases
/// row 2; the operator retries row 1; claim Y finds row 1 as the head, chooses rows 1, 2 and 3,
/// and waits for row 2; X commits. Y sees row 2 leased as committed and leaves the aggregate
/// alone: taking 1 and 3 would let 3 be published before 2.
#[tokio::test]
async fn a_claim_leaves_an_aggregate_whose_chosen_row_another_claim_leased_meanwhile() {
    let pg = aggregate_with_its_first_row_parked().await;
    let mut tx = pg.begin().await;
    tx.enqueue(&[scenarios::event("z", 1)]).await.unwrap();
    tx.commit().await;

    // X leases row 2 and holds its transaction open.
    let mut x = pg.pool().begin().await.unwrap();
    sqlx::query(include_str!("../sql/postgres/claim_guard.sql"))
        .bind("600000")
        .execute(&mut *x)
        .await
        .unwrap();
    let x_rows: Vec<i64> =
        sqlx::query(&include_str!("../sql/postgres/claim.sql").replace("{outbox}", "idem_outbox"))
            .bind(1_i64)
            .bind(uuid::Uuid::new_v4())
            .bind("x")
            .bind(60_000_i64)
            .bind(i64::MIN)
            .bind(10_i64)
            .fetch_all(&mut *x)
            .await
            .unwrap()
            .iter()
            .filter_map(|row| sqlx::Row::get::<Option<i64>, _>(row, "aggregate_seq"))
            .collect();
    assert_eq!(x_rows, vec![2], "X leased row 2");

    assert_eq!(pg.store().retry_parked(None).await.unwrap(), 1);
    let store_y = pg.store().clone();
    let y = tokio::spawn(async move { store_y.claim(&req(10)).await });
    lock_waiters(&pg, 1).await;
    x.commit().await.unwrap();

    let y: Vec<(String, i64)> = y
        .await
        .unwrap()
        .unwrap()
        .records
        .iter()
        .map(|r| (r.aggregate_id.clone(), r.aggregate_seq))
        .collect();
    assert_eq!(
        y,
        vec![("z".to_owned(), 1)],
        "Y holds {y:?} while X holds x's row 2: it must leave x whole (row 3 could be published \
         before 2) and still take z"
    );
}

/// A writer may insert a row with a lease of its own (`claimed_until` in the future, no claim
/// id): the claim leaves that row's aggregate alone, as it would for a relay's lease, and still
/// takes every other aggregate's rows; it never chooses a row its lease would then skip (a claim
/// that leases fewer rows than it chose is taken again, so such a row would stop every claim).
#[tokio::test]
async fn a_row_with_a_writers_own_lease_holds_its_aggregate_and_nothing_else() {
    let pg = Pg::new().await;
    let mut tx = pg.begin().await;
    tx.enqueue(&[scenarios::event("x", 1)]).await.unwrap();
    tx.commit().await;
    writer_row_of_x_then_y(&pg, "claimed_until", "now() + interval '1 hour'").await;

    let claim = pg.store().claim(&req(10)).await.unwrap();
    let claimed: Vec<(&str, i64)> = claim
        .records
        .iter()
        .map(|r| (r.aggregate_id.as_str(), r.aggregate_seq))
        .collect();
    assert_eq!(
        claimed,
        vec![("y", 1)],
        "x waits behind its leased row 2, y does not"
    );
}

/// A writer may insert any count in `attempts` and `permanent_failures`: at the column's
/// maximum the claim and the mark keep it there instead of failing on an overflow, which would
/// fail every claim that reaches the row and so stop every other aggregate too.
#[tokio::test]
async fn counts_a_writer_set_to_their_maximum_stop_no_claim_and_no_mark() {
    use idem_core::outbox::{ClaimOutcome, Disposition, Failure};
    let pg = Pg::new().await;
    writer_row_of_x_then_y(
        &pg,
        "attempts, permanent_failures",
        "2147483647, 2147483647",
    )
    .await;

    let claim = pg.store().claim(&req(10)).await.unwrap();
    let ids: Vec<&str> = claim
        .records
        .iter()
        .map(|r| r.aggregate_id.as_str())
        .collect();
    assert_eq!(ids, vec!["x", "y"]);
    let x = claim.records[0].id;
    pg.store()
        .complete(
            &claim,
            &ClaimOutcome {
                published: vec![claim.records[1].id],
                failed: vec![Failure {
                    id: x,
                    reason: "refused".into(),
                    backoff: std::time::Duration::ZERO,
                    disposition: Disposition::Permanent,
                }],
            },
        )
        .await
        .unwrap();
    let again = pg.store().claim(&req(10)).await.unwrap();
    assert_eq!(
        again.records.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![x]
    );
    assert_eq!(again.records[0].attempt, i32::MAX);
    assert_eq!(again.records[0].permanent_failures, i32::MAX);
}

/// A row of aggregate `x` inserted by a writer with `columns` set to `values` (SQL), then an
/// event of aggregate `y` enqueued after it.
#[allow(clippy::unwrap_used)]
async fn writer_row_of_x_then_y(pg: &Pg, columns: &str, values: &str) {
    pg.exec(&format!(
        "INSERT INTO idem_outbox (event_id, aggregate_type, aggregate_id, event_type, payload, {columns}) \
         VALUES (gen_random_uuid(), 'order', 'x', 'order.paid', '{{}}', {values})"
    ))
    .await
    .unwrap();
    let mut tx = pg.begin().await;
    tx.enqueue(&[scenarios::event("y", 1)]).await.unwrap();
    tx.commit().await;
}

/// Rows 1, 2 and 3 of aggregate `x`, row 1 parked.
#[allow(clippy::unwrap_used)]
async fn aggregate_with_its_first_row_parked() -> Pg {
    use idem_core::outbox::{ClaimOutcome, Failure};
    let pg = Pg::new().await;
    let mut tx = pg.begin().await;
    tx.enqueue(&[
        scenarios::event("x", 1),
        scenarios::event("x", 2),
        scenarios::event("x", 3),
    ])
    .await
    .unwrap();
    tx.commit().await;
    let first = pg.store().claim(&req(1)).await.unwrap();
    pg.store()
        .complete(
            &first,
            &ClaimOutcome {
                published: vec![],
                failed: vec![Failure {
                    id: first.records[0].id,
                    reason: "message too large".into(),
                    backoff: std::time::Duration::ZERO,
                    disposition: idem_core::outbox::Disposition::Park,
                }],
            },
        )
        .await
        .unwrap();
    pg
}

/// A claim of up to `batch` rows by relay `r`.
fn req(batch: u32) -> idem_core::outbox::ClaimRequest {
    idem_core::outbox::ClaimRequest {
        relay_id: "r".to_owned(),
        batch_size: batch,
        lease: std::time::Duration::from_secs(60),
    }
}
