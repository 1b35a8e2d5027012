-- Ceiling, consumer (1/3): the batch's inbox rows, set-based, exactly the columns and values
-- idem's inbox writes, arrays bound from the client. Lean SQL of the bench, not idem's.
INSERT INTO idem_inbox AS i
    (consumer_group, event_id, event_type, aggregate_type, aggregate_id, payload_hash, delivery_count, status)
SELECT $1, e.event_id, e.event_type, e.aggregate_type, e.aggregate_id, e.payload_hash, e.copies, 'processed'
FROM unnest($2::uuid[], $3::text[], $4::text[], $5::text[], $6::text[], $7::int[])
     AS e(event_id, event_type, aggregate_type, aggregate_id, payload_hash, copies)
ORDER BY e.event_id
ON CONFLICT (consumer_group, event_id) DO UPDATE
    SET delivery_count = i.delivery_count + EXCLUDED.delivery_count,
        last_delivered_at = now()
RETURNING i.event_id, i.delivery_count, i.payload_hash
