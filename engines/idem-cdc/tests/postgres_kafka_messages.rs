//! Message mode (the table-less outbox) against real PostgreSQL and Kafka: events written with
//! `MessageOutbox` next to a business row, published with the table mode's wire contract;
//! rollbacks, other prefixes, hostile messages, and who may write at all (migration 13).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{RoleGuard, Running, World, event, ids, spawn, stop};
use idem_cdc::{CdcMetrics, CdcRelay, Mode};
use idem_conformance::backend::Backend;
use idem_conformance::kafka;
use idem_core::Event;
use idem_core::envelope::{self, Prefix};
use idem_core::outbox::OutboxRecord;
use idem_core::publish::{FailureKind, Message, PublishError, Publisher};
use idem_kafka::KafkaPublisher;
use idem_kafka::inspect::Record;
use idem_sql::postgres::MessageOutbox;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

const PREFIX: &str = "idem.outbox";

/// A message-mode relay, its slot created, running in the background.
async fn started(w: &World, metrics: CdcMetrics) -> Running {
    let relay = relay(w, metrics);
    relay.prepare().await.unwrap();
    spawn(relay)
}

fn relay(w: &World, metrics: CdcMetrics) -> CdcRelay<KafkaPublisher> {
    let mode = Mode::Messages {
        prefix: PREFIX.to_owned(),
    };
    w.relay_with(w.config_in(mode), metrics)
}

/// Commits `events` with the message writer in one transaction, next to a business row.
async fn commit(w: &World, order: &str, events: &[Event]) {
    let mut tx = w.pg.pool().begin().await.unwrap();
    sqlx::query("INSERT INTO test_orders (id, amount_minor) VALUES ($1, 1250)")
        .bind(order)
        .execute(&mut *tx)
        .await
        .unwrap();
    MessageOutbox::default()
        .enqueue_all(&mut tx, events)
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

/// Emits raw `content` as the superuser (a hostile or foreign writer).
async fn emit(w: &World, transactional: bool, prefix: &str, content: &str) {
    sqlx::query("SELECT pg_logical_emit_message($1, $2, $3)")
        .bind(transactional)
        .bind(prefix)
        .bind(content)
        .execute(w.pg.pool())
        .await
        .unwrap();
}

/// The record table mode would have claimed for `e`, at the position the relay published it.
fn expected(e: &Event, got: &Record) -> idem_core::wire::WireRecord {
    let seq: i64 = got.header("idem_aggregate_seq").unwrap().parse().unwrap();
    let record = OutboxRecord::of_event(e, 0, seq, e.occurred_at());
    idem_core::wire::encode(&record, "unused", None)
}

fn seq(r: &Record) -> i64 {
    r.header("idem_aggregate_seq").unwrap().parse().unwrap()
}

/// Two business transactions write three events with the message writer; the relay publishes
/// them in commit order with the wire contract of table mode: the same key, headers and
/// payload bytes `idem_core::wire::encode` gives for the event. The two events of one
/// transaction share their `aggregate_seq` (the commit's position); the later commit's is
/// higher.
#[tokio::test(flavor = "multi_thread")]
async fn message_mode_publishes_events_written_in_a_business_transaction() {
    let w = World::new().await;
    let relay = relay(&w, CdcMetrics::unregistered().unwrap());
    relay.prepare().await.unwrap();
    let first = Event::builder("order", "o-1", "order.paid")
        .payload_json(r#"{"amount_minor":1250,"note":"é \"q\""}"#)
        .header("tenant", "acme")
        .build()
        .unwrap();
    let second = event("o-1", 2);
    let third = event("o-2", 3);
    commit(&w, "10042", &[first.clone(), second.clone()]).await;
    commit(&w, "10043", std::slice::from_ref(&third)).await;
    assert_eq!(w.pg.scalar("SELECT count(*) FROM test_orders").await, 2);
    let mut running = spawn(relay);
    let got = w.expect(&[&first, &second, &third], &mut running).await;
    for (e, r) in [&first, &second, &third].into_iter().zip(&got) {
        let want = expected(e, r);
        assert_eq!(r.key.as_deref(), Some(want.key.as_str()));
        assert_eq!(
            r.payload.as_deref(),
            Some(want.payload.as_str()),
            "payload bytes"
        );
        assert_eq!(r.headers, want.headers, "headers");
    }
    assert_eq!(seq(&got[0]), seq(&got[1]), "one transaction, one position");
    assert!(
        seq(&got[2]) > seq(&got[1]),
        "a later commit, a higher position"
    );
    assert_eq!(
        w.pg.scalar("SELECT count(*) FROM idem_outbox").await,
        0,
        "no outbox row"
    );
    stop(running).await;
}

/// Without a table nothing refuses an event id written again (a writer retrying after a commit
/// whose outcome it did not learn): both copies are published with one `ce_id`, which the
/// consumer's inbox absorbs. One id twice in one call is refused before anything is emitted.
#[tokio::test(flavor = "multi_thread")]
async fn an_event_id_written_twice_in_message_mode_is_published_twice_with_one_ce_id() {
    let w = World::new().await;
    let relay = relay(&w, CdcMetrics::unregistered().unwrap());
    relay.prepare().await.unwrap();
    let e = event("d-1", 1);
    commit(&w, "1", std::slice::from_ref(&e)).await;
    commit(&w, "2", std::slice::from_ref(&e)).await;
    let mut tx = w.pg.pool().begin().await.unwrap();
    let twice = MessageOutbox::default()
        .enqueue_all(&mut tx, &[e.clone(), e.clone()])
        .await;
    assert!(
        matches!(
            twice,
            Err(idem_core::Error::InvalidEvent {
                field: "event_id",
                ..
            })
        ),
        "{twice:?}"
    );
    tx.rollback().await.unwrap();
    let mut running = spawn(relay);
    let got = w.expect(&[&e, &e], &mut running).await;
    assert_eq!(got[0].payload, got[1].payload);
    stop(running).await;
}

/// A rolled-back transaction's messages never reach Kafka, nor does a message under another
/// prefix (another tool's, or a relay with another `--prefix`); the committed events around
/// them do.
#[tokio::test(flavor = "multi_thread")]
async fn rolled_back_messages_and_other_prefixes_are_never_published() {
    let w = World::new().await;
    let mut running = started(&w, CdcMetrics::unregistered().unwrap()).await;
    let mut rolled = w.pg.pool().begin().await.unwrap();
    MessageOutbox::default()
        .enqueue_all(&mut rolled, &[event("r-1", 1), event("r-2", 2)])
        .await
        .unwrap();
    rolled.rollback().await.unwrap();
    let kept = event("k-1", 3);
    commit(&w, "1", std::slice::from_ref(&kept)).await;
    let foreign = event("f-1", 4);
    let mut tx = w.pg.pool().begin().await.unwrap();
    MessageOutbox::new(Prefix::new("other.outbox").unwrap())
        .enqueue(&mut tx, &foreign)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    emit(&w, true, "idem.outbox2", &envelope::encode(&foreign)).await;
    emit(&w, true, "idem", &envelope::encode(&foreign)).await;
    let marker = event("z-1", 5);
    commit(&w, "2", std::slice::from_ref(&marker)).await;
    w.expect(&[&kept, &marker], &mut running).await;
    stop(running).await;
}

/// Anyone allowed to call `pg_logical_emit_message` can write anything under the relay's
/// prefix: content that is not JSON, an event forging a reserved header, and a
/// non-transactional message (written even when its transaction rolls back) are
/// dead-lettered with their reasons, and the events after them still flow.
#[tokio::test(flavor = "multi_thread")]
async fn hostile_messages_are_dead_lettered_and_the_events_after_them_flow() {
    let w = World::new().await;
    let metrics = CdcMetrics::unregistered().unwrap();
    let mut running = started(&w, metrics.clone()).await;
    let before = event("h-0", 0);
    commit(&w, "0", std::slice::from_ref(&before)).await;
    emit(&w, true, PREFIX, "not json").await;
    let forged = envelope::encode(&event("h-1", 1)).replacen(
        "\"headers\":{}",
        "\"headers\":{\"ce_id\":\"forged\"}",
        1,
    );
    assert!(forged.contains("forged"), "{forged}");
    emit(&w, true, PREFIX, &forged).await;
    let loose = event("h-2", 2);
    emit(&w, false, PREFIX, &envelope::encode(&loose)).await;
    let after = event("h-3", 3);
    commit(&w, "3", std::slice::from_ref(&after)).await;
    // Only the writer's events: the hostile ones are set aside.
    w.expect(&[&before, &after], &mut running).await;
    let letters = dead_letters(&w, 3, &mut running).await;
    let reasons: Vec<&str> = letters
        .iter()
        .map(|r| r.header("idem_dead_letter_reason").unwrap_or_default())
        .collect();
    assert!(
        reasons.iter().any(|r| r.contains("not an idem envelope")),
        "{reasons:?}"
    );
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("headers") && r.contains("ce_id")),
        "{reasons:?}"
    );
    assert!(
        reasons.iter().any(|r| r.contains("non-transactional")),
        "{reasons:?}"
    );
    for r in &letters {
        assert!(
            r.header("idem_lsn").is_some(),
            "a dead letter names its position"
        );
    }
    assert_eq!(
        metrics.refused.with_label_values(&["dead_lettered"]).get(),
        3
    );
    stop(running).await;
}

/// One transaction holding two events and a message that is not one: the events are published
/// and counted as published (`idem_cdc_events_total` 2), the message dead-lettered and counted
/// as refused, not subtracted from the published. (Before, the count took every refusal of the
/// batch off its messages: 1.)
#[tokio::test(flavor = "multi_thread")]
async fn a_refusal_next_to_events_is_not_taken_off_the_published_count() {
    let w = World::new().await;
    let metrics = CdcMetrics::unregistered().unwrap();
    let mut running = started(&w, metrics.clone()).await;
    let events = [event("m-1", 1), event("m-2", 2)];
    let mut tx = w.pg.pool().begin().await.unwrap();
    MessageOutbox::default()
        .enqueue(&mut tx, &events[0])
        .await
        .unwrap();
    sqlx::query("SELECT pg_logical_emit_message(true, $1, 'not json')")
        .bind(PREFIX)
        .execute(&mut *tx)
        .await
        .unwrap();
    MessageOutbox::default()
        .enqueue(&mut tx, &events[1])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let after = w.wal_position().await;
    w.expect(&[&events[0], &events[1]], &mut running).await;
    dead_letters(&w, 1, &mut running).await;
    // The counts are taken before the transaction is confirmed.
    common::eventually("the transaction is confirmed", || {
        let m = metrics.clone();
        async move { m.confirmed_lsn.get() >= after }
    })
    .await;
    assert_eq!(
        metrics.refused.with_label_values(&["dead_lettered"]).get(),
        1
    );
    assert_eq!(metrics.events.get(), 2, "published events");
    stop(running).await;
}

async fn dead_letters(w: &World, n: usize, running: &mut Running) -> Vec<Record> {
    let topic = w.dead_letters.clone();
    w.records_in(&topic, n, running).await
}

/// After `idem migrate` (run as a superuser, the suite's case) PUBLIC may not execute
/// `pg_logical_emit_message`: a role without the grant gets permission denied from the
/// writer (with the grant to ask for), a granted role writes, and the relay's start check
/// reports the function closed. Granted to PUBLIC again, the check reports it open (the
/// gauge is 1).
#[tokio::test(flavor = "multi_thread")]
async fn after_the_migration_only_a_granted_role_may_write_messages() {
    let w = World::new().await;
    let suffix = kafka::unique("r").replace('-', "_");
    let (granted, denied) = (
        format!("idem_msg_ok_{suffix}"),
        format!("idem_msg_no_{suffix}"),
    );
    let _roles = RoleGuard {
        url: w.pg.url().to_owned(),
        roles: vec![granted.clone(), denied.clone()],
    };
    let metrics = CdcMetrics::unregistered().unwrap();
    let relay = relay(&w, metrics.clone());
    assert_eq!(relay.check_emit_privilege().await, Some(false));
    assert_eq!(metrics.emit_open_to_public.get(), 0);
    for role in [&granted, &denied] {
        w.pg.exec(&format!("CREATE ROLE \"{role}\" NOLOGIN"))
            .await
            .unwrap();
        w.pg.exec(&format!("GRANT INSERT ON test_orders TO \"{role}\""))
            .await
            .unwrap();
    }
    w.pg.exec(&format!(
        "GRANT EXECUTE ON FUNCTION pg_logical_emit_message(boolean, text, text) TO \"{granted}\""
    ))
    .await
    .unwrap();
    let write_as = |role: String| {
        let pool = w.pg.pool().clone();
        async move {
            let mut tx = pool.begin().await.unwrap();
            sqlx::query(&format!("SET LOCAL ROLE \"{role}\""))
                .execute(&mut *tx)
                .await
                .unwrap();
            let r = MessageOutbox::default()
                .enqueue(&mut tx, &event("p-1", 1))
                .await;
            tx.rollback().await.unwrap();
            r
        }
    };
    let refused = write_as(denied.clone()).await.unwrap_err().to_string();
    assert!(refused.contains("permission denied"), "{refused}");
    assert!(refused.contains("GRANT EXECUTE ON FUNCTION"), "{refused}");
    write_as(granted.clone()).await.unwrap();
    w.pg.exec("GRANT EXECUTE ON FUNCTION pg_logical_emit_message(boolean, text, text) TO PUBLIC")
        .await
        .unwrap();
    assert_eq!(relay.check_emit_privilege().await, Some(true));
    assert_eq!(metrics.emit_open_to_public.get(), 1);
    write_as(denied).await.unwrap();
}

/// Migration 13 run by a role that may not revoke (not a superuser, not the functions'
/// owner) does not fail: it warns, and PUBLIC can still call the function, which the relay's
/// start check reports.
#[tokio::test(flavor = "multi_thread")]
async fn migration_13_by_a_role_that_may_not_revoke_warns_instead_of_failing() {
    let w = World::new().await;
    let suffix = kafka::unique("r").replace('-', "_");
    let migrator = format!("idem_msg_mig_{suffix}");
    let _roles = RoleGuard {
        url: w.pg.url().to_owned(),
        roles: vec![migrator.clone()],
    };
    w.pg.exec("GRANT EXECUTE ON FUNCTION pg_logical_emit_message(boolean, text, text) TO PUBLIC")
        .await
        .unwrap();
    w.pg.exec(&format!("CREATE ROLE \"{migrator}\" NOLOGIN"))
        .await
        .unwrap();
    let migration =
        include_str!("../../../stores/idem-sql/migrations/postgres/0013_emit_message_revoked.sql");
    let mut conn = w.pg.pool().acquire().await.unwrap();
    sqlx::raw_sql(&format!("SET ROLE \"{migrator}\"; {migration}; RESET ROLE"))
        .execute(&mut *conn)
        .await
        .expect("the migration must not fail for a role that may not revoke");
    drop(conn);
    let metrics = CdcMetrics::unregistered().unwrap();
    let relay = relay(&w, metrics.clone());
    assert_eq!(relay.check_emit_privilege().await, Some(true));
    assert_eq!(metrics.emit_open_to_public.get(), 1);
    // The same migration as the superuser closes it.
    sqlx::raw_sql(migration).execute(w.pg.pool()).await.unwrap();
    assert_eq!(relay.check_emit_privilege().await, Some(false));
}

/// A relay whose prefix no writer could use (`MessageOutbox` takes a validated `Prefix`) refuses
/// to start instead of waiting for messages that never come.
#[tokio::test(flavor = "multi_thread")]
async fn a_relay_with_an_invalid_prefix_refuses_to_start() {
    let w = World::new().await;
    let mode = Mode::Messages {
        prefix: "idem outbox".to_owned(),
    };
    let relay = w.relay_with(w.config_in(mode), CdcMetrics::unregistered().unwrap());
    let refused = relay.prepare().await.unwrap_err();
    assert!(
        matches!(&refused, idem_cdc::CdcError::Config(m) if m.contains("message prefix")),
        "{refused}"
    );
    assert!(
        idem_cdc::slot_state(w.pg.pool(), &idem_cdc::Name::new("slot", &w.slot).unwrap())
            .await
            .unwrap()
            .is_none(),
        "no slot created"
    );
}

/// A non-transactional message with the relay's prefix belongs to no transaction, so the
/// acknowledgement rule does not hold it: the server's keepalive that follows it (sent at once
/// when the client is behind) must not confirm past it before its dead letter is durable, or a
/// crash in between loses the dead letter. With a long linger the dead letter waits in the
/// batch; the slot's position may pass the message only once the dead letter is in the topic,
/// never while the topic is still empty.
#[tokio::test(flavor = "multi_thread")]
async fn a_keepalive_never_confirms_past_a_message_whose_dead_letter_is_not_durable() {
    let w = World::new().await;
    let mode = Mode::Messages {
        prefix: PREFIX.to_owned(),
    };
    let mut config = w.config_in(mode);
    config.linger = std::time::Duration::from_secs(5);
    let relay = w.relay_with(config, CdcMetrics::unregistered().unwrap());
    relay.prepare().await.unwrap();
    let running = spawn(relay);
    let lsn: String = sqlx::query_scalar("SELECT pg_logical_emit_message(false, $1, 'x')::text")
        .bind(PREFIX)
        .fetch_one(w.pg.pool())
        .await
        .unwrap();
    let lsn = idem_cdc::changes::parse_lsn(&lsn).unwrap();
    let slot = idem_cdc::Name::new("slot", &w.slot).unwrap();
    common::eventually("the slot to confirm past the message", || async {
        idem_cdc::slot_state(w.pg.pool(), &slot)
            .await
            .unwrap()
            .and_then(|s| s.confirmed_flush_lsn)
            .as_deref()
            .and_then(idem_cdc::changes::parse_lsn)
            .is_some_and(|confirmed| confirmed > lsn)
    })
    .await;
    let (brokers, topic) = (w.brokers.clone(), w.dead_letters.clone());
    let letters = tokio::task::spawn_blocking(move || {
        idem_kafka::inspect::read_all(&brokers, &topic, std::time::Duration::from_secs(10))
            .unwrap_or_default()
    })
    .await
    .unwrap();
    assert_eq!(
        letters.len(),
        1,
        "the position passed the message before its dead letter was in the topic"
    );
    stop(running).await;
}

/// A hostile message larger than Kafka accepts (2 MiB under the relay's prefix) is refused
/// unparsed; its dead letter carries a bounded excerpt, so Kafka takes it and the events after
/// it flow. (A dead letter with the whole content would be refused by Kafka for good, and
/// retried forever with nothing else published.)
#[tokio::test(flavor = "multi_thread")]
async fn a_message_too_large_for_kafka_is_dead_lettered_as_an_excerpt_and_later_events_flow() {
    let w = World::new().await;
    let mut running = started(&w, CdcMetrics::unregistered().unwrap()).await;
    emit(&w, true, PREFIX, &"x".repeat(2 << 20)).await;
    let after = event("big-1", 1);
    commit(&w, "1", std::slice::from_ref(&after)).await;
    w.expect(&[&after], &mut running).await;
    let letters = dead_letters(&w, 1, &mut running).await;
    let letter = &letters[0];
    assert!(
        letter.payload.as_deref().unwrap_or_default().len()
            <= idem_cdc::changes::DEAD_LETTER_EXCERPT_BYTES,
        "an excerpt"
    );
    assert_eq!(
        letter.header("idem_dead_letter_content_bytes"),
        Some((2usize << 20).to_string().as_str())
    );
    assert!(
        letter
            .header("idem_dead_letter_reason")
            .is_some_and(|r| r.contains("limit")),
        "{:?}",
        letter.headers
    );
    stop(running).await;
}

/// The refusal's reason can quote what it refuses (a header name of 990 000 bytes: with the
/// content excerpt, more than Kafka takes): the dead letter's reason header is bounded too, or
/// Kafka would refuse the dead letter for good and the relay would retry it forever.
#[tokio::test(flavor = "multi_thread")]
async fn a_refusal_quoting_a_huge_value_is_still_dead_lettered() {
    let w = World::new().await;
    let mut running = started(&w, CdcMetrics::unregistered().unwrap()).await;
    let huge = envelope::encode(&event("q-1", 1)).replacen(
        "\"headers\":{}",
        &format!("\"headers\":{{\"{}\":\"v\"}}", "h".repeat(990_000)),
        1,
    );
    emit(&w, true, PREFIX, &huge).await;
    let after = event("q-2", 2);
    commit(&w, "1", std::slice::from_ref(&after)).await;
    w.expect(&[&after], &mut running).await;
    let letters = dead_letters(&w, 1, &mut running).await;
    let reason = letters[0]
        .header("idem_dead_letter_reason")
        .unwrap_or_default();
    assert!(
        reason.len() <= idem_cdc::changes::DEAD_LETTER_REASON_BYTES,
        "{}",
        reason.len()
    );
    assert!(reason.contains("header"), "{reason:.200}");
    stop(running).await;
}

/// A publisher that fails every dead letter (`kind`), counting the attempts, and sends the
/// rest with Kafka.
struct FailingDeadLetters {
    kafka: KafkaPublisher,
    topic: String,
    kind: FailureKind,
    attempts: Arc<AtomicUsize>,
}

impl Publisher for FailingDeadLetters {
    async fn publish(&self, messages: &[Message]) -> Vec<Result<(), PublishError>> {
        if messages.iter().any(|m| m.topic == self.topic) {
            self.attempts.fetch_add(1, Ordering::SeqCst);
            let refused = PublishError {
                kind: self.kind,
                reason: "test: the dead-letter topic fails".to_owned(),
            };
            return vec![Err(refused); messages.len()];
        }
        self.kafka.publish(messages).await
    }
}

/// A message-mode relay whose dead letters all fail with `kind`, running, with one hostile
/// message (at the returned position) waiting to be dead-lettered and an event after it; and
/// the count of dead-letter attempts.
async fn failing_dead_letters(
    w: &World,
    kind: FailureKind,
) -> (Running, Event, String, Arc<AtomicUsize>) {
    let config = w.config_in(Mode::Messages {
        prefix: PREFIX.to_owned(),
    });
    let producer = idem_kafka::producer_config(&w.brokers, &[]).unwrap();
    let publisher = FailingDeadLetters {
        kafka: KafkaPublisher::new(producer)
            .unwrap()
            .with_topic_creation(1, Some(1)),
        topic: w.dead_letters.clone(),
        kind,
        attempts: Arc::default(),
    };
    let attempts = publisher.attempts.clone();
    let metrics = CdcMetrics::unregistered().unwrap();
    let relay = CdcRelay::new(w.pg.url(), w.pg.pool().clone(), publisher, config, metrics);
    relay.prepare().await.unwrap();
    let running = spawn(relay);
    let hostile: String =
        sqlx::query_scalar("SELECT pg_logical_emit_message(true, $1, 'not an envelope')::text")
            .bind(PREFIX)
            .fetch_one(w.pg.pool())
            .await
            .unwrap();
    let after = event("dl-1", 1);
    commit(w, "1", std::slice::from_ref(&after)).await;
    (running, after, hostile, attempts)
}

/// A dead-letter topic that refuses a record for good stops the relay with a message naming
/// the topic, instead of retrying forever while nothing else is published; the refused
/// message's position is not confirmed, so a relay with a working topic dead-letters it and
/// the event after it flows. (Before, the relay retried the dead letter forever.)
#[tokio::test(flavor = "multi_thread")]
async fn a_dead_letter_topic_that_refuses_records_stops_the_relay_and_loses_nothing() {
    let w = World::new().await;
    let (mut running, after, ..) = failing_dead_letters(&w, FailureKind::Permanent).await;
    let ended = tokio::time::timeout(std::time::Duration::from_secs(60), &mut running.1)
        .await
        .expect("the relay kept retrying the dead letter")
        .unwrap();
    let err = ended.unwrap_err();
    assert!(
        matches!(&err, idem_cdc::CdcError::DeadLetterRefused { topic, .. } if *topic == w.dead_letters),
        "{err}"
    );
    let mut running = started(&w, CdcMetrics::unregistered().unwrap()).await;
    let letters = dead_letters(&w, 1, &mut running).await;
    assert_eq!(letters[0].payload.as_deref(), Some("not an envelope"));
    // The event after it flows; the stopped relay may have published it already (its batch
    // was produced before the dead letter failed, and nothing was confirmed): then it comes
    // twice, with one ce_id.
    let got = w.records(1, &mut running).await;
    assert!(
        ids(&got).iter().all(|id| *id == after.id().to_string()),
        "{:?}",
        ids(&got)
    );
    stop(running).await;
}

/// While a dead letter fails again and again (transient), a shutdown still stops the relay
/// at once, and nothing at or past the message is confirmed. (Before, the retry loop ignored
/// shutdown: the relay never stopped.)
#[tokio::test(flavor = "multi_thread")]
async fn a_relay_retrying_a_dead_letter_still_stops_when_asked() {
    let w = World::new().await;
    let (running, _, hostile, attempts) = failing_dead_letters(&w, FailureKind::Transient).await;
    common::eventually("the dead letter failed twice", || {
        let n = attempts.load(Ordering::SeqCst);
        async move { n >= 2 }
    })
    .await;
    let (stop, task) = running;
    let _ = stop.send(());
    let ended = tokio::time::timeout(std::time::Duration::from_secs(20), task)
        .await
        .expect("the relay did not stop while retrying a dead letter")
        .unwrap();
    ended.unwrap();
    let past: bool = sqlx::query_scalar(
        "SELECT confirmed_flush_lsn >= $2::text::pg_lsn FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(&w.slot)
    .bind(&hostile)
    .fetch_one(w.pg.pool())
    .await
    .unwrap();
    assert!(
        !past,
        "the slot confirmed past a message whose dead letter was never sent"
    );
}

/// A dead-letter topic Kafka can never accept is refused before the relay starts.
#[tokio::test(flavor = "multi_thread")]
async fn an_invalid_dead_letter_topic_is_refused_at_start() {
    let w = World::new().await;
    let mut config = w.config_in(Mode::Messages {
        prefix: PREFIX.to_owned(),
    });
    config.dead_letter_topic = "no such topic!".to_owned();
    let relay = w.relay_with(config, CdcMetrics::unregistered().unwrap());
    let refused = relay.prepare().await.unwrap_err();
    assert!(
        matches!(&refused, idem_cdc::CdcError::Config(m) if m.contains("no such topic!")),
        "{refused}"
    );
}

/// `enqueue_with` joins the events to the caller's own write in one statement: the row and the
/// events commit together and are published; a write that fails (a unique violation) fails the
/// statement with the write's SQLSTATE and emits nothing; a write naming a placeholder it does
/// not bind is refused before anything is sent (the transaction is still usable).
#[tokio::test(flavor = "multi_thread")]
async fn enqueue_with_writes_the_row_and_the_events_in_one_statement_or_neither() {
    let w = World::new().await;
    let mut running = started(&w, CdcMetrics::unregistered().unwrap()).await;
    let insert = "INSERT INTO test_orders (id, amount_minor) VALUES ($1, $2)";
    let outbox = MessageOutbox::default();
    let (a, b) = (event("w-1", 1), event("w-1", 2));
    let mut tx = w.pg.pool().begin().await.unwrap();
    let write = sqlx::query(insert).bind("500").bind(1250_i64);
    outbox
        .enqueue_with(&mut tx, write, &[a.clone(), b.clone()])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        w.pg.scalar("SELECT count(*) FROM test_orders WHERE id = '500'")
            .await,
        1
    );

    let lost = event("w-2", 3);
    let mut tx = w.pg.pool().begin().await.unwrap();
    let again = sqlx::query(insert).bind("500").bind(1_i64);
    let err = outbox
        .enqueue_with(&mut tx, again, std::slice::from_ref(&lost))
        .await
        .unwrap_err();
    let code = match &err {
        idem_core::Error::Database { source, .. } => source
            .downcast_ref::<sqlx::Error>()
            .and_then(|e| e.as_database_error())
            .and_then(|d| d.code())
            .map(|c| c.into_owned()),
        _ => None,
    };
    assert_eq!(code.as_deref(), Some("23505"), "{err}");
    tx.rollback().await.unwrap();

    let mut tx = w.pg.pool().begin().await.unwrap();
    let short = sqlx::query(insert).bind("501");
    let refused = outbox
        .enqueue_with(&mut tx, short, std::slice::from_ref(&lost))
        .await;
    assert!(
        matches!(
            &refused,
            Err(idem_core::Error::InvalidArgument { argument: "business statement of enqueue_with", reason })
                if reason.contains("$2")
        ),
        "{refused:?}"
    );
    let one: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(one, 1, "nothing was sent: the transaction is not aborted");
    tx.rollback().await.unwrap();

    let marker = event("w-3", 4);
    commit(&w, "502", std::slice::from_ref(&marker)).await;
    w.expect(&[&a, &b, &marker], &mut running).await;
    stop(running).await;
}

/// Drops `w`'s slot between two sessions of the relay reading it: its walsender is ended, and
/// the slot dropped before the relay's next session takes it (tried again until it is).
async fn drop_the_slot_between_sessions(w: &World) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let dropped: Option<String> = sqlx::query_scalar(
            "SELECT slot_name::text FROM pg_replication_slots, \
             LATERAL pg_drop_replication_slot(slot_name) WHERE slot_name = $1 AND NOT active",
        )
        .bind(&w.slot)
        .fetch_optional(w.pg.pool())
        .await
        .unwrap_or(None);
        if dropped.is_some() {
            return;
        }
        sqlx::query(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
             WHERE slot_name = $1 AND active",
        )
        .bind(&w.slot)
        .execute(w.pg.pool())
        .await
        .unwrap();
        assert!(
            std::time::Instant::now() < deadline,
            "the slot was never free to drop"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// A slot that vanishes between sessions (dropped, or absent on the server a failover made
/// primary) is never made again in silence: the relay stops with `SlotMissing` and
/// `idem_cdc_slot_lost` = 1, and so does a relay started later (the publication records the
/// slot). `--create-slot` makes one, once; the events committed without a slot are in no
/// stream, which is what the error says.
#[tokio::test(flavor = "multi_thread")]
async fn a_slot_gone_between_sessions_stops_the_relay_instead_of_being_made_again() {
    let w = World::new().await;
    let metrics = CdcMetrics::unregistered().unwrap();
    let mut running = started(&w, metrics.clone()).await;
    let (m1, m2, m3) = (event("m-1", 1), event("m-2", 2), event("m-3", 3));
    commit(&w, "1", std::slice::from_ref(&m1)).await;
    w.expect(&[&m1], &mut running).await;
    drop_the_slot_between_sessions(&w).await;
    commit(&w, "2", std::slice::from_ref(&m2)).await;
    let ended = tokio::time::timeout(std::time::Duration::from_secs(60), running.1)
        .await
        .expect("the relay stops")
        .unwrap();
    let err = ended.expect_err("a missing slot is an error");
    assert!(
        matches!(err, idem_cdc::CdcError::SlotMissing { .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("`CdcConfig::create_slot`"),
        "{err}"
    );
    assert!(err.to_string().contains("in no stream"), "{err}");
    assert_eq!(metrics.slot_lost.get(), 1);
    assert_eq!(metrics.slots_created.get(), 1, "the first start's only");
    let none: i64 =
        w.pg.scalar(&format!(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{}'",
            w.slot
        ))
        .await;
    assert_eq!(none, 0, "no slot made again");

    let later = CdcMetrics::unregistered().unwrap();
    let err = relay(&w, later.clone()).prepare().await.unwrap_err();
    assert!(
        matches!(err, idem_cdc::CdcError::SlotMissing { .. }),
        "a relay started later: {err}"
    );
    assert_eq!(later.slot_lost.get(), 1);

    let mode = Mode::Messages {
        prefix: PREFIX.to_owned(),
    };
    let mut config = w.config_in(mode);
    config.create_slot = true;
    let again = CdcMetrics::unregistered().unwrap();
    let relay = w.relay_with(config, again.clone());
    relay.prepare().await.unwrap();
    assert_eq!((again.slots_created.get(), again.slot_lost.get()), (1, 0));
    let mut running = spawn(relay);
    commit(&w, "3", std::slice::from_ref(&m3)).await;
    let got = w.records(2, &mut running).await;
    assert_eq!(ids(&got), vec![m1.id().to_string(), m3.id().to_string()]);
    stop(running).await;
}
