-- Ceiling, consumer (3/3): one application row per applied event, when the reference schema
-- has the table (the same rows the settlement handler writes).
INSERT INTO settlement_applications (event_id, payment_id)
SELECT * FROM unnest($1::uuid[], $2::text[])
