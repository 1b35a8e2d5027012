-- A replay's claim on event $2 of group $1: inserts its inbox row as processed, or turns a
-- dead_lettered row with the same payload hash ($6) processed. Returns a row only then; an
-- already processed row, or one with another payload, is left alone and returns nothing. The
-- row stays locked until the replay's transaction ends.
INSERT INTO {inbox} AS i
    (consumer_group, event_id, event_type, aggregate_type, aggregate_id, payload_hash, status)
VALUES ($1, $2, $3, $4, $5, $6, 'processed')
ON CONFLICT (consumer_group, event_id) DO UPDATE
    SET status = 'processed'
    WHERE i.status = 'dead_lettered' AND i.payload_hash = EXCLUDED.payload_hash
RETURNING i.event_id
