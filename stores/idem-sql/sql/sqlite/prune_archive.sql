-- Copies up to ?2 published rows published before ?1 to the archive; prune_delete.sql then
-- deletes them in the same transaction.
INSERT OR REPLACE INTO {outbox_archive}
SELECT * FROM {outbox}
WHERE id IN (SELECT id FROM {outbox} WHERE status = 'published' AND published_at < ?1 ORDER BY published_at LIMIT ?2)
