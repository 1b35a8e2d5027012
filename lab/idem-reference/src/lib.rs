//! The reference pipeline: an order service that writes a paid order and its `order.paid` event
//! in one transaction, and a settlement service that turns each `order.paid` event into exactly
//! one settlement row (unique per payment) through the idem consumer runtime.
//!
//! ```text
//! orders (order DB) ─outbox─► relay ─► outbox.event.order ─► settlement consumer ─► settlements (settlement DB)
//! ```
//!
//! The `idem-lab orders` and `idem-lab settlement` commands run each side as its own process.

pub mod money;
pub mod points;
mod settle;
mod verify;

pub use verify::verify_config;

use idem_consumer::{BatchContext, BatchError, Handler, HandlerContext, HandlerError, Outcome};
use idem_core::{Event, InboundEvent};
use idem_sql::{Dialect, Scheme, SqlConnection, Statement};

/// The event type the settlement service applies.
pub const ORDER_PAID: &str = "order.paid";
/// The aggregate type of orders (the topic is `outbox.event.order`).
pub const ORDER: &str = "order";

/// The reference tables for PostgreSQL.
pub const POSTGRES_SCHEMA: &str = include_str!("../sql/postgres.sql");
/// The reference tables for SQLite.
pub const SQLITE_SCHEMA: &str = include_str!("../sql/sqlite.sql");

/// The reference tables, as [`POSTGRES_SCHEMA`] and [`SQLITE_SCHEMA`] create them.
pub const TABLES: &[&str] = &[
    "orders",
    "settlements",
    "settlement_applications",
    "points_awards",
    "points_reversals",
    "audit_log",
    "points_lab_overlaps",
];

/// The reference tables the database `pool` reaches does not have (in its search path).
pub async fn missing_tables<DB: Dialect>(
    pool: &sqlx::Pool<DB>,
) -> Result<Vec<&'static str>, sqlx::Error> {
    let mut missing = vec![];
    for table in TABLES {
        let probe = format!("SELECT 1 AS one FROM {table} WHERE 1 = 0");
        let mut conn = pool.acquire().await?;
        match Statement::<DB>::new(&probe)
            .fetch_optional(&mut *conn)
            .await
        {
            Ok(_) => {}
            Err(e) if is_missing_table(&e) => missing.push(*table),
            Err(e) => return Err(e),
        }
    }
    Ok(missing)
}

/// Whether `e` says a table does not exist (SQLSTATE 42P01; SQLite's "no such table").
fn is_missing_table(e: &sqlx::Error) -> bool {
    e.as_database_error().is_some_and(|d| {
        d.code().as_deref() == Some("42P01") || d.message().starts_with("no such table")
    })
}

/// Creates the reference tables if they are missing.
pub async fn ensure_schema_postgres(pool: &sqlx::PgPool) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(POSTGRES_SCHEMA)
        .execute(pool)
        .await
        .map(|_| ())
}

/// Creates the reference tables if they are missing.
pub async fn ensure_schema_sqlite(pool: &sqlx::SqlitePool) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(SQLITE_SCHEMA).execute(pool).await.map(|_| ())
}

/// One paid order, as the order service writes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PaidOrder {
    /// Order id (the aggregate id).
    pub order_id: String,
    /// Payment id (the settlement's unique key).
    pub payment_id: String,
    /// Amount in minor units.
    pub amount_minor: i64,
    /// ISO 4217 currency.
    pub currency: String,
}

impl PaidOrder {
    /// The deterministic order number `n` used by `idem-lab orders` (amounts vary from 1.00 to 99.99).
    pub fn numbered(prefix: &str, n: u64) -> Self {
        PaidOrder {
            order_id: format!("{prefix}order-{n}"),
            payment_id: format!("{prefix}pay-{n}"),
            amount_minor: 100 + i64::try_from(n % 9_900).unwrap_or(0),
            currency: "EUR".to_owned(),
        }
    }

    /// The `order.paid` event: the amount as an exact decimal string.
    pub fn event(&self) -> idem_core::Result<Event> {
        Event::builder(ORDER, &self.order_id, ORDER_PAID)
            .payload(&serde_json::json!({
                "order_id": self.order_id,
                "payment_id": self.payment_id,
                "amount": money::format_minor(self.amount_minor),
                "currency": self.currency,
            }))
            .build()
    }
}

/// Errors of the order service.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OrderError {
    /// The database refused the order.
    #[error("writing order {order_id}")]
    Database {
        /// The order.
        order_id: String,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// The event could not be built or enqueued.
    #[error(transparent)]
    Outbox(#[from] idem_core::Error),
}

impl OrderError {
    /// The database could not be reached or dropped the session (a reset, a partition, a
    /// restart, a terminated backend): the same order may be written again later. Whether this
    /// attempt committed is unknown when the answer to its `COMMIT` was what got lost.
    pub fn is_unreachable(&self) -> bool {
        match self {
            OrderError::Database { source, .. } => match source {
                sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::Protocol(_) => true,
                sqlx::Error::Database(d) => d
                    .code()
                    .is_some_and(|c| c.starts_with("08") || c.starts_with("57P")),
                _ => false,
            },
            OrderError::Outbox(e) => e.is_transient(),
        }
    }

    /// The order row exists already: after an unreachable attempt, that attempt committed (the
    /// order row and its event commit together or not at all).
    pub fn is_already_written(&self) -> bool {
        matches!(self, OrderError::Database { source: sqlx::Error::Database(d), .. }
            if d.is_unique_violation())
    }
}

/// Writes the order row and its `order.paid` event in one PostgreSQL transaction.
pub async fn place_order_postgres(
    pool: &sqlx::PgPool,
    outbox: &idem_sql::postgres::Outbox,
    order: &PaidOrder,
) -> Result<(), OrderError> {
    write_order(
        pool,
        Some(outbox),
        order,
        &order.event()?,
        std::time::Duration::ZERO,
    )
    .await
}

/// [`place_order_postgres`], holding the transaction open for `hold` before committing: a
/// slow writer whose outbox row gets a lower id than rows committed before it (the commit-order
/// skew that an id-watermark relay would skip).
pub async fn place_order_postgres_held(
    pool: &sqlx::PgPool,
    outbox: &idem_sql::postgres::Outbox,
    order: &PaidOrder,
    hold: std::time::Duration,
) -> Result<(), OrderError> {
    write_order(pool, Some(outbox), order, &order.event()?, hold).await
}

/// How a PostgreSQL order writer hands the order's event to the pipeline.
#[derive(Clone, Debug)]
pub enum EventPath {
    /// idem's outbox (`Outbox::enqueue`).
    Outbox(idem_sql::postgres::Outbox),
    /// A plain `INSERT` into the outbox table `table` (quoted and qualified, from validated
    /// table names), naming the contract's five columns as a writer in any language does
    /// (docs/integrating/outbox-contract.md).
    Sql {
        /// The outbox table.
        table: String,
    },
    /// A transactional logical decoding message, for the CDC relay in message mode.
    Messages(idem_sql::postgres::MessageOutbox),
}

/// Writes the order row and its `order.paid` event through `path` in one PostgreSQL
/// transaction, held open for `hold` before committing.
pub async fn place_order_via(
    pool: &sqlx::PgPool,
    path: &EventPath,
    order: &PaidOrder,
    hold: std::time::Duration,
) -> Result<(), OrderError> {
    if let EventPath::Outbox(outbox) = path {
        return write_order(pool, Some(outbox), order, &order.event()?, hold).await;
    }
    let db = |source| OrderError::Database {
        order_id: order.order_id.clone(),
        source,
    };
    let event = order.event()?;
    let mut tx = pool.begin().await.map_err(db)?;
    sqlx::query(
        "INSERT INTO orders (order_id, payment_id, amount_minor, currency) VALUES ($1, $2, $3, $4)",
    )
    .bind(order.order_id.as_str())
    .bind(order.payment_id.as_str())
    .bind(order.amount_minor)
    .bind(order.currency.as_str())
    .execute(&mut *tx)
    .await
    .map_err(db)?;
    match path {
        EventPath::Sql { table } => {
            sqlx::query(&format!(
                "INSERT INTO {table} (event_id, aggregate_type, aggregate_id, event_type, payload) \
                 VALUES ($1, $2, $3, $4, $5::jsonb)"
            ))
            .bind(event.id().as_uuid())
            .bind(event.aggregate_type())
            .bind(event.aggregate_id())
            .bind(event.event_type())
            .bind(event.payload())
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        }
        EventPath::Messages(messages) => messages.enqueue(&mut tx, &event).await?,
        EventPath::Outbox(_) => {}
    }
    if !hold.is_zero() {
        tokio::time::sleep(hold).await;
    }
    tx.commit().await.map_err(db)
}

/// Writes the order row and `event` in one PostgreSQL transaction; with no `outbox`, the order
/// row alone (what the service would cost without the outbox: `idem-lab bench` compares the two).
pub async fn write_order_postgres(
    pool: &sqlx::PgPool,
    outbox: Option<&idem_sql::postgres::Outbox>,
    order: &PaidOrder,
    event: &Event,
) -> Result<(), OrderError> {
    write_order(pool, outbox, order, event, std::time::Duration::ZERO).await
}

/// Writes the order row and its `order.paid` event in one SQLite transaction.
pub async fn place_order_sqlite(
    pool: &sqlx::SqlitePool,
    outbox: &idem_sql::sqlite::Outbox,
    order: &PaidOrder,
) -> Result<(), OrderError> {
    write_order(
        pool,
        Some(outbox),
        order,
        &order.event()?,
        std::time::Duration::ZERO,
    )
    .await
}

/// Writes the order row and `event` (when there is an `outbox`) in one transaction of either
/// database, holding it open for `hold` before committing.
pub async fn write_order<DB: Dialect>(
    pool: &sqlx::Pool<DB>,
    outbox: Option<&idem_sql::Outbox<DB>>,
    order: &PaidOrder,
    event: &Event,
    hold: std::time::Duration,
) -> Result<(), OrderError> {
    let db = |source| OrderError::Database {
        order_id: order.order_id.clone(),
        source,
    };
    let mut tx = pool.begin().await.map_err(db)?;
    Statement::<DB>::new(
        "INSERT INTO orders (order_id, payment_id, amount_minor, currency) VALUES ($1, $2, $3, $4)",
    )
    .bind(order.order_id.as_str())
    .bind(order.payment_id.as_str())
    .bind(order.amount_minor)
    .bind(order.currency.as_str())
    .execute(&mut tx)
    .await
    .map_err(db)?;
    if let Some(outbox) = outbox {
        outbox.enqueue(&mut tx, event).await?;
    }
    if !hold.is_zero() {
        tokio::time::sleep(hold).await;
    }
    tx.commit().await.map_err(db)
}

/// What a settlement handler reads from an `order.paid` event.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Paid {
    order_id: String,
    payment_id: String,
    amount: money::Amount,
}

/// What an `order.paid` event says, or why it cannot be applied (checked before any SQL).
fn parse_paid(event: &InboundEvent) -> Result<Paid, String> {
    if event.event_type != ORDER_PAID {
        return Err(format!(
            "unexpected event type {:?}; the settlement service applies {ORDER_PAID}",
            event.event_type
        ));
    }
    let text = |field: &str| match event.payload.get(field) {
        Some(serde_json::Value::String(s)) if !s.is_empty() && s.len() <= 200 => Ok(s.clone()),
        Some(other) => Err(format!(
            "{field} must be a non-empty string of at most 200 bytes, got {other}"
        )),
        None => Err(format!("the payload has no {field}")),
    };
    Ok(Paid {
        order_id: text("order_id")?,
        payment_id: text("payment_id")?,
        amount: money::parse_amount(&event.payload)?,
    })
}

/// The effect name of the points award (the key is `event-<event id>-points.award`).
pub const POINTS_AWARD: &str = "points.award";

/// Points for an amount: one per whole currency unit, at least one.
pub fn points_for(amount_minor: i64) -> i64 {
    (amount_minor / 100).max(1)
}

/// The settlement handler: one row per payment, written in the consumer's transaction, and —
/// when built [`with_points`](Settlement::with_points) — one `points.award` effect per payment,
/// posted in the same transaction.
///
/// `INSERT … ON CONFLICT (payment_id) DO NOTHING` makes a second event for the same payment
/// (a different event id carrying the same business fact) converge to the one row; the same
/// payment with a different amount or order is refused (dead-lettered), never overwritten. The
/// effect is posted only by the event that inserted the settlement row: a second event for
/// the payment would derive another key, so it must not ask for a second award.
#[derive(Clone, Debug, Default)]
pub struct Settlement {
    /// Where points awards go (`http://127.0.0.1:8088/awards`), when points are on.
    points: Option<String>,
    /// PostgreSQL `lock_timeout` for the handler's statements, if set: a lock held longer on the
    /// business tables fails the statement (SQLSTATE 55P03), a transient failure.
    lock_timeout: Option<std::time::Duration>,
}

impl Settlement {
    /// Settlements only.
    pub fn new() -> Self {
        Settlement::default()
    }

    /// Settlements, and one points award per paid order, posted to `target` through the
    /// effect stage.
    pub fn with_points(target: impl Into<String>) -> Settlement {
        Settlement {
            points: Some(target.into()),
            lock_timeout: None,
        }
    }

    /// On PostgreSQL, gives up on a lock held longer than `timeout` on the business tables (a
    /// transient failure, retried until the lock is released; never a dead letter). Without it
    /// the handler waits for the lock. `idem-lab settlement --lock-timeout`.
    pub fn with_lock_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.lock_timeout = Some(timeout);
        self
    }
}

/// The body of the points award of `paid`.
fn award_body(paid: &Paid) -> serde_json::Value {
    serde_json::json!({
        "order_id": paid.order_id,
        "payment_id": paid.payment_id,
        "points": points_for(paid.amount.minor),
    })
}

/// Whether `paid` is the settlement `existing` (order, amount, currency) already stored for its
/// payment: the same fact under another event id converges; anything else is refused.
fn already_settled(paid: &Paid, existing: &(String, i64, String)) -> Result<(), String> {
    let (order, minor, currency) = existing;
    if (order, *minor, currency) == (&paid.order_id, paid.amount.minor, &paid.amount.currency) {
        return Ok(());
    }
    Err(format!(
        "payment {} is already settled for order {order} with {} {currency}; this event says order {} with {} {}",
        paid.payment_id,
        money::format_minor(*minor),
        paid.order_id,
        money::format_minor(paid.amount.minor),
        paid.amount.currency
    ))
}

/// The PostgreSQL `lock_timeout` of the rest of the consumer's transaction (`set_config`'s
/// `is_local`); other databases have none.
async fn set_lock_timeout<C: SqlConnection>(
    conn: &mut C,
    timeout: Option<std::time::Duration>,
) -> Result<(), HandlerError> {
    let Some(timeout) = timeout else {
        return Ok(());
    };
    if C::Dialect::SCHEME != Scheme::Postgres {
        return Ok(());
    }
    Statement::<C::Dialect>::new("SELECT set_config('lock_timeout', $1, true)")
        .bind(format!("{}ms", timeout.as_millis().max(1)))
        .execute(conn)
        .await
        .map(|_| ())
        .map_err(HandlerError::from)
}

impl<C: SqlConnection> Handler<C> for Settlement {
    /// One event: the batch of one (so the replay, the isolating retry and a batch apply the
    /// same statements).
    async fn handle(
        &self,
        cx: &mut HandlerContext<'_, C>,
        event: &InboundEvent,
    ) -> Result<(), HandlerError> {
        match self.settle_batch(&mut cx.as_batch(), &[event]).await {
            Ok(outcomes) => match outcomes.into_iter().next() {
                Some(Outcome::Applied) => Ok(()),
                Some(Outcome::Refused(reason)) => Err(HandlerError::Permanent(reason)),
                None => Err(HandlerError::transient(
                    "the settlement batch returned no outcome",
                )),
            },
            Err(BatchError::Event { error, .. } | BatchError::Batch(error)) => Err(error),
        }
    }

    fn business_key(&self, event: &InboundEvent) -> String {
        event
            .payload
            .get("payment_id")
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_owned()
    }

    fn validate(&self, event: &InboundEvent) -> Result<(), String> {
        parse_paid(event).map(|_| ())
    }

    /// The batch in a few set-based statements (the `settle` module): a settlement per payment,
    /// an application row per applied event, a points effect per settlement inserted.
    async fn handle_batch(
        &self,
        cx: &mut BatchContext<'_, C>,
        events: &[&InboundEvent],
    ) -> Result<Vec<Outcome>, BatchError> {
        self.settle_batch(cx, events).await
    }
}

/// The audit consumer of the chaos runner: a second consumer group over the same events, in the
/// settlement database, writing one insert-only `audit_log` row per applied event. With the
/// inbox scoped by group it sees every event once; an inbox that ignored the group would let
/// the settlement group's rows hide these events (the negative control that proves it).
#[derive(Clone, Copy, Debug, Default)]
pub struct Audit;

impl<C: SqlConnection> Handler<C> for Audit {
    async fn handle(
        &self,
        cx: &mut HandlerContext<'_, C>,
        event: &InboundEvent,
    ) -> Result<(), HandlerError> {
        let paid = parse_paid(event).map_err(HandlerError::Permanent)?;
        Statement::<C::Dialect>::new(
            "INSERT INTO audit_log (event_id, payment_id, amount_minor) VALUES ($1, $2, $3)",
        )
        .event_id(event.event_id)
        .bind(paid.payment_id.as_str())
        .bind(paid.amount.minor)
        .execute(cx.conn())
        .await
        .map_err(HandlerError::from)?;
        Ok(())
    }

    fn validate(&self, event: &InboundEvent) -> Result<(), String> {
        parse_paid(event).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn is_a_handler<C, H: Handler<C>>() {}

    /// Code generic over the dialect (one consumer wiring for both databases) sees the
    /// handlers: the connection of every [`Dialect`] is a [`SqlConnection`].
    #[allow(dead_code)]
    fn handlers_serve_code_generic_over_the_dialect<DB: Dialect>() {
        is_a_handler::<DB::Connection, Settlement>();
        is_a_handler::<DB::Connection, Audit>();
    }

    #[test]
    fn handlers_serve_both_databases() {
        handlers_serve_code_generic_over_the_dialect::<sqlx::Postgres>();
        handlers_serve_code_generic_over_the_dialect::<sqlx::Sqlite>();
    }
}
