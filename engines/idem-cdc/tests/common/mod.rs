//! Helpers shared by the CDC relay's tests against real PostgreSQL and Kafka: a world of one
//! database, slot and topic (the slot dropped at the end), the relay in the background, and
//! reading the topic until enough records arrived.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::future::Future;
use std::time::{Duration, Instant};

use idem_cdc::{CdcConfig, CdcMetrics, CdcRelay, Mode, Name};
use idem_conformance::backend::{Backend, OpenTx, Pg};
use idem_conformance::kafka;
use idem_core::Event;
use idem_core::wire::TopicNaming;
use idem_kafka::KafkaPublisher;
use idem_kafka::inspect::{Record, read_all};

/// Drops the test's slot at the end, even after a failed assertion: a forgotten slot pins WAL
/// and keeps its database from being dropped.
pub(crate) struct SlotGuard {
    pub url: String,
    pub slot: String,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        let slot = self.slot.clone();
        cleanup(&self.url, |pool| async move {
            // The relay's session may still be closing: wait for the slot to be free.
            for _ in 0..100 {
                let r = sqlx::query(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
                     WHERE slot_name = $1 AND NOT active",
                )
                .bind(&slot)
                .execute(&pool)
                .await;
                let left: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1",
                )
                .bind(&slot)
                .fetch_one(&pool)
                .await
                .unwrap_or(0);
                if r.is_ok() && left == 0 {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
    }
}

/// Drops test roles at the end, even after a failed assertion (their grants in the test
/// database first, or a role cannot be dropped).
pub(crate) struct RoleGuard {
    pub url: String,
    pub roles: Vec<String>,
}

impl Drop for RoleGuard {
    fn drop(&mut self) {
        let roles = self.roles.clone();
        cleanup(&self.url, |pool| async move {
            for role in roles {
                let _ = sqlx::raw_sql(&format!(
                    "DROP OWNED BY \"{role}\"; DROP ROLE IF EXISTS \"{role}\""
                ))
                .execute(&pool)
                .await;
            }
        });
    }
}

/// Runs `f` on a connection to `url` on a runtime of its own (a `Drop` may run inside the
/// test's runtime, which cannot block), and waits for it.
fn cleanup<F, Fut>(url: &str, f: F)
where
    F: FnOnce(sqlx::PgPool) -> Fut + Send + 'static,
    Fut: Future<Output = ()>,
{
    let url = url.to_owned();
    let _ = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let pool = sqlx::PgPool::connect(&url).await.unwrap();
            f(pool).await;
        });
    })
    .join();
}

/// Fields drop in order: the slot first, then the database.
pub(crate) struct World {
    _guard: SlotGuard,
    pub pg: Pg,
    pub topic: String,
    /// The dead-letter topic of this world's relay.
    pub dead_letters: String,
    pub slot: String,
    pub brokers: String,
}

impl World {
    pub(crate) async fn new() -> Self {
        // RUST_LOG=idem_cdc=debug shows the relay's sessions when a test fails.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let pg = Pg::new().await;
        let slot = kafka::unique("cdc").replace('-', "_");
        let topic = kafka::unique("cdc-orders");
        let _guard = SlotGuard {
            url: pg.url().to_owned(),
            slot: slot.clone(),
        };
        World {
            pg,
            topic,
            dead_letters: kafka::unique("cdc-dead-letters"),
            slot,
            brokers: kafka::shared(),
            _guard,
        }
    }

    pub(crate) fn config(&self) -> CdcConfig {
        self.config_in(Mode::Table(self.pg.tables().clone()))
    }

    /// The test settings in `mode`.
    pub(crate) fn config_in(&self, mode: Mode) -> CdcConfig {
        let mut c = CdcConfig::new(
            Name::new("slot", &self.slot).unwrap(),
            Name::new("publication", &format!("{}_pub", self.slot)).unwrap(),
            mode,
        );
        c.dead_letter_topic = self.dead_letters.clone();
        c.topics = TopicNaming {
            prefix: String::new(),
            overrides: [("order".to_owned(), self.topic.clone())].into(),
        };
        c.poll = Duration::from_millis(200);
        c.retry_backoff = Duration::from_millis(50);
        c
    }

    pub(crate) fn relay(&self, metrics: CdcMetrics) -> CdcRelay<KafkaPublisher> {
        self.relay_with(self.config(), metrics)
    }

    /// A relay with `config`, publishing to this world's broker.
    pub(crate) fn relay_with(
        &self,
        config: CdcConfig,
        metrics: CdcMetrics,
    ) -> CdcRelay<KafkaPublisher> {
        let producer = idem_kafka::producer_config(&self.brokers, &[]).unwrap();
        let publisher = KafkaPublisher::new(producer)
            .unwrap()
            .with_topic_creation(1, Some(1));
        CdcRelay::builder(self.pg.url(), self.pg.pool().clone(), publisher)
            .config(config)
            .metrics(metrics)
            .build()
            .unwrap()
    }

    /// Commits one transaction enqueueing `events`.
    pub(crate) async fn commit(&self, events: &[Event]) {
        let mut tx = self.pg.begin().await;
        tx.enqueue(events).await.unwrap();
        tx.commit().await;
    }

    /// The topic's records once there are at least `n` (panics after a minute, or at once
    /// when the relay stopped with an error).
    pub(crate) async fn records(&self, n: usize, relay: &mut Running) -> Vec<Record> {
        self.records_in(&self.topic, n, relay).await
    }

    /// The topic's first records, asserted to be `want`'s events in this order.
    pub(crate) async fn expect(&self, want: &[&Event], relay: &mut Running) -> Vec<Record> {
        let got = self.records(want.len(), relay).await;
        let want: Vec<String> = want.iter().map(|e| e.id().to_string()).collect();
        assert_eq!(ids(&got), want);
        got
    }

    /// Commits a marker event and waits until it reached the topic: the relay's session has
    /// drained the table and streams. Returns how many records the topic holds then.
    /// The server's current WAL write position, as a number: at or past every commit so far.
    pub(crate) async fn wal_position(&self) -> i64 {
        sqlx::query_scalar("SELECT (pg_current_wal_lsn() - '0/0')::bigint")
            .fetch_one(self.pg.pool())
            .await
            .unwrap()
    }

    pub(crate) async fn streaming(&self, relay: &mut Running) -> usize {
        let marker = event("marker", 0);
        self.commit(std::slice::from_ref(&marker)).await;
        let id = marker.id().to_string();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let got = self.records(1, relay).await;
            if got.iter().any(|r| r.header("ce_id") == Some(id.as_str())) {
                return got.len();
            }
            assert!(Instant::now() < deadline, "the marker never arrived");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// [`World::records`] of `topic`.
    pub(crate) async fn records_in(
        &self,
        topic: &str,
        n: usize,
        relay: &mut Running,
    ) -> Vec<Record> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let (brokers, name) = (self.brokers.clone(), topic.to_owned());
            let got = tokio::task::spawn_blocking(move || {
                read_all(&brokers, &name, Duration::from_secs(10)).unwrap_or_default()
            })
            .await
            .unwrap();
            if got.len() >= n {
                return got;
            }
            if relay.1.is_finished() {
                panic!("the relay stopped early: {:?}", (&mut relay.1).await);
            }
            assert!(
                Instant::now() < deadline,
                "only {} of {n} records reached {}",
                got.len(),
                topic
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

pub(crate) type Running = (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), idem_cdc::CdcError>>,
);

pub(crate) fn event(aggregate: &str, n: u32) -> Event {
    Event::builder("order", aggregate, "order.paid")
        .payload(&serde_json::json!({"n": n}))
        .build()
        .unwrap()
}

pub(crate) fn ids(records: &[Record]) -> Vec<String> {
    records
        .iter()
        .map(|r| r.header("ce_id").unwrap_or_default().to_owned())
        .collect()
}

/// Runs `relay` in the background until the returned sender is dropped or sent to.
pub(crate) fn spawn<P: idem_core::publish::Publisher>(relay: CdcRelay<P>) -> Running {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let shutdown = async move {
            let _ = stopped.await;
        };
        relay.run(shutdown).await
    });
    (stop, task)
}

/// A handle on no relay (for reading a topic after the relay stopped).
pub(crate) fn spawn_idle() -> Running {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let _ = rx.await;
        Ok(())
    });
    (tx, task)
}

pub(crate) async fn stop(handle: Running) {
    let (tx, task) = handle;
    let _ = tx.send(());
    task.await.unwrap().unwrap();
}

pub(crate) async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(60);
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
