-- Whether PUBLIC (every role) may execute an overload of pg_logical_emit_message in this
-- database, so that any role can write message-mode events (migration 13 revokes it).
SELECT coalesce(bool_or(a.privilege_type = 'EXECUTE'), false) AS open
FROM pg_catalog.pg_proc AS p,
    LATERAL aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) AS a
WHERE p.proname = 'pg_logical_emit_message'
    AND p.pronamespace = 'pg_catalog'::regnamespace
    AND a.grantee = 0
