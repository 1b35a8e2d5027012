-- Returns the parked row with event id ?1 to pending. The attempt count restarts.
UPDATE {outbox}
SET status = 'pending', attempts = 0, permanent_failures = 0, next_attempt_at = 0, last_error = NULL
WHERE status = 'parked' AND event_id = ?1
