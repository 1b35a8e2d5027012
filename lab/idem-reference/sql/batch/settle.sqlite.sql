-- Settles a batch of order.paid events (see settle.postgres.sql): each column one JSON array,
-- the rows joined by array index. SQLite has no INSERT in a WITH clause: the application rows
-- are written by applications.sqlite.sql. Returns the payments inserted.
INSERT INTO settlements (payment_id, order_id, amount_minor, currency, event_id)
SELECT p.value, o.value, a.value, c.value, e.value
FROM json_each(?1) AS p
JOIN json_each(?2) AS o ON o.key = p.key
JOIN json_each(?3) AS a ON a.key = p.key
JOIN json_each(?4) AS c ON c.key = p.key
JOIN json_each(?5) AS e ON e.key = p.key
WHERE true
ORDER BY p.value, p.key
ON CONFLICT (payment_id) DO NOTHING
RETURNING payment_id
