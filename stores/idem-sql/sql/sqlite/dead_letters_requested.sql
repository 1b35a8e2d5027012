-- See the PostgreSQL version.
SELECT id, topic, record_partition, record_offset, event_id, event_type, reason, record_key, payload,
       headers, replay_requested_by
FROM {dead_letters}
WHERE consumer_group = ?1
  AND replay_requested_at IS NOT NULL
  AND (replay_outcome IS NULL OR replay_outcome = 'failed')
  AND id > ?2
ORDER BY id
LIMIT ?3
