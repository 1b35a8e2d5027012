INSERT INTO {dead_letters}
    (consumer_group, topic, record_partition, record_offset, event_id, event_type, reason, record_key, payload, headers)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)
ON CONFLICT (consumer_group, topic, record_partition, record_offset) DO NOTHING
