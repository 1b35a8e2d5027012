//! The control plane, over an ordinary connection: the publication the slot reads, the slot
//! itself, and the slot's state for metrics, `idem outbox status` and the loud failure of a
//! slot whose WAL is gone.

use sqlx::{PgPool, Row};

use crate::error::CdcError;

/// A replication slot or publication name: 1 to 63 of `[a-z0-9_]` (PostgreSQL's rule for slot
/// names, applied to publications too so that both can be spliced into SQL unquoted-safe and
/// double-quoted).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Name(String);

impl Name {
    /// Validates `name`.
    pub fn new(what: &'static str, name: &str) -> Result<Self, CdcError> {
        let ok = !name.is_empty()
            && name.len() <= 63
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
        if ok {
            Ok(Name(name.to_owned()))
        } else {
            Err(CdcError::Config(format!(
                "{what} {name:?} must be 1 to 63 of [a-z0-9_]"
            )))
        }
    }

    /// A name idem itself chooses (the defaults), valid by construction: the test
    /// `the_default_names_are_valid` checks each against [`Name::new`].
    pub(crate) fn known(name: &'static str) -> Self {
        Name(name.to_owned())
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name double-quoted for SQL text (safe: it is `[a-z0-9_]` only).
    fn quoted(&self) -> String {
        format!("\"{}\"", self.0)
    }
}

impl std::fmt::Display for Name {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// What the publication must hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Publishes {
    /// The outbox table (schema, bare name, and its quoted qualified name), inserts only.
    Table {
        /// The table's schema (`public` when none is configured).
        schema: String,
        /// The table's bare name.
        name: String,
        /// The quoted, qualified name spliced into `CREATE PUBLICATION`.
        qualified: String,
    },
    /// No table: only `pg_logical_emit_message` messages (message mode).
    Nothing,
}

/// Creates the publication when it is missing; checks an existing one publishes inserts and
/// holds the outbox table (table mode).
pub async fn ensure_publication(
    pool: &PgPool,
    publication: &Name,
    publishes: &Publishes,
) -> Result<(), CdcError> {
    let (schema, table) = match publishes {
        Publishes::Table { schema, name, .. } => (schema.as_str(), name.as_str()),
        Publishes::Nothing => ("", ""),
    };
    let row = sqlx::query(include_str!("../sql/publication_get.sql"))
        .bind(publication.as_str())
        .bind(schema)
        .bind(table)
        .fetch_optional(pool)
        .await
        .map_err(|e| CdcError::db("reading the publication", e))?;
    let Some(row) = row else {
        let sql = match publishes {
            Publishes::Table { qualified, .. } => format!(
                "CREATE PUBLICATION {} FOR TABLE {qualified} WITH (publish = 'insert')",
                publication.quoted()
            ),
            Publishes::Nothing => format!("CREATE PUBLICATION {}", publication.quoted()),
        };
        sqlx::query(&sql)
            .execute(pool)
            .await
            .map_err(|e| CdcError::db(format!("creating publication {publication}"), e))?;
        return Ok(());
    };
    let pubinsert: bool = row.try_get("pubinsert").map_err(decode)?;
    let has_table: bool = row.try_get("has_table").map_err(decode)?;
    if !pubinsert || (matches!(publishes, Publishes::Table { .. }) && !has_table) {
        return Err(CdcError::Config(format!(
            "publication {publication} exists but does not publish the inserts of {schema}.{table}: \
             drop it or name another with `CdcConfig::publication`"
        )));
    }
    Ok(())
}

/// A slot as `pg_replication_slots` shows it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SlotState {
    /// The slot.
    pub slot: String,
    /// Whether a session reads it now.
    pub active: bool,
    /// That session's server process.
    pub active_pid: Option<i32>,
    /// `reserved`, `extended`, `unreserved` or `lost` (`None` before the slot reserved WAL).
    pub wal_status: Option<String>,
    /// The position the slot confirmed: everything before it was published and acknowledged.
    pub confirmed_flush_lsn: Option<String>,
    /// WAL bytes between the server's position and the confirmed one.
    pub lag_bytes: Option<i64>,
    /// Bytes that can still be written before the slot would lose WAL
    /// (`max_slot_wal_keep_size`); `None` when unbounded.
    pub safe_wal_size: Option<i64>,
}

impl SlotState {
    /// Whether the server removed WAL the slot needs: it can never stream again, and events
    /// committed since its confirmed position are not in any stream (a loud failure).
    pub fn is_lost(&self) -> bool {
        self.wal_status.as_deref() == Some("lost")
    }
}

/// The slot's state, `None` when it does not exist.
pub async fn slot_state(pool: &PgPool, slot: &Name) -> Result<Option<SlotState>, CdcError> {
    let row = sqlx::query(include_str!("../sql/slot_get.sql"))
        .bind(slot.as_str())
        .fetch_optional(pool)
        .await
        .map_err(|e| CdcError::db("reading the replication slot", e))?;
    let Some(row) = row else {
        return Ok(None);
    };
    let plugin: Option<String> = row.try_get("plugin").map_err(decode)?;
    let kind: String = row.try_get("slot_type").map_err(decode)?;
    if kind != "logical" || plugin.as_deref() != Some("pgoutput") {
        return Err(CdcError::Config(format!(
            "slot {slot} exists but is a {kind} slot of plugin {plugin:?}, not a logical pgoutput \
             slot: name another with `CdcConfig::slot`"
        )));
    }
    Ok(Some(SlotState {
        slot: slot.as_str().to_owned(),
        active: row.try_get("active").map_err(decode)?,
        active_pid: row.try_get("active_pid").map_err(decode)?,
        wal_status: row.try_get("wal_status").map_err(decode)?,
        confirmed_flush_lsn: row.try_get("confirmed_flush_lsn").map_err(decode)?,
        lag_bytes: row.try_get("lag_bytes").map_err(decode)?,
        safe_wal_size: row.try_get("safe_wal_size").map_err(decode)?,
    }))
}

/// The state of every logical pgoutput slot of the connection's database (what `idem outbox
/// status` shows next to the table's counts).
pub async fn slots_here(pool: &PgPool) -> Result<Vec<SlotState>, CdcError> {
    let names: Vec<String> = sqlx::query_scalar(include_str!("../sql/slots_here.sql"))
        .fetch_all(pool)
        .await
        .map_err(|e| CdcError::db("listing the replication slots", e))?;
    let mut out = Vec::with_capacity(names.len());
    for n in names {
        // Slot names PostgreSQL accepted are [a-z0-9_]: always a valid Name.
        let Ok(name) = Name::new("slot", &n) else {
            continue;
        };
        if let Some(state) = slot_state(pool, &name).await? {
            out.push(state);
        }
    }
    Ok(out)
}

/// Creates the slot (every transaction committed after this is in its stream); refuses a slot
/// that lost its WAL. A slot another relay created at the same moment is taken as it is.
pub async fn create_slot(pool: &PgPool, slot: &Name) -> Result<SlotState, CdcError> {
    let created = sqlx::query(include_str!("../sql/slot_create.sql"))
        .bind(slot.as_str())
        .execute(pool)
        .await;
    // Two relays starting at once: the other one created it.
    if let Err(e) = created
        && !is_duplicate_object(&e)
    {
        return Err(CdcError::db(format!("creating replication slot {slot}"), e));
    }
    let state = slot_state(pool, slot).await?.ok_or_else(|| {
        CdcError::SessionEnded(format!(
            "replication slot {slot} vanished right after its creation (another client dropped it)"
        ))
    })?;
    usable(state)
}

/// `state`, or the error of a slot that lost its WAL.
pub fn usable(state: SlotState) -> Result<SlotState, CdcError> {
    if state.is_lost() {
        return Err(CdcError::SlotLost {
            slot: state.slot,
            confirmed: state.confirmed_flush_lsn,
        });
    }
    Ok(state)
}

/// The line of a publication's comment that records a slot made to read it. The comment is a
/// catalog entry: it survives the slot's drop, and a physical standby has it after a failover
/// although PostgreSQL 15 gives it none of the primary's logical slots.
fn slot_line(slot: &Name) -> String {
    format!("idem-cdc slot {slot}")
}

/// Whether the publication's `comment` records `slot`.
pub fn records_slot(comment: Option<&str>, slot: &Name) -> bool {
    let line = slot_line(slot);
    comment.is_some_and(|c| c.lines().any(|l| l.trim() == line))
}

/// The publication's comment (`None`: none, or no such publication).
pub async fn publication_comment(
    pool: &PgPool,
    publication: &Name,
) -> Result<Option<String>, CdcError> {
    let comment: Option<Option<String>> =
        sqlx::query_scalar(include_str!("../sql/publication_comment.sql"))
            .bind(publication.as_str())
            .fetch_optional(pool)
            .await
            .map_err(|e| CdcError::db("reading the publication's comment", e))?;
    Ok(comment.flatten())
}

/// Records on the publication that `slot` reads it, after its `comment` (what
/// [`publication_comment`] read): a later start that finds the slot missing knows it existed.
/// Needs ownership of the publication (the relay owns the one it created).
pub async fn record_slot(
    pool: &PgPool,
    publication: &Name,
    slot: &Name,
    comment: Option<&str>,
) -> Result<(), CdcError> {
    let line = slot_line(slot);
    let text = match comment {
        Some(c) if !c.trim().is_empty() => format!("{c}\n{line}"),
        _ => line,
    };
    set_comment(pool, publication.as_str(), Some(&text)).await
}

/// Removes `slot` from every publication comment that records it, as [`drop_slot`]'s
/// companion: a relay started later under that name makes the slot as on a first start.
pub async fn forget_slot(pool: &PgPool, slot: &Name) -> Result<(), CdcError> {
    let publications: Vec<(String, Option<String>)> =
        sqlx::query_as(include_str!("../sql/publication_comments.sql"))
            .fetch_all(pool)
            .await
            .map_err(|e| CdcError::db("reading the publications' comments", e))?;
    for (publication, comment) in publications {
        if records_slot(comment.as_deref(), slot) {
            let kept = without_slot(comment.as_deref().unwrap_or_default(), slot);
            set_comment(pool, &publication, kept.as_deref()).await?;
        }
    }
    Ok(())
}

/// `comment` without `slot`'s line; `None` when nothing else is left.
fn without_slot(comment: &str, slot: &Name) -> Option<String> {
    let line = slot_line(slot);
    let kept: Vec<&str> = comment.lines().filter(|l| l.trim() != line).collect();
    let kept = kept.join("\n");
    (!kept.trim().is_empty()).then_some(kept)
}

/// Sets (or, with `None`, removes) the comment of publication `name`; the server quotes the name
/// and the text (`format`'s `%I` and `%L`, whose NULL removes the comment).
async fn set_comment(pool: &PgPool, name: &str, text: Option<&str>) -> Result<(), CdcError> {
    let statement: String = sqlx::query_scalar(
        "SELECT pg_catalog.format('COMMENT ON PUBLICATION %I IS %L', $1::text, $2::text)",
    )
    .bind(name)
    .bind(text)
    .fetch_one(pool)
    .await
    .map_err(|e| CdcError::db("writing the publication's comment", e))?;
    sqlx::raw_sql(&statement)
        .execute(pool)
        .await
        .map_err(|e| CdcError::db(format!("commenting on publication {name}"), e))?;
    Ok(())
}

/// Drops the slot (it must not be in use): its WAL is released, and whatever was committed
/// after its confirmed position will never be streamed.
pub async fn drop_slot(pool: &PgPool, slot: &Name) -> Result<(), CdcError> {
    sqlx::query(include_str!("../sql/slot_drop.sql"))
        .bind(slot.as_str())
        .execute(pool)
        .await
        .map_err(|e| CdcError::db(format!("dropping replication slot {slot}"), e))?;
    Ok(())
}

fn is_duplicate_object(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == "42710")
}

fn decode(e: sqlx::Error) -> CdcError {
    CdcError::db("decoding pg_replication_slots", e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_names_are_valid() {
        use crate::relay::{DEFAULT_MESSAGES_PUBLICATION, DEFAULT_SLOT, DEFAULT_TABLE_PUBLICATION};
        for name in [
            DEFAULT_SLOT,
            DEFAULT_TABLE_PUBLICATION,
            DEFAULT_MESSAGES_PUBLICATION,
        ] {
            assert_eq!(Name::new("name", name).unwrap(), Name::known(name));
        }
    }

    #[test]
    fn a_slot_is_recorded_by_its_own_line_of_the_comment() {
        let slot = Name::new("slot", "idem_cdc").unwrap();
        assert!(records_slot(Some("idem-cdc slot idem_cdc"), &slot));
        assert!(records_slot(
            Some("owned by payments\nidem-cdc slot other\nidem-cdc slot idem_cdc"),
            &slot
        ));
        for comment in [
            None,
            Some(""),
            Some("idem-cdc slot idem_cdc_2"),
            Some("not idem-cdc slot idem_cdc"),
        ] {
            assert!(!records_slot(comment, &slot), "{comment:?}");
        }
    }

    #[test]
    fn forgetting_a_slot_keeps_the_rest_of_the_comment() {
        let slot = Name::new("slot", "idem_cdc").unwrap();
        assert_eq!(without_slot("idem-cdc slot idem_cdc", &slot), None);
        assert_eq!(
            without_slot(
                "owned by payments\nidem-cdc slot idem_cdc\nidem-cdc slot b",
                &slot
            )
            .as_deref(),
            Some("owned by payments\nidem-cdc slot b")
        );
    }

    #[test]
    fn names_are_lowercase_digits_and_underscores_only() {
        assert!(Name::new("slot", "idem_cdc_1").is_ok());
        for bad in ["", "Idem", "a-b", "a\"; drop table x; --", &"a".repeat(64)] {
            assert!(Name::new("slot", bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            Name::new("slot", "s").map(|n| n.quoted()).ok(),
            Some("\"s\"".into())
        );
    }
}
