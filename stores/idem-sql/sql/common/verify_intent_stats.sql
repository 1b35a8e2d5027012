-- One effect's intents: attempts (repeats included) and states.
SELECT count(*){::bigint} AS intents,
       COALESCE(sum(attempts), 0){::bigint} AS attempts,
       count(*) FILTER (WHERE status = 'done'){::bigint} AS done,
       count(*) FILTER (WHERE status = 'pending'){::bigint} AS pending,
       count(*) FILTER (WHERE status = 'parked'){::bigint} AS parked,
       count(*) FILTER (WHERE status = 'unknown'){::bigint} AS unknown
FROM {effect_intents}
WHERE effect = $1
