SELECT consumer_group, topic, record_partition, record_offset, event_id::text AS event_id, reason
FROM {dead_letters}
WHERE consumer_group = $1
ORDER BY id
LIMIT $2
