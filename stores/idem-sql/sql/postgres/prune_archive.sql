-- Moves up to $2 published rows older than $1 seconds to the archive table, atomically.
WITH doomed AS (
    SELECT id FROM {outbox}
    WHERE status = 'published' AND published_at < now() - $1 * interval '1 second'
    ORDER BY published_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED
),
moved AS (
    DELETE FROM {outbox} o USING doomed d WHERE o.id = d.id RETURNING o.*
)
INSERT INTO {outbox_archive} SELECT * FROM moved
