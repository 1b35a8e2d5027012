//! The server-side Idempotency-Key store ([`IdempotencyStore`]), written once.

use std::time::Duration;

use idem_core::idempotency::{
    ClaimToken, IdempotencyKey, IdempotencyStore, KeyClaim, StoredResponse, TransactionalKeyStore,
    TxClaim,
};
use idem_core::{Result, TableNames};
use sqlx::{Pool, Transaction};

use crate::Dialect;
use crate::dialect::{Now, Stmt, get};
use crate::queries::Handle;

/// The server-side Idempotency-Key store ([`IdempotencyStore`]) in database `DB`.
#[derive(Debug)]
pub struct KeyStore<DB: Dialect>(Handle<DB>);

impl<DB: Dialect> Clone for KeyStore<DB> {
    fn clone(&self) -> Self {
        KeyStore(self.0.clone())
    }
}

impl<DB: Dialect> KeyStore<DB> {
    /// A key store over `pool` with the given tables (created by [`migrate`](crate::migrate())).
    pub fn new(pool: Pool<DB>, tables: TableNames) -> Self {
        KeyStore(Handle::new(pool, &tables))
    }

    /// Claims the key on `c` (one statement); true when this caller holds the claim.
    async fn claim_on(
        &self,
        c: &mut DB::Connection,
        (scope, key, fingerprint): (&str, &IdempotencyKey, &str),
        (lock, retention): (Duration, Duration),
        token: &ClaimToken,
    ) -> Result<bool> {
        let now = Now::read();
        Stmt::<DB>::new(&self.0.queries.key_claim)
            .bind(scope)
            .bind(key.as_str())
            .bind(fingerprint)
            .after(now, lock)
            .after(now, retention)
            .bind(token.as_str())
            .now(now)
            .fetch_optional(c)
            .await
            .map(|row| row.is_some())
            .map_err(|e| crate::dialect::db_error("claiming an idempotency key", e))
    }

    /// The key as stored, read on `c`, for a claim that found it taken.
    async fn existing_on(
        &self,
        c: &mut DB::Connection,
        scope: &str,
        key: &IdempotencyKey,
        fingerprint: &str,
    ) -> Result<KeyClaim> {
        let context = "reading an idempotency key";
        let row = Stmt::<DB>::new(&self.0.queries.key_get)
            .bind(scope)
            .bind(key.as_str())
            .fetch_optional(c)
            .await
            .map_err(|e| crate::dialect::db_error(context, e))?;
        let Some(row) = row else {
            // Released or swept between the two statements: the caller may simply retry.
            return Ok(KeyClaim::InFlight);
        };
        let dec = |e| crate::dialect::db_error("decoding an idempotency key", e);
        let stored: String = get::<DB, _>(&row, "fingerprint").map_err(dec)?;
        let status: String = get::<DB, _>(&row, "status").map_err(dec)?;
        if stored != fingerprint || status != "completed" {
            return Ok(classify(&stored, &status, fingerprint, None));
        }
        let code: i32 = get::<DB, _>(&row, "response_status").map_err(dec)?;
        let headers = DB::get_json_text(&row, "response_headers").map_err(dec)?;
        let body: Vec<u8> = get::<DB, _>(&row, "response_body").map_err(dec)?;
        Ok(classify(
            &stored,
            &status,
            fingerprint,
            Some((code, &headers, body)),
        ))
    }

    /// Stores `response` on `c` for the claim `token` holds; false when it is not held.
    async fn complete_on(
        &self,
        c: &mut DB::Connection,
        (scope, key): (&str, &IdempotencyKey),
        token: &ClaimToken,
        response: &StoredResponse,
    ) -> Result<bool> {
        let headers = serde_json::to_string(&response.headers).unwrap_or_else(|_| "[]".to_owned());
        Stmt::<DB>::new(&self.0.queries.key_complete)
            .bind(scope)
            .bind(key.as_str())
            .bind(i32::from(response.status))
            .bind(headers)
            .bind(response.body.as_slice())
            .bind(token.as_str())
            .execute(c)
            .await
            .map(|n| n == 1)
            .map_err(|e| crate::dialect::db_error("storing an idempotent response", e))
    }
}

/// What a taken key means for a new request with `fingerprint`.
fn classify(
    stored: &str,
    status: &str,
    fingerprint: &str,
    response: Option<(i32, &str, Vec<u8>)>,
) -> KeyClaim {
    if stored != fingerprint {
        return KeyClaim::Mismatch;
    }
    match (status, response) {
        ("completed", Some((code, headers, body))) => KeyClaim::Completed(StoredResponse {
            status: u16::try_from(code).unwrap_or(500),
            headers: serde_json::from_str(headers).unwrap_or_default(),
            body,
        }),
        _ => KeyClaim::InFlight,
    }
}

impl<DB: Dialect> IdempotencyStore for KeyStore<DB> {
    async fn claim(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        fingerprint: &str,
        lock: Duration,
        retention: Duration,
    ) -> Result<KeyClaim> {
        let token = ClaimToken::random();
        let mut c = self.0.conn("claiming an idempotency key").await?;
        let ids = (scope, key, fingerprint);
        if self
            .claim_on(&mut c, ids, (lock, retention), &token)
            .await?
        {
            return Ok(KeyClaim::New(token));
        }
        self.existing_on(&mut c, scope, key, fingerprint).await
    }

    async fn renew(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: &ClaimToken,
        lock: Duration,
    ) -> Result<bool> {
        let context = "renewing the lock of an idempotency key";
        let mut c = self.0.conn(context).await?;
        Stmt::<DB>::new(&self.0.queries.key_renew)
            .bind(scope)
            .bind(key.as_str())
            .bind(token.as_str())
            .after(Now::read(), lock)
            .execute(&mut c)
            .await
            .map(|n| n == 1)
            .map_err(|e| crate::dialect::db_error(context, e))
    }

    async fn complete(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: &ClaimToken,
        response: &StoredResponse,
    ) -> Result<bool> {
        let mut c = self.0.conn("storing an idempotent response").await?;
        self.complete_on(&mut c, (scope, key), token, response)
            .await
    }

    async fn release(&self, scope: &str, key: &IdempotencyKey, token: &ClaimToken) -> Result<bool> {
        let context = "releasing an idempotency key";
        let mut c = self.0.conn(context).await?;
        Stmt::<DB>::new(&self.0.queries.key_release)
            .bind(scope)
            .bind(key.as_str())
            .bind(token.as_str())
            .execute(&mut c)
            .await
            .map(|n| n == 1)
            .map_err(|e| crate::dialect::db_error(context, e))
    }

    async fn sweep(&self) -> Result<u64> {
        let context = "sweeping expired idempotency keys";
        let mut c = self.0.conn(context).await?;
        Stmt::<DB>::new(&self.0.queries.key_sweep)
            .now(Now::read())
            .execute(&mut c)
            .await
            .map_err(|e| crate::dialect::db_error(context, e))
    }
}

impl<DB: Dialect> TransactionalKeyStore for KeyStore<DB> {
    type Transaction = Transaction<'static, DB>;

    /// `BEGIN` on PostgreSQL (a concurrent claim of the key waits on its row), `BEGIN
    /// IMMEDIATE` on SQLite (the write lock is taken up front, so the busy timeout applies).
    async fn claim_in_transaction(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        fingerprint: &str,
        lock: Duration,
        retention: Duration,
    ) -> Result<TxClaim<Self::Transaction>> {
        let mut tx = DB::begin_pool(&self.0.pool).await.map_err(|e| {
            crate::dialect::db_error(
                "claiming an idempotency key: starting a write transaction",
                e,
            )
        })?;
        let token = ClaimToken::random();
        let ids = (scope, key, fingerprint);
        if self
            .claim_on(&mut tx, ids, (lock, retention), &token)
            .await?
        {
            return Ok(TxClaim::New { tx, token });
        }
        let found = self.existing_on(&mut tx, scope, key, fingerprint).await;
        let _ = tx.rollback().await;
        Ok(match found? {
            KeyClaim::Completed(r) => TxClaim::Completed(r),
            KeyClaim::Mismatch => TxClaim::Mismatch,
            KeyClaim::InFlight | KeyClaim::New(_) => TxClaim::InFlight,
        })
    }

    async fn complete_and_commit(
        &self,
        mut tx: Self::Transaction,
        scope: &str,
        key: &IdempotencyKey,
        token: &ClaimToken,
        response: &StoredResponse,
    ) -> Result<bool> {
        let stored = self
            .complete_on(&mut tx, (scope, key), token, response)
            .await;
        if !matches!(stored, Ok(true)) {
            let _ = tx.rollback().await;
            return stored;
        }
        tx.commit()
            .await
            .map_err(|e| crate::dialect::db_error("committing an idempotent request", e))?;
        Ok(true)
    }

    async fn roll_back(&self, tx: Self::Transaction) {
        if let Err(e) = tx.rollback().await {
            tracing::warn!(error = %e, "rolling back an idempotent request");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_taken_key_is_a_mismatch_in_flight_or_a_stored_response() {
        assert!(matches!(
            classify("a", "completed", "b", None),
            KeyClaim::Mismatch
        ));
        assert!(matches!(
            classify("a", "in_flight", "a", None),
            KeyClaim::InFlight
        ));
        match classify("a", "completed", "a", Some((201, "[]", b"ok".to_vec()))) {
            KeyClaim::Completed(r) => assert_eq!((r.status, r.body), (201, b"ok".to_vec())),
            other => panic!("{other:?}"),
        }
        match classify("a", "completed", "a", Some((-1, "not json", vec![]))) {
            KeyClaim::Completed(r) => assert_eq!(r.status, 500),
            other => panic!("{other:?}"),
        }
    }
}
