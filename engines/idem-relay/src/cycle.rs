//! One claim → publish → mark cycle: the I/O around the pure steps of [`crate::message`] and
//! [`crate::outcome`], with the crash points and negative controls where they fire.

use std::borrow::Cow;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use idem_core::Result;
use idem_core::crash::{self, CrashPoint};
use idem_core::outbox::{Claim, ClaimOutcome, ClaimRequest, Completed, OutboxRecord};
use idem_core::publish::Publisher;
use idem_core::store::OutboxStore;

use crate::message;
use crate::outcome::{self, Backoff, Next, Policy, RowOutcome};
use crate::{CycleReport, Relay};

/// The last instant at which a batch claimed no earlier than `started` may still be produced:
/// the lease (which the database started after `started`) must outlast the longest publish.
/// A publisher that cannot bound a publish gets 90% of the lease for the claim.
pub(crate) fn produce_deadline(
    started: Instant,
    lease: Duration,
    longest_publish: Option<Duration>,
) -> Instant {
    match longest_publish {
        Some(publish) => started + lease.saturating_sub(publish),
        None => started + lease.mul_f64(0.9),
    }
}

/// The topic, event type and aggregate type of a row: the labels of its metrics.
fn labels<'a>(r: &'a OutboxRecord, topic: &'a str) -> [&'a str; 3] {
    [topic, r.event_type.as_str(), r.aggregate_type.as_str()]
}

impl<S: OutboxStore, P: Publisher> Relay<S, P> {
    /// Runs one claim–publish–mark cycle.
    ///
    /// Duplicate windows, and what closes them:
    /// * crash after the claim, before producing: the lease expires, the rows are claimed
    ///   again with the next attempt number; nothing reached Kafka, nothing is duplicated.
    /// * crash after the broker acknowledged, before the mark commits: the rows are published
    ///   again after the lease expires. The copy in Kafka is a duplicate, counted by
    ///   `idem_outbox_republish_total` and absorbed by the consumer's inbox (same `ce_id`).
    /// * a relay paused past its lease: another relay takes the rows over; the paused relay's
    ///   mark is fenced by the claim id and changes nothing (`idem_outbox_lease_lost_total`).
    pub async fn run_once(&self) -> Result<CycleReport> {
        let (started, claim) = self.claim_batch().await?;
        self.process(started, claim).await
    }

    /// Claims the next batch; returns when the claim started (its lease began later) with it.
    pub(crate) async fn claim_batch(&self) -> Result<(Instant, Claim)> {
        let started = Instant::now();
        let claim = self
            .store
            .claim(&ClaimRequest {
                relay_id: self.config.relay_id.clone(),
                batch_size: self.config.batch_size,
                lease: self.config.lease,
            })
            .await?;
        Ok((started, claim))
    }

    /// Publishes a claimed batch, awaits every delivery report and marks the rows: the part of
    /// [`Relay::run_once`] after the claim. `started` is when the claim started.
    pub(crate) async fn process(&self, started: Instant, claim: Claim) -> Result<CycleReport> {
        let mut report = CycleReport {
            claimed: claim.records.len() + claim.corrupt.len(),
            ..CycleReport::default()
        };
        if report.claimed == 0 {
            return Ok(report);
        }
        let records = self.negative_controls(&claim).await?;
        crash::crash_point(CrashPoint::RelayAfterClaimBeforePublish)?;

        let plan = message::plan(&records, &self.config.topics, self.config.source.as_deref());
        if Instant::now()
            >= produce_deadline(started, self.config.lease, self.publisher.longest_publish())
        {
            // The lease could end while the batch is still being produced, and another relay
            // could then publish the same rows: produce nothing, let the lease expire.
            tracing::warn!(relay = %self.config.relay_id, "the claim left too little of the lease to publish the batch; abandoning it");
            self.metrics
                .abandoned
                .inc_by(u64::try_from(records.len()).unwrap_or(u64::MAX));
            return Ok(report);
        }
        let delivered = self.publisher.publish(&plan.messages).await;
        let reported_at = Utc::now();
        let results = plan.results(delivered);
        crash::crash_point(CrashPoint::RelayAfterPublishBeforeMark)?;

        let never_park = || crash::broken(crash::Mechanism::NeverPark);
        let policy = Policy {
            max_attempts: self.config.max_attempts,
            never_park: &never_park,
        };
        let outcomes = outcome::classify(&records, results, &policy);
        self.account_failures(&claim, &records, &plan.topics, &outcomes);
        let mark = outcome::mark(&claim.corrupt, &records, &outcomes, self.backoff());
        let completed = self.store.complete(&claim, &mark).await?;
        self.account_mark(&mut report, &mark, completed);
        if completed.fenced == 0 {
            report.republished =
                self.account_published(&records, &plan.topics, &outcomes, reported_at);
        }
        self.metrics
            .batch_seconds
            .observe(started.elapsed().as_secs_f64());
        Ok(report)
    }

    fn backoff(&self) -> Backoff {
        Backoff {
            first: self.config.retry_backoff,
            max: self.config.retry_backoff_max,
        }
    }

    /// Negative controls (chaos runs only): see `idem_core::crash::Mechanism`. Returns the rows
    /// to publish: all the claim's, unless the `id-watermark` control skipped some.
    async fn negative_controls<'c>(&self, claim: &'c Claim) -> Result<Cow<'c, [OutboxRecord]>> {
        let records: Cow<'c, [OutboxRecord]> = if crash::broken(crash::Mechanism::IdWatermark) {
            let mark = self.watermark.load(Ordering::Relaxed);
            let (below, above): (Vec<_>, Vec<_>) =
                claim.records.iter().cloned().partition(|r| r.id < mark);
            let skipped = ClaimOutcome {
                published: below.iter().map(|r| r.id).collect(),
                failed: vec![],
            };
            self.store.complete(claim, &skipped).await?;
            Cow::Owned(above)
        } else {
            Cow::Borrowed(&claim.records)
        };
        if crash::broken(crash::Mechanism::MarkBeforeReport) {
            let early = ClaimOutcome {
                published: records.iter().map(|r| r.id).collect(),
                failed: vec![],
            };
            self.store.complete(claim, &early).await?;
        }
        Ok(records)
    }

    /// Logs the rows that will be parked or retried and counts the failures, before the mark.
    fn account_failures(
        &self,
        claim: &Claim,
        records: &[OutboxRecord],
        topics: &[String],
        outcomes: &[RowOutcome],
    ) {
        for (id, reason) in &claim.corrupt {
            tracing::error!(row = id, %reason, "parking an outbox row that cannot be decoded");
        }
        for ((r, topic), o) in records.iter().zip(topics).zip(outcomes) {
            let RowOutcome::Failed { error, next } = o else {
                continue;
            };
            self.metrics
                .count_failed(&labels(r, topic), error.kind, *next);
            match next {
                Next::Park => {
                    tracing::error!(event_id = %r.event_id, reason = %error.reason, attempts = r.attempt, "parking outbox row");
                }
                Next::Retry => {
                    // One line per outage, not per row: the broker's state says it.
                    tracing::debug!(event_id = %r.event_id, reason = %error.reason, attempt = r.attempt, "publish failed; will retry");
                    self.health.failed(crate::PUBLISHING, &error.reason);
                }
            }
        }
    }

    /// Fills the report from what the mark changed; remembers the highest row marked (for the
    /// `id-watermark` control) and counts fenced rows.
    fn account_mark(&self, report: &mut CycleReport, mark: &ClaimOutcome, completed: Completed) {
        let Completed {
            marked,
            released,
            fenced,
        } = completed;
        report.published = marked;
        if let Some(max) = mark.published.iter().max() {
            self.watermark.fetch_max(*max, Ordering::Relaxed);
        }
        let parked = mark.failed.iter().filter(|f| f.disposition.parks()).count();
        report.parked = u64::try_from(parked).unwrap_or(u64::MAX);
        report.retried = released.saturating_sub(report.parked);
        report.fenced = fenced;
        if fenced > 0 {
            self.metrics.lease_lost.inc_by(fenced);
            tracing::warn!(relay = %self.config.relay_id, fenced, "lease lost: another relay took these rows over");
        }
    }

    /// Counts the rows marked published, once the mark committed for the whole claim (fenced
    /// rows belong to the relay that took the lease over, which counts them). Returns how many
    /// of them were republishes.
    fn account_published(
        &self,
        records: &[OutboxRecord],
        topics: &[String],
        outcomes: &[RowOutcome],
        reported_at: DateTime<Utc>,
    ) -> u64 {
        let mut republished = 0;
        for ((r, topic), o) in records.iter().zip(topics).zip(outcomes) {
            if *o != RowOutcome::Published {
                continue;
            }
            let again = r.attempt > 1;
            self.metrics
                .count_published(&labels(r, topic), reported_at - r.created_at, again);
            republished += u64::from(again);
        }
        republished
    }
}
