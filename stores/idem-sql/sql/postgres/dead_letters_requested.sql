-- Open dead letters of group $1 whose replay was requested, with an id above $2, by id, at most
-- $3, and who asked: what a consumer of the group serves (`dead_letters_requested_idx`).
SELECT id, topic, record_partition, record_offset, event_id::text AS event_id, event_type, reason, record_key, payload,
       headers::text AS headers, replay_requested_by
FROM {dead_letters}
WHERE consumer_group = $1
  AND replay_requested_at IS NOT NULL
  AND (replay_outcome IS NULL OR replay_outcome = 'failed')
  AND id > $2
ORDER BY id
LIMIT $3
