-- See the PostgreSQL version.
SELECT (SELECT count(*) FROM (SELECT 1 FROM {outbox} WHERE status = 'pending' LIMIT ?1)) AS pending,
       (SELECT count(*) FROM (SELECT 1 FROM {outbox} WHERE status = 'parked' LIMIT ?1)) AS parked,
       (SELECT COALESCE(max(id), 0) FROM {outbox}) AS last_id,
       (SELECT (julianday('now') - julianday(created_at)) * 86400.0
          FROM {outbox} WHERE status = 'pending' ORDER BY id LIMIT 1) AS oldest_pending_age
