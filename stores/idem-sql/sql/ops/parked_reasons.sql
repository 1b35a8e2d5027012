-- Parked rows grouped by their reason, among the oldest $1, most rows first.
SELECT COALESCE(last_error, '') AS reason, count(*){::bigint} AS rows_, min(id){::bigint} AS first_id
FROM (SELECT id, last_error FROM {outbox} WHERE status = 'parked' ORDER BY id LIMIT $1) t
GROUP BY COALESCE(last_error, '')
ORDER BY rows_ DESC, first_id
LIMIT 100
