//! Engine tests against a real SQLite inbox with a scripted source. The Kafka path and
//! PostgreSQL are covered in `tests/e2e` and `lab/idem-lab/tests`.

use std::sync::{Arc, Mutex};

use idem_core::TableNames;
use idem_core::crash::{Action, CrashPoint};
use idem_sql::sqlite::SqliteInbox;
use sqlx::SqliteConnection;

use super::*;

type Positions = Vec<(String, i32, i64)>;

#[derive(Clone, Default)]
struct ScriptedSource {
    commits: Arc<Mutex<Vec<Positions>>>,
    fail_commits: Arc<Mutex<bool>>,
    /// Errors `next_batch` returns, in order, before it waits forever.
    fetch_errors: Arc<Mutex<Vec<Error>>>,
    /// Batches `next_batch` returns (last first), after the errors.
    batches: Arc<Mutex<Vec<Vec<Delivery>>>>,
}

impl Source for ScriptedSource {
    fn group(&self) -> Option<&str> {
        Some("settlement")
    }
    async fn next_batch(&self, _max: usize, _linger: Duration) -> Result<Vec<Delivery>> {
        if let Some(e) = self.fetch_errors.lock().unwrap().pop() {
            return Err(e);
        }
        let batch = self.batches.lock().unwrap().pop();
        match batch {
            Some(b) => Ok(b),
            None => std::future::pending().await,
        }
    }
    async fn commit(&self, done: &[(String, i32, i64)]) -> Result<()> {
        if *self.fail_commits.lock().unwrap() {
            return Err(Error::broker(
                "committing offsets",
                "coordinator unavailable",
            ));
        }
        self.commits.lock().unwrap().push(done.to_vec());
        Ok(())
    }
}

/// Posts a `test.effect` for each event, then refuses payloads with "poison", fails transiently
/// while `flaky` is above zero, and writes one row per event into `effects`: an effect of an
/// event that is not applied must not be recorded.
#[derive(Clone, Default)]
struct Recorder {
    flaky: Arc<Mutex<u32>>,
    calls: Arc<Mutex<u32>>,
    /// The consumer's metrics, to read `idem_consumer_stalled_since_seconds` inside each call.
    metrics: Arc<Mutex<Option<ConsumerMetrics>>>,
    /// The stalled gauge of the handler's topic, read at the start of each call.
    stalled_seen: Arc<Mutex<Vec<i64>>>,
}

impl Handler<SqliteConnection> for Recorder {
    async fn handle(
        &self,
        cx: &mut HandlerContext<'_, SqliteConnection>,
        e: &InboundEvent,
    ) -> std::result::Result<(), HandlerError> {
        *self.calls.lock().unwrap() += 1;
        if let Some(m) = self.metrics.lock().unwrap().as_ref() {
            let g = m
                .stalled_since
                .with_label_values(&[e.topic.as_str(), "settlement"]);
            self.stalled_seen.lock().unwrap().push(g.get());
        }
        cx.effects().post(
            "test.effect",
            "http://127.0.0.1:9/effects",
            serde_json::json!({ "order": e.aggregate_id }),
        )?;
        if e.payload.get("poison").is_some() {
            return Err(HandlerError::permanent("the payload is poison"));
        }
        {
            let mut f = self.flaky.lock().unwrap();
            if *f > 0 {
                *f -= 1;
                return Err(HandlerError::transient("database is busy"));
            }
        }
        // `?`: the database's error classified by the consumer's rule.
        sqlx::query("INSERT INTO effects (event_id) VALUES (?1)")
            .bind(e.event_id.to_string())
            .execute(cx.conn())
            .await?;
        Ok(())
    }
}

struct Fixture {
    _dir: tempfile::TempDir,
    consumer: Consumer<SqliteInbox, Recorder, ScriptedSource>,
    source: ScriptedSource,
    handler: Recorder,
    pool: sqlx::SqlitePool,
}

async fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let pool =
        idem_sql::sqlite::connect(&format!("sqlite://{}", dir.path().join("c.db").display()))
            .await
            .unwrap();
    idem_sql::sqlite::migrate(&pool, &TableNames::default())
        .await
        .unwrap();
    sqlx::query("CREATE TABLE effects (event_id TEXT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let source = ScriptedSource::default();
    let handler = Recorder::default();
    let mut config = ConsumerConfig::new("settlement");
    config.retry_backoff = Duration::ZERO;
    config.max_batch_retries = 2;
    let metrics = ConsumerMetrics::new(&prometheus::Registry::new()).unwrap();
    *handler.metrics.lock().unwrap() = Some(metrics.clone());
    let inbox = SqliteInbox::new(pool.clone(), TableNames::default());
    Fixture {
        _dir: dir,
        consumer: Consumer::new(inbox, handler.clone(), source.clone(), config, metrics),
        source,
        handler,
        pool,
    }
}

impl Fixture {
    async fn effects(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
    /// The event ids of the recorded effect intents, with their traceparents, by event id.
    async fn intents(&self) -> Vec<(String, Option<String>)> {
        sqlx::query_as(
            "SELECT event_id, traceparent FROM idem_effect_intents ORDER BY event_id, idem_key",
        )
        .fetch_all(&self.pool)
        .await
        .unwrap()
    }
    async fn delivery_count(&self, id: EventId) -> i64 {
        sqlx::query_scalar("SELECT delivery_count FROM idem_inbox WHERE event_id = ?1")
            .bind(id.to_string())
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
    async fn dead_letters(&self) -> Vec<idem_core::store::StoredDeadLetter> {
        self.consumer
            .inbox()
            .dead_letters("settlement", 100)
            .await
            .unwrap()
    }
}

fn record(offset: i64, id: EventId, payload: &str) -> Delivery {
    Delivery {
        topic: "outbox.event.order".into(),
        partition: 0,
        offset,
        key: Some("o-1".into()),
        payload: Some(payload.as_bytes().to_vec()),
        headers: vec![
            ("ce_id".into(), id.to_string()),
            ("ce_type".into(), "order.paid".into()),
            ("idem_aggregate_type".into(), "order".into()),
            ("idem_aggregate_id".into(), "o-1".into()),
        ],
        timestamp: Some(std::time::SystemTime::now()),
    }
}

#[tokio::test]
async fn a_fatal_source_error_ends_the_run_and_a_transient_one_is_retried() {
    let f = fixture().await;
    f.source.fetch_errors.lock().unwrap().extend([
        Error::broker_fatal("receiving records", "fenced by another member"),
        Error::broker("receiving records", "all brokers down"),
    ]);
    let run = tokio::time::timeout(
        // One retry backoff (100 ms) for the transient error, then the fatal one ends it.
        Duration::from_secs(10),
        f.consumer.run(std::future::pending()),
    )
    .await
    .expect("a consumer whose source can never fetch again ran on");
    let e = run.expect_err("the run ended without the fatal error");
    assert!(e.is_fatal(), "{e}");
    assert!(f.source.fetch_errors.lock().unwrap().is_empty());
}

#[tokio::test]
async fn the_same_event_twice_is_applied_once_and_counted() {
    let mut f = fixture().await;
    let id = EventId::new();
    let r1 = f.consumer.process(&[record(0, id, "{}")]).await.unwrap();
    let r2 = f.consumer.process(&[record(1, id, "{}")]).await.unwrap();
    assert_eq!((r1.processed, r1.duplicate_skips), (1, 0));
    assert_eq!(
        (r2.processed, r2.duplicate_skips, r2.duplicate_deliveries),
        (0, 1, 1)
    );
    assert_eq!(f.effects().await, 1);
    assert_eq!(f.delivery_count(id).await, 2);
    assert_eq!(total(&f.consumer.metrics().duplicate_skips), 1);
    assert_eq!(
        f.source.commits.lock().unwrap().len(),
        2,
        "both batches' offsets committed"
    );
    let latency = f
        .consumer
        .metrics()
        .publish_to_processed
        .with_label_values(&["outbox.event.order", "settlement", "order.paid", "order"]);
    assert_eq!(
        latency.get_sample_count(),
        1,
        "the applied event is timed, the skipped copy is not"
    );
}

#[test]
fn the_lag_gauge_drops_topics_no_longer_assigned_to_zero() {
    let m = ConsumerMetrics::new(&prometheus::Registry::new()).unwrap();
    m.set_lag("g", &[("a".into(), 5), ("b".into(), 7)]);
    m.set_lag("g", &[("b".into(), 2)]);
    assert_eq!(m.lag.with_label_values(&["a", "g"]).get(), 0);
    assert_eq!(m.lag.with_label_values(&["b", "g"]).get(), 2);
}

#[tokio::test]
async fn copies_inside_one_batch_are_applied_once() {
    let mut f = fixture().await;
    let id = EventId::new();
    let r = f
        .consumer
        .process(&[
            record(0, id, "{}"),
            record(1, id, "{}"),
            record(2, id, "{}"),
        ])
        .await
        .unwrap();
    assert_eq!((r.processed, r.duplicate_skips), (1, 2));
    assert_eq!(f.effects().await, 1);
    assert_eq!(f.delivery_count(id).await, 3);
}

#[tokio::test]
async fn a_known_id_with_another_payload_is_a_conflict_and_not_applied() {
    let mut f = fixture().await;
    let id = EventId::new();
    f.consumer
        .process(&[record(0, id, r#"{"amount":1}"#)])
        .await
        .unwrap();
    let r = f
        .consumer
        .process(&[record(1, id, r#"{"amount":2}"#)])
        .await
        .unwrap();
    assert_eq!((r.processed, r.conflicts, r.dead_lettered), (0, 1, 1));
    assert_eq!(f.effects().await, 1);
    let dl = f.dead_letters().await;
    assert_eq!(dl.len(), 1);
    assert!(
        dl[0].reason.contains("idempotency conflict"),
        "{}",
        dl[0].reason
    );
    assert_eq!(total(&f.consumer.metrics().conflicts), 1);
}

#[tokio::test]
async fn undecodable_records_are_dead_lettered_and_the_rest_applied() {
    let mut f = fixture().await;
    let good = EventId::new();
    let mut no_id = record(1, EventId::new(), "{}");
    no_id.headers.retain(|(k, _)| k != "ce_id");
    let mut bad_id = record(2, EventId::new(), "{}");
    bad_id.headers[0].1 = "not-a-uuid".into();
    let not_json = record(3, EventId::new(), "{oops");
    let r = f
        .consumer
        .process(&[
            record(0, good, "{}"),
            no_id,
            bad_id,
            not_json,
            record(4, EventId::new(), "{}"),
        ])
        .await
        .unwrap();
    assert_eq!((r.processed, r.dead_lettered), (2, 3));
    let reasons: Vec<String> = f
        .dead_letters()
        .await
        .into_iter()
        .map(|d| d.reason)
        .collect();
    assert!(reasons[0].contains("no ce_id"), "{reasons:?}");
    assert!(reasons[1].contains("not a UUID"), "{reasons:?}");
    assert!(reasons[2].contains("not valid JSON"), "{reasons:?}");
    assert_eq!(
        f.source.commits.lock().unwrap()[0],
        vec![("outbox.event.order".to_owned(), 0, 4)],
        "the offset moves past them"
    );
}

#[tokio::test]
async fn a_permanent_handler_failure_dead_letters_only_that_event_and_its_redelivery_is_skipped() {
    let mut f = fixture().await;
    let (a, poison, b) = (EventId::new(), EventId::new(), EventId::new());
    let batch = [
        record(0, a, "{}"),
        record(1, poison, r#"{"poison":true}"#),
        record(2, b, "{}"),
    ];
    let r = f.consumer.process(&batch).await.unwrap();
    assert_eq!((r.processed, r.dead_lettered), (2, 1));
    assert_eq!(f.effects().await, 2);
    let mut applied = vec![a.to_string(), b.to_string()];
    applied.sort();
    let intents: Vec<String> = f.intents().await.into_iter().map(|(id, _)| id).collect();
    assert_eq!(
        intents, applied,
        "the refused event's posted effect is not recorded"
    );
    let dl = f.dead_letters().await;
    assert_eq!(dl[0].event_id.as_deref(), Some(poison.to_string().as_str()));
    assert_eq!(dl[0].reason, "the payload is poison");
    let again = f
        .consumer
        .process(&[record(3, poison, r#"{"poison":true}"#)])
        .await
        .unwrap();
    assert_eq!(
        (again.dead_lettered, again.duplicate_skips),
        (0, 1),
        "not retried forever"
    );
}

/// SQLite's way for a business rule to refuse, `RAISE(ABORT, …)` in a trigger
/// (`SQLITE_CONSTRAINT_TRIGGER`), is permanent: the event is dead-lettered with the trigger's
/// message, the rest of the batch applied.
#[tokio::test]
async fn a_trigger_that_raises_abort_in_sqlite_dead_letters_its_event_with_the_message() {
    let mut f = fixture().await;
    let (a, frozen, b) = (EventId::new(), EventId::new(), EventId::new());
    sqlx::query(&format!(
        "CREATE TRIGGER frozen BEFORE INSERT ON effects WHEN NEW.event_id = '{frozen}' \
         BEGIN SELECT RAISE(ABORT, 'payment is frozen'); END"
    ))
    .execute(&f.pool)
    .await
    .unwrap();
    let batch = [
        record(0, a, "{}"),
        record(1, frozen, "{}"),
        record(2, b, "{}"),
    ];
    let r = f.consumer.process(&batch).await.unwrap();
    assert_eq!((r.processed, r.dead_lettered), (2, 1), "{r:?}");
    assert_eq!(f.effects().await, 2);
    let dl = f.dead_letters().await;
    assert_eq!(dl[0].event_id.as_deref(), Some(frozen.to_string().as_str()));
    assert_eq!(
        dl[0].reason,
        "the database refused: payment is frozen (SQLite code 1811)"
    );
}

#[tokio::test]
async fn crash_after_dedup_before_handler_commits_nothing() {
    let mut f = fixture().await;
    let id = EventId::new();
    crash::arm(
        CrashPoint::ConsumerAfterDedupBeforeHandler,
        Action::Error,
        1,
    )
    .unwrap();
    let err = f
        .consumer
        .process(&[record(0, id, "{}")])
        .await
        .unwrap_err();
    assert!(matches!(
        err,
        Error::CrashPoint(CrashPoint::ConsumerAfterDedupBeforeHandler)
    ));
    assert!(
        f.source.commits.lock().unwrap().is_empty(),
        "no offset commit"
    );
    let inbox: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_inbox")
        .fetch_one(&f.pool)
        .await
        .unwrap();
    assert_eq!(
        (inbox, f.effects().await),
        (0, 0),
        "the inbox row rolled back with the transaction"
    );
    let r = f.consumer.process(&[record(0, id, "{}")]).await.unwrap();
    assert_eq!(r.processed, 1, "the redelivery is applied as new");
    assert_eq!(f.delivery_count(id).await, 1);
}

#[tokio::test]
async fn offsets_are_committed_only_after_the_database_commit() {
    let mut f = fixture().await;
    let id = EventId::new();
    crash::arm(
        CrashPoint::ConsumerAfterDbCommitBeforeOffsetCommit,
        Action::Error,
        1,
    )
    .unwrap();
    assert!(f.consumer.process(&[record(0, id, "{}")]).await.is_err());
    assert_eq!(f.effects().await, 1, "the database committed");
    assert!(
        f.source.commits.lock().unwrap().is_empty(),
        "the offset did not"
    );
    let r = f.consumer.process(&[record(0, id, "{}")]).await.unwrap();
    assert_eq!((r.processed, r.duplicate_skips), (0, 1));
    assert_eq!(f.effects().await, 1);
    assert_eq!(f.source.commits.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn many_refused_events_cost_one_extra_attempt() {
    let mut f = fixture().await;
    let batch: Vec<Delivery> = (0..50)
        .map(|i| {
            record(
                i,
                EventId::new(),
                if i % 2 == 0 {
                    r#"{"poison":true}"#
                } else {
                    "{}"
                },
            )
        })
        .collect();
    let r = f.consumer.process(&batch).await.unwrap();
    assert_eq!((r.processed, r.dead_lettered, r.retries), (25, 25, 0));
    assert_eq!(f.effects().await, 25);
    assert_eq!(
        *f.handler.calls.lock().unwrap(),
        1 + 49,
        "one failed attempt, then one isolated pass without the known poison"
    );
    let dead: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idem_inbox WHERE status = 'dead_lettered'")
            .fetch_one(&f.pool)
            .await
            .unwrap();
    assert_eq!(dead, 25);
    assert_eq!(f.dead_letters().await.len(), 25);
}

#[tokio::test]
async fn a_failed_offset_commit_is_counted_and_the_redelivery_skipped() {
    let mut f = fixture().await;
    let id = EventId::new();
    *f.source.fail_commits.lock().unwrap() = true;
    let r = f.consumer.process(&[record(0, id, "{}")]).await.unwrap();
    assert_eq!(
        r.processed, 1,
        "the batch is applied even though its offset could not be committed"
    );
    assert_eq!(f.consumer.metrics().offset_commit_failures.get(), 1);
    *f.source.fail_commits.lock().unwrap() = false;
    let again = f.consumer.process(&[record(0, id, "{}")]).await.unwrap();
    assert_eq!((again.processed, again.duplicate_skips), (0, 1));
    assert_eq!(f.effects().await, 1);
}

#[tokio::test]
async fn the_handler_span_continues_the_trace_captured_at_enqueue() {
    use opentelemetry::trace::{SpanKind, TracerProvider as _};
    use tracing_subscriber::layer::SubscriberExt;
    const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    const PRODUCER_SPAN: &str = "00f067aa0ba902b7";
    let exporter = opentelemetry_sdk::trace::InMemorySpanExporter::default();
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("idem-test")));
    let _default = tracing::subscriber::set_default(subscriber);

    let mut f = fixture().await;
    let mut traced = record(0, EventId::new(), "{}");
    traced.headers.push((
        "traceparent".into(),
        format!("00-{TRACE}-{PRODUCER_SPAN}-01"),
    ));
    let untraced = record(1, EventId::new(), "{}");
    let r = f.consumer.process(&[traced, untraced]).await.unwrap();
    assert_eq!(r.processed, 2);
    provider.force_flush().unwrap();

    let spans = exporter.get_finished_spans().unwrap();
    let handled: Vec<_> = spans.iter().filter(|s| s.name == "idem.handle").collect();
    assert_eq!(handled.len(), 2, "{spans:#?}");
    let child = handled
        .iter()
        .find(|s| s.span_context.trace_id().to_string() == TRACE)
        .expect("one handler span is in the enqueued trace");
    assert_eq!(
        child.parent_span_id.to_string(),
        PRODUCER_SPAN,
        "its parent is the producer's span"
    );
    assert_eq!(child.span_kind, SpanKind::Consumer);
    let other = handled
        .iter()
        .find(|s| s.span_context.trace_id().to_string() != TRACE)
        .unwrap();
    assert_eq!(
        other.parent_span_id,
        opentelemetry::trace::SpanId::INVALID,
        "an event without a traceparent starts its own trace"
    );
    // An effect posted by the handler carries the handler span as its parent, in the same trace.
    let seen: Vec<Option<String>> = f.intents().await.into_iter().map(|(_, tp)| tp).collect();
    assert!(
        seen.contains(&Some(format!(
            "00-{TRACE}-{}-01",
            child.span_context.span_id()
        ))),
        "{seen:?}"
    );
}

/// Transient failures never dead-letter: the batch backs off and is retried until it applies.
/// Dead-lettering after `max_retries` would make every redelivery a skip, so a lock held for two
/// minutes would lose the event for good.
#[tokio::test]
async fn a_transient_failure_outlasting_the_retries_is_applied_once_and_never_dead_lettered() {
    let mut f = fixture().await;
    let id = EventId::new();
    *f.handler.flaky.lock().unwrap() = 12;
    let r = f.consumer.process(&[record(0, id, "{}")]).await.unwrap();
    assert_eq!(
        (r.processed, r.dead_lettered, r.retries),
        (1, 0, 12),
        "applied after its twelve transient failures"
    );
    assert_eq!(f.effects().await, 1);
    assert_eq!(
        f.intents().await.len(),
        1,
        "thirteen calls posted the effect, the one that applied recorded it"
    );
    assert!(
        f.dead_letters().await.is_empty(),
        "{:?}",
        f.dead_letters().await
    );
    let status: String = sqlx::query_scalar("SELECT status FROM idem_inbox WHERE event_id = ?1")
        .bind(id.to_string())
        .fetch_one(&f.pool)
        .await
        .unwrap();
    assert_eq!(status, "processed");
    let again = f.consumer.process(&[record(1, id, "{}")]).await.unwrap();
    assert_eq!((again.processed, again.duplicate_skips), (0, 1));
    assert_eq!(f.effects().await, 1, "applied once");
    assert_eq!(total(&f.consumer.metrics().retries), 12);
    let seen = f.handler.stalled_seen.lock().unwrap().clone();
    assert_eq!(seen[0], 0, "not stalled before the first failure");
    assert!(
        seen[1..=12].iter().all(|s| *s > 0 && *s == seen[1]),
        "stalled since the first failure, while it lasts: {seen:?}"
    );
    let gauge = f
        .consumer
        .metrics()
        .stalled_since
        .with_label_values(&["outbox.event.order", "settlement"]);
    assert_eq!(gauge.get(), 0, "flowing again once the batch committed");
}

/// The database unreachable is no event's fault: nothing is dead-lettered, the offset is not
/// committed, the run ends after `max_batch_retries` and a restarted consumer applies the batch.
#[tokio::test]
async fn a_database_outage_dead_letters_nothing_and_a_restart_applies_the_batch() {
    let mut f = fixture().await;
    let id = EventId::new();
    let path = f._dir.path().join("c.db");
    f.consumer.inbox().pool().close().await;
    let err = f
        .consumer
        .process(&[record(0, id, "{}")])
        .await
        .expect_err("a closed database applied the batch");
    assert!(err.to_string().contains("beginning"), "{err}");
    assert!(
        f.source.commits.lock().unwrap().is_empty(),
        "no offset commit"
    );
    assert_eq!(total(&f.consumer.metrics().dead_lettered), 0);
    assert_eq!(
        total(&f.consumer.metrics().retries),
        3,
        "max_batch_retries (2) retries, then the error"
    );
    // The supervisor's restart: a new consumer over a reachable database.
    let pool = idem_sql::sqlite::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    let mut config = ConsumerConfig::new("settlement");
    config.retry_backoff = Duration::ZERO;
    let mut restarted = Consumer::new(
        SqliteInbox::new(pool.clone(), TableNames::default()),
        f.handler.clone(),
        f.source.clone(),
        config,
        ConsumerMetrics::new(&prometheus::Registry::new()).unwrap(),
    );
    let r = restarted.process(&[record(0, id, "{}")]).await.unwrap();
    assert_eq!((r.processed, r.dead_lettered), (1, 0));
    let (effects, letters): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM effects), (SELECT count(*) FROM idem_dead_letters)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((effects, letters), (1, 0));
}

/// A batch that keeps failing transiently does not keep the consumer from stopping: `run`
/// returns at shutdown while the batch backs off, with nothing of it committed.
#[tokio::test]
async fn shutdown_stops_a_batch_that_backs_off_and_commits_nothing() {
    let f = fixture().await;
    *f.handler.flaky.lock().unwrap() = u32::MAX;
    f.source
        .batches
        .lock()
        .unwrap()
        .push(vec![record(0, EventId::new(), "{}")]);
    let metrics = f.consumer.metrics().clone();
    let calls = f.handler.calls.clone();
    let stop = async move {
        // Stop once the handler has failed a few times (the batch is backing off).
        while *calls.lock().unwrap() < 5 {
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), f.consumer.run(stop))
        .await
        .expect("the run did not stop while its batch backed off")
        .unwrap();
    assert!(
        f.source.commits.lock().unwrap().is_empty(),
        "no offset commit"
    );
    assert_eq!(total(&metrics.dead_lettered), 0);
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(&f.pool)
        .await
        .unwrap();
    assert_eq!(effects, 0);
}

fn series(c: &dyn prometheus::core::Collector) -> usize {
    c.collect().iter().map(|mf| mf.get_metric().len()).sum()
}

/// The `event_type` and `aggregate_type` labels come from record headers, which a foreign
/// producer writes: they are bounded, so it cannot make one series per value it sends.
#[tokio::test]
async fn ten_thousand_hostile_header_values_do_not_make_ten_thousand_series() {
    let mut f = fixture().await;
    let batch: Vec<Delivery> = (0..10_000)
        .map(|i| {
            let mut d = record(i, EventId::new(), "{}");
            d.headers[1].1 = format!("order.paid.{i}");
            d.headers[2].1 = format!("hostile \"aggregate\" {i}\n");
            if i % 2 == 1 {
                d.headers.retain(|(k, _)| k != "ce_id"); // undecodable: dead-lettered
            }
            d
        })
        .collect();
    let r = f.consumer.process(&batch).await.unwrap();
    assert_eq!((r.processed, r.dead_lettered), (5_000, 5_000));
    let m = f.consumer.metrics();
    for (name, n) in [
        ("processed", series(&m.processed)),
        ("dead_lettered", series(&m.dead_lettered)),
        ("publish_to_processed", series(&m.publish_to_processed)),
    ] {
        assert!(n <= 200, "{name}: {n} series from hostile headers");
    }
    assert_eq!(total(&m.processed), 5_000, "nothing uncounted");
}

#[tokio::test]
async fn a_built_consumer_registers_its_metrics_only_when_given_a_registry() {
    let f = fixture().await;
    let inbox = || SqliteInbox::new(f.pool.clone(), TableNames::default());
    let mut quiet = Consumer::builder(inbox(), f.handler.clone(), f.source.clone())
        .build()
        .unwrap();
    let r = quiet
        .process(&[record(0, EventId::new(), "{}")])
        .await
        .unwrap();
    assert_eq!(r.processed, 1);
    assert_eq!(
        total(&quiet.metrics().processed),
        1,
        "counted, not exported"
    );
    let registry = prometheus::Registry::new();
    let exported = Consumer::builder(inbox(), f.handler.clone(), f.source.clone())
        .registry(&registry)
        .build()
        .unwrap();
    assert!(format!("{exported:?}").starts_with("Consumer {"));
    let exports = |name: &str| registry.gather().iter().any(|mf| mf.name() == name);
    assert!(exports("idem_consumer_offset_commit_failures_total"));
}

#[tokio::test]
async fn a_built_consumer_takes_its_group_from_the_source_and_refuses_another() {
    let f = fixture().await;
    let inbox = || SqliteInbox::new(f.pool.clone(), TableNames::default());
    let built = Consumer::builder(inbox(), f.handler.clone(), f.source.clone())
        .build()
        .unwrap();
    assert_eq!(built.config.group, "settlement");
    let other = Consumer::builder(inbox(), f.handler.clone(), f.source.clone())
        .config(ConsumerConfig::new("audit"))
        .build()
        .unwrap_err();
    assert_eq!(other.kind(), idem_core::ErrorKind::Config);
    assert!(other.to_string().contains("\"audit\""), "{other}");
    let same = Consumer::builder(inbox(), f.handler.clone(), f.source.clone())
        .config(ConsumerConfig {
            batch_size: 7,
            ..ConsumerConfig::new("settlement")
        })
        .build()
        .unwrap();
    assert_eq!(same.config.batch_size, 7);
    let none = group_config(None, None).unwrap_err();
    assert!(
        none.to_string().contains("names no consumer group"),
        "{none}"
    );
}
