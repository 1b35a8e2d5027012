-- Every publication of the database with its comment (NULL: none).
SELECT p.pubname::text AS pubname, pg_catalog.obj_description(p.oid, 'pg_publication') AS comment
FROM pg_catalog.pg_publication p
