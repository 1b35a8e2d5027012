-- A published row moved to the archive by pruning.
SELECT event_id{::text} AS event_id
FROM {outbox_archive}
WHERE aggregate_type = $1 AND aggregate_id = $2 AND event_type = $3
LIMIT 1
