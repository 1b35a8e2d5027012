-- See the PostgreSQL version.
UPDATE {dead_letters}
SET replayed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'),
    replayed_by = ?2,
    replay_outcome = ?3,
    replay_attempts = replay_attempts + 1,
    replay_requested_at = NULL,
    replay_requested_by = NULL,
    reason = COALESCE(?4, reason)
WHERE id = ?1
  AND (replay_outcome IS NULL OR replay_outcome = 'failed')
