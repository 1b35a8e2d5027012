-- Records one event in the inbox of group ?1 (see the PostgreSQL version): the returned
-- delivery_count equals the copies sent (?7) exactly when the row is new.
INSERT INTO {inbox}
    (consumer_group, event_id, event_type, aggregate_type, aggregate_id, payload_hash, delivery_count, status)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
ON CONFLICT (consumer_group, event_id) DO UPDATE
    SET delivery_count = delivery_count + excluded.delivery_count,
        last_delivered_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
RETURNING delivery_count, payload_hash
