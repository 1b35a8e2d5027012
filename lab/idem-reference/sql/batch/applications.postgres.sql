-- One application row per event applied ($1 event ids, $2 their payments).
INSERT INTO settlement_applications (event_id, payment_id)
SELECT * FROM unnest($1::uuid[], $2::text[])
