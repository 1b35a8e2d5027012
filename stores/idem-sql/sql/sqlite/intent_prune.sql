-- Deletes up to ?2 done effect intents finished before ?1 (same text format as updated_at).
-- Pending, parked and unknown intents stay whatever their age.
DELETE FROM {effect_intents}
WHERE id IN (SELECT id FROM {effect_intents} WHERE status = 'done' AND updated_at < ?1 LIMIT ?2)
