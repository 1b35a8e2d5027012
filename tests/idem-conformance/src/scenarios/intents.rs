//! Effect intents ([`IntentStore`], idem-sql's `intents.rs`): recorded with the handler's
//! transaction, claimed and fenced per attempt, parked, unknown and resolved by a decision, an
//! undecodable row parked, and the durable sending mark.

use std::time::Duration;

use idem_core::EventId;
use idem_core::idempotency::{EffectIntent, IntentOutcome, IntentStatus, IntentStore};

use super::{MINUTE, SECOND};
use crate::backend::{Backend, OpenTx};

scenarios! {
    intents_scenarios;
    intents_commit_with_the_handler_and_keep_their_key,
    intents_recorded_as_a_batch_are_recorded_as_one_by_one,
    intent_outcomes_are_fenced_by_the_attempt,
    a_batch_of_outcomes_is_fenced_per_attempt,
    parked_intents_are_listed_and_retried_with_the_same_key,
    unknown_intents_are_read_and_resolved_by_a_decision,
    an_undecodable_intent_is_parked_and_the_others_are_claimed,
    a_sending_mark_holds_the_next_attempt_for_its_settle,
    a_sending_mark_lasts_until_an_outcome_of_its_attempt_is_recorded,
}

fn intent(event: EventId) -> EffectIntent {
    EffectIntent {
        event_id: event,
        effect: "points.award".into(),
        target: "http://127.0.0.1:8088/awards".into(),
        body: serde_json::json!({"payment_id": "pay-1", "points": 12}),
        traceparent: None,
    }
}

pub async fn intents_commit_with_the_handler_and_keep_their_key<B: Backend>(b: &B) {
    let (kept, dropped) = (intent(EventId::new()), intent(EventId::new()));
    let mut tx = b.begin().await;
    assert!(tx.record_intent(&dropped).await.unwrap());
    tx.rollback().await;
    let mut tx = b.begin().await;
    assert!(tx.record_intent(&kept).await.unwrap());
    assert!(
        !tx.record_intent(&kept).await.unwrap(),
        "recording the same effect twice is a no-op"
    );
    tx.commit().await;
    let intents = b.intents();
    let claimed = intents.claim(10, MINUTE).await.unwrap();
    assert_eq!(claimed.len(), 1, "the rolled-back intent does not exist");
    assert_eq!(claimed[0].key, kept.key().unwrap());
    assert_eq!((claimed[0].attempt, &claimed[0].intent), (1, &kept));
    assert!(
        intents.claim(10, MINUTE).await.unwrap().is_empty(),
        "leased"
    );
}

pub async fn intents_recorded_as_a_batch_are_recorded_as_one_by_one<B: Backend>(b: &B) {
    let (a, c, d) = (
        intent(EventId::new()),
        intent(EventId::new()),
        intent(EventId::new()),
    );
    let b2 = EffectIntent {
        traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
        body: serde_json::json!({"payment_id": "pay-\"2\"", "points": 3}),
        ..intent(EventId::new())
    };
    let mut tx = b.begin().await;
    assert!(tx.record_intents(&[]).await.unwrap().is_empty());
    assert!(tx.record_intent(&d).await.unwrap());
    assert_eq!(
        tx.record_intents(&[c.clone(), b2.clone(), c.clone(), a.clone(), d.clone()])
            .await
            .unwrap(),
        [true, true, false, true, false],
        "a key earlier in the batch or already recorded is skipped"
    );
    assert!(!tx.record_intent(&a).await.unwrap(), "one-by-one sees it");
    tx.commit().await;
    let mut tx = b.begin().await;
    let e = intent(EventId::new());
    assert_eq!(tx.record_intents(&[e]).await.unwrap(), [true]);
    tx.rollback().await;
    let mut claimed = b.intents().claim(10, MINUTE).await.unwrap();
    claimed.sort_by_key(|c| c.id);
    let got: Vec<&EffectIntent> = claimed.iter().map(|c| &c.intent).collect();
    let mut want = vec![&d, &c, &b2, &a];
    want.sort_by_key(|i| i.key().unwrap().as_str().to_owned());
    let mut got_sorted = got.clone();
    got_sorted.sort_by_key(|i| i.key().unwrap().as_str().to_owned());
    assert_eq!(
        got_sorted, want,
        "every column kept; the rolled-back batch is gone"
    );
    assert_eq!(got[0], &d, "recorded first");
}

pub async fn intent_outcomes_are_fenced_by_the_attempt<B: Backend>(b: &B) {
    let i = intent(EventId::new());
    let mut tx = b.begin().await;
    tx.record_intent(&i).await.unwrap();
    tx.commit().await;
    let store = b.intents();
    let first = store.claim(10, Duration::ZERO).await.unwrap().remove(0);
    tokio::time::sleep(Duration::from_millis(5)).await; // past the zero-length lease
    let second = store.claim(10, MINUTE).await.unwrap().remove(0);
    assert_eq!(
        (second.attempt, &second.key),
        (2, &first.key),
        "a new attempt, the same key"
    );
    let done = IntentOutcome::Done {
        status: 201,
        body: "{}".into(),
    };
    assert!(
        !store.finish(first.id, first.attempt, &done).await.unwrap(),
        "the stale dispatcher is fenced"
    );
    assert!(
        store
            .finish(
                second.id,
                second.attempt,
                &IntentOutcome::Retry {
                    after: MINUTE,
                    reason: "503".into()
                }
            )
            .await
            .unwrap()
    );
    assert!(
        store.claim(10, MINUTE).await.unwrap().is_empty(),
        "backing off"
    );
}

/// A batch of outcomes is recorded in one write, each fenced by its own attempt: the outcome of
/// an attempt whose claim expired and was taken again changes nothing, the others are recorded.
pub async fn a_batch_of_outcomes_is_fenced_per_attempt<B: Backend>(b: &B) {
    use idem_core::idempotency::FinishedAttempt;
    let mut tx = b.begin().await;
    for _ in 0..3 {
        tx.record_intent(&intent(EventId::new())).await.unwrap();
    }
    tx.commit().await;
    let store = b.intents();
    let stale = store.claim(1, Duration::ZERO).await.unwrap().remove(0);
    tokio::time::sleep(Duration::from_millis(5)).await; // past the zero-length lease
    let mut claimed = store.claim(10, MINUTE).await.unwrap();
    claimed.sort_by_key(|c| c.id);
    assert_eq!(claimed.len(), 3, "the expired one and the two others");
    let retaken = claimed.iter().find(|c| c.id == stale.id).unwrap();
    assert_eq!(retaken.attempt, 2);
    let done = |id, attempt| FinishedAttempt {
        id,
        attempt,
        outcome: IntentOutcome::Done {
            status: 201,
            body: format!("{{\"id\":{id}}}"),
        },
    };
    let mut batch: Vec<FinishedAttempt> = claimed
        .iter()
        .filter(|c| c.id != stale.id)
        .map(|c| done(c.id, c.attempt))
        .collect();
    batch.push(done(stale.id, stale.attempt));
    let mut recorded = store.finish_all(&batch).await.unwrap();
    recorded.sort_unstable();
    let others: Vec<i64> = claimed
        .iter()
        .map(|c| c.id)
        .filter(|id| *id != stale.id)
        .collect();
    assert_eq!(
        recorded, others,
        "the stale attempt is fenced, the others recorded"
    );
    let (_, status) = store.get(stale.id).await.unwrap().unwrap();
    assert_eq!(
        status,
        IntentStatus::Pending,
        "the fenced outcome changed nothing"
    );
    assert!(store.finish_all(&[]).await.unwrap().is_empty());
    assert_eq!(
        store.finish_all(&batch).await.unwrap(),
        vec![stale.id; 0],
        "a batch recorded once is not recorded again"
    );
    let again = store
        .finish_all(&[done(retaken.id, retaken.attempt)])
        .await
        .unwrap();
    assert_eq!(again, vec![stale.id], "the live attempt records");
    for c in &claimed {
        let (_, status) = store.get(c.id).await.unwrap().unwrap();
        assert_eq!(status, IntentStatus::Done, "{}", c.id);
    }
}

pub async fn parked_intents_are_listed_and_retried_with_the_same_key<B: Backend>(b: &B) {
    let i = intent(EventId::new());
    let mut tx = b.begin().await;
    tx.record_intent(&i).await.unwrap();
    tx.commit().await;
    let store = b.intents();
    let c = store.claim(10, MINUTE).await.unwrap().remove(0);
    let reason = "422: the key was used with a different request";
    assert!(
        store
            .finish(
                c.id,
                c.attempt,
                &IntentOutcome::Park {
                    reason: reason.into()
                }
            )
            .await
            .unwrap()
    );
    let stuck = store.stuck(10).await.unwrap();
    assert_eq!(stuck.len(), 1);
    assert_eq!(
        (stuck[0].status.as_str(), stuck[0].reason.as_deref()),
        ("parked", Some(reason))
    );
    assert_eq!(store.retry_stuck(Some(&[c.id])).await.unwrap(), 1);
    let again = store.claim(10, MINUTE).await.unwrap().remove(0);
    assert_eq!((again.key, again.attempt), (c.key, 2));
}

pub async fn unknown_intents_are_read_and_resolved_by_a_decision<B: Backend>(b: &B) {
    use idem_core::idempotency::Resolution;
    let (applied, resent) = (intent(EventId::new()), intent(EventId::new()));
    let mut tx = b.begin().await;
    tx.record_intent(&applied).await.unwrap();
    tx.record_intent(&resent).await.unwrap();
    tx.commit().await;
    let store = b.intents();
    let claimed = store.claim(10, MINUTE).await.unwrap();
    let unknown = IntentOutcome::Unknown {
        reason: "timed out; the remote ignores keys".into(),
    };
    for c in &claimed {
        assert!(store.finish(c.id, c.attempt, &unknown).await.unwrap());
    }
    let (a, r) = (&claimed[0], &claimed[1]);
    let (read, status) = store.get(a.id).await.unwrap().unwrap();
    assert_eq!(
        (read.key.clone(), status.as_str()),
        (a.key.clone(), "unknown")
    );
    assert_eq!(read.intent, applied);
    assert!(store.get(a.id + 1_000).await.unwrap().is_none());

    assert!(
        store
            .resolve(a.id, Resolution::Applied, "checked at the remote")
            .await
            .unwrap()
    );
    assert!(
        !store
            .resolve(a.id, Resolution::Pending, "again")
            .await
            .unwrap(),
        "a done intent is not reopened"
    );
    assert_eq!(
        store.get(a.id).await.unwrap().unwrap().1,
        IntentStatus::Done
    );
    assert!(
        store
            .resolve(r.id, Resolution::Pending, "compensated")
            .await
            .unwrap()
    );
    let again = store.claim(10, MINUTE).await.unwrap();
    assert_eq!(again.len(), 1, "only the re-sent one is due");
    assert_eq!(
        (again[0].id, &again[0].key, again[0].attempt),
        (r.id, &r.key, 2)
    );
    assert!(store.stuck(10).await.unwrap().is_empty());
}

/// A row written through the SQL contract by a foreign writer that cannot be decoded (here an
/// empty key) must not fail the whole claim after it committed, every lease period, so that no
/// intent is delivered any more: it is parked with its reason; the others are claimed.
pub async fn an_undecodable_intent_is_parked_and_the_others_are_claimed<B: Backend>(b: &B) {
    let t = b.tables().qualified("effect_intents");
    b.exec(&format!(
        "INSERT INTO {t} (idem_key, effect, target, event_id, body) \
         VALUES ('', 'points.award', 'http://127.0.0.1:1/awards', '018f0000-0000-7000-8000-000000000001', '{{}}')"
    ))
    .await
    .unwrap();
    let good = intent(EventId::new());
    let mut tx = b.begin().await;
    tx.record_intent(&good).await.unwrap();
    tx.commit().await;
    let store = b.intents();
    let claimed = store.claim(10, MINUTE).await.unwrap();
    assert_eq!(claimed.len(), 1, "the decodable intent is delivered");
    assert_eq!(claimed[0].intent, good);
    let stuck = store.stuck(10).await.unwrap();
    assert_eq!(stuck.len(), 1, "{stuck:?}");
    assert_eq!(stuck[0].status, IntentStatus::Parked);
    assert!(
        stuck[0]
            .reason
            .as_deref()
            .unwrap_or_default()
            .contains("cannot be decoded"),
        "{stuck:?}"
    );
    assert!(store.claim(10, MINUTE).await.unwrap().is_empty());
}

/// A sending mark holds every later attempt back for the policy's settle: the successor of a
/// dispatcher that died with the request in flight asks the remote only once the remote had
/// `settle` to finish that request (a probe asked sooner finds nothing, and the effect is sent
/// twice), although the lease ended long before.
pub async fn a_sending_mark_holds_the_next_attempt_for_its_settle<B: Backend>(b: &B) {
    let i = intent(EventId::new());
    let mut tx = b.begin().await;
    tx.record_intent(&i).await.unwrap();
    tx.commit().await;
    let store = b.intents();
    let first = store.claim(10, MINUTE).await.unwrap().remove(0);
    assert!(
        store
            .mark_sending(first.id, 1, SECOND, 60 * MINUTE)
            .await
            .unwrap()
    );
    // The dispatcher dies with the request in flight; its lease ends.
    b.end_intent_leases().await;
    assert!(
        store.claim(10, MINUTE).await.unwrap().is_empty(),
        "claimed again before the remote had its settle time"
    );
    // Once the settle time is over, the next attempt sees the unrecorded send.
    b.expire_intent_leases().await;
    let second = store.claim(10, MINUTE).await.unwrap().remove(0);
    assert_eq!((second.attempt, second.unrecorded_send), (2, Some(1)));
}

/// The durable sending mark: written only while the attempt holds enough lease,
/// seen by every later attempt until an outcome of the marked attempt is recorded, kept by a
/// retry of an attempt that sent nothing, cleared by a decision.
pub async fn a_sending_mark_lasts_until_an_outcome_of_its_attempt_is_recorded<B: Backend>(b: &B) {
    let i = intent(EventId::new());
    let mut tx = b.begin().await;
    tx.record_intent(&i).await.unwrap();
    tx.commit().await;
    let store = b.intents();
    let first = store.claim(10, MINUTE).await.unwrap().remove(0);
    assert_eq!(first.unrecorded_send, None);
    assert!(
        !store
            .mark_sending(first.id, 1, 2 * MINUTE, Duration::ZERO)
            .await
            .unwrap(),
        "the lease is too short for this request"
    );
    assert!(
        !store
            .mark_sending(first.id, 2, SECOND, Duration::ZERO)
            .await
            .unwrap(),
        "not this attempt's lease"
    );
    assert!(
        store
            .mark_sending(first.id, 1, SECOND, Duration::ZERO)
            .await
            .unwrap()
    );

    // The dispatcher dies; after the lease, the next attempt sees the unrecorded send.
    b.expire_intent_leases().await;
    let second = store.claim(10, MINUTE).await.unwrap().remove(0);
    assert_eq!((second.attempt, second.unrecorded_send), (2, Some(1)));
    let retry = |reason: &str| IntentOutcome::Retry {
        after: Duration::ZERO,
        reason: reason.into(),
    };
    assert!(
        !store.finish(first.id, 1, &retry("late")).await.unwrap(),
        "the dead attempt is fenced"
    );
    assert!(
        store
            .finish(second.id, 2, &retry("not sent: too little lease left"))
            .await
            .unwrap()
    );
    let third = store.claim(10, MINUTE).await.unwrap().remove(0);
    assert_eq!(
        third.unrecorded_send,
        Some(1),
        "a retry of an attempt that sent nothing keeps the mark"
    );
    assert!(
        store
            .mark_sending(third.id, 3, SECOND, Duration::ZERO)
            .await
            .unwrap()
    );
    assert!(store.finish(third.id, 3, &retry("429")).await.unwrap());
    let fourth = store.claim(10, MINUTE).await.unwrap().remove(0);
    assert_eq!(
        fourth.unrecorded_send, None,
        "attempt 3's outcome is recorded"
    );
    assert_eq!(
        store
            .get(fourth.id)
            .await
            .unwrap()
            .unwrap()
            .0
            .unrecorded_send,
        None
    );

    assert!(
        store
            .mark_sending(fourth.id, 4, SECOND, Duration::ZERO)
            .await
            .unwrap()
    );
    let unknown = IntentOutcome::Unknown {
        reason: "attempt 4 was sent and its outcome never recorded".into(),
    };
    b.expire_intent_leases().await;
    let fifth = store.claim(10, MINUTE).await.unwrap().remove(0);
    assert_eq!(fifth.unrecorded_send, Some(4));
    assert!(store.finish(fifth.id, 5, &unknown).await.unwrap());
    assert_eq!(store.retry_stuck(Some(&[fifth.id])).await.unwrap(), 1);
    let sixth = store.claim(10, MINUTE).await.unwrap().remove(0);
    assert_eq!(
        (sixth.attempt, sixth.unrecorded_send),
        (6, None),
        "a person's retry is a decision: the mark is gone"
    );
}
