//! The reference points API: an external service that awards points per request, protected by
//! the Idempotency-Key layer, with its own database as the proof of how many awards happened.
//!
//! * `POST /awards` (requires `Authorization: Bearer <client>` and `Idempotency-Key`), body
//!   `{"order_id": "...", "payment_id": "...", "points": 12}` → `201 {"award_id": .., ...}`.
//! * `GET /awards/by-payment/{payment_id}` → the awards of one payment that are not reversed:
//!   the status probe a client uses before retrying when it cannot rely on keys.
//! * `POST /awards/by-payment/{payment_id}/reversal` → reverses the client's awards of one
//!   payment (`200 {"reversed": n}`; running it again reverses nothing more): the compensation.
//! * `POST /keyless/awards` → the same award **without** the Idempotency-Key layer: a stand-in for
//!   a remote that ignores keys, to exercise the status probe and the unknown-outcome state.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{Next, from_fn, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use idem_core::TableNames;
use idem_core::idempotency::IdempotencyStore;
use idem_http::{ClientScope, Idempotency, IdempotencyConfig, KeyTransaction};
use idem_sql::{Dialect, KeyStore, Statement, with_pool};

/// The points database, PostgreSQL or SQLite (`PointsDb::Postgres(pool)`,
/// `PointsDb::Sqlite(pool)`).
pub type PointsDb = idem_sql::AnyPool;

/// An award request.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
pub struct AwardRequest {
    /// The order.
    pub order_id: String,
    /// The payment (one award per payment is expected).
    pub payment_id: String,
    /// Points, positive.
    pub points: i64,
}

/// One stored award.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Award {
    /// Row id.
    pub award_id: i64,
    /// Who asked.
    pub client: String,
    /// The order.
    pub order_id: String,
    /// The payment.
    pub payment_id: String,
    /// Points.
    pub points: i64,
}

fn problem(status: StatusCode, detail: impl Into<String>) -> Response {
    let body = serde_json::json!({"type": "about:blank", "title": status.canonical_reason(), "status": status.as_u16(), "detail": detail.into()});
    (
        status,
        [(header::CONTENT_TYPE, "application/problem+json")],
        body.to_string(),
    )
        .into_response()
}

fn client(headers: &HeaderMap) -> Option<String> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let token = v.strip_prefix("Bearer ")?.trim();
    (!token.is_empty() && token.len() <= 100).then(|| token.to_owned())
}

fn require_client(headers: &HeaderMap) -> Result<String, Box<Response>> {
    client(headers).ok_or_else(|| {
        Box::new(problem(
            StatusCode::UNAUTHORIZED,
            "send Authorization: Bearer <client>",
        ))
    })
}

/// `POST /awards`: the award row carries the client's Idempotency-Key under a unique
/// constraint, so the award and its key commit together. Should the server die between the
/// award and the layer storing the response, a retry that takes the key over after the lock
/// expires finds the award and answers with it instead of awarding twice.
async fn award(state: State<PointsDb>, headers: HeaderMap, req: Json<AwardRequest>) -> Response {
    match key_of(&headers) {
        Ok(key) => store_award(state, headers, req, Some(key)).await,
        Err(r) => *r,
    }
}

/// The request's Idempotency-Key, or the answer refusing it.
fn key_of(headers: &HeaderMap) -> Result<String, Box<Response>> {
    let values: Vec<&[u8]> = headers
        .get_all(idem_http::IDEMPOTENCY_KEY)
        .iter()
        .map(|v| v.as_bytes())
        .collect();
    idem_core::idempotency::IdempotencyKey::from_header_values(&values)
        .map(|key| key.as_str().to_owned())
        .map_err(|e| Box::new(problem(StatusCode::BAD_REQUEST, e.to_string())))
}

/// `POST /keyless/awards`: the same award, ignoring any key (the stand-in for a remote without
/// Idempotency-Key support).
async fn award_keyless(
    state: State<PointsDb>,
    headers: HeaderMap,
    req: Json<AwardRequest>,
) -> Response {
    store_award(state, headers, req, None).await
}

/// The client of a valid award request, or the answer refusing it.
fn checked(headers: &HeaderMap, req: &AwardRequest) -> Result<String, Box<Response>> {
    let client = require_client(headers)?;
    if req.points <= 0 || req.order_id.is_empty() || req.payment_id.is_empty() {
        return Err(Box::new(problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "order_id and payment_id must be set and points positive",
        )));
    }
    Ok(client)
}

async fn store_award(
    State(db): State<PointsDb>,
    headers: HeaderMap,
    Json(req): Json<AwardRequest>,
    key: Option<String>,
) -> Response {
    let client = match checked(&headers, &req) {
        Ok(c) => c,
        Err(r) => return *r,
    };
    let id = with_pool!(&db, p => insert_award_pooled(p, &client, &req, key.as_deref()).await);
    awarded(id, client, req)
}

/// `POST /awards` under [`transactional_router`]: the award is written in the transaction of
/// the key's claim, which the Idempotency-Key layer commits with the stored response.
///
/// Boxed: axum proves the handler's future `Send` for every lifetime, which fails for the
/// transaction's guard unless the future is boxed here, where its lifetimes are known.
#[allow(clippy::type_complexity)]
fn award_in_transaction<DB: Dialect>(
    tx: KeyTransaction<sqlx::Transaction<'static, DB>>,
    headers: HeaderMap,
    Json(req): Json<AwardRequest>,
) -> std::pin::Pin<Box<dyn Future<Output = Response> + Send>> {
    Box::pin(async move {
        let key = match key_of(&headers) {
            Ok(k) => k,
            Err(r) => return *r,
        };
        let client = match checked(&headers, &req) {
            Ok(c) => c,
            Err(r) => return *r,
        };
        let Some(mut t) = tx.take() else {
            return problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the request's transaction is gone",
            );
        };
        let id = insert_award::<DB>(&mut t, &client, &req, Some(&key)).await;
        tx.put_back(t);
        awarded(id, client, req)
    })
}

/// The answer to a stored (or found) award, or to a failure to store it.
fn awarded(id: Result<i64, sqlx::Error>, client: String, req: AwardRequest) -> Response {
    match id {
        Ok(award_id) => (
            StatusCode::CREATED,
            Json(Award {
                award_id,
                client,
                order_id: req.order_id,
                payment_id: req.payment_id,
                points: req.points,
            }),
        )
            .into_response(),
        Err(e) => {
            tracing::error!(error = %e, "storing an award");
            problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "the award could not be stored; retry with the same Idempotency-Key",
            )
        }
    }
}

/// [`insert_award`] on a connection of `pool`.
async fn insert_award_pooled<DB: Dialect>(
    pool: &sqlx::Pool<DB>,
    client: &str,
    req: &AwardRequest,
    key: Option<&str>,
) -> Result<i64, sqlx::Error> {
    let mut c = pool.acquire().await?;
    insert_award::<DB>(&mut c, client, req, key).await
}

/// Stores the award, or finds the one stored under the same (client, key): its id.
///
/// Boxed: a future generic over the dialect, awaited in an axum handler generic over it, must
/// be `Send` for every lifetime of its borrows, which the compiler proves only for a boxed one.
fn insert_award<'a, DB: Dialect>(
    c: &'a mut DB::Connection,
    client: &'a str,
    req: &'a AwardRequest,
    key: Option<&'a str>,
) -> std::pin::Pin<Box<dyn Future<Output = Result<i64, sqlx::Error>> + Send + 'a>> {
    Box::pin(async move {
        let inserted = Statement::<DB>::new(
        "INSERT INTO points_awards (client, order_id, payment_id, points, idem_key) VALUES ($1, $2, $3, $4, $5) \
         ON CONFLICT (client, idem_key) DO NOTHING RETURNING id",
    )
    .bind(client)
    .bind(req.order_id.as_str())
    .bind(req.payment_id.as_str())
    .bind(req.points)
    .bind(key)
    .fetch_optional(&mut *c)
    .await?;
        let row = match inserted {
            Some(row) => row,
            None => Statement::<DB>::new(
                "SELECT id FROM points_awards WHERE client = $1 AND idem_key = $2",
            )
            .bind(client)
            .bind(key)
            .fetch_optional(c)
            .await?
            .ok_or(sqlx::Error::RowNotFound)?,
        };
        idem_sql::get::<DB, i64>(&row, "id")
    })
}

/// The awards of `payment_id` for `client` that are not reversed.
async fn awards_of<DB: Dialect>(
    pool: &sqlx::Pool<DB>,
    payment_id: &str,
    client: &str,
) -> Result<Vec<Award>, sqlx::Error> {
    let mut c = pool.acquire().await?;
    let rows = Statement::<DB>::new(
        "SELECT id, client, order_id, payment_id, points FROM points_awards a WHERE payment_id = $1 AND client = $2 \
         AND NOT EXISTS (SELECT 1 FROM points_reversals r WHERE r.award_id = a.id) ORDER BY id",
    )
    .bind(payment_id)
    .bind(client)
    .fetch_all(&mut c)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(Award {
                award_id: idem_sql::get::<DB, _>(r, "id")?,
                client: idem_sql::get::<DB, _>(r, "client")?,
                order_id: idem_sql::get::<DB, _>(r, "order_id")?,
                payment_id: idem_sql::get::<DB, _>(r, "payment_id")?,
                points: idem_sql::get::<DB, _>(r, "points")?,
            })
        })
        .collect()
}

/// Runs `sql` with `a`, `b` bound on `pool`; the rows it changed.
async fn execute2<DB: Dialect>(
    pool: &sqlx::Pool<DB>,
    sql: &str,
    a: &str,
    b: &str,
) -> Result<u64, sqlx::Error> {
    let mut c = pool.acquire().await?;
    Statement::<DB>::new(sql)
        .bind(a)
        .bind(b)
        .execute(&mut c)
        .await
}

async fn by_payment(
    State(db): State<PointsDb>,
    headers: HeaderMap,
    Path(payment_id): Path<String>,
) -> Response {
    let client = match require_client(&headers) {
        Ok(c) => c,
        Err(r) => return *r,
    };
    let rows = with_pool!(&db, p => awards_of(p, &payment_id, &client).await);
    match rows {
        Ok(awards) => Json(awards).into_response(),
        Err(e) => {
            tracing::error!(error = %e, "reading awards");
            problem(StatusCode::SERVICE_UNAVAILABLE, "awards could not be read")
        }
    }
}

async fn reverse(
    State(db): State<PointsDb>,
    headers: HeaderMap,
    Path(payment_id): Path<String>,
) -> Response {
    let client = match require_client(&headers) {
        Ok(c) => c,
        Err(r) => return *r,
    };
    let n = with_pool!(&db, p => execute2(
        p,
        "INSERT INTO points_reversals (award_id) SELECT id FROM points_awards WHERE payment_id = $1 AND client = $2 ON CONFLICT (award_id) DO NOTHING",
        &payment_id,
        &client,
    )
    .await);
    match n {
        Ok(reversed) => Json(serde_json::json!({ "reversed": reversed })).into_response(),
        Err(e) => {
            tracing::error!(error = %e, "reversing awards");
            problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "the reversal could not be stored; run it again",
            )
        }
    }
}

/// The points API's authentication layer: `Authorization: Bearer <client>` names the client,
/// and the Idempotency-Key layer scopes keys by that [`ClientScope`] (never by the raw header).
async fn authenticate(mut req: Request, next: Next) -> Response {
    match client(req.headers()) {
        Some(c) => {
            req.extensions_mut().insert(ClientScope(c));
            next.run(req).await
        }
        None => problem(
            StatusCode::UNAUTHORIZED,
            "send Authorization: Bearer <client>",
        ),
    }
}

/// The points API router: `POST /awards` behind the Idempotency-Key layer over `keys` (scoped
/// per client by its authentication layer), the status probe, the reversal (compensation) and the
/// key-less stand-in.
pub fn router<S: IdempotencyStore>(db: PointsDb, keys: S, config: IdempotencyConfig) -> Router {
    build(db, keys, config, None)
}

/// [`router`] with `POST /awards` written in the transaction of its key's claim
/// ([`Idempotency::transactional_layer`] over the key store in `db`'s `tables`): the award and
/// its key's completion commit together (one commit per award), so a crash between them cannot
/// leave an award under an in-flight key.
pub fn transactional_router(
    db: PointsDb,
    tables: &TableNames,
    config: IdempotencyConfig,
) -> Router {
    // Each dialect named: axum proves a handler `Send` only for a concrete database.
    let awards: Router<PointsDb> = match &db {
        PointsDb::Postgres(p) => {
            let keys = KeyStore::new(p.clone(), tables.clone());
            Router::new()
                .route("/awards", post(award_in_transaction::<sqlx::Postgres>))
                .route_layer(Idempotency::new(keys, config).transactional_layer())
        }
        PointsDb::Sqlite(p) => {
            let keys = KeyStore::new(p.clone(), tables.clone());
            Router::new()
                .route("/awards", post(award_in_transaction::<sqlx::Sqlite>))
                .route_layer(Idempotency::new(keys, config).transactional_layer())
        }
    };
    finish(awards, db, Router::new())
}

/// [`router`] with the lab options of the test harness: every keyed award waits
/// [`Lab::award_delay`] inside the Idempotency-Key layer before it is stored (a points API slower
/// than its key lock), and the lab counts executions of one key that overlap in time —
/// the Idempotency-Key layer guarantees there are none. `GET /lab/award-executions` answers
/// `{"executions": n, "overlapping": m}`; each overlap is also logged and stored in
/// `points_lab_overlaps` (so it survives a kill of the process).
pub fn lab_router<S: IdempotencyStore>(
    db: PointsDb,
    keys: S,
    config: IdempotencyConfig,
    lab: Lab,
) -> Router {
    build(db, keys, config, Some(lab))
}

fn build<S: IdempotencyStore>(
    db: PointsDb,
    keys: S,
    config: IdempotencyConfig,
    lab: Option<Lab>,
) -> Router {
    let awards: Router<PointsDb> = Router::new().route("/awards", post(award));
    let (awards, lab_routes): (_, Router) = match lab {
        Some(lab) => {
            let state = Arc::new(LabState::new(lab, db.clone()));
            (
                awards.route_layer(from_fn_with_state(Arc::clone(&state), lab_award)),
                Router::new()
                    .route("/lab/award-executions", get(lab_executions))
                    .with_state(state),
            )
        }
        None => (awards, Router::new()),
    };
    finish(
        awards.route_layer(Idempotency::new(keys, config).layer()),
        db,
        lab_routes,
    )
}

/// The keyed awards (behind their Idempotency-Key layer) behind authentication, with the other
/// routes.
fn finish(awards: Router<PointsDb>, db: PointsDb, lab_routes: Router) -> Router {
    awards
        .route_layer(from_fn(authenticate))
        .route("/keyless/awards", post(award_keyless))
        .route("/awards/by-payment/{payment_id}", get(by_payment))
        .route("/awards/by-payment/{payment_id}/reversal", post(reverse))
        .with_state(db)
        .merge(lab_routes)
}

/// Lab options of the points API (`idem-lab points-api --award-delay`), for the test harness only.
#[derive(Clone, Debug, Default)]
pub struct Lab {
    /// How long a slow keyed award waits before it is stored.
    pub award_delay: Duration,
    /// Which keys are slow: one in this many, chosen by a hash of the key (so every execution
    /// of a key is slow or none is); 0 and 1 mean every key.
    pub slow_one_in: u32,
}

impl Lab {
    /// Whether awards with idempotency key `key` wait [`Lab::award_delay`].
    pub fn is_slow(&self, key: &str) -> bool {
        // FNV-1a: stable across processes and runs, unlike the std hasher.
        let hash = key.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        self.slow_one_in <= 1 || hash % u64::from(self.slow_one_in) == 0
    }
}

/// Executions of keyed awards, per (client, key), as the lab sees them.
struct LabState {
    lab: Lab,
    db: PointsDb,
    running: Mutex<HashMap<(String, String), u32>>,
    executions: AtomicU64,
    overlapping: AtomicU64,
}

impl LabState {
    fn new(lab: Lab, db: PointsDb) -> Self {
        LabState {
            lab,
            db,
            running: Mutex::default(),
            executions: AtomicU64::new(0),
            overlapping: AtomicU64::new(0),
        }
    }

    /// Counts an execution of `id` starting; true when another one of `id` is running.
    fn enter(&self, id: &(String, String)) -> bool {
        self.executions.fetch_add(1, Ordering::SeqCst);
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        let n = running.entry(id.clone()).or_insert(0);
        *n += 1;
        *n > 1
    }

    fn leave(&self, id: &(String, String)) {
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = running.get_mut(id) {
            *n -= 1;
            if *n == 0 {
                running.remove(id);
            }
        }
    }

    async fn record_overlap(&self, (client, key): &(String, String)) {
        self.overlapping.fetch_add(1, Ordering::SeqCst);
        tracing::error!(
            client,
            key,
            "LAB: two executions of one Idempotency-Key overlap"
        );
        let stored = with_pool!(&self.db, p => execute2(
            p,
            "INSERT INTO points_lab_overlaps (client, idem_key) VALUES ($1, $2)",
            client,
            key,
        )
        .await);
        if let Err(e) = stored {
            tracing::error!(error = %e, "storing a lab overlap");
        }
    }
}

/// Leaves the execution when dropped, however the handler ends.
struct Running<'a>(&'a LabState, (String, String));

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.leave(&self.1);
    }
}

async fn lab_award(State(lab): State<Arc<LabState>>, req: Request, next: Next) -> Response {
    let client = req
        .extensions()
        .get::<ClientScope>()
        .map(|c| c.0.clone())
        .unwrap_or_default();
    let key = req
        .headers()
        .get(idem_http::IDEMPOTENCY_KEY)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_default();
    let slow = lab.lab.is_slow(&key);
    let id = (client, key);
    if lab.enter(&id) {
        lab.record_overlap(&id).await;
    }
    let _running = Running(&lab, id);
    if slow {
        tokio::time::sleep(lab.lab.award_delay).await;
    }
    next.run(req).await
}

async fn lab_executions(State(lab): State<Arc<LabState>>) -> Response {
    Json(serde_json::json!({
        "executions": lab.executions.load(Ordering::SeqCst),
        "overlapping": lab.overlapping.load(Ordering::SeqCst),
    }))
    .into_response()
}

/// The points API over HTTPS (rustls with the ring provider): its certificate and key, and
/// optionally the CA that client certificates must be issued by (then every client must
/// present one).
pub mod https {
    use std::future::Future;
    use std::path::{Path, PathBuf};
    use std::sync::Arc;
    use std::time::Duration;

    use axum::Router;
    use hyper_util::rt::TokioIo;
    use hyper_util::service::TowerToHyperService;
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    use tokio_rustls::TlsAcceptor;

    /// The longest a client may take to complete its handshake.
    const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
    /// After a refused handshake, how long the connection stays open for the client to read
    /// the alert (a close with unread bytes would reset it before the alert is read).
    const LINGER: Duration = Duration::from_secs(1);

    /// The server's TLS files (PEM).
    #[derive(Clone, Debug)]
    pub struct ServerTls {
        /// The server's certificate chain (the end-entity certificate first).
        pub cert: PathBuf,
        /// Its private key (PKCS#8, PKCS#1 or SEC1).
        pub key: PathBuf,
        /// Require a client certificate issued by a CA in this file.
        pub client_ca: Option<PathBuf>,
    }

    /// Why the server's TLS files cannot be used; each message names the file. None holds key
    /// material.
    #[derive(Debug, thiserror::Error)]
    #[non_exhaustive]
    pub enum ServerTlsError {
        /// A file cannot be read.
        #[error("cannot read the {what} {}: {source}; check the path and its permissions", path.display())]
        Read {
            /// Which file.
            what: &'static str,
            /// The file.
            path: PathBuf,
            /// The I/O error.
            #[source]
            source: std::io::Error,
        },
        /// A file holds no PEM certificate, or no PEM key.
        #[error("the {what} {} holds no usable PEM {expected}: give it in PEM", path.display())]
        NotPem {
            /// Which file.
            what: &'static str,
            /// The file.
            path: PathBuf,
            /// What was looked for (`certificate`, `private key`).
            expected: &'static str,
        },
        /// rustls refused the certificate, the key or the client CA (a key that does not
        /// match the certificate, an unsupported algorithm, a CA that is not one).
        #[error("the TLS settings cannot be used ({what}): {reason}")]
        Refused {
            /// What was refused.
            what: String,
            /// What rustls says.
            reason: String,
        },
    }

    fn certificates(
        what: &'static str,
        path: &Path,
    ) -> Result<Vec<CertificateDer<'static>>, ServerTlsError> {
        let pem = std::fs::read(path).map_err(|source| ServerTlsError::Read {
            what,
            path: path.to_owned(),
            source,
        })?;
        let certs: Vec<_> = CertificateDer::pem_slice_iter(&pem)
            .collect::<Result<_, _>>()
            .unwrap_or_default();
        if certs.is_empty() {
            return Err(ServerTlsError::NotPem {
                what,
                path: path.to_owned(),
                expected: "certificate",
            });
        }
        Ok(certs)
    }

    impl ServerTls {
        /// The acceptor, after reading and checking the files (the key matches the
        /// certificate).
        pub fn acceptor(&self) -> Result<TlsAcceptor, ServerTlsError> {
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let chain = certificates("server certificate", &self.cert)?;
            let key_pem = std::fs::read(&self.key).map_err(|source| ServerTlsError::Read {
                what: "server key",
                path: self.key.clone(),
                source,
            })?;
            let key =
                PrivateKeyDer::from_pem_slice(&key_pem).map_err(|_| ServerTlsError::NotPem {
                    what: "server key",
                    path: self.key.clone(),
                    expected: "private key",
                })?;
            let refused = |what: String| {
                move |e: rustls::Error| ServerTlsError::Refused {
                    what,
                    reason: e.to_string(),
                }
            };
            let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                .map_err(refused("protocol versions".to_owned()))?;
            let builder = match &self.client_ca {
                None => builder.with_no_client_auth(),
                Some(ca) => {
                    let mut roots = rustls::RootCertStore::empty();
                    for cert in certificates("client CA", ca)? {
                        roots
                            .add(cert)
                            .map_err(refused(format!("client CA {}", ca.display())))?;
                    }
                    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                        Arc::new(roots),
                        provider,
                    )
                    .build()
                    .map_err(|e| ServerTlsError::Refused {
                        what: format!("client CA {}", ca.display()),
                        reason: e.to_string(),
                    })?;
                    builder.with_client_cert_verifier(verifier)
                }
            };
            let mut config = builder
                .with_single_cert(chain, key)
                .map_err(refused(format!(
                    "server certificate {} with key {}",
                    self.cert.display(),
                    self.key.display()
                )))?;
            config.alpn_protocols = vec![b"http/1.1".to_vec()];
            Ok(TlsAcceptor::from(Arc::new(config)))
        }
    }

    /// Serves `app` over HTTPS (HTTP/1.1) on `listener` until `shutdown` completes, then lets
    /// the connections in progress finish their requests. A refused handshake is logged
    /// (`warn`, with the peer and rustls' reason) and its connection closed after the alert.
    pub async fn serve(
        listener: TcpListener,
        acceptor: TlsAcceptor,
        app: Router,
        shutdown: impl Future<Output = ()>,
    ) -> std::io::Result<()> {
        tokio::pin!(shutdown);
        let graceful = hyper_util::server::graceful::GracefulShutdown::new();
        loop {
            let (tcp, peer) = tokio::select! {
                () = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of descriptors and the like: the next accept may work.
                        tracing::warn!(error = %e, "points API: accept failed");
                        continue;
                    }
                },
            };
            let acceptor = acceptor.clone();
            let service = TowerToHyperService::new(app.clone());
            let watcher = graceful.watcher();
            tokio::spawn(async move {
                let accepted =
                    tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp).into_fallible())
                        .await;
                let tls = match accepted {
                    Ok(Ok(tls)) => tls,
                    Ok(Err((e, mut tcp))) => {
                        tracing::warn!(%peer, error = %e, "points API: TLS handshake refused");
                        // The alert is written; wait for the client to read it and close.
                        let _ = tcp.shutdown().await;
                        let mut sink = [0_u8; 1024];
                        let _ = tokio::time::timeout(LINGER, async {
                            while matches!(tcp.read(&mut sink).await, Ok(n) if n > 0) {}
                        })
                        .await;
                        return;
                    }
                    Err(_) => {
                        tracing::warn!(%peer, "points API: TLS handshake timed out");
                        return;
                    }
                };
                let conn = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tls), service);
                if let Err(e) = watcher.watch(conn).await {
                    tracing::debug!(%peer, error = %e, "points API: connection ended");
                }
            });
        }
        drop(listener);
        graceful.shutdown().await;
        Ok(())
    }
}
