//! The operator commands that change rows (`idem outbox retry`, `idem dead-letters replay
//! --confirm`, `idem effects retry|resolve|compensate`) write the same audit rows as the
//! console's buttons: who, what, on what, why, how many rows, how it ended.

use idem_sql::AnyStore;
use idem_sql::ops::Action;

/// An action that ran, to record.
pub(crate) struct Audited {
    /// `outbox.retry`, `dead_letters.replay`, `effects.applied`, …
    pub(crate) action: &'static str,
    /// The rows it acted on.
    pub(crate) target: String,
    /// Why (the command's `--reason`, or its note).
    pub(crate) reason: String,
    /// Rows changed.
    pub(crate) affected: u64,
    /// How it ended.
    pub(crate) outcome: String,
}

/// Who runs the command: `by`, else `$USER`, else `idem`.
pub(crate) fn actor(by: Option<&str>) -> String {
    by.map(str::to_owned)
        .or_else(|| std::env::var("USER").ok())
        .unwrap_or_else(|| "idem".to_owned())
}

/// Writes the audit row of an action that ran. A failure is said on standard error (the
/// action has run; the row cannot be taken back), and the command still succeeds.
pub(crate) async fn record(store: &AnyStore, by: Option<&str>, a: Audited) {
    let actor = actor(by);
    let action = Action {
        actor: &actor,
        action: a.action,
        target: &a.target,
        reason: &a.reason,
        affected: i64::try_from(a.affected).unwrap_or(i64::MAX),
        outcome: &a.outcome,
    };
    if let Err(e) = idem_sql::with_store!(store, s => s.ops().audit(action).await) {
        eprintln!(
            "warning: {} ran, and its audit row could not be written: {e}",
            a.action
        );
    }
}
