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
        TestDb::create_with("").await
    }

    /// A fresh database created with `options` after `CREATE DATABASE <name>` (e.g.
    /// `ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0`).
    pub async fn create_with(options: &str) -> Self {
        let admin = admin_url();
        let name = format!("idem_test_{}", uuid::Uuid::new_v4().simple());
        let mut conn = PgConnection::connect(&admin).await.unwrap_or_else(|e| {
            panic!("cannot reach PostgreSQL at {admin} (set IDEM_TEST_PG_URL): {e}")
        });
        sqlx::query(&format!("CREATE DATABASE {name} {options}"))
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

/// The TLS material `scripts/test` makes for the run (`IDEM_TEST_PG_TLS_DIR`): the CA that
/// signed the suite server's certificate, one that signed nothing of it, role `idem_tls`'s
/// password (that role is refused in clear) and role `idem_cert`'s client certificates (one
/// valid, one expired; that role authenticates by certificate only).
pub struct PgTlsMaterial {
    dir: std::path::PathBuf,
}

impl PgTlsMaterial {
    /// The run's material. Panics, saying what to do, when the test command did not make it.
    pub fn get() -> PgTlsMaterial {
        match std::env::var("IDEM_TEST_PG_TLS_DIR") {
            Ok(d) if !d.is_empty() => PgTlsMaterial { dir: d.into() },
            _ => panic!(
                "IDEM_TEST_PG_TLS_DIR is not set: scripts/test makes the TLS certificates and \
                 roles of the suite's PostgreSQL server; run the tests through it"
            ),
        }
    }

    /// A file of the material, by name.
    pub fn file(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    /// The CA that signed the server's certificate.
    pub fn ca(&self) -> String {
        self.file("ca.pem")
    }

    /// Role `idem_tls`'s password.
    pub fn password(&self) -> String {
        std::fs::read_to_string(self.dir.join("idem_tls.password"))
            .unwrap_or_else(|e| panic!("reading idem_tls.password: {e}"))
            .trim()
            .to_owned()
    }

    /// `postgres://idem_tls:<password>@<host>:5432/<db>?<params>`.
    pub fn tls_url(&self, host: &str, db: &str, params: &str) -> String {
        format!(
            "postgres://idem_tls:{}@{host}:5432/{db}?{params}",
            self.password()
        )
    }

    /// The `verify-full` URL of role `idem_tls` on `db`, trusting the run's CA.
    pub fn verify_full_url(&self, db: &str) -> String {
        self.tls_url(
            "127.0.0.1",
            db,
            &format!("sslmode=verify-full&sslrootcert={}", self.ca()),
        )
    }

    /// The URL of role `idem_cert` on `db` with the client certificate `cert` (`idem_cert` or
    /// `idem_cert-expired`).
    pub fn cert_url(&self, db: &str, cert: &str) -> String {
        format!(
            "postgres://idem_cert@127.0.0.1:5432/{db}?sslmode=verify-full&sslrootcert={}&sslcert={}&sslkey={}",
            self.ca(),
            self.file(&format!("{cert}.pem")),
            self.file(&format!("{cert}.key"))
        )
    }
}

impl TestDb {
    /// A fresh database owned by `role` (for the TLS roles, which cannot create one over the
    /// maintenance connection).
    pub async fn create_owned_by(role: &str) -> Self {
        let db = TestDb::create().await;
        sqlx::query(&format!("ALTER DATABASE {} OWNER TO {role}", db.name))
            .execute(&db.pool)
            .await
            .unwrap_or_else(|e| panic!("giving {} to {role}: {e}", db.name));
        db
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}
