//! Why the CDC relay stopped or refused to start.

/// Errors of the CDC relay. Each message says what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CdcError {
    /// A setting or an existing object (slot, publication) the relay cannot use: the
    /// configuration must change. The relay refuses to start, or stops.
    #[error("{0}")]
    Config(String),
    /// The database's outbox lacks what this build needs: run `idem migrate`.
    #[error(
        "{context}: the outbox has no {missing} column; run `idem migrate` before starting the CDC relay ({source})"
    )]
    NotMigrated {
        /// What the relay was doing.
        context: String,
        /// The column it needs.
        missing: &'static str,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// The relay's metrics could not be registered (a registry that already holds them).
    #[error("registering the CDC relay's metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    /// The dead-letter topic refuses a record for good: the relay stops without confirming the
    /// refused event, so nothing after it is lost.
    #[error(
        "the dead-letter topic {topic:?} refuses a record for good ({reason}): fix the topic \
         (its name, its ACLs, max.message.bytes) or choose another dead-letter topic, then \
         restart; nothing after the refused event was confirmed, so nothing is lost"
    )]
    DeadLetterRefused {
        /// The dead-letter topic.
        topic: String,
        /// The broker's answer.
        reason: String,
    },
    /// The replication session ended before a stop was asked (the server closed the stream, a
    /// background task failed): the relay starts a new session from the slot's confirmed
    /// position.
    #[error("the replication session ended: {0}")]
    SessionEnded(String),
    /// A statement on the control-plane connection failed.
    #[error("{context}: {source}")]
    Database {
        /// What the relay was doing.
        context: String,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// The replication session failed (connection, authentication, server error). The relay
    /// starts a new session from the slot's confirmed position: nothing after it was confirmed.
    #[error("replication session: {0}")]
    Replication(#[from] pgwire_replication::PgWireError),
    /// The slot lost WAL it needed (`max_slot_wal_keep_size`): events committed after its
    /// confirmed position can no longer be streamed. Never skipped silently.
    #[error(
        "replication slot {slot} is lost (wal_status = lost, confirmed up to {confirmed:?}): \
         PostgreSQL removed WAL it needed, so events committed after that position will never \
         be streamed. Table mode: re-publish the rows committed since then with the polling \
         relay (`idem relay`), then drop the slot (`idem cdc drop-slot`) and start again; \
         message mode: those events are gone"
    )]
    SlotLost {
        /// The slot.
        slot: String,
        /// Its last confirmed position.
        confirmed: Option<String>,
    },
    /// The slot is missing although its publication records that it existed: it was dropped,
    /// or this server took over from one that had it. The relay never makes a new slot by
    /// itself then (`CdcConfig::create_slot` does, once).
    #[error(
        "replication slot {slot} is missing, but it existed (publication {publication} records \
         it, or this relay read it): it was dropped, or this server took over from one that had \
         it (a failover: \
         PostgreSQL 15 keeps no logical slot on a standby). {consequence} Start the relay once \
         with `CdcConfig::create_slot` to make a new slot"
    )]
    SlotMissing {
        /// The slot.
        slot: String,
        /// The publication that records it.
        publication: String,
        /// What the new slot cannot bring back, by mode.
        consequence: &'static str,
    },
    /// An idem-core error (an armed crash point in error mode, in tests).
    #[error(transparent)]
    Core(#[from] idem_core::Error),
    /// The stream carried something the relay cannot read (a malformed pgoutput message): the
    /// relay stops without confirming it, so that nothing is skipped.
    #[error("undecodable replication stream{}: {reason}", at(*.lsn))]
    Stream {
        /// Where, when the message carried a position.
        lsn: Option<u64>,
        /// What was wrong.
        reason: String,
    },
}

/// " at 16/B374D848", or nothing when the position is unknown.
fn at(lsn: Option<u64>) -> String {
    lsn.map(|l| format!(" at {}", crate::changes::show_lsn(l)))
        .unwrap_or_default()
}

impl CdcError {
    /// A database error with its context.
    pub fn db(context: impl Into<String>, source: sqlx::Error) -> Self {
        CdcError::Database {
            context: context.into(),
            source,
        }
    }
}
