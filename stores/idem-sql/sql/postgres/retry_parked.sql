-- Returns parked rows to pending ($1 NULL: all of them). The attempt count restarts.
UPDATE {outbox}
SET status = 'pending', attempts = 0, permanent_failures = 0, next_attempt_at = '-infinity', last_error = NULL
WHERE status = 'parked' AND ($1::uuid[] IS NULL OR event_id = ANY($1))
