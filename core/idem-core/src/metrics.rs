//! What the metrics of the relay, the consumer and the effect stage share. The metrics
//! themselves live next to the code that updates them; `docs/operating/metrics.md` lists them all.

/// Buckets of the end-to-end latency histograms (`idem_outbox_commit_to_publish_seconds`,
/// `idem_consumer_publish_to_processed_seconds`), in seconds: from an idle relay's poll interval
/// up to a backlog of a quarter of an hour. The same buckets on both sides let a dashboard put
/// their quantiles side by side.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0,
];
