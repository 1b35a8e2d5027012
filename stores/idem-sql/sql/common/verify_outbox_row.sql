-- The newest outbox row of one aggregate's event type: where a missing effect's event stands.
SELECT event_id{::text} AS event_id, status, last_error
FROM {outbox}
WHERE aggregate_type = $1 AND aggregate_id = $2 AND event_type = $3
ORDER BY id DESC LIMIT 1
