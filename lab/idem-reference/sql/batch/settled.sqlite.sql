-- The settlements stored for the payments ?1, a JSON array (see settled.postgres.sql).
SELECT payment_id, order_id, amount_minor, currency FROM settlements
WHERE payment_id IN (SELECT value FROM json_each(?1))
