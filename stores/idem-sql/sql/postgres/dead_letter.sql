INSERT INTO {dead_letters}
    (consumer_group, topic, record_partition, record_offset, event_id, event_type, reason, record_key, payload, headers)
SELECT $1, d.topic, d.record_partition, d.record_offset, d.event_id, d.event_type, d.reason, d.record_key, d.payload,
       d.headers::jsonb
FROM UNNEST($2::text[], $3::int[], $4::bigint[], $5::uuid[], $6::text[], $7::text[], $8::text[], $9::text[], $10::text[])
     AS d(topic, record_partition, record_offset, event_id, event_type, reason, record_key, payload, headers)
ON CONFLICT (consumer_group, topic, record_partition, record_offset) DO NOTHING
