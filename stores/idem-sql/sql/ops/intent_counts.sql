-- Effect intents pending, parked and unknown, each counted up to $1 through its partial index,
-- and the newest intent's id (its growth is the rate intents are recorded at).
SELECT (SELECT COALESCE(max(id), 0) FROM {effect_intents}){::bigint} AS last_id,
       (SELECT count(*) FROM (SELECT 1 FROM {effect_intents} WHERE status = 'pending' LIMIT $1) a){::bigint} AS pending,
       (SELECT count(*) FROM (SELECT 1 FROM {effect_intents} WHERE status = 'parked' LIMIT $1) b){::bigint} AS parked,
       (SELECT count(*) FROM (SELECT 1 FROM {effect_intents} WHERE status = 'unknown' LIMIT $1) c){::bigint} AS unknown
