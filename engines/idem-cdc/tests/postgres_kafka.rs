//! The CDC relay against real PostgreSQL (logical replication, wal_level = logical) and a real
//! Kafka broker: commit order, rollbacks, a relay that stops between the publish and the
//! confirmation. Each test uses its own database, slot and topic, and drops its slot.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{World, event, eventually, ids, spawn, spawn_idle, stop};
use idem_cdc::{CdcMetrics, Name};
use idem_conformance::backend::{Backend, OpenTx};
use idem_core::Event;

/// T1 inserts first and commits last; T2 inserts later and commits first: the stream, and so
/// the topic, has T2's event before T1's (commit order, without the polling relay's counter).
#[tokio::test(flavor = "multi_thread")]
async fn two_open_transactions_arrive_in_commit_order() {
    let w = World::new().await;
    let relay = w.relay(CdcMetrics::unregistered().unwrap());
    relay.prepare().await.unwrap();
    let mut running = spawn(relay);
    let before = w.streaming(&mut running).await;
    let (first, second) = (event("a-1", 1), event("b-1", 2));
    let mut t1 = w.pg.begin().await;
    t1.enqueue(std::slice::from_ref(&first)).await.unwrap();
    let mut t2 = w.pg.begin().await;
    t2.enqueue(std::slice::from_ref(&second)).await.unwrap();
    t2.commit().await;
    t1.commit().await;
    let got = w.records(before + 2, &mut running).await;
    assert_eq!(
        ids(&got[before..]),
        vec![second.id().to_string(), first.id().to_string()],
        "the later insert committed first and comes first"
    );
    assert_eq!(
        got[before + 1].key.as_deref(),
        Some("a-1"),
        "keyed by aggregate id"
    );
    stop(running).await;
}

/// Rows committed before the slot existed (an outbox that had rows when the CDC relay first
/// started, or a switch from the polling relay) are never in the slot's stream: the session's
/// drain publishes them before streaming. The chaos runner found them lost before the drain.
#[tokio::test(flavor = "multi_thread")]
async fn rows_committed_before_the_slot_existed_are_published_first() {
    let w = World::new().await;
    let old: Vec<Event> = (0..3).map(|i| event(&format!("old-{i}"), i)).collect();
    w.commit(&old).await;
    let metrics = CdcMetrics::unregistered().unwrap();
    let relay = w.relay(metrics.clone());
    relay.prepare().await.unwrap();
    let mut running = spawn(relay);
    let got = w.records(3, &mut running).await;
    let want: Vec<String> = old.iter().map(|e| e.id().to_string()).collect();
    assert_eq!(ids(&got[..3]), want, "in commit order");
    assert_eq!(metrics.drained.get(), 3);
    let n = w.streaming(&mut running).await;
    assert_eq!(n, 4, "drained once, then streamed: nothing else");
    stop(running).await;
}

/// A relay restarted after an outage streams the backlog written meanwhile: the rows were
/// written after the slot's confirmed position, so the slot carries them and the session's
/// drain leaves them alone (before schema 14 the drain published each of them and the stream
/// sent it again: two copies of the whole backlog).
#[tokio::test(flavor = "multi_thread")]
async fn a_backlog_written_while_the_relay_was_stopped_is_streamed_once_not_drained() {
    let w = World::new().await;
    let relay = w.relay(CdcMetrics::unregistered().unwrap());
    relay.prepare().await.unwrap();
    let mut running = spawn(relay);
    let before = w.streaming(&mut running).await;
    stop(running).await;
    let backlog: Vec<Event> = (0..20).map(|i| event(&format!("o-{}", i % 3), i)).collect();
    for chunk in backlog.chunks(5) {
        w.commit(chunk).await;
    }
    let metrics = CdcMetrics::unregistered().unwrap();
    let mut running = spawn(w.relay(metrics.clone()));
    let total = w.streaming(&mut running).await;
    assert_eq!(
        metrics.drained.get(),
        0,
        "nothing to drain: all in the slot"
    );
    assert_eq!(
        total,
        before + backlog.len() + 1,
        "each event once, then the marker"
    );
    let got = w.records(total, &mut running).await;
    for key in ["o-0", "o-1", "o-2"] {
        let of_key = |ids: Vec<String>| -> Vec<String> {
            let wanted: Vec<String> = backlog
                .iter()
                .filter(|e| e.aggregate_id() == key)
                .map(|e| e.id().to_string())
                .collect();
            ids.into_iter().filter(|i| wanted.contains(i)).collect()
        };
        let want = of_key(backlog.iter().map(|e| e.id().to_string()).collect());
        assert_eq!(of_key(ids(&got)), want, "{key}: in commit order");
    }
    stop(running).await;
}

/// `written_lsn` is the trigger's, not the writer's: rows written before the slot existed with a
/// made-up position past every slot's, one by its INSERT and one by a later UPDATE (schema 15),
/// are still drained (trusted, they would never be published: the slot does not stream them
/// and the drain would skip them).
#[tokio::test(flavor = "multi_thread")]
async fn a_writer_cannot_set_written_lsn_to_hide_a_row_from_the_drain() {
    let w = World::new().await;
    let outbox = w.pg.tables().qualified("outbox");
    let (inserted, updated) = (event("h-1", 1), event("h-2", 2));
    for (e, aggregate) in [(&inserted, "h-1"), (&updated, "h-2")] {
        sqlx::query(&format!(
            "INSERT INTO {outbox} (event_id, aggregate_type, aggregate_id, event_type, payload, written_lsn) \
             VALUES ($1, 'order', $2, 'order.paid', '{{}}', 'FFFFFFFF/FFFFFFFF')"
        ))
        .bind(e.id().as_uuid())
        .bind(aggregate)
        .execute(w.pg.pool())
        .await
        .unwrap();
    }
    let moved = sqlx::query(&format!(
        "UPDATE {outbox} SET written_lsn = 'FFFFFFFF/FFFFFFFF' WHERE aggregate_id = 'h-2'"
    ))
    .execute(w.pg.pool())
    .await
    .unwrap();
    assert_eq!(moved.rows_affected(), 1, "the UPDATE ran");
    let stamped: Vec<String> = sqlx::query_scalar(&format!(
        "SELECT written_lsn::text FROM {outbox} ORDER BY id"
    ))
    .fetch_all(w.pg.pool())
    .await
    .unwrap();
    assert_eq!(stamped.len(), 2);
    for lsn in &stamped {
        assert_ne!(lsn, "FFFFFFFF/FFFFFFFF", "the trigger keeps the position");
    }
    let metrics = CdcMetrics::unregistered().unwrap();
    let relay = w.relay(metrics.clone());
    relay.prepare().await.unwrap();
    let mut running = spawn(relay);
    let got = w.records(2, &mut running).await;
    let mut got_ids = ids(&got[..2]);
    got_ids.sort();
    let mut want = vec![inserted.id().to_string(), updated.id().to_string()];
    want.sort();
    assert_eq!(got_ids, want);
    assert_eq!(metrics.drained.get(), 2);
    stop(running).await;
}

/// Debezium's pattern: the writer deletes its outbox row in the transaction that inserted it.
/// The table never holds the row, the slot streams the insert, so the event is published.
#[tokio::test(flavor = "multi_thread")]
async fn a_row_deleted_in_the_transaction_that_inserted_it_is_still_published() {
    let w = World::new().await;
    let relay = w.relay(CdcMetrics::unregistered().unwrap());
    relay.prepare().await.unwrap();
    let mut running = spawn(relay);
    let before = w.streaming(&mut running).await;
    let gone = event("d-1", 1);
    let outbox = idem_sql::postgres::Outbox::new(w.pg.tables().clone());
    let table = w.pg.tables().qualified("outbox");
    let mut tx = w.pg.pool().begin().await.unwrap();
    outbox.enqueue(&mut tx, &gone).await.unwrap();
    sqlx::query(&format!("DELETE FROM {table} WHERE event_id = $1"))
        .bind(gone.id().as_uuid())
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let got = w.records(before + 1, &mut running).await;
    assert_eq!(ids(&got[before..]), vec![gone.id().to_string()]);
    let left: i64 =
        sqlx::query_scalar(&format!("SELECT count(*) FROM {table} WHERE event_id = $1"))
            .bind(gone.id().as_uuid())
            .fetch_one(w.pg.pool())
            .await
            .unwrap();
    assert_eq!(left, 0);
    stop(running).await;
}

/// The CDC relay streams the INSERT, the polling relay reads the committed row: they agree
/// because an event cannot change once written. An ORM's insert-then-update in one transaction
/// is refused (nothing is published, the writer sees why); a parked row corrected and retried is
/// published as corrected by the next session's drain.
#[tokio::test(flavor = "multi_thread")]
async fn what_the_cdc_relay_publishes_is_what_committed() {
    let w = World::new().await;
    let relay = w.relay(CdcMetrics::unregistered().unwrap());
    relay.prepare().await.unwrap();
    let mut running = spawn(relay);
    let before = w.streaming(&mut running).await;
    let table = w.pg.tables().qualified("outbox");
    let outbox = idem_sql::postgres::Outbox::new(w.pg.tables().clone());
    let flushed = event("u-1", 1);
    let mut tx = w.pg.pool().begin().await.unwrap();
    outbox.enqueue(&mut tx, &flushed).await.unwrap();
    let err = sqlx::query(&format!(
        "UPDATE {table} SET payload = '{{\"n\": 1250}}', headers = '{{\"tenant\": \"acme\"}}' \
         WHERE event_id = $1"
    ))
    .bind(flushed.id().as_uuid())
    .execute(&mut *tx)
    .await
    .expect_err("an update of the row the transaction inserted")
    .to_string();
    assert!(err.contains("written_once_check"), "{err}");
    drop(tx);
    let kept = event("u-2", 2);
    w.commit(std::slice::from_ref(&kept)).await;
    let got = w.records(before + 1, &mut running).await;
    assert_eq!(ids(&got[before..]), vec![kept.id().to_string()]);
    let published =
        format!("SELECT count(*) FROM {table} WHERE event_id = $1 AND status = 'published'");
    eventually("the row marked published", || {
        let (pool, sql, id) = (w.pg.pool().clone(), published.clone(), kept.id().as_uuid());
        async move {
            sqlx::query_scalar::<_, i64>(&sql)
                .bind(id)
                .fetch_one(&pool)
                .await
                .unwrap()
                == 1
        }
    })
    .await;
    stop(running).await;
    // Parked (by hand, as an operator holds an event), corrected, retried.
    for sql in [
        "UPDATE {table} SET status = 'parked' WHERE event_id = $1",
        "UPDATE {table} SET payload = '{\"n\": 3}' WHERE event_id = $1",
        "UPDATE {table} SET status = 'pending' WHERE event_id = $1",
    ] {
        sqlx::query(&sql.replace("{table}", &table))
            .bind(kept.id().as_uuid())
            .execute(w.pg.pool())
            .await
            .unwrap();
    }
    let mut running = spawn(w.relay(CdcMetrics::unregistered().unwrap()));
    let got = w.records(before + 2, &mut running).await;
    assert_eq!(
        ids(&got[before + 1..before + 2]),
        vec![kept.id().to_string()]
    );
    let payload = got[before + 1].payload.as_deref().unwrap_or_default();
    assert!(payload.contains("\"n\": 3"), "{payload}");
    stop(running).await;
}

/// `--delete-published`: the relay deletes the rows it published instead of marking them, so
/// the table keeps nothing published; a restart sends nothing again.
#[tokio::test(flavor = "multi_thread")]
async fn with_delete_published_the_relay_deletes_what_it_published() {
    let w = World::new().await;
    let mut config = w.config();
    config.delete_published = true;
    let relay = w.relay_with(config.clone(), CdcMetrics::unregistered().unwrap());
    relay.prepare().await.unwrap();
    let mut running = spawn(relay);
    let before = w.streaming(&mut running).await;
    let events: Vec<Event> = (0..5).map(|i| event(&format!("x-{i}"), i)).collect();
    w.commit(&events).await;
    w.records(before + events.len(), &mut running).await;
    until_the_outbox_is_empty(&w, "the published rows deleted").await;
    stop(running).await;
    let mut running = spawn(w.relay_with(config, CdcMetrics::unregistered().unwrap()));
    let n = w.streaming(&mut running).await;
    assert_eq!(
        n,
        before + events.len() + 1,
        "nothing sent again, then the marker"
    );
    stop(running).await;
}

/// Waits until the world's outbox holds no row.
async fn until_the_outbox_is_empty(w: &World, what: &str) {
    let rows = format!("SELECT count(*) FROM {}", w.pg.tables().qualified("outbox"));
    eventually(what, || {
        let (pool, rows) = (w.pg.pool().clone(), rows.clone());
        async move {
            let n: i64 = sqlx::query_scalar(&rows).fetch_one(&pool).await.unwrap();
            n == 0
        }
    })
    .await;
}

/// `--delete-published` holds for the session-start drain too: the rows written before the slot
/// existed are published by the drain and deleted, not left marked `published` (nothing prunes
/// them in this mode).
#[tokio::test(flavor = "multi_thread")]
async fn with_delete_published_the_drain_deletes_what_it_published() {
    let w = World::new().await;
    let backlog: Vec<Event> = (0..3).map(|i| event(&format!("b-{i}"), i)).collect();
    w.commit(&backlog).await;
    let mut config = w.config();
    config.delete_published = true;
    let metrics = CdcMetrics::unregistered().unwrap();
    let relay = w.relay_with(config, metrics.clone());
    relay.prepare().await.unwrap();
    let mut running = spawn(relay);
    let got = w.records(backlog.len(), &mut running).await;
    assert_eq!(got.len(), backlog.len());
    assert_eq!(metrics.drained.get(), 3, "the drain published the backlog");
    until_the_outbox_is_empty(&w, "the drained rows deleted").await;
    stop(running).await;
}

/// A rolled-back transaction's rows never reach Kafka; the committed one after it does.
#[tokio::test(flavor = "multi_thread")]
async fn rolled_back_transactions_are_never_published() {
    let w = World::new().await;
    let relay = w.relay(CdcMetrics::unregistered().unwrap());
    relay.prepare().await.unwrap();
    let mut running = spawn(relay);
    let before = w.streaming(&mut running).await;
    let mut rolled = w.pg.begin().await;
    rolled
        .enqueue(&[event("r-1", 1), event("r-2", 2)])
        .await
        .unwrap();
    rolled.rollback().await;
    let kept = event("k-1", 3);
    w.commit(std::slice::from_ref(&kept)).await;
    // A marker committed after both: once it arrives, everything before it has.
    let marker = event("z-1", 4);
    w.commit(std::slice::from_ref(&marker)).await;
    let got = w.records(before + 2, &mut running).await;
    assert_eq!(
        ids(&got[before..]),
        vec![kept.id().to_string(), marker.id().to_string()]
    );
    stop(running).await;
}

/// Kafka acknowledged a batch and the relay stops before confirming it (the crash point in
/// error mode ends the session): the next session streams from the slot's confirmed position,
/// so the batch comes again. Every event arrives at least once; the copies carry the same
/// `ce_id`, which the consumer's inbox absorbs.
#[tokio::test(flavor = "multi_thread")]
async fn a_relay_stopped_after_publishing_and_before_confirming_publishes_the_batch_again() {
    use idem_core::crash::{self, Action, CrashPoint};
    let w = World::new().await;
    let metrics = CdcMetrics::unregistered().unwrap();
    let relay = w.relay(metrics.clone());
    relay.prepare().await.unwrap();
    let mut running = spawn(relay);
    let before = w.streaming(&mut running).await;
    let events: Vec<Event> = (0..5).map(|i| event(&format!("c-{i}"), i)).collect();
    crash::arm(CrashPoint::CdcAfterPublishBeforeConfirm, Action::Error, 1).unwrap();
    w.commit(&events).await;
    // Published once, then (not confirmed) by the next session's stream: copies with one
    // ce_id each (written after the confirmed position, the rows are not drained).
    let got = w.records(before + 10, &mut running).await;
    crash::disarm_all();
    assert_eq!(
        metrics.sessions_failed.get(),
        1,
        "the crash point ended one session"
    );
    let copies = |got: &[idem_kafka::inspect::Record], e: &Event| {
        let id = e.id().to_string();
        got.iter()
            .filter(|r| r.header("ce_id") == Some(id.as_str()))
            .count()
    };
    for e in &events {
        assert!(copies(&got, e) >= 2, "every event, again after the stop");
    }
    assert!(metrics.confirmed_lsn.get() > 0);
    stop(running).await;
    // Stopped gracefully: confirmed and marked. A new session sends nothing again.
    let settled = w.records(before + 10, &mut spawn_idle()).await;
    let settled: Vec<usize> = events.iter().map(|e| copies(&settled, e)).collect();
    let again = w.relay(CdcMetrics::unregistered().unwrap());
    let mut running = spawn(again);
    let n = w.streaming(&mut running).await;
    let now = w.records(n, &mut running).await;
    let now: Vec<usize> = events.iter().map(|e| copies(&now, e)).collect();
    assert_eq!(now, settled, "after the confirmation nothing is sent again");
    stop(running).await;
}

/// The published rows are marked in the table (so `idem outbox status`, pruning and
/// `idem verify` see them), and the slot's metrics show no lag once everything is confirmed.
#[tokio::test(flavor = "multi_thread")]
async fn published_rows_are_marked_and_the_slot_confirms_them() {
    let w = World::new().await;
    let metrics = CdcMetrics::unregistered().unwrap();
    let relay = w.relay(metrics.clone());
    relay.prepare().await.unwrap();
    let mut running = spawn(relay);
    w.commit(&[event("m-1", 1), event("m-2", 2)]).await;
    w.records(2, &mut running).await;
    eventually("both rows marked published", || async {
        w.pg.scalar("SELECT count(*) FROM idem_outbox WHERE status = 'published'")
            .await
            == 2
    })
    .await;
    let slot = Name::new("slot", &w.slot).unwrap();
    // `idem outbox status` lists the database's slots: this one, read by the relay.
    let here = idem_cdc::slots_here(w.pg.pool()).await.unwrap();
    assert!(
        here.iter()
            .any(|s| s.slot == w.slot && s.active && !s.is_lost()),
        "{here:?}"
    );
    eventually("the slot to confirm the events", || async {
        let confirmed = slot_confirmed(&w, &slot).await;
        let pos = u64::try_from(metrics.confirmed_lsn.get()).unwrap_or(0);
        pos > 0 && confirmed >= pos
    })
    .await;
    stop(running).await;
}

/// The slot's `confirmed_flush_lsn` (0 before any).
async fn slot_confirmed(w: &World, slot: &Name) -> u64 {
    let state = idem_cdc::slot_state(w.pg.pool(), slot)
        .await
        .unwrap()
        .unwrap();
    state
        .confirmed_flush_lsn
        .as_deref()
        .and_then(idem_cdc::changes::parse_lsn)
        .unwrap_or(0)
}

/// An idle relay confirms the server's position from its keepalives, so that WAL the stream
/// never carries (another table's writes here) is not held by the slot, and its
/// `idem_cdc_confirmed_lsn` shows that position. (Before, the gauge moved with published
/// batches only: an idle relay showed a stale position while the slot moved on.)
#[tokio::test(flavor = "multi_thread")]
async fn an_idle_relay_confirms_the_servers_position_and_shows_it() {
    let w = World::new().await;
    let metrics = CdcMetrics::unregistered().unwrap();
    let relay = w.relay(metrics.clone());
    relay.prepare().await.unwrap();
    let mut running = spawn(relay);
    w.streaming(&mut running).await;
    let at_start = metrics.confirmed_lsn.get();
    for sql in [
        "CREATE TABLE not_published (n int)",
        "INSERT INTO not_published SELECT generate_series(1, 1000)",
    ] {
        sqlx::query(sql).execute(w.pg.pool()).await.unwrap();
    }
    let written = w.wal_position().await;
    assert!(written > at_start);
    let slot = Name::new("slot", &w.slot).unwrap();
    eventually(
        "the slot and the gauge past the other table's writes",
        || async {
            let confirmed = slot_confirmed(&w, &slot).await;
            let gauge = u64::try_from(metrics.confirmed_lsn.get()).unwrap_or(0);
            let written = u64::try_from(written).unwrap_or(u64::MAX);
            confirmed >= written && gauge >= written
        },
    )
    .await;
    assert_eq!(metrics.events.get(), 1, "the marker only");
    stop(running).await;
}

/// One reader per slot: a second relay waits (`idem_cdc_standby` 1) while the first reads the
/// slot, and takes over once the first one's session is gone (its task aborted, as a crashed
/// process's connection closes): the events committed after that reach Kafka through it.
#[tokio::test(flavor = "multi_thread")]
async fn a_second_relay_waits_for_the_slot_and_takes_over_when_the_first_dies() {
    let w = World::new().await;
    let first = w.relay(CdcMetrics::unregistered().unwrap());
    first.prepare().await.unwrap();
    let mut running = spawn(first);
    let before = event("t-1", 1);
    w.commit(std::slice::from_ref(&before)).await;
    w.records(1, &mut running).await;
    let slot = Name::new("slot", &w.slot).unwrap();
    let reader = || async {
        idem_cdc::slot_state(w.pg.pool(), &slot)
            .await
            .unwrap()
            .and_then(|s| s.active_pid)
    };
    let first_pid = reader().await.expect("the first relay reads the slot");
    let standby_metrics = CdcMetrics::unregistered().unwrap();
    let mut standby = spawn(w.relay(standby_metrics.clone()));
    eventually("the second relay to wait as a standby", || async {
        standby_metrics.standby.get() == 1
    })
    .await;
    assert_eq!(
        reader().await,
        Some(first_pid),
        "the first relay still reads"
    );
    running.1.abort();
    let after = event("t-2", 2);
    w.commit(std::slice::from_ref(&after)).await;
    let got = w.records(2, &mut standby).await;
    assert_eq!(
        got.last().and_then(|r| r.header("ce_id")),
        Some(after.id().to_string().as_str())
    );
    assert_eq!(standby_metrics.standby.get(), 0);
    let now = reader().await;
    assert!(
        now.is_some() && now != Some(first_pid),
        "the second relay reads the slot: {now:?}"
    );
    stop(standby).await;
}

/// A transaction larger than a batch is published in parts as it streams in, so the relay never
/// holds a whole large transaction; none of it is confirmed before its Commit and its last
/// part. The relay is stopped after its second part (the crash point ends that session after
/// the first part was published and confirmed what it could): the next session streams the
/// whole transaction again, so the first part's publication confirmed nothing of it. Every
/// event arrives at least once, the first two parts' twice, each aggregate in commit order,
/// and the confirmation lands only after the rest.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_larger_than_a_batch_goes_out_in_parts_and_is_confirmed_whole() {
    use idem_core::crash::{self, Action, CrashPoint};
    let w = World::new().await;
    let metrics = CdcMetrics::unregistered().unwrap();
    let mut config = w.config();
    config.batch_size = 10;
    let relay = w.relay_with(config, metrics.clone());
    relay.prepare().await.unwrap();
    let mut running = spawn(relay);
    let before = w.streaming(&mut running).await;
    let big: Vec<Event> = (0..35).map(|i| event(&format!("p-{}", i % 3), i)).collect();
    crash::arm(CrashPoint::CdcAfterPublishBeforeConfirm, Action::Error, 2).unwrap();
    w.commit(&big).await;
    // At or past the big transaction's commit record: confirmed only once it is, whole.
    let committed = w.wal_position().await;
    let got = w.records(before + big.len() + 20, &mut running).await;
    crash::disarm_all();
    assert_eq!(
        metrics.sessions_failed.get(),
        1,
        "the crash point fired once"
    );
    assert!(
        metrics.parts.get() >= 4,
        "35 rows in batches of 10: parts, {}",
        metrics.parts.get()
    );
    let copies = |e: &Event| {
        let id = e.id().to_string();
        got.iter()
            .filter(|r| r.header("ce_id") == Some(id.as_str()))
            .count()
    };
    // The first two parts are the first 20 rows inserted (the writer sorts by aggregate): sent
    // by the failed session and again by the next one.
    let first_part: Vec<String> = ids(&got[before..before + 20]);
    for (i, e) in big.iter().enumerate() {
        let id = e.id().to_string();
        let want = if first_part.contains(&id) { 2 } else { 1 };
        assert!(copies(e) >= want, "event {i}: {} copies", copies(e));
    }
    for key in ["p-0", "p-1", "p-2"] {
        let last_copy: Vec<String> = {
            let mut seen = std::collections::HashSet::new();
            let mut v: Vec<String> = ids(&got[before..])
                .into_iter()
                .rev()
                .filter(|id| seen.insert(id.clone()))
                .collect();
            v.reverse();
            let of_key: std::collections::HashSet<String> = big
                .iter()
                .filter(|e| e.aggregate_id() == key)
                .map(|e| e.id().to_string())
                .collect();
            v.retain(|id| of_key.contains(id));
            v
        };
        let want: Vec<String> = big
            .iter()
            .filter(|e| e.aggregate_id() == key)
            .map(|e| e.id().to_string())
            .collect();
        assert_eq!(last_copy, want, "{key}: the last copies in commit order");
    }
    eventually("the transaction is confirmed", || async {
        metrics.confirmed_lsn.get() >= committed
    })
    .await;
    stop(running).await;
}

/// Refuses every mark of an outbox row as published while `mark_refused` has a row: a lock
/// timeout, a killed connection or any failure of the mark's UPDATE stands for it.
async fn refuse_marks(w: &World) {
    for sql in [
        "CREATE TABLE mark_refused (n int)",
        "INSERT INTO mark_refused VALUES (1)",
        "CREATE FUNCTION refuse_mark() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
         IF NEW.status = 'published' AND EXISTS (SELECT 1 FROM mark_refused) THEN \
         RAISE EXCEPTION 'the test refuses this mark'; END IF; RETURN NEW; END $$",
        "CREATE TRIGGER refuse_mark BEFORE UPDATE ON idem_outbox FOR EACH ROW \
         EXECUTE FUNCTION refuse_mark()",
    ] {
        w.pg.exec(sql).await.unwrap();
    }
}

async fn published(w: &World) -> i64 {
    w.pg.scalar("SELECT count(*) FROM idem_outbox WHERE status = 'published'")
        .await
}

/// A mark that fails is made again in the same session: the row is marked once the failure
/// passes, not left pending (and counted as backlog) until the next session republishes it.
#[tokio::test(flavor = "multi_thread")]
async fn a_failed_mark_is_made_again_in_the_same_session() {
    let w = World::new().await;
    refuse_marks(&w).await;
    let metrics = CdcMetrics::unregistered().unwrap();
    let relay = w.relay(metrics.clone());
    relay.prepare().await.unwrap();
    let mut running = spawn(relay);
    w.commit(&[event("f-1", 1)]).await;
    w.records(1, &mut running).await;
    eventually("a refused mark", || async {
        metrics.mark_failures.get() >= 1
    })
    .await;
    assert_eq!(published(&w).await, 0);
    w.pg.exec("DELETE FROM mark_refused").await.unwrap();
    eventually("the row marked", || async { published(&w).await == 1 }).await;
    assert_eq!(
        metrics.sessions_failed.get(),
        0,
        "marked in the same session"
    );
    assert_eq!(metrics.drained.get(), 0, "nothing drained again");
    stop(running).await;
}

/// A mark that keeps failing ends the session: the next session's drain publishes the row
/// again at once (a copy the inbox absorbs), instead of at a restart that may come after the
/// inbox forgot the event. The drain's own mark fails too and ends that session with the row
/// leased: the session after it ends that lease instead of waiting it out, so the row is marked
/// as soon as marks land again.
#[tokio::test(flavor = "multi_thread")]
async fn a_mark_that_keeps_failing_ends_the_session_and_the_next_drains_the_row() {
    let w = World::new().await;
    refuse_marks(&w).await;
    let metrics = CdcMetrics::unregistered().unwrap();
    let relay = w.relay(metrics.clone());
    relay.prepare().await.unwrap();
    let mut running = spawn(relay);
    w.commit(&[event("k-1", 1)]).await;
    w.records(1, &mut running).await;
    eventually(
        "the stream's session and a drain's ended on the mark",
        || async { metrics.sessions_failed.get() >= 2 },
    )
    .await;
    w.pg.exec("DELETE FROM mark_refused").await.unwrap();
    eventually("the row drained and marked", || async {
        metrics.drained.get() >= 1 && published(&w).await == 1
    })
    .await;
    let records = w.records(3, &mut running).await;
    assert!(
        ids(&records).iter().all(|id| *id == ids(&records)[0]),
        "the same event, published again by each drain"
    );
    stop(running).await;
}

/// Table mode: a slot gone while no relay ran (dropped, or absent after a failover) stops the
/// next relay with `SlotMissing`; `--create-slot` makes a new one, and its first session's
/// drain publishes the rows committed without a slot: nothing is lost. `idem cdc drop-slot`
/// (drop, then forget) lets a relay start again as on a first start.
#[tokio::test(flavor = "multi_thread")]
async fn a_slot_gone_while_no_relay_ran_is_made_again_only_when_asked_and_loses_nothing() {
    let w = World::new().await;
    let relay = w.relay(CdcMetrics::unregistered().unwrap());
    relay.prepare().await.unwrap();
    let mut running = spawn(relay);
    let before = w.streaming(&mut running).await;
    stop(running).await;
    let slot = Name::new("slot", &w.slot).unwrap();
    idem_cdc::drop_slot(w.pg.pool(), &slot).await.unwrap();
    let gap = event("g-1", 1);
    w.commit(std::slice::from_ref(&gap)).await;

    let metrics = CdcMetrics::unregistered().unwrap();
    let err = w.relay(metrics.clone()).prepare().await.unwrap_err();
    assert!(
        matches!(err, idem_cdc::CdcError::SlotMissing { .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("Table mode loses nothing"),
        "{err}"
    );
    assert_eq!(metrics.slot_lost.get(), 1);

    let mut config = w.config();
    config.create_slot = true;
    let metrics = CdcMetrics::unregistered().unwrap();
    let relay = w.relay_with(config, metrics.clone());
    relay.prepare().await.unwrap();
    let mut running = spawn(relay);
    let got = w.records(before + 1, &mut running).await;
    assert_eq!(ids(&got[before..]), vec![gap.id().to_string()]);
    assert_eq!(metrics.slots_created.get(), 1);
    stop(running).await;

    idem_cdc::drop_slot(w.pg.pool(), &slot).await.unwrap();
    idem_cdc::forget_slot(w.pg.pool(), &slot).await.unwrap();
    let metrics = CdcMetrics::unregistered().unwrap();
    w.relay(metrics.clone()).prepare().await.unwrap();
    assert_eq!(metrics.slots_created.get(), 1, "made as on a first start");
}
