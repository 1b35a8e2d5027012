-- The settlements stored for the payments $1 (the rare path: events whose payment was settled
-- before, by another event id).
SELECT payment_id, order_id, amount_minor, currency FROM settlements WHERE payment_id = ANY($1::text[])
