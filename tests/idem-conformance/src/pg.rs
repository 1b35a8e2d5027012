//! Throwaway PostgreSQL databases on the local server.
//!
//! `IDEM_TEST_PG_URL` names the server's maintenance database (default
//! `postgres://postgres@127.0.0.1:5432/postgres`). Each [`TestDb`] is a new database, dropped
//! (with `FORCE`) when it goes out of scope.

use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{Connection, PgConnection};

/// The maintenance URL.
pub fn admin_url() -> String {
    std::env::var("IDEM_TEST_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// A fresh database.
pub struct TestDb {
    name: String,
    url: String,
    pool: PgPool,
}

impl TestDb {
    pub async fn create() -> Self {
        let admin = admin_url();
        let name = format!("idem_test_{}", uuid::Uuid::new_v4().simple());
        let mut conn = PgConnection::connect(&admin).await.unwrap_or_else(|e| {
            panic!("cannot reach PostgreSQL at {admin} (set IDEM_TEST_PG_URL): {e}")
        });
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut conn)
            .await
            .unwrap();
        let url = match admin.rfind('/') {
            Some(i) => format!("{}/{name}", &admin[..i]),
            None => panic!("IDEM_TEST_PG_URL must end with /<database>"),
        };
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .connect(&url)
            .await
            .unwrap();
        TestDb { name, url, pool }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    pub fn url(&self) -> &str {
        &self.url
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        let admin = admin_url();
        // Drop runs outside async context guarantees: use a private runtime on a thread.
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                if let Ok(mut conn) = PgConnection::connect(&admin).await {
                    let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                        .execute(&mut conn)
                        .await;
                }
            });
        })
        .join();
    }
}
