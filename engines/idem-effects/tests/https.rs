//! The dispatcher against the reference points API served over real TLS on a loopback port,
//! with certificates made for the run (a CA, a server certificate for 127.0.0.1, one for
//! another name, an expired one, client certificates): a trusted remote ends done with the
//! intent's key; every certificate failure parks the intent after one attempt with its reason,
//! and the remote never receives the request. Settings that cannot work stop the dispatcher at
//! start, naming the file.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::Response;
use idem_conformance::backend::{Backend, Lite, OpenTx};
use idem_core::EventId;
use idem_core::idempotency::{EffectIntent, IntentStore};
use idem_effects::{Dispatcher, DispatcherConfig, EffectMetrics, HttpTls, IntentStatus};
use idem_reference::points::https::{ServerTls, serve};
use idem_reference::points::{PointsDb, router};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// Every refusal ends well within this: one handshake on loopback.
const BOUND: Duration = Duration::from_secs(5);

/// A CA of the run, able to issue certificates.
struct Ca {
    issuer: Issuer<'static, KeyPair>,
    pem: String,
}

fn ca(name: &str) -> Ca {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let key = KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    Ca {
        pem: cert.pem(),
        issuer: Issuer::new(params, key),
    }
}

/// A certificate and its key, as PEM.
struct Leaf {
    cert: String,
    key: String,
}

fn leaf(
    ca: &Ca,
    names: &[&str],
    usage: ExtendedKeyUsagePurpose,
    tune: impl FnOnce(&mut CertificateParams),
) -> Leaf {
    let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
    let mut params = CertificateParams::new(names).unwrap();
    params
        .distinguished_name
        .push(DnType::CommonName, "idem https test");
    params.extended_key_usages = vec![usage];
    tune(&mut params);
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &ca.issuer).unwrap();
    Leaf {
        cert: cert.pem(),
        key: key.serialize_pem(),
    }
}

/// The certificates of one run, written as files.
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki { dir };
        let (ca, other_ca) = (ca("idem test CA"), ca("another CA"));
        pki.write("ca.pem", &ca.pem);
        let server = ExtendedKeyUsagePurpose::ServerAuth;
        let client = ExtendedKeyUsagePurpose::ClientAuth;
        pki.pair("server", &leaf(&ca, &["127.0.0.1"], server.clone(), |_| {}));
        pki.pair(
            "other-name",
            &leaf(&ca, &["other.example"], server.clone(), |_| {}),
        );
        pki.pair(
            "expired",
            &leaf(&ca, &["127.0.0.1"], server, |p| {
                p.not_before = rcgen::date_time_ymd(2020, 1, 1);
                p.not_after = rcgen::date_time_ymd(2021, 1, 1);
            }),
        );
        pki.pair(
            "client",
            &leaf(&ca, &["settlement"], client.clone(), |_| {}),
        );
        pki.pair(
            "stranger",
            &leaf(&other_ca, &["settlement"], client.clone(), |_| {}),
        );
        pki.pair(
            "expired-client",
            &leaf(&ca, &["settlement"], client, |p| {
                p.not_before = rcgen::date_time_ymd(2020, 1, 1);
                p.not_after = rcgen::date_time_ymd(2021, 1, 1);
            }),
        );
        pki
    }

    fn write(&self, name: &str, pem: &str) {
        std::fs::write(self.path(name), pem).unwrap();
    }

    fn pair(&self, name: &str, leaf: &Leaf) {
        self.write(&format!("{name}.crt"), &leaf.cert);
        self.write(&format!("{name}.key"), &leaf.key);
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The server settings of certificate `name`, optionally requiring client certificates of
    /// the run's CA.
    fn server(&self, name: &str, client_ca: bool) -> ServerTls {
        ServerTls {
            cert: self.path(&format!("{name}.crt")),
            key: self.path(&format!("{name}.key")),
            client_ca: client_ca.then(|| self.path("ca.pem")),
        }
    }

    /// Trusts the run's CA besides the system's roots.
    fn trusting(&self) -> HttpTls {
        HttpTls {
            ca_bundle: Some(self.path("ca.pem")),
            ..HttpTls::default()
        }
    }

    /// [`Self::trusting`], presenting client certificate `name`.
    fn presenting(&self, name: &str) -> HttpTls {
        HttpTls {
            client_cert: Some(self.path(&format!("{name}.crt"))),
            client_key: Some(self.path(&format!("{name}.key"))),
            ..self.trusting()
        }
    }
}

/// What reached the remote's HTTP layer.
#[derive(Clone, Default)]
struct Seen {
    requests: Arc<AtomicUsize>,
    keys: Arc<Mutex<Vec<String>>>,
}

async fn count(State(seen): State<Seen>, req: Request, next: Next) -> Response {
    seen.requests.fetch_add(1, Ordering::SeqCst);
    if let Some(k) = req.headers().get("idempotency-key") {
        seen.keys
            .lock()
            .unwrap()
            .push(k.to_str().unwrap().to_owned());
    }
    next.run(req).await
}

/// The reference points API on a loopback port: over TLS with `tls`, or plain HTTP.
struct Remote {
    target: String,
    seen: Seen,
    pool: sqlx::SqlitePool,
    _db: Lite,
}

async fn remote(tls: Option<ServerTls>) -> Remote {
    let db = Lite::new().await;
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", db.path().display()))
        .await
        .unwrap();
    idem_reference::ensure_schema_sqlite(&pool).await.unwrap();
    let seen = Seen::default();
    let app = router(
        PointsDb::Sqlite(pool.clone()),
        db.keys(),
        idem_http::IdempotencyConfig::default(),
    )
    .layer(from_fn_with_state(seen.clone(), count));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    match tls {
        Some(tls) => {
            let acceptor = tls.acceptor().unwrap_or_else(|e| panic!("{e}"));
            tokio::spawn(serve(listener, acceptor, app, std::future::pending()));
        }
        None => {
            tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        }
    }
    Remote {
        target: format!("https://{addr}/awards"),
        seen,
        pool,
        _db: db,
    }
}

impl Remote {
    async fn awards(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM points_awards")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    fn requests(&self) -> usize {
        self.seen.requests.load(Ordering::SeqCst)
    }

    fn host(&self) -> String {
        idem_effects::classify::host(&self.target)
    }
}

fn config(tls: HttpTls) -> DispatcherConfig {
    DispatcherConfig {
        timeout: Duration::from_secs(2),
        retry_backoff: Duration::ZERO,
        lease: Duration::from_secs(10),
        authorization: Some("Bearer settlement".into()),
        tls,
        ..DispatcherConfig::default()
    }
}

/// A client database holding one intent for `target`, and a dispatcher with `tls`.
struct Client {
    db: Lite,
    intent: EffectIntent,
    dispatcher: Dispatcher<idem_sql::sqlite::SqliteIntents>,
}

async fn client(target: &str, tls: HttpTls) -> Client {
    let db = Lite::new().await;
    let intent = EffectIntent {
        event_id: EventId::new(),
        effect: "points.award".into(),
        target: target.to_owned(),
        body: serde_json::json!({"order_id": "order-1", "payment_id": "pay-1", "points": 7}),
        traceparent: None,
    };
    let mut tx = db.begin().await;
    assert!(tx.record_intent(&intent).await.unwrap());
    tx.commit().await;
    let dispatcher = Dispatcher::new(
        db.intents(),
        config(tls),
        EffectMetrics::new(&prometheus::Registry::new()).unwrap(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    Client {
        db,
        intent,
        dispatcher,
    }
}

impl Client {
    /// Runs one claim, within [`BOUND`].
    async fn dispatch_once(&self) -> usize {
        let started = Instant::now();
        let n = tokio::time::timeout(BOUND, self.dispatcher.run_once())
            .await
            .expect("one attempt ends within the bound")
            .unwrap();
        assert!(started.elapsed() < BOUND);
        n
    }

    async fn status(&self) -> IntentStatus {
        let (_, status) = self.db.intents().get(1).await.unwrap().unwrap();
        status
    }

    /// The intent is parked after one attempt with `reason`, counted as a TLS park of
    /// `failure`, and a second claim finds nothing to send.
    async fn assert_parked(&self, remote: &Remote, failure: &str, reason: &str) {
        assert_eq!(self.dispatch_once().await, 1);
        let stuck = self.db.intents().stuck(10).await.unwrap();
        let (_, status) = self.db.intents().get(1).await.unwrap().unwrap();
        let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", self.db.path().display()))
            .await
            .unwrap();
        let last: Option<String> = sqlx::query_scalar("SELECT last_error FROM idem_effect_intents")
            .fetch_one(&pool)
            .await
            .unwrap_or(None);
        assert_eq!(stuck.len(), 1, "{status}: {last:?}");
        assert_eq!(stuck[0].status, IntentStatus::Parked);
        assert_eq!(stuck[0].attempts, 1, "one attempt, not a retry loop");
        assert_eq!(stuck[0].reason.as_deref(), Some(reason));
        assert_eq!(self.dispatch_once().await, 0, "parked: never claimed again");
        let m = self.dispatcher.metrics();
        let labels = ["points.award", &remote.host()];
        assert_eq!(m.parked.with_label_values(&labels).get(), 1);
        assert_eq!(
            m.tls_failures
                .with_label_values(&[labels[0], labels[1], failure])
                .get(),
            1
        );
        assert_eq!(m.retries.with_label_values(&labels).get(), 0);
        assert_eq!(
            remote.requests(),
            0,
            "the remote never received the request"
        );
        assert_eq!(remote.awards().await, 0);
    }

    /// The intent is done, the remote saw one request with the intent's key and applied it.
    async fn assert_done(&self, remote: &Remote) {
        assert_eq!(self.dispatch_once().await, 1);
        assert_eq!(self.status().await, IntentStatus::Done);
        assert_eq!(
            *remote.seen.keys.lock().unwrap(),
            vec![self.intent.key().unwrap().header_value()],
            "one request, with the intent's key"
        );
        assert_eq!(remote.awards().await, 1);
    }
}

const RETRY: &str = "then `idem effects retry` sends it again with the same key";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_trusted_by_the_ca_bundle_ends_done_with_the_intents_key() {
    let pki = Pki::new();
    let remote = remote(Some(pki.server("server", false))).await;
    let c = client(&remote.target, pki.trusting()).await;
    c.assert_done(&remote).await;
    // Only the bundle, without the system's roots, trusts it too.
    let only = HttpTls {
        ca_bundle_only: true,
        ..pki.trusting()
    };
    let second = client(&remote.target, only).await;
    assert_eq!(second.dispatch_once().await, 1);
    assert_eq!(second.status().await, IntentStatus::Done);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_system_roots_only_an_unknown_issuer_parks_after_one_attempt() {
    let pki = Pki::new();
    let remote = remote(Some(pki.server("server", false))).await;
    let c = client(&remote.target, HttpTls::default()).await;
    c.assert_parked(
        &remote,
        "unknown_issuer",
        &format!(
            "TLS: the remote's certificate is not trusted (unknown issuer): give the CA that \
             issued it in the dispatcher's CA bundle (`idem effects dispatch --ca-bundle`, \
             `HttpTls::ca_bundle`), {RETRY}; the request was not sent"
        ),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_for_another_name_parks() {
    let pki = Pki::new();
    let remote = remote(Some(pki.server("other-name", false))).await;
    let c = client(&remote.target, pki.trusting()).await;
    c.assert_parked(
        &remote,
        "wrong_name",
        &format!(
            "TLS: the remote's certificate is not valid for 127.0.0.1 (it names other.example): \
             use a target URL with a name the certificate holds, or have the certificate \
             reissued for 127.0.0.1, {RETRY}; the request was not sent"
        ),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_certificate_parks() {
    let pki = Pki::new();
    let remote = remote(Some(pki.server("expired", false))).await;
    let c = client(&remote.target, pki.trusting()).await;
    c.assert_parked(
        &remote,
        "expired",
        &format!(
            "TLS: the remote's certificate expired (valid until 2021-01-01 00:00:00 UTC): the \
             remote must renew it (or this host's clock is wrong), {RETRY}; the request was not \
             sent"
        ),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_requiring_a_client_certificate_accepts_ours() {
    let pki = Pki::new();
    let remote = remote(Some(pki.server("server", true))).await;
    let c = client(&remote.target, pki.presenting("client")).await;
    c.assert_done(&remote).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_requiring_a_client_certificate_parks_an_intent_sent_without_one() {
    let pki = Pki::new();
    let remote = remote(Some(pki.server("server", true))).await;
    let c = client(&remote.target, pki.trusting()).await;
    c.assert_parked(
        &remote,
        "client_certificate_required",
        &format!(
            "TLS: the remote requires a client certificate and none is configured (it sent the \
             alert certificate_required): give the dispatcher one \
             (`idem effects dispatch --client-cert --client-key`, `HttpTls::client_cert` and \
             `HttpTls::client_key`), {RETRY}; the remote refused the handshake, so \
             it did not process the request"
        ),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_of_an_untrusted_ca_parks() {
    let pki = Pki::new();
    let remote = remote(Some(pki.server("server", true))).await;
    let c = client(&remote.target, pki.presenting("stranger")).await;
    c.assert_parked(
        &remote,
        "client_certificate_refused",
        &format!(
            "TLS: the remote refused our client certificate (it sent the alert unknown_ca): \
             give the dispatcher a certificate its CA trusts (`idem effects dispatch \
             --client-cert --client-key`, `HttpTls::client_cert` and `HttpTls::client_key`), \
             {RETRY}; the remote refused the handshake, so it did not process the request"
        ),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_target_served_as_plain_http_parks_and_is_never_sent_in_the_clear() {
    let pki = Pki::new();
    let remote = remote(None).await;
    let c = client(&remote.target, pki.trusting()).await;
    c.assert_parked(
        &remote,
        "not_tls",
        &format!(
            "TLS: the remote does not speak TLS at this address (received corrupt message of \
             type InvalidContentType): check the target's port and scheme (an https:// target is \
             never sent as plain HTTP), {RETRY}; the request was not sent"
        ),
    )
    .await;
}

/// `Dispatcher::new` with `tls`: its error.
async fn refused(tls: HttpTls) -> String {
    let db = Lite::new().await;
    let started = Instant::now();
    let e = Dispatcher::new(
        db.intents(),
        config(tls),
        EffectMetrics::unregistered().unwrap(),
    )
    .expect_err("the settings are refused at start");
    assert!(started.elapsed() < BOUND);
    e.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unusable_tls_files_stop_the_dispatcher_at_start_naming_the_file() {
    let pki = Pki::new();
    let p = |name: &str| pki.path(name);
    let shown = |path: &Path| path.display().to_string();
    let missing = p("missing.pem");
    let e = refused(HttpTls {
        ca_bundle: Some(missing.clone()),
        ..HttpTls::default()
    })
    .await;
    assert!(
        e.starts_with(&format!(
            "configuration error: cannot read the CA bundle {}: ",
            shown(&missing)
        )) && e.ends_with("; check the path and that this process may read it"),
        "{e}"
    );
    // A DER file, not PEM.
    let der = p("ca.der");
    std::fs::write(&der, [0x30_u8, 0x82, 0x01, 0x0a, 0x02, 0x82]).unwrap();
    let e = refused(HttpTls {
        ca_bundle: Some(der.clone()),
        ..HttpTls::default()
    })
    .await;
    assert_eq!(
        e,
        format!(
            "configuration error: the CA bundle {} holds no PEM certificate (a `-----BEGIN \
             CERTIFICATE-----` block): give the certificate(s) in PEM (a DER file converts with \
             `openssl x509 -inform der -in FILE -out FILE.pem`)",
            shown(&der)
        )
    );
    // A certificate given as the key.
    let e = refused(HttpTls {
        client_cert: Some(p("client.crt")),
        client_key: Some(p("client.crt")),
        ..HttpTls::default()
    })
    .await;
    assert_eq!(
        e,
        format!(
            "configuration error: the client key {} holds no usable PEM private key (`-----BEGIN \
             PRIVATE KEY-----`, `RSA PRIVATE KEY` or `EC PRIVATE KEY`): give the key of the \
             client certificate in PEM",
            shown(&p("client.crt"))
        )
    );
    // Another certificate's key.
    let e = refused(HttpTls {
        client_cert: Some(p("client.crt")),
        client_key: Some(p("server.key")),
        ..HttpTls::default()
    })
    .await;
    assert_eq!(
        e,
        format!(
            "configuration error: the client key {} does not match the client certificate {}: \
             give the key the certificate was issued for",
            shown(&p("server.key")),
            shown(&p("client.crt"))
        )
    );
    let key = std::fs::read_to_string(p("server.key")).unwrap();
    let body: String = key.lines().nth(1).unwrap().to_owned();
    assert!(!e.contains(&body), "no key material in the message");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_target_that_refuses_connections_is_retried_not_parked() {
    let pki = Pki::new();
    // A port nobody listens on: bound, then closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let target = format!("https://127.0.0.1:{port}/awards");
    let c = client(&target, pki.trusting()).await;
    assert_eq!(c.dispatch_once().await, 1);
    assert_eq!(
        c.status().await,
        IntentStatus::Pending,
        "a connection error is retried"
    );
    assert!(c.db.intents().stuck(10).await.unwrap().is_empty());
    let m = c.dispatcher.metrics();
    let labels = ["points.award", &format!("127.0.0.1:{port}")];
    assert_eq!(m.retries.with_label_values(&labels).get(), 1);
    assert_eq!(m.parked.with_label_values(&labels).get(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_target_is_never_upgraded_to_https() {
    let pki = Pki::new();
    let remote = remote(Some(pki.server("server", false))).await;
    let plain = remote.target.replacen("https://", "http://", 1);
    let c = client(&plain, pki.trusting()).await;
    // Sent as plain HTTP to a TLS port: the server's handshake fails on it and nothing is
    // applied. A handshake without a request shows the port speaks TLS: the intent is parked
    // with what to change, not retried without end, and never sent over TLS.
    c.assert_parked(
        &remote,
        "plain_to_tls",
        &format!(
            "TLS: the target is http:// but the remote speaks TLS at that address, and idem \
             never sends a request there as anything but plain HTTP: have the handler write the \
             remote's https:// URL (and correct this intent's target), {RETRY}; the remote read \
             no request from plain text, so it did not process it"
        ),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_client_certificate_parks_with_renew_it() {
    let pki = Pki::new();
    let remote = remote(Some(pki.server("server", true))).await;
    let c = client(&remote.target, pki.presenting("expired-client")).await;
    c.assert_parked(
        &remote,
        "client_certificate_refused",
        &format!(
            "TLS: the remote refused our client certificate because it has expired (it sent the \
             alert certificate_expired): renew it and give the dispatcher the \
             new one (`idem effects dispatch --client-cert --client-key`, `HttpTls::client_cert` and \
             `HttpTls::client_key`), {RETRY}; the remote refused the \
             handshake, so it did not process the request"
        ),
    )
    .await;
}

/// An `http://` target whose remote does not answer at all is an ordinary failure, retried:
/// the diagnosis parks only when a TLS server answers at that address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_target_with_nothing_listening_is_retried() {
    let pki = Pki::new();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let c = client(&format!("http://127.0.0.1:{port}/awards"), pki.trusting()).await;
    assert_eq!(c.dispatch_once().await, 1);
    assert_eq!(c.status().await, IntentStatus::Pending);
}
