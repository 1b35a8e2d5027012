-- One effect's intents: attempts (repeats included) and states.
SELECT count(*) AS intents,
       COALESCE(sum(attempts), 0) AS attempts,
       COALESCE(sum(status = 'done'), 0) AS done,
       COALESCE(sum(status = 'pending'), 0) AS pending,
       COALESCE(sum(status = 'parked'), 0) AS parked,
       COALESCE(sum(status = 'unknown'), 0) AS unknown
FROM {effect_intents}
WHERE effect = ?1
