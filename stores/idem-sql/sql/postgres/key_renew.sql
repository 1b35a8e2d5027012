-- Extends to $4 ms from now the lock of the in-flight claim ($1 scope, $2 key) that token $3 holds.
-- No row: the claim was taken over or swept.
UPDATE {idempotency_keys}
SET locked_until = now() + $4 * interval '1 millisecond'
WHERE scope = $1 AND idem_key = $2 AND status = 'in_flight' AND claim_token = $3
