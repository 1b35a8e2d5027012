//! Validated names for idem's tables.
//!
//! SQL identifiers cannot be bound as parameters, so idem splices them into its SQL text. They
//! come only from [`TableNames`], whose schema and prefix are checked against a strict pattern
//! (`[a-z_][a-z0-9_]*`) and then double-quoted. Nothing from an event or a request ever reaches
//! an identifier.

use crate::error::{Error, Result};

/// Longest schema name or table prefix accepted (PostgreSQL identifiers are at most 63 bytes and
/// idem appends up to 28 bytes of its own, as in `<prefix>outbox_pending_aggregate_idx`).
pub const MAX_IDENT_LEN: usize = 32;

/// Where idem's tables live: an optional schema and a table-name prefix (default `idem_`).
///
/// ```
/// use idem_core::TableNames;
/// let t = TableNames::new(Some("billing"), "idem_")?;
/// assert_eq!(t.qualified("outbox"), r#""billing"."idem_outbox""#);
/// assert!(TableNames::new(Some("x; drop table y"), "idem_").is_err());
/// # Ok::<(), idem_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableNames {
    schema: Option<String>,
    prefix: String,
}

impl Default for TableNames {
    fn default() -> Self {
        TableNames {
            schema: None,
            prefix: "idem_".to_owned(),
        }
    }
}

impl TableNames {
    /// Validates `schema` and `prefix`. The prefix may be empty.
    pub fn new(schema: Option<&str>, prefix: &str) -> Result<Self> {
        if let Some(s) = schema {
            check_ident("schema", s, false)?;
        }
        check_ident("table prefix", prefix, true)?;
        Ok(TableNames {
            schema: schema.map(str::to_owned),
            prefix: prefix.to_owned(),
        })
    }

    /// The schema, if one is set.
    pub fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// The table prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The bare (unquoted, unqualified) name of table `base`, e.g. `idem_outbox`.
    pub fn bare(&self, base: &str) -> String {
        format!("{}{}", self.prefix, base)
    }

    /// The quoted, schema-qualified name of table `base`, e.g. `"idem_outbox"`.
    pub fn qualified(&self, base: &str) -> String {
        match &self.schema {
            Some(s) => format!("\"{s}\".\"{}{base}\"", self.prefix),
            None => format!("\"{}{base}\"", self.prefix),
        }
    }

    /// Replaces `{name}` placeholders in `sql` with [`Self::qualified`] names and `{bare:name}`
    /// with [`Self::bare`] names, for the table bases listed in `bases`.
    pub fn render(&self, sql: &str, bases: &[&str]) -> String {
        let mut out = sql.to_owned();
        for base in bases {
            out = out.replace(&format!("{{bare:{base}}}"), &self.bare(base));
            out = out.replace(&format!("{{{base}}}"), &self.qualified(base));
        }
        if let Some(s) = &self.schema {
            out = out.replace("{schema}", &format!("\"{s}\""));
        }
        out
    }
}

fn check_ident(what: &'static str, value: &str, allow_empty: bool) -> Result<()> {
    let err = |reason| {
        Err(Error::InvalidIdentifier {
            what,
            value: value.to_owned(),
            reason,
        })
    };
    if value.is_empty() {
        return if allow_empty {
            Ok(())
        } else {
            err("must not be empty")
        };
    }
    if value.len() > MAX_IDENT_LEN {
        return err("is longer than 32 bytes");
    }
    let mut chars = value.chars();
    if !chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
    {
        return err("must start with a lowercase ASCII letter or '_'");
    }
    if !chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_') {
        return err("may contain only lowercase ASCII letters, digits and '_'");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_names() {
        let t = TableNames::default();
        assert_eq!(t.qualified("outbox"), "\"idem_outbox\"");
        assert_eq!(
            t.render("SELECT * FROM {outbox} -- {bare:outbox}", &["outbox"]),
            "SELECT * FROM \"idem_outbox\" -- idem_outbox"
        );
    }

    #[test]
    fn hostile_identifiers_are_refused() {
        for bad in ["Public", "a\"b", "a;b", "1abc", "a b", "é", &"a".repeat(33)] {
            assert!(
                TableNames::new(Some(bad), "idem_").is_err(),
                "schema {bad:?} accepted"
            );
            assert!(
                TableNames::new(None, bad).is_err(),
                "prefix {bad:?} accepted"
            );
        }
        assert!(TableNames::new(None, "").is_ok());
        assert!(TableNames::new(Some(""), "x_").is_err());
    }
}
