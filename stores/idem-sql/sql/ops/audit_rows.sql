-- Audit entries with an id below $1, newest first, at most $2.
SELECT id, at{::text} AS at, actor, action, target, reason, affected, outcome
FROM {audit}
WHERE id < $1
ORDER BY id DESC
LIMIT $2
