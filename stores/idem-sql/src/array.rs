//! [`Array`]: one parameter holding a column of values, so that a statement written once for
//! both dialects can insert or look up a whole batch in one round trip.

use idem_core::EventId;

/// A column of values bound as **one** parameter: a PostgreSQL array (`text[]`, `bigint[]`,
/// `int[]`, `uuid[]`; read it with `unnest($1::text[])` or `= ANY($1)`), or, on SQLite, a JSON
/// array as text (read it with `json_each(?1)`). With [`Statement::bind`](crate::Statement::bind)
/// a set-based statement binds a batch in one parameter per column, whatever its size.
///
/// On PostgreSQL:
///
/// ```no_run
/// # async fn demo<C: idem_sql::SqlConnection>(conn: &mut C, ids: &[idem_core::EventId]) -> sqlx::Result<u64> {
/// use idem_sql::{Array, Statement};
/// Statement::<C::Dialect>::new("INSERT INTO audit_log (event_id) SELECT unnest($1::uuid[])")
///     .bind(Array::event_ids(ids))
///     .execute(conn)
///     .await
/// # }
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Array<T>(pub Vec<T>);

impl<T: Element> Array<T> {
    /// The column `values`.
    pub fn new(values: Vec<T>) -> Self {
        Array(values)
    }
}

impl Array<uuid::Uuid> {
    /// Event ids, as each database stores them: `uuid` on PostgreSQL, hyphenated text on SQLite
    /// (as [`Statement::event_id`](crate::Statement::event_id) binds one).
    pub fn event_ids(ids: &[EventId]) -> Self {
        Array(ids.iter().map(EventId::as_uuid).collect())
    }
}

impl<T: Element> FromIterator<T> for Array<T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        Array(iter.into_iter().collect())
    }
}

/// A value an [`Array`] holds: `String`, `Option<String>` (NULL when `None`), `i64`, `i32` or
/// a `uuid::Uuid`. Sealed.
pub trait Element: Send + sealed::Sealed {
    /// The value in a SQLite JSON array.
    fn json(&self) -> serde_json::Value;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for String {}
    impl Sealed for Option<String> {}
    impl Sealed for i64 {}
    impl Sealed for i32 {}
    impl Sealed for uuid::Uuid {}
}

impl Element for String {
    fn json(&self) -> serde_json::Value {
        serde_json::Value::String(self.clone())
    }
}

impl Element for Option<String> {
    fn json(&self) -> serde_json::Value {
        self.clone()
            .map_or(serde_json::Value::Null, serde_json::Value::String)
    }
}

impl Element for i64 {
    fn json(&self) -> serde_json::Value {
        serde_json::Value::from(*self)
    }
}

impl Element for i32 {
    fn json(&self) -> serde_json::Value {
        serde_json::Value::from(*self)
    }
}

impl Element for uuid::Uuid {
    fn json(&self) -> serde_json::Value {
        serde_json::Value::String(self.hyphenated().to_string())
    }
}

#[cfg(feature = "postgres")]
impl<T> sqlx::Type<sqlx::Postgres> for Array<T>
where
    Vec<T>: sqlx::Type<sqlx::Postgres>,
{
    fn type_info() -> sqlx::postgres::PgTypeInfo {
        <Vec<T> as sqlx::Type<sqlx::Postgres>>::type_info()
    }

    fn compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
        <Vec<T> as sqlx::Type<sqlx::Postgres>>::compatible(ty)
    }
}

#[cfg(feature = "postgres")]
impl<'q, T> sqlx::Encode<'q, sqlx::Postgres> for Array<T>
where
    Vec<T>: sqlx::Encode<'q, sqlx::Postgres>,
{
    fn encode_by_ref(
        &self,
        buf: &mut sqlx::postgres::PgArgumentBuffer,
    ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
        self.0.encode_by_ref(buf)
    }
}

#[cfg(feature = "sqlite")]
impl<T: Element> sqlx::Type<sqlx::Sqlite> for Array<T> {
    fn type_info() -> sqlx::sqlite::SqliteTypeInfo {
        <String as sqlx::Type<sqlx::Sqlite>>::type_info()
    }
}

#[cfg(feature = "sqlite")]
impl<'q, T: Element> sqlx::Encode<'q, sqlx::Sqlite> for Array<T> {
    fn encode_by_ref(
        &self,
        buf: &mut Vec<sqlx::sqlite::SqliteArgumentValue<'q>>,
    ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
        let json = serde_json::Value::Array(self.0.iter().map(Element::json).collect());
        <String as sqlx::Encode<'q, sqlx::Sqlite>>::encode(json.to_string(), buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sqlite_array_is_a_json_array_of_its_values() {
        let id = EventId::new();
        let ids = Array::event_ids(&[id]);
        let as_json = |a: Vec<serde_json::Value>| serde_json::Value::Array(a).to_string();
        assert_eq!(
            as_json(ids.0.iter().map(Element::json).collect()),
            format!("[\"{id}\"]")
        );
        let texts: Array<String> = ["a\"b".to_owned()].into_iter().collect();
        assert_eq!(
            as_json(texts.0.iter().map(Element::json).collect()),
            r#"["a\"b"]"#
        );
        assert_eq!(Array::new(vec![1_i64, -2]).0[1].json(), -2);
    }
}
