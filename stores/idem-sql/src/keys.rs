//! The server-side Idempotency-Key store ([`IdempotencyStore`]), written once.

use std::time::Duration;

use idem_core::idempotency::{
    ClaimToken, IdempotencyKey, IdempotencyStore, KeyClaim, StoredResponse,
};
use idem_core::{Error, Result, TableNames};
use sqlx::Pool;

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

    /// The key as stored, for a claim that found it taken.
    async fn existing(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        fingerprint: &str,
    ) -> Result<KeyClaim> {
        let context = "reading an idempotency key";
        let mut c = self.0.conn(context).await?;
        let row = Stmt::<DB>::new(&self.0.queries.key_get)
            .bind(scope)
            .bind(key.as_str())
            .fetch_optional(&mut c)
            .await
            .map_err(|e| Error::database(context, e))?;
        let Some(row) = row else {
            // Released or swept between the two statements: the caller may simply retry.
            return Ok(KeyClaim::InFlight);
        };
        let dec = |e| Error::database("decoding an idempotency key", e);
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
        let context = "claiming an idempotency key";
        let now = Now::read();
        let token = ClaimToken::random();
        let mut c = self.0.conn(context).await?;
        let claimed = Stmt::<DB>::new(&self.0.queries.key_claim)
            .bind(scope)
            .bind(key.as_str())
            .bind(fingerprint)
            .after(now, lock)
            .after(now, retention)
            .bind(token.as_str())
            .now(now)
            .fetch_optional(&mut c)
            .await
            .map_err(|e| Error::database(context, e))?;
        drop(c);
        if claimed.is_some() {
            return Ok(KeyClaim::New(token));
        }
        self.existing(scope, key, fingerprint).await
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
            .map_err(|e| Error::database(context, e))
    }

    async fn complete(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: &ClaimToken,
        response: &StoredResponse,
    ) -> Result<bool> {
        let context = "storing an idempotent response";
        let headers = serde_json::to_string(&response.headers).unwrap_or_else(|_| "[]".to_owned());
        let mut c = self.0.conn(context).await?;
        Stmt::<DB>::new(&self.0.queries.key_complete)
            .bind(scope)
            .bind(key.as_str())
            .bind(i32::from(response.status))
            .bind(headers)
            .bind(response.body.as_slice())
            .bind(token.as_str())
            .execute(&mut c)
            .await
            .map(|n| n == 1)
            .map_err(|e| Error::database(context, e))
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
            .map_err(|e| Error::database(context, e))
    }

    async fn sweep(&self) -> Result<u64> {
        let context = "sweeping expired idempotency keys";
        let mut c = self.0.conn(context).await?;
        Stmt::<DB>::new(&self.0.queries.key_sweep)
            .now(Now::read())
            .execute(&mut c)
            .await
            .map_err(|e| Error::database(context, e))
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
