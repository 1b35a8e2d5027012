//! The run's topic, read back: what each consumer group has not consumed yet, and how many
//! copies of an event the topic holds.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, bail};
use idem_kafka::Connection;
use idem_kafka::inspect::Record;

use crate::demo::world::Databases;
use idem_sql::AnyPool;

/// Copies in the topic beyond the first per event id (`ce_id`).
pub(super) fn duplicates(records: &[Record]) -> i64 {
    let ids: std::collections::HashSet<&str> = records
        .iter()
        .filter_map(|r| r.header(idem_core::wire::CE_ID))
        .collect();
    i64::try_from(records.len() - ids.len()).unwrap_or(i64::MAX)
}

/// Every record of the run's topic (an error when the topic cannot be read).
pub(super) async fn read(
    kafka: &Connection,
    topic: &str,
) -> anyhow::Result<idem_core::Result<Vec<Record>>> {
    let (conn, topic) = (kafka.client_config(), topic.to_owned());
    Ok(tokio::task::spawn_blocking(move || {
        idem_kafka::inspect::read_all_with(&conn, &topic, Duration::from_secs(60))
    })
    .await?)
}

/// Per check, the missing effects whose events their group has not consumed yet. A points
/// award is downstream of the settlement group (the settlement handler records its intent).
/// `None` when a group's committed offsets cannot be read (a broker down or restarting): what
/// waits is unknown then, never zero.
pub(super) async fn unconsumed(
    kafka: &Connection,
    topic: &str,
    records: &[Record],
    dbs: &Databases,
) -> anyhow::Result<Option<BTreeMap<String, u64>>> {
    let Some(not_settled) = unconsumed_missing(
        kafka,
        topic,
        "settlement",
        records,
        &dbs.settlement,
        "settlements",
    )
    .await
    .context("counting what group settlement has not consumed")?
    else {
        return Ok(None);
    };
    let not_awarded = missing_in(&dbs.points, "points_awards", not_settled.clone()).await?;
    let Some(not_audited) =
        unconsumed_missing(kafka, topic, "audit", records, &dbs.settlement, "audit_log")
            .await
            .context("counting what group audit has not consumed")?
    else {
        return Ok(None);
    };
    let mut counts = BTreeMap::new();
    for (check, list) in [
        ("settlements", not_settled),
        ("points", not_awarded),
        ("audit", not_audited),
    ] {
        if !list.is_empty() {
            counts.insert(check.to_owned(), list.len() as u64);
        }
    }
    Ok(Some(counts))
}

/// Missing effects whose events wait in the topic for their group: `None` when the topic or a
/// group's offsets cannot be read.
pub(super) async fn waiting(
    kafka: &Connection,
    topic: &str,
    dbs: &Databases,
) -> anyhow::Result<Option<u64>> {
    let Ok(records) = read(kafka, topic).await? else {
        return Ok(None);
    };
    Ok(unconsumed(kafka, topic, &records, dbs)
        .await?
        .map(|counts| counts.values().sum()))
}

/// The payment ids of the events of `records` that sit at or beyond `group`'s committed offset
/// in their partition (or in a partition where the group committed nothing) and have no row in
/// `table`: events the group has not consumed yet, as opposed to events it read past. `None`
/// when the broker does not answer for the group's offsets.
async fn unconsumed_missing(
    kafka: &Connection,
    topic: &str,
    group: &str,
    records: &[Record],
    db: &AnyPool,
    table: &str,
) -> anyhow::Result<Option<Vec<String>>> {
    let committed = {
        let (conn, topic, group) = (kafka.client_config(), topic.to_owned(), group.to_owned());
        tokio::task::spawn_blocking(move || {
            idem_kafka::inspect::committed_offsets_with(
                &conn,
                &group,
                &topic,
                Duration::from_secs(30),
            )
        })
        .await?
    };
    let Ok(committed) = committed else {
        return Ok(None);
    };
    let committed: std::collections::HashMap<i32, i64> = committed.into_iter().collect();
    Ok(Some(
        missing_in(db, table, not_read_past(records, &committed)).await?,
    ))
}

/// The payment ids of the records a group has not read past: at or beyond its committed offset
/// (the next offset it will read) in their partition, or anywhere in a partition where it
/// committed nothing.
fn not_read_past(
    records: &[Record],
    committed: &std::collections::HashMap<i32, i64>,
) -> Vec<String> {
    records
        .iter()
        .filter(|r| r.offset >= committed.get(&r.partition).copied().unwrap_or(0))
        .filter_map(|r| r.payload.as_deref())
        .filter_map(|p| serde_json::from_str::<serde_json::Value>(p).ok())
        .filter_map(|v| v.get("payment_id")?.as_str().map(str::to_owned))
        .collect()
}

/// The payment ids of `payments` without a row in `table` (one of the reference pipeline's
/// tables, never input), sorted and without repeats.
async fn missing_in(
    db: &AnyPool,
    table: &str,
    mut payments: Vec<String>,
) -> anyhow::Result<Vec<String>> {
    payments.sort();
    payments.dedup();
    if payments.is_empty() {
        return Ok(payments);
    }
    let AnyPool::Postgres(pool) = db else {
        bail!("chaos runs on PostgreSQL only");
    };
    let sql = format!(
        "SELECT k.payment_id FROM unnest($1::text[]) AS k(payment_id) \
         WHERE NOT EXISTS (SELECT 1 FROM {table} t WHERE t.payment_id = k.payment_id) \
         ORDER BY 1"
    );
    Ok(sqlx::query_scalar(&sql)
        .bind(payments)
        .fetch_all(pool)
        .await?)
}

#[cfg(test)]
mod tests {
    use super::{duplicates, not_read_past};
    use idem_kafka::inspect::Record;

    fn record(partition: i32, offset: i64, payment: &str) -> Record {
        Record {
            partition,
            offset,
            key: None,
            payload: Some(format!(r#"{{"payment_id":"{payment}","amount":"1.00"}}"#)),
            headers: vec![],
        }
    }

    #[test]
    fn only_records_the_group_has_not_read_past_count_as_unconsumed() {
        let records = [
            record(0, 0, "p0"),
            record(0, 1, "p1"),
            record(0, 2, "p2"),
            record(1, 0, "q0"),
            record(1, 1, "q1"),
            record(2, 0, "r0"),
        ];
        // Partition 0: offset 2 is the next to read; partition 1: everything read;
        // partition 2: nothing committed.
        let committed = [(0, 2), (1, 2)].into_iter().collect();
        assert_eq!(not_read_past(&records, &committed), vec!["p2", "r0"]);
        // A group that committed nothing has read past nothing.
        let none = Default::default();
        assert_eq!(not_read_past(&records, &none).len(), records.len());
    }

    #[test]
    fn copies_beyond_the_first_per_event_id_are_duplicates() {
        let with_id = |offset: i64, id: &str| Record {
            headers: vec![(idem_core::wire::CE_ID.to_owned(), id.to_owned())],
            ..record(0, offset, id)
        };
        let records = [
            with_id(0, "a"),
            with_id(1, "b"),
            with_id(2, "a"),
            with_id(3, "a"),
        ];
        assert_eq!(duplicates(&records), 2);
        assert_eq!(duplicates(&records[..2]), 0);
    }
}
