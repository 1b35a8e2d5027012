//! The demo's driving loop: it arms crash points, writes orders, republishes published events
//! and forges conflicting copies as [`plan`] decides, until the pipeline settles
//! or the deadline passes.

use std::time::{Duration, Instant};

use anyhow::bail;
use idem_core::crash::{self, Action, CrashPoint};
use idem_core::publish::{Message, Publisher};
use idem_core::wire;
use idem_kafka::KafkaPublisher;
use idem_reference::PaidOrder;
use idem_sql::{AnyPool, AnyStore, Dialect, Store, with_store};

use super::plan::{self, Counts, PointState, Seed, Tally, Targets};
use super::supervise::{Ctl, Stop};

const COUNT_DONE: &str = "SELECT count(*) FROM idem_effect_intents WHERE status = 'done'";
const COUNT_PENDING: &str = "SELECT count(*) FROM idem_outbox WHERE status <> 'published'";
const COUNT_SETTLED: &str = "SELECT count(*) FROM settlements";
const COUNT_DEAD: &str = "SELECT count(*) FROM idem_dead_letters";

/// The injector's state across steps.
pub(super) struct Injector<'a> {
    /// What to inject.
    pub targets: Targets,
    /// What has been injected.
    pub tally: Tally,
    seed: Seed,
    /// The last outbox row a conflict was forged from.
    forged_up_to: i64,
    orders: AnyStore,
    orders_pool: AnyPool,
    settlement: AnyPool,
    publisher: &'a KafkaPublisher,
    topic: &'a str,
}

impl<'a> Injector<'a> {
    /// An injector writing to `orders` (the orders database's store), watching `settlement`
    /// and forging onto `topic`.
    pub(super) fn new(
        targets: Targets,
        orders: AnyStore,
        settlement: AnyPool,
        publisher: &'a KafkaPublisher,
        topic: &'a str,
    ) -> Self {
        Injector {
            targets,
            tally: Tally::default(),
            seed: Seed::default(),
            forged_up_to: 0,
            orders_pool: orders.pool(),
            orders,
            settlement,
            publisher,
            topic,
        }
    }

    /// Steps until the pipeline settles; past `deadline` (from `started`), stops the components
    /// and fails (a liveness failure).
    pub(super) async fn until_settled(
        &mut self,
        ctl: &Ctl,
        stop: &Stop,
        started: Instant,
        deadline: Duration,
    ) -> anyhow::Result<()> {
        let mut last_progress = Instant::now();
        loop {
            if Instant::now() > started + deadline {
                stop.stop();
                bail!(
                    "liveness: the pipeline did not settle within {deadline:?} (orders written {}, crash points {:?})",
                    self.tally.written,
                    pipeline_fired()
                );
            }
            let (batch, counts) = self.step().await?;
            if last_progress.elapsed() >= Duration::from_secs(1) {
                self.progress_line(started, &counts, ctl);
                last_progress = Instant::now();
            }
            let done = plan::faults_done(&pipeline_fired(), self.targets.crashes);
            if plan::settled(&self.targets, &self.tally, done, &counts) {
                return Ok(());
            }
            tokio::time::sleep(plan::pause(batch)).await;
        }
    }

    /// One step: crash points, orders, republishes, a conflict; the orders written and what
    /// the databases show afterwards.
    async fn step(&mut self) -> anyhow::Result<(u64, Counts)> {
        self.arm_crash_points()?;
        let (settle, orders) = (&self.settlement, &self.orders_pool);
        let idle = settle.scalar(COUNT_DONE).await? >= self.tally.written_i64();
        let pending = orders.scalar(COUNT_PENDING).await?;
        let faults_done = plan::faults_done(&pipeline_fired(), self.targets.crashes);
        let batch = plan::order_batch(&self.targets, &self.tally, faults_done, pending, idle);
        let first = self.tally.written + 1;
        with_store!(&self.orders, s => write_orders(s, first, batch).await?);
        self.tally.written += batch;
        if let Some(k) = plan::republish_batch(&self.targets, &self.tally) {
            self.tally.republished += orders.exec(&republish_sql(orders, k)).await?;
        }
        if plan::conflict_due(&self.targets, &self.tally) {
            let (publisher, topic) = (self.publisher, self.topic);
            self.tally.conflicts +=
                inject_conflict(orders, publisher, topic, &mut self.forged_up_to).await?;
        }
        let counts = Counts {
            pending,
            settled: settle.scalar(COUNT_SETTLED).await?,
            done: settle.scalar(COUNT_DONE).await?,
            dead: settle.scalar(COUNT_DEAD).await?,
        };
        Ok((batch, counts))
    }

    /// Keeps each crash point armed (error mode, on one of its next few hits) until it has
    /// fired often enough.
    fn arm_crash_points(&mut self) -> anyhow::Result<()> {
        let states: Vec<PointState> = pipeline_fired()
            .into_iter()
            .map(|(p, n)| (p, n, crash::is_armed(p)))
            .collect();
        for (p, fire_on) in plan::crash_arming(&states, self.targets.crashes, &mut self.seed) {
            crash::arm(p, Action::Error, fire_on)?;
        }
        Ok(())
    }

    fn progress_line(&self, started: Instant, c: &Counts, ctl: &Ctl) {
        let fired: u64 = pipeline_fired().iter().map(|(_, n)| *n).sum();
        let t = &self.tally;
        eprintln!(
            "idem demo: {:>5.1}s  orders {}  unpublished {}  settled {}  awarded {}  crash points fired {fired}/{}  rows set back to pending {}  conflicting copies {}  restarts {}",
            started.elapsed().as_secs_f64(),
            t.written,
            c.pending,
            c.settled,
            c.done,
            CrashPoint::POLLING_PIPELINE.len() as u64 * self.targets.crashes,
            t.republished,
            t.conflicts,
            ctl.total_restarts()
        );
    }
}

/// Writes orders `first..first + count`, each its own transaction (order row + order.paid).
async fn write_orders<DB: Dialect>(s: &Store<DB>, first: u64, count: u64) -> anyhow::Result<()> {
    let outbox = s.outbox();
    for n in first..first + count {
        let order = PaidOrder::numbered("", n);
        idem_reference::write_order(
            s.pool(),
            Some(&outbox),
            &order,
            &order.event()?,
            Duration::ZERO,
        )
        .await?;
    }
    Ok(())
}

/// Makes `k` random published rows pending again (extra duplicate deliveries). `k` is a
/// number the demo computed, never input.
fn republish_sql(orders: &AnyPool, k: u64) -> String {
    let due = match orders {
        AnyPool::Postgres(_) => "'-infinity'",
        AnyPool::Sqlite(_) => "0",
    };
    format!(
        "UPDATE idem_outbox SET status = 'pending', next_attempt_at = {due}, published_at = NULL \
         WHERE id IN (SELECT id FROM idem_outbox WHERE status = 'published' ORDER BY random() LIMIT {k})"
    )
}

/// Sends a published event again under its own id with a changed amount: the consumer must
/// refuse it as an idempotency conflict (dead-lettered with the reason), never apply it.
///
/// Each conflict forges another event (the first published row after `forged_up_to`, which it
/// then advances): two copies of one forgery could meet in one consumer batch, where the second
/// is a duplicate of the first rather than a conflict, and only one would be dead-lettered.
async fn inject_conflict(
    orders: &AnyPool,
    publisher: &KafkaPublisher,
    topic: &str,
    forged_up_to: &mut i64,
) -> anyhow::Result<u64> {
    let Some((row_id, event_id, order_id)) = next_published(orders, *forged_up_to).await? else {
        return Ok(0);
    };
    *forged_up_to = row_id;
    let message = forged(topic, &event_id, &order_id);
    let results = publisher.publish(std::slice::from_ref(&message)).await;
    Ok(u64::from(results.iter().all(Result::is_ok)))
}

/// The first published outbox row after `after`: its id, event id and aggregate (order) id.
async fn next_published(
    orders: &AnyPool,
    after: i64,
) -> anyhow::Result<Option<(i64, String, String)>> {
    let sql = "SELECT id, event_id, aggregate_id FROM idem_outbox \
               WHERE status = 'published' AND id > $1 ORDER BY id LIMIT 1";
    Ok(match orders {
        AnyPool::Postgres(p) => sqlx::query_as::<_, (i64, uuid::Uuid, String)>(sql)
            .bind(after)
            .fetch_optional(p)
            .await?
            .map(|(row_id, id, agg)| (row_id, id.to_string(), agg)),
        AnyPool::Sqlite(p) => sqlx::query_as(sql).bind(after).fetch_optional(p).await?,
    })
}

/// A copy of event `event_id` of order `order_id` with another payload.
fn forged(topic: &str, event_id: &str, order_id: &str) -> Message {
    let payload = serde_json::json!({
        "order_id": order_id,
        "payment_id": "forged",
        "amount": "0.01",
        "currency": "EUR",
    });
    let h = |k: &str, v: &str| (k.to_owned(), v.to_owned());
    Message {
        topic: topic.to_owned(),
        key: order_id.to_owned(),
        payload: payload.to_string(),
        headers: vec![
            h(wire::CE_ID, event_id),
            h(wire::CE_TYPE, idem_reference::ORDER_PAID),
            h(wire::IDEM_AGGREGATE_TYPE, idem_reference::ORDER),
            h(wire::IDEM_AGGREGATE_ID, order_id),
        ],
    }
}

/// How often each point of the demo's pipeline (the polling relay's) has fired in this process.
pub(super) fn pipeline_fired() -> Vec<(CrashPoint, u64)> {
    crash::fired()
        .into_iter()
        .filter(|(p, _)| CrashPoint::POLLING_PIPELINE.contains(p))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forged_copy_carries_the_event_id_and_decodes_under_the_wire_contract() {
        let id = idem_core::EventId::new().to_string();
        let m = forged("t", &id, "order-7");
        let d = idem_core::inbox::Delivery {
            topic: m.topic.clone(),
            partition: 0,
            offset: 1,
            key: Some(m.key.clone()),
            payload: Some(m.payload.into_bytes()),
            headers: m.headers,
            timestamp: None,
        };
        let e = wire::decode(&d).unwrap();
        assert_eq!(e.event_id.to_string(), id);
        assert_eq!(e.event_type, idem_reference::ORDER_PAID);
        assert_eq!(
            (e.aggregate_type.as_str(), e.aggregate_id.as_str()),
            ("order", "order-7")
        );
        assert_eq!(e.payload["payment_id"], "forged");
    }
}
