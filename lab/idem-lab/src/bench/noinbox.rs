//! `idem-lab bench no-inbox-consumer` (hidden): the settlement service exactly as `idem-lab settlement`
//! runs it, except that the inbox records nothing and calls every event new. Only the bench
//! uses it, to price the inbox ("consumer with dedup ÷ without"); it is not effectively-once.

use idem_consumer::{Consumer, ConsumerConfig, ConsumerMetrics};
use idem_core::store::{Dedup, InboxEntry, InboxStore, StoredDeadLetter};
use idem_core::{EventId, Result};
use idem_kafka::KafkaSource;
use idem_sql::postgres::PgInbox;
use sqlx::PgConnection;

use crate::lab_consumer::LabConsumerArgs;

/// [`PgInbox`] without the inbox insert: every event is new.
struct NoInbox(PgInbox);

impl InboxStore for NoInbox {
    type Conn = PgConnection;
    type Tx = sqlx::Transaction<'static, sqlx::Postgres>;

    async fn begin(&self) -> Result<Self::Tx> {
        self.0.begin().await
    }
    async fn commit(&self, tx: Self::Tx) -> Result<()> {
        self.0.commit(tx).await
    }
    async fn rollback(&self, tx: Self::Tx) -> Result<()> {
        self.0.rollback(tx).await
    }
    async fn record(
        &self,
        _conn: &mut PgConnection,
        _group: &str,
        entries: &[InboxEntry<'_>],
    ) -> Result<Vec<Dedup>> {
        Ok(entries.iter().map(|_| Dedup::New).collect())
    }
    async fn record_effects(
        &self,
        conn: &mut PgConnection,
        intents: &[idem_core::idempotency::EffectIntent],
    ) -> Result<Vec<bool>> {
        self.0.record_effects(conn, intents).await
    }
    async fn savepoint(&self, conn: &mut PgConnection) -> Result<()> {
        self.0.savepoint(conn).await
    }
    async fn rollback_to_savepoint(&self, conn: &mut PgConnection) -> Result<()> {
        self.0.rollback_to_savepoint(conn).await
    }
    async fn release_savepoint(&self, conn: &mut PgConnection) -> Result<()> {
        self.0.release_savepoint(conn).await
    }
    async fn check_usable(&self, conn: &mut PgConnection) -> Result<()> {
        self.0.check_usable(conn).await
    }
    async fn mark_dead_lettered(
        &self,
        _conn: &mut PgConnection,
        _group: &str,
        _ids: &[EventId],
    ) -> Result<()> {
        Ok(())
    }
    async fn dead_letter(
        &self,
        conn: &mut PgConnection,
        group: &str,
        letters: &[idem_core::store::DeadLetter],
    ) -> Result<()> {
        self.0.dead_letter(conn, group, letters).await
    }
    async fn dead_letters(&self, group: &str, limit: u32) -> Result<Vec<StoredDeadLetter>> {
        self.0.dead_letters(group, limit).await
    }
    async fn open_dead_letters(
        &self,
        group: &str,
        after: i64,
        only: Option<i64>,
        limit: u32,
    ) -> Result<Vec<idem_core::store::OpenDeadLetter>> {
        self.0.open_dead_letters(group, after, only, limit).await
    }
    async fn find_dead_letter(&self, group: &str, id: i64) -> Result<Option<StoredDeadLetter>> {
        self.0.find_dead_letter(group, id).await
    }
    async fn request_replays(
        &self,
        group: &str,
        only: Option<i64>,
        reason: Option<&str>,
        by: &str,
    ) -> Result<Vec<i64>> {
        self.0.request_replays(group, only, reason, by).await
    }
    async fn requested_replays(
        &self,
        group: &str,
        after: i64,
        limit: u32,
    ) -> Result<Vec<idem_core::store::RequestedReplay>> {
        self.0.requested_replays(group, after, limit).await
    }
    async fn claim_replay(
        &self,
        conn: &mut PgConnection,
        group: &str,
        event: &idem_core::InboundEvent,
    ) -> Result<bool> {
        self.0.claim_replay(conn, group, event).await
    }
    async fn finish_replay(
        &self,
        conn: &mut PgConnection,
        id: i64,
        by: &str,
        outcome: idem_core::store::ReplayOutcome,
        reason: Option<&str>,
    ) -> Result<bool> {
        self.0.finish_replay(conn, id, by, outcome, reason).await
    }
}

/// Runs until SIGTERM.
pub(super) async fn run(args: LabConsumerArgs) -> anyhow::Result<()> {
    let shutdown = idem_cli::util::shutdown_signal()?;
    let pool = idem_sql::postgres::connect(&args.db, 4).await?;
    idem_reference::ensure_schema_postgres(&pool).await?;
    let kafka = args.consumer_config()?;
    let source = KafkaSource::new(&kafka, std::slice::from_ref(&args.topic))?;
    let mut config = ConsumerConfig::new(&args.group);
    config.batch_size = args.batch_size.max(1);
    let metrics = ConsumerMetrics::new(&prometheus::Registry::new())?;
    let inbox = NoInbox(PgInbox::new(pool, idem_core::TableNames::default()));
    Consumer::new(
        inbox,
        idem_reference::Settlement::new(),
        source,
        config,
        metrics,
    )
    .run(shutdown)
    .await?;
    Ok(())
}
