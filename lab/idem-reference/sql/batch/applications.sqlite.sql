-- One application row per event applied (?1 event ids, ?2 their payments: JSON arrays).
INSERT INTO settlement_applications (event_id, payment_id)
SELECT e.value, p.value
FROM json_each(?1) AS e
JOIN json_each(?2) AS p ON p.key = e.key
