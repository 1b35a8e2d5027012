SELECT id, consumer_group, topic, record_partition, record_offset, event_id::text AS event_id, reason,
       replay_outcome, replayed_at::text AS replayed_at, replayed_by,
       replay_requested_at::text AS replay_requested_at, replay_requested_by
FROM {dead_letters}
WHERE consumer_group = $1
ORDER BY id
LIMIT $2
