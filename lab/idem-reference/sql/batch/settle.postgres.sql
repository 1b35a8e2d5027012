-- Settles a batch of order.paid events ($1..$5: one array per column, in the batch's order):
-- one settlement per payment, inserted sorted by payment (the lock order of concurrent
-- batches), the earliest event of a payment first; `ON CONFLICT DO NOTHING` also absorbs a
-- payment that appears twice in the batch. Each event that inserted its settlement gets its
-- application row in the same statement. Returns the payments inserted.
WITH input AS (
    SELECT *
    FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::uuid[]) WITH ORDINALITY
         AS s(payment_id, order_id, amount_minor, currency, event_id, ord)
),
settled AS (
    INSERT INTO settlements (payment_id, order_id, amount_minor, currency, event_id)
    SELECT payment_id, order_id, amount_minor, currency, event_id
    FROM input
    ORDER BY payment_id, ord
    ON CONFLICT (payment_id) DO NOTHING
    RETURNING event_id, payment_id
),
applied AS (
    INSERT INTO settlement_applications (event_id, payment_id)
    SELECT event_id, payment_id FROM settled
)
SELECT payment_id FROM settled
