//! The server-side Idempotency-Key store ([`IdempotencyStore`], [`TransactionalKeyStore`],
//! idem-sql's `keys.rs`): claims, replays and their scope, release, expiry and sweep, fencing by
//! the claim's token, renewal, concurrent claims, and claims made inside a transaction.

use std::time::Duration;

use idem_core::idempotency::{
    ClaimToken, IdempotencyKey, IdempotencyStore, KeyClaim, StoredResponse, TransactionalKeyStore,
    TxClaim,
};

use super::MINUTE;
use crate::backend::Backend;

scenarios! {
    keys_scenarios;
    idempotency_keys_claim_replay_and_scope,
    idempotency_keys_release_expire_and_sweep,
    idempotency_claims_are_fenced_by_their_token,
    a_renewed_claim_is_not_taken_over,
    concurrent_claims_of_one_key_let_exactly_one_execute,
    a_key_claimed_in_a_transaction_commits_or_rolls_back_with_it,
    a_claim_waits_for_the_transaction_holding_the_key,
}

/// The token of a claim that must be new.
#[track_caller]
fn new_claim(c: KeyClaim) -> ClaimToken {
    match c {
        KeyClaim::New(token) => token,
        other => panic!("expected a new claim, got {other:?}"),
    }
}

/// Claims `k` for client "c" with a lock that has already run out.
async fn claim_with_zero_lock<K: IdempotencyStore>(keys: &K, k: &IdempotencyKey) -> ClaimToken {
    new_claim(
        keys.claim("c", k, "fp", Duration::ZERO, MINUTE)
            .await
            .unwrap(),
    )
}

fn empty(status: u16) -> StoredResponse {
    StoredResponse {
        status,
        headers: vec![],
        body: vec![],
    }
}

pub async fn idempotency_keys_claim_replay_and_scope<B: Backend>(b: &B) {
    let keys = b.keys();
    let k = IdempotencyKey::new("order-10042-points").unwrap();
    let a = new_claim(
        keys.claim("client-a", &k, "fp1", MINUTE, MINUTE)
            .await
            .unwrap(),
    );
    assert_eq!(
        keys.claim("client-a", &k, "fp1", MINUTE, MINUTE)
            .await
            .unwrap(),
        KeyClaim::InFlight
    );
    assert_eq!(
        keys.claim("client-a", &k, "fp2", MINUTE, MINUTE)
            .await
            .unwrap(),
        KeyClaim::Mismatch
    );
    let b_token = new_claim(
        keys.claim("client-b", &k, "fp1", MINUTE, MINUTE)
            .await
            .unwrap(),
    );
    assert_ne!(a, b_token, "every claim has its own token");
    let resp = StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body: br#"{"award":1}"#.to_vec(),
    };
    assert!(keys.complete("client-a", &k, &a, &resp).await.unwrap());
    assert_eq!(
        keys.claim("client-a", &k, "fp1", MINUTE, MINUTE)
            .await
            .unwrap(),
        KeyClaim::Completed(resp)
    );
    assert_eq!(
        keys.claim("client-a", &k, "fp2", MINUTE, MINUTE)
            .await
            .unwrap(),
        KeyClaim::Mismatch
    );
    assert_eq!(
        keys.claim("client-b", &k, "fp1", MINUTE, MINUTE)
            .await
            .unwrap(),
        KeyClaim::InFlight,
        "B never sees A's response"
    );
}

pub async fn idempotency_keys_release_expire_and_sweep<B: Backend>(b: &B) {
    let keys = b.keys();
    let k = IdempotencyKey::new("k").unwrap();
    let t = new_claim(keys.claim("c", &k, "fp", MINUTE, MINUTE).await.unwrap());
    assert!(keys.release("c", &k, &t).await.unwrap());
    new_claim(
        keys.claim("c", &k, "fp", Duration::ZERO, MINUTE)
            .await
            .unwrap(),
    );
    // The in-flight lock ran out (its server died mid-request): the same request takes over.
    // (Time has to pass here: this waits past the zero-length lock, it synchronises nothing.)
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(
        keys.claim("c", &k, "other", MINUTE, MINUTE).await.unwrap(),
        KeyClaim::Mismatch,
        "a dead claim is taken over only by the same request"
    );
    let t = new_claim(keys.claim("c", &k, "fp", MINUTE, MINUTE).await.unwrap());
    assert!(keys.complete("c", &k, &t, &empty(200)).await.unwrap());
    let old = IdempotencyKey::new("old").unwrap();
    let t = new_claim(
        keys.claim("c", &old, "fp", MINUTE, Duration::ZERO)
            .await
            .unwrap(),
    );
    assert!(keys.complete("c", &old, &t, &empty(200)).await.unwrap());
    let live = IdempotencyKey::new("live").unwrap();
    new_claim(
        keys.claim("c", &live, "fp", MINUTE, Duration::ZERO)
            .await
            .unwrap(),
    );
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(
        keys.sweep().await.unwrap(),
        1,
        "only the expired completed key is swept, not an expired claim whose lock is live"
    );
    assert!(matches!(
        keys.claim("c", &k, "fp", MINUTE, MINUTE).await.unwrap(),
        KeyClaim::Completed(_)
    ));
    assert_eq!(
        keys.claim("c", &live, "fp", MINUTE, MINUTE).await.unwrap(),
        KeyClaim::InFlight,
        "a live claim is not taken over, even past its retention"
    );
    new_claim(
        keys.claim("c", &old, "other", MINUTE, MINUTE)
            .await
            .unwrap(),
    );
}

/// At the store: A's lock runs out, B takes the key over; A's renew, complete and
/// release change nothing and say so, and B's claim is intact.
pub async fn idempotency_claims_are_fenced_by_their_token<B: Backend>(b: &B) {
    let keys = b.keys();
    let k = IdempotencyKey::new("slow").unwrap();
    let a = claim_with_zero_lock(&keys, &k).await;
    // Time has to pass: A's zero-length lock runs out.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let b_token = new_claim(keys.claim("c", &k, "fp", MINUTE, MINUTE).await.unwrap());
    assert!(
        !keys.renew("c", &k, &a, MINUTE).await.unwrap(),
        "A's renew is fenced"
    );
    assert!(
        !keys.release("c", &k, &a).await.unwrap(),
        "A's release is fenced"
    );
    assert!(
        !keys.complete("c", &k, &a, &empty(201)).await.unwrap(),
        "A's completion is fenced"
    );
    assert_eq!(
        keys.claim("c", &k, "fp", MINUTE, MINUTE).await.unwrap(),
        KeyClaim::InFlight,
        "B's claim survived A's release and completion"
    );
    assert!(keys.renew("c", &k, &b_token, MINUTE).await.unwrap());
    assert!(keys.complete("c", &k, &b_token, &empty(202)).await.unwrap());
    assert_eq!(
        keys.claim("c", &k, "fp", MINUTE, MINUTE).await.unwrap(),
        KeyClaim::Completed(empty(202)),
        "B's response, not A's"
    );
    assert!(
        !keys.complete("c", &k, &b_token, &empty(203)).await.unwrap(),
        "once"
    );
    assert!(
        !keys.release("c", &k, &b_token).await.unwrap(),
        "a completed key is kept"
    );
}

/// A claim renewed before its lock runs out is never taken over.
pub async fn a_renewed_claim_is_not_taken_over<B: Backend>(b: &B) {
    let keys = b.keys();
    let k = IdempotencyKey::new("renewed").unwrap();
    let a = claim_with_zero_lock(&keys, &k).await;
    assert!(keys.renew("c", &k, &a, MINUTE).await.unwrap());
    // Time passes beyond the claim's first lock; the renewal holds it.
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(
        keys.claim("c", &k, "fp", MINUTE, MINUTE).await.unwrap(),
        KeyClaim::InFlight
    );
    assert!(keys.complete("c", &k, &a, &empty(201)).await.unwrap());
}

pub async fn concurrent_claims_of_one_key_let_exactly_one_execute<B: Backend>(b: &B) {
    let k = IdempotencyKey::new("same").unwrap();
    let mut tasks = vec![];
    for _ in 0..10 {
        let (keys, k) = (b.keys(), k.clone());
        tasks.push(tokio::spawn(async move {
            keys.claim("c", &k, "fp", MINUTE, MINUTE).await.unwrap()
        }));
    }
    let mut new = 0;
    for t in tasks {
        match t.await.unwrap() {
            KeyClaim::New(_) => new += 1,
            KeyClaim::InFlight => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(new, 1);
}

/// The open transaction of a claim that must be new.
#[track_caller]
fn new_tx<T>(c: TxClaim<T>) -> (T, ClaimToken) {
    match c {
        TxClaim::New { tx, token } => (tx, token),
        TxClaim::InFlight => panic!("expected a new claim, got InFlight"),
        TxClaim::Mismatch => panic!("expected a new claim, got Mismatch"),
        TxClaim::Completed(r) => panic!("expected a new claim, got Completed({r:?})"),
    }
}

/// A claim made in a transaction exists only when the transaction commits with the response:
/// rolled back (or fenced by a wrong token) it leaves the key free; committed, it replays; a
/// claim in flight outside a transaction is in flight for a transactional claim too.
pub async fn a_key_claimed_in_a_transaction_commits_or_rolls_back_with_it<B: Backend>(b: &B) {
    let keys = b.keys();
    let k = IdempotencyKey::new("tx").unwrap();
    let (tx, _) = new_tx(
        keys.claim_in_transaction("c", &k, "fp", MINUTE, MINUTE)
            .await
            .unwrap(),
    );
    keys.roll_back(tx).await;
    let (tx, token) = new_tx(
        keys.claim_in_transaction("c", &k, "fp", MINUTE, MINUTE)
            .await
            .unwrap(),
    );
    let wrong = ClaimToken::random();
    assert!(
        !keys
            .complete_and_commit(tx, "c", &k, &wrong, &empty(201))
            .await
            .unwrap(),
        "a completion with another token is fenced and rolls back"
    );
    let (tx, token2) = new_tx(
        keys.claim_in_transaction("c", &k, "fp", MINUTE, MINUTE)
            .await
            .unwrap(),
    );
    assert_ne!(token.as_str(), token2.as_str());
    assert!(
        keys.complete_and_commit(tx, "c", &k, &token2, &empty(201))
            .await
            .unwrap()
    );
    assert_eq!(
        keys.claim("c", &k, "fp", MINUTE, MINUTE).await.unwrap(),
        KeyClaim::Completed(empty(201))
    );
    match keys
        .claim_in_transaction("c", &k, "fp", MINUTE, MINUTE)
        .await
        .unwrap()
    {
        TxClaim::Completed(r) => assert_eq!(r, empty(201)),
        _ => panic!("a committed key replays"),
    }
    assert!(matches!(
        keys.claim_in_transaction("c", &k, "other", MINUTE, MINUTE)
            .await
            .unwrap(),
        TxClaim::Mismatch
    ));
    let in_flight = IdempotencyKey::new("plain").unwrap();
    new_claim(
        keys.claim("c", &in_flight, "fp", MINUTE, MINUTE)
            .await
            .unwrap(),
    );
    assert!(matches!(
        keys.claim_in_transaction("c", &in_flight, "fp", MINUTE, MINUTE)
            .await
            .unwrap(),
        TxClaim::InFlight
    ));
}

/// PostgreSQL: a second claim of a key held by an open transaction waits on the key's row,
/// then replays the committed response (or claims the key when the first rolled back). SQLite
/// has one writer at a time: the second transaction waits for the write lock, which the
/// scenario above covers by running one after the other.
pub async fn a_claim_waits_for_the_transaction_holding_the_key<B: Backend>(b: &B) {
    if !B::CONCURRENT_WRITERS {
        return;
    }
    for commit in [true, false] {
        let keys = b.keys();
        let k = IdempotencyKey::new(if commit { "held-c" } else { "held-r" }).unwrap();
        let (tx, token) = new_tx(
            keys.claim_in_transaction("c", &k, "fp", MINUTE, MINUTE)
                .await
                .unwrap(),
        );
        let waiters = b
            .scalar("SELECT count(*) FROM pg_locks WHERE NOT granted")
            .await;
        let (keys2, k2) = (keys.clone(), k.clone());
        let second = tokio::spawn(async move {
            keys2
                .claim_in_transaction("c", &k2, "fp", MINUTE, MINUTE)
                .await
                .unwrap()
        });
        while b
            .scalar("SELECT count(*) FROM pg_locks WHERE NOT granted")
            .await
            <= waiters
        {
            tokio::task::yield_now().await;
        }
        assert!(!second.is_finished(), "the second claim waits on the key");
        if commit {
            assert!(
                keys.complete_and_commit(tx, "c", &k, &token, &empty(201))
                    .await
                    .unwrap()
            );
            match second.await.unwrap() {
                TxClaim::Completed(r) => assert_eq!(r, empty(201)),
                _ => panic!("the second claim replays the committed response"),
            }
        } else {
            keys.roll_back(tx).await;
            let (tx2, _) = new_tx(second.await.unwrap());
            keys.roll_back(tx2).await;
        }
    }
}
