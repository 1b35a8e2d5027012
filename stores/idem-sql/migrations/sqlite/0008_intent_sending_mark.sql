-- Effect intents, SQLite, version 8: the durable sending mark (see the PostgreSQL migration).
ALTER TABLE {effect_intents} ADD COLUMN sending_attempt INTEGER;
