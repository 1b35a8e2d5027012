//! The operator's reads (`idem_sql::ops::Ops`) on PostgreSQL and SQLite: what each view shows
//! of a seeded database, the caps that bound them, and the audit.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use idem_conformance::backend::{Backend, Lite, Pg};
use idem_core::TableNames;
use idem_sql::Dialect;
use idem_sql::ops::{Action, Ops};

/// Outbox: two pending `order` rows, three parked (two `shipment` for one reason, one `order`
/// for another). Dead letters: two in `settlement` for one reason (one of them replayed), one
/// in `audit`. Inbox rows of two groups. Intents: one parked, one unknown, one done.
async fn seed<B: Backend>(b: &B) {
    for (n, ty) in [
        (1, "order"),
        (2, "order"),
        (3, "shipment"),
        (4, "shipment"),
        (5, "order"),
    ] {
        b.exec(&format!(
            "INSERT INTO idem_outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('00000000-0000-4000-8000-00000000000{n}', '{ty}', 'a-{n}', 'e', '{{\"n\":{n}}}')"
        ))
        .await
        .unwrap();
    }
    b.exec("UPDATE idem_outbox SET status = 'parked', last_error = 'no topic' WHERE aggregate_type = 'shipment'")
        .await
        .unwrap();
    b.exec("UPDATE idem_outbox SET status = 'parked', last_error = 'too large' WHERE aggregate_id = 'a-5'")
        .await
        .unwrap();
    for (offset, group, reason, outcome) in [
        (1, "settlement", "unknown order", "NULL"),
        (2, "settlement", "unknown order", "'applied'"),
        (3, "settlement", "unknown order", "NULL"),
        (4, "audit", "bad json", "NULL"),
    ] {
        b.exec(&format!(
            "INSERT INTO idem_dead_letters (consumer_group, topic, record_partition, record_offset, reason, payload, replay_outcome) \
             VALUES ('{group}', 't', 0, {offset}, '{reason}', '<b>{offset}</b>', {outcome})"
        ))
        .await
        .unwrap();
    }
    for (group, n) in [("settlement", 1), ("settlement", 2), ("audit", 3)] {
        b.exec(&format!(
            "INSERT INTO idem_inbox (consumer_group, event_id, event_type, aggregate_type, aggregate_id, payload_hash) \
             VALUES ('{group}', '00000000-0000-4000-8000-00000000010{n}', 'e', 'order', 'a', 'h')"
        ))
        .await
        .unwrap();
    }
    for (n, status) in [(1, "parked"), (2, "unknown"), (3, "done")] {
        b.exec(&format!(
            "INSERT INTO idem_effect_intents (idem_key, effect, target, event_id, body, status, last_error, response_status, response_body) \
             VALUES ('k{n}', 'points.award', 'http://127.0.0.1:9/awards', '00000000-0000-4000-8000-00000000020{n}', '{{}}', '{status}', 'why {n}', 422, 'no such member')"
        ))
        .await
        .unwrap();
    }
}

async fn views<B: Backend, DB: Dialect>(b: B, ops: Ops<DB>) {
    seed(&b).await;
    let s = ops.outbox_summary(1000).await.unwrap();
    assert_eq!((s.pending, s.parked), (2, 3));
    assert!(s.last_id >= 5, "{s:?}");
    assert!(
        s.oldest_pending_age
            .is_some_and(|a| (0.0..600.0).contains(&a)),
        "{s:?}"
    );
    let capped = ops.outbox_summary(1).await.unwrap();
    assert_eq!(
        (capped.pending, capped.parked),
        (1, 1),
        "counts stop at the cap"
    );

    let types = ops.outbox_types(1000).await.unwrap();
    let t: Vec<_> = types
        .iter()
        .map(|t| (t.aggregate_type.as_str(), t.pending, t.parked))
        .collect();
    assert_eq!(t, [("order", 2, 1), ("shipment", 0, 2)]);

    let reasons = ops.parked_reasons(1000).await.unwrap();
    let r: Vec<_> = reasons
        .iter()
        .map(|r| (r.reason.as_str(), r.rows))
        .collect();
    assert_eq!(r, [("no topic", 2), ("too large", 1)]);
    let all = ops.parked_rows(0, None, 10).await.unwrap();
    assert_eq!(all.len(), 3);
    assert_eq!(
        all[0].preview.replace(' ', ""),
        "{\"n\":3}",
        "the payload's start"
    );
    let one = ops.parked_rows(0, Some("too large"), 10).await.unwrap();
    assert_eq!(one.len(), 1);
    assert_eq!(one[0].aggregate_id, "a-5");
    let page = ops.parked_rows(all[0].id, None, 1).await.unwrap();
    assert_eq!(page[0].id, all[1].id, "pages by id");

    letters_and_intents(&ops).await;
    audit(&ops).await;
}

async fn letters_and_intents<DB: Dialect>(ops: &Ops<DB>) {
    assert_eq!(
        ops.consumer_groups().await.unwrap(),
        ["audit", "settlement"]
    );
    let groups = ops.letter_groups(1000).await.unwrap();
    let g: Vec<_> = groups
        .iter()
        .map(|g| (g.consumer_group.as_str(), g.reason.as_str(), g.letters))
        .collect();
    assert_eq!(
        g,
        [("settlement", "unknown order", 2), ("audit", "bad json", 1)],
        "open letters only"
    );
    let open = ops
        .letter_rows("settlement", 0, None, true, 10)
        .await
        .unwrap();
    assert_eq!(open.iter().map(|l| l.offset).collect::<Vec<_>>(), [1, 3]);
    assert_eq!(
        open[0].preview, "<b>1</b>",
        "kept as written; escaping is the page's"
    );
    let every = ops
        .letter_rows("settlement", 0, Some("unknown order"), false, 10)
        .await
        .unwrap();
    assert_eq!(every.len(), 3);
    assert_eq!(every[1].replay_outcome, "applied");

    let c = ops.intent_counts(1000).await.unwrap();
    assert_eq!((c.pending, c.parked, c.unknown), (0, 1, 1));
    let stuck = ops.intent_rows(0, None, 10).await.unwrap();
    assert_eq!(
        stuck.iter().map(|i| i.key.as_str()).collect::<Vec<_>>(),
        ["k1", "k2"]
    );
    assert_eq!(
        (stuck[0].response_status, stuck[0].response.as_str()),
        (Some(422), "no such member")
    );
    let unknown = ops.intent_rows(0, Some("unknown"), 10).await.unwrap();
    assert_eq!(unknown.len(), 1);
}

async fn audit<DB: Dialect>(ops: &Ops<DB>) {
    assert!(ops.cdc_slots().await.is_ok());
    for n in 1..=3 {
        let target = format!("outbox row {n}");
        ops.audit(Action {
            actor: "on-call",
            action: "outbox.retry",
            target: &target,
            reason: "fixed the topic",
            affected: 1,
            outcome: "done",
        })
        .await
        .unwrap();
    }
    let audit = ops.audit_rows(i64::MAX, 2).await.unwrap();
    assert_eq!(
        audit.iter().map(|a| a.target.as_str()).collect::<Vec<_>>(),
        ["outbox row 3", "outbox row 2"]
    );
    let older = ops.audit_rows(audit[1].id, 10).await.unwrap();
    assert_eq!(older.len(), 1);
    assert_eq!((older[0].actor.as_str(), older[0].affected), ("on-call", 1));
}

#[tokio::test]
async fn postgres_views_show_the_seeded_rows() {
    let pg = Pg::new().await;
    let ops = Ops::new(pg.pool().clone(), &TableNames::default());
    views(pg, ops).await;
}

#[tokio::test]
async fn sqlite_views_show_the_seeded_rows() {
    let lite = Lite::new().await;
    let url = format!("sqlite://{}", lite.path().display());
    let pool = idem_sql::sqlite::connect(&url).await.unwrap();
    views(lite, Ops::new(pool, &TableNames::default())).await;
}
