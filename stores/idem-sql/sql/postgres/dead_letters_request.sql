-- Requests a replay of the open dead letters of group $1 (only id $2, only those with reason $4,
-- when not NULL) by $3:
-- the group's running consumer serves them through its handler. Closed letters (applied, or
-- found applied) are left alone; a letter requested already keeps its first request time.
UPDATE {dead_letters}
SET replay_requested_at = COALESCE(replay_requested_at, now()),
    replay_requested_by = $3
WHERE consumer_group = $1
  AND ($2::bigint IS NULL OR id = $2)
  AND ($4::text IS NULL OR reason = $4)
  AND (replay_outcome IS NULL OR replay_outcome = 'failed')
RETURNING id
