-- Deletes expired keys, but never an in-flight claim whose lock is live (its request still runs).
DELETE FROM {idempotency_keys}
WHERE expires_at < now() AND (status = 'completed' OR locked_until < now())
