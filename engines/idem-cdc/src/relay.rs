//! The CDC relay: one replication session at a time on the slot; committed transactions are
//! decoded in commit order, grouped into batches of whole transactions, published, and the
//! batch's last `end_lsn` is confirmed only once every message of it (and so of every earlier
//! transaction) has a successful delivery report or was refused for good (parked or
//! dead-lettered). A crash anywhere before the confirmation makes the next session resend from
//! the slot's confirmed position: duplicates, which the consumer's inbox absorbs; never a gap.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idem_core::TableNames;
use idem_core::backoff::Backoff;
use idem_core::health::Health;
use idem_core::publish::{FailureKind, Message, Publisher};
use idem_core::wire::TopicNaming;
use pgwire_replication::{Lsn, ReplicationClient, ReplicationEvent};
use sqlx::PgPool;
use tokio::time::Instant;

use crate::ack::{AckTracker, TxnId};
use crate::batch::{Batch, Refusal, reported};
use crate::changes::Assembler;
use crate::error::CdcError;
use crate::metrics::CdcMetrics;
use crate::session::replication_config;
use crate::slot::{self, Name, Publishes, SlotState};
use idem_relay::unwritable::Unwritable;

/// What the relay reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Inserts into the outbox table (its schema and prefix).
    Table(TableNames),
    /// Transactional `pg_logical_emit_message` messages with this prefix (no table).
    Messages {
        /// The prefix the writers emit with.
        prefix: String,
    },
}

/// The CDC relay's settings.
#[derive(Clone, Debug)]
pub struct CdcConfig {
    /// The logical replication slot, created on a first start. Once made, the publication's
    /// comment records it, and a relay that finds it missing stops with
    /// [`CdcError::SlotMissing`] instead of making a new one.
    pub slot: Name,
    /// The publication the slot reads (created when missing).
    pub publication: Name,
    /// Table or message mode.
    pub mode: Mode,
    /// Topic names, as for the polling relay.
    pub topics: TopicNaming,
    /// CloudEvents `ce_source` (default `/idem/<aggregate type>`).
    pub source: Option<String>,
    /// Messages per publish call; a batch holds whole transactions, so it can hold more.
    pub batch_size: usize,
    /// The longest a committed transaction waits for others before its batch is published.
    pub linger: Duration,
    /// First wait after a failed publish; doubles up to `retry_backoff_max`.
    pub retry_backoff: Duration,
    /// Longest wait between publish attempts.
    pub retry_backoff_max: Duration,
    /// How long messages to a topic may fail without a success before the relay asks the
    /// cluster about the topic; when it answers that the topic does not exist or may not be
    /// written, its rows are parked (table mode) or its records dead-lettered whole (message
    /// mode), and the others flow ([`idem_relay::unwritable`]).
    pub unwritable_topic_grace: Duration,
    /// Where events that cannot be published are dead-lettered (message mode, and rows whose
    /// id cannot be read).
    pub dead_letter_topic: String,
    /// How often a relay waiting for the slot checks whether its reader is gone, and how often
    /// the slot's state is read for the metrics.
    pub poll: Duration,
    /// Table mode: delete the published rows instead of marking them `published` (the table
    /// keeps what is pending or parked; nothing to prune).
    pub delete_published: bool,
    /// Make the slot even where its publication records that it existed (after a failover or
    /// a drop: [`CdcError::SlotMissing`] says what the new slot cannot bring back). Once per
    /// process: a slot that goes missing again stops the relay.
    pub create_slot: bool,
}

impl CdcConfig {
    /// The backoff between publish attempts: `retry_backoff`, doubling, at most
    /// `retry_backoff_max`.
    pub fn backoff(&self) -> Backoff {
        Backoff::new(self.retry_backoff, self.retry_backoff_max)
    }
}

/// The slot a relay reads unless told otherwise.
pub const DEFAULT_SLOT: &str = "idem_cdc";
/// The publication of table mode unless told otherwise.
pub const DEFAULT_TABLE_PUBLICATION: &str = "idem_outbox_pub";
/// The publication of message mode unless told otherwise.
pub const DEFAULT_MESSAGES_PUBLICATION: &str = "idem_messages_pub";
/// The topic events that cannot be published are dead-lettered to unless told otherwise.
pub const DEFAULT_DEAD_LETTER_TOPIC: &str = "idem.cdc.dead_letters";

impl Default for CdcConfig {
    /// Table mode over the default tables, slot [`DEFAULT_SLOT`], publication
    /// [`DEFAULT_TABLE_PUBLICATION`].
    fn default() -> Self {
        CdcConfig::new(
            Name::known(DEFAULT_SLOT),
            Name::known(DEFAULT_TABLE_PUBLICATION),
            Mode::Table(TableNames::default()),
        )
    }
}

impl CdcConfig {
    /// Defaults for `slot` and `publication` in `mode`.
    pub fn new(slot: Name, publication: Name, mode: Mode) -> Self {
        CdcConfig {
            slot,
            publication,
            mode,
            topics: TopicNaming::default(),
            source: None,
            batch_size: 500,
            linger: Duration::from_millis(2),
            retry_backoff: Duration::from_millis(200),
            retry_backoff_max: Duration::from_secs(10),
            unwritable_topic_grace: Duration::from_secs(60),
            dead_letter_topic: DEFAULT_DEAD_LETTER_TOPIC.to_owned(),
            poll: Duration::from_secs(1),
            delete_published: false,
            create_slot: false,
        }
    }
}

/// How a session ended without an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ended {
    /// Shutdown was asked for.
    Shutdown,
}

/// The CDC relay over `publisher`.
pub struct CdcRelay<P> {
    url: String,
    pool: PgPool,
    publisher: Arc<Unwritable<P>>,
    config: CdcConfig,
    metrics: CdcMetrics,
    health: Health,
    /// Set once this process has made or read the slot: from then on a missing slot is lost,
    /// whatever the publication's comment says (a role that may not comment on it).
    slot_seen: AtomicBool,
    /// Set once `--create-slot` made a slot: it makes one at most.
    create_used: AtomicBool,
    /// Set once a failure to record the slot was logged (a standby tries at every poll).
    record_warned: AtomicBool,
    /// The relay id of this relay's drains: one for all its sessions, so that a session ends
    /// the leases its predecessor's drain left (drain.rs).
    drain_id: String,
}

impl<P> std::fmt::Debug for CdcRelay<P> {
    /// Not the URL: it may hold a password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CdcRelay")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// The dependency names the CDC relay reports (`CdcRelay::health`): its database (the
/// control plane's pool), its slot (a replication session streaming from it; a standby waiting
/// for another reader is not ready) and its publishing (a batch delivered, or not). Whether the
/// broker answers while nothing is sent is the command's to watch.
pub(crate) const DATABASE: &str = "database";
/// The health name of the relay's slot: not ready while no replication session streams from
/// it (a standby waiting for another reader, a slot lost or missing); see [`CdcRelay::health`].
pub const SLOT: &str = "slot";
/// See [`DATABASE`].
pub(crate) const PUBLISHING: &str = "publishing";

/// Builds a [`CdcRelay`]: [`CdcConfig::default`] unless [`CdcRelayBuilder::config`] says
/// otherwise, and metrics registered only when a registry is given
/// ([`CdcRelayBuilder::registry`]).
pub struct CdcRelayBuilder<P> {
    url: String,
    pool: PgPool,
    publisher: P,
    config: CdcConfig,
    registry: Option<prometheus::Registry>,
    metrics: Option<CdcMetrics>,
    health: Option<Health>,
}

impl<P> std::fmt::Debug for CdcRelayBuilder<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CdcRelayBuilder")
            .field("config", &self.config)
            .field("registry", &self.registry.is_some())
            .finish_non_exhaustive()
    }
}

impl<P: Publisher> CdcRelayBuilder<P> {
    /// The settings.
    pub fn config(mut self, config: CdcConfig) -> Self {
        self.config = config;
        self
    }

    /// Creates the relay's metrics and registers them in `registry` (at
    /// [`CdcRelayBuilder::build`]).
    pub fn registry(mut self, registry: &prometheus::Registry) -> Self {
        self.registry = Some(registry.clone());
        self
    }

    /// Counts into `metrics`, created (and registered) by the caller; wins over
    /// [`CdcRelayBuilder::registry`].
    pub fn metrics(mut self, metrics: CdcMetrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Reports the relay's dependencies into `health` ([`CdcRelay::health`]).
    pub fn health(mut self, health: Health) -> Self {
        self.health = Some(health);
        self
    }

    /// The relay. Without a registry or metrics it counts into metrics nothing exports.
    /// Fails when the registry holds the relay's metric names already.
    pub fn build(self) -> Result<CdcRelay<P>, CdcError> {
        let metrics = match (self.metrics, &self.registry) {
            (Some(m), _) => Ok(m),
            (None, Some(registry)) => CdcMetrics::new(registry),
            (None, None) => CdcMetrics::unregistered(),
        }?;
        let relay = CdcRelay::new(&self.url, self.pool, self.publisher, self.config, metrics);
        Ok(match self.health {
            Some(h) => relay.health(h),
            None => relay,
        })
    }
}

impl<P: Publisher> CdcRelay<P> {
    /// A builder of a relay reading the database at `url` (`pool`: an ordinary connection to
    /// the same database, for the control plane) and publishing with `publisher`.
    pub fn builder(url: &str, pool: PgPool, publisher: P) -> CdcRelayBuilder<P> {
        CdcRelayBuilder {
            url: url.to_owned(),
            pool,
            publisher,
            config: CdcConfig::default(),
            registry: None,
            metrics: None,
            health: None,
        }
    }

    /// A relay reading the database at `url` (`pool`: an ordinary connection to the same
    /// database, for the control plane).
    pub fn new(
        url: &str,
        pool: PgPool,
        publisher: P,
        config: CdcConfig,
        metrics: CdcMetrics,
    ) -> Self {
        CdcRelay {
            url: url.to_owned(),
            pool,
            publisher: Arc::new(Unwritable::new(
                publisher,
                Some(config.unwritable_topic_grace),
            )),
            config,
            metrics,
            health: Health::new(),
            slot_seen: AtomicBool::new(false),
            create_used: AtomicBool::new(false),
            record_warned: AtomicBool::new(false),
            drain_id: format!("cdc-drain-{}", idem_relay::default_relay_id()),
        }
    }

    /// Reports the database's, the slot's and the publishing's state into `health`, read by
    /// `/readyz`; their outages are logged there, once and then at a bounded rate.
    pub fn health(mut self, health: Health) -> Self {
        for name in [DATABASE, SLOT] {
            health.expect(name);
        }
        self.health = health;
        self
    }

    /// Creates the publication and the slot when they are missing; the slot's state.
    pub async fn prepare(&self) -> Result<SlotState, CdcError> {
        idem_core::event::validate_topic(&self.config.dead_letter_topic)
            .map_err(|e| CdcError::Config(format!("the dead-letter topic: {e}")))?;
        let schema = self.schema().await?;
        let publishes = match &self.config.mode {
            Mode::Table(t) => Publishes::Table {
                schema,
                name: t.bare("outbox"),
                qualified: t.qualified("outbox"),
            },
            Mode::Messages { prefix } => {
                idem_core::envelope::Prefix::new(prefix)
                    .map_err(|e| CdcError::Config(e.to_string()))?;
                Publishes::Nothing
            }
        };
        let publication = &self.config.publication;
        slot::ensure_publication(&self.pool, publication, &publishes).await?;
        let comment = slot::publication_comment(&self.pool, publication).await?;
        let recorded = slot::records_slot(comment.as_deref(), &self.config.slot);
        let state = match slot::slot_state(&self.pool, &self.config.slot).await? {
            Some(state) => slot::usable(state)?,
            None => self.create_slot(recorded).await?,
        };
        self.slot_seen.store(true, Ordering::Relaxed);
        if !recorded {
            self.record_slot(comment.as_deref()).await;
        }
        Ok(state)
    }

    /// Makes the missing slot: on a first start, or once with `--create-slot`. A slot this
    /// process read before, or that its publication records, is lost instead: the events
    /// committed after its confirmed position are in no stream, and a new slot would skip them
    /// in silence.
    async fn create_slot(&self, recorded: bool) -> Result<SlotState, CdcError> {
        let existed = recorded || self.slot_seen.load(Ordering::Relaxed);
        let allowed = self.config.create_slot && !self.create_used.swap(true, Ordering::Relaxed);
        if existed && !allowed {
            return Err(self.slot_missing());
        }
        let state = slot::create_slot(&self.pool, &self.config.slot).await?;
        self.metrics.slots_created.inc();
        self.metrics.slot_lost.set(0);
        if existed {
            tracing::warn!(slot = %self.config.slot, lsn = ?state.confirmed_flush_lsn, "made replication slot again (`create_slot`): it streams what commits from now on");
        } else {
            tracing::info!(slot = %self.config.slot, lsn = ?state.confirmed_flush_lsn, "made replication slot");
        }
        Ok(state)
    }

    /// The error of a slot that existed and is gone; sets `idem_cdc_slot_lost`.
    fn slot_missing(&self) -> CdcError {
        self.metrics.slot_lost.set(1);
        CdcError::SlotMissing {
            slot: self.config.slot.to_string(),
            publication: self.config.publication.to_string(),
            consequence: match self.config.mode {
                Mode::Table(_) => {
                    "Table mode loses nothing: the new slot's first session publishes every row \
                     still pending in the table (its drain)."
                }
                Mode::Messages { .. } => {
                    "Message mode: the events committed after the old slot's last confirmed \
                     position are in no stream and will not be published (there is no table \
                     to publish them from)."
                }
            },
        }
    }

    /// Records the slot on its publication; a role that may not comment on the publication
    /// (not its owner) is told once what it loses: a slot missing at a later start then looks
    /// like a first start.
    async fn record_slot(&self, comment: Option<&str>) {
        let (publication, slot) = (&self.config.publication, &self.config.slot);
        if let Err(e) = slot::record_slot(&self.pool, publication, slot, comment).await
            && !self.record_warned.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(error = %e, %publication, %slot, "could not record the slot on its publication: a slot dropped or lost in a failover while no relay runs would be made again at the next start without an error; make the relay's role the publication's owner");
        }
    }

    /// Message mode: whether `PUBLIC` may execute `pg_logical_emit_message` (then any role
    /// that can connect can write events the relay publishes); sets
    /// `idem_cdc_emit_open_to_public` and warns when it can. `None` when it could not be read
    /// (logged; the relay runs on). [`CdcRelay::run`] checks once at its start.
    pub async fn check_emit_privilege(&self) -> Option<bool> {
        let open = match sqlx::query_scalar::<_, bool>(include_str!(
            "../sql/emit_open_to_public.sql"
        ))
        .fetch_one(&self.pool)
        .await
        {
            Ok(open) => open,
            Err(e) => {
                tracing::warn!(error = %e, "reading who may execute pg_logical_emit_message failed");
                return None;
            }
        };
        self.metrics.emit_open_to_public.set(i64::from(open));
        if open {
            tracing::warn!(
                grant = idem_core::envelope::EMIT_GRANT,
                "PUBLIC may execute pg_logical_emit_message: ANY role that can connect can write \
                 outbox events this relay publishes. Run `idem migrate` as a superuser (migration \
                 13 revokes it), or as a superuser: REVOKE EXECUTE ON FUNCTION \
                 pg_logical_emit_message(boolean, text, text) FROM PUBLIC (and the bytea \
                 overload), then grant it to the writing role only"
            );
        }
        Some(open)
    }

    /// The outbox table's schema: the configured one, else the connection's current schema.
    async fn schema(&self) -> Result<String, CdcError> {
        if let Mode::Table(t) = &self.config.mode
            && let Some(s) = t.schema()
        {
            return Ok(s.to_owned());
        }
        sqlx::query_scalar("SELECT current_schema()")
            .fetch_one(&self.pool)
            .await
            .map_err(|e| CdcError::db("reading the current schema", e))
    }

    /// Relays until `shutdown` completes. One reader per slot: while another session reads
    /// it, this relay waits and takes over once that reader is gone. A failed session (or a
    /// failure to read the slot before one, as while the server is down) is replaced by a new
    /// one from the slot's confirmed position; a lost slot or a configuration the server
    /// refuses stops the relay.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) -> Result<(), CdcError> {
        tokio::pin!(shutdown);
        if matches!(self.config.mode, Mode::Messages { .. }) {
            self.check_emit_privilege().await;
        }
        let mut backoff = self.config.retry_backoff;
        loop {
            // The server may be down between sessions too (a crash, a restart): reading the
            // slot then fails like a session does, and is tried again the same way.
            let ended = match self.wait_for_slot(&mut shutdown).await {
                Ok(false) => return Ok(()),
                Ok(true) => self.session(&mut shutdown).await,
                Err(e) => Err(e),
            };
            match ended {
                Ok(Ended::Shutdown) => return Ok(()),
                Err(
                    e @ (CdcError::SlotLost { .. }
                    | CdcError::SlotMissing { .. }
                    | CdcError::Config(_)
                    | CdcError::NotMigrated { .. }
                    | CdcError::DeadLetterRefused { .. }),
                ) => return Err(e),
                Err(e) => {
                    self.metrics.sessions_failed.inc();
                    // Logged by the health: once per outage, then at a bounded rate.
                    self.health.failed(
                        SLOT,
                        &format_args!(
                            "{e}; a new session starts from the slot's confirmed position"
                        ),
                    );
                }
            }
            tokio::select! {
                () = &mut shutdown => return Ok(()),
                () = tokio::time::sleep(backoff) => {}
            }
            backoff = self.config.backoff().next(backoff);
        }
    }

    /// Waits until no other session reads the slot; `false` when shutdown came first.
    async fn wait_for_slot(
        &self,
        shutdown: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
    ) -> Result<bool, CdcError> {
        let mut said = false;
        loop {
            let state = match self.prepare().await {
                Ok(state) => state,
                Err(e) => {
                    self.health.failed(DATABASE, &e);
                    return Err(e);
                }
            };
            self.health.ok(DATABASE);
            self.metrics.observe(&state);
            self.metrics.standby.set(i64::from(state.active));
            if !state.active {
                return Ok(true);
            }
            if !said {
                tracing::info!(slot = %self.config.slot, pid = ?state.active_pid, "another session reads the slot; waiting to take over");
                said = true;
            }
            self.health.failed(
                SLOT,
                &"another session reads the slot (this relay is a standby)",
            );
            tokio::select! {
                () = &mut *shutdown => return Ok(false),
                () = tokio::time::sleep(self.config.poll) => {}
            }
        }
    }

    /// One replication session, until shutdown or an error.
    async fn session(
        &self,
        shutdown: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
    ) -> Result<Ended, CdcError> {
        let cfg = replication_config(&self.url, &self.config.slot, &self.config.publication)?;
        let mut client = ReplicationClient::connect(cfg).await?;
        client.wait_started().await?;
        // The slot is held by this session, so its confirmed position stays where the stream
        // resumes from until this session confirms more.
        let confirmed = slot::slot_state(&self.pool, &self.config.slot)
            .await?
            .and_then(|s| s.confirmed_flush_lsn);
        let start = confirmed
            .as_deref()
            .and_then(crate::changes::parse_lsn)
            .unwrap_or(0);
        let mut acks = Acks {
            tracker: AckTracker::new(start),
            batch: Vec::new(),
            marking: None,
        };
        // What the stream will never carry goes out first.
        if let Mode::Table(t) = &self.config.mode {
            let publisher = self.publisher.clone();
            let from = confirmed.as_deref();
            let id = &self.drain_id;
            let n = crate::drain::drain(&self.pool, t, publisher, &self.config, id, from).await?;
            if n > 0 {
                tracing::info!(
                    rows = n,
                    "published the rows pending in the table before streaming"
                );
                self.metrics.drained.inc_by(n);
            }
        }
        tracing::info!(slot = %self.config.slot, "CDC session started");
        self.health.ok(SLOT);
        let mut assembler = Assembler::new(self.config.mode.clone(), &self.schema().await?);
        let mut batch = Batch::default();
        let mut deadline: Option<Instant> = None;
        let mut next_status = Instant::now() + self.config.poll;
        // The batch ends with a part of the open transaction: published at once.
        let mut part = false;
        loop {
            // A mark that failed for good ends the session now, not at the next batch's mark.
            if acks
                .marking
                .as_ref()
                .is_some_and(tokio::task::JoinHandle::is_finished)
            {
                acks.marks_done().await?;
            }
            let full = batch.is_full(self.config.batch_size);
            let due = full || deadline.is_some_and(|d| d <= Instant::now());
            if part || (!batch.is_empty() && due) {
                let ready = std::mem::take(&mut batch);
                (deadline, part) = (None, false);
                if !self.publish(ready, &mut acks, &client, shutdown).await? {
                    stopping_marks_done(&mut acks).await;
                    crate::session::stop(&mut client).await;
                    return Ok(Ended::Shutdown);
                }
                continue;
            }
            tokio::select! {
                biased;
                () = &mut *shutdown => {
                    stopping_marks_done(&mut acks).await;
                    crate::session::stop(&mut client).await;
                    return Ok(Ended::Shutdown);
                }
                ev = client.recv() => {
                    let Some(ev) = ev? else {
                        return Err(CdcError::SessionEnded(
                            "the server ended the replication stream".to_owned(),
                        ));
                    };
                    self.event(ev, &mut assembler, &mut batch, &mut acks, &client)?;
                    if assembler.part_due(self.config.batch_size) {
                        // A transaction larger than a batch: what came of it so far goes out
                        // now (after the batch before it), so no transaction, however large, is
                        // held in memory. Nothing of it is confirmed before its Commit.
                        self.metrics.parts.inc();
                        let items = assembler.take_part();
                        batch.push_part(items, &self.config.topics, self.config.source.as_deref());
                        part = true;
                    } else if !batch.is_empty() && deadline.is_none() {
                        deadline = Some(Instant::now() + self.config.linger);
                    }
                }
                () = sleep_until(deadline) => {}
                () = tokio::time::sleep_until(next_status) => {
                    next_status = Instant::now() + self.config.poll;
                    self.status().await?;
                }
            }
        }
    }

    /// Feeds one replication event to the assembler; a committed transaction joins the batch.
    fn event(
        &self,
        ev: ReplicationEvent,
        assembler: &mut Assembler,
        batch: &mut Batch,
        acks: &mut Acks,
        client: &ReplicationClient,
    ) -> Result<(), CdcError> {
        tracing::trace!(event = ?ev, "replication event");
        match ev {
            ReplicationEvent::Begin {
                final_lsn,
                commit_time_micros,
                ..
            } => {
                assembler.begin(final_lsn.as_u64(), commit_time_micros)?;
                acks.tracker.begin().map_err(ack_error)?;
            }
            ReplicationEvent::XLogData {
                data, wal_start, ..
            } => {
                if assembler.data(&data, wal_start.as_u64())? {
                    self.metrics.ignored_changes.inc();
                }
            }
            ReplicationEvent::Message {
                transactional,
                lsn,
                prefix,
                content,
            } => {
                if let Some(alone) =
                    assembler.message(transactional, lsn.as_u64(), &prefix, &content)
                {
                    batch.push(alone, &self.config.topics, self.config.source.as_deref());
                }
            }
            ReplicationEvent::Commit { end_lsn, .. } => {
                let txn = assembler.commit(end_lsn.as_u64())?;
                // Every item counts, refusals too: each is reported once it is published or
                // its park or dead letter is durable.
                let items = u64::try_from(txn.items.len()).unwrap_or(u64::MAX);
                let id = acks
                    .tracker
                    .commit(end_lsn.as_u64(), items)
                    .map_err(ack_error)?;
                acks.batch.push((id, items));
                self.metrics.transactions.inc();
                batch.push(txn, &self.config.topics, self.config.source.as_deref());
            }
            ReplicationEvent::KeepAlive { wal_end, .. } => {
                // With nothing open or unacknowledged, every transaction committed before the
                // server's sent position was streamed before this keepalive and is confirmed.
                // Not while the batch holds anything: a non-transactional message's dead
                // letter is in no transaction the tracker waits for.
                if batch.is_empty() && acks.tracker.keepalive(wal_end.as_u64()) {
                    let confirmable = acks.tracker.confirmable();
                    client.update_applied_lsn(Lsn::from_u64(confirmable));
                    self.metrics.confirmed_lsn.set(lsn_gauge(confirmable));
                }
            }
            ReplicationEvent::StoppedAt { .. } => {}
        }
        Ok(())
    }

    /// Publishes a batch until every message has a successful report or was refused for good,
    /// refuses what must be, then confirms the batch's last position. `false`: shutdown came
    /// first (nothing confirmed; the next session sends the batch again).
    async fn publish(
        &self,
        mut batch: Batch,
        acks: &mut Acks,
        client: &ReplicationClient,
        shutdown: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
    ) -> Result<bool, CdcError> {
        let mut pending: Vec<usize> = (0..batch.messages.len()).collect();
        let mut backoff = self.config.retry_backoff;
        // Messages the broker refused for good (the batch's refusals also hold what was never
        // a message: those are not subtracted from what was published).
        let mut refused_by_broker = 0;
        while !pending.is_empty() {
            // The first attempt sends the batch as it is (`pending` is every index, in order);
            // a retry copies what it sends again.
            let results = if pending.len() == batch.messages.len() {
                self.publisher.publish(&batch.messages).await
            } else {
                let send: Vec<Message> = pending
                    .iter()
                    .filter_map(|&i| batch.messages.get(i).cloned())
                    .collect();
                self.publisher.publish(&send).await
            };
            let r = reported(&batch.messages, &pending, &results);
            refused_by_broker += r.refused.len();
            for (i, error) in r.refused {
                let row_id = batch.rows.get(i).copied().flatten();
                let refusal = match batch.messages.get(i) {
                    Some(m) if error.kind == FailureKind::Unwritable => {
                        Refusal::of_topic(row_id, m.clone(), error.reason)
                    }
                    m => {
                        let content = m.map(|m| m.payload.clone()).unwrap_or_default();
                        Refusal::new(row_id, None, content, error.reason)
                    }
                };
                batch.refused.push(refusal);
            }
            if r.again.is_empty() {
                self.health.ok(PUBLISHING);
                break;
            }
            self.health.failed(
                PUBLISHING,
                &format_args!(
                    "{} of {} messages not delivered; retrying",
                    r.again.len(),
                    pending.len()
                ),
            );
            self.metrics.publish_retries.inc();
            pending = r.again;
            tokio::select! {
                () = &mut *shutdown => return Ok(false),
                () = tokio::time::sleep(backoff) => {}
            }
            backoff = self.config.backoff().next(backoff);
        }
        idem_core::crash::crash_point(idem_core::crash::CrashPoint::CdcAfterPublishBeforeConfirm)?;
        if !self.refuse(&batch.refused, shutdown).await? {
            return Ok(false);
        }
        self.mark(&batch, acks).await?;
        let published = batch.messages.len().saturating_sub(refused_by_broker);
        self.metrics
            .events
            .inc_by(u64::try_from(published).unwrap_or(u64::MAX));
        for (id, items) in acks.batch.drain(..) {
            for _ in 0..items {
                acks.tracker.delivered(id).map_err(ack_error)?;
            }
        }
        let confirmable = acks.tracker.confirmable();
        client.update_applied_lsn(Lsn::from_u64(confirmable));
        self.metrics.confirmed_lsn.set(lsn_gauge(confirmable));
        Ok(true)
    }

    /// Parks refused rows (table mode) and dead-letters the rest, before the confirmation.
    /// `false`: shutdown came first (nothing confirmed; the next session refuses them again).
    async fn refuse(
        &self,
        refused: &[Refusal],
        shutdown: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
    ) -> Result<bool, CdcError> {
        let mut letters = Vec::new();
        for r in refused {
            match (&self.config.mode, r.row_id) {
                (Mode::Table(t), Some(id)) => {
                    crate::changes::park(&self.pool, t, id, &r.reason).await?;
                    self.metrics.refused.with_label_values(&["parked"]).inc();
                    tracing::error!(outbox_id = id, reason = %r.reason, "parked an outbox row");
                }
                _ => letters.push(crate::changes::dead_letter(
                    &self.config.dead_letter_topic,
                    r,
                )),
            }
        }
        let mut backoff = self.config.retry_backoff;
        while !letters.is_empty() {
            letters = self.dead_letter(letters).await?;
            if letters.is_empty() {
                break;
            }
            tokio::select! {
                () = &mut *shutdown => return Ok(false),
                () = tokio::time::sleep(backoff) => {}
            }
            backoff = self.config.backoff().next(backoff);
        }
        Ok(true)
    }

    /// Publishes dead letters; returns those to send again (a transient failure). One that the
    /// broker refuses for good stops the relay: nothing past it is confirmed, and no other place
    /// keeps the refused event (a dead letter is an excerpt far below Kafka's record limit, so
    /// this is the topic: its name, its ACLs, its `max.message.bytes`).
    async fn dead_letter(&self, letters: Vec<Message>) -> Result<Vec<Message>, CdcError> {
        let results = self.publisher.publish(&letters).await;
        let mut left = Vec::new();
        let reports = results.into_iter().chain(std::iter::repeat_with(|| Ok(())));
        for (m, res) in letters.into_iter().zip(reports) {
            match res {
                Ok(()) => {
                    self.metrics
                        .refused
                        .with_label_values(&["dead_lettered"])
                        .inc();
                    tracing::error!(
                        topic = %m.topic,
                        reason = m.header(crate::changes::DEAD_LETTER_REASON).unwrap_or(""),
                        "dead-lettered an event"
                    );
                }
                Err(e) if e.kind.is_permanent() => {
                    return Err(CdcError::DeadLetterRefused {
                        topic: self.config.dead_letter_topic.clone(),
                        reason: e.reason,
                    });
                }
                Err(e) => {
                    tracing::warn!(reason = %e.reason, "dead-lettering a refused CDC event failed; retrying");
                    left.push(m);
                }
            }
        }
        Ok(left)
    }

    /// Table mode: marks (or deletes) the published rows, in the background while the next
    /// batch is produced; one mark at a time, so a slow one holds the next batch's. A mark that
    /// fails is made again ([`mark_until_it_lands`]); one that still fails ends the session, so
    /// the next session's drain publishes its rows again now, not at a restart that may come
    /// weeks later, beyond the inbox's horizon. The relay never reads the marks back; a mark
    /// that has not committed when the relay dies leaves its rows pending, and the next
    /// session's drain publishes them again (copies the inbox absorbs:
    /// docs/concepts/duplicate-windows.md).
    async fn mark(&self, batch: &Batch, acks: &mut Acks) -> Result<(), CdcError> {
        let Mode::Table(t) = &self.config.mode else {
            return Ok(());
        };
        let parked: std::collections::HashSet<i64> =
            batch.refused.iter().filter_map(|r| r.row_id).collect();
        let ids: Vec<i64> = batch
            .rows
            .iter()
            .flatten()
            .copied()
            .filter(|id| !parked.contains(id))
            .collect();
        acks.marks_done().await?;
        if ids.is_empty() {
            return Ok(());
        }
        let (pool, tables, metrics) = (self.pool.clone(), t.clone(), self.metrics.clone());
        let delete = self.config.delete_published;
        acks.marking = Some(tokio::spawn(async move {
            mark_until_it_lands(&pool, &tables, &ids, delete, &metrics).await
        }));
        Ok(())
    }

    /// Reads the slot's state into the metrics; a lost slot is an error.
    async fn status(&self) -> Result<(), CdcError> {
        match slot::slot_state(&self.pool, &self.config.slot).await {
            Ok(Some(state)) => {
                self.metrics.observe(&state);
                if state.is_lost() {
                    return Err(CdcError::SlotLost {
                        slot: state.slot,
                        confirmed: state.confirmed_flush_lsn,
                    });
                }
            }
            Ok(None) => return Err(self.slot_missing()),
            Err(e) => tracing::warn!(error = %e, "reading the slot's state failed"),
        }
        Ok(())
    }
}

/// The acknowledgement rule of one session, and the transactions of the batch being built or
/// published with their item counts.
struct Acks {
    tracker: AckTracker,
    batch: Vec<(TxnId, u64)>,
    /// Table mode: the mark of the last batch, still running (one at a time).
    marking: Option<tokio::task::JoinHandle<Result<(), CdcError>>>,
}

impl Acks {
    /// Waits for the mark still running: a graceful stop leaves every published row marked,
    /// so the next session drains none of them again. Its error is the mark's, after its
    /// attempts ran out.
    async fn marks_done(&mut self) -> Result<(), CdcError> {
        match self.marking.take() {
            None => Ok(()),
            Some(m) => m.await.map_err(|e| {
                CdcError::SessionEnded(format!("the task marking published rows stopped: {e}"))
            })?,
        }
    }
}

/// On a stop: waits for the last mark, whose failure leaves its rows to the next session's
/// drain (the process is stopping, so that session follows its restart).
async fn stopping_marks_done(acks: &mut Acks) {
    if let Err(e) = acks.marks_done().await {
        tracing::warn!(error = %e, "stopping with published rows unmarked: the next session publishes them again");
    }
}

/// How often a failed mark is made again, and how long the first wait is (doubling): about
/// 8 s in all, a lock held a moment or a connection the pool lost.
const MARK_ATTEMPTS: u32 = 6;
const MARK_BACKOFF: Duration = Duration::from_millis(250);

/// Marks (or deletes) `ids`, again after a failure, up to [`MARK_ATTEMPTS`] times; every
/// failure counts in `idem_cdc_mark_failures_total`. The last failure is returned: the session
/// ends on it and the next one drains the rows.
async fn mark_until_it_lands(
    pool: &PgPool,
    tables: &TableNames,
    ids: &[i64],
    delete: bool,
    metrics: &CdcMetrics,
) -> Result<(), CdcError> {
    let mut wait = MARK_BACKOFF;
    let mut attempt = 1;
    loop {
        match crate::changes::mark_published(pool, tables, ids, delete).await {
            Ok(()) => return Ok(()),
            Err(e) => {
                metrics.mark_failures.inc();
                if attempt >= MARK_ATTEMPTS {
                    tracing::warn!(error = %e, rows = ids.len(), attempts = attempt, "marking published rows failed every time; ending the session so that the next one publishes them again now");
                    return Err(e);
                }
                tracing::warn!(error = %e, rows = ids.len(), attempt, "marking published rows failed; trying again");
            }
        }
        tokio::time::sleep(wait).await;
        wait *= 2;
        attempt += 1;
    }
}

fn ack_error(e: crate::ack::AckError) -> CdcError {
    CdcError::SessionEnded(e.to_string())
}

/// An LSN as a gauge value (saturating: a gauge is an i64).
fn lsn_gauge(lsn: u64) -> i64 {
    i64::try_from(lsn).unwrap_or(i64::MAX)
}

/// Ready at `t`; never when `None`.
async fn sleep_until(t: Option<Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}
