//! The reference pipeline's `idem verify` config: the checks that say nothing was lost or
//! doubled between its orders, its settlements and its points awards. `idem-lab verify-config`
//! writes it as TOML for `idem verify --config`; the demo and the chaos runner verify with it.

use idem_verify::{
    Check, CurrencyColumns, EmptyCheck, Locate, Side, Tables, UniqueCheck, VerifyConfig,
};

/// The reference pipeline's checks: orders → settlements (one per payment, same amount and
/// currency), the settlement log (one application per event), and — with the points API's
/// database — orders → points awards (one per payment, one point per whole currency unit).
pub fn verify_config(
    orders_db: &str,
    settlement_db: &str,
    points_db: Option<&str>,
) -> VerifyConfig {
    let mut checks = vec![settlements(orders_db, settlement_db)];
    if let Some(points) = points_db {
        checks.push(points_awards(orders_db, settlement_db, points));
    }
    VerifyConfig {
        checks,
        unique: vec![UniqueCheck {
            name: "settlement applications per event".to_owned(),
            db: settlement_db.to_owned(),
            query: "SELECT event_id FROM settlement_applications".to_owned(),
            key: "event_id".to_owned(),
        }],
        // The points API records two executions of one Idempotency-Key that ran at once
        // (lab mode): the key layer's lock must prevent every one.
        empty: points_db
            .map(|points| EmptyCheck {
                name: "overlapping executions of one key".to_owned(),
                db: points.to_owned(),
                query: "SELECT idem_key FROM points_lab_overlaps".to_owned(),
                key: "idem_key".to_owned(),
            })
            .into_iter()
            .collect(),
        tables: Tables::default(),
        currencies: vec![CurrencyColumns {
            check: "settlements".to_owned(),
            source: "currency".to_owned(),
            target: "currency".to_owned(),
        }],
    }
}

/// Where a missing settlement's (or award's) `order.paid` event stopped.
fn locate(settlement_db: &str, effect: bool) -> Locate {
    Locate {
        outbox_db: None,
        aggregate_type: "order".to_owned(),
        event_type: "order.paid".to_owned(),
        inbox_db: settlement_db.to_owned(),
        consumer_group: "settlement".to_owned(),
        intents_db: effect.then(|| settlement_db.to_owned()),
        effect: effect.then(|| crate::POINTS_AWARD.to_owned()),
    }
}

fn settlements(orders_db: &str, settlement_db: &str) -> Check {
    Check {
        name: "settlements".to_owned(),
        event_type: Some("order.paid".to_owned()),
        source: Side {
            db: orders_db.to_owned(),
            query: "SELECT payment_id, amount_minor, currency, order_id FROM orders".to_owned(),
            key: "payment_id".to_owned(),
            amount: Some("amount_minor".to_owned()),
            event_type_column: None,
            aggregate_id: Some("order_id".to_owned()),
        },
        target: Side {
            db: settlement_db.to_owned(),
            query: "SELECT payment_id, amount_minor, currency FROM settlements".to_owned(),
            key: "payment_id".to_owned(),
            amount: Some("amount_minor".to_owned()),
            event_type_column: None,
            aggregate_id: None,
        },
        locate: Some(locate(settlement_db, false)),
    }
}

fn points_awards(orders_db: &str, settlement_db: &str, points_db: &str) -> Check {
    let postgres = orders_db.starts_with("postgres://") || orders_db.starts_with("postgresql://");
    let greatest = if postgres { "GREATEST" } else { "max" };
    Check {
        name: "points".to_owned(),
        event_type: Some("order.paid".to_owned()),
        source: Side {
            db: orders_db.to_owned(),
            query: format!(
                "SELECT payment_id, {greatest}(amount_minor / 100, 1) AS points, order_id FROM orders"
            ),
            key: "payment_id".to_owned(),
            amount: Some("points".to_owned()),
            event_type_column: None,
            aggregate_id: Some("order_id".to_owned()),
        },
        target: Side {
            db: points_db.to_owned(),
            query: "SELECT payment_id, points FROM points_awards a \
                    WHERE NOT EXISTS (SELECT 1 FROM points_reversals r WHERE r.award_id = a.id)"
                .to_owned(),
            key: "payment_id".to_owned(),
            amount: Some("points".to_owned()),
            event_type_column: None,
            aggregate_id: None,
        },
        locate: Some(locate(settlement_db, true)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reference_config_validates_and_survives_toml() {
        let c = verify_config("postgres://h/o", "postgres://h/s", Some("sqlite://p.db"));
        c.validate().unwrap_or_else(|e| panic!("{e}"));
        let text = c.to_toml().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(VerifyConfig::from_toml(&text).ok(), Some(c));
    }
}
