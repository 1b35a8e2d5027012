//! The settlement handler's batch: a few set-based statements per batch, whatever its size.
//!
//! 1. every payload is parsed first: a malformed event is refused ([`Outcome::Refused`]) before
//!    any SQL, so it costs no rollback and no isolating retry;
//! 2. one statement inserts the settlements (sorted by payment: the lock order) and, on
//!    PostgreSQL, the application rows of the events that inserted them (`sql/batch/settle.*`);
//! 3. only when a payment was settled before (by another event id, or earlier in the batch):
//!    one look-up of those payments (`= ANY($1)`), a comparison in Rust, and one insert of the
//!    application rows of the events that converge; a different order or amount is refused;
//! 4. with points, the events that inserted a settlement post their award
//!    ([`idem_consumer::Effects::post`]); the runtime records the batch's intents in one
//!    statement.
//!
//! A statement the database refuses (a constraint only it knows) fails the batch as
//! [`BatchError::Batch`] with a permanent error: the runtime retries it one event at a time,
//! each in a savepoint, and dead-letters exactly the event the database refuses.

use std::collections::{HashMap, HashSet};

use idem_consumer::{BatchContext, BatchError, HandlerError, Outcome};
use idem_core::InboundEvent;
use idem_sql::{Array, Scheme, SqlConnection, Statement, get};

use super::{POINTS_AWARD, Paid, Settlement, award_body, parse_paid};

/// The statement of the dialect of `C`: PostgreSQL's or SQLite's text.
fn sql<C: SqlConnection>(postgres: &'static str, sqlite: &'static str) -> &'static str {
    match <C::Dialect as idem_sql::Dialect>::SCHEME {
        Scheme::Postgres => postgres,
        Scheme::Sqlite => sqlite,
    }
}

const SETTLE: (&str, &str) = (
    include_str!("../sql/batch/settle.postgres.sql"),
    include_str!("../sql/batch/settle.sqlite.sql"),
);
const SETTLED: (&str, &str) = (
    include_str!("../sql/batch/settled.postgres.sql"),
    include_str!("../sql/batch/settled.sqlite.sql"),
);
const APPLICATIONS: (&str, &str) = (
    include_str!("../sql/batch/applications.postgres.sql"),
    include_str!("../sql/batch/applications.sqlite.sql"),
);

/// One valid event of the batch and what it says.
#[derive(Debug)]
struct Item<'e> {
    event: &'e InboundEvent,
    paid: Paid,
}

/// The stored settlement of a payment: (order, amount in minor units, currency).
type Stored = (String, i64, String);

/// What happened to one valid event.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// It inserted its payment's settlement (and, on PostgreSQL, its application row).
    Inserted,
    /// Its payment was settled with the same order and amount: applied, converged.
    Converged,
    /// Its payment was settled differently: refused with this reason, nothing written.
    Conflict(String),
}

/// For each of `items`, whether it inserted its payment's settlement: the first item of each
/// payment the settle statement returned (`inserted`). Pure.
fn inserting(items: &[Item<'_>], inserted: &HashSet<String>) -> Vec<bool> {
    let mut first: HashSet<&str> = HashSet::with_capacity(items.len());
    items
        .iter()
        .map(|i| {
            let payment = i.paid.payment_id.as_str();
            first.insert(payment) && inserted.contains(payment)
        })
        .collect()
}

/// The verdict on each of `items` (`inserting`: see [`inserting`]); every item that did not
/// insert is compared with its payment's `stored` settlement. Pure. `None` when a payment was
/// neither inserted nor found (a transient race).
fn verdicts(
    items: &[Item<'_>],
    inserting: &[bool],
    stored: &HashMap<String, Stored>,
) -> Option<Vec<Verdict>> {
    items
        .iter()
        .zip(inserting)
        .map(|(item, inserted)| {
            if *inserted {
                return Some(Verdict::Inserted);
            }
            let existing = stored.get(&item.paid.payment_id)?;
            Some(match super::already_settled(&item.paid, existing) {
                Ok(()) => Verdict::Converged,
                Err(reason) => Verdict::Conflict(reason),
            })
        })
        .collect()
}

/// Inserts the settlements of `items` (and, on PostgreSQL, the application rows of the events
/// that inserted one): the payments inserted.
async fn settle<C: SqlConnection>(
    conn: &mut C,
    items: &[Item<'_>],
) -> Result<HashSet<String>, HandlerError> {
    let col = |f: fn(&Paid) -> String| items.iter().map(|i| f(&i.paid)).collect::<Array<_>>();
    let ids: Vec<idem_core::EventId> = items.iter().map(|i| i.event.event_id).collect();
    let rows = Statement::<C::Dialect>::new(sql::<C>(SETTLE.0, SETTLE.1))
        .bind(col(|p| p.payment_id.clone()))
        .bind(col(|p| p.order_id.clone()))
        .bind(
            items
                .iter()
                .map(|i| i.paid.amount.minor)
                .collect::<Array<_>>(),
        )
        .bind(col(|p| p.amount.currency.clone()))
        .bind(Array::event_ids(&ids))
        .fetch_all(conn)
        .await
        .map_err(HandlerError::from)?;
    rows.iter()
        .map(|r| get::<C::Dialect, String>(r, "payment_id"))
        .collect::<sqlx::Result<_>>()
        .map_err(HandlerError::from)
}

/// The stored settlements of `payments`.
async fn stored<C: SqlConnection>(
    conn: &mut C,
    payments: Vec<String>,
) -> Result<HashMap<String, Stored>, HandlerError> {
    if payments.is_empty() {
        return Ok(HashMap::new());
    }
    let rows = Statement::<C::Dialect>::new(sql::<C>(SETTLED.0, SETTLED.1))
        .bind(Array::new(payments))
        .fetch_all(conn)
        .await
        .map_err(HandlerError::from)?;
    rows.iter()
        .map(|r| {
            let text = |c: &str| get::<C::Dialect, String>(r, c);
            Ok((
                text("payment_id")?,
                (
                    text("order_id")?,
                    get::<C::Dialect, i64>(r, "amount_minor")?,
                    text("currency")?,
                ),
            ))
        })
        .collect::<sqlx::Result<_>>()
        .map_err(HandlerError::from)
}

/// One application row for each of `applied`.
async fn applications<C: SqlConnection>(
    conn: &mut C,
    applied: &[&Item<'_>],
) -> Result<(), HandlerError> {
    if applied.is_empty() {
        return Ok(());
    }
    let ids: Vec<idem_core::EventId> = applied.iter().map(|i| i.event.event_id).collect();
    Statement::<C::Dialect>::new(sql::<C>(APPLICATIONS.0, APPLICATIONS.1))
        .bind(Array::event_ids(&ids))
        .bind(
            applied
                .iter()
                .map(|i| i.paid.payment_id.clone())
                .collect::<Array<_>>(),
        )
        .execute(conn)
        .await
        .map(|_| ())
        .map_err(HandlerError::from)
}

/// The events of a batch, parsed: the valid ones with their positions, and an outcome slot
/// for each event (the refusals filled in).
fn parse<'e>(events: &[&'e InboundEvent]) -> (Vec<usize>, Vec<Item<'e>>, Vec<Option<Outcome>>) {
    let mut outcomes = vec![None; events.len()];
    let (mut at, mut items) = (vec![], Vec::with_capacity(events.len()));
    for (i, event) in events.iter().enumerate() {
        match parse_paid(event) {
            Ok(paid) => {
                at.push(i);
                items.push(Item { event, paid });
            }
            Err(reason) => outcomes[i] = Some(Outcome::Refused(reason)),
        }
    }
    (at, items, outcomes)
}

impl Settlement {
    /// [`idem_consumer::Handler::handle_batch`] of the settlement handler (see the module).
    pub(crate) async fn settle_batch<C: SqlConnection>(
        &self,
        cx: &mut BatchContext<'_, C>,
        events: &[&InboundEvent],
    ) -> Result<Vec<Outcome>, BatchError> {
        let (at, items, mut outcomes) = parse(events);
        if !items.is_empty() {
            super::set_lock_timeout(cx.conn(), self.lock_timeout).await?;
            let verdicts = apply(cx.conn(), &items).await?;
            self.award_all(cx, &items, &verdicts)?;
            for (i, v) in at.into_iter().zip(verdicts) {
                outcomes[i] = Some(match v {
                    Verdict::Inserted | Verdict::Converged => Outcome::Applied,
                    Verdict::Conflict(reason) => Outcome::Refused(reason),
                });
            }
        }
        outcomes
            .into_iter()
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| HandlerError::transient("an event of the batch got no outcome").into())
    }

    /// Posts one points award per event that inserted its settlement, when points are on.
    fn award_all<C>(
        &self,
        cx: &mut BatchContext<'_, C>,
        items: &[Item<'_>],
        verdicts: &[Verdict],
    ) -> Result<(), HandlerError> {
        let Some(target) = self.points.as_deref() else {
            return Ok(());
        };
        for (item, _) in items
            .iter()
            .zip(verdicts)
            .filter(|(_, v)| **v == Verdict::Inserted)
        {
            cx.effects(item.event)
                .post(POINTS_AWARD, target, award_body(&item.paid))?;
        }
        Ok(())
    }
}

/// Settles the valid `items` and writes their application rows.
async fn apply<C: SqlConnection>(
    conn: &mut C,
    items: &[Item<'_>],
) -> Result<Vec<Verdict>, HandlerError> {
    let inserting = inserting(items, &settle(conn, items).await?);
    let others: HashSet<&str> = items
        .iter()
        .zip(&inserting)
        .filter(|(_, inserted)| !**inserted)
        .map(|(i, _)| i.paid.payment_id.as_str())
        .collect();
    let stored = stored(conn, others.into_iter().map(str::to_owned).collect()).await?;
    let verdicts = verdicts(items, &inserting, &stored).ok_or_else(|| {
        HandlerError::transient("a payment was neither settled nor found; retrying")
    })?;
    // PostgreSQL wrote the application rows of the inserting events with their settlements.
    let with_settlement = <C::Dialect as idem_sql::Dialect>::SCHEME == Scheme::Postgres;
    let applied: Vec<&Item<'_>> = items
        .iter()
        .zip(&verdicts)
        .filter(|(_, v)| match v {
            Verdict::Inserted => !with_settlement,
            Verdict::Converged => true,
            Verdict::Conflict(_) => false,
        })
        .map(|(i, _)| i)
        .collect();
    applications(conn, &applied).await?;
    Ok(verdicts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::money;

    fn item<'e>(event: &'e InboundEvent, payment: &str, order: &str, minor: i64) -> Item<'e> {
        Item {
            event,
            paid: Paid {
                order_id: order.into(),
                payment_id: payment.into(),
                amount: money::Amount {
                    minor,
                    currency: "EUR".into(),
                },
            },
        }
    }

    #[test]
    fn the_first_event_of_an_inserted_payment_inserted_it_and_the_others_are_compared() {
        let e = InboundEvent {
            event_id: idem_core::EventId::new(),
            event_type: crate::ORDER_PAID.into(),
            aggregate_type: crate::ORDER.into(),
            aggregate_id: "o-1".into(),
            payload: serde_json::json!({}),
            payload_hash: String::new(),
            traceparent: None,
            topic: "t".into(),
            partition: 0,
            offset: 0,
        };
        let items = [
            item(&e, "p-1", "o-1", 100),
            item(&e, "p-1", "o-1", 100),
            item(&e, "p-1", "o-9", 100),
            item(&e, "p-2", "o-2", 200),
            item(&e, "p-3", "o-3", 300),
        ];
        let inserted = HashSet::from(["p-1".to_owned(), "p-3".to_owned()]);
        let flags = inserting(&items, &inserted);
        assert_eq!(flags, [true, false, false, false, true]);
        let stored = HashMap::from([
            ("p-1".to_owned(), ("o-1".to_owned(), 100, "EUR".to_owned())),
            ("p-2".to_owned(), ("o-2".to_owned(), 250, "EUR".to_owned())),
        ]);
        let v = verdicts(&items, &flags, &stored).unwrap();
        assert_eq!(v[0], Verdict::Inserted);
        assert_eq!(v[1], Verdict::Converged, "the same fact twice in one batch");
        assert!(
            matches!(&v[2], Verdict::Conflict(r) if r.contains("order o-1")),
            "{v:?}"
        );
        assert!(
            matches!(&v[3], Verdict::Conflict(r) if r.contains("2.50")),
            "{v:?}"
        );
        assert_eq!(v[4], Verdict::Inserted);
        let missing = [item(&e, "p-4", "o-4", 100)];
        assert_eq!(verdicts(&missing, &[false], &stored), None);
    }
}
