-- The comment of publication $1 (a row with NULL: none; no row: no such publication).
SELECT pg_catalog.obj_description(p.oid, 'pg_publication') AS comment
FROM pg_catalog.pg_publication p
WHERE p.pubname = $1
