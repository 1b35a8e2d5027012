-- The consumer groups with rows in the inbox, by one index probe per group (a loose scan of the
-- primary key), at most 100.
WITH RECURSIVE g(name, n) AS (
    SELECT min(consumer_group), 1 FROM {inbox}
    UNION ALL
    SELECT (SELECT min(consumer_group) FROM {inbox} WHERE consumer_group > g.name), n + 1
    FROM g WHERE g.name IS NOT NULL AND n < 100
)
SELECT name FROM g WHERE name IS NOT NULL
