-- Records a batch of effect intents (see the PostgreSQL version): each column one JSON array,
-- the rows joined by array index. Returns the keys inserted.
INSERT INTO {effect_intents} (idem_key, effect, target, event_id, body, traceparent)
SELECT k.value, e.value, t.value, v.value, b.value, p.value
FROM json_each(?1) AS k
JOIN json_each(?2) AS e ON e.key = k.key
JOIN json_each(?3) AS t ON t.key = k.key
JOIN json_each(?4) AS v ON v.key = k.key
JOIN json_each(?5) AS b ON b.key = k.key
JOIN json_each(?6) AS p ON p.key = k.key
WHERE true
ORDER BY k.value, k.key
ON CONFLICT (idem_key) DO NOTHING
RETURNING idem_key
