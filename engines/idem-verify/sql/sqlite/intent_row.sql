SELECT status, last_error FROM {effect_intents} WHERE idem_key = ?1
