-- Claims key (?1 scope, ?2 key, ?3 fingerprint); ?4 lock until, ?5 expires at, ?6 the claim token
-- that fences renew, complete and release, ?7 now (Unix ms, last: the clock is the dialect's
-- final parameter). See the PostgreSQL version.
INSERT INTO {idempotency_keys} (scope, idem_key, fingerprint, status, locked_until, created_at, expires_at, claim_token)
VALUES (?1, ?2, ?3, 'in_flight', ?4, ?7, ?5, ?6)
ON CONFLICT (scope, idem_key) DO UPDATE
    SET fingerprint = excluded.fingerprint, status = 'in_flight', locked_until = excluded.locked_until,
        response_status = NULL, response_headers = NULL, response_body = NULL,
        created_at = excluded.created_at, expires_at = excluded.expires_at, claim_token = excluded.claim_token
    WHERE (status = 'completed' AND expires_at < ?7)
       OR (status = 'in_flight' AND locked_until < ?7
           AND (fingerprint = excluded.fingerprint OR expires_at < ?7))
RETURNING 1 AS claimed
