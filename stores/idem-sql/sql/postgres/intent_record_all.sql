-- Records a batch of effect intents in the caller's transaction, one array per column (as
-- intent_record.sql does one): keys sorted (the lock order of concurrent batches); an intent
-- whose key exists, or appears earlier in the batch, is skipped. Returns the keys inserted.
INSERT INTO {effect_intents} (idem_key, effect, target, event_id, body, traceparent)
SELECT i.idem_key, i.effect, i.target, i.event_id, i.body::jsonb, i.traceparent
FROM UNNEST($1::text[], $2::text[], $3::text[], $4::uuid[], $5::text[], $6::text[]) WITH ORDINALITY
     AS i(idem_key, effect, target, event_id, body, traceparent, ord)
ORDER BY i.idem_key, i.ord
ON CONFLICT (idem_key) DO NOTHING
RETURNING idem_key
