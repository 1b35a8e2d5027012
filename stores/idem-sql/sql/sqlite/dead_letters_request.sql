-- See the PostgreSQL version.
UPDATE {dead_letters}
SET replay_requested_at = COALESCE(replay_requested_at, strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    replay_requested_by = ?3
WHERE consumer_group = ?1
  AND (?2 IS NULL OR id = ?2)
  AND (?4 IS NULL OR reason = ?4)
  AND (replay_outcome IS NULL OR replay_outcome = 'failed')
RETURNING id
