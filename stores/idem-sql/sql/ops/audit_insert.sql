-- Records an operator action: who ($1), what ($2), on what ($3), why ($4), rows changed ($5),
-- how it ended ($6).
INSERT INTO {audit} (actor, action, target, reason, affected, outcome)
VALUES ($1, $2, $3, $4, $5, $6)
