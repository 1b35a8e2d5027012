-- See the PostgreSQL version.
INSERT INTO {inbox}
    (consumer_group, event_id, event_type, aggregate_type, aggregate_id, payload_hash, status)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, 'processed')
ON CONFLICT (consumer_group, event_id) DO UPDATE
    SET status = 'processed'
    WHERE status = 'dead_lettered' AND payload_hash = excluded.payload_hash
RETURNING event_id
