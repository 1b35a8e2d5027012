-- Returns all parked rows to pending. The attempt count restarts.
UPDATE {outbox}
SET status = 'pending', attempts = 0, permanent_failures = 0, next_attempt_at = 0, last_error = NULL
WHERE status = 'parked'
