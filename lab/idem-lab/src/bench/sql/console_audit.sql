-- Console bench: $1 operator actions recorded over the 30 days before now.
INSERT INTO idem_audit (at, actor, action, target, reason, affected, outcome)
SELECT now() - interval '30 days' * (1 - n::float8 / $1::bigint),
       (ARRAY['ana', 'bo', 'chen'])[n % 3 + 1],
       (ARRAY['outbox.retry', 'dead_letters.replay', 'effects.retry'])[n % 3 + 1],
       'bench: row ' || n, 'ticket OPS-' || n, n % 50, 'done'
FROM generate_series(1, $1::bigint) n
