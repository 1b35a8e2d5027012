-- Bounds the claim that follows in the same transaction, whatever the statistics say (after a
-- mass re-pend they can claim that no row is pending): it is cancelled after $1 milliseconds
-- (an error the relay logs and retries, not a silent stall); it is planned for each execution
-- rather than from a plan cached while the outbox was empty; a sort may not replace the walk of
-- `pending_idx` in id order or of `pending_aggregate_idx` in aggregate order (with stale
-- statistics it would sort every pending row, once per claim); and no JIT compiles it (the
-- sort penalty would otherwise look like a costly plan worth compiling). Its commit does not wait
-- for the WAL flush (`synchronous_commit = off`): a lease lost to a PostgreSQL crash leaves its
-- rows pending and unleased, to be claimed and published again, which the consumer's inbox
-- absorbs (docs/concepts/duplicate-windows.md). Every setting ends with the transaction.
SELECT set_config('statement_timeout', $1, true),
       set_config('plan_cache_mode', 'force_custom_plan', true),
       set_config('enable_sort', 'off', true),
       set_config('jit', 'off', true),
       set_config('synchronous_commit', 'off', true)
