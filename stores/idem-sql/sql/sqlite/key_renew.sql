-- Sets the lock of the in-flight claim (?1 scope, ?2 key) that token ?3 holds to ?4 (Unix ms).
-- No row: the claim was taken over or swept.
UPDATE {idempotency_keys}
SET locked_until = ?4
WHERE scope = ?1 AND idem_key = ?2 AND status = 'in_flight' AND claim_token = ?3
