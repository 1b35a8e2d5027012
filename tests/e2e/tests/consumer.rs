//! The consumer runtime with the settlement handler against real PostgreSQL and librdkafka's
//! mock cluster: duplicates, poison records, money edge cases.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use idem_conformance::backend::{Backend, Pg};
use idem_conformance::process::eventually;
use idem_consumer::{Consumer, ConsumerConfig, ConsumerMetrics, total};
use idem_core::publish::{Message, Publisher};
use idem_core::store::{InboxStore, Source};
use idem_core::{EventId, TableNames};
use idem_kafka::{EmbeddedCluster, KafkaPublisher, KafkaSource, consumer_config};
use idem_reference::{PaidOrder, Settlement};
use idem_sql::postgres::PgInbox;
use tokio::sync::watch;

const TOPIC: &str = "outbox.event.order";

struct Setup {
    pg: Pg,
    _cluster: EmbeddedCluster,
    brokers: String,
    publisher: KafkaPublisher,
}

async fn setup() -> Setup {
    let pg = Pg::new().await;
    idem_reference::ensure_schema_postgres(pg.pool())
        .await
        .unwrap();
    let cluster = EmbeddedCluster::start(1).unwrap();
    cluster.create_topic(TOPIC, 2).unwrap();
    let brokers = cluster.bootstrap_servers();
    let publisher =
        KafkaPublisher::new(idem_kafka::producer_config(&brokers, &[]).unwrap()).unwrap();
    Setup {
        pg,
        _cluster: cluster,
        brokers,
        publisher,
    }
}

/// A record as the relay would publish it.
fn record(id: EventId, key: &str, payload: &str) -> Message {
    Message {
        topic: TOPIC.into(),
        key: key.into(),
        payload: payload.into(),
        headers: vec![
            ("ce_id".into(), id.to_string()),
            ("ce_type".into(), "order.paid".into()),
            ("idem_aggregate_type".into(), "order".into()),
            ("idem_aggregate_id".into(), key.into()),
        ],
    }
}

fn paid(n: u64) -> (EventId, Message) {
    let o = PaidOrder::numbered("", n);
    let e = o.event().unwrap();
    (e.id(), record(e.id(), &o.order_id, e.payload()))
}

/// Runs a settlement consumer in the background until the returned sender says stop.
fn start_consumer(
    s: &Setup,
) -> (
    watch::Sender<bool>,
    tokio::task::JoinHandle<ConsumerMetrics>,
) {
    let (stop, handle) = start_consumer_with(s, Settlement::new());
    (
        stop,
        tokio::spawn(async move {
            let (result, metrics) = handle.await.unwrap();
            result.unwrap();
            metrics
        }),
    )
}

/// Runs a consumer with `handler` (retry backoff 10 to 50 ms) until the sender says stop; the
/// task returns how its run ended and its metrics.
fn start_consumer_with<H: idem_consumer::Handler<sqlx::PgConnection>>(
    s: &Setup,
    handler: H,
) -> (
    watch::Sender<bool>,
    tokio::task::JoinHandle<(idem_core::Result<()>, ConsumerMetrics)>,
) {
    let (stop, handle, _) = start_consumer_metered(s, handler);
    (stop, handle)
}

/// A consumer running in the background: its stop switch, its task, its metrics.
type Metered = (
    watch::Sender<bool>,
    tokio::task::JoinHandle<(idem_core::Result<()>, ConsumerMetrics)>,
    ConsumerMetrics,
);

/// [`start_consumer_with`], and the metrics to read while it runs.
fn start_consumer_metered<H: idem_consumer::Handler<sqlx::PgConnection>>(
    s: &Setup,
    handler: H,
) -> Metered {
    let source = KafkaSource::new(
        &consumer_config(&s.brokers, "settlement", &[]).unwrap(),
        &[TOPIC.to_owned()],
    )
    .unwrap();
    let metrics = ConsumerMetrics::new(&prometheus::Registry::new()).unwrap();
    let inbox = PgInbox::new(s.pg.pool().clone(), TableNames::default());
    let mut config = ConsumerConfig::new("settlement");
    config.retry_backoff = Duration::from_millis(10);
    config.retry_backoff_max = Duration::from_millis(50);
    let consumer = Consumer::new(inbox, handler, source, config, metrics.clone());
    let (tx, mut rx) = watch::channel(false);
    let observed = metrics.clone();
    let handle = tokio::spawn(async move {
        let result = consumer
            .run(async move {
                let _ = rx.wait_for(|s| *s).await;
            })
            .await;
        (result, metrics)
    });
    (tx, handle, observed)
}

async fn scalar(s: &Setup, sql: &str) -> i64 {
    sqlx::query_scalar::<_, i64>(sql)
        .fetch_one(s.pg.pool())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_event_delivered_twice_settles_once() {
    let s = setup().await;
    let (id, msg) = paid(1);
    let acks = s.publisher.publish(&[msg.clone(), msg]).await;
    assert!(acks.iter().all(Result::is_ok), "{acks:?}");
    let (stop, handle) = start_consumer(&s);
    let count_sql = format!(
        "SELECT coalesce(max(delivery_count), 0)::bigint FROM idem_inbox WHERE event_id = '{id}'"
    );
    eventually(
        "both copies to be delivered",
        Duration::from_secs(30),
        || async { (scalar(&s, &count_sql).await == 2).then_some(()) },
    )
    .await;
    stop.send(true).unwrap();
    let metrics = handle.await.unwrap();
    assert_eq!(scalar(&s, "SELECT count(*) FROM settlements").await, 1);
    assert_eq!(
        scalar(&s, "SELECT amount_minor FROM settlements").await,
        101
    );
    assert_eq!(total(&metrics.processed), 1);
    assert_eq!(total(&metrics.duplicate_skips), 1);
    assert_eq!(total(&metrics.duplicate_deliveries), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_records_and_bad_money_are_dead_lettered_and_the_rest_settled() {
    let s = setup().await;
    let (good1, m1) = paid(1);
    let (good2, m2) = paid(2);
    let k = "order-x";
    let bad = |payload: &str| record(EventId::new(), k, payload);
    let mut no_id = bad("{}");
    no_id.headers.retain(|(h, _)| h != "ce_id");
    let money = |amount: &str| {
        format!(
            r#"{{"order_id":"order-x","payment_id":"pay-x","amount":{amount},"currency":"EUR"}}"#
        )
    };
    let cases = vec![
        (no_id, "no ce_id header"),
        (bad("{not json"), "not valid JSON"),
        (bad(&money(r#""-5.00""#)), "must be positive"),
        (bad(&money(r#""0.00""#)), "must be positive"),
        (
            bad(&money(r#""123456789012345678.00""#)),
            "exceeds the maximum",
        ),
        (bad(&money(r#""12,50""#)), "not a decimal"),
        (bad(&money("12.5")), "never a float"),
        (
            bad(r#"{"payment_id":"pay-y","amount":"1.00"}"#),
            "no order_id",
        ),
    ];
    let mut batch = vec![m1];
    batch.extend(cases.iter().map(|(m, _)| m.clone()));
    batch.push(m2);
    assert!(s.publisher.publish(&batch).await.iter().all(Result::is_ok));
    let (stop, handle) = start_consumer(&s);
    eventually(
        "every record to be handled",
        Duration::from_secs(30),
        || async {
            let done = scalar(&s, "SELECT count(*) FROM settlements").await
                + scalar(&s, "SELECT count(*) FROM idem_dead_letters").await;
            (done == 2 + i64::try_from(cases.len()).unwrap()).then_some(())
        },
    )
    .await;
    stop.send(true).unwrap();
    let metrics = handle.await.unwrap();
    let settled: Vec<String> =
        sqlx::query_scalar("SELECT event_id::text FROM settlements ORDER BY payment_id")
            .fetch_all(s.pg.pool())
            .await
            .unwrap();
    assert_eq!(
        settled,
        vec![good1.to_string(), good2.to_string()],
        "no partial effect of a bad record"
    );
    let inbox = PgInbox::new(s.pg.pool().clone(), TableNames::default());
    let letters = inbox.dead_letters("settlement", 100).await.unwrap();
    assert_eq!(letters.len(), cases.len());
    for (_, want) in &cases {
        assert!(
            letters.iter().any(|l| l.reason.contains(want)),
            "no dead letter says {want:?}: {letters:#?}"
        );
    }
    assert_eq!(total(&metrics.dead_lettered), cases.len() as u64);
    assert_eq!(total(&metrics.processed), 2);
    // The offsets moved past the bad records.
    let committed = {
        let b = s.brokers.clone();
        tokio::task::spawn_blocking(move || {
            idem_kafka::inspect::committed_offsets(&b, "settlement", TOPIC, Duration::from_secs(10))
        })
        .await
        .unwrap()
        .unwrap()
    };
    let next: i64 = committed.iter().map(|(_, o)| o).sum();
    assert_eq!(
        next,
        i64::try_from(batch.len()).unwrap(),
        "committed offsets cover every record: {committed:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_groups_each_apply_every_event_once() {
    let s = setup().await;
    let (id, msg) = paid(7);
    assert!(s.publisher.publish(&[msg]).await.iter().all(Result::is_ok));
    let inbox = PgInbox::new(s.pg.pool().clone(), TableNames::default());
    for group in ["settlement", "audit"] {
        let source = KafkaSource::new(
            &consumer_config(&s.brokers, group, &[]).unwrap(),
            &[TOPIC.to_owned()],
        )
        .unwrap();
        let metrics = ConsumerMetrics::new(&prometheus::Registry::new()).unwrap();
        let c = Consumer::new(
            inbox.clone(),
            Settlement::new(),
            source,
            ConsumerConfig::new(group),
            metrics.clone(),
        );
        let (tx, mut rx) = watch::channel(false);
        let h = tokio::spawn(async move {
            c.run(async move {
                let _ = rx.wait_for(|s| *s).await;
            })
            .await
            .unwrap();
        });
        let sql = format!(
            "SELECT count(*) FROM idem_inbox WHERE consumer_group = '{group}' AND event_id = '{id}'"
        );
        eventually(
            "the group to record the event",
            Duration::from_secs(30),
            || async { (scalar(&s, &sql).await == 1).then_some(()) },
        )
        .await;
        tx.send(true).unwrap();
        h.await.unwrap();
        assert_eq!(total(&metrics.duplicate_skips), 0, "{group} saw it as new");
    }
    assert_eq!(
        scalar(&s, "SELECT count(*) FROM idem_inbox").await,
        2,
        "one inbox row per group"
    );
    assert_eq!(
        scalar(&s, "SELECT count(*) FROM settlements").await,
        1,
        "the business key still converges"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_payment_under_two_event_ids_converges_to_one_settlement() {
    let s = setup().await;
    let order = PaidOrder::numbered("", 9);
    let (a, b) = (order.event().unwrap(), order.event().unwrap());
    assert_ne!(a.id(), b.id(), "the same business fact enqueued twice");
    let msgs = [
        record(a.id(), &order.order_id, a.payload()),
        record(b.id(), &order.order_id, b.payload()),
    ];
    assert!(s.publisher.publish(&msgs).await.iter().all(Result::is_ok));
    let (stop, handle) = start_consumer(&s);
    eventually(
        "both events to be recorded",
        Duration::from_secs(30),
        || async { (scalar(&s, "SELECT count(*) FROM idem_inbox").await == 2).then_some(()) },
    )
    .await;
    stop.send(true).unwrap();
    let metrics = handle.await.unwrap();
    assert_eq!(
        total(&metrics.processed),
        2,
        "two distinct events: the inbox cannot know they are one fact"
    );
    assert_eq!(
        scalar(&s, "SELECT count(*) FROM settlement_applications").await,
        2
    );
    assert_eq!(
        scalar(&s, "SELECT count(*) FROM settlements").await,
        1,
        "the unique payment_id converges them"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lag_probe_counts_what_the_member_has_not_read_yet() {
    let s = setup().await;
    let msgs: Vec<Message> = (1..=10).map(|n| paid(n).1).collect();
    assert!(s.publisher.publish(&msgs).await.iter().all(Result::is_ok));
    let source = KafkaSource::new(
        &consumer_config(&s.brokers, "lag", &[]).unwrap(),
        &[TOPIC.to_owned()],
    )
    .unwrap();
    let probe = source.lag_probe().expect("a Kafka source measures its lag");
    let measure = || {
        let p = probe.clone();
        async move { tokio::task::spawn_blocking(move || p()).await.unwrap() }
    };
    let first = source.next_batch(4, Duration::from_secs(2)).await.unwrap();
    assert_eq!(first.len(), 4);
    assert_eq!(
        measure().await,
        vec![(TOPIC.to_owned(), 6)],
        "ten published, four handed to the runtime (a partition not read yet counts from its start)"
    );
    let rest = source
        .next_batch(100, Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(rest.len(), 6);
    assert_eq!(measure().await, vec![(TOPIC.to_owned(), 0)]);
    assert!(
        first.iter().chain(&rest).all(|d| d.timestamp.is_some()),
        "the producer stamps every record"
    );
}

/// The settlement handler, but for payment `pay-3`, while `swallow` is set, it also runs a
/// statement that fails and swallows the error — the "duplicate key means done" idiom done
/// wrong. `calls` counts its calls for pay-3 that swallowed an error (the flag is read first, so
/// a call counted is a call that failed, whenever the test clears the flag).
struct Swallowing {
    inner: Settlement,
    swallow: std::sync::Arc<std::sync::atomic::AtomicBool>,
    calls: std::sync::Arc<std::sync::atomic::AtomicU32>,
}

impl idem_consumer::Handler<sqlx::PgConnection> for Swallowing {
    async fn handle(
        &self,
        cx: &mut idem_consumer::HandlerContext<'_, sqlx::PgConnection>,
        e: &idem_core::InboundEvent,
    ) -> Result<(), idem_consumer::HandlerError> {
        use std::sync::atomic::Ordering;
        self.inner.handle(cx, e).await?;
        if e.payload["payment_id"] == "pay-3" && self.swallow.load(Ordering::SeqCst) {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let _ = sqlx::query("SELECT 1 / 0").execute(cx.conn()).await;
        }
        Ok(())
    }
}

/// PostgreSQL aborts a transaction at its first failed statement and answers `COMMIT` with
/// `ROLLBACK`, no error. A consumer that took that for a commit would commit the offsets of a
/// batch whose inbox rows and settlements are gone. The transaction is checked before the
/// commit, the batch is retried one event at a time, and the swallowing handler's event is found
/// and retried as a transient failure: never dead-lettered, held back with its batch until the
/// handler behaves; then everything settles once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_swallows_a_database_error_loses_nothing() {
    use std::sync::atomic::Ordering;
    let s = setup().await;
    let msgs: Vec<Message> = (1..=5).map(|n| paid(n).1).collect();
    let acks = s.publisher.publish(&msgs).await;
    assert!(acks.iter().all(Result::is_ok), "{acks:?}");
    let swallow = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let handler = Swallowing {
        inner: Settlement::new(),
        swallow: swallow.clone(),
        calls: calls.clone(),
    };
    let (stop, handle) = start_consumer_with(&s, handler);
    // Five failed calls: the first may be the whole batch's (found unusable at the commit, not
    // charged to an event); each later one is an isolated retry of pay-3 (`retries` + 1).
    eventually(
        "pay-3's handler to fail five times, retried in isolation",
        Duration::from_secs(60),
        || async { (calls.load(Ordering::SeqCst) >= 5).then_some(()) },
    )
    .await;
    assert_eq!(
        scalar(
            &s,
            "SELECT count(*) FROM settlements WHERE payment_id = 'pay-3'"
        )
        .await,
        0,
        "the swallowing handler's writes were rolled back"
    );
    assert_eq!(
        scalar(&s, "SELECT count(*) FROM idem_dead_letters").await,
        0,
        "a transient failure never dead-letters"
    );
    swallow.store(false, Ordering::SeqCst);
    eventually(
        "the five payments to settle",
        Duration::from_secs(60),
        || async { (scalar(&s, "SELECT count(*) FROM settlements").await == 5).then_some(()) },
    )
    .await;
    stop.send(true).unwrap();
    let (result, metrics) = handle.await.unwrap();
    result.unwrap();
    assert_eq!(scalar(&s, "SELECT count(*) FROM idem_inbox").await, 5);
    assert_eq!(
        scalar(&s, "SELECT count(*) FROM idem_dead_letters").await,
        0
    );
    assert_eq!(total(&metrics.dead_lettered), 0);
    assert!(total(&metrics.retries) >= 4);
}

/// End to end: a lock held on the business table makes every attempt of the handler time out
/// (SQLSTATE 55P03, transient) far past ten retries. Nothing is dead-lettered, the member is
/// reported stalled, and once the lock is released every payment settles once. (The chaos runner's long-lock fault class; with
/// `IDEM_BREAK=transient-dead-letters` the same run dead-letters the payments.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_held_on_the_business_table_stalls_the_batch_and_dead_letters_nothing() {
    let s = setup().await;
    let mut locker = s.pg.pool().begin().await.unwrap();
    sqlx::query("LOCK TABLE settlements IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *locker)
        .await
        .unwrap();
    let msgs: Vec<Message> = (1..=3).map(|n| paid(n).1).collect();
    assert!(s.publisher.publish(&msgs).await.iter().all(Result::is_ok));
    let handler = Settlement::new().with_lock_timeout(Duration::from_millis(20));
    let (stop, handle, metrics) = start_consumer_metered(&s, handler);
    eventually(
        "thirty lock timeouts (three times the old dead-letter budget)",
        Duration::from_secs(60),
        || async {
            (total(&metrics.retries) >= 30 || total(&metrics.dead_lettered) > 0).then_some(())
        },
    )
    .await;
    assert_eq!(
        scalar(&s, "SELECT count(*) FROM idem_dead_letters").await,
        0,
        "a transient failure dead-lettered a payment"
    );
    assert_eq!(total(&metrics.dead_lettered), 0);
    let stalled = metrics
        .stalled_since
        .with_label_values(&[TOPIC, "settlement"])
        .get();
    assert!(stalled > 0, "the member reports itself stalled");
    locker.rollback().await.unwrap();
    eventually(
        "the three payments to settle once the lock is gone",
        Duration::from_secs(60),
        || async { (scalar(&s, "SELECT count(*) FROM settlements").await == 3).then_some(()) },
    )
    .await;
    stop.send(true).unwrap();
    let (result, metrics) = handle.await.unwrap();
    result.unwrap();
    assert_eq!(scalar(&s, "SELECT count(*) FROM idem_inbox").await, 3);
    assert_eq!(
        scalar(&s, "SELECT count(*) FROM idem_dead_letters").await,
        0
    );
    assert_eq!(total(&metrics.dead_lettered), 0);
    assert_eq!(
        metrics
            .stalled_since
            .with_label_values(&[TOPIC, "settlement"])
            .get(),
        0,
        "flowing again"
    );
}

/// `order.paid` number `n`, keyed `key`: every record of one key goes to one partition.
fn paid_keyed(n: u64, key: &str) -> (EventId, Message) {
    let o = PaidOrder::numbered("", n);
    let e = o.event().unwrap();
    (e.id(), record(e.id(), key, e.payload()))
}

/// A `BEFORE INSERT` trigger on `settlements` that raises `errcode` for `payment` (the
/// PostgreSQL way of a business rule refusing a row).
async fn refuse_payment(s: &Setup, name: &str, payment: &str, errcode: &str) {
    let function = format!(
        "CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN \
           IF NEW.payment_id = '{payment}' THEN \
             RAISE EXCEPTION 'payment % is frozen', NEW.payment_id USING ERRCODE = '{errcode}'; \
           END IF; \
           RETURN NEW; \
         END $$"
    );
    sqlx::query(&function).execute(s.pg.pool()).await.unwrap();
    let trigger = format!(
        "CREATE TRIGGER {name} BEFORE INSERT ON settlements FOR EACH ROW EXECUTE FUNCTION {name}()"
    );
    sqlx::query(&trigger).execute(s.pg.pool()).await.unwrap();
}

async fn settled_payments(s: &Setup) -> Vec<String> {
    sqlx::query_scalar("SELECT payment_id FROM settlements ORDER BY payment_id")
        .fetch_all(s.pg.pool())
        .await
        .unwrap()
}

/// Review 3, N6: a trigger that refuses one payment with `RAISE EXCEPTION` (SQLSTATE `P0001`),
/// and one that refuses another with `54000` (program limit exceeded), in one partition. Each
/// refused event is dead-lettered with the trigger's message and its SQLSTATE, the others of
/// the partition settle, and events published afterwards flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_business_rule_that_raises_dead_letters_its_event_and_the_partition_flows_on() {
    let s = setup().await;
    refuse_payment(&s, "frozen_payment", "pay-2", "P0001").await;
    refuse_payment(&s, "too_large_payment", "pay-4", "54000").await;
    let first: Vec<(EventId, Message)> = (1..=5).map(|n| paid_keyed(n, "order-k")).collect();
    let msgs: Vec<Message> = first.iter().map(|(_, m)| m.clone()).collect();
    assert!(s.publisher.publish(&msgs).await.iter().all(Result::is_ok));
    let (stop, handle, metrics) = start_consumer_metered(&s, Settlement::new());
    eventually(
        "pay-1, pay-3 and pay-5 to settle",
        Duration::from_secs(60),
        || async { (settled_payments(&s).await.len() == 3).then_some(()) },
    )
    .await;
    let later: Vec<Message> = (6..=7).map(|n| paid_keyed(n, "order-k").1).collect();
    assert!(s.publisher.publish(&later).await.iter().all(Result::is_ok));
    eventually(
        "the events published after the refusals to settle",
        Duration::from_secs(60),
        || async { (settled_payments(&s).await.len() == 5).then_some(()) },
    )
    .await;
    stop.send(true).unwrap();
    let (result, _) = handle.await.unwrap();
    result.unwrap();
    assert_eq!(
        settled_payments(&s).await,
        ["pay-1", "pay-3", "pay-5", "pay-6", "pay-7"]
    );
    let inbox = PgInbox::new(s.pg.pool().clone(), TableNames::default());
    let letters = inbox.dead_letters("settlement", 100).await.unwrap();
    let reason_of = |id: EventId| {
        letters
            .iter()
            .find(|l| l.event_id.as_deref() == Some(id.to_string().as_str()))
            .map(|l| l.reason.clone())
    };
    assert_eq!(letters.len(), 2, "{letters:#?}");
    assert_eq!(
        reason_of(first[1].0).as_deref(),
        Some("the database refused: payment pay-2 is frozen (SQLSTATE P0001)")
    );
    assert_eq!(
        reason_of(first[3].0).as_deref(),
        Some("the database refused: payment pay-4 is frozen (SQLSTATE 54000)")
    );
    assert_eq!(total(&metrics.dead_lettered), 2);
    assert_eq!(
        metrics
            .stalled_since
            .with_label_values(&[TOPIC, "settlement"])
            .get(),
        0,
        "the partition is not stalled"
    );
}

/// Review 3, N6: a SQLSTATE the rule does not name (a trigger's custom `ERRCODE`) is retried
/// as transient `max_unclassified_failures` (10) times, then the event is dead-lettered with
/// the code and the message; the rest of the partition settles. A lock timeout is never
/// counted so (`a_lock_held_on_the_business_table_stalls_the_batch_and_dead_letters_nothing`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unclassified_sqlstate_is_retried_a_bounded_number_of_times_then_dead_lettered() {
    let s = setup().await;
    refuse_payment(&s, "odd_payment", "pay-2", "ZZ001").await;
    let events: Vec<(EventId, Message)> = (1..=3).map(|n| paid_keyed(n, "order-k")).collect();
    let msgs: Vec<Message> = events.iter().map(|(_, m)| m.clone()).collect();
    assert!(s.publisher.publish(&msgs).await.iter().all(Result::is_ok));
    let (stop, handle, metrics) = start_consumer_metered(&s, Settlement::new());
    eventually(
        "pay-1 and pay-3 to settle",
        Duration::from_secs(60),
        || async { (settled_payments(&s).await.len() == 2).then_some(()) },
    )
    .await;
    stop.send(true).unwrap();
    let (result, _) = handle.await.unwrap();
    result.unwrap();
    assert_eq!(settled_payments(&s).await, ["pay-1", "pay-3"]);
    let inbox = PgInbox::new(s.pg.pool().clone(), TableNames::default());
    let letters = inbox.dead_letters("settlement", 100).await.unwrap();
    assert_eq!(letters.len(), 1, "{letters:#?}");
    assert_eq!(
        letters[0].event_id.as_deref(),
        Some(events[1].0.to_string().as_str())
    );
    let reason = &letters[0].reason;
    assert!(
        reason.starts_with(
            "SQLSTATE ZZ001 is neither transient nor permanent by the consumer's rule; \
             dead-lettered after 10 failures"
        ),
        "{reason}"
    );
    assert!(reason.contains("payment pay-2 is frozen"), "{reason}");
    assert!(
        total(&metrics.retries) >= 10,
        "retried before the dead letter"
    );
    assert_eq!(total(&metrics.dead_lettered), 1);
}

/// How a consumer over `inbox` ends (at most 30 s).
async fn stop_of<I>(brokers: &str, inbox: I) -> idem_core::Result<()>
where
    I: InboxStore,
    Settlement: idem_consumer::Handler<I::Conn>,
{
    let source = KafkaSource::new(
        &consumer_config(brokers, "unmigrated", &[]).unwrap(),
        &[TOPIC.to_owned()],
    )
    .unwrap();
    let consumer = Consumer::builder(inbox, Settlement::new(), source)
        .build()
        .unwrap();
    tokio::time::timeout(
        Duration::from_secs(30),
        consumer.run(std::future::pending()),
    )
    .await
    .expect("the consumer ran on instead of refusing the database")
}

/// A consumer given a database nobody migrated (PostgreSQL without idem's tables, SQLite, and
/// one migrated to an older schema) stops at start with the reason, before it reads a record:
/// it does not retry "relation does not exist" for every batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_refuses_a_database_not_migrated_at_start() {
    let cluster = EmbeddedCluster::start(1).unwrap();
    cluster.create_topic(TOPIC, 1).unwrap();
    let brokers = cluster.bootstrap_servers();
    let pg = idem_conformance::pg::TestDb::create().await;
    let e = stop_of(
        &brokers,
        PgInbox::new(pg.pool().clone(), TableNames::default()),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), idem_core::ErrorKind::NotMigrated, "{e}");
    assert!(e.to_string().contains("schema is at version 0"), "{e}");
    // One migration behind what this build ships.
    let old = Pg::new().await;
    old.exec("DELETE FROM idem_schema_migrations WHERE version = (SELECT max(version) FROM idem_schema_migrations)")
        .await
        .unwrap();
    let e = stop_of(
        &brokers,
        PgInbox::new(old.pool().clone(), TableNames::default()),
    )
    .await
    .unwrap_err();
    assert!(e.to_string().contains("older than the"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("none.db").display());
    let lite = idem_sql::sqlite::connect(&url).await.unwrap();
    let e = stop_of(
        &brokers,
        idem_sql::sqlite::SqliteInbox::new(lite, TableNames::default()),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), idem_core::ErrorKind::NotMigrated, "{e}");
}

/// A consumer subscribed to a topic the cluster does not have, on a cluster that creates no
/// topic on its own (as production clusters run), stops at start with the topic's name and
/// what to do, instead of waiting for records that never come; the same consumer on a topic
/// that exists runs until it is stopped; on a cluster that creates topics with their first
/// record, a missing topic lets it start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_refuses_a_topic_the_cluster_does_not_have() {
    let brokers = idem_conformance::kafka::shared();
    let pg = Pg::new().await;
    idem_reference::ensure_schema_postgres(pg.pool())
        .await
        .unwrap();
    let consumer = |topic: &str| {
        let group = idem_conformance::kafka::unique("missing-topic");
        let source = KafkaSource::new(
            &consumer_config(&brokers, &group, &[]).unwrap(),
            &[topic.to_owned()],
        )
        .unwrap();
        let inbox = PgInbox::new(pg.pool().clone(), TableNames::default());
        Consumer::builder(inbox, Settlement::new(), source)
            .build()
            .unwrap()
    };
    let missing = idem_conformance::kafka::unique("no-such-topic");
    let e = tokio::time::timeout(
        Duration::from_secs(60),
        consumer(&missing).run(std::future::pending()),
    )
    .await
    .expect("the consumer waited on a topic that does not exist")
    .unwrap_err();
    assert_eq!(e.kind(), idem_core::ErrorKind::Config, "{e}");
    let text = e.to_string();
    assert!(
        text.contains(&missing) && text.contains("idem topic create"),
        "{text}"
    );
    let present = idem_conformance::kafka::unique("present-topic");
    idem_kafka::ensure_topics(&brokers, std::slice::from_ref(&present), 1, 1)
        .await
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(consumer(&present).run(async {
        let _ = stopped.await;
    }));
    // It applies what the topic carries: it is past its checks and running.
    let publisher =
        KafkaPublisher::new(idem_kafka::producer_config(&brokers, &[]).unwrap()).unwrap();
    let (_, mut order) = paid(1);
    order.topic = present.clone();
    assert!(publisher.publish(&[order]).await.iter().all(Result::is_ok));
    eventually("the order settled", Duration::from_secs(60), || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM settlements")
            .fetch_one(pg.pool())
            .await
            .unwrap();
        (n == 1).then_some(())
    })
    .await;
    assert!(!run.is_finished());
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    // A cluster that creates a topic with its first record: the topic is not missing for good,
    // so the source lets its consumer start and wait for it.
    let auto = idem_conformance::kafka::KafkaCluster::start_with(
        1,
        &[("auto.create.topics.enable", "true")],
    );
    let source = KafkaSource::new(
        &consumer_config(auto.brokers(), "auto-create", &[]).unwrap(),
        std::slice::from_ref(&missing),
    )
    .unwrap();
    source.check_topics().await.unwrap();
}
