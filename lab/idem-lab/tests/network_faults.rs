//! Network faults between one component and Apache Kafka: a broker prepared with proxied
//! listeners (`scripts/kafka prepare --proxied-listeners`) advertises, on each, the addresses
//! of the fault proxies in front of it, so a client bootstrapped there reaches every node
//! through its proxies only. A blackhole on one component's proxies stops that component and
//! no other; healing lets its held request through. A broker down behind a TCP proxy (its
//! connections accepted, then reset) is not taken for a TLS listener. A relay whose produce
//! reached the broker but whose answer did not come back leads to one effect. A writer cut
//! from PostgreSQL writes each order once.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::Duration;

use idem_conformance::kafka::{KafkaCluster, unique};
use idem_netfault::{Conditions, ProxiedListener};
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};

fn producer(bootstrap: &str) -> FutureProducer {
    ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("acks", "all")
        .set("enable.idempotence", "true")
        .set("message.timeout.ms", "60000")
        .create()
        .unwrap()
}

async fn send(p: &FutureProducer, topic: &str, value: &str) {
    let record = FutureRecord::to(topic).key("k").payload(value);
    p.send(record, Duration::from_secs(60)).await.unwrap();
}

#[test]
fn a_blackholed_component_is_cut_from_every_node_and_only_it() {
    let cluster = KafkaCluster::start_proxied(1, 2);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let relay = ProxiedListener::start(cluster.dir(), "P1", 1)
            .await
            .unwrap();
        let consumer_side = ProxiedListener::start(cluster.dir(), "P2", 2)
            .await
            .unwrap();
        let topic = unique("netfault");
        idem_kafka::ensure_topics(cluster.brokers(), std::slice::from_ref(&topic), 1, 1)
            .await
            .unwrap();
        let cut = producer(&relay.bootstrap());
        send(&cut, &topic, "before").await;
        let through = relay.proxies[0].stats();
        assert!(through.bytes_up > 0 && through.accepted >= 1, "{through:?}");

        relay.set(Conditions::blackhole());
        let held = send(&cut, &topic, "held");
        tokio::pin!(held);
        // The producer's only way to the node is its proxy: nothing is acknowledged while it
        // is blackholed (an absence can only be waited for).
        let early = tokio::time::timeout(Duration::from_secs(2), &mut held).await;
        assert!(early.is_err(), "a record passed a blackholed listener");
        // Another component, through its own proxies, still reaches the node.
        send(&producer(&consumer_side.bootstrap()), &topic, "beside").await;

        relay.set(Conditions::healthy());
        held.await;
        let values = read_all(&consumer_side.bootstrap(), &topic, 3);
        assert_eq!(values, ["before", "beside", "held"]);
    });
}

/// The first `n` values of `topic`'s only partition, read through `bootstrap`.
fn read_all(bootstrap: &str, topic: &str, n: usize) -> Vec<String> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", unique("netfault-reader"))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    consumer.subscribe(&[topic]).unwrap();
    let mut values = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while values.len() < n && std::time::Instant::now() < deadline {
        if let Some(m) = consumer.poll(Duration::from_millis(500)) {
            let m = m.unwrap();
            values
                .push(String::from_utf8(rdkafka::Message::payload(&m).unwrap().to_vec()).unwrap());
        }
    }
    values
}

/// A broker that is down behind a TCP proxy (a load balancer, a mesh's sidecar) looks to the
/// client like connections accepted and then cut during the first request, not refused:
/// the start-up check says the cluster is unreachable (a client keeps trying), not that the
/// listener wants TLS or SASL.
#[test]
fn a_broker_down_behind_a_proxy_is_unreachable_not_a_tls_listener() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let down = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let proxy = idem_netfault::Proxy::start("127.0.0.1:0".parse().unwrap(), down, 4)
            .await
            .unwrap();
        let through = idem_kafka::Connection::plaintext(proxy.addr().to_string());
        match through.check(Duration::from_secs(4)).await {
            Err(e @ idem_kafka::ConnectError::Unreachable(_)) => assert!(!e.is_refusal()),
            other => panic!("expected Unreachable, got {other:?}"),
        }
        assert!(proxy.stats().accepted >= 2, "{:?}", proxy.stats());
    });
}

/// The reference order service behind a fault proxy to PostgreSQL, each transaction held
/// open before its commit. Three faults hit a transaction in flight: a reset before its
/// `COMMIT`, a `COMMIT` that commits but whose answer is lost (the proxy delays it and the
/// connection is reset while it is on its way), and a reset again. The service writes each
/// order again until the database answers, takes the unique order row as the answer that got
/// lost, and every order is written once, with its one event.
#[test]
fn a_writer_cut_from_postgres_writes_each_order_once() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let db = idem_conformance::pg::TestDb::create().await;
        let setup = lab(&["setup", "--db", db.url()]).output().unwrap();
        assert!(setup.status.success(), "{setup:?}");
        let (proxy, routed) = behind_a_proxy(db.url(), 5).await;
        let log = tempfile::NamedTempFile::new().unwrap();
        let mut writer = lab(&[
            "orders", "--db", &routed, "--count", "40", "--prefix", "cut-",
        ])
        .args(["--slow-every", "1", "--slow", "150ms"])
        .env("RUST_LOG", "warn")
        .stderr(log.reopen().unwrap())
        .spawn()
        .unwrap();
        let mut written = 0;
        for pass in 0..3 {
            written = wait_for(db.pool(), written + 3).await;
            wait_in_transaction(db.pool()).await;
            if pass == 1 {
                // The `COMMIT` reaches the database a second late and its answer would come
                // back a second after that: the reset once the order is visible loses it.
                let committed = orders(db.pool()).await + 1;
                proxy.set(Conditions {
                    latency: Duration::from_secs(1),
                    ..Conditions::healthy()
                });
                wait_for(db.pool(), committed).await;
            }
            proxy.reset_all();
            proxy.set(Conditions::healthy());
        }
        let status = tokio::task::spawn_blocking(move || writer.wait().unwrap())
            .await
            .unwrap();
        let stderr = std::fs::read_to_string(log.path()).unwrap();
        assert!(status.success(), "the writer stopped: {stderr}");
        let retried = stderr.matches("writing the order again").count();
        assert!(retried >= 3, "{retried} retries after 3 resets: {stderr}");
        let lost_answers = stderr.matches("the order is written already").count();
        assert!(lost_answers >= 1, "{stderr}");
        assert!(proxy.stats().reset >= 3, "{:?}", proxy.stats());
        let (rows, events): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(DISTINCT order_id) FROM orders WHERE order_id LIKE 'cut-%'), \
                    (SELECT count(*) FROM idem_outbox WHERE aggregate_id LIKE 'cut-%')",
        )
        .fetch_one(db.pool())
        .await
        .unwrap();
        assert_eq!((orders(db.pool()).await, rows, events), (40, 40, 40));
    });
}

async fn orders(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Waits until `at_least` orders are written (a writer of seven a second gets there in well
/// under the minute allowed), returning how many are.
async fn wait_for(pool: &sqlx::PgPool, at_least: i64) -> i64 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let n = orders(pool).await;
        if n >= at_least {
            return n;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{n} of {at_least} orders"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the writer's session holds a transaction open (it holds each for 150 ms).
async fn wait_in_transaction(pool: &sqlx::PgPool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND state = 'idle in transaction'",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if open > 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no transaction held open"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn lab(args: &[&str]) -> std::process::Command {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_idem-lab"));
    c.args(args);
    c
}

/// The `host:port` of a PostgreSQL URL, and its address.
/// A fault proxy to the PostgreSQL server of `url` (seeded with `seed`), and `url` through it.
async fn behind_a_proxy(url: &str, seed: u64) -> (idem_netfault::Proxy, String) {
    let (authority, upstream) = postgres_address(url);
    let proxy = idem_netfault::Proxy::start("127.0.0.1:0".parse().unwrap(), upstream, seed)
        .await
        .unwrap();
    let routed = url.replacen(&authority, &proxy.addr().to_string(), 1);
    (proxy, routed)
}

fn postgres_address(url: &str) -> (String, std::net::SocketAddr) {
    let rest = url.split_once("://").unwrap().1;
    let auth = &rest[..rest.find(['/', '?']).unwrap_or(rest.len())];
    let host = auth.rsplit_once('@').map_or(auth, |(_, h)| h).to_owned();
    let addr = std::net::ToSocketAddrs::to_socket_addrs(&host)
        .unwrap()
        .next()
        .unwrap();
    (host, addr)
}

/// The outbox status of the event of order `order_id`, and the last publish error recorded for
/// it (none: no publish failed); none while the row does not exist.
async fn outbox_row(pool: &sqlx::PgPool, order_id: &str) -> Option<(String, Option<String>)> {
    sqlx::query_as("SELECT status, last_error FROM idem_outbox WHERE aggregate_id = $1")
        .bind(order_id)
        .fetch_optional(pool)
        .await
        .unwrap()
}

/// The outbox status of the event of order `order_id`.
async fn outbox_status(pool: &sqlx::PgPool, order_id: &str) -> Option<String> {
    outbox_row(pool, order_id).await.map(|(status, _)| status)
}

/// Waits until order `order_id`'s event has `status` in the outbox (the relay logs to `log`).
async fn wait_status(pool: &sqlx::PgPool, order_id: &str, status: &str, log: &Path) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while outbox_status(pool, order_id).await.as_deref() != Some(status) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{order_id} never became {status}; the relay's log: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The records of `topic` whose payload names payment `payment_id`, read from the cluster
/// directly (no proxy).
fn copies_of(brokers: &str, topic: &str, payment_id: &str) -> usize {
    let conn = idem_kafka::Connection::plaintext(brokers).client_config();
    idem_kafka::inspect::read_all_with(&conn, topic, Duration::from_secs(30))
        .unwrap()
        .iter()
        .filter(|r| r.payload.as_deref().is_some_and(|p| p.contains(payment_id)))
        .count()
}

/// An order written while the relay's answers from Kafka are held: once its record is in the
/// topic (read past the proxy), the row is still pending — the relay is between its produce and
/// the acknowledgement.
struct Unanswered {
    order: String,
    payment: String,
}

impl Unanswered {
    /// The copies of its record in the topic.
    async fn copies(&self, brokers: &str, topic: &str) -> usize {
        let (b, t, p) = (brokers.to_owned(), topic.to_owned(), self.payment.clone());
        tokio::task::spawn_blocking(move || copies_of(&b, &t, &p))
            .await
            .unwrap()
    }
}

async fn lose_the_answer(
    listener: &ProxiedListener,
    pool: &sqlx::PgPool,
    brokers: &str,
    topic: &str,
    write: &impl Fn(&str),
    (prefix, log): (&str, &Path),
) -> Unanswered {
    // A warm-up order published just before: the relay's producer has its connections up
    // (one it had to open under held answers would never get past its handshake, and the
    // produce would never leave), such as after the reset of the phase before.
    let warm = format!("{prefix}warm-");
    write(&warm);
    wait_status(pool, &format!("{warm}order-1"), "published", log).await;
    listener.set(Conditions::answers_held());
    write(prefix);
    let order = Unanswered {
        order: format!("{prefix}order-1"),
        payment: format!("{prefix}pay-1"),
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while order.copies(brokers, topic).await == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the produce never arrived; the relay's log: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
    }
    assert_eq!(
        outbox_status(pool, &order.order).await.as_deref(),
        Some("pending"),
        "the row was marked without an acknowledgement"
    );
    order
}

/// Waits until the relay recorded a failed publish of order `order_id` (its message timed
/// out): the row is pending with its error.
async fn wait_failed(pool: &sqlx::PgPool, order_id: &str, log: &Path) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Some((status, Some(_))) = outbox_row(pool, order_id).await
            && status == "pending"
        {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no failed publish of {order_id} recorded; the relay's log: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A relay whose produce reaches the broker while the broker's answer does not come back (held
/// by its proxy): the record is in the topic while the row is still pending. An answer lost to
/// a reset is absorbed by the idempotent producer (the broker drops the retried batch); an
/// answer held past the producer's timeout makes the relay publish the row again, and the
/// consumer's inbox applies the second copy as nothing. Each order has one effect.
#[test]
fn a_relay_that_loses_the_acknowledgement_after_its_produce_leads_to_one_effect() {
    let cluster = KafkaCluster::start_proxied(1, 1);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (orders_db, audit_db) = (
            idem_conformance::pg::TestDb::create().await,
            idem_conformance::pg::TestDb::create().await,
        );
        for db in [&orders_db, &audit_db] {
            let setup = lab(&["setup", "--db", db.url()]).output().unwrap();
            assert!(setup.status.success(), "{setup:?}");
        }
        let topic = unique("acklost");
        let prefix = topic.strip_suffix("order").unwrap_or(&topic).to_owned();
        let topic = format!("{prefix}.order");
        idem_kafka::ensure_topics(cluster.brokers(), std::slice::from_ref(&topic), 1, 1)
            .await
            .unwrap();
        let listener = ProxiedListener::start(cluster.dir(), "P1", 3)
            .await
            .unwrap();
        let log = tempfile::NamedTempFile::new().unwrap();
        let mut relay = lab(&[
            "relay",
            "--db",
            orders_db.url(),
            "--brokers",
            &listener.bootstrap(),
            "--topic-prefix",
            &format!("{prefix}."),
            "--lease",
            "31s",
            "--retry-backoff-max",
            "1s",
            // Far longer than the test takes to see a held produce in the topic (a consumer
            // reading it, on a loaded machine): the reset of phase b comes before it.
            "--producer-config",
            "message.timeout.ms=15000",
        ])
        .env("RUST_LOG", "info")
        .stderr(log.reopen().unwrap())
        .spawn()
        .unwrap();
        let write = |prefix: &str| {
            let out = lab(&[
                "orders",
                "--db",
                orders_db.url(),
                "--count",
                "1",
                "--prefix",
                prefix,
            ])
            .output()
            .unwrap();
            assert!(out.status.success(), "{out:?}");
        };
        write("a-");
        wait_status(orders_db.pool(), "a-order-1", "published", log.path()).await;

        let brokers = cluster.brokers().to_owned();
        // The answer lost to a reset: the producer sends the batch again on a new connection
        // with its sequence number, and the broker drops it as a duplicate.
        let hold = |prefix: &'static str| {
            let at = (prefix, log.path());
            lose_the_answer(&listener, orders_db.pool(), &brokers, &topic, &write, at)
        };
        let b = hold("b-").await;
        let failed = outbox_row(orders_db.pool(), &b.order)
            .await
            .and_then(|r| r.1);
        assert_eq!(
            failed, None,
            "the produce timed out before its answer was reset"
        );
        listener.reset_all();
        listener.set(Conditions::healthy());
        wait_status(orders_db.pool(), &b.order, "published", log.path()).await;
        assert_eq!(
            b.copies(&brokers, &topic).await,
            1,
            "the broker kept the retry"
        );
        // The answer held past the producer's message timeout: the relay records the failed
        // publish, keeps the row pending, and publishes it again once the way heals: a second
        // copy, which the consumer's inbox absorbs.
        let c = hold("c-").await;
        wait_failed(orders_db.pool(), &c.order, log.path()).await;
        listener.set(Conditions::healthy());
        wait_status(orders_db.pool(), &c.order, "published", log.path()).await;
        assert_eq!(
            c.copies(&brokers, &topic).await,
            2,
            "the relay published once more"
        );
        let _ = relay.kill();
        let _ = relay.wait();
        // Six records (a, the two warm-ups, b, and c twice) for five orders: five rows, every
        // copy delivered.
        let (rows, deliveries) =
            consume_all(audit_db.pool(), audit_db.url(), &brokers, &topic, 6).await;
        assert_eq!(deliveries, 6, "every copy was delivered");
        assert_eq!(rows, 5, "five orders and six records: {rows} rows");
    });
}

/// Runs the audit consumer on `topic` until its inbox counts `records` deliveries (or a
/// minute passes): the audit rows and the deliveries.
async fn consume_all(
    pool: &sqlx::PgPool,
    url: &str,
    brokers: &str,
    topic: &str,
    records: i64,
) -> (i64, i64) {
    let mut consumer = lab(&[
        "settlement",
        "--db",
        url,
        "--brokers",
        brokers,
        "--group",
        "audit",
        "--topic",
        topic,
        "--handler",
        "audit",
    ])
    .env("RUST_LOG", "warn")
    .stderr(std::process::Stdio::null())
    .spawn()
    .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let counts = loop {
        let (rows, deliveries): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM audit_log), \
                    (SELECT COALESCE(sum(delivery_count), 0)::bigint FROM idem_inbox)",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if deliveries >= records || tokio::time::Instant::now() > deadline {
            break (rows, deliveries);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let _ = consumer.kill();
    let _ = consumer.wait();
    counts
}

/// A relay started while its database is cut off (a blackhole longer than the 10 s connect
/// timeout, as when it is restarted inside a partition or while the server restarts) waits for
/// the database instead of exiting, and publishes once the way heals.
#[test]
fn a_relay_started_while_its_database_is_cut_off_waits_and_publishes() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let db = idem_conformance::pg::TestDb::create().await;
        let setup = lab(&["setup", "--db", db.url()]).output().unwrap();
        assert!(setup.status.success(), "{setup:?}");
        let written = lab(&["orders", "--db", db.url(), "--count", "1", "--prefix", "w-"])
            .output()
            .unwrap();
        assert!(written.status.success(), "{written:?}");
        let (proxy, routed) = behind_a_proxy(db.url(), 11).await;
        proxy.set(Conditions::blackhole());
        let topic = unique("cutoff");
        let log = tempfile::NamedTempFile::new().unwrap();
        let mut relay = lab(&[
            "relay",
            "--db",
            &routed,
            "--brokers",
            &idem_conformance::kafka::shared(),
            "--topic-prefix",
            &format!("{topic}."),
            "--create-topics",
            "1",
        ])
        .env("RUST_LOG", "warn")
        .stderr(log.reopen().unwrap())
        .spawn()
        .unwrap();
        // The driver gives up on a connection after 10 s: wait for the relay's second try.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while std::fs::read_to_string(log.path())
            .unwrap()
            .matches("the database cannot be reached; trying again")
            .count()
            < 1
        {
            assert!(
                relay.try_wait().unwrap().is_none(),
                "the relay exited: {}",
                std::fs::read_to_string(log.path()).unwrap()
            );
            assert!(tokio::time::Instant::now() < deadline, "no retry logged");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        proxy.set(Conditions::healthy());
        wait_status(db.pool(), "w-order-1", "published", log.path()).await;
        let _ = relay.kill();
        let _ = relay.wait();
    });
}
