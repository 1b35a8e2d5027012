-- Open dead letters (never replayed, or whose replay failed) grouped by consumer group and
-- reason, among the newest $1, most letters first.
SELECT consumer_group, reason, count(*){::bigint} AS letters, min(id){::bigint} AS first_id,
       max(id){::bigint} AS last_id,
       sum(CASE WHEN replay_requested_at IS NULL THEN 0 ELSE 1 END){::bigint} AS requested
FROM (SELECT id, consumer_group, reason, replay_requested_at FROM {dead_letters}
      WHERE replay_outcome IS NULL OR replay_outcome = 'failed'
      ORDER BY id DESC LIMIT $1) t
GROUP BY consumer_group, reason
ORDER BY letters DESC, first_id
LIMIT 100
