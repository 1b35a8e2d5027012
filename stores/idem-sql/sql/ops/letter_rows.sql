-- Dead letters of group $1 with an id above $2 (reason $3 when not NULL; open ones only when $4
-- is 1), by id, at most $5, each with the start of its value.
SELECT id, topic, record_partition{::bigint} AS record_partition, record_offset, event_id{::text} AS event_id,
       COALESCE(event_type, '') AS event_type, reason, created_at{::text} AS created_at,
       COALESCE(substr(payload, 1, 300), '') AS preview,
       COALESCE(replay_outcome, '') AS replay_outcome,
       replay_requested_at{::text} AS replay_requested_at
FROM {dead_letters}
WHERE consumer_group = $1 AND id > $2
  AND ($3{::text} IS NULL OR reason = $3)
  AND ($4{::bigint} = 0 OR replay_outcome IS NULL OR replay_outcome = 'failed')
ORDER BY id
LIMIT $5
