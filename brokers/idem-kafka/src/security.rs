//! How idem reaches and authenticates to a Kafka cluster: the one place every client's
//! connection settings come from.
//!
//! A [`Connection`] is the bootstrap servers plus a [`KafkaSecurity`] (`security.protocol`
//! PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL; a SASL mechanism PLAIN, SCRAM-SHA-256,
//! SCRAM-SHA-512 or OAUTHBEARER with OIDC client credentials; the CA file, the client
//! certificate and key). [`Connection::producer_config`], [`Connection::consumer_config`] and
//! [`Connection::client_config`] (the admin, metadata and inspection clients) all start from
//! it, so the relays, the consumers, the topic tool, the bench and the chaos runner connect
//! alike. [`KafkaSecurity::validate`] runs before any client exists and says what is wrong
//! and which setting fixes it, by its librdkafka name in backquotes (`` `sasl.username` ``: a
//! command line maps it to its own flag); [`Connection::check`] then connects once and turns librdkafka's
//! repeated log lines about a refused handshake or login into one error saying what to do.
//!
//! Secrets (passwords, the OIDC client secret, private keys) are held in [`Secret`]: its
//! `Debug` and `Display` print `[redacted]`, and no error of this module carries one.
//! [`is_secret_setting`] names the librdkafka keys whose values are never printed
//! ([`redacted_value`], [`describe_settings`]).

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::client::ClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{BaseProducer, Producer, ProducerContext};

/// The placeholder printed instead of a secret.
pub const REDACTED: &str = "[redacted]";

/// librdkafka settings whose values are secrets: never logged, printed or put in an error.
const SECRET_SETTINGS: &[&str] = &[
    "sasl.password",
    "ssl.key.password",
    "ssl.key.pem",
    "ssl_key",
    "ssl.keystore.password",
    "ssl.truststore.password",
    "sasl.oauthbearer.client.secret",
    "sasl.oauthbearer.config",
    "sasl.oauthbearer.assertion.private.key.passphrase",
    "sasl.oauthbearer.assertion.private.key.pem",
];

/// Whether the value of librdkafka setting `key` is a secret (a password, a client secret, a
/// private key or a token configuration); also any key naming a password or a secret.
pub fn is_secret_setting(key: &str) -> bool {
    let key = key.trim().to_ascii_lowercase();
    SECRET_SETTINGS.contains(&key.as_str())
        || key.contains("password")
        || key.contains("secret")
        || key.ends_with(".pem") && key.contains("key")
}

/// `value`, or [`REDACTED`] when `key` is a secret setting.
pub fn redacted_value<'a>(key: &str, value: &'a str) -> &'a str {
    if is_secret_setting(key) {
        REDACTED
    } else {
        value
    }
}

/// `key=value` pairs for a log line or a report, secrets redacted.
pub fn describe_settings(settings: &[(String, String)]) -> Vec<String> {
    settings
        .iter()
        .map(|(k, v)| format!("{k}={}", redacted_value(k, v)))
        .collect()
}

/// A secret string (a password, a client secret). `Debug` and `Display` print
/// [`REDACTED`]; [`Secret::expose`] is the only way to the value.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret.
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// Reads a secret from a file (as container platforms mount them); one trailing newline is
    /// dropped. The error names the file and what to do, never its content.
    pub fn from_file(path: &Path, what: &str) -> Result<Self, SecurityError> {
        let text = std::fs::read_to_string(path).map_err(|e| SecurityError::SecretFile {
            what: what.to_owned(),
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
        let text = text
            .strip_suffix("\r\n")
            .or_else(|| text.strip_suffix('\n'))
            .unwrap_or(&text);
        if text.is_empty() {
            return Err(SecurityError::SecretFile {
                what: what.to_owned(),
                path: path.to_owned(),
                reason: "the file is empty".to_owned(),
            });
        }
        Ok(Secret(text.to_owned()))
    }

    /// The secret's value, for the client configuration only.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REDACTED)
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REDACTED)
    }
}

/// `security.protocol`: whether the connection is encrypted (TLS) and whether the client logs
/// in with SASL.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SecurityProtocol {
    /// No TLS, no SASL (librdkafka's default).
    #[default]
    Plaintext,
    /// TLS; the client authenticates with a certificate when the broker asks for one.
    Ssl,
    /// SASL over an unencrypted connection (passwords cross the network in the clear with
    /// PLAIN: for tests and private networks only).
    SaslPlaintext,
    /// SASL over TLS.
    SaslSsl,
}

impl SecurityProtocol {
    /// The name librdkafka and Kafka use.
    pub fn as_str(self) -> &'static str {
        match self {
            SecurityProtocol::Plaintext => "PLAINTEXT",
            SecurityProtocol::Ssl => "SSL",
            SecurityProtocol::SaslPlaintext => "SASL_PLAINTEXT",
            SecurityProtocol::SaslSsl => "SASL_SSL",
        }
    }

    /// Whether the connection uses TLS.
    pub fn tls(self) -> bool {
        matches!(self, SecurityProtocol::Ssl | SecurityProtocol::SaslSsl)
    }

    /// Whether the client logs in with SASL.
    pub fn sasl(self) -> bool {
        matches!(
            self,
            SecurityProtocol::SaslPlaintext | SecurityProtocol::SaslSsl
        )
    }
}

impl fmt::Display for SecurityProtocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SecurityProtocol {
    type Err = SecurityError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_uppercase().as_str() {
            "PLAINTEXT" => Ok(SecurityProtocol::Plaintext),
            "SSL" => Ok(SecurityProtocol::Ssl),
            "SASL_PLAINTEXT" => Ok(SecurityProtocol::SaslPlaintext),
            "SASL_SSL" => Ok(SecurityProtocol::SaslSsl),
            _ => Err(SecurityError::UnknownProtocol(s.to_owned())),
        }
    }
}

/// `sasl.mechanism`: how a SASL client logs in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SaslMechanism {
    /// User and password sent as they are (inside TLS with SASL_SSL): Confluent Cloud API keys.
    Plain,
    /// Salted challenge-response, SHA-256.
    ScramSha256,
    /// Salted challenge-response, SHA-512 (MSK, Strimzi).
    ScramSha512,
    /// An OAuth 2 bearer token, fetched from an OIDC token endpoint with client credentials.
    OAuthBearer,
}

impl SaslMechanism {
    /// The name librdkafka and Kafka use.
    pub fn as_str(self) -> &'static str {
        match self {
            SaslMechanism::Plain => "PLAIN",
            SaslMechanism::ScramSha256 => "SCRAM-SHA-256",
            SaslMechanism::ScramSha512 => "SCRAM-SHA-512",
            SaslMechanism::OAuthBearer => "OAUTHBEARER",
        }
    }

    /// Whether the mechanism logs in with a user name and a password.
    pub fn takes_password(self) -> bool {
        !matches!(self, SaslMechanism::OAuthBearer)
    }
}

impl fmt::Display for SaslMechanism {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SaslMechanism {
    type Err = SecurityError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_uppercase().as_str() {
            "PLAIN" => Ok(SaslMechanism::Plain),
            "SCRAM-SHA-256" => Ok(SaslMechanism::ScramSha256),
            "SCRAM-SHA-512" => Ok(SaslMechanism::ScramSha512),
            "OAUTHBEARER" => Ok(SaslMechanism::OAuthBearer),
            "GSSAPI" => Err(SecurityError::Gssapi),
            _ => Err(SecurityError::UnknownMechanism(s.to_owned())),
        }
    }
}

/// Why a Kafka security setting cannot be used; each message names the setting that fixes it
/// by its librdkafka name in backquotes (`` `security.protocol` ``), and no secret.
#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    /// An unknown `security.protocol`.
    #[error(
        "unknown Kafka security protocol {0:?}: use PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL (`security.protocol`)"
    )]
    UnknownProtocol(String),
    /// An unknown SASL mechanism.
    #[error(
        "unknown SASL mechanism {0:?}: use PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER (`sasl.mechanism`)"
    )]
    UnknownMechanism(String),
    /// GSSAPI (Kerberos) is not built in.
    #[error(
        "SASL mechanism GSSAPI (Kerberos) is not built into idem: use PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER"
    )]
    Gssapi,
    /// Any other incoherent combination, described in full.
    #[error("{0}")]
    Invalid(String),
    /// A secret file that cannot be read.
    #[error("cannot read the {what} from {path}: {reason}", path = path.display())]
    SecretFile {
        /// What the file holds (`SASL password`, …).
        what: String,
        /// The file.
        path: PathBuf,
        /// Why it cannot be used.
        reason: String,
    },
    /// A CA, certificate or key file that is missing or not PEM.
    #[error("{what} {path}, set by {setting}: {reason}", path = path.display())]
    File {
        /// What the file should hold (`the CA file`, …).
        what: &'static str,
        /// The setting that names it, in backquotes.
        setting: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong and what to do.
        reason: String,
    },
}

/// The OIDC client credentials OAUTHBEARER fetches its token with
/// (`sasl.oauthbearer.method=oidc`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OAuthBearer {
    /// The token endpoint (`sasl.oauthbearer.token.endpoint.url`).
    pub token_endpoint: String,
    /// The client id.
    pub client_id: String,
    /// The client secret.
    pub client_secret: Secret,
    /// The scope asked for, if any.
    pub scope: Option<String>,
}

/// How to secure and authenticate a Kafka connection. The default is PLAINTEXT with nothing
/// else, librdkafka's own default.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KafkaSecurity {
    /// `security.protocol`.
    pub protocol: SecurityProtocol,
    /// `sasl.mechanism` (SASL protocols only).
    pub mechanism: Option<SaslMechanism>,
    /// `sasl.username` (PLAIN, SCRAM).
    pub username: Option<String>,
    /// `sasl.password` (PLAIN, SCRAM).
    pub password: Option<Secret>,
    /// `ssl.ca.location`: the PEM file of the CA(s) that signed the brokers' certificates
    /// (none: the system's CA bundle, probed at the usual paths).
    pub ca_file: Option<PathBuf>,
    /// `ssl.certificate.location`: this client's PEM certificate (mutual TLS).
    pub cert_file: Option<PathBuf>,
    /// `ssl.key.location`: the PEM private key of [`KafkaSecurity::cert_file`].
    pub key_file: Option<PathBuf>,
    /// `ssl.key.password`: the key file's passphrase, when it is encrypted.
    pub key_password: Option<Secret>,
    /// OAUTHBEARER's OIDC client credentials.
    pub oauth: Option<OAuthBearer>,
}

/// The settings a [`KafkaSecurity`] writes; a user override of one of them must agree.
const SECURITY_KEYS: &[&str] = &[
    "security.protocol",
    "sasl.mechanism",
    "sasl.mechanisms",
    "sasl.username",
    "sasl.password",
    "ssl.ca.location",
    "ssl.certificate.location",
    "ssl.key.location",
    "ssl.key.password",
    "sasl.oauthbearer.method",
    "sasl.oauthbearer.token.endpoint.url",
    "sasl.oauthbearer.client.id",
    "sasl.oauthbearer.client.secret",
    "sasl.oauthbearer.scope",
];

impl KafkaSecurity {
    /// Whether this is PLAINTEXT with nothing else set.
    pub fn is_plaintext_default(&self) -> bool {
        *self == KafkaSecurity::default()
    }

    /// Checks that the settings fit together and that the CA, certificate and key files exist
    /// and are PEM; every error says which setting to change.
    pub fn validate(&self) -> Result<(), SecurityError> {
        let p = self.protocol;
        let invalid = |s: String| Err(SecurityError::Invalid(s));
        match (p.sasl(), self.mechanism) {
            (false, Some(m)) => {
                return invalid(format!(
                    "SASL mechanism {m} is set but the security protocol is {p}, which does not log in with SASL: set `security.protocol` to SASL_SSL, or drop `sasl.mechanism`"
                ));
            }
            (true, None) => {
                return invalid(format!(
                    "security protocol {p} needs a SASL mechanism: set `sasl.mechanism` to PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER"
                ));
            }
            _ => {}
        }
        if !p.sasl() && (self.username.is_some() || self.password.is_some()) {
            return invalid(format!(
                "a SASL user or password is set but the security protocol is {p}: set `security.protocol` to SASL_SSL and `sasl.mechanism`, or drop the SASL credentials"
            ));
        }
        if !p.sasl() && self.oauth.is_some() {
            return invalid(format!(
                "OAUTHBEARER settings are set but the security protocol is {p}: set `security.protocol` to SASL_SSL and `sasl.mechanism` to OAUTHBEARER"
            ));
        }
        if let Some(m) = self.mechanism {
            self.validate_login(m)?;
        }
        if !p.tls()
            && (self.ca_file.is_some() || self.cert_file.is_some() || self.key_file.is_some())
        {
            return invalid(format!(
                "TLS files (CA, certificate or key) are set but the security protocol is {p}, which does not use TLS: set `security.protocol` to SSL or SASL_SSL"
            ));
        }
        match (&self.cert_file, &self.key_file) {
            (None, Some(_)) => {
                return invalid(
                    "a TLS client key is set without its certificate: set `ssl.certificate.location` to the client certificate the key belongs to".to_owned(),
                );
            }
            (Some(_), None) => {
                return invalid(
                    "a TLS client certificate is set without its private key: set `ssl.key.location`".to_owned(),
                );
            }
            _ => {}
        }
        if self.key_password.is_some() && self.key_file.is_none() {
            return invalid(
                "a TLS key password is set without a key: set `ssl.key.location`, or drop `ssl.key.password`".to_owned(),
            );
        }
        if let Some(ca) = &self.ca_file {
            check_pem(
                ca,
                "the CA file",
                "`ssl.ca.location`",
                "-----BEGIN CERTIFICATE-----",
                "give the PEM file of the CA that signed the brokers' certificates",
            )?;
        }
        if let Some(cert) = &self.cert_file {
            check_pem(
                cert,
                "the client certificate",
                "`ssl.certificate.location`",
                "-----BEGIN CERTIFICATE-----",
                "give this client's PEM certificate",
            )?;
        }
        if let Some(key) = &self.key_file {
            check_pem(
                key,
                "the client key",
                "`ssl.key.location`",
                "PRIVATE KEY-----",
                "give the PEM private key of the client certificate",
            )?;
        }
        Ok(())
    }

    /// The credentials mechanism `m` needs, and nothing else.
    fn validate_login(&self, m: SaslMechanism) -> Result<(), SecurityError> {
        let invalid = |s: String| Err(SecurityError::Invalid(s));
        if m.takes_password() {
            if self.oauth.is_some() {
                return invalid(format!(
                    "OAUTHBEARER settings are set but the SASL mechanism is {m}: set `sasl.mechanism` to OAUTHBEARER, or drop the `sasl.oauthbearer.*` settings"
                ));
            }
            match (&self.username, &self.password) {
                (None, Some(_)) => invalid(format!(
                    "a SASL password is set but no user: set `sasl.username` for {m}"
                )),
                (None, None) => invalid(format!(
                    "SASL mechanism {m} needs a user and a password: set `sasl.username` and `sasl.password`"
                )),
                (Some(u), None) => invalid(format!(
                    "SASL user {u} has no password: set `sasl.password`"
                )),
                (Some(u), Some(_)) if u.is_empty() => {
                    invalid("the SASL user is empty: set `sasl.username`".to_owned())
                }
                (Some(_), Some(_)) => Ok(()),
            }
        } else {
            if self.username.is_some() || self.password.is_some() {
                return invalid(
                    "OAUTHBEARER logs in with an OIDC client id and secret, not a SASL user and password: set `sasl.oauthbearer.client.id` and `sasl.oauthbearer.client.secret` instead".to_owned(),
                );
            }
            let Some(o) = &self.oauth else {
                return invalid(
                    "SASL mechanism OAUTHBEARER needs an OIDC token endpoint, a client id and a client secret: set `sasl.oauthbearer.token.endpoint.url`, `sasl.oauthbearer.client.id` and `sasl.oauthbearer.client.secret`".to_owned(),
                );
            };
            if !(o.token_endpoint.starts_with("https://")
                || o.token_endpoint.starts_with("http://"))
            {
                return invalid(format!(
                    "the OIDC token endpoint {:?} (`sasl.oauthbearer.token.endpoint.url`) is not an http(s):// URL",
                    o.token_endpoint
                ));
            }
            if o.client_id.is_empty() {
                return invalid(
                    "the OIDC client id is empty: set `sasl.oauthbearer.client.id`".to_owned(),
                );
            }
            Ok(())
        }
    }

    /// The librdkafka settings of this security, secrets included (for a client
    /// configuration only: never print them, see [`describe_settings`]).
    pub fn settings(&self) -> Vec<(&'static str, String)> {
        let mut s = vec![("security.protocol", self.protocol.as_str().to_owned())];
        if let Some(m) = self.mechanism {
            s.push(("sasl.mechanism", m.as_str().to_owned()));
        }
        if let Some(u) = &self.username {
            s.push(("sasl.username", u.clone()));
        }
        if let Some(p) = &self.password {
            s.push(("sasl.password", p.expose().to_owned()));
        }
        if self.protocol.tls() {
            // Without a CA file, the system's bundle: librdkafka finds it at the usual paths
            // ("probe"), which a statically built OpenSSL would not look at by itself.
            let ca = self
                .ca_file
                .as_ref()
                .map_or_else(|| "probe".to_owned(), |p| p.display().to_string());
            s.push(("ssl.ca.location", ca));
            // The broker's host name is checked against its certificate.
            s.push(("ssl.endpoint.identification.algorithm", "https".to_owned()));
        }
        if let Some(c) = &self.cert_file {
            s.push(("ssl.certificate.location", c.display().to_string()));
        }
        if let Some(k) = &self.key_file {
            s.push(("ssl.key.location", k.display().to_string()));
        }
        if let Some(p) = &self.key_password {
            s.push(("ssl.key.password", p.expose().to_owned()));
        }
        if let Some(o) = &self.oauth {
            s.push(("sasl.oauthbearer.method", "oidc".to_owned()));
            s.push((
                "sasl.oauthbearer.token.endpoint.url",
                o.token_endpoint.clone(),
            ));
            s.push(("sasl.oauthbearer.client.id", o.client_id.clone()));
            s.push((
                "sasl.oauthbearer.client.secret",
                o.client_secret.expose().to_owned(),
            ));
            if let Some(scope) = &o.scope {
                s.push(("sasl.oauthbearer.scope", scope.clone()));
            }
        }
        s
    }

    /// Reads the security settings of a client configuration (`security.protocol=…` and the
    /// like) back into a [`KafkaSecurity`], to validate them alike.
    pub fn from_client_config(cfg: &ClientConfig) -> Result<Self, SecurityError> {
        let get = |k: &str| cfg.get(k).map(str::to_owned).filter(|v| !v.is_empty());
        let protocol = match get("security.protocol") {
            Some(p) => p.parse()?,
            None => SecurityProtocol::Plaintext,
        };
        let mechanism = match get("sasl.mechanism").or_else(|| get("sasl.mechanisms")) {
            Some(m) => Some(m.parse()?),
            None => None,
        };
        let ca_file = get("ssl.ca.location")
            .filter(|c| c != "probe")
            .map(PathBuf::from);
        let oidc = get("sasl.oauthbearer.method").is_some_and(|m| m.eq_ignore_ascii_case("oidc"));
        let oauth = match (
            get("sasl.oauthbearer.token.endpoint.url"),
            get("sasl.oauthbearer.client.id"),
        ) {
            (Some(token_endpoint), Some(client_id)) if oidc => Some(OAuthBearer {
                token_endpoint,
                client_id,
                client_secret: Secret::new(
                    get("sasl.oauthbearer.client.secret").unwrap_or_default(),
                ),
                scope: get("sasl.oauthbearer.scope"),
            }),
            (Some(_), _) | (_, Some(_)) if oidc => {
                return Err(SecurityError::Invalid(
                    "sasl.oauthbearer.method=oidc needs sasl.oauthbearer.token.endpoint.url and sasl.oauthbearer.client.id".to_owned(),
                ));
            }
            _ => None,
        };
        let mut security = KafkaSecurity {
            protocol,
            mechanism,
            username: get("sasl.username"),
            password: get("sasl.password").map(Secret::new),
            ca_file,
            cert_file: get("ssl.certificate.location").map(PathBuf::from),
            key_file: get("ssl.key.location").map(PathBuf::from),
            key_password: get("ssl.key.password").map(Secret::new),
            oauth,
        };
        // librdkafka's unsecured test tokens (sasl.oauthbearer.config) need no OIDC settings.
        if security.mechanism == Some(SaslMechanism::OAuthBearer)
            && security.oauth.is_none()
            && !oidc
            && get("sasl.oauthbearer.config").is_some()
        {
            security.mechanism = None;
            security.protocol = SecurityProtocol::Plaintext;
        }
        Ok(security)
    }
}

/// Checks that `path` exists, is readable and holds `marker` (a PEM header).
fn check_pem(
    path: &Path,
    what: &'static str,
    setting: &'static str,
    marker: &str,
    todo: &str,
) -> Result<(), SecurityError> {
    let fail = |reason: String| {
        Err(SecurityError::File {
            what,
            setting,
            path: path.to_owned(),
            reason,
        })
    };
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return fail(format!("does not exist: {todo}"));
        }
        Err(e) => return fail(format!("cannot be read ({e}): {todo}")),
    };
    let text = String::from_utf8_lossy(&bytes);
    if !text.contains(marker) {
        return fail(format!(
            "is not PEM (no line with {marker}; a DER file converts with `openssl x509 -inform DER -in FILE -out FILE.pem`, a key with `openssl pkey -inform DER`): {todo}"
        ));
    }
    Ok(())
}

/// The bootstrap servers and the security of one cluster: every client idem makes for it
/// starts from here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Connection {
    brokers: String,
    security: KafkaSecurity,
}

impl Connection {
    /// A connection to `brokers` with `security`, validated ([`KafkaSecurity::validate`]).
    pub fn new(brokers: impl Into<String>, security: KafkaSecurity) -> Result<Self, SecurityError> {
        security.validate()?;
        Ok(Connection {
            brokers: brokers.into(),
            security,
        })
    }

    /// A PLAINTEXT connection to `brokers` (librdkafka's mock cluster, a local broker).
    pub fn plaintext(brokers: impl Into<String>) -> Self {
        Connection {
            brokers: brokers.into(),
            security: KafkaSecurity::default(),
        }
    }

    /// The same security towards other bootstrap servers (the mock cluster's address once it
    /// is started).
    pub fn with_brokers(&self, brokers: impl Into<String>) -> Self {
        Connection {
            brokers: brokers.into(),
            security: self.security.clone(),
        }
    }

    /// The bootstrap servers.
    pub fn brokers(&self) -> &str {
        &self.brokers
    }

    /// The security.
    pub fn security(&self) -> &KafkaSecurity {
        &self.security
    }

    /// A client configuration holding the bootstrap servers and the security settings only:
    /// the base of admin, metadata and inspection clients.
    pub fn client_config(&self) -> ClientConfig {
        let mut cfg = ClientConfig::new();
        self.apply(&mut cfg);
        cfg
    }

    /// Sets the bootstrap servers and the security settings on `cfg`.
    pub fn apply(&self, cfg: &mut ClientConfig) {
        cfg.set("bootstrap.servers", &self.brokers);
        if self.security.is_plaintext_default() {
            return;
        }
        for (k, v) in self.security.settings() {
            cfg.set(k, v);
        }
    }

    /// Refuses an override (`--producer-config`, `--consumer-config`) of a security setting
    /// this connection sets to something else: one setting, one place.
    pub(crate) fn check_override(&self, side: &str, key: &str, value: &str) -> crate::Result<()> {
        if self.security.is_plaintext_default() || !SECURITY_KEYS.contains(&key) {
            return Ok(());
        }
        let ours = self.security.settings();
        match ours.iter().find(|(k, _)| *k == key) {
            Some((_, v)) if v == value => Ok(()),
            _ => Err(idem_core::Error::Config(format!(
                "{side} setting {key}={} conflicts with the security settings: set {key} through the security settings (`KafkaSecurity`) only",
                redacted_value(key, value)
            ))),
        }
    }

    /// The producer configuration of the relays: see [`crate::producer_config`].
    pub fn producer_config(&self, overrides: &[(String, String)]) -> crate::Result<ClientConfig> {
        crate::producer_config_for(self, overrides)
    }

    /// A consumer configuration for `group`: see [`crate::consumer_config`].
    pub fn consumer_config(
        &self,
        group: &str,
        overrides: &[(String, String)],
    ) -> crate::Result<ClientConfig> {
        crate::source::consumer_config_for(self, group, overrides)
    }

    /// Connects once (within `timeout`) and reads the cluster's metadata, so that a refused
    /// TLS handshake or login stops a command at start with what to do, instead of librdkafka
    /// retrying it forever in its log. See [`check_client`].
    pub async fn check(&self, timeout: Duration) -> Result<(), ConnectError> {
        check_client(self.client_config(), timeout).await
    }
}

/// Why a first connection failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The cluster refused this client for good (a login, a certificate, the wrong protocol):
    /// retrying cannot help, the configuration must change.
    #[error("{0}")]
    Refused(String),
    /// The cluster could not be reached within the time allowed (down, wrong address): a
    /// client may keep trying.
    #[error("{0}")]
    Unreachable(String),
    /// The client could not be created (a setting librdkafka refuses).
    #[error("{0}")]
    Client(String),
}

impl ConnectError {
    /// Whether retrying cannot help (see [`ConnectError::Refused`], [`ConnectError::Client`]).
    pub fn is_refusal(&self) -> bool {
        !matches!(self, ConnectError::Unreachable(_))
    }
}

/// What librdkafka reported while a check ran.
#[derive(Default)]
struct Reports {
    errors: Mutex<Vec<(Option<RDKafkaErrorCode>, String)>>,
}

impl ClientContext for Reports {
    fn error(&self, error: KafkaError, reason: &str) {
        self.errors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((error.rdkafka_error_code(), reason.to_owned()));
    }

    /// librdkafka's log lines are kept too: some refusals (a dropped connection while the
    /// first request is in flight) only show there. They are never printed.
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, _fac: &str, log_message: &str) {
        if !matches!(level, rdkafka::config::RDKafkaLogLevel::Debug) {
            self.errors
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((None, log_message.to_owned()));
        }
    }
}

impl ProducerContext for Reports {
    type DeliveryOpaque = ();

    fn delivery(
        &self,
        _delivery_result: &rdkafka::message::DeliveryResult<'_>,
        _delivery_opaque: Self::DeliveryOpaque,
    ) {
    }
}

/// Connects with `config` (bootstrap servers and security settings; other keys are ignored)
/// and reads the cluster's metadata within `timeout`. A login the broker refuses, a broker
/// certificate this client does not trust, a client certificate the broker refuses, a
/// plaintext client at a TLS listener (or the reverse) return [`ConnectError::Refused`] as
/// soon as librdkafka reports it, with what is wrong and what to do; a cluster that does not
/// answer returns [`ConnectError::Unreachable`] after `timeout` (at once when every broker
/// refuses the TCP connection).
pub async fn check_client(config: ClientConfig, timeout: Duration) -> Result<(), ConnectError> {
    let mut conn = crate::admin::connection_of(&config);
    conn.set_log_level(rdkafka::config::RDKafkaLogLevel::Info);
    tokio::task::spawn_blocking(move || check_blocking(&conn, timeout))
        .await
        .map_err(|e| ConnectError::Client(format!("the Kafka connection check stopped: {e}")))?
}

fn check_blocking(conn: &ClientConfig, timeout: Duration) -> Result<(), ConnectError> {
    let security = KafkaSecurity::from_client_config(conn).unwrap_or_default();
    let producer: BaseProducer<Reports> =
        conn.create_with_context(Reports::default()).map_err(|e| {
            ConnectError::Client(format!("creating a Kafka client: {}", client_error(&e)))
        })?;
    let brokers = conn.get("bootstrap.servers").unwrap_or("").to_owned();
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let step = left.min(Duration::from_millis(500));
        let result = producer.client().fetch_metadata(None, step);
        // Serve the error events the attempt queued.
        producer.poll(Duration::ZERO);
        let reports: Vec<(Option<RDKafkaErrorCode>, String)> = producer
            .context()
            .errors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if result.is_ok() {
            return Ok(());
        }
        if let Some(refusal) = refusal(&reports, &security, &brokers) {
            return Err(ConnectError::Refused(refusal));
        }
        // Every broker refused the TCP connection, twice or more: nobody listens there (a
        // broker down, a wrong port). Said at once: waiting cannot tell more.
        let refused_tcp = reports
            .iter()
            .filter(|(_, r)| r.contains("Connection refused"))
            .count();
        let all_refused = reports
            .iter()
            .all(|(_, r)| r.contains("Connection refused") || r.contains("brokers are down"));
        if Instant::now() >= deadline || (refused_tcp >= 2 && all_refused) {
            let last = reports
                .last()
                .map_or_else(|| "no answer".to_owned(), |(_, r)| r.clone());
            let what = if refused_tcp >= 2 && all_refused {
                format!("nothing listens at {brokers} (connection refused)")
            } else {
                format!("no Kafka broker at {brokers} answered within {timeout:?}")
            };
            return Err(ConnectError::Unreachable(format!(
                "{what} (last report: {last}): check the brokers (`bootstrap.servers`) and that the cluster runs and this host can reach it"
            )));
        }
    }
}

/// A librdkafka error as text, the value of a secret setting left out (librdkafka's own text
/// of a refused setting repeats its value).
pub fn client_error(e: &KafkaError) -> String {
    match e {
        KafkaError::ClientConfig(_, desc, key, value) if is_secret_setting(key) => {
            let desc = if value.is_empty() {
                desc.clone()
            } else {
                desc.replace(value.as_str(), REDACTED)
            };
            format!("librdkafka refused the setting {key} ({desc}; value {REDACTED})")
        }
        KafkaError::ClientConfig(_, desc, key, _) => {
            format!("librdkafka refused the setting {key}: {desc}")
        }
        e => e.to_string(),
    }
}

/// The refusal among `reports`, described: what is wrong and what to do. `None` while only
/// unreachable brokers were reported.
fn refusal(
    reports: &[(Option<RDKafkaErrorCode>, String)],
    security: &KafkaSecurity,
    brokers: &str,
) -> Option<String> {
    let p = security.protocol;
    for (code, reason) in reports {
        let r = reason.as_str();
        if let Some(o) = &security.oauth
            && security.mechanism == Some(SaslMechanism::OAuthBearer)
            && (*code == Some(RDKafkaErrorCode::Authentication)
                || r.contains("SASL authentication error"))
        {
            return Some(oauth_refusal(r, o));
        }
        if *code == Some(RDKafkaErrorCode::Authentication)
            || r.contains("SASL authentication error")
        {
            let who = security.username.as_deref().unwrap_or("(no user)");
            let m = security.mechanism.map_or("SASL", SaslMechanism::as_str);
            return Some(format!(
                "the Kafka broker refused the {m} login of user {who}: {}; check `sasl.username` and `sasl.password` and that the user exists for {m} on the cluster",
                broker_said(r)
            ));
        }
        if r.contains("certificate verify failed")
            || r.contains("broker certificate could not be verified")
        {
            let ca = security.ca_file.as_ref().map_or_else(
                || "the system's CA bundle".to_owned(),
                |c| c.display().to_string(),
            );
            return Some(format!(
                "this client does not trust the Kafka broker's TLS certificate ({}): OpenSSL does not say which check failed, so check both: the certificate must be signed by a CA in `ssl.ca.location`, now {ca}, and it must name the host this client connects to (in `bootstrap.servers` and the broker's advertised listeners): connect by a host name the certificate names",
                broker_said(r)
            ));
        }
        if r.contains("alert certificate expired")
            || r.contains("alert bad certificate")
            || r.contains("alert certificate unknown")
            || r.contains("alert unknown ca")
            || r.contains("alert certificate required")
            || r.contains("alert handshake failure")
        {
            let cert = security.cert_file.as_ref().map_or_else(
                || "none given (`ssl.certificate.location`)".to_owned(),
                |c| c.display().to_string(),
            );
            return Some(format!(
                "the Kafka broker refused this client's TLS certificate ({}): give `ssl.certificate.location` and `ssl.key.location` a certificate that is valid now (not expired) and signed by a CA the broker trusts (certificate: {cert})",
                broker_said(r)
            ));
        }
        if r.contains("connecting to a PLAINTEXT broker listener")
            || (p.tls() && r.contains("wrong version number"))
        {
            return Some(format!(
                "the Kafka listener at {brokers} does not speak TLS but the security protocol is {p} ({}): point `bootstrap.servers` at the cluster's TLS listener, or set `security.protocol` to PLAINTEXT or SASL_PLAINTEXT",
                broker_said(r)
            ));
        }
    }
    // A listener that expects TLS (or SASL) closes on a plaintext ApiVersion request: seen
    // twice, it is the protocol, not a broker restarting (which refuses connections instead).
    // A connection *reset* is the network's doing: a TCP proxy or load balancer whose broker
    // is down accepts and then resets, as does a middlebox; that is a cluster out of reach.
    let dropped: usize = reports
        .iter()
        .filter(|(_, r)| {
            let closed = r.contains("Disconnected while requesting ApiVersion")
                || (r.contains("Disconnected") && r.contains("in state APIVERSION_QUERY"));
            closed && !r.to_ascii_lowercase().contains("connection reset")
        })
        .map(|(_, r)| {
            if r.contains("identical error(s) suppressed") {
                2
            } else {
                1
            }
        })
        .sum();
    // A TLS or SASL listener accepts the TCP connection: a refused one means the broker is
    // down or restarting, and the connections it dropped mid-request were those of its kill.
    let refused_tcp = reports
        .iter()
        .any(|(_, r)| r.contains("Connection refused"));
    if dropped >= 2 && !p.tls() && !refused_tcp {
        return Some(format!(
            "the Kafka broker at {brokers} closed every connection during the first request: its listener most likely expects TLS or SASL while the security protocol is {p}; set `security.protocol` to SSL or SASL_SSL as the listener requires"
        ));
    }
    None
}

/// A refused OAUTHBEARER login described: the token endpoint gave no token (wrong client
/// credentials, a wrong or unreachable endpoint), or the broker refused the token it gave.
/// The client secret is taken out of what the endpoint said, should it repeat it.
fn oauth_refusal(report: &str, o: &OAuthBearer) -> String {
    let hide = |s: &str| {
        let secret = o.client_secret.expose();
        if secret.is_empty() {
            s.to_owned()
        } else {
            s.replace(secret, REDACTED)
        }
    };
    const NO_TOKEN: &str = "Failed to acquire SASL OAUTHBEARER token: ";
    if let Some(i) = report.find(NO_TOKEN) {
        let said = hide(report[i + NO_TOKEN.len()..].trim());
        return format!(
            "the OIDC token endpoint {} gave client {} no token ({said}): check the client id `sasl.oauthbearer.client.id` and the client secret `sasl.oauthbearer.client.secret` with the identity provider, and that `sasl.oauthbearer.token.endpoint.url` is its token URL",
            o.token_endpoint, o.client_id
        );
    }
    format!(
        "the Kafka broker refused the OAUTHBEARER token that {} issued to client {} ({}): check that the identity provider gives this client tokens with the audience and issuer the broker expects (sasl.oauthbearer.expected.audience, sasl.oauthbearer.expected.issuer) signed by a key of the broker's JWKS (sasl.oauthbearer.jwks.endpoint.url); the broker's log names the failed check",
        o.token_endpoint,
        o.client_id,
        hide(&broker_said(report))
    )
}

/// The part of a librdkafka report after the broker's name, without the suppressed-count tail.
fn broker_said(reason: &str) -> String {
    let r = reason
        .split_once("/bootstrap: ")
        .or_else(|| reason.split_once(": "))
        .map_or(reason, |(_, rest)| rest)
        .trim();
    let r = r.strip_prefix("SASL authentication error: ").unwrap_or(r);
    // librdkafka's timing tail: "(after 315ms in state AUTH_REQ[, 1 identical error(s) suppressed])".
    let r = match r.rfind(" (after ") {
        Some(i) if r.ends_with(')') => &r[..i],
        _ => r,
    };
    r.trim().to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pem(dir: &Path, name: &str, body: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, body).unwrap_or_else(|e| panic!("{e}"));
        p
    }

    fn scram() -> KafkaSecurity {
        KafkaSecurity {
            protocol: SecurityProtocol::SaslSsl,
            mechanism: Some(SaslMechanism::ScramSha512),
            username: Some("relay".into()),
            password: Some(Secret::new("hunter2-secret")),
            ..KafkaSecurity::default()
        }
    }

    fn message(s: &KafkaSecurity) -> String {
        s.validate()
            .map_or_else(|e| e.to_string(), |()| "valid".to_owned())
    }

    #[test]
    fn incoherent_settings_are_refused_with_the_setting_that_fixes_them() {
        assert_eq!(message(&scram()), "valid");
        let m = message(&KafkaSecurity {
            protocol: SecurityProtocol::Ssl,
            ..scram()
        });
        assert!(
            m.starts_with("SASL mechanism SCRAM-SHA-512 is set but the security protocol is SSL"),
            "{m}"
        );
        let m = message(&KafkaSecurity {
            username: None,
            ..scram()
        });
        assert!(
            m.starts_with("a SASL password is set but no user: set `sasl.username`"),
            "{m}"
        );
        let m = message(&KafkaSecurity {
            password: None,
            ..scram()
        });
        assert!(m.starts_with("SASL user relay has no password"), "{m}");
        let m = message(&KafkaSecurity {
            mechanism: None,
            username: None,
            password: None,
            ..scram()
        });
        assert!(m.contains("needs a SASL mechanism"), "{m}");
        let dir = tempfile_dir();
        let key = pem(&dir, "k.pem", "-----BEGIN PRIVATE KEY-----\n");
        let m = message(&KafkaSecurity {
            protocol: SecurityProtocol::Ssl,
            key_file: Some(key),
            ..KafkaSecurity::default()
        });
        assert!(
            m.starts_with("a TLS client key is set without its certificate"),
            "{m}"
        );
        let m = message(&KafkaSecurity {
            protocol: SecurityProtocol::Ssl,
            ca_file: Some(dir.join("missing.pem")),
            ..KafkaSecurity::default()
        });
        assert!(
            m.contains("missing.pem, set by `ssl.ca.location`: does not exist"),
            "{m}"
        );
        let not_pem = pem(&dir, "ca.der", "\u{30}\u{82}binary");
        let m = message(&KafkaSecurity {
            protocol: SecurityProtocol::Ssl,
            ca_file: Some(not_pem),
            ..KafkaSecurity::default()
        });
        assert!(
            m.contains("ca.der, set by `ssl.ca.location`: is not PEM"),
            "{m}"
        );
        let m = message(&KafkaSecurity {
            mechanism: Some(SaslMechanism::OAuthBearer),
            username: None,
            password: None,
            ..scram()
        });
        assert!(m.contains("needs an OIDC token endpoint"), "{m}");
        std::fs::remove_dir_all(&dir).ok();
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("idem-kafka-security-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap_or_else(|e| panic!("{e}"));
        d
    }

    #[test]
    fn secrets_never_reach_debug_or_errors() {
        let s = scram();
        let debug = format!("{s:?}");
        assert!(!debug.contains("hunter2"), "{debug}");
        assert!(debug.contains(REDACTED), "{debug}");
        let conn = Connection::new("b:1", s).unwrap_or_else(|e| panic!("{e}"));
        assert!(!format!("{conn:?}").contains("hunter2"));
        let cfg = conn.client_config();
        assert!(!format!("{cfg:?}").contains("hunter2"));
        assert_eq!(cfg.get("sasl.password"), Some("hunter2-secret"));
        let settings = vec![("sasl.password".to_owned(), "hunter2".to_owned())];
        assert_eq!(
            describe_settings(&settings),
            vec![format!("sasl.password={REDACTED}")]
        );
        let e = KafkaError::ClientConfig(
            rdkafka::types::RDKafkaConfRes::RD_KAFKA_CONF_INVALID,
            "Invalid value \"hunter2\" for sasl.password".to_owned(),
            "sasl.password".to_owned(),
            "hunter2".to_owned(),
        );
        let text = client_error(&e);
        assert!(!text.contains("hunter2"), "{text}");
        let conflict = conn
            .check_override("producer", "sasl.password", "other-secret")
            .map_or_else(|e| e.to_string(), |()| String::new());
        assert!(
            conflict.contains("conflicts with the security settings"),
            "{conflict}"
        );
        assert!(!conflict.contains("other-secret"), "{conflict}");
    }

    #[test]
    fn connections_dropped_by_a_killed_broker_are_not_a_protocol_refusal() {
        let plain = KafkaSecurity::default();
        let report = |r: &str| (None, r.to_owned());
        let dropped = report(
            "127.0.0.1:9092/bootstrap: Disconnected while requesting ApiVersion: might be caused by incorrect security.protocol configuration",
        );
        let both = [dropped.clone(), dropped.clone()];
        assert!(
            refusal(&both, &plain, "127.0.0.1:9092").is_some(),
            "a listener that drops every first request expects TLS or SASL"
        );
        let killed = [
            dropped.clone(),
            dropped,
            report(
                "127.0.0.1:9092/bootstrap: Connect to ipv4#127.0.0.1:9092 failed: Connection refused (after 0ms in state CONNECT)",
            ),
        ];
        assert_eq!(refusal(&killed, &plain, "127.0.0.1:9092"), None);
    }

    #[test]
    fn oauthbearer_refusals_name_the_token_endpoint_or_the_broker_never_the_secret() {
        let security = KafkaSecurity {
            protocol: SecurityProtocol::SaslSsl,
            mechanism: Some(SaslMechanism::OAuthBearer),
            oauth: Some(OAuthBearer {
                token_endpoint: "https://idp.example/token".to_owned(),
                client_id: "relay".to_owned(),
                client_secret: Secret::new("s3cret-value"),
                scope: None,
            }),
            ..KafkaSecurity::default()
        };
        let auth = |r: &str| [(Some(RDKafkaErrorCode::Authentication), r.to_owned())];
        let no_token = refusal(
            &auth(
                "Failed to acquire SASL OAUTHBEARER token: {\"error\":\"invalid_client\",\"echo\":\"s3cret-value\"}",
            ),
            &security,
            "b:1",
        )
        .unwrap_or_default();
        assert!(
            no_token.starts_with(
                "the OIDC token endpoint https://idp.example/token gave client relay no token ({\"error\":\"invalid_client\",\"echo\":\"[redacted]\"}): check the client id"
            ),
            "{no_token}"
        );
        let rejected = refusal(
            &auth(
                "sasl_ssl://b:1/bootstrap: SASL authentication error: {\"status\":\"invalid_token\"} (after 5ms in state AUTH_REQ)",
            ),
            &security,
            "b:1",
        )
        .unwrap_or_default();
        assert!(
            rejected.starts_with(
                "the Kafka broker refused the OAUTHBEARER token that https://idp.example/token issued to client relay ({\"status\":\"invalid_token\"}): check that the identity provider"
            ),
            "{rejected}"
        );
    }

    #[test]
    fn librdkafka_is_built_with_tls_sasl_and_oidc() {
        let native = ClientConfig::new()
            .create_native_config()
            .unwrap_or_else(|e| panic!("{e}"));
        let features = native
            .get("builtin.features")
            .unwrap_or_else(|e| panic!("{e}"));
        for f in [
            "ssl",
            "sasl_plain",
            "sasl_scram",
            "sasl_oauthbearer",
            "oidc",
        ] {
            assert!(
                features.split(',').any(|x| x == f),
                "{f} missing: {features}"
            );
        }
    }

    #[test]
    fn overrides_are_read_back_and_validated_like_flags() {
        let mut cfg = ClientConfig::new();
        cfg.set("security.protocol", "sasl_ssl")
            .set("sasl.mechanism", "SCRAM-SHA-256")
            .set("sasl.password", "x");
        let s = KafkaSecurity::from_client_config(&cfg).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.protocol, SecurityProtocol::SaslSsl);
        assert!(message(&s).starts_with("a SASL password is set but no user"));
    }
}
