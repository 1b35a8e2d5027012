-- Deletes up to ?2 published rows published before ?1 (same text format as published_at).
DELETE FROM {outbox}
WHERE id IN (SELECT id FROM {outbox} WHERE status = 'published' AND published_at < ?1 ORDER BY published_at LIMIT ?2)
