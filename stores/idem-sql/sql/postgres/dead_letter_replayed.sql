-- Records a replay of dead letter $1: by $2, outcome $3, and the new reason $4 when not NULL.
-- A request for the replay is served by it (cleared). A letter whose replay succeeded before is
-- left alone.
UPDATE {dead_letters}
SET replayed_at = now(),
    replayed_by = $2,
    replay_outcome = $3,
    replay_attempts = replay_attempts + 1,
    replay_requested_at = NULL,
    replay_requested_by = NULL,
    reason = COALESCE($4, reason)
WHERE id = $1
  AND (replay_outcome IS NULL OR replay_outcome = 'failed')
