//! `idem effects dispatch` and `idem-lab points-api` as real processes over HTTPS, with
//! certificates made for the run by the `openssl` command: the points API requires client
//! certificates of the run's CA; the dispatcher given the CA bundle and a client certificate
//! awards the points, the same key on the wire; without a client certificate the intent is
//! parked with the reason and the API awards nothing. TLS files that cannot work stop either
//! process at start with a message naming the file.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use idem_conformance::backend::{Backend, Lite, OpenTx};
use idem_conformance::process::{Proc, eventually};
use idem_core::EventId;
use idem_core::idempotency::EffectIntent;

/// Every refusal at start ends within this.
const BOUND: Duration = Duration::from_secs(20);

fn lab(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem-lab"));
    cmd.args(args)
        .env("RUST_LOG", "info")
        .env_remove("IDEM_CRASH_POINTS");
    cmd
}

/// `idem-lab setup`: idem's tables and the reference tables in `db` (the reference services
/// create none).
fn setup(db: &str) {
    let out = lab(&["setup", "--db", db]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run openssl: {e}"));
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA, a server certificate for 127.0.0.1 and a client certificate, in `dir`.
fn make_pki(dir: &Path) {
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    let mut ca = vec!["req", "-x509"];
    ca.extend(ec);
    ca.extend([
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=idem e2e CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    ]);
    openssl(dir, &ca);
    for (name, ext) in [
        (
            "server",
            "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        ),
        (
            "client",
            "subjectAltName=DNS:settlement\nextendedKeyUsage=clientAuth\n",
        ),
    ] {
        let (key, csr, crt, extfile) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.crt"),
            format!("{name}.ext"),
        );
        std::fs::write(dir.join(&extfile), ext).unwrap();
        let subj = format!("/CN={name}");
        let mut req = vec!["req"];
        req.extend(ec);
        req.extend(["-keyout", &key, "-out", &csr, "-subj", &subj]);
        openssl(dir, &req);
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-out",
                &crt,
                "-extfile",
                &extfile,
            ],
        );
    }
}

struct World {
    dir: tempfile::TempDir,
    client: Lite,
    server: Lite,
    api: Proc,
    target: String,
}

impl World {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn arg(&self, name: &str) -> String {
        self.path(name).display().to_string()
    }
}

/// The points API over HTTPS requiring client certificates, and one intent for it.
async fn world() -> World {
    let dir = tempfile::tempdir().unwrap();
    make_pki(dir.path());
    let (client, server) = (Lite::new().await, Lite::new().await);
    let file = |name: &str| dir.path().join(name).display().to_string();
    let server_url = format!("sqlite://{}", server.path().display());
    setup(&server_url);
    let api = Proc::spawn(
        "points-api",
        lab(&[
            "points-api",
            "--db",
            &server_url,
            "--listen",
            "127.0.0.1:0",
            "--tls-cert",
            &file("server.crt"),
            "--tls-key",
            &file("server.key"),
            "--client-ca",
            &file("ca.pem"),
        ]),
    );
    let line = api.wait_for_line("listening on https://", Duration::from_secs(30));
    assert!(line.ends_with(" (client certificates required)"), "{line}");
    let base = line
        .split(' ')
        .find(|w| w.starts_with("https://"))
        .unwrap()
        .to_owned();
    let target = format!("{base}/awards");
    let intent = EffectIntent {
        event_id: EventId::new(),
        effect: "points.award".into(),
        target: target.clone(),
        body: serde_json::json!({"order_id": "order-1", "payment_id": "pay-1", "points": 12}),
        traceparent: None,
    };
    let mut tx = client.begin().await;
    tx.record_intent(&intent).await.unwrap();
    tx.commit().await;
    World {
        dir,
        client,
        server,
        api,
        target,
    }
}

impl World {
    /// `idem effects dispatch` over the client database, with `extra` arguments; the
    /// authorization comes from a file.
    fn dispatch(&self, extra: &[&str]) -> Command {
        let token = self.path("authorization");
        std::fs::write(&token, "Bearer settlement\n").unwrap();
        let db = format!("sqlite://{}", self.client.path().display());
        let mut cmd = lab(&["effects", "dispatch", "--db", &db, "--timeout", "2s"]);
        cmd.args(extra)
            .env("IDEM_EFFECTS_AUTHORIZATION_FILE", &token)
            .env_remove("IDEM_EFFECTS_AUTHORIZATION");
        cmd
    }

    async fn intent_status(&self) -> Option<(String, i64, String)> {
        let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", self.client.path().display()))
            .await
            .unwrap();
        sqlx::query_as("SELECT status, attempts, COALESCE(last_error, '') FROM idem_effect_intents")
            .fetch_optional(&pool)
            .await
            .unwrap()
            .map(|(s, a, e): (String, i64, String)| (s, a, e))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatcher_with_the_ca_bundle_and_a_client_certificate_awards_points_over_https() {
    let w = world().await;
    let cmd = w.dispatch(&[
        "--ca-bundle",
        &w.arg("ca.pem"),
        "--client-cert",
        &w.arg("client.crt"),
        "--client-key",
        &w.arg("client.key"),
    ]);
    let d = Proc::spawn("dispatcher", cmd);
    d.wait_for_line("HTTPS trusts the CA bundle", Duration::from_secs(30));
    eventually("the intent to be done", Duration::from_secs(60), || async {
        w.intent_status()
            .await
            .filter(|(s, _, _)| s == "done")
            .map(|_| ())
    })
    .await;
    let (_, attempts, _) = w.intent_status().await.unwrap();
    assert_eq!(attempts, 1);
    assert_eq!(
        w.server.scalar("SELECT count(*) FROM points_awards").await,
        1
    );
    let token = std::fs::read_to_string(w.path("authorization")).unwrap();
    assert!(
        d.log().iter().all(|l| !l.contains(token.trim())),
        "the authorization never reaches the log"
    );
    let _ = &w.target;
    // SIGTERM: the HTTPS server stops accepting, ends its connections and exits cleanly.
    let mut w = w;
    drop(d);
    w.api.signal(15);
    assert!(w.api.wait_exit(BOUND).success());
    w.api
        .wait_for_line("idem points-api: stopped cleanly", Duration::from_secs(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_client_certificate_the_intent_is_parked_and_nothing_is_awarded() {
    let w = world().await;
    let _d = Proc::spawn("dispatcher", w.dispatch(&["--ca-bundle", &w.arg("ca.pem")]));
    let parked = eventually(
        "the intent to be parked",
        Duration::from_secs(60),
        || async { w.intent_status().await.filter(|(s, _, _)| s == "parked") },
    )
    .await;
    assert_eq!(
        parked,
        (
            "parked".to_owned(),
            1,
            "TLS: the remote requires a client certificate and none is configured (it sent the \
             alert certificate_required): give the dispatcher one \
             (`idem effects dispatch --client-cert --client-key`, `HttpTls::client_cert` and \
             `HttpTls::client_key`), then `idem effects retry` sends it again \
             with the same key; the remote refused the handshake, so it did not process the \
             request"
                .to_owned()
        )
    );
    assert_eq!(
        w.server.scalar("SELECT count(*) FROM points_awards").await,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unusable_tls_files_stop_both_processes_at_start_naming_the_file() {
    let w = world().await;
    let missing = w.arg("missing.pem");
    let started = Instant::now();
    let mut d = Proc::spawn("dispatcher", w.dispatch(&["--ca-bundle", &missing]));
    let status = d.wait_exit(BOUND);
    assert!(!status.success());
    assert!(
        d.log().iter().any(|l| l.contains(&format!(
            "cannot read the CA bundle {missing}: No such file or directory (os error 2); check \
             the path and that this process may read it"
        ))),
        "{:?}",
        d.log()
    );
    // The server's key given as the client's: not the certificate's key.
    let mut d = Proc::spawn(
        "dispatcher",
        w.dispatch(&[
            "--client-cert",
            &w.arg("client.crt"),
            "--client-key",
            &w.arg("server.key"),
        ]),
    );
    assert!(!d.wait_exit(BOUND).success());
    assert!(
        d.log().iter().any(|l| l.contains(&format!(
            "the client key {} does not match the client certificate {}: give the key the \
             certificate was issued for",
            w.arg("server.key"),
            w.arg("client.crt")
        ))),
        "{:?}",
        d.log()
    );
    let key = std::fs::read_to_string(w.path("server.key")).unwrap();
    let key_line = key.lines().nth(1).unwrap();
    assert!(
        d.log().iter().all(|l| !l.contains(key_line)),
        "no key material"
    );
    // The points API given a certificate as its key.
    let server_url = format!("sqlite://{}", w.server.path().display());
    let mut api = Proc::spawn(
        "points-api-2",
        lab(&[
            "points-api",
            "--db",
            &server_url,
            "--listen",
            "127.0.0.1:0",
            "--tls-cert",
            &w.arg("server.crt"),
            "--tls-key",
            &w.arg("server.crt"),
        ]),
    );
    assert!(!api.wait_exit(BOUND).success());
    assert!(
        api.log().iter().any(|l| l.contains(&format!(
            "the server key {} holds no usable PEM private key: give it in PEM",
            w.arg("server.crt")
        ))),
        "{:?}",
        api.log()
    );
    assert!(started.elapsed() < BOUND * 3);
}
