-- Deletes up to ?2 processed inbox rows processed and last delivered before ?1 (same text
-- format as the columns). Dead-lettered rows stay: they record what was not applied.
DELETE FROM {inbox}
WHERE (consumer_group, event_id) IN (
    SELECT consumer_group, event_id FROM {inbox}
    WHERE status = 'processed' AND processed_at < ?1 AND last_delivered_at < ?1
    LIMIT ?2
)
