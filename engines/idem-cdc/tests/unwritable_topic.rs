//! One event whose topic does not exist, on a cluster that creates no topic on first use (as
//! production clusters run), is parked once the cluster says so (table mode), and every other
//! event flows; a session-start drain of such a row ends. A private one-node broker with
//! `auto.create.topics.enable=false`; the relay's producer creates no topic.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{World, eventually, ids, spawn, stop};
use idem_cdc::{CdcConfig, CdcMetrics, CdcRelay, Mode};
use idem_conformance::backend::Backend;
use idem_conformance::kafka::{self, KafkaCluster};
use idem_core::Event;
use idem_core::publish::Publisher;
use idem_kafka::KafkaPublisher;

/// A relay on `brokers` that creates no topic, with a short grace for unwritable topics.
fn relay(
    w: &World,
    brokers: &str,
    config: CdcConfig,
    metrics: CdcMetrics,
) -> CdcRelay<KafkaPublisher> {
    let producer = idem_kafka::producer_config(
        brokers,
        &[("message.timeout.ms".to_owned(), "2000".to_owned())],
    )
    .unwrap();
    let publisher = KafkaPublisher::new(producer).unwrap();
    CdcRelay::new(w.pg.url(), w.pg.pool().clone(), publisher, config, metrics)
}

/// Creates `topics` on `brokers` (a creating publisher sends each a first record) and returns
/// the test's settings: orders to `w.topic`, invoices to a topic nobody creates.
async fn setup(w: &mut World, brokers: &str, mode: Mode) -> (CdcConfig, String) {
    w.brokers = brokers.to_owned();
    let producer = idem_kafka::producer_config(brokers, &[]).unwrap();
    let creator = KafkaPublisher::new(producer)
        .unwrap()
        .with_topic_creation(1, Some(1));
    let first = |topic: &str| idem_core::publish::Message {
        topic: topic.to_owned(),
        key: "setup".to_owned(),
        payload: "{}".to_owned(),
        headers: vec![],
    };
    let sent = creator
        .publish(&[first(&w.topic), first(&w.dead_letters)])
        .await;
    assert!(sent.iter().all(Result::is_ok), "{sent:?}");
    let missing = kafka::unique("cdc-missing");
    let mut config = w.config_in(mode);
    config
        .topics
        .overrides
        .insert("invoice".to_owned(), missing.clone());
    config.unwritable_topic_grace = Duration::from_secs(2);
    (config, missing)
}

/// Waits until every one of `events` is on the world's topic (copies allowed).
async fn published(w: &World, events: &[&Event], running: &mut common::Running) {
    let want: Vec<String> = events.iter().map(|e| e.id().to_string()).collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let got = ids(&w.records(1, running).await);
        if want.iter().all(|id| got.contains(id)) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not all of {want:?} reached the topic: {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn invoice(id: &str) -> Event {
    Event::builder("invoice", id, "invoice.issued")
        .payload(&serde_json::json!({ "invoice": id }))
        .build()
        .unwrap()
}

fn order(id: &str) -> Event {
    common::event(id, 1)
}

#[tokio::test(flavor = "multi_thread")]
async fn an_event_for_a_topic_that_does_not_exist_is_set_aside_and_the_others_flow() {
    let cluster = KafkaCluster::start_with(1, &[("auto.create.topics.enable", "false")]);

    // Table mode: parked with the reason, whether the session-start drain or the stream
    // carried it; the orders after it published.
    let mut w = World::new().await;
    let table = Mode::Table(w.pg.tables().clone());
    let (config, missing) = setup(&mut w, cluster.brokers(), table).await;
    let drained = invoice("i-0");
    w.commit(std::slice::from_ref(&drained)).await; // before the slot: the drain's
    let metrics = CdcMetrics::unregistered().unwrap();
    let r = relay(&w, cluster.brokers(), config, metrics.clone());
    r.prepare().await.unwrap();
    let mut running = spawn(r);
    let (o1, i1, o2, o3) = (order("o-1"), invoice("i-1"), order("o-2"), order("o-3"));
    for e in [&o1, &i1, &o2, &o3] {
        w.commit(std::slice::from_ref(e)).await;
    }
    // The drain ended and the orders committed after the invoice are published (the drain's
    // claims may send copies of streamed rows: at least once).
    published(&w, &[&o1, &o2, &o3], &mut running).await;
    let outbox = w.pg.tables().qualified("outbox");
    let parked = format!("SELECT count(*) FROM {outbox} WHERE status = 'parked'");
    eventually("both invoices parked", || {
        let (w, sql) = (&w, parked.clone());
        async move { w.pg.scalar(&sql).await == 2 }
    })
    .await;
    let reasons: Vec<String> = sqlx::query_scalar(&format!(
        "SELECT last_error FROM {outbox} WHERE aggregate_type = 'invoice'"
    ))
    .fetch_all(w.pg.pool())
    .await
    .unwrap();
    for why in &reasons {
        assert!(
            why.contains(&format!("topic {missing} does not exist")),
            "{why}"
        );
    }
    // The stream carries i-1 too (the drain's claims may take it first): set aside there as well.
    eventually("the stream's copy set aside", || {
        let n = metrics.refused.with_label_values(&["parked"]).get();
        async move { n >= 1 }
    })
    .await;
    let o4 = order("o-4");
    w.commit(std::slice::from_ref(&o4)).await;
    published(&w, &[&o4], &mut running).await; // a later batch flows
    stop(running).await;
}

/// Message mode has no table to park in: the record for the missing topic is dead-lettered
/// whole (key, value, headers, and the topic it was meant for), the slot confirms past it, the
/// others flow; once the topic exists, `replay` publishes it there as it was.
#[tokio::test(flavor = "multi_thread")]
async fn message_mode_dead_letters_the_whole_record_and_replays_it_once_the_topic_exists() {
    let cluster = KafkaCluster::start_with(1, &[("auto.create.topics.enable", "false")]);
    let mut w = World::new().await;
    let mode = Mode::Messages {
        prefix: "idem.outbox".to_owned(),
    };
    let (config, missing) = setup(&mut w, cluster.brokers(), mode).await;
    let r = relay(
        &w,
        cluster.brokers(),
        config,
        CdcMetrics::unregistered().unwrap(),
    );
    r.prepare().await.unwrap();
    let mut running = spawn(r);
    let (o1, i1, o2) = (order("o-1"), invoice("i-1"), order("o-2"));
    for e in [&o1, &i1, &o2] {
        let mut tx = w.pg.pool().begin().await.unwrap();
        idem_sql::postgres::MessageOutbox::default()
            .enqueue_all(&mut tx, std::slice::from_ref(e))
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    published(&w, &[&o1, &o2], &mut running).await;
    let letters = w.records_in(&w.dead_letters, 2, &mut running).await;
    let letter = letters
        .iter()
        .find(|l| l.header("ce_id") == Some(i1.id().to_string().as_str()))
        .unwrap_or_else(|| panic!("no dead letter of i-1: {letters:?}"));
    assert_eq!(
        letter.header("idem_dead_letter_topic"),
        Some(missing.as_str())
    );
    let why = letter.header("idem_dead_letter_reason").unwrap();
    assert!(
        why.contains(&format!("topic {missing} does not exist")),
        "{why}"
    );
    let after_i1 = w.wal_position().await;
    let slot = idem_cdc::Name::new("slot", &w.slot).unwrap();
    eventually("the slot to confirm past the invoice", || async {
        idem_cdc::slot_state(w.pg.pool(), &slot)
            .await
            .unwrap()
            .and_then(|s| s.confirmed_flush_lsn)
            .as_deref()
            .and_then(idem_cdc::changes::parse_lsn)
            .is_some_and(|confirmed| i64::try_from(confirmed).unwrap() >= after_i1)
    })
    .await;
    stop(running).await;

    // The topic made, the letter goes where it was meant to, as it was.
    let producer = idem_kafka::producer_config(cluster.brokers(), &[]).unwrap();
    let publisher = KafkaPublisher::new(producer)
        .unwrap()
        .with_topic_creation(1, Some(1));
    let as_message = |r: &idem_kafka::inspect::Record| idem_core::publish::Message {
        topic: w.dead_letters.clone(),
        key: r.key.clone().unwrap_or_default(),
        payload: r.payload.clone().unwrap_or_default(),
        headers: r.headers.clone(),
    };
    let all: Vec<_> = letters.iter().map(as_message).collect();
    let done = idem_cdc::replay::replay(&publisher, &all, std::slice::from_ref(&missing)).await;
    assert_eq!(done.published, 1, "{done:?}");
    assert!(done.failed.is_empty(), "{done:?}");
    let mut idle = common::spawn_idle();
    let replayed = w.records_in(&missing, 1, &mut idle).await;
    assert_eq!(replayed.len(), 1);
    let (got, kept) = (&replayed[0], letter);
    assert_eq!(
        (got.key.as_deref(), got.payload.as_deref()),
        (kept.key.as_deref(), kept.payload.as_deref())
    );
    assert_eq!(got.header("ce_id"), kept.header("ce_id"));
    assert_eq!(got.header("idem_dead_letter_topic"), None);
    assert_eq!(got.header("idem_dead_letter_reason"), None);
    stop(idle).await;
}
