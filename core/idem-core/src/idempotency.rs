//! `Idempotency-Key` values (IETF `draft-ietf-httpapi-idempotency-key-header`).
//!
//! The header is a Structured Field *Item* whose value is an *sf-string*: `"` + printable ASCII
//! (with `"` and `\` escaped by `\`) + `"`. idem derives the key of an external effect from the
//! event and the effect name — `event-<event id>-<effect>` — so every attempt of one effect,
//! across retries, crashes and restarts, carries the same key, and no attempt ever mints a new
//! one.

use std::fmt;

use crate::event::EventId;

/// The request header that carries the key (the IETF draft's `Idempotency-Key`), as the
/// dispatcher sends it and the server layer reads it; HTTP header names are case-insensitive.
pub const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";

/// Longest key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 255;
/// Longest effect name accepted, in bytes.
pub const MAX_EFFECT_NAME_LEN: usize = 64;

/// Why an `Idempotency-Key` was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The request has no `Idempotency-Key` header.
    #[error("the Idempotency-Key header is required on this route")]
    Missing,
    /// The request has the header more than once.
    #[error("the Idempotency-Key header appears {0} times; send it exactly once")]
    Repeated(usize),
    /// The header value is not an sf-string.
    #[error("the Idempotency-Key header must be a quoted string such as \"a1b2c3\": {0}")]
    NotAString(String),
    /// The key is empty.
    #[error("the Idempotency-Key is empty")]
    Empty,
    /// The key is too long.
    #[error("the Idempotency-Key is {0} bytes long; the limit is 255")]
    TooLong(usize),
    /// The key has a character outside printable ASCII.
    #[error("the Idempotency-Key contains {0:?}; only printable ASCII is allowed")]
    InvalidChar(char),
    /// An effect name is unusable in a key.
    #[error(
        "effect name {0:?} must be 1 to 64 of lowercase ASCII letters, digits, '.', '_' and '-'"
    )]
    InvalidEffect(String),
}

/// A validated idempotency key.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Validates a raw (unquoted) key: 1 to 255 printable ASCII characters.
    pub fn new(raw: impl Into<String>) -> Result<Self, KeyError> {
        let raw = raw.into();
        if raw.is_empty() {
            return Err(KeyError::Empty);
        }
        if raw.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong(raw.len()));
        }
        if let Some(c) = raw.chars().find(|c| !(' '..='~').contains(c)) {
            return Err(KeyError::InvalidChar(c));
        }
        Ok(IdempotencyKey(raw))
    }

    /// The key of effect `effect` of event `event`: `event-<event id>-<effect>`. The same
    /// inputs always give the same key.
    ///
    /// ```
    /// use idem_core::idempotency::IdempotencyKey;
    /// let id: idem_core::EventId = "7f1d0c7e-0000-7000-8000-000000010042".parse()?;
    /// let key = IdempotencyKey::for_effect(id, "points.award")?;
    /// assert_eq!(key.as_str(), "event-7f1d0c7e-0000-7000-8000-000000010042-points.award");
    /// assert_eq!(key.header_value(), "\"event-7f1d0c7e-0000-7000-8000-000000010042-points.award\"");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn for_effect(event: EventId, effect: &str) -> Result<Self, KeyError> {
        let ok = !effect.is_empty()
            && effect.len() <= MAX_EFFECT_NAME_LEN
            && effect.bytes().all(|b| {
                b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-')
            });
        if !ok {
            return Err(KeyError::InvalidEffect(effect.to_owned()));
        }
        IdempotencyKey::new(format!("event-{event}-{effect}"))
    }

    /// The key itself.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The header value: the key as an sf-string.
    pub fn header_value(&self) -> String {
        let mut out = String::with_capacity(self.0.len() + 2);
        out.push('"');
        for c in self.0.chars() {
            if c == '"' || c == '\\' {
                out.push('\\');
            }
            out.push(c);
        }
        out.push('"');
        out
    }

    /// Reads the key from every value of the `Idempotency-Key` header field in a request.
    pub fn from_header_values(values: &[&[u8]]) -> Result<Self, KeyError> {
        match values {
            [] => Err(KeyError::Missing),
            [one] => Self::parse_sf_string(one),
            many => Err(KeyError::Repeated(many.len())),
        }
    }

    fn parse_sf_string(value: &[u8]) -> Result<Self, KeyError> {
        let text = std::str::from_utf8(value)
            .map_err(|_| KeyError::NotAString("the value is not ASCII".to_owned()))?;
        let trimmed = text.trim_matches(' ');
        let inner = trimmed
            .strip_prefix('"')
            .and_then(|s| s.strip_suffix('"'))
            .ok_or_else(|| KeyError::NotAString(format!("{trimmed:?} is not in double quotes")))?;
        let mut key = String::with_capacity(inner.len());
        let mut chars = inner.chars();
        while let Some(c) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some(e @ ('"' | '\\')) => key.push(e),
                    _ => {
                        return Err(KeyError::NotAString(
                            "a backslash may only escape '\"' or '\\'".to_owned(),
                        ));
                    }
                },
                '"' => {
                    return Err(KeyError::NotAString(
                        "an unescaped '\"' inside the string".to_owned(),
                    ));
                }
                c => key.push(c),
            }
        }
        IdempotencyKey::new(key)
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_keys_are_stable_and_distinct_per_effect() {
        let id = EventId::new();
        let a = IdempotencyKey::for_effect(id, "points.award").unwrap();
        assert_eq!(a, IdempotencyKey::for_effect(id, "points.award").unwrap());
        assert_ne!(a, IdempotencyKey::for_effect(id, "email.receipt").unwrap());
        assert_ne!(
            a,
            IdempotencyKey::for_effect(EventId::new(), "points.award").unwrap()
        );
        assert!(IdempotencyKey::for_effect(id, "Points Award").is_err());
        assert!(IdempotencyKey::for_effect(id, "").is_err());
    }

    #[test]
    fn header_values_round_trip() {
        let k = IdempotencyKey::new(r#"a"b\c"#).unwrap();
        assert_eq!(k.header_value(), r#""a\"b\\c""#);
        let back = IdempotencyKey::from_header_values(&[k.header_value().as_bytes()]).unwrap();
        assert_eq!(back, k);
    }

    #[test]
    fn bad_headers_are_refused_with_a_reason() {
        let long = format!("\"{}\"", "k".repeat(256));
        let cases: [(&[&[u8]], KeyError); 7] = [
            (&[], KeyError::Missing),
            (&[b"\"a\"", b"\"b\""], KeyError::Repeated(2)),
            (&[b"\"\""], KeyError::Empty),
            (&[long.as_bytes()], KeyError::TooLong(256)),
            (&[b"\"a\tb\""], KeyError::InvalidChar('\t')),
            (&[b"\"a\x01b\""], KeyError::InvalidChar('\u{1}')),
            (&[b"\"caf\xc3\xa9\""], KeyError::InvalidChar('é')),
        ];
        for (values, want) in cases {
            assert_eq!(IdempotencyKey::from_header_values(values), Err(want));
        }
        for raw in [
            &b"unquoted"[..],
            b"\"open",
            b"\"a\"b\"",
            b"\"bad \\x escape\"",
        ] {
            assert!(
                matches!(
                    IdempotencyKey::from_header_values(&[raw]),
                    Err(KeyError::NotAString(_))
                ),
                "{raw:?}"
            );
        }
    }
}

/// A response stored under an idempotency key, replayed to retries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredResponse {
    /// HTTP status code.
    pub status: u16,
    /// Headers worth replaying (content type and the like).
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
}

/// Proof that a caller holds a key's in-flight claim: a random token stored with the claim.
///
/// Renewing, completing and releasing a claim are fenced by it: a caller whose claim was taken
/// over (its lock ran out) changes nothing, and learns it.
#[derive(Clone, PartialEq, Eq)]
pub struct ClaimToken(String);

impl ClaimToken {
    /// A new random token (a UUID v4: 122 random bits).
    pub fn random() -> Self {
        ClaimToken(uuid::Uuid::new_v4().simple().to_string())
    }

    /// The token as stored.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ClaimToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // A token is a capability over one claim: never in logs.
        f.write_str("ClaimToken(..)")
    }
}

/// What the key store says when a request claims a key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyClaim {
    /// The key is new (or its earlier use expired, or its lock ran out): execute the request.
    /// The token fences what this caller does with the claim.
    New(ClaimToken),
    /// A request with this key is still executing.
    InFlight,
    /// The key was used with a different request (another fingerprint).
    Mismatch,
    /// The request completed before: replay this response.
    Completed(StoredResponse),
}

/// Server-side storage of idempotency keys, scoped per client.
///
/// Claiming is one atomic statement on a unique (scope, key) constraint — never a read followed
/// by an insert — so of concurrent claims of one key exactly one gets [`KeyClaim::New`]. The
/// claim is exclusive while its lock lasts; the holder keeps it with [`renew`](Self::renew)
/// while it executes. Renewing, completing and releasing are fenced by the claim's
/// [`ClaimToken`]: they return `false`, and change nothing, when the caller no longer holds the
/// claim (its lock ran out and a retry took the key over, or the key was swept).
pub trait IdempotencyStore: Clone + Send + Sync + 'static {
    /// Claims `key` for `scope` with the request `fingerprint`. An in-flight claim is exclusive
    /// for `lock` (unless renewed); a completed key is kept for `retention`.
    fn claim(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        fingerprint: &str,
        lock: std::time::Duration,
        retention: std::time::Duration,
    ) -> impl std::future::Future<Output = crate::Result<KeyClaim>> + Send;

    /// Extends the lock of the claim `token` holds to `lock` from now. Returns false when the
    /// claim is not held any more. (A claim whose lock is live is never swept, even past its
    /// retention.)
    fn renew(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: &ClaimToken,
        lock: std::time::Duration,
    ) -> impl std::future::Future<Output = crate::Result<bool>> + Send;

    /// Stores the response of the claim `token` holds. Returns false, storing nothing, when the
    /// claim is not held any more.
    fn complete(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: &ClaimToken,
        response: &StoredResponse,
    ) -> impl std::future::Future<Output = crate::Result<bool>> + Send;

    /// Forgets the claim `token` holds, whose request failed in a way a retry may fix (a 5xx):
    /// the retry executes again. Returns false, deleting nothing, when the claim is not held
    /// any more (another request's claim is never deleted).
    fn release(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: &ClaimToken,
    ) -> impl std::future::Future<Output = crate::Result<bool>> + Send;

    /// Deletes expired keys; returns how many.
    fn sweep(&self) -> impl std::future::Future<Output = crate::Result<u64>> + Send;
}

/// What [`TransactionalKeyStore::claim_in_transaction`] found.
///
/// Only [`TxClaim::New`] leaves a transaction open; the others found the key taken and rolled
/// theirs back.
#[derive(Debug)]
pub enum TxClaim<T> {
    /// The key is this request's, claimed inside the open write transaction `tx`: run the
    /// handler's writes in it, then [`TransactionalKeyStore::complete_and_commit`]; dropping it
    /// rolls the claim and the writes back together.
    New {
        /// The open transaction holding the claim.
        tx: T,
        /// Fences the completion.
        token: ClaimToken,
    },
    /// A request with this key is executing outside a transaction (its lock is live).
    InFlight,
    /// The key was used with a different request (another fingerprint).
    Mismatch,
    /// The request completed before: replay this response.
    Completed(StoredResponse),
}

/// A key store that can claim a key, let the handler write, and store the response in **one**
/// database transaction, so that the handler's effect and the key's completion commit together
/// or not at all.
///
/// Without it the layer commits the claim, the handler's writes and the completion separately:
/// a server that dies between the handler's commit and the completion leaves the effect applied
/// under an in-flight key, and a retry executes again once the lock runs out (only a business
/// key in the handler absorbs that). In one transaction a crash anywhere rolls everything back
/// and a retry executes once; a failed commit is a failed request.
///
/// While the transaction is open the claim is invisible to other requests: a concurrent request
/// with the same key waits on the database (PostgreSQL: on the key's row; SQLite: on the write
/// lock, up to its busy timeout) and then replays the committed response, or claims the key if
/// the first request rolled back. The handler therefore holds a database transaction (on SQLite
/// the database's write lock) for as long as it runs: keep it short.
pub trait TransactionalKeyStore: IdempotencyStore {
    /// An open write transaction on the key store's database.
    type Transaction: Send + 'static;

    /// Opens a write transaction and claims `key` for `scope` in it (as
    /// [`IdempotencyStore::claim`], the claim visible to others only when it commits).
    fn claim_in_transaction(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        fingerprint: &str,
        lock: std::time::Duration,
        retention: std::time::Duration,
    ) -> impl std::future::Future<Output = crate::Result<TxClaim<Self::Transaction>>> + Send;

    /// Stores `response` for the claim `token` holds in `tx` and commits `tx`. Returns false,
    /// having rolled `tx` back, when the claim is not held; an error when the commit failed (the
    /// transaction's writes did not happen, or, when the connection broke during the commit, may
    /// have: a retry then replays or executes, never both).
    fn complete_and_commit(
        &self,
        tx: Self::Transaction,
        scope: &str,
        key: &IdempotencyKey,
        token: &ClaimToken,
        response: &StoredResponse,
    ) -> impl std::future::Future<Output = crate::Result<bool>> + Send;

    /// Rolls `tx` back: the claim and the handler's writes are gone, and a retry executes again.
    fn roll_back(&self, tx: Self::Transaction) -> impl std::future::Future<Output = ()> + Send;
}

/// An external effect a handler asks for, recorded in its own transaction (the "one more
/// outbox"): a dispatcher delivers it later, always with the same key.
#[derive(Clone, Debug, PartialEq)]
pub struct EffectIntent {
    /// The event that caused it.
    pub event_id: EventId,
    /// Effect name (`points.award`): with the event id it makes the key.
    pub effect: String,
    /// Where to send it (an absolute URL).
    pub target: String,
    /// The JSON request body.
    pub body: serde_json::Value,
    /// Trace context to forward.
    pub traceparent: Option<String>,
}

impl EffectIntent {
    /// The key every attempt of this intent carries.
    pub fn key(&self) -> Result<IdempotencyKey, KeyError> {
        IdempotencyKey::for_effect(self.event_id, &self.effect)
    }
}

/// An intent claimed by a dispatcher.
#[derive(Clone, Debug, PartialEq)]
pub struct ClaimedIntent {
    /// Row id.
    pub id: i64,
    /// The key (stored, never recomputed).
    pub key: IdempotencyKey,
    /// The intent.
    pub intent: EffectIntent,
    /// This attempt's number (1 = first).
    pub attempt: i32,
    /// An earlier attempt that was marked as sending ([`IntentStore::mark_sending`]) and whose
    /// outcome was never recorded (the dispatcher died, or lost its lease, with the request
    /// possibly applied by the remote). `None` when every marked attempt has an outcome.
    pub unrecorded_send: Option<i32>,
}

/// How an attempt ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IntentOutcome {
    /// 2xx: the effect happened; keep the response.
    Done {
        /// HTTP status.
        status: u16,
        /// Response body (text).
        body: String,
    },
    /// Try again after `after`, with the same key.
    Retry {
        /// Wait this long.
        after: std::time::Duration,
        /// Why.
        reason: String,
    },
    /// Stop: a person must look (422, other 4xx).
    Park {
        /// Why.
        reason: String,
    },
    /// The remote cannot tell whether the effect happened (no keys, no probe answer).
    Unknown {
        /// Why.
        reason: String,
    },
}

/// How one attempt of one intent ended, for [`IntentStore::finish_all`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FinishedAttempt {
    /// Row id.
    pub id: i64,
    /// The attempt number the claim gave it (the fencing token).
    pub attempt: i32,
    /// How it ended.
    pub outcome: IntentOutcome,
}

/// Where an effect intent is in its life; stored as its [`IntentStatus::as_str`] text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum IntentStatus {
    /// Waiting for (another) attempt.
    Pending,
    /// Delivered; the response is stored.
    Done,
    /// Stopped for a person (a 422, another 4xx, a remote that kept refusing).
    Parked,
    /// Nobody can tell whether the effect happened (a remote that ignores keys).
    Unknown,
}

impl IntentStatus {
    /// The stored text: `pending`, `done`, `parked`, `unknown`.
    pub fn as_str(self) -> &'static str {
        match self {
            IntentStatus::Pending => "pending",
            IntentStatus::Done => "done",
            IntentStatus::Parked => "parked",
            IntentStatus::Unknown => "unknown",
        }
    }

    /// Parked or unknown: settled only by a person or a compensation.
    pub fn is_stuck(self) -> bool {
        matches!(self, IntentStatus::Parked | IntentStatus::Unknown)
    }
}

impl fmt::Display for IntentStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A stored status that is none of `pending`, `done`, `parked`, `unknown`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the effect intent status {0:?} is not one of pending, done, parked, unknown: \
     was the table written by a newer idem? run the matching `idem migrate`"
)]
pub struct UnknownStatus(pub String);

impl std::str::FromStr for IntentStatus {
    type Err = UnknownStatus;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "pending" => Ok(IntentStatus::Pending),
            "done" => Ok(IntentStatus::Done),
            "parked" => Ok(IntentStatus::Parked),
            "unknown" => Ok(IntentStatus::Unknown),
            other => Err(UnknownStatus(other.to_owned())),
        }
    }
}

/// A parked or unknown intent, for `idem effects parked`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct StuckIntent {
    /// Row id.
    pub id: i64,
    /// Its key.
    pub key: String,
    /// Effect name.
    pub effect: String,
    /// [`IntentStatus::Parked`] or [`IntentStatus::Unknown`].
    pub status: IntentStatus,
    /// Attempts made.
    pub attempts: i32,
    /// Why it stopped.
    pub reason: Option<String>,
}

/// The client side's effect intents ("one more outbox") in one database.
pub trait IntentStore: Clone + Send + Sync + 'static {
    /// The connection type handlers write through.
    type Conn: Send;

    /// Records `intent` in the transaction `conn` belongs to. Returns false when an intent with
    /// the same key already exists (recording is idempotent).
    fn record(
        &self,
        conn: &mut Self::Conn,
        intent: &EffectIntent,
    ) -> impl std::future::Future<Output = crate::Result<bool>> + Send;

    /// Records `intents` in the transaction `conn` belongs to, as [`IntentStore::record`] does
    /// each: one result per intent, in order, false when its key already exists (or appears
    /// earlier in `intents`). A store may do it in one statement; the default records them one
    /// by one. An intent whose key is invalid fails the whole call, recording nothing it can
    /// roll back.
    fn record_all(
        &self,
        conn: &mut Self::Conn,
        intents: &[EffectIntent],
    ) -> impl std::future::Future<Output = crate::Result<Vec<bool>>> + Send {
        async move {
            let mut recorded = Vec::with_capacity(intents.len());
            for intent in intents {
                recorded.push(self.record(&mut *conn, intent).await?);
            }
            Ok(recorded)
        }
    }

    /// Leases up to `batch` due intents for `lease`, raising their attempt numbers.
    fn claim(
        &self,
        batch: u32,
        lease: std::time::Duration,
    ) -> impl std::future::Future<Output = crate::Result<Vec<ClaimedIntent>>> + Send;

    /// Records, durably and before the request goes out, that attempt `attempt` of intent `id`
    /// is sending it: a later attempt sees it as [`ClaimedIntent::unrecorded_send`] until an
    /// outcome of this attempt is recorded. Marks only while this attempt still holds the lease
    /// for at least `lease_left` (by the database's clock); false means not marked (the lease was
    /// lost or is too short): the request must not be sent. The mark also keeps every later
    /// attempt from claiming the intent before `settle` from now: a request whose sender dies
    /// may still be processed by the remote that long, and a probe asked sooner would find
    /// nothing and send it again.
    fn mark_sending(
        &self,
        id: i64,
        attempt: i32,
        lease_left: std::time::Duration,
        settle: std::time::Duration,
    ) -> impl std::future::Future<Output = crate::Result<bool>> + Send;

    /// Records how attempt `attempt` of intent `id` ended. Fenced by the attempt number: a
    /// dispatcher whose lease was taken over changes nothing (returns false). The sending mark
    /// of this attempt is cleared, and any mark when the intent leaves `pending`; a `Retry` of
    /// an attempt that sent nothing keeps an earlier attempt's mark.
    ///
    /// One attempt through [`finish_all`](Self::finish_all).
    fn finish(
        &self,
        id: i64,
        attempt: i32,
        outcome: &IntentOutcome,
    ) -> impl std::future::Future<Output = crate::Result<bool>> + Send {
        let one = [FinishedAttempt {
            id,
            attempt,
            outcome: outcome.clone(),
        }];
        async move { Ok(!self.finish_all(&one).await?.is_empty()) }
    }

    /// Records how each of `finished` ended, in one write (one statement on PostgreSQL, one
    /// `BEGIN IMMEDIATE` transaction on SQLite), with [`finish`](Self::finish)'s fencing and
    /// sending-mark rules for each. Returns the ids whose outcome was recorded; an attempt whose
    /// id is missing was fenced (its lease was taken over, or the intent left `pending`) and
    /// changed nothing. All or nothing: an error records none of them.
    fn finish_all(
        &self,
        finished: &[FinishedAttempt],
    ) -> impl std::future::Future<Output = crate::Result<Vec<i64>>> + Send;

    /// Lists parked and unknown intents.
    fn stuck(
        &self,
        limit: u32,
    ) -> impl std::future::Future<Output = crate::Result<Vec<StuckIntent>>> + Send;

    /// Returns parked and unknown intents (all, or these ids) to pending; their key is unchanged.
    fn retry_stuck(
        &self,
        ids: Option<&[i64]>,
    ) -> impl std::future::Future<Output = crate::Result<u64>> + Send;

    /// Reads intent `id` and its status.
    fn get(
        &self,
        id: i64,
    ) -> impl std::future::Future<Output = crate::Result<Option<(ClaimedIntent, IntentStatus)>>> + Send;

    /// Settles a parked or unknown intent by a decision made outside the dispatcher (a person,
    /// or a compensation that ran): `resolution` is its new state and `note` is kept as its
    /// reason. Returns false when the intent is not parked or unknown.
    fn resolve(
        &self,
        id: i64,
        resolution: Resolution,
        note: &str,
    ) -> impl std::future::Future<Output = crate::Result<bool>> + Send;
}

/// A row returned by an intent claim, as a store decoded it.
#[derive(Debug)]
pub enum ClaimedRow {
    /// A deliverable intent.
    Intent(ClaimedIntent),
    /// A row that cannot be decoded (a foreign writer's), with the claim's attempt number.
    Undecodable {
        /// Row id.
        id: i64,
        /// The attempt number the claim gave it.
        attempt: i32,
        /// Why it cannot be decoded.
        error: crate::Error,
    },
}

impl ClaimedRow {
    /// The row `id`, claimed as attempt `attempt`, from its decoding.
    pub fn of(decoded: crate::Result<ClaimedIntent>, id: i64, attempt: i32) -> Self {
        match decoded {
            Ok(c) => ClaimedRow::Intent(c),
            Err(error) => ClaimedRow::Undecodable { id, attempt, error },
        }
    }
}

/// The parking reason of a claimed intent row that cannot be decoded.
pub fn undecodable_reason(error: &crate::Error) -> String {
    format!(
        "this intent row cannot be decoded ({error}); it was written by something other than \
         idem: fix or delete the row, then `idem effects retry --id`"
    )
}

/// Parks the undecodable rows of a claim with their reason, so that one of them never fails a
/// claim again, and returns the deliverable intents (for [`IntentStore::claim`]).
pub async fn park_undecodable<S: IntentStore>(
    store: &S,
    rows: Vec<ClaimedRow>,
) -> crate::Result<Vec<ClaimedIntent>> {
    let mut claimed = Vec::with_capacity(rows.len());
    for row in rows {
        match row {
            ClaimedRow::Intent(c) => claimed.push(c),
            ClaimedRow::Undecodable { id, attempt, error } => {
                let reason = undecodable_reason(&error);
                store
                    .finish(id, attempt, &IntentOutcome::Park { reason })
                    .await?;
            }
        }
    }
    Ok(claimed)
}

/// How a parked or unknown intent is settled ([`IntentStore::resolve`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Resolution {
    /// The effect happened (a person checked the remote): done, never sent again.
    Applied,
    /// Send it again, with the same key.
    Pending,
    /// Keep it parked (for example after a compensation that a person wants to review).
    Parked,
}

impl Resolution {
    /// The status it gives the intent.
    pub fn status(self) -> IntentStatus {
        match self {
            Resolution::Applied => IntentStatus::Done,
            Resolution::Pending => IntentStatus::Pending,
            Resolution::Parked => IntentStatus::Parked,
        }
    }
}
