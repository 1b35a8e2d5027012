//! The consumer's lanes on real PostgreSQL (each lane a transaction on its own connection) with
//! a scripted source: partitions applied concurrently, each in offset order; the next batch
//! fetched while the current one is applied; a revoked partition's records never applied
//! after the revocation; one failing partition not holding back the others' commits; the
//! stored offsets committed when the run ends.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_conformance::backend::{Backend, Pg};
use idem_conformance::process::eventually;
use idem_consumer::{
    Consumer, ConsumerConfig, ConsumerMetrics, Handler, HandlerContext, HandlerError,
};
use idem_core::store::{Delivery, Source};
use idem_core::{EventId, InboundEvent, Result};
use tokio::sync::{Notify, watch};

const TOPIC: &str = "outbox.event.order";

type Positions = Vec<(String, i32, i64)>;

#[derive(Default)]
struct ScriptState {
    /// Batches still to hand out, first first.
    batches: Vec<Vec<Delivery>>,
    /// Partitions to revoke right after the next batch is handed out.
    revoke_after_next: Vec<i32>,
    /// Revocations: (epoch, partition).
    revoked: Vec<(u64, i32)>,
    /// Revocations so far.
    revocations: u64,
    /// The revocation count when the last batch was handed out.
    batch_epoch: u64,
    commits: Vec<Positions>,
    fetches: u32,
    closed: bool,
}

/// A source handing out scripted batches; revocations are scripted too.
#[derive(Clone, Default)]
struct Script {
    state: Arc<Mutex<ScriptState>>,
    fetched: Arc<Notify>,
}

impl Script {
    fn with_batches(batches: Vec<Vec<Delivery>>) -> Self {
        let s = Script::default();
        s.state.lock().unwrap().batches = batches;
        s
    }
    fn revoke(&self, partition: i32) {
        let mut s = self.state.lock().unwrap();
        s.revocations += 1;
        let epoch = s.revocations;
        s.revoked.push((epoch, partition));
    }
    fn commits(&self) -> Vec<Positions> {
        self.state.lock().unwrap().commits.clone()
    }
    /// The last committed offset of each partition.
    fn committed(&self) -> BTreeMap<i32, i64> {
        let mut last = BTreeMap::new();
        for c in self.commits() {
            for (_, p, o) in c {
                last.insert(p, o);
            }
        }
        last
    }
}

impl Source for Script {
    async fn next_batch(&self, _max: usize, _linger: Duration) -> Result<Vec<Delivery>> {
        let batch = {
            let mut s = self.state.lock().unwrap();
            s.fetches += 1;
            let batch = (!s.batches.is_empty()).then(|| s.batches.remove(0));
            s.batch_epoch = s.revocations;
            if batch.is_some() {
                for p in std::mem::take(&mut s.revoke_after_next) {
                    s.revocations += 1;
                    let epoch = s.revocations;
                    s.revoked.push((epoch, p));
                }
            }
            batch
        };
        self.fetched.notify_waiters();
        match batch {
            Some(b) => Ok(b),
            None => std::future::pending().await,
        }
    }
    async fn commit(&self, done: &[(String, i32, i64)]) -> Result<()> {
        self.state.lock().unwrap().commits.push(done.to_vec());
        Ok(())
    }
    fn epoch(&self) -> u64 {
        self.state.lock().unwrap().batch_epoch
    }
    fn revoked_since(&self, _topic: &str, partition: i32, epoch: u64) -> bool {
        let s = self.state.lock().unwrap();
        s.revoked.iter().any(|(e, p)| *e > epoch && *p == partition)
    }
    async fn close(&self) -> Result<()> {
        self.state.lock().unwrap().closed = true;
        Ok(())
    }
}

/// Writes (partition, offset) per applied event into `lane_effects`, whose `seq` orders the
/// applications. Partition `failing` fails transiently while set; with `wait_for_partition`, the
/// first event of partition 0 waits (at most 20 s) until one of that partition has entered the
/// handler; with `wait_for_fetches`, the first call waits until the source was asked that often.
#[derive(Clone)]
struct Lanes {
    failing: Arc<Mutex<Option<i32>>>,
    failures: Arc<AtomicU32>,
    wait_for_partition: Option<i32>,
    entered: watch::Sender<Vec<i32>>,
    overlapped: Arc<AtomicBool>,
    wait_for_fetches: Option<(Script, u32)>,
    in_flight: Arc<AtomicU32>,
    max_in_flight: Arc<AtomicU32>,
}

impl Default for Lanes {
    fn default() -> Self {
        Lanes {
            failing: Arc::default(),
            failures: Arc::default(),
            wait_for_partition: None,
            entered: watch::channel(vec![]).0,
            overlapped: Arc::default(),
            wait_for_fetches: None,
            in_flight: Arc::default(),
            max_in_flight: Arc::default(),
        }
    }
}

impl Lanes {
    async fn wait(&self, e: &InboundEvent) {
        if let (Some(other), 0) = (self.wait_for_partition, e.partition)
            && !self.overlapped.load(Ordering::SeqCst)
        {
            let mut rx = self.entered.subscribe();
            let seen =
                tokio::time::timeout(Duration::from_secs(20), rx.wait_for(|v| v.contains(&other)))
                    .await;
            self.overlapped
                .store(matches!(seen, Ok(Ok(_))), Ordering::SeqCst);
        }
        if let Some((script, n)) = &self.wait_for_fetches
            && !self.overlapped.load(Ordering::SeqCst)
        {
            let fetched = async {
                loop {
                    let notified = script.fetched.notified();
                    if script.state.lock().unwrap().fetches >= *n {
                        return;
                    }
                    notified.await;
                }
            };
            let seen = tokio::time::timeout(Duration::from_secs(20), fetched).await;
            self.overlapped.store(seen.is_ok(), Ordering::SeqCst);
        }
    }
}

impl Handler<sqlx::PgConnection> for Lanes {
    async fn handle(
        &self,
        cx: &mut HandlerContext<'_, sqlx::PgConnection>,
        e: &InboundEvent,
    ) -> std::result::Result<(), HandlerError> {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        self.entered.send_modify(|v| v.push(e.partition));
        self.wait(e).await;
        let result = if *self.failing.lock().unwrap() == Some(e.partition) {
            self.failures.fetch_add(1, Ordering::SeqCst);
            Err(HandlerError::transient("the partition's table is locked"))
        } else {
            sqlx::query("INSERT INTO lane_effects (part, record_offset) VALUES ($1, $2)")
                .bind(e.partition)
                .bind(e.offset)
                .execute(cx.conn())
                .await
                .map(|_| ())
                .map_err(HandlerError::transient)
        };
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        result
    }
}

fn record(partition: i32, offset: i64) -> Delivery {
    let id = EventId::new();
    let key = format!("order-{partition}");
    Delivery {
        topic: TOPIC.into(),
        partition,
        offset,
        key: Some(key.clone()),
        payload: Some(format!(r#"{{"n":{offset}}}"#).into_bytes()),
        headers: vec![
            ("ce_id".into(), id.to_string()),
            ("ce_type".into(), "order.paid".into()),
            ("idem_aggregate_type".into(), "order".into()),
            ("idem_aggregate_id".into(), key),
        ],
        timestamp: None,
    }
}

/// Partitions 0 and 1, `n` records each, interleaved as a broker would hand them out.
fn two_partitions(n: i64) -> Vec<Delivery> {
    (0..n).flat_map(|o| [record(0, o), record(1, o)]).collect()
}

async fn database() -> Pg {
    let pg = Pg::new().await;
    pg.exec(
        "CREATE TABLE lane_effects (seq bigserial PRIMARY KEY, part int NOT NULL, record_offset bigint NOT NULL)",
    )
    .await
    .unwrap();
    pg
}

type PgInbox = <Pg as Backend>::Inbox;

fn consumer(pg: &Pg, h: Lanes, source: Script, batch: usize) -> Consumer<PgInbox, Lanes, Script> {
    let mut config = ConsumerConfig::new("settlement");
    config.batch_size = batch;
    config.retry_backoff = Duration::from_millis(5);
    config.retry_backoff_max = Duration::from_millis(20);
    let metrics = ConsumerMetrics::new(&prometheus::Registry::new()).unwrap();
    Consumer::new(pg.inbox(), h, source, config, metrics)
}

/// The applied offsets of each partition, in the order they were applied.
async fn applied(pg: &Pg) -> BTreeMap<i32, Vec<i64>> {
    let rows: Vec<(i32, i64)> =
        sqlx::query_as("SELECT part, record_offset FROM lane_effects ORDER BY seq")
            .fetch_all(pg.pool())
            .await
            .unwrap();
    let mut by: BTreeMap<i32, Vec<i64>> = BTreeMap::new();
    for (p, o) in rows {
        by.entry(p).or_default().push(o);
    }
    by
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_are_applied_concurrently_each_in_offset_order() {
    let pg = database().await;
    let handler = Lanes {
        wait_for_partition: Some(1),
        ..Lanes::default()
    };
    let source = Script::default();
    let mut c = consumer(&pg, handler.clone(), source.clone(), 2);
    let report = c.process(&two_partitions(5)).await.unwrap();
    assert_eq!((report.records, report.processed), (10, 10));
    assert!(
        handler.overlapped.load(Ordering::SeqCst),
        "partition 1 was not applied while partition 0's transaction was open"
    );
    assert!(handler.max_in_flight.load(Ordering::SeqCst) >= 2);
    let want: Vec<i64> = (0..5).collect();
    assert_eq!(
        applied(&pg).await,
        BTreeMap::from([(0, want.clone()), (1, want)])
    );
    // Each transaction (2 records at most) committed its own partition's offsets, in order.
    let commits = source.commits();
    for p in [0, 1] {
        let mine: Vec<i64> = commits
            .iter()
            .flatten()
            .filter(|(_, part, _)| *part == p)
            .map(|(_, _, o)| *o)
            .collect();
        assert_eq!(mine, vec![1, 3, 4], "partition {p}: {commits:?}");
    }
    assert!(commits.iter().all(|c| c.len() == 1), "{commits:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_concurrency_bounds_the_partitions_in_flight() {
    let pg = database().await;
    let handler = Lanes::default();
    let mut c = {
        let mut config = ConsumerConfig::new("settlement");
        config.partition_concurrency = 1;
        let metrics = ConsumerMetrics::new(&prometheus::Registry::new()).unwrap();
        Consumer::new(
            pg.inbox(),
            handler.clone(),
            Script::default(),
            config,
            metrics,
        )
    };
    let mut records = two_partitions(3);
    records.extend((0..3).map(|o| record(2, o)));
    assert_eq!(c.process(&records).await.unwrap().processed, 9);
    assert_eq!(handler.max_in_flight.load(Ordering::SeqCst), 1);
    let want: Vec<i64> = (0..3).collect();
    assert_eq!(
        applied(&pg).await,
        BTreeMap::from([(0, want.clone()), (1, want.clone()), (2, want)])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_batch_is_fetched_while_the_current_one_is_applied() {
    let pg = database().await;
    let source = Script::with_batches(vec![vec![record(0, 0)], vec![record(0, 1)]]);
    let handler = Lanes {
        wait_for_fetches: Some((source.clone(), 2)),
        ..Lanes::default()
    };
    let c = consumer(&pg, handler.clone(), source.clone(), 10);
    let (stop, mut rx) = watch::channel(false);
    let run = tokio::spawn(c.run(async move {
        let _ = rx.wait_for(|s| *s).await;
    }));
    let s = source.clone();
    eventually("both batches committed", Duration::from_secs(30), || {
        let s = s.clone();
        async move { (s.committed().get(&0) == Some(&1)).then_some(()) }
    })
    .await;
    stop.send(true).unwrap();
    run.await.unwrap().unwrap();
    assert!(
        handler.overlapped.load(Ordering::SeqCst),
        "the second batch was not fetched while the first was being applied"
    );
    assert_eq!(applied(&pg).await, BTreeMap::from([(0, vec![0, 1])]));
    assert!(
        source.state.lock().unwrap().closed,
        "the run closed its source"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_of_a_partition_revoked_after_the_fetch_are_never_applied() {
    let pg = database().await;
    let source = Script::with_batches(vec![two_partitions(3)]);
    source.state.lock().unwrap().revoke_after_next = vec![1];
    let c = consumer(&pg, Lanes::default(), source.clone(), 10);
    let (stop, mut rx) = watch::channel(false);
    let run = tokio::spawn(c.run(async move {
        let _ = rx.wait_for(|s| *s).await;
    }));
    let s = source.clone();
    eventually("partition 0 committed", Duration::from_secs(30), || {
        let s = s.clone();
        async move { (s.committed().get(&0) == Some(&2)).then_some(()) }
    })
    .await;
    stop.send(true).unwrap();
    run.await.unwrap().unwrap();
    assert_eq!(applied(&pg).await, BTreeMap::from([(0, vec![0, 1, 2])]));
    assert_eq!(source.committed().get(&1), None, "{:?}", source.commits());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_revoked_while_its_transaction_retries_is_not_applied_after_the_revocation() {
    let pg = database().await;
    let handler = Lanes::default();
    *handler.failing.lock().unwrap() = Some(0);
    let source = Script::default();
    let mut c = consumer(&pg, handler.clone(), source.clone(), 10);
    let (h, s) = (handler.clone(), source.clone());
    let revoker = tokio::spawn(async move {
        eventually("partition 0 to fail", Duration::from_secs(30), || async {
            (h.failures.load(Ordering::SeqCst) > 0).then_some(())
        })
        .await;
        s.revoke(0);
    });
    // Were the records retried after the revocation, this would never return.
    let report = tokio::time::timeout(Duration::from_secs(60), c.process(&two_partitions(3)))
        .await
        .expect("partition 0 was retried after its revocation")
        .unwrap();
    revoker.await.unwrap();
    assert_eq!(report.processed, 3, "{report:?}");
    assert_eq!(applied(&pg).await, BTreeMap::from([(1, vec![0, 1, 2])]));
    assert_eq!(source.committed(), BTreeMap::from([(1, 2)]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_partition_does_not_hold_back_the_commit_of_another() {
    let pg = database().await;
    let handler = Lanes::default();
    *handler.failing.lock().unwrap() = Some(0);
    let records = two_partitions(3);
    let source = Script::with_batches(vec![records.clone()]);
    let c = consumer(&pg, handler.clone(), source.clone(), 10);
    let (stop, mut rx) = watch::channel(false);
    let run = tokio::spawn(c.run(async move {
        let _ = rx.wait_for(|s| *s).await;
    }));
    let s = source.clone();
    eventually(
        "partition 1 committed while partition 0 fails",
        Duration::from_secs(30),
        || {
            let s = s.clone();
            async move { (s.committed().get(&1) == Some(&2)).then_some(()) }
        },
    )
    .await;
    assert!(handler.failures.load(Ordering::SeqCst) > 0);
    assert_eq!(source.committed().get(&0), None);
    // A shutdown while partition 0 backs off abandons it, uncommitted, and closes the source.
    stop.send(true).unwrap();
    run.await.unwrap().unwrap();
    assert_eq!(applied(&pg).await, BTreeMap::from([(1, vec![0, 1, 2])]));
    assert_eq!(source.committed(), BTreeMap::from([(1, 2)]));
    assert!(source.state.lock().unwrap().closed);

    // Once partition 0's handler behaves, a new consumer applies it once.
    *handler.failing.lock().unwrap() = None;
    let mut again = consumer(&pg, handler.clone(), Script::default(), 10);
    let report = again.process(&records).await.unwrap();
    assert_eq!((report.processed, report.duplicate_skips), (3, 3));
    let want: Vec<i64> = (0..3).collect();
    assert_eq!(
        applied(&pg).await,
        BTreeMap::from([(0, want.clone()), (1, want)])
    );
}
