-- Run on every connection a SQLite pool takes back: it fails if the connection is still inside
-- a transaction, and the pool then closes the connection (which rolls the transaction back and
-- frees the write lock). sqlx's `begin_with` acknowledges a custom `BEGIN IMMEDIATE` and then
-- awaits the connection's handle to check it; a future dropped at that await (a task aborted,
-- a claim cancelled) has no `Transaction` to roll back, and the pooled connection kept the write
-- lock, so every other writer waited out its busy timeout and failed.
BEGIN DEFERRED;
ROLLBACK
