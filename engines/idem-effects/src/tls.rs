//! HTTPS for the dispatcher: which certificates it trusts and presents ([`HttpTls`], loaded and
//! checked when the dispatcher is built), and what a failed handshake means
//! ([`TlsFailure`], decided from the client error's source chain).
//!
//! The client speaks TLS with rustls and the ring provider (reqwest's rustls features); it
//! trusts the system's roots, plus or instead of a CA bundle, and presents a client certificate
//! when one is configured. A target's scheme is used as written: an `http://` target is never
//! upgraded, an `https://` one never falls back to plain HTTP.

use std::error::Error as StdError;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{AlertDescription, CertificateError};
use tokio::io::AsyncReadExt;

/// The TLS settings of the dispatcher's HTTP client (its probes and compensations use the same
/// client). Paths only: the files are read and checked by [`HttpTls::load`] when the dispatcher
/// is built, so a mistake stops it at start rather than parking every intent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HttpTls {
    /// A PEM file of one or more CA certificates trusted besides the system's roots (or
    /// instead of them, with `ca_bundle_only`).
    pub ca_bundle: Option<PathBuf>,
    /// Trust only `ca_bundle`, not the system's roots.
    pub ca_bundle_only: bool,
    /// The client certificate (PEM; the end-entity certificate first, then its intermediates)
    /// presented to remotes that require one (mutual TLS). Goes with `client_key`.
    pub client_cert: Option<PathBuf>,
    /// The private key of `client_cert` (PEM: PKCS#8, PKCS#1 or SEC1).
    pub client_key: Option<PathBuf>,
}

/// Why the TLS settings cannot be used; every message names the file and what to do. None
/// holds key material.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsConfigError {
    /// A file cannot be read.
    #[error("cannot read the {what} {}: {source}; check the path and that this process may read it", path.display())]
    Read {
        /// Which file (`CA bundle`, `client certificate`, `client key`).
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A certificate file holds no PEM certificate.
    #[error(
        "the {what} {} holds no PEM certificate (a `-----BEGIN CERTIFICATE-----` block): give \
         the certificate(s) in PEM (a DER file converts with `openssl x509 -inform der -in FILE \
         -out FILE.pem`)", path.display()
    )]
    NoCertificate {
        /// Which file.
        what: &'static str,
        /// The file.
        path: PathBuf,
    },
    /// A certificate file is not valid PEM, or a certificate in it is unusable.
    #[error("the {what} {} is not usable: {reason}; give PEM certificate(s)", path.display())]
    BadCertificate {
        /// Which file.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The key file holds no PEM private key (or it is not valid PEM).
    #[error(
        "the client key {} holds no usable PEM private key (`-----BEGIN PRIVATE KEY-----`, \
         `RSA PRIVATE KEY` or `EC PRIVATE KEY`): give the key of the client certificate in PEM",
        path.display()
    )]
    NoKey {
        /// The file.
        path: PathBuf,
    },
    /// The key cannot be loaded (an algorithm the ring provider does not sign with).
    #[error(
        "the client key {} cannot be used: {reason}; give an RSA, ECDSA (P-256, P-384) or \
         Ed25519 key", path.display()
    )]
    BadKey {
        /// The file.
        path: PathBuf,
        /// Why (never the key).
        reason: String,
    },
    /// The key is not the key of the certificate.
    #[error(
        "the client key {} does not match the client certificate {}: give the key the \
         certificate was issued for", key.display(), cert.display()
    )]
    KeyMismatch {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
    },
    /// A client certificate without a key, or a key without a certificate.
    #[error(
        "a client {given} is configured without a client {missing}: give both \
         (`HttpTls::client_cert` and `HttpTls::client_key`) or neither"
    )]
    Incomplete {
        /// What is given (`certificate` or `key`).
        given: &'static str,
        /// What is missing.
        missing: &'static str,
    },
    /// Only the CA bundle is to be trusted, and there is none.
    #[error(
        "only the CA bundle is to be trusted, and no CA bundle is configured: give one \
         (`HttpTls::ca_bundle`) or trust the system's roots too (`HttpTls::ca_bundle_only`)"
    )]
    OnlyWithoutBundle,
    /// rustls refused the settings.
    #[error("the TLS settings cannot be used: {0}")]
    Rustls(String),
}

/// The provider every TLS setting is checked with: ring, as in the client (the workspace never
/// enables aws-lc-rs, and reqwest falls back to ring when no default provider is installed).
fn provider() -> rustls::crypto::CryptoProvider {
    rustls::crypto::ring::default_provider()
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsConfigError> {
    std::fs::read(path).map_err(|source| TlsConfigError::Read {
        what,
        path: path.to_owned(),
        source,
    })
}

/// The certificates of a PEM file, in order; an error names the file.
fn certificates(
    what: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsConfigError> {
    let pem = read(what, path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsConfigError::BadCertificate {
            what,
            path: path.to_owned(),
            reason: format!("not valid PEM ({e})"),
        })?;
    if certs.is_empty() {
        return Err(TlsConfigError::NoCertificate {
            what,
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

/// The TLS settings, read and checked: the rustls client configuration the dispatcher's HTTP
/// client and its handshake diagnosis share ([`LoadedTls::apply`], [`diagnose`]). Its `Debug`
/// shows the files, never the key.
#[derive(Clone)]
pub struct LoadedTls {
    settings: HttpTls,
    config: Arc<rustls::ClientConfig>,
    bundle_roots: usize,
    system_roots: usize,
}

impl std::fmt::Debug for LoadedTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedTls")
            .field("settings", &self.settings)
            .field("bundle_roots", &self.bundle_roots)
            .field("system_roots", &self.system_roots)
            .finish_non_exhaustive()
    }
}

impl LoadedTls {
    /// Whether a client certificate is presented.
    pub fn has_client_certificate(&self) -> bool {
        self.settings.client_cert.is_some()
    }

    /// How many CA certificates the bundle added.
    pub fn bundle_roots(&self) -> usize {
        self.bundle_roots
    }

    /// How many of the system's root certificates are trusted (0 with `ca_bundle_only`).
    pub fn system_roots(&self) -> usize {
        self.system_roots
    }

    /// The rustls client configuration.
    pub fn client_config(&self) -> Arc<rustls::ClientConfig> {
        self.config.clone()
    }
}

impl HttpTls {
    /// Reads and checks the files: the bundle holds PEM certificates usable as roots, the
    /// client certificate is PEM, its key is a PEM private key the ring provider signs with,
    /// and the key matches the certificate.
    pub fn load(&self) -> Result<LoadedTls, TlsConfigError> {
        if self.ca_bundle_only && self.ca_bundle.is_none() {
            return Err(TlsConfigError::OnlyWithoutBundle);
        }
        let mut roots = rustls::RootCertStore::empty();
        let mut system_roots = 0;
        if !self.ca_bundle_only {
            // As reqwest does: certificates of the system's store that do not parse (old
            // roots without extensions) are skipped, not fatal.
            let native = rustls_native_certs::load_native_certs();
            (system_roots, _) = roots.add_parsable_certificates(native.certs);
            if !native.errors.is_empty() {
                tracing::debug!(
                    errors = native.errors.len(),
                    "some of the system's root certificates could not be read"
                );
            }
        }
        let mut bundle_roots = 0;
        if let Some(path) = &self.ca_bundle {
            for (i, cert) in certificates("CA bundle", path)?.into_iter().enumerate() {
                roots
                    .add(cert)
                    .map_err(|e| TlsConfigError::BadCertificate {
                        what: "CA bundle",
                        path: path.clone(),
                        reason: format!("certificate {} is not a usable CA: {e}", i + 1),
                    })?;
                bundle_roots += 1;
            }
        }
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsConfigError::Rustls(e.to_string()))?
            .with_root_certificates(roots);
        let config = match (&self.client_cert, &self.client_key) {
            (None, None) => builder.with_no_client_auth(),
            (Some(_), None) => {
                return Err(TlsConfigError::Incomplete {
                    given: "certificate",
                    missing: "key",
                });
            }
            (None, Some(_)) => {
                return Err(TlsConfigError::Incomplete {
                    given: "key",
                    missing: "certificate",
                });
            }
            (Some(cert), Some(key)) => {
                let (chain, key) = identity(cert, key)?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| TlsConfigError::Rustls(e.to_string()))?
            }
        };
        Ok(LoadedTls {
            settings: self.clone(),
            config: Arc::new(config),
            bundle_roots,
            system_roots,
        })
    }
}

/// The client certificate chain and key, after checking that they belong together.
fn identity(
    cert_path: &Path,
    key_path: &Path,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TlsConfigError> {
    let chain = certificates("client certificate", cert_path)?;
    let key_pem = read("client key", key_path)?;
    // The PEM parser's error is not shown: it may quote a line of the key file.
    let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|_| TlsConfigError::NoKey {
        path: key_path.to_owned(),
    })?;
    let provider = provider();
    let signing = provider
        .key_provider
        .load_private_key(key.clone_key())
        .map_err(|e| TlsConfigError::BadKey {
            path: key_path.to_owned(),
            reason: e.to_string(),
        })?;
    match rustls::sign::CertifiedKey::new(chain.clone(), signing).keys_match() {
        Ok(()) | Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => {}
        Err(rustls::Error::InconsistentKeys(_)) => {
            return Err(TlsConfigError::KeyMismatch {
                cert: cert_path.to_owned(),
                key: key_path.to_owned(),
            });
        }
        Err(e) => {
            return Err(TlsConfigError::BadCertificate {
                what: "client certificate",
                path: cert_path.to_owned(),
                reason: e.to_string(),
            });
        }
    }
    Ok((chain, key))
}

impl LoadedTls {
    /// The client builder with this TLS configuration (rustls, ring, these roots and this
    /// client certificate).
    pub fn apply(&self, builder: reqwest::ClientBuilder) -> reqwest::ClientBuilder {
        builder.use_preconfigured_tls(rustls::ClientConfig::clone(&self.config))
    }
}

/// Why a TLS handshake failed, as a person can act on it. Decided by [`tls_failure`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TlsFailure {
    /// The remote's certificate is not issued by a trusted CA.
    UnknownIssuer,
    /// The remote's certificate expired (`not_after`, seconds since the epoch, when known).
    Expired {
        /// Its `notAfter`.
        not_after: Option<u64>,
    },
    /// The remote's certificate is not valid yet (`not_before`, when known).
    NotValidYet {
        /// Its `notBefore`.
        not_before: Option<u64>,
    },
    /// The remote's certificate does not hold the target's host name.
    WrongName {
        /// The name the target URL gives.
        expected: String,
        /// The names the certificate holds.
        presented: Vec<String>,
    },
    /// The remote's certificate was refused for another reason (revoked, bad signature, not for
    /// a server, …).
    BadCertificate {
        /// What rustls says.
        detail: String,
    },
    /// The remote demands a client certificate and none is configured.
    ClientCertificateRequired {
        /// The alert the remote sent.
        alert: String,
    },
    /// The remote refused the client certificate that was presented.
    ClientCertificateRefused {
        /// The alert the remote sent.
        alert: String,
    },
    /// What answered does not speak TLS (a plain HTTP server on an `https://` target).
    NotTls {
        /// What rustls says.
        detail: String,
    },
    /// An `http://` target whose remote speaks TLS at that address: the plain-text request
    /// was no TLS record, so the remote read nothing of it (idem never upgrades a target).
    PlainToTls,
    /// Another handshake failure: no protocol version or cipher suite in common, an alert.
    Protocol {
        /// What rustls says.
        detail: String,
    },
}

/// What to do once the cause is fixed: the same for every TLS park.
const THEN_RETRY: &str = "then `idem effects retry` sends it again with the same key";
/// Where the dispatcher's CA bundle is set: the operator command and the Rust setting (a park
/// reason is read by an operator, whichever way the dispatcher runs).
const CA_BUNDLE: &str = "`idem effects dispatch --ca-bundle`, `HttpTls::ca_bundle`";
/// Where its client certificate and key are set.
const CLIENT_CERT: &str = "`idem effects dispatch --client-cert --client-key`, \
                           `HttpTls::client_cert` and `HttpTls::client_key`";

impl TlsFailure {
    /// The label of `idem_effect_tls_failure_total{failure}`.
    pub fn label(&self) -> &'static str {
        match self {
            TlsFailure::UnknownIssuer => "unknown_issuer",
            TlsFailure::Expired { .. } => "expired",
            TlsFailure::NotValidYet { .. } => "not_valid_yet",
            TlsFailure::WrongName { .. } => "wrong_name",
            TlsFailure::BadCertificate { .. } => "bad_certificate",
            TlsFailure::ClientCertificateRequired { .. } => "client_certificate_required",
            TlsFailure::ClientCertificateRefused { .. } => "client_certificate_refused",
            TlsFailure::NotTls { .. } => "not_tls",
            TlsFailure::PlainToTls => "plain_to_tls",
            TlsFailure::Protocol { .. } => "protocol",
        }
    }

    /// The park reason: what is wrong, what to do, and that the remote did not process the
    /// request.
    pub fn reason(&self) -> String {
        match self {
            TlsFailure::UnknownIssuer => format!(
                "TLS: the remote's certificate is not trusted (unknown issuer): give the CA that \
                 issued it in the dispatcher's CA bundle ({CA_BUNDLE}), {THEN_RETRY}; the \
                 request was not sent"
            ),
            TlsFailure::Expired { not_after } => format!(
                "TLS: the remote's certificate expired{}: the remote must renew it (or this \
                 host's clock is wrong), {THEN_RETRY}; the request was not sent",
                not_after.map_or_else(String::new, |t| format!(" (valid until {})", utc(t)))
            ),
            TlsFailure::NotValidYet { not_before } => format!(
                "TLS: the remote's certificate is not valid yet{}: check this host's clock and \
                 the remote's certificate, {THEN_RETRY}; the request was not sent",
                not_before.map_or_else(String::new, |t| format!(" (valid from {})", utc(t)))
            ),
            TlsFailure::WrongName {
                expected,
                presented,
            } => format!(
                "TLS: the remote's certificate is not valid for {expected} (it names {}): use a \
                 target URL with a name the certificate holds, or have the certificate \
                 reissued for {expected}, {THEN_RETRY}; the request was not sent",
                if presented.is_empty() {
                    "no name".to_owned()
                } else {
                    presented.join(", ")
                }
            ),
            TlsFailure::BadCertificate { detail } => format!(
                "TLS: the remote's certificate was refused ({detail}): the remote must fix its \
                 certificate, {THEN_RETRY}; the request was not sent"
            ),
            TlsFailure::ClientCertificateRequired { alert } => format!(
                "TLS: the remote requires a client certificate and none is configured (it sent \
                 the alert {alert}): give the dispatcher one ({CLIENT_CERT}), \
                 {THEN_RETRY}; the remote refused the handshake, so it did not process the \
                 request"
            ),
            TlsFailure::ClientCertificateRefused { alert } if alert == "certificate_expired" => {
                format!(
                    "TLS: the remote refused our client certificate because it has expired (it \
                     sent the alert {alert}): renew it and give the dispatcher the new one \
                     ({CLIENT_CERT}), {THEN_RETRY}; the remote refused the handshake, so it did \
                     not process the request"
                )
            }
            TlsFailure::ClientCertificateRefused { alert } => format!(
                "TLS: the remote refused our client certificate (it sent the alert {alert}): \
                 give the dispatcher a certificate its CA trusts \
                 ({CLIENT_CERT}), {THEN_RETRY}; the remote refused the handshake, so it did not \
                 process the request"
            ),
            TlsFailure::NotTls { detail } => format!(
                "TLS: the remote does not speak TLS at this address ({detail}): check the \
                 target's port and scheme (an https:// target is never sent as plain HTTP), \
                 {THEN_RETRY}; the request was not sent"
            ),
            TlsFailure::PlainToTls => format!(
                "TLS: the target is http:// but the remote speaks TLS at that address, and idem \
                 never sends a request there as anything but plain HTTP: have the handler write \
                 the remote's https:// URL (and correct this intent's target), {THEN_RETRY}; \
                 the remote read no request from plain text, so it did not process it"
            ),
            TlsFailure::Protocol { detail } => format!(
                "TLS: the handshake failed ({detail}): check the remote's TLS settings (TLS 1.2 \
                 or 1.3 is required), {THEN_RETRY}; the request was not sent"
            ),
        }
    }
}

/// The TLS failure in `error`'s source chain, if any, as the dispatcher parks it.
///
/// `connecting`: the error ended the connection attempt (the handshake never completed on our
/// side, so no byte of the request was written). Then every rustls error is a handshake
/// failure. After the connection was made, only a client-certificate alert is one (TLS 1.3:
/// see below); any other TLS error there may have come after the remote read the request, and
/// is left to the ordinary (ambiguous, retried) failure. `gave_client_certificate`: one was
/// configured (an alert about certificates then refuses ours; otherwise it demands one).
///
/// Under TLS 1.3 a client's handshake ends when it sends its own certificate and Finished; it
/// may write the request right after them, before the server has checked the certificate. A
/// refusal of the certificate then arrives as an alert while the response is read, after the
/// request's bytes may have left this host. What is known: the server's TLS layer reads the
/// client's Certificate, CertificateVerify and Finished before any record that follows them,
/// and a server that refuses the certificate aborts the handshake there (RFC 8446 §4.4.2.4),
/// so it never decrypts the request, let alone gives it to the application. The request was
/// not processed; parking it is safe, and `idem effects retry` sends it again with the same key.
pub fn tls_failure(
    error: &(dyn StdError + 'static),
    connecting: bool,
    gave_client_certificate: bool,
) -> Option<TlsFailure> {
    let tls = rustls_error(error)?;
    let failure = from_rustls(tls, gave_client_certificate);
    let client_alert = matches!(
        failure,
        TlsFailure::ClientCertificateRequired { .. } | TlsFailure::ClientCertificateRefused { .. }
    );
    (connecting || client_alert).then_some(failure)
}

/// How long [`diagnose`] waits, after its handshake, for the remote's verdict on the client
/// certificate: a remote that refuses it sends its alert one round trip after our Finished.
pub const DIAGNOSIS_SETTLE: Duration = Duration::from_millis(300);

/// Asks `target`'s remote, with a TLS handshake of `config` and no request, whether it refuses
/// this client: `Some` when the handshake fails or the remote sends an alert about the client
/// certificate within [`DIAGNOSIS_SETTLE`]; `None` when it accepts, cannot be reached, or
/// `within` runs out. For an `http://` target whose remote answered with no HTTP response
/// ([`answered_not_http`]), whether the remote speaks TLS at that address
/// ([`TlsFailure::PlainToTls`]): a plain-text request to a TLS port gets a TLS alert back, and
/// would otherwise be retried without end.
///
/// For a request that failed without saying why. Under TLS 1.3 a remote refuses a client
/// certificate after our side of the handshake is done; when the refusal closes the
/// connection before the request was handed to it, the HTTP client reports only that the
/// connection was not ready, and the alert is lost. Nothing is sent here beyond the handshake.
pub async fn diagnose(
    config: Arc<rustls::ClientConfig>,
    target: &str,
    within: Duration,
    gave_client_certificate: bool,
) -> Option<TlsFailure> {
    let url = reqwest::Url::parse(target).ok()?;
    let plain = match url.scheme() {
        "https" => false,
        "http" => true,
        _ => return None,
    };
    let port = url.port_or_known_default()?;
    // An IPv6 literal comes bracketed (`[::1]`).
    let host = url
        .host_str()?
        .trim_start_matches('[')
        .trim_end_matches(']');
    let name = match host.parse::<IpAddr>() {
        Ok(ip) => ServerName::IpAddress(ip.into()),
        Err(_) => ServerName::try_from(host.to_owned()).ok()?,
    };
    let addr = host.to_owned();
    let attempt = async {
        let tcp = tokio::net::TcpStream::connect((addr.as_str(), port))
            .await
            .ok()?;
        let connector = tokio_rustls::TlsConnector::from(config);
        let handshake = connector.connect(name, tcp).await;
        if plain {
            return speaks_tls(&handshake).then_some(TlsFailure::PlainToTls);
        }
        let mut tls = match handshake {
            Ok(tls) => tls,
            Err(e) => return tls_failure(&e, true, gave_client_certificate),
        };
        let mut buf = [0_u8; 512];
        match tokio::time::timeout(DIAGNOSIS_SETTLE, tls.read(&mut buf)).await {
            Ok(Err(e)) => tls_failure(&e, false, gave_client_certificate),
            // Accepted (tickets, nothing, or the remote closed without an alert).
            Ok(Ok(_)) | Err(_) => None,
        }
    };
    tokio::time::timeout(within, attempt).await.ok().flatten()
}

/// Whether the remote answered a plain-HTTP request with bytes that are no HTTP response (a
/// TLS server's alert, for one): the HTTP client's parse error is in `error`'s chain. Only
/// then is an `http://` target worth a TLS handshake ([`diagnose`]): a reset or a closed
/// connection may come after an HTTP server read the request.
pub fn answered_not_http(error: &(dyn StdError + 'static)) -> bool {
    let mut next: Option<&(dyn StdError + 'static)> = Some(error);
    while let Some(e) = next {
        let text = e.to_string();
        if text.starts_with("invalid HTTP") || text == "message head is too large" {
            return true;
        }
        next = e.source();
    }
    false
}

/// Whether a handshake's outcome shows a TLS server: it completed, or it failed on something
/// only TLS says (a certificate, an alert), not on an answer that is no TLS at all.
fn speaks_tls<T>(handshake: &std::io::Result<T>) -> bool {
    match handshake {
        Ok(_) => true,
        Err(e) => rustls_error(e).is_some_and(|tls| {
            !matches!(
                tls,
                rustls::Error::InvalidMessage(_) | rustls::Error::InappropriateMessage { .. }
            )
        }),
    }
}

/// The first `rustls::Error` in the chain: itself, or inside an `std::io::Error` (tokio-rustls
/// reports handshake failures as I/O errors; `io::Error::source` skips the error it wraps, so
/// it is looked at with `get_ref`).
fn rustls_error<'a>(error: &'a (dyn StdError + 'static)) -> Option<&'a rustls::Error> {
    let mut next: Option<&'a (dyn StdError + 'static)> = Some(error);
    while let Some(e) = next {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && let Some(inner) = io.get_ref()
            && let Some(tls) = rustls_error(inner)
        {
            return Some(tls);
        }
        next = e.source();
    }
    None
}

fn from_rustls(e: &rustls::Error, gave_client_certificate: bool) -> TlsFailure {
    match e {
        rustls::Error::InvalidCertificate(c) => from_certificate_error(c),
        rustls::Error::AlertReceived(alert) if client_certificate_alert(*alert) => {
            let alert = alert_name(*alert);
            if gave_client_certificate {
                TlsFailure::ClientCertificateRefused { alert }
            } else {
                TlsFailure::ClientCertificateRequired { alert }
            }
        }
        rustls::Error::InvalidMessage(_) | rustls::Error::InappropriateMessage { .. } => {
            TlsFailure::NotTls {
                detail: e.to_string(),
            }
        }
        other => TlsFailure::Protocol {
            detail: other.to_string(),
        },
    }
}

/// Alerts a server sends about the client's certificate (or its absence).
fn client_certificate_alert(alert: AlertDescription) -> bool {
    matches!(
        alert,
        AlertDescription::CertificateRequired
            | AlertDescription::NoCertificate
            | AlertDescription::BadCertificate
            | AlertDescription::UnsupportedCertificate
            | AlertDescription::CertificateRevoked
            | AlertDescription::CertificateExpired
            | AlertDescription::CertificateUnknown
            | AlertDescription::UnknownCA
            | AlertDescription::AccessDenied
    )
}

/// The alert's name as RFC 8446 spells it (`certificate_required`).
fn alert_name(alert: AlertDescription) -> String {
    let debug = format!("{alert:?}");
    let mut out = String::with_capacity(debug.len() + 4);
    for (i, ch) in debug.chars().enumerate() {
        if ch.is_ascii_uppercase() {
            if i > 0 && !out.ends_with('_') {
                out.push('_');
            }
            out.push(ch.to_ascii_lowercase());
        } else {
            out.push(ch);
        }
    }
    // `UnknownCA` → `unknown_c_a`: the acronyms RFC 8446 writes as words.
    out.replace("c_a", "ca").replace("p_s_k", "psk")
}

fn from_certificate_error(c: &CertificateError) -> TlsFailure {
    match c {
        CertificateError::UnknownIssuer => TlsFailure::UnknownIssuer,
        CertificateError::Expired => TlsFailure::Expired { not_after: None },
        CertificateError::ExpiredContext { not_after, .. } => TlsFailure::Expired {
            not_after: Some(not_after.as_secs()),
        },
        CertificateError::NotValidYet => TlsFailure::NotValidYet { not_before: None },
        CertificateError::NotValidYetContext { not_before, .. } => TlsFailure::NotValidYet {
            not_before: Some(not_before.as_secs()),
        },
        CertificateError::NotValidForName => TlsFailure::WrongName {
            expected: "the target's host".to_owned(),
            presented: Vec::new(),
        },
        CertificateError::NotValidForNameContext {
            expected,
            presented,
        } => TlsFailure::WrongName {
            expected: server_name(expected),
            presented: presented.iter().map(|p| presented_name(p)).collect(),
        },
        other => TlsFailure::BadCertificate {
            detail: rustls::Error::InvalidCertificate(other.clone()).to_string(),
        },
    }
}

fn server_name(name: &rustls::pki_types::ServerName<'_>) -> String {
    match name {
        rustls::pki_types::ServerName::DnsName(d) => d.as_ref().to_owned(),
        rustls::pki_types::ServerName::IpAddress(ip) => std::net::IpAddr::from(*ip).to_string(),
        other => format!("{other:?}"),
    }
}

/// A presented name as webpki formats it (`DnsName("a.example")`, `IpAddress(…)`), without the
/// wrapping: `a.example`.
fn presented_name(p: &str) -> String {
    p.split_once('(')
        .and_then(|(_, rest)| rest.strip_suffix(')'))
        .map(|inner| inner.trim_matches('"').to_owned())
        .unwrap_or_else(|| p.to_owned())
}

/// `secs` since the epoch as `YYYY-MM-DD HH:MM:SS UTC`.
fn utc(secs: u64) -> String {
    let days = i64::try_from(secs / 86_400).unwrap_or(i64::MAX / 2);
    let rem = secs % 86_400;
    // Days since 1970-01-01 to a civil date (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_and_names_read_as_a_person_writes_them() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(1_609_459_199), "2020-12-31 23:59:59 UTC");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(
            alert_name(AlertDescription::CertificateRequired),
            "certificate_required"
        );
        assert_eq!(alert_name(AlertDescription::UnknownCA), "unknown_ca");
        assert_eq!(
            presented_name("DnsName(\"other.example\")"),
            "other.example"
        );
        assert_eq!(presented_name("odd"), "odd");
    }

    #[test]
    fn failures_are_found_inside_io_errors_and_only_where_they_are_safe_to_park() {
        let unknown = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer),
        );
        assert_eq!(
            tls_failure(&unknown, true, false),
            Some(TlsFailure::UnknownIssuer)
        );
        assert_eq!(
            tls_failure(&unknown, false, false),
            None,
            "after the connection was made the request may have been read"
        );
        let required = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::AlertReceived(AlertDescription::CertificateRequired),
        );
        assert_eq!(
            tls_failure(&required, false, false),
            Some(TlsFailure::ClientCertificateRequired {
                alert: "certificate_required".into()
            })
        );
        assert!(matches!(
            tls_failure(&required, false, true),
            Some(TlsFailure::ClientCertificateRefused { .. })
        ));
        let plain = std::io::Error::other("connection refused");
        assert_eq!(tls_failure(&plain, true, false), None);
    }

    #[test]
    fn settings_without_files_load_and_half_an_identity_is_refused() {
        assert!(HttpTls::default().load().is_ok());
        let half = HttpTls {
            client_cert: Some("c.pem".into()),
            ..HttpTls::default()
        };
        assert!(matches!(
            half.load(),
            Err(TlsConfigError::Incomplete {
                given: "certificate",
                ..
            })
        ));
        let only = HttpTls {
            ca_bundle_only: true,
            ..HttpTls::default()
        };
        assert!(matches!(
            only.load(),
            Err(TlsConfigError::OnlyWithoutBundle)
        ));
    }
}
