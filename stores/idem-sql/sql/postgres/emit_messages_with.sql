-- Message mode's enqueue in the same statement as the caller's own write (one round trip for
-- both). {business} is the caller's statement with its parameters $1…$n, run as a
-- data-modifying WITH query, which PostgreSQL runs to completion whether or not the rest
-- refers to it; it fails, and so nothing is emitted, if the write fails. Then the messages as
-- in emit_messages.sql (emit_message.sql for one event): {emit} is that statement's SELECT
-- with its $1 and $2 renumbered $n+1 and $n+2. Returns how many were emitted.
WITH idem_business AS ({business})
{emit}
