//! A decoder for the pgoutput messages the CDC relay reads from the outbox table's publication:
//! protocol version 1, text format (PostgreSQL 15, "Logical Replication Message Formats").
//!
//! The replication client turns Begin (`B`), Commit (`C`) and logical decoding messages (`M`)
//! into typed events itself and forwards every other message raw; [`Decoder::decode`] takes one
//! of those raw messages. It handles:
//!
//! - `R` Relation: the table's shape, kept in a cache keyed by its oid. PostgreSQL sends it
//!   before the first change of a relation in a session and again after the table changed, so
//!   a relation sent again replaces the cached one.
//! - `I` Insert: the new row as text values, checked against its relation's column count.
//! - `U` Update, `D` Delete, `T` Truncate: reported as [`Change::Ignored`] so the relay can count
//!   them. The outbox publication publishes inserts only; these mean someone altered it.
//! - `Y` Type and `O` Origin: skipped.
//!
//! **Invariant**: every input, however malformed or hostile, is either decoded or refused with
//! a typed [`PgOutputError`]; the decoder never panics and never allocates more than the input
//! can hold (a length or a count is checked against the bytes actually left before use).

use std::collections::HashMap;
use std::sync::Arc;

/// One column of a [`Relation`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Column {
    /// Flags: 1 when the column is part of the replica identity key.
    pub flags: u8,
    /// The column's name.
    pub name: String,
    /// The oid of the column's data type (`pg_type.oid`).
    pub type_oid: u32,
    /// The type modifier (`atttypmod`), -1 when there is none.
    pub type_modifier: i32,
}

/// A table's shape as the server announced it in a Relation message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Relation {
    /// The relation's oid, the key later changes refer to it by.
    pub oid: u32,
    /// The schema name (empty for `pg_catalog`).
    pub namespace: String,
    /// The table name.
    pub name: String,
    /// The replica identity setting (`d`, `n`, `f` or `i`, as a byte).
    pub replica_identity: u8,
    /// The published columns, in the order the tuples carry them.
    pub columns: Vec<Column>,
}

impl Relation {
    /// The position of the column called `name` in this relation's tuples.
    pub fn column_index(&self, name: &str) -> Option<usize> {
        self.columns.iter().position(|c| c.name == name)
    }
}

/// A change that is not an insert, reported so the relay can count it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IgnoredKind {
    /// An `UPDATE` (`U`).
    Update,
    /// A `DELETE` (`D`).
    Delete,
    /// A `TRUNCATE` (`T`).
    Truncate,
}

/// Messages decoded but of no use to the relay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SkippedKind {
    /// A Type message (`Y`): a non-built-in type's name.
    Type,
    /// An Origin message (`O`): the transaction came from another node.
    Origin,
}

/// One decoded pgoutput message.
#[derive(Clone, Debug, PartialEq)]
pub enum Change<'m> {
    /// A Relation message, now in the cache.
    Relation(Arc<Relation>),
    /// A new row of `relation`: one text value per column, `None` for SQL `NULL`.
    Insert {
        /// The table the row was inserted into.
        relation: Arc<Relation>,
        /// The row's values in the relation's column order.
        values: Vec<Option<&'m str>>,
    },
    /// An update, delete or truncate. `relation` is the relation it names (for a truncate, the
    /// first of the relations it names), `None` when the cache does not know it.
    Ignored {
        /// Which kind of change.
        kind: IgnoredKind,
        /// The relation it applies to, if known.
        relation: Option<Arc<Relation>>,
    },
    /// A Type or Origin message.
    Skipped(SkippedKind),
}

/// Why a pgoutput message could not be decoded. The relay stops on any of them: the stream is
/// not what the publication should carry, and skipping a message could skip an event.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PgOutputError {
    /// The message is empty.
    #[error("empty pgoutput message")]
    Empty,
    /// The message ends before a field it must hold.
    #[error(
        "pgoutput message '{tag}' is truncated: {field} needs {needed} bytes at offset {at}, {left} left"
    )]
    Truncated {
        /// The message tag.
        tag: char,
        /// The field being read.
        field: &'static str,
        /// Bytes the field needs.
        needed: usize,
        /// Offset of the field in the message.
        at: usize,
        /// Bytes left at that offset.
        left: usize,
    },
    /// A string has no terminating NUL byte.
    #[error("pgoutput message '{tag}': {field} at offset {at} has no terminating NUL")]
    Unterminated {
        /// The message tag.
        tag: char,
        /// The field being read.
        field: &'static str,
        /// Offset of the string.
        at: usize,
    },
    /// A string or a text value is not UTF-8 (the relay expects a UTF-8 database).
    #[error("pgoutput message '{tag}': {field} is not valid UTF-8")]
    InvalidUtf8 {
        /// The message tag.
        tag: char,
        /// The field being read.
        field: &'static str,
    },
    /// A count or a length is negative.
    #[error("pgoutput message '{tag}': {field} is negative ({value})")]
    Negative {
        /// The message tag.
        tag: char,
        /// The field being read.
        field: &'static str,
        /// The value read.
        value: i64,
    },
    /// A change names a relation no Relation message announced.
    #[error(
        "pgoutput message '{tag}' names relation oid {oid}, which no Relation message announced"
    )]
    UnknownRelation {
        /// The message tag.
        tag: char,
        /// The oid it names.
        oid: u32,
    },
    /// An insert's tuple has another number of columns than its relation.
    #[error("insert into {relation}: the tuple has {found} columns, the relation {expected}")]
    ColumnCountMismatch {
        /// `namespace.name` of the relation.
        relation: String,
        /// Columns of the relation.
        expected: usize,
        /// Columns in the tuple.
        found: usize,
    },
    /// An insert carries a value the relay cannot use: binary (the relay asks for text) or
    /// unchanged TOAST (impossible in a new row).
    #[error("insert into {relation}: column {column} is {kind}, not text")]
    UnsupportedValue {
        /// `namespace.name` of the relation.
        relation: String,
        /// The column's name.
        column: String,
        /// What it was.
        kind: &'static str,
    },
    /// A tuple column starts with an unknown kind byte.
    #[error("pgoutput message '{tag}': unknown tuple value kind {byte:#04x}")]
    UnknownValueKind {
        /// The message tag.
        tag: char,
        /// The kind byte.
        byte: u8,
    },
    /// An insert's tuple does not start with `N`.
    #[error("insert: expected the new tuple marker 'N', found {byte:#04x}")]
    MissingNewTuple {
        /// The byte found.
        byte: u8,
    },
    /// Bytes are left after a complete message.
    #[error("pgoutput message '{tag}' has {count} bytes after its end")]
    TrailingBytes {
        /// The message tag.
        tag: char,
        /// Bytes left.
        count: usize,
    },
    /// Begin, Commit or Message arrived raw: the replication client should have turned them
    /// into events.
    #[error("pgoutput message '{tag}' should have been handled by the replication client")]
    Boundary {
        /// The message tag.
        tag: char,
    },
    /// A tag this decoder does not know (for example a streaming message of protocol 2).
    #[error("unknown pgoutput message tag {byte:#04x} (the relay speaks protocol version 1)")]
    UnknownTag {
        /// The tag byte.
        byte: u8,
    },
}

/// Reads the fields of one message, each read checked against the bytes left.
struct Reader<'a> {
    tag: char,
    buf: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], PgOutputError> {
        let (head, rest) = self
            .buf
            .split_at_checked(n)
            .ok_or(PgOutputError::Truncated {
                tag: self.tag,
                field,
                needed: n,
                at: self.at,
                left: self.buf.len(),
            })?;
        self.buf = rest;
        self.at += n;
        Ok(head)
    }

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], PgOutputError> {
        let bytes = self.take(N, field)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn u8(&mut self, field: &'static str) -> Result<u8, PgOutputError> {
        Ok(u8::from_be_bytes(self.array(field)?))
    }

    fn i16(&mut self, field: &'static str) -> Result<i16, PgOutputError> {
        Ok(i16::from_be_bytes(self.array(field)?))
    }

    fn i32(&mut self, field: &'static str) -> Result<i32, PgOutputError> {
        Ok(i32::from_be_bytes(self.array(field)?))
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, PgOutputError> {
        Ok(u32::from_be_bytes(self.array(field)?))
    }

    /// A count or a length: an Int16 or Int32 that must not be negative.
    fn count(&mut self, value: i64, field: &'static str) -> Result<usize, PgOutputError> {
        usize::try_from(value).map_err(|_| PgOutputError::Negative {
            tag: self.tag,
            field,
            value,
        })
    }

    fn utf8(&self, bytes: &'a [u8], field: &'static str) -> Result<&'a str, PgOutputError> {
        std::str::from_utf8(bytes).map_err(|_| PgOutputError::InvalidUtf8 {
            tag: self.tag,
            field,
        })
    }

    /// A NUL-terminated string.
    fn cstr(&mut self, field: &'static str) -> Result<String, PgOutputError> {
        let end = self
            .buf
            .iter()
            .position(|b| *b == 0)
            .ok_or(PgOutputError::Unterminated {
                tag: self.tag,
                field,
                at: self.at,
            })?;
        let bytes = self.take(end, field)?;
        self.take(1, field)?;
        Ok(self.utf8(bytes, field)?.to_owned())
    }

    /// A capacity for `n` items of at least `min_size` bytes each: never more than the bytes
    /// left could hold, so an absurd count allocates nothing.
    fn capacity(&self, n: usize, min_size: usize) -> usize {
        n.min(self.buf.len() / min_size.max(1))
    }

    fn finish(self) -> Result<(), PgOutputError> {
        match self.buf.len() {
            0 => Ok(()),
            count => Err(PgOutputError::TrailingBytes {
                tag: self.tag,
                count,
            }),
        }
    }
}

/// Decodes pgoutput messages and keeps the relation cache they refer to.
///
/// One decoder per replication session: the server sends a relation again in a new session
/// before its first change, so the cache starts empty each time.
#[derive(Debug, Default)]
pub struct Decoder {
    relations: HashMap<u32, Arc<Relation>>,
}

impl Decoder {
    /// A decoder with an empty relation cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// The cached relation with `oid`.
    pub fn relation(&self, oid: u32) -> Option<&Arc<Relation>> {
        self.relations.get(&oid)
    }

    /// Decodes one raw pgoutput message (the `XLogData` payload).
    pub fn decode<'m>(&mut self, message: &'m [u8]) -> Result<Change<'m>, PgOutputError> {
        let (&byte, body) = message.split_first().ok_or(PgOutputError::Empty)?;
        let mut r = Reader {
            tag: char::from(byte),
            buf: body,
            at: 1,
        };
        let change = match byte {
            b'R' => {
                let relation = Arc::new(read_relation(&mut r)?);
                self.relations.insert(relation.oid, Arc::clone(&relation));
                Change::Relation(relation)
            }
            b'I' => self.read_insert(&mut r)?,
            b'U' => self.ignored(&mut r, IgnoredKind::Update)?,
            b'D' => self.ignored(&mut r, IgnoredKind::Delete)?,
            b'T' => self.read_truncate(&mut r)?,
            // The contents of Type and Origin messages are of no use: not parsed further.
            b'Y' => return Ok(Change::Skipped(SkippedKind::Type)),
            b'O' => return Ok(Change::Skipped(SkippedKind::Origin)),
            b'B' | b'C' | b'M' => return Err(PgOutputError::Boundary { tag: r.tag }),
            _ => return Err(PgOutputError::UnknownTag { byte }),
        };
        r.finish()?;
        Ok(change)
    }

    fn known(&self, r: &Reader<'_>, oid: u32) -> Result<Arc<Relation>, PgOutputError> {
        self.relations
            .get(&oid)
            .cloned()
            .ok_or(PgOutputError::UnknownRelation { tag: r.tag, oid })
    }

    fn read_insert<'m>(&self, r: &mut Reader<'m>) -> Result<Change<'m>, PgOutputError> {
        let oid = r.u32("relation oid")?;
        let relation = self.known(r, oid)?;
        let marker = r.u8("new tuple marker")?;
        if marker != b'N' {
            return Err(PgOutputError::MissingNewTuple { byte: marker });
        }
        let values = read_text_tuple(r, &relation)?;
        Ok(Change::Insert { relation, values })
    }

    /// An update or delete: only the relation is read; the tuples that follow are not decoded.
    fn ignored<'m>(
        &self,
        r: &mut Reader<'m>,
        kind: IgnoredKind,
    ) -> Result<Change<'m>, PgOutputError> {
        let oid = r.u32("relation oid")?;
        r.buf = &[];
        Ok(Change::Ignored {
            kind,
            relation: self.relations.get(&oid).cloned(),
        })
    }

    fn read_truncate<'m>(&self, r: &mut Reader<'m>) -> Result<Change<'m>, PgOutputError> {
        let n = i64::from(r.i32("relation count")?);
        let n = r.count(n, "relation count")?;
        r.u8("options")?;
        let mut first = None;
        for _ in 0..n {
            let oid = r.u32("relation oid")?;
            if first.is_none() {
                first = Some(self.relations.get(&oid).cloned());
            }
        }
        Ok(Change::Ignored {
            kind: IgnoredKind::Truncate,
            relation: first.flatten(),
        })
    }
}

fn read_relation(r: &mut Reader<'_>) -> Result<Relation, PgOutputError> {
    let oid = r.u32("relation oid")?;
    let namespace = r.cstr("namespace")?;
    let name = r.cstr("relation name")?;
    let replica_identity = r.u8("replica identity")?;
    let n = i64::from(r.i16("column count")?);
    let n = r.count(n, "column count")?;
    // A column takes at least 10 bytes: flags, an empty name's NUL, type oid, modifier.
    let mut columns = Vec::with_capacity(r.capacity(n, 10));
    for _ in 0..n {
        columns.push(Column {
            flags: r.u8("column flags")?,
            name: r.cstr("column name")?,
            type_oid: r.u32("column type oid")?,
            type_modifier: r.i32("column type modifier")?,
        });
    }
    Ok(Relation {
        oid,
        namespace,
        name,
        replica_identity,
        columns,
    })
}

fn read_text_tuple<'m>(
    r: &mut Reader<'m>,
    relation: &Relation,
) -> Result<Vec<Option<&'m str>>, PgOutputError> {
    let n = i64::from(r.i16("tuple column count")?);
    let n = r.count(n, "tuple column count")?;
    let qualified = || format!("{}.{}", relation.namespace, relation.name);
    if n != relation.columns.len() {
        return Err(PgOutputError::ColumnCountMismatch {
            relation: qualified(),
            expected: relation.columns.len(),
            found: n,
        });
    }
    let mut values = Vec::with_capacity(r.capacity(n, 1));
    for column in &relation.columns {
        let unsupported = |kind| PgOutputError::UnsupportedValue {
            relation: qualified(),
            column: column.name.clone(),
            kind,
        };
        match r.u8("tuple value kind")? {
            b'n' => values.push(None),
            b't' => values.push(Some(read_text_value(r)?)),
            b'u' => return Err(unsupported("an unchanged TOAST value")),
            b'b' => return Err(unsupported("binary")),
            byte => return Err(PgOutputError::UnknownValueKind { tag: r.tag, byte }),
        }
    }
    Ok(values)
}

fn read_text_value<'m>(r: &mut Reader<'m>) -> Result<&'m str, PgOutputError> {
    let len = i64::from(r.i32("value length")?);
    let len = r.count(len, "value length")?;
    let bytes = r.take(len, "value")?;
    r.utf8(bytes, "value")
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Builds pgoutput messages byte by byte, as the server writes them.
    #[derive(Default)]
    pub(crate) struct Enc(pub(crate) Vec<u8>);

    impl Enc {
        pub(crate) fn tag(t: u8) -> Self {
            Enc(vec![t])
        }
        pub(crate) fn u8(mut self, v: u8) -> Self {
            self.0.push(v);
            self
        }
        pub(crate) fn i16(mut self, v: i16) -> Self {
            self.0.extend_from_slice(&v.to_be_bytes());
            self
        }
        pub(crate) fn i32(mut self, v: i32) -> Self {
            self.0.extend_from_slice(&v.to_be_bytes());
            self
        }
        pub(crate) fn u32(mut self, v: u32) -> Self {
            self.0.extend_from_slice(&v.to_be_bytes());
            self
        }
        pub(crate) fn cstr(mut self, s: &str) -> Self {
            self.0.extend_from_slice(s.as_bytes());
            self.0.push(0);
            self
        }
        pub(crate) fn text(self, s: &str) -> Self {
            let len = i32::try_from(s.len()).unwrap_or(i32::MAX);
            let mut e = self.u8(b't').i32(len);
            e.0.extend_from_slice(s.as_bytes());
            e
        }
    }

    /// A Relation message for `oid` with `(name, type oid)` columns.
    pub(crate) fn relation_msg(oid: u32, ns: &str, name: &str, cols: &[(&str, u32)]) -> Vec<u8> {
        let n = i16::try_from(cols.len()).unwrap_or(i16::MAX);
        let mut e = Enc::tag(b'R').u32(oid).cstr(ns).cstr(name).u8(b'd').i16(n);
        for (col, ty) in cols {
            e = e.u8(0).cstr(col).u32(*ty).i32(-1);
        }
        e.0
    }

    /// An Insert message for `oid` with text values (`None` = NULL).
    pub(crate) fn insert_msg(oid: u32, values: &[Option<&str>]) -> Vec<u8> {
        let n = i16::try_from(values.len()).unwrap_or(i16::MAX);
        let mut e = Enc::tag(b'I').u32(oid).u8(b'N').i16(n);
        for v in values {
            e = match v {
                Some(s) => e.text(s),
                None => e.u8(b'n'),
            };
        }
        e.0
    }

    fn two_columns() -> Vec<u8> {
        relation_msg(16384, "public", "t", &[("id", 20), ("body", 25)])
    }

    fn decoder() -> Decoder {
        let mut d = Decoder::new();
        d.decode(&two_columns()).unwrap();
        d
    }

    #[test]
    fn a_relation_then_an_insert_decode() {
        let mut d = Decoder::new();
        let Change::Relation(rel) = d.decode(&two_columns()).unwrap() else {
            panic!("not a relation")
        };
        assert_eq!(rel.namespace, "public");
        assert_eq!(rel.name, "t");
        assert_eq!(rel.columns[1].name, "body");
        assert_eq!(rel.columns[1].type_oid, 25);
        assert_eq!(rel.column_index("body"), Some(1));
        let msg = insert_msg(16384, &[Some("7"), None]);
        let change = d.decode(&msg).unwrap();
        let Change::Insert { relation, values } = change else {
            panic!("not an insert")
        };
        assert_eq!(relation.oid, 16384);
        assert_eq!(values, vec![Some("7"), None]);
    }

    #[test]
    fn a_relation_sent_again_replaces_the_cached_shape() {
        let mut d = decoder();
        let wider = relation_msg(16384, "public", "t", &[("id", 20), ("body", 25), ("x", 23)]);
        d.decode(&wider).unwrap();
        let err = d
            .decode(&insert_msg(16384, &[Some("7"), None]))
            .unwrap_err();
        assert!(
            matches!(
                err,
                PgOutputError::ColumnCountMismatch {
                    expected: 3,
                    found: 2,
                    ..
                }
            ),
            "{err}"
        );
        let msg = insert_msg(16384, &[Some("7"), None, Some("1")]);
        let ok = d.decode(&msg);
        assert!(matches!(ok, Ok(Change::Insert { .. })), "{ok:?}");
    }

    #[test]
    fn an_insert_of_an_unknown_relation_is_refused() {
        let err = decoder()
            .decode(&insert_msg(99, &[Some("7"), None]))
            .unwrap_err();
        assert_eq!(err, PgOutputError::UnknownRelation { tag: 'I', oid: 99 });
    }

    #[test]
    fn binary_and_unchanged_values_are_refused() {
        // A second column of kind `kind` after a text "7", with `rest` after the kind byte.
        let second = |kind: u8, rest: &[u8]| {
            let mut m = Enc::tag(b'I')
                .u32(16384)
                .u8(b'N')
                .i16(2)
                .text("7")
                .u8(kind)
                .0;
            m.extend_from_slice(rest);
            decoder().decode(&m).unwrap_err()
        };
        let err = second(b'b', &[0, 0, 0, 1, 0]);
        assert!(
            matches!(err, PgOutputError::UnsupportedValue { kind: "binary", .. }),
            "{err}"
        );
        let err = second(b'u', &[]);
        assert!(
            matches!(err, PgOutputError::UnsupportedValue { .. }),
            "{err}"
        );
        let err = second(b'x', &[]);
        assert!(
            matches!(err, PgOutputError::UnknownValueKind { byte: b'x', .. }),
            "{err}"
        );
    }

    #[test]
    fn invalid_utf8_is_refused() {
        let mut bad = Enc::tag(b'I').u32(16384).u8(b'N').i16(2).u8(b't').i32(2).0;
        bad.extend_from_slice(&[0xff, 0xfe]);
        bad.push(b'n');
        let err = decoder().decode(&bad).unwrap_err();
        assert!(
            matches!(err, PgOutputError::InvalidUtf8 { field: "value", .. }),
            "{err}"
        );
        let mut name = Enc::tag(b'R').u32(1).0;
        name.extend_from_slice(&[0xc3, 0x28, 0]);
        let err = Decoder::new().decode(&name).unwrap_err();
        assert!(
            matches!(
                err,
                PgOutputError::InvalidUtf8 {
                    field: "namespace",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn absurd_lengths_and_counts_are_refused_without_allocating() {
        let negative = Enc::tag(b'I').u32(16384).u8(b'N').i16(2).u8(b't').i32(-1).0;
        let err = decoder().decode(&negative).unwrap_err();
        assert!(
            matches!(err, PgOutputError::Negative { value: -1, .. }),
            "{err}"
        );
        let huge = Enc::tag(b'I')
            .u32(16384)
            .u8(b'N')
            .i16(2)
            .u8(b't')
            .i32(i32::MAX)
            .0;
        let err = decoder().decode(&huge).unwrap_err();
        assert!(
            matches!(err, PgOutputError::Truncated { needed, .. } if needed == 2_147_483_647),
            "{err}"
        );
        let columns = Enc::tag(b'R')
            .u32(1)
            .cstr("s")
            .cstr("t")
            .u8(b'd')
            .i16(i16::MAX)
            .0;
        assert!(matches!(
            Decoder::new().decode(&columns),
            Err(PgOutputError::Truncated { .. })
        ));
        let negative_cols = Enc::tag(b'R').u32(1).cstr("s").cstr("t").u8(b'd').i16(-3).0;
        assert!(matches!(
            Decoder::new().decode(&negative_cols),
            Err(PgOutputError::Negative { .. })
        ));
        let truncate = Enc::tag(b'T').i32(i32::MAX).u8(0).0;
        assert!(matches!(
            Decoder::new().decode(&truncate),
            Err(PgOutputError::Truncated { .. })
        ));
    }

    #[test]
    fn a_wrong_tuple_marker_and_trailing_bytes_are_refused() {
        let mut msg = insert_msg(16384, &[Some("7"), None]);
        if let Some(marker) = msg.get_mut(5) {
            *marker = b'K';
        }
        let err = decoder().decode(&msg).unwrap_err();
        assert_eq!(err, PgOutputError::MissingNewTuple { byte: b'K' });
        let mut long = insert_msg(16384, &[Some("7"), None]);
        long.push(0);
        let err = decoder().decode(&long).unwrap_err();
        assert_eq!(err, PgOutputError::TrailingBytes { tag: 'I', count: 1 });
    }

    #[test]
    fn updates_deletes_and_truncates_are_reported_as_ignored() {
        let mut d = decoder();
        let update = Enc::tag(b'U').u32(16384).u8(b'N').i16(0).0;
        let delete = Enc::tag(b'D').u32(16384).u8(b'K').i16(0).0;
        let truncate = Enc::tag(b'T').i32(2).u8(0).u32(16384).u32(5).0;
        for (msg, kind) in [
            (update, IgnoredKind::Update),
            (delete, IgnoredKind::Delete),
            (truncate, IgnoredKind::Truncate),
        ] {
            match d.decode(&msg).unwrap() {
                Change::Ignored { kind: k, relation } => {
                    assert_eq!(k, kind);
                    assert_eq!(relation.map(|r| r.oid), Some(16384));
                }
                other => panic!("{other:?}"),
            }
        }
        let unknown = Enc::tag(b'D').u32(7).u8(b'K').i16(0).0;
        assert!(matches!(
            d.decode(&unknown),
            Ok(Change::Ignored { relation: None, .. })
        ));
    }

    #[test]
    fn type_and_origin_are_skipped_and_other_tags_refused() {
        let mut d = Decoder::new();
        let ty = Enc::tag(b'Y').u32(1).cstr("public").cstr("mood").0;
        assert_eq!(d.decode(&ty).unwrap(), Change::Skipped(SkippedKind::Type));
        let origin = Enc::tag(b'O').u32(0).u32(0).cstr("node").0;
        assert_eq!(
            d.decode(&origin).unwrap(),
            Change::Skipped(SkippedKind::Origin)
        );
        assert_eq!(
            d.decode(b"B").unwrap_err(),
            PgOutputError::Boundary { tag: 'B' }
        );
        assert_eq!(
            d.decode(b"S\0").unwrap_err(),
            PgOutputError::UnknownTag { byte: b'S' }
        );
        assert_eq!(d.decode(b"").unwrap_err(), PgOutputError::Empty);
    }

    #[test]
    fn every_prefix_of_a_valid_message_is_an_error_not_a_panic() {
        let rel = two_columns();
        for end in 0..rel.len() {
            let prefix = rel.get(..end).unwrap_or_default();
            assert!(
                Decoder::new().decode(prefix).is_err(),
                "relation prefix {end} accepted"
            );
        }
        let ins = insert_msg(16384, &[Some("7"), Some("héllo")]);
        for end in 0..ins.len() {
            let prefix = ins.get(..end).unwrap_or_default();
            assert!(
                decoder().decode(prefix).is_err(),
                "insert prefix {end} accepted"
            );
        }
        assert!(decoder().decode(&ins).is_ok());
    }

    /// xorshift64*: deterministic, no dependency.
    pub(crate) struct Rng(pub(crate) u64);

    impl Rng {
        pub(crate) fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        pub(crate) fn below(&mut self, n: u64) -> u64 {
            self.next() % n.max(1)
        }
        /// Uniform index into `len` items (0 when there are none).
        pub(crate) fn index(&mut self, len: usize) -> usize {
            let n = self.below(u64::try_from(len).unwrap_or(u64::MAX));
            usize::try_from(n).unwrap_or(0)
        }
    }

    #[test]
    fn random_bytes_and_mutations_never_panic() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let valid = [
            two_columns(),
            insert_msg(16384, &[Some("7"), None]),
            Enc::tag(b'T').i32(1).u8(0).u32(16384).0,
        ];
        for round in 0..20_000u64 {
            let mut d = decoder();
            let msg: Vec<u8> = if round % 2 == 0 {
                let len = rng.below(64);
                let mut m: Vec<u8> = (0..len).map(|_| rng.next().to_le_bytes()[3]).collect();
                if let Some(first) = m.first_mut() {
                    *first = b"RIUDTYO"[rng.index(7)];
                }
                m
            } else {
                let pick = rng.index(valid.len());
                let mut m = valid.get(pick).cloned().unwrap_or_default();
                for _ in 0..=rng.below(3) {
                    let at = rng.index(m.len());
                    if let Some(b) = m.get_mut(at) {
                        *b = rng.next().to_le_bytes()[4];
                    }
                }
                m
            };
            let _ = d.decode(&msg);
        }
    }
}
