//! Measures `Dispatcher::run` draining effect intents from PostgreSQL to a fast fake remote
//! (an axum route that answers `201 {}` at once), so that the dispatcher and its SQL are the
//! bound, not the remote.
//!
//! ```text
//! IDEM_TEST_PG_URL=postgres://postgres@127.0.0.1:5432/postgres \
//!   cargo run -p idem-effects --example dispatch_throughput -- 20000 8 3
//! ```
//!
//! Arguments: intents per run (default 20000), concurrency (default 8), runs (default 3). It
//! creates the database `idem_effects_bench`, drops it at the end, and prints intents/s and WAL
//! syncs per intent per run (`pg_stat_wal`, the whole server's: run it on a quiet server) and the
//! dispatcher's transactions per intent (`pg_stat_database`, this database's only).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use idem_core::TableNames;
use idem_effects::{Dispatcher, DispatcherConfig, EffectMetrics};
use sqlx::{Connection, PgConnection, PgPool};

const DB: &str = "idem_effects_bench";

fn arg(i: usize, default: u64) -> u64 {
    std::env::args()
        .nth(i)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

/// The fake remote's URL.
async fn fake_remote() -> String {
    let app = axum::Router::new().route(
        "/awards",
        axum::routing::post(|| async { (axum::http::StatusCode::CREATED, "{}") }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/awards", listener.local_addr().unwrap());
    let nodelay = std::env::var_os("NODELAY").is_some();
    let listener = axum::serve::ListenerExt::tap_io(listener, move |tcp| {
        if nodelay {
            let _ = tcp.set_nodelay(true);
        }
    });
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

async fn fill(pool: &PgPool, n: u64, target: &str) {
    sqlx::query("TRUNCATE idem_effect_intents")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO idem_effect_intents (idem_key, effect, target, event_id, body) \
         SELECT 'event-' || u || '-points.award', 'points.award', $1, u, '{\"points\": 1}' \
         FROM (SELECT gen_random_uuid() AS u FROM generate_series(1, $2)) g",
    )
    .bind(target)
    .bind(i64::try_from(n).unwrap())
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("VACUUM ANALYZE idem_effect_intents")
        .execute(pool)
        .await
        .unwrap();
}

/// Drains `n` intents: intents/s, WAL syncs per intent (the server's, other sessions'
/// included) and transactions per intent (this database's, the dispatcher's only).
async fn drain(pool: &PgPool, n: u64, concurrency: usize) -> (f64, f64, f64) {
    let intents = idem_sql::postgres::PgIntents::new(pool.clone(), TableNames::default());
    let config = DispatcherConfig {
        concurrency,
        timeout: Duration::from_secs(10),
        lease: Duration::from_secs(30),
        ..DispatcherConfig::default()
    };
    let d = Dispatcher::new(intents, config, EffectMetrics::unregistered().unwrap()).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let syncs_before = wal_syncs(pool).await;
    let commits_before = commits(pool).await;
    let polls = std::sync::atomic::AtomicI64::new(0);
    let started = Instant::now();
    let run = d.run(async {
        let _ = stopped.await;
    });
    let watch = async {
        loop {
            polls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let done: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM idem_effect_intents WHERE status = 'done'",
            )
            .fetch_one(pool)
            .await
            .unwrap();
            if u64::try_from(done).unwrap() >= n {
                let _ = stop.send(());
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let (r, ()) = tokio::join!(run, watch);
    r.unwrap();
    let elapsed = started.elapsed().as_secs_f64();
    #[allow(clippy::cast_precision_loss)]
    let syncs = (wal_syncs(pool).await - syncs_before) as f64 / n as f64;
    // The watcher's own transactions (and the two reads of the counter) are not the dispatcher's.
    let own = polls.load(std::sync::atomic::Ordering::Relaxed) + 2;
    #[allow(clippy::cast_precision_loss)]
    let commits = (commits(pool).await - commits_before - own) as f64 / n as f64;
    #[allow(clippy::cast_precision_loss)]
    (n as f64 / elapsed, syncs, commits)
}

/// Transactions committed in this database so far (`pg_stat_database.xact_commit`; the
/// statistics are flushed with a delay of up to a second, hence the pause before reading).
async fn commits(pool: &PgPool) -> i64 {
    tokio::time::sleep(Duration::from_millis(1500)).await;
    sqlx::query_scalar(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// WAL syncs of the whole server so far (`pg_stat_wal`): every durable commit costs one, unless
/// group commit shares it.
async fn wal_syncs(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT wal_sync FROM pg_stat_wal")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::main]
async fn main() {
    let (n, concurrency, runs) = (arg(1, 20_000), arg(2, 8), arg(3, 3));
    let admin = std::env::var("IDEM_TEST_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let url = format!("{}/{DB}", &admin[..admin.rfind('/').unwrap()]);
    let mut conn = PgConnection::connect(&admin).await.unwrap();
    sqlx::query(&format!("DROP DATABASE IF EXISTS {DB} WITH (FORCE)"))
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query(&format!("CREATE DATABASE {DB}"))
        .execute(&mut conn)
        .await
        .unwrap();
    let pool = idem_sql::postgres::connect(&url, 8).await.unwrap();
    idem_sql::postgres::migrate(&pool, &TableNames::default())
        .await
        .unwrap();
    let target = fake_remote().await;
    for run in 1..=runs {
        fill(&pool, n, &target).await;
        let (rate, syncs, commits) = drain(&pool, n, usize::try_from(concurrency).unwrap()).await;
        println!(
            "run {run}: {n} intents, concurrency {concurrency}: {rate:.0} intents/s, \
             {commits:.3} transactions and {syncs:.3} WAL syncs (server-wide) per intent"
        );
    }
    pool.close().await;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {DB} WITH (FORCE)"))
        .execute(&mut conn)
        .await
        .unwrap();
}
