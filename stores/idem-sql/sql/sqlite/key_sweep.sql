-- Deletes keys expired at ?1 (Unix ms), but never an in-flight claim whose lock is live.
DELETE FROM {idempotency_keys}
WHERE expires_at < ?1 AND (status = 'completed' OR locked_until < ?1)
