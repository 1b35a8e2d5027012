-- Forgets the in-flight claim ($1 scope, $2 key) that token $3 holds; never another request's claim.
DELETE FROM {idempotency_keys}
WHERE scope = $1 AND idem_key = $2 AND status = 'in_flight' AND claim_token = $3
