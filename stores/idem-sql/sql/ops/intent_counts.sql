-- Effect intents pending, parked and unknown, each counted up to $1 through its partial index.
SELECT (SELECT count(*) FROM (SELECT 1 FROM {effect_intents} WHERE status = 'pending' LIMIT $1) a){::bigint} AS pending,
       (SELECT count(*) FROM (SELECT 1 FROM {effect_intents} WHERE status = 'parked' LIMIT $1) b){::bigint} AS parked,
       (SELECT count(*) FROM (SELECT 1 FROM {effect_intents} WHERE status = 'unknown' LIMIT $1) c){::bigint} AS unknown
