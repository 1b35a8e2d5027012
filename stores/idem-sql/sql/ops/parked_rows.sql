-- Parked rows with an id above $1 (with reason $2 when not NULL), by id, at most $3, each with
-- the start of its payload.
SELECT id, event_id{::text} AS event_id, aggregate_type, aggregate_id, event_type, attempts{::bigint} AS attempts,
       COALESCE(last_error, '') AS reason, created_at{::text} AS created_at,
       substr(payload{::text}, 1, 300) AS preview
FROM {outbox}
WHERE status = 'parked' AND id > $1 AND ($2{::text} IS NULL OR COALESCE(last_error, '') = $2)
ORDER BY id
LIMIT $3
