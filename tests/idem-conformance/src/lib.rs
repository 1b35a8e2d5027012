//! Test support for idem, not shipped: backend-agnostic store scenarios that run once per
//! database ([`scenarios`]), throwaway PostgreSQL databases ([`pg`]) and Apache Kafka brokers
//! ([`kafka`]), an OAuth 2 identity provider for OAUTHBEARER ([`oidc`]), records to hand a
//! consumer ([`records`]).
// Fixtures that own processes, pools and temporary directories; none is printed.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    missing_debug_implementations
)]

pub mod backend;
pub mod kafka;
pub mod oidc;
pub mod pg;
pub mod private_pg;
pub mod process;
pub mod records;
pub mod retention;
pub mod scenarios;

/// Generates one `#[tokio::test]` per scenario for a backend constructor.
///
/// ```ignore
/// idem_conformance::conformance_tests!(idem_conformance::backend::Sqlite::new().await);
/// ```
#[macro_export]
macro_rules! conformance_tests {
    ($make:expr) => {
        $crate::conformance_tests!(@each $make;
            commit_keeps_business_row_and_events,
            rollback_leaves_neither,
            enqueue_all_keeps_order_within_each_aggregate,
            minimal_contract_insert_is_publishable,
            contract_constraints_reject_bad_rows,
            an_event_cannot_change_once_written,
            duplicate_event_id_is_refused,
            a_missing_table_is_an_error_of_kind_not_migrated,
            commit_order_skew_never_skips_a_row,
            same_aggregate_writers_are_serialized_in_commit_order,
            claims_never_share_an_aggregate,
            stale_claim_cannot_mark,
            failed_rows_back_off_and_park,
            backlog_counts_pending_and_parked_rows_per_aggregate_type,
            prune_deletes_or_archives_published_rows,
            migrate_is_idempotent,
            custom_table_prefix_is_used,
            inbox_dedups_per_group_and_counts_deliveries,
            inbox_detects_a_payload_conflict,
            inbox_rows_roll_back_with_the_transaction,
            concurrent_inbox_inserts_let_exactly_one_apply,
            dead_letters_are_kept_once_per_record,
            idempotency_keys_claim_replay_and_scope,
            idempotency_keys_release_expire_and_sweep,
            idempotency_claims_are_fenced_by_their_token,
            a_renewed_claim_is_not_taken_over,
            concurrent_claims_of_one_key_let_exactly_one_execute,
            a_key_claimed_in_a_transaction_commits_or_rolls_back_with_it,
            a_claim_waits_for_the_transaction_holding_the_key,
            intents_commit_with_the_handler_and_keep_their_key,
            intents_recorded_as_a_batch_are_recorded_as_one_by_one,
            intent_outcomes_are_fenced_by_the_attempt,
            a_batch_of_outcomes_is_fenced_per_attempt,
            parked_intents_are_listed_and_retried_with_the_same_key,
            unknown_intents_are_read_and_resolved_by_a_decision,
            a_backing_off_aggregate_does_not_slow_the_others,
            an_undecodable_intent_is_parked_and_the_others_are_claimed,
            a_sending_mark_lasts_until_an_outcome_of_its_attempt_is_recorded,
            a_sending_mark_holds_the_next_attempt_for_its_settle
        );
    };
    (@each $make:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let backend = $make;
                $crate::scenarios::$name(&backend).await;
            }
        )*
    };
}
