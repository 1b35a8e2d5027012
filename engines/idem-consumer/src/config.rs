//! Consumer settings.

use std::time::Duration;

/// Consumer settings.
#[derive(Clone, Debug)]
pub struct ConsumerConfig {
    /// Consumer group: the inbox is keyed by (group, event id).
    pub group: String,
    /// Most records per transaction.
    pub batch_size: usize,
    /// How long to wait for more records after the first one of a batch.
    pub linger: Duration,
    /// Failures of a batch not caused by one event (the database unreachable, a failed commit)
    /// before [`Consumer::process`](crate::Consumer::process) gives up and returns the error; the offset is not committed,
    /// so nothing is lost, and a restarted consumer retries the batch. A transient failure of
    /// one event's handler is retried without limit: it never dead-letters the event.
    pub max_batch_retries: u32,
    /// Failures of one event with a database error the rule of
    /// [`HandlerError::from`](crate::HandlerError::from) does not classify
    /// ([`HandlerError::Unclassified`](crate::HandlerError::Unclassified): a SQLSTATE class it
    /// does not name, a custom `ERRCODE`) after which the event is dead-lettered with its code
    /// and message, so an unknown code stops its partition for a bounded time, never for good.
    /// Each failure before is retried as transient and logged with the code. Failures the
    /// rule calls transient (a lock or statement timeout, a serialization failure, a lost
    /// connection) never count. `u32::MAX`: retried without limit.
    pub max_unclassified_failures: u32,
    /// First retry backoff; doubles per retry.
    pub retry_backoff: Duration,
    /// Longest retry backoff: a batch held up by a transient failure is retried at least this
    /// often for as long as the failure lasts.
    pub retry_backoff_max: Duration,
    /// How often `idem_consumer_lag` is measured (when the source can measure it).
    pub lag_interval: Duration,
    /// How many partitions are applied at once, each in its own transaction on its own
    /// connection (at least 1). A fetch collects up to `batch_size` × this many records; the
    /// records of one partition are always applied in offset order, one transaction after
    /// another. Each partition in flight holds a database connection: keep this at or below
    /// the pool's size.
    pub partition_concurrency: usize,
    /// How often the consumer looks for dead-letter replays an operator requested for its
    /// group (`idem dead-letters replay --confirm`) and serves them through its handler. Each
    /// look is one indexed query that finds nothing most of the time.
    pub replay_poll: Duration,
}

impl ConsumerConfig {
    /// Defaults for `group`: batches of 200, 5 ms linger, retries from 100 ms doubling to at
    /// most 30 s (a transiently failing event is retried every 30 s until it applies; the
    /// database unreachable for 20 attempts, about eight minutes, ends the run; an event failing
    /// with an unclassified database error 10 times, about a minute and a half, is
    /// dead-lettered), up to 4 partitions applied at once, requested replays looked for every
    /// second.
    pub fn new(group: impl Into<String>) -> Self {
        ConsumerConfig {
            group: group.into(),
            batch_size: 200,
            linger: Duration::from_millis(5),
            max_batch_retries: 20,
            max_unclassified_failures: 10,
            retry_backoff: Duration::from_millis(100),
            retry_backoff_max: Duration::from_secs(30),
            lag_interval: Duration::from_secs(5),
            partition_concurrency: 4,
            replay_poll: Duration::from_secs(1),
        }
    }
}
