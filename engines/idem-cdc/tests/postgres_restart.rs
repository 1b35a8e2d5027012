//! The CDC relay across a PostgreSQL crash (`pg_ctl stop -m immediate`, then a start: recovery
//! replays the WAL, and the slot's position goes back to its last checkpoint): no committed
//! event is lost, and the copies carry the same `ce_id`. Runs on a private server (the suite's
//! shared one must never restart under the other tests).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use idem_cdc::{CdcConfig, CdcMetrics, CdcRelay, Mode, Name};
use idem_conformance::kafka;
use idem_conformance::private_pg::PrivatePg;
use idem_core::wire::TopicNaming;
use idem_core::{Event, TableNames};
use idem_kafka::KafkaPublisher;
use idem_kafka::inspect::read_all;

async fn pool(url: &str) -> sqlx::PgPool {
    // The server restarts under this pool: connections that die are replaced on the next use.
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(30))
        .connect(url)
        .await
        .unwrap()
}

async fn commit(pool: &sqlx::PgPool, events: &[Event]) {
    let outbox = idem_sql::postgres::Outbox::new(TableNames::default());
    // A connection of the pool may have died with the server: retry until one works.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let attempt = async {
            let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
            outbox
                .enqueue_all(&mut tx, events)
                .await
                .map_err(|e| e.to_string())?;
            tx.commit().await.map_err(|e| e.to_string())
        };
        match attempt.await {
            Ok(()) => return,
            Err(e) => assert!(Instant::now() < deadline, "cannot commit: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn event(aggregate: &str) -> Event {
    Event::builder("order", aggregate, "order.paid")
        .payload(&serde_json::json!({"a": aggregate}))
        .build()
        .unwrap()
}

/// A CDC relay on `pg`, its slot created, running in the background.
struct Started {
    control: sqlx::PgPool,
    topic: String,
    brokers: String,
    metrics: CdcMetrics,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), idem_cdc::CdcError>>,
}

async fn started(pg: &PrivatePg) -> Started {
    started_on(pg, kafka::unique("cdc-restart"), false).await
}

/// [`started`], publishing to `topic`; `create_slot`: make the slot again if it is missing.
async fn started_on(pg: &PrivatePg, topic: String, create_slot: bool) -> Started {
    let url = pg.url();
    let control = pool(&url).await;
    idem_sql::postgres::migrate(&control, &TableNames::default())
        .await
        .unwrap();
    let brokers = kafka::shared();
    let mut config = CdcConfig::new(
        Name::new("slot", "restart_slot").unwrap(),
        Name::new("publication", "restart_pub").unwrap(),
        Mode::Table(TableNames::default()),
    );
    config.topics = TopicNaming {
        prefix: String::new(),
        overrides: [("order".to_owned(), topic.clone())].into(),
    };
    config.poll = Duration::from_millis(200);
    config.retry_backoff = Duration::from_millis(100);
    config.retry_backoff_max = Duration::from_millis(500);
    config.create_slot = create_slot;
    let metrics = CdcMetrics::unregistered().unwrap();
    let publisher = KafkaPublisher::new(idem_kafka::producer_config(&brokers, &[]).unwrap())
        .unwrap()
        .with_topic_creation(1, Some(1));
    // The relay's own pool gives up on a connection soon, as a service's should, so that a
    // down server fails its attempts in seconds instead of the test pool's 30.
    let relay_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(2))
        .connect(&url)
        .await
        .unwrap();
    let relay = CdcRelay::new(&url, relay_pool, publisher, config, metrics.clone());
    relay.prepare().await.unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        relay
            .run(async move {
                let _ = stopped.await;
            })
            .await
    });
    Started {
        control,
        topic,
        brokers,
        metrics,
        stop,
        task,
    }
}

impl Started {
    /// Waits until every event of `want` is in the topic, the relay running all along.
    async fn expect(&mut self, want: &[&Event]) {
        let want: Vec<String> = want.iter().map(|e| e.id().to_string()).collect();
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let (b, t) = (self.brokers.clone(), self.topic.clone());
            let got = tokio::task::spawn_blocking(move || {
                read_all(&b, &t, Duration::from_secs(10)).unwrap_or_default()
            })
            .await
            .unwrap();
            let seen: std::collections::BTreeSet<String> = got
                .iter()
                .filter_map(|r| r.header("ce_id").map(str::to_owned))
                .collect();
            if want.iter().all(|id| seen.contains(id)) {
                return;
            }
            self.assert_running().await;
            assert!(
                Instant::now() < deadline,
                "{} of {} events reached Kafka after the crash",
                want.iter().filter(|id| seen.contains(*id)).count(),
                want.len()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Fails with the relay's own result when it stopped.
    async fn assert_running(&mut self) {
        if self.task.is_finished() {
            let ended = (&mut self.task).await;
            panic!("the relay stopped: {ended:?}");
        }
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.unwrap().unwrap();
    }
}

/// Events committed before the crash (published or not yet) and after it all reach Kafka.
#[tokio::test(flavor = "multi_thread")]
async fn no_committed_event_is_lost_across_a_postgresql_crash() {
    let pg = PrivatePg::start();
    let mut relay = started(&pg).await;
    let before: Vec<Event> = (0..5).map(|i| event(&format!("b-{i}"))).collect();
    commit(&relay.control, &before).await;
    // Crash while those may still be in flight or unconfirmed.
    pg.crash_and_restart();
    let after: Vec<Event> = (0..5).map(|i| event(&format!("a-{i}"))).collect();
    commit(&relay.control, &after).await;
    relay
        .expect(&before.iter().chain(&after).collect::<Vec<_>>())
        .await;
    assert!(
        relay.metrics.sessions_failed.get() >= 1,
        "the crash ended the relay's session (and a new one took over)"
    );
    relay.stop().await;
}

/// The server stays down for a while: the relay's session fails, and so do its attempts to
/// read the slot before the next one; it keeps trying, and once the server is back the events
/// committed before and after the outage reach Kafka. (Before, the first failed read of the
/// slot between sessions stopped the relay: the crash test above failed that way in a CI
/// rehearsal whenever the restart took longer than the relay's backoff.)
#[tokio::test(flavor = "multi_thread")]
async fn a_relay_outlives_a_postgresql_outage_between_its_sessions() {
    let pg = PrivatePg::start();
    let mut relay = started(&pg).await;
    let before = [event("o-1")];
    commit(&relay.control, &before).await;
    relay.expect(&[&before[0]]).await;
    pg.try_crash().unwrap();
    // Down: the session fails, then reading the slot for the next one fails (each counted).
    let deadline = Instant::now() + Duration::from_secs(60);
    while relay.metrics.sessions_failed.get() < 3 {
        relay.assert_running().await;
        assert!(Instant::now() < deadline, "no failed session while down");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    pg.try_start_again().unwrap();
    let after = [event("o-2")];
    commit(&relay.control, &after).await;
    relay.expect(&[&before[0], &after[0]]).await;
    relay.stop().await;
}

/// A failover to a standby (`pg_basebackup`, synchronous) that has no logical slot, as a
/// PostgreSQL 15 or 16 standby never has: the relay does not make a new slot on its own (it
/// would stream only what commits after it) but stops with `SlotMissing` and
/// `idem_cdc_slot_lost` 1; started again with `--create-slot`, table mode publishes every
/// event, those committed on the new primary before the new slot included (its drain).
#[tokio::test(flavor = "multi_thread")]
async fn a_failover_to_a_standby_without_the_slot_stops_the_relay_and_create_slot_loses_nothing() {
    let pg = PrivatePg::start();
    pg.try_add_standby().unwrap();
    let mut relay = started(&pg).await;
    let before = [event("f-1")];
    commit(&relay.control, &before).await;
    relay.expect(&[&before[0]]).await;
    pg.try_fail_over().unwrap();
    let between = [event("f-2")];
    commit(&relay.control, &between).await;
    let ended = tokio::time::timeout(Duration::from_secs(90), &mut relay.task)
        .await
        .expect("the relay kept going on the promoted standby")
        .unwrap();
    assert!(
        matches!(ended, Err(idem_cdc::CdcError::SlotMissing { .. })),
        "{ended:?}"
    );
    assert_eq!(relay.metrics.slot_lost.get(), 1);
    let slots: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_replication_slots")
        .fetch_one(&relay.control)
        .await
        .unwrap();
    assert_eq!(slots, 0, "no slot was made in silence");

    let mut again = started_on(&pg, relay.topic.clone(), true).await;
    let after = [event("f-3")];
    commit(&again.control, &after).await;
    again.expect(&[&before[0], &between[0], &after[0]]).await;
    again.stop().await;
}
