//! What to verify: the checks of a pipeline, read from a small TOML file.

use serde::{Deserialize, Serialize};

use crate::VerifyError;

/// Everything `idem verify` checks.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct VerifyConfig {
    /// Source-to-target reconciliations.
    #[serde(default, rename = "check")]
    pub checks: Vec<Check>,
    /// Keys that must appear at most once in one table (duplicate business effects).
    #[serde(default, rename = "unique", skip_serializing_if = "Vec::is_empty")]
    pub unique: Vec<UniqueCheck>,
    /// Queries that must return no row.
    #[serde(default, rename = "empty", skip_serializing_if = "Vec::is_empty")]
    pub empty: Vec<EmptyCheck>,
    /// Where idem's own tables are (for loss localisation and attempt counts).
    #[serde(default)]
    pub tables: Tables,
    /// Currency columns compared by checks that reconcile money (`[[currency]]`).
    #[serde(default, rename = "currency", skip_serializing_if = "Vec::is_empty")]
    pub currencies: Vec<CurrencyColumns>,
}

/// The currency columns of one check: a target row in another currency than its source row is
/// a violation (`kind="currency"`), even when the amounts agree.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct CurrencyColumns {
    /// The `[[check]]` it applies to.
    pub check: String,
    /// The source query's currency column.
    pub source: String,
    /// The target query's currency column.
    pub target: String,
}

/// idem's table names in every database of the config.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Tables {
    /// PostgreSQL schema (default: the search path).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<String>,
    /// Prefix of idem's tables (default `idem_`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
}

/// One reconciliation: every source row must have exactly one target row with the same key (and
/// the same amount, when amounts are named).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Check {
    /// Name in the report and the `check` label of `idem_reconciliation_gap`.
    pub name: String,
    /// The event type the totals are reported under when the source names none per row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_type: Option<String>,
    /// Where the facts come from (the order database).
    pub source: Side,
    /// Where their effects must be (the settlement database, the points API's database).
    pub target: Side,
    /// How to find where a missing effect's event stopped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub locate: Option<Locate>,
}

/// One side of a check: a query and the columns that matter.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Side {
    /// `postgres://…` or `sqlite://path`.
    pub db: String,
    /// A `SELECT` returning at least the named columns (operator-written, like a DSN: it is run
    /// as given, wrapped in an ordering query).
    pub query: String,
    /// The business key column.
    pub key: String,
    /// The amount column (integer minor units), if amounts are reconciled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub amount: Option<String>,
    /// A column naming each row's event type (source only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_type_column: Option<String>,
    /// A column naming each row's aggregate id (source only; needed by `locate`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aggregate_id: Option<String>,
}

/// How to follow a missing effect back through the pipeline.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Locate {
    /// The database holding the outbox (default: the source's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outbox_db: Option<String>,
    /// The outbox rows' aggregate type.
    pub aggregate_type: String,
    /// The outbox rows' event type.
    pub event_type: String,
    /// The consumer's database (its inbox and dead letters).
    pub inbox_db: String,
    /// The consumer group.
    pub consumer_group: String,
    /// The database holding the effect intents, when the target is an external API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intents_db: Option<String>,
    /// The effect name (`points.award`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effect: Option<String>,
}

/// A key that must not repeat: a repeated key is a duplicate business effect.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct UniqueCheck {
    /// Name in the report.
    pub name: String,
    /// The database.
    pub db: String,
    /// The query.
    pub query: String,
    /// The column that must be unique.
    pub key: String,
}

/// A query that must return no row: an invariant each returned row breaks (two executions of
/// one key that overlapped, a balance below zero, an effect without its event).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct EmptyCheck {
    /// Name in the report.
    pub name: String,
    /// The database.
    pub db: String,
    /// The query.
    pub query: String,
    /// The column that names each row in the report.
    pub key: String,
}

/// A column name usable in SQL: `[A-Za-z_][A-Za-z0-9_]*`, at most 63 bytes.
pub(crate) fn column(name: &str, what: &str) -> Result<String, VerifyError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .enumerate()
            .all(|(i, b)| b == b'_' || b.is_ascii_alphabetic() || (i > 0 && b.is_ascii_digit()));
    if ok {
        Ok(format!("\"{name}\""))
    } else {
        Err(VerifyError::Config(format!(
            "{what} {name:?} is not a plain column name (letters, digits and '_', not starting with a digit)"
        )))
    }
}

/// A user query, checked to be one statement.
pub(crate) fn one_statement(query: &str, what: &str) -> Result<String, VerifyError> {
    let q = query.trim().trim_end_matches(';').trim();
    if q.is_empty() || q.contains(';') {
        return Err(VerifyError::Config(format!(
            "{what} must be exactly one SELECT statement"
        )));
    }
    Ok(q.to_owned())
}

impl VerifyConfig {
    /// Reads a TOML config.
    pub fn from_toml(text: &str) -> Result<Self, VerifyError> {
        let config: VerifyConfig =
            toml::from_str(text).map_err(|e| VerifyError::Config(e.to_string()))?;
        config.validate()?;
        Ok(config)
    }

    /// The currency columns of check `name`, if its currency is compared.
    pub fn currency_of(&self, name: &str) -> Option<&CurrencyColumns> {
        self.currencies.iter().find(|c| c.check == name)
    }

    /// Checks names and queries before anything connects.
    pub fn validate(&self) -> Result<(), VerifyError> {
        if self.checks.is_empty() && self.unique.is_empty() && self.empty.is_empty() {
            return Err(VerifyError::Config(
                "the config has no [[check]], no [[unique]] and no [[empty]]".to_owned(),
            ));
        }
        for c in &self.checks {
            for (side, s) in [("source", &c.source), ("target", &c.target)] {
                let what = format!("check {:?} {side}", c.name);
                one_statement(&s.query, &format!("{what} query"))?;
                column(&s.key, &format!("{what} key"))?;
                for col in [&s.amount, &s.event_type_column, &s.aggregate_id]
                    .into_iter()
                    .flatten()
                {
                    column(col, &format!("{what} column"))?;
                }
            }
            if c.source.amount.is_some() != c.target.amount.is_some() {
                return Err(VerifyError::Config(format!(
                    "check {:?}: name the amount column on both sides or on neither",
                    c.name
                )));
            }
            if c.locate.is_some() && c.source.aggregate_id.is_none() {
                return Err(VerifyError::Config(format!(
                    "check {:?}: [check.locate] needs source.aggregate_id",
                    c.name
                )));
            }
            if let Some(l) = &c.locate
                && l.intents_db.is_some() != l.effect.is_some()
            {
                return Err(VerifyError::Config(format!(
                    "check {:?}: name both locate.intents_db and locate.effect, or neither",
                    c.name
                )));
            }
        }
        for cur in &self.currencies {
            if !self.checks.iter().any(|c| c.name == cur.check) {
                return Err(VerifyError::Config(format!(
                    "[[currency]] names check {:?}, and there is no [[check]] of that name",
                    cur.check
                )));
            }
            column(
                &cur.source,
                &format!("currency of check {:?} source", cur.check),
            )?;
            column(
                &cur.target,
                &format!("currency of check {:?} target", cur.check),
            )?;
        }
        for e in &self.empty {
            one_statement(&e.query, &format!("empty {:?} query", e.name))?;
            column(&e.key, &format!("empty {:?} key", e.name))?;
        }
        for u in &self.unique {
            one_statement(&u.query, &format!("unique {:?} query", u.name))?;
            column(&u.key, &format!("unique {:?} key", u.name))?;
        }
        Ok(())
    }

    /// The config as TOML, as [`VerifyConfig::from_toml`] reads it (a pipeline's config written
    /// by a tool, for `idem verify --config`).
    pub fn to_toml(&self) -> Result<String, VerifyError> {
        toml::to_string(self).map_err(|e| VerifyError::Config(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_file_names_queries_keys_and_amounts() {
        let c = VerifyConfig::from_toml(
            r#"
            [[check]]
            name = "invoices"
            source = { db = "postgres://h/a", query = "SELECT id, total FROM invoices", key = "id", amount = "total" }
            target = { db = "sqlite://b.db", query = "SELECT invoice_id, total FROM ledger;", key = "invoice_id", amount = "total" }
            "#,
        )
        .unwrap();
        assert_eq!(c.checks[0].target.key, "invoice_id");
        for bad in [
            r#"[[check]]
name = "x"
source = { db = "postgres://h/a", query = "SELECT 1; DROP TABLE t", key = "id" }
target = { db = "postgres://h/a", query = "SELECT 1", key = "id" }"#,
            r#"[[check]]
name = "x"
source = { db = "postgres://h/a", query = "SELECT 1", key = "id\" OR 1=1" }
target = { db = "postgres://h/a", query = "SELECT 1", key = "id" }"#,
            r#"[[check]]
name = "x"
source = { db = "postgres://h/a", query = "SELECT 1", key = "id", amount = "a" }
target = { db = "postgres://h/a", query = "SELECT 1", key = "id" }"#,
            "",
            "[[check]]\nname = \"x\"\nsurprise = 1",
            r#"[[check]]
name = "x"
source = { db = "postgres://h/a", query = "SELECT 1", key = "id" }
target = { db = "postgres://h/a", query = "SELECT 1", key = "id" }
[[currency]]
check = "y"
source = "c"
target = "c""#,
        ] {
            assert!(
                matches!(VerifyConfig::from_toml(bad), Err(VerifyError::Config(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn a_config_written_as_toml_reads_back_the_same() {
        let c = VerifyConfig::from_toml(
            r#"
            [[check]]
            name = "invoices"
            event_type = "invoice.issued"
            source = { db = "postgres://h/a", query = "SELECT id, total, cur, inv FROM invoices", key = "id", amount = "total", aggregate_id = "inv" }
            target = { db = "sqlite://b.db", query = "SELECT invoice_id, total, cur FROM ledger", key = "invoice_id", amount = "total" }
            locate = { aggregate_type = "invoice", event_type = "invoice.issued", inbox_db = "sqlite://b.db", consumer_group = "ledger" }
            [[unique]]
            name = "one entry per invoice"
            db = "sqlite://b.db"
            query = "SELECT invoice_id FROM ledger"
            key = "invoice_id"
            [[currency]]
            check = "invoices"
            source = "cur"
            target = "cur"
            [tables]
            prefix = "app_"
            "#,
        )
        .unwrap();
        let text = c.to_toml().unwrap();
        assert_eq!(VerifyConfig::from_toml(&text).unwrap(), c, "{text}");
        assert!(
            !text.contains("outbox_db"),
            "an unset option is left out: {text}"
        );
    }
}
