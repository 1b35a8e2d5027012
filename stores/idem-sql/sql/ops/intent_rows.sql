-- Parked and unknown intents (status $2 only, when not NULL) with an id above $1, by id, at most
-- $3, with the remote's last answer.
SELECT id, idem_key, effect, target, status, attempts{::bigint} AS attempts,
       response_status{::bigint} AS response_status,
       COALESCE(substr(response_body, 1, 300), '') AS response,
       COALESCE(last_error, '') AS reason, updated_at{::text} AS updated_at
FROM {effect_intents}
WHERE status IN ('parked', 'unknown') AND id > $1 AND ($2{::text} IS NULL OR status = $2)
ORDER BY id
LIMIT $3
