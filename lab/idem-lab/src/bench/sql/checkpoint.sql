-- Levels the server's state before each part of a bracketed measurement (ceiling before, the
-- system phase, ceiling after): every dirty buffer written, the next checkpoint as far away for
-- each part, so none of them alone pays a checkpoint's writes or the full-page images that
-- follow one. Needs superuser or pg_checkpoint; without it the bench warns and goes on.
CHECKPOINT
