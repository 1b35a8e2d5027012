-- The schema version idem's tables are at: the highest migration applied.
SELECT max(version) AS version FROM {schema_migrations}
