SELECT id, event_id, aggregate_type, aggregate_id, event_type, attempts, last_error
FROM {outbox}
WHERE status = 'parked'
ORDER BY id
LIMIT $1
