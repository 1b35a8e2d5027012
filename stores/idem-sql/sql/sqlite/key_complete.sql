-- Stores the response of the in-flight claim (?1 scope, ?2 key) that token ?6 holds.
-- No row: the claim was taken over or swept, and the new holder's claim is left alone.
UPDATE {idempotency_keys}
SET status = 'completed', response_status = ?3, response_headers = ?4, response_body = ?5
WHERE scope = ?1 AND idem_key = ?2 AND status = 'in_flight' AND claim_token = ?6
