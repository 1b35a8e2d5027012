-- Records a batch in the inbox of group $1. A new event is inserted with delivery_count = its
-- copies in the batch; an existing one gets its count raised. The returned delivery_count equals
-- the copies sent exactly when the row is new. The returned payload_hash is the stored one.
INSERT INTO {inbox} AS i
    (consumer_group, event_id, event_type, aggregate_type, aggregate_id, payload_hash, delivery_count, status)
SELECT $1, e.event_id, e.event_type, e.aggregate_type, e.aggregate_id, e.payload_hash, e.copies, e.status
FROM UNNEST($2::uuid[], $3::text[], $4::text[], $5::text[], $6::text[], $7::int[], $8::text[])
     AS e(event_id, event_type, aggregate_type, aggregate_id, payload_hash, copies, status)
ORDER BY e.event_id
ON CONFLICT (consumer_group, event_id) DO UPDATE
    SET delivery_count = i.delivery_count + EXCLUDED.delivery_count,
        last_delivered_at = now()
RETURNING i.event_id, i.delivery_count, i.payload_hash
