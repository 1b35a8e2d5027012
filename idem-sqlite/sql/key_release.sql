DELETE FROM {idempotency_keys} WHERE scope = ?1 AND idem_key = ?2 AND status = 'in_flight'
