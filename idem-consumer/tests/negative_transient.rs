//! The `transient-dead-letters` negative control. Broken, the consumer dead-letters an event
//! after a few transient failures — the defect of review §8 — so a harness that drives transient
//! failures must see a loss. `IDEM_BREAK` is read once per process: the test runs itself again
//! as a child process with it set.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idem_consumer::{Consumer, ConsumerConfig, ConsumerMetrics, Handler, HandlerError};
use idem_core::crash::{BREAK_TRANSIENT_DEAD_LETTERS, BROKEN_TRANSIENT_BUDGET};
use idem_core::{Delivery, EventId, InboundEvent, InboxStore, Result, Source, TableNames};

struct NoSource;

impl Source for NoSource {
    async fn next_batch(&mut self, _max: usize, _linger: Duration) -> Result<Vec<Delivery>> {
        std::future::pending().await
    }
    async fn commit(&mut self, _done: &[(String, i32, i64)]) -> Result<()> {
        Ok(())
    }
}

/// Fails transiently `failures` times, then succeeds.
struct Flaky(Arc<AtomicU32>);

impl Handler<sqlx::SqliteConnection> for Flaky {
    async fn handle(
        &self,
        _conn: &mut sqlx::SqliteConnection,
        _e: &InboundEvent,
    ) -> std::result::Result<(), HandlerError> {
        let left = self.0.load(Ordering::SeqCst);
        if left > 0 {
            self.0.store(left - 1, Ordering::SeqCst);
            return Err(HandlerError::transient("lock timeout"));
        }
        Ok(())
    }
}

#[test]
fn the_transient_dead_letters_control_brings_back_the_defect() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "broken_run", "--ignored", "--nocapture"])
        .env("IDEM_BREAK", BREAK_TRANSIENT_DEAD_LETTERS)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
#[ignore = "run by the_transient_dead_letters_control_brings_back_the_defect with IDEM_BREAK set"]
async fn broken_run() {
    assert!(idem_core::crash::broken(BREAK_TRANSIENT_DEAD_LETTERS));
    let dir = tempfile::tempdir().unwrap();
    let pool = idem_sqlite::connect(&format!("sqlite://{}", dir.path().join("n.db").display()))
        .await
        .unwrap();
    idem_sqlite::migrate(&pool, &TableNames::default())
        .await
        .unwrap();
    let inbox = idem_sqlite::SqliteInbox::new(pool, TableNames::default());
    let mut config = ConsumerConfig::new("settlement");
    config.retry_backoff = Duration::ZERO;
    let handler = Flaky(Arc::new(AtomicU32::new(BROKEN_TRANSIENT_BUDGET + 5)));
    let metrics = ConsumerMetrics::new(&prometheus::Registry::new()).unwrap();
    let mut consumer = Consumer::new(inbox, handler, NoSource, config, metrics);
    let id = EventId::new();
    let record = Delivery {
        topic: "outbox.event.order".into(),
        partition: 0,
        offset: 0,
        key: Some("o-1".into()),
        payload: Some(b"{}".to_vec()),
        headers: vec![
            ("ce_id".into(), id.to_string()),
            ("ce_type".into(), "order.paid".into()),
        ],
        timestamp: None,
    };
    let r = consumer.process(&[record]).await.unwrap();
    assert_eq!(
        (r.processed, r.dead_lettered),
        (0, 1),
        "the control did not break the mechanism"
    );
    let letters = consumer
        .inbox()
        .dead_letters("settlement", 10)
        .await
        .unwrap();
    assert!(
        letters[0].reason.contains("transient failures"),
        "{letters:?}"
    );
}
