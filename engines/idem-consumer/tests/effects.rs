//! The effects a handler posts, under the runtime, on PostgreSQL and SQLite: an intent the
//! database refuses for its data refuses the event that posted it (dead-lettered with the
//! reason, the rest of the batch applied with their intents), and never stalls the partition.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use idem_conformance::backend::{Backend, Lite, Pg};
use idem_conformance::records::{NoSource, delivery};
use idem_consumer::{
    Consumer, ConsumerConfig, ConsumerMetrics, Handler, HandlerContext, HandlerError,
};
use idem_core::store::InboxStore;
use idem_core::{EventId, InboundEvent};

/// Posts one effect per event, to the URL its payload names.
struct PostsTo;

macro_rules! posts_to {
    ($conn:ty) => {
        impl Handler<$conn> for PostsTo {
            async fn handle(
                &self,
                cx: &mut HandlerContext<'_, $conn>,
                e: &InboundEvent,
            ) -> std::result::Result<(), HandlerError> {
                let target = e.payload["target"].as_str().unwrap_or_default().to_owned();
                cx.effects()
                    .post("test.effect", target, serde_json::json!({}))?;
                Ok(())
            }
        }
    };
}
posts_to!(sqlx::PgConnection);
posts_to!(sqlx::SqliteConnection);

/// Three events, the second posting to a URL with a NUL byte, which PostgreSQL's text cannot
/// hold (SQLSTATE 22021) and SQLite stores.
async fn an_intent_the_database_refuses_dead_letters_its_event_only<B: Backend>(b: B, refused: bool)
where
    PostsTo: Handler<<B::Inbox as InboxStore>::Conn>,
{
    let mut config = ConsumerConfig::new("g");
    config.retry_backoff = Duration::ZERO;
    let metrics = ConsumerMetrics::unregistered().unwrap();
    let mut c = Consumer::new(b.inbox(), PostsTo, NoSource, config, metrics);
    let ids: Vec<EventId> = (0..3).map(|_| EventId::new()).collect();
    let targets = ["http://h/a", "http://h/\\u0000b", "http://h/c"];
    let records: Vec<_> = ids
        .iter()
        .zip(targets)
        .enumerate()
        .map(|(i, (id, t))| {
            let payload = format!(r#"{{"target":"{t}"}}"#);
            delivery(
                "t",
                i64::try_from(i).unwrap(),
                *id,
                "order.paid",
                &format!("o-{i}"),
                &payload,
            )
        })
        .collect();
    let r = tokio::time::timeout(Duration::from_secs(30), c.process(&records))
        .await
        .expect("an intent the database refuses stalled the batch")
        .unwrap();
    let intents = b.scalar("SELECT count(*) FROM idem_effect_intents").await;
    if refused {
        assert_eq!((r.processed, r.dead_lettered), (2, 1), "{r:?}");
        assert_eq!(intents, 2, "the two applied events' intents");
        let letters = b.inbox().dead_letters("g", 10).await.unwrap();
        assert_eq!(letters.len(), 1);
        assert_eq!(letters[0].event_id, Some(ids[1].to_string()));
        assert!(
            letters[0].reason.contains("effects cannot be recorded"),
            "{}",
            letters[0].reason
        );
    } else {
        assert_eq!((r.processed, r.dead_lettered), (3, 0), "{r:?}");
        assert_eq!(intents, 3);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_intent_the_database_refuses_dead_letters_its_event_only() {
    an_intent_the_database_refuses_dead_letters_its_event_only(Pg::new().await, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_stores_the_same_intents() {
    an_intent_the_database_refuses_dead_letters_its_event_only(Lite::new().await, false).await;
}
