-- Effect intents, PostgreSQL, version 8: the durable sending mark. `sending_attempt` is the
-- attempt whose request may have reached the remote and whose outcome is not recorded yet
-- (written and committed before a request to a remote that ignores keys); a later attempt that
-- finds it set never re-sends blindly.
ALTER TABLE {effect_intents} ADD COLUMN IF NOT EXISTS sending_attempt integer;
