-- The publication $1: whether it publishes inserts, and whether it holds table $3 of schema $2.
SELECT p.pubinsert,
       EXISTS (SELECT 1 FROM pg_publication_tables t
               WHERE t.pubname = p.pubname AND t.schemaname = $2 AND t.tablename = $3) AS has_table
FROM pg_publication p
WHERE p.pubname = $1
