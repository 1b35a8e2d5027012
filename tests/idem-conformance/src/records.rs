//! Records for consumer tests that hand batches to `Consumer::process`: a source never read,
//! and a record as the relay publishes it.

use std::time::Duration;

use idem_core::store::{Delivery, Source};
use idem_core::{EventId, Result};

/// A source that is never read: the tests hand batches to `Consumer::process`.
pub struct NoSource;

impl Source for NoSource {
    async fn next_batch(&self, _max: usize, _linger: Duration) -> Result<Vec<Delivery>> {
        std::future::pending().await
    }
    async fn commit(&self, _done: &[(String, i32, i64)]) -> Result<()> {
        Ok(())
    }
}

/// A record of `topic`, partition 0, at `offset`, keyed and aggregated by `aggregate_id`
/// (aggregate type `order`), with the event id, type and payload given.
pub fn delivery(
    topic: &str,
    offset: i64,
    id: EventId,
    event_type: &str,
    aggregate_id: &str,
    payload: &str,
) -> Delivery {
    Delivery {
        topic: topic.into(),
        partition: 0,
        offset,
        key: Some(aggregate_id.into()),
        payload: Some(payload.as_bytes().to_vec()),
        headers: vec![
            ("ce_id".into(), id.to_string()),
            ("ce_type".into(), event_type.into()),
            ("idem_aggregate_type".into(), "order".into()),
            ("idem_aggregate_id".into(), aggregate_id.into()),
        ],
        timestamp: None,
    }
}
