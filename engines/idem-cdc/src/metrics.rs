//! The CDC relay's Prometheus metrics (docs/operating/cdc-relay.md lists them; they have no
//! alert rules in deploy/prometheus yet).

use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};

use crate::slot::SlotState;

/// The CDC relay's counters and gauges.
#[derive(Clone, Debug)]
pub struct CdcMetrics {
    /// Events published and confirmed.
    pub events: IntCounter,
    /// Committed transactions read from the stream.
    pub transactions: IntCounter,
    /// Events not published, by `how` (`parked`, `dead_lettered`).
    pub refused: IntCounterVec,
    /// Publish calls repeated after a transient failure.
    pub publish_retries: IntCounter,
    /// Updates, deletes and truncates the stream carried (the publication should not).
    pub ignored_changes: IntCounter,
    /// Replication sessions that ended with an error (each replaced by a new one).
    pub sessions_failed: IntCounter,
    /// Failed marks of published rows (table mode; the rows stay pending in the table).
    pub mark_failures: IntCounter,
    /// The last position this relay confirmed.
    pub confirmed_lsn: IntGauge,
    /// WAL bytes between the server's position and the slot's confirmed one.
    pub slot_lag_bytes: IntGauge,
    /// 1 when the slot lost WAL it needed (`wal_status = lost`), or is missing although its
    /// publication records it: page someone.
    pub slot_lost: IntGauge,
    /// Slots this relay created: one on a first start, one more for each `--create-slot`
    /// after a lost or missing slot.
    pub slots_created: IntCounter,
    /// Bytes that can still be written before the slot would lose WAL (-1: unbounded).
    pub slot_safe_wal_bytes: IntGauge,
    /// 1 while this relay waits for another session to stop reading the slot (a standby).
    pub standby: IntGauge,
    /// Message mode: 1 when `PUBLIC` may execute `pg_logical_emit_message`, so any role can
    /// write events (migration 13 revokes it; a non-superuser migration cannot).
    pub emit_open_to_public: IntGauge,
    /// Rows published from the table at a session's start (pending before the slot existed,
    /// retried after a park, or published earlier with a lost mark).
    pub drained: IntCounter,
    /// Parts of transactions larger than a batch published before their Commit arrived.
    pub parts: IntCounter,
}

impl CdcMetrics {
    /// Creates the metrics and registers them into `registry`.
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let m = Self::unregistered()?;
        registry.register(Box::new(m.events.clone()))?;
        registry.register(Box::new(m.transactions.clone()))?;
        registry.register(Box::new(m.refused.clone()))?;
        registry.register(Box::new(m.publish_retries.clone()))?;
        registry.register(Box::new(m.ignored_changes.clone()))?;
        registry.register(Box::new(m.sessions_failed.clone()))?;
        registry.register(Box::new(m.mark_failures.clone()))?;
        registry.register(Box::new(m.confirmed_lsn.clone()))?;
        registry.register(Box::new(m.slot_lag_bytes.clone()))?;
        registry.register(Box::new(m.slot_lost.clone()))?;
        registry.register(Box::new(m.slots_created.clone()))?;
        registry.register(Box::new(m.slot_safe_wal_bytes.clone()))?;
        registry.register(Box::new(m.standby.clone()))?;
        registry.register(Box::new(m.emit_open_to_public.clone()))?;
        registry.register(Box::new(m.drained.clone()))?;
        registry.register(Box::new(m.parts.clone()))?;
        Ok(m)
    }

    /// The metrics, registered nowhere.
    pub fn unregistered() -> prometheus::Result<Self> {
        let c = |name: &str, help: &str| IntCounter::new(name, help);
        let g = |name: &str, help: &str| IntGauge::new(name, help);
        Ok(CdcMetrics {
            events: c(
                "idem_cdc_events_total",
                "Events published and confirmed by the CDC relay",
            )?,
            transactions: c(
                "idem_cdc_transactions_total",
                "Committed transactions read from the replication stream",
            )?,
            refused: IntCounterVec::new(
                Opts::new(
                    "idem_cdc_refused_total",
                    "Events the CDC relay did not publish, by how they were set aside",
                ),
                &["how"],
            )?,
            publish_retries: c(
                "idem_cdc_publish_retries_total",
                "Publish calls repeated after a transient failure",
            )?,
            ignored_changes: c(
                "idem_cdc_ignored_changes_total",
                "Updates, deletes and truncates in the stream (the publication should carry inserts only)",
            )?,
            sessions_failed: c(
                "idem_cdc_sessions_failed_total",
                "Replication sessions that ended with an error",
            )?,
            mark_failures: c(
                "idem_cdc_mark_failures_total",
                "Failed attempts to mark published outbox rows (table mode; each is made again)",
            )?,
            confirmed_lsn: g(
                "idem_cdc_confirmed_lsn",
                "The last WAL position the CDC relay confirmed",
            )?,
            slot_lag_bytes: g(
                "idem_cdc_slot_lag_bytes",
                "WAL bytes between the server's position and the slot's confirmed position",
            )?,
            slot_lost: g(
                "idem_cdc_slot_lost",
                "1 when the slot lost WAL it needed (wal_status = lost), or is missing although its publication records it",
            )?,
            slots_created: c(
                "idem_cdc_slots_created_total",
                "Replication slots the CDC relay created (a first start, or `create_slot` after a lost or missing slot)",
            )?,
            slot_safe_wal_bytes: g(
                "idem_cdc_slot_safe_wal_bytes",
                "Bytes that can be written before the slot loses WAL (-1: unbounded)",
            )?,
            drained: c(
                "idem_cdc_drained_total",
                "Rows published from the outbox table at a session's start, before streaming",
            )?,
            parts: c(
                "idem_cdc_transaction_parts_total",
                "Parts of transactions larger than the batch size published before their commit arrived (each transaction is still confirmed whole)",
            )?,
            standby: g(
                "idem_cdc_standby",
                "1 while this relay waits for another reader of the slot to stop",
            )?,
            emit_open_to_public: g(
                "idem_cdc_emit_open_to_public",
                "1 when every role may execute pg_logical_emit_message and so write message-mode events",
            )?,
        })
    }

    /// Sets the slot gauges from its state.
    pub fn observe(&self, state: &SlotState) {
        self.slot_lag_bytes.set(state.lag_bytes.unwrap_or(0));
        self.slot_lost.set(i64::from(state.is_lost()));
        self.slot_safe_wal_bytes
            .set(state.safe_wal_size.unwrap_or(-1));
    }
}
