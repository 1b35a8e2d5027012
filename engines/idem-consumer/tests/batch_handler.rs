//! `Handler::handle_batch` under the runtime (SQLite): the batch is handed to the handler once;
//! events refused by `validate` or by an `Outcome::Refused` are dead-lettered without a rollback;
//! a batch the database refuses as a whole is retried one event at a time in savepoints, and
//! exactly the events refused one by one are dead-lettered; a transient failure and a broken
//! outcome count are retried, never dead-lettered. The effects posted for an event are recorded
//! when, and only when, it is applied.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_conformance::backend::{Backend, Lite};
use idem_conformance::records::{NoSource, delivery};
use idem_consumer::{
    BatchContext, BatchError, Consumer, ConsumerConfig, ConsumerMetrics, Handler, HandlerContext,
    HandlerError, Outcome,
};
use idem_core::store::{Delivery, InboxStore};
use idem_core::{EventId, InboundEvent};
use sqlx::SqliteConnection;

/// How the scripted batch handler misbehaves.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
enum Mode {
    /// `{"refuse": …}` payloads refused with an outcome, the others applied.
    #[default]
    Outcomes,
    /// A batch holding a `{"db": …}` payload fails as a whole, as a refused set-based
    /// statement does; alone, that event is refused.
    DatabaseRefusesTheSet,
    /// The first call returns one outcome too few.
    WrongCountOnce,
    /// The first call fails transiently as a batch.
    TransientOnce,
}

/// Inserts one `effects` row per applied event in one statement per batch, and records the
/// size of every batch it is handed.
#[derive(Clone, Default)]
struct SetHandler {
    mode: Mode,
    batches: Arc<Mutex<Vec<usize>>>,
}

impl Handler<SqliteConnection> for SetHandler {
    async fn handle(
        &self,
        _cx: &mut HandlerContext<'_, SqliteConnection>,
        _e: &InboundEvent,
    ) -> std::result::Result<(), HandlerError> {
        unreachable!("the runtime calls handle_batch")
    }

    fn validate(&self, e: &InboundEvent) -> std::result::Result<(), String> {
        match e.payload.get("malformed") {
            Some(_) => Err("malformed payload".into()),
            None => Ok(()),
        }
    }

    async fn handle_batch(
        &self,
        cx: &mut BatchContext<'_, SqliteConnection>,
        events: &[&InboundEvent],
    ) -> std::result::Result<Vec<Outcome>, BatchError> {
        let call = {
            let mut b = self.batches.lock().unwrap();
            b.push(events.len());
            b.len()
        };
        assert!(
            events.iter().all(|e| e.payload.get("malformed").is_none()),
            "validated events only"
        );
        let has = |e: &InboundEvent, k: &str| e.payload.get(k).is_some();
        // Every event asks for an effect: only the applied ones may record it.
        for e in events {
            cx.effects(e).post(
                "test.effect",
                "http://127.0.0.1:9/effects",
                serde_json::json!({}),
            )?;
        }
        match self.mode {
            Mode::TransientOnce if call == 1 => Err(HandlerError::transient("database is busy"))?,
            Mode::DatabaseRefusesTheSet if events.iter().any(|e| has(e, "db")) => {
                if events.len() > 1 {
                    Err(HandlerError::permanent("a CHECK refused the statement"))?
                }
                return Ok(vec![Outcome::Refused(
                    "the database refuses this one".into(),
                )]);
            }
            _ => {}
        }
        let outcomes: Vec<Outcome> = events
            .iter()
            .map(|e| match has(e, "refuse") {
                true => Outcome::Refused("a business rule refuses it".into()),
                false => Outcome::Applied,
            })
            .collect();
        for (e, o) in events.iter().zip(&outcomes) {
            if *o == Outcome::Applied {
                sqlx::query("INSERT INTO effects (event_id) VALUES (?1)")
                    .bind(e.event_id.to_string())
                    .execute(cx.conn())
                    .await?;
            }
        }
        if self.mode == Mode::WrongCountOnce && call == 1 {
            return Ok(outcomes[1..].to_vec());
        }
        Ok(outcomes)
    }
}

fn record(offset: i64, id: EventId, payload: &str) -> Delivery {
    let aggregate = format!("o-{offset}");
    delivery("t", offset, id, "order.paid", &aggregate, payload)
}

type Under = Consumer<idem_sql::sqlite::SqliteInbox, SetHandler, NoSource>;

async fn setup(mode: Mode) -> (Lite, SetHandler, Under) {
    let b = Lite::new().await;
    b.exec("CREATE TABLE effects (event_id TEXT NOT NULL)")
        .await
        .unwrap();
    let handler = SetHandler {
        mode,
        ..SetHandler::default()
    };
    let mut config = ConsumerConfig::new("g");
    config.retry_backoff = Duration::ZERO;
    let metrics = ConsumerMetrics::unregistered().unwrap();
    let c = Consumer::new(b.inbox(), handler.clone(), NoSource, config, metrics);
    (b, handler, c)
}

/// `n` records with fresh event ids, the payload of each chosen by its offset.
fn batch(payload_of: impl Fn(i64) -> &'static str, n: i64) -> (Vec<EventId>, Vec<Delivery>) {
    let ids: Vec<EventId> = (0..n).map(|_| EventId::new()).collect();
    let records = ids
        .iter()
        .zip(0..)
        .map(|(id, i)| record(i, *id, payload_of(i)))
        .collect();
    (ids, records)
}

async fn dead<B: Backend>(b: &B) -> Vec<(i64, String)> {
    let mut l: Vec<(i64, String)> = b
        .inbox()
        .dead_letters("g", 100)
        .await
        .unwrap()
        .into_iter()
        .map(|l| (l.offset, l.reason))
        .collect();
    l.sort();
    l
}

#[tokio::test]
async fn refusals_by_validate_and_by_outcome_cost_one_call_and_no_rollback() {
    let (b, h, mut c) = setup(Mode::Outcomes).await;
    let (_, records) = batch(
        |i| match i {
            4 => r#"{"malformed":true}"#,
            i if i % 3 == 0 => r#"{"refuse":true}"#,
            _ => "{}",
        },
        10,
    );
    let r = c.process(&records).await.unwrap();
    assert_eq!(
        (r.processed, r.dead_lettered, r.retries),
        (5, 5, 0),
        "{r:?}"
    );
    assert_eq!(
        *h.batches.lock().unwrap(),
        [9],
        "one call with the nine valid events, no isolating pass"
    );
    assert_eq!(b.scalar("SELECT count(*) FROM effects").await, 5);
    assert_eq!(
        b.scalar("SELECT count(*) FROM idem_effect_intents").await,
        5,
        "one intent per applied event, none for a refused one"
    );
    let letters = dead(&b).await;
    assert_eq!(letters.len(), 5);
    assert_eq!(letters[2], (4, "malformed payload".to_owned()));
    assert_eq!(letters[0], (0, "a business rule refuses it".to_owned()));
    assert_eq!(
        b.scalar("SELECT count(*) FROM idem_inbox WHERE status = 'dead_lettered'")
            .await,
        5
    );
}

#[tokio::test]
async fn a_batch_the_database_refuses_is_isolated_and_only_its_poison_dead_lettered() {
    let (b, h, mut c) = setup(Mode::DatabaseRefusesTheSet).await;
    let (_, records) = batch(
        |i| match i {
            2 => r#"{"db":true}"#,
            5 => r#"{"refuse":true}"#,
            _ => "{}",
        },
        6,
    );
    let r = c.process(&records).await.unwrap();
    assert_eq!(
        (r.processed, r.dead_lettered, r.retries),
        (4, 2, 1),
        "{r:?}"
    );
    assert_eq!(
        *h.batches.lock().unwrap(),
        [6, 1, 1, 1, 1, 1, 1],
        "the refused set, then one savepoint per event"
    );
    assert_eq!(b.scalar("SELECT count(*) FROM effects").await, 4);
    assert_eq!(
        b.scalar("SELECT count(*) FROM idem_effect_intents").await,
        4,
        "one intent per applied event, none for a refused one"
    );
    let letters = dead(&b).await;
    assert_eq!(
        letters,
        [
            (2, "the database refuses this one".to_owned()),
            (5, "a business rule refuses it".to_owned())
        ]
    );
}

/// Three plain events under `mode`: one failed call, then one isolated pass applies all three
/// (the first call's writes rolled back), and a redelivery reaches no handler.
async fn three_applied_after_one_isolated_pass(mode: Mode) {
    let (b, h, mut c) = setup(mode).await;
    let (_, records) = batch(|_| "{}", 3);
    let r = c.process(&records).await.unwrap();
    assert_eq!(
        (r.processed, r.dead_lettered, r.retries),
        (3, 0, 1),
        "{r:?}"
    );
    assert_eq!(*h.batches.lock().unwrap(), [3, 1, 1, 1]);
    assert_eq!(b.scalar("SELECT count(*) FROM effects").await, 3);
    assert_eq!(
        b.scalar("SELECT count(*) FROM idem_effect_intents").await,
        3,
        "one intent per applied event, none for a refused one"
    );
    let again = c.process(&records).await.unwrap();
    assert_eq!((again.processed, again.duplicate_skips), (0, 3));
    assert_eq!(
        h.batches.lock().unwrap().len(),
        4,
        "duplicates reach no handler"
    );
}

#[tokio::test]
async fn a_wrong_outcome_count_is_isolated_and_dead_letters_nothing() {
    three_applied_after_one_isolated_pass(Mode::WrongCountOnce).await;
}

#[tokio::test]
async fn a_transient_batch_failure_is_retried_and_applied_once() {
    three_applied_after_one_isolated_pass(Mode::TransientOnce).await;
}
