-- Ceiling, consumer (2/3): the batch's settlements in one statement, in payment order (the lock
-- order), a payment settled once (the business key).
INSERT INTO settlements (payment_id, order_id, amount_minor, currency, event_id)
SELECT s.payment_id, s.order_id, s.amount_minor, s.currency, s.event_id
FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::uuid[])
     AS s(payment_id, order_id, amount_minor, currency, event_id)
ORDER BY s.payment_id
ON CONFLICT (payment_id) DO NOTHING
RETURNING payment_id
