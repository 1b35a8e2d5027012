-- Claims key ($1 scope, $2 key, $3 fingerprint) for $4 ms (in flight) and $5 ms (retention),
-- with the claim token $6 that fences renew, complete and release.
-- Inserts a new row, or takes over an expired completed key, or an in-flight claim whose lock ran
-- out (its server died mid-request, or stopped renewing) when the request is the same or the key
-- expired. A live claim (renewed by its holder) is never taken over. Returns a row only when this
-- caller holds the claim.
INSERT INTO {idempotency_keys} AS k (scope, idem_key, fingerprint, status, locked_until, expires_at, claim_token)
VALUES ($1, $2, $3, 'in_flight', now() + $4 * interval '1 millisecond', now() + $5 * interval '1 millisecond', $6)
ON CONFLICT (scope, idem_key) DO UPDATE
    SET fingerprint = EXCLUDED.fingerprint, status = 'in_flight', locked_until = EXCLUDED.locked_until,
        response_status = NULL, response_headers = NULL, response_body = NULL,
        created_at = now(), expires_at = EXCLUDED.expires_at, claim_token = EXCLUDED.claim_token
    WHERE (k.status = 'completed' AND k.expires_at < now())
       OR (k.status = 'in_flight' AND k.locked_until < now()
           AND (k.fingerprint = EXCLUDED.fingerprint OR k.expires_at < now()))
RETURNING 1 AS claimed
