-- One effect intent by its key: where an effect's attempts stand.
SELECT status, last_error FROM {effect_intents} WHERE idem_key = $1
