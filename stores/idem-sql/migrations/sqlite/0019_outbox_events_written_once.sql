-- idem outbox, SQLite, version 19: an event is what its INSERT wrote.
--
-- The columns that make the event cannot change while the row is pending or published, as on
-- PostgreSQL: what a relay publishes is what committed, whichever relay reads it. A parked row
-- may still be corrected, then `idem outbox retry` returns it to pending.
CREATE TRIGGER IF NOT EXISTS "{bare:outbox}_written_once"
BEFORE UPDATE OF event_id, aggregate_type, aggregate_id, event_type, payload, headers, topic,
    traceparent, occurred_at, created_at
ON {outbox}
WHEN OLD.status <> 'parked' AND (
       NEW.event_id IS NOT OLD.event_id
    OR NEW.aggregate_type IS NOT OLD.aggregate_type
    OR NEW.aggregate_id IS NOT OLD.aggregate_id
    OR NEW.event_type IS NOT OLD.event_type
    OR NEW.payload IS NOT OLD.payload
    OR NEW.headers IS NOT OLD.headers
    OR NEW.topic IS NOT OLD.topic
    OR NEW.traceparent IS NOT OLD.traceparent
    OR NEW.occurred_at IS NOT OLD.occurred_at
    OR NEW.created_at IS NOT OLD.created_at)
BEGIN
    SELECT RAISE(ABORT, 'an event cannot change once written (its row is pending or published): write a new event instead; only a parked row may be corrected, then `idem outbox retry` ({bare:outbox}_written_once_check)');
END;
