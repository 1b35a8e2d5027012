-- Dead letters of group $1 not replayed successfully yet (never replayed, or the last replay
-- failed), with an id above $2, only id $3 when it is not NULL, by id, at most $4.
SELECT id, topic, record_partition, record_offset, event_id::text AS event_id, event_type, reason, record_key, payload,
       headers::text AS headers
FROM {dead_letters}
WHERE consumer_group = $1
  AND (replay_outcome IS NULL OR replay_outcome = 'failed')
  AND id > $2
  AND ($3::bigint IS NULL OR id = $3)
ORDER BY id
LIMIT $4
