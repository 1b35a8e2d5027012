//! A PostgreSQL URL read as libpq reads its parameters, once, for every pool and for the CDC
//! relay's replication session: the host, the user, the database and the TLS settings
//! (`sslmode`, `sslrootcert`, `sslcert`, `sslkey`) mean the same to both.
//!
//! The parameters follow libpq's names (sqlx's dashed aliases are accepted too), with the
//! `PGSSLMODE`, `PGSSLROOTCERT`, `PGSSLCERT`, `PGSSLKEY` and `PGPASSWORD` environment variables as
//! defaults, as libpq and sqlx read them. An unknown parameter is refused: a misspelt
//! `sslmode` must not silently leave a connection in clear, and the refusal never repeats the
//! value (it may be a secret).

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use idem_core::{Error, Result};
use sqlx::postgres::{PgConnectOptions, PgSslMode};

/// libpq's `sslmode`. `allow` is read as [`SslMode::Prefer`]: sqlx has no "plain first, TLS
/// when refused" step, and `prefer` connects wherever `allow` would, encrypted when the server
/// offers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SslMode {
    /// Never TLS.
    Disable,
    /// TLS when the server offers it, without checking its certificate (libpq's default).
    Prefer,
    /// TLS or no connection; the certificate is not checked (unless a root certificate is
    /// given: then, as libpq does, it is checked as under [`SslMode::VerifyCa`]).
    Require,
    /// TLS, and the server's certificate must chain to a trusted CA.
    VerifyCa,
    /// TLS, a trusted chain, and the certificate names the host connected to. Recommended.
    VerifyFull,
}

impl SslMode {
    /// libpq's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    /// Whether the connection fails rather than go in clear.
    pub fn requires_tls(self) -> bool {
        !matches!(self, SslMode::Disable | SslMode::Prefer)
    }

    /// Whether the server's certificate chain is checked.
    pub fn verifies_chain(self) -> bool {
        matches!(self, SslMode::VerifyCa | SslMode::VerifyFull)
    }

    fn parse(value: &str, source: &str) -> Result<SslMode> {
        match value {
            "disable" => Ok(SslMode::Disable),
            "allow" | "prefer" => Ok(SslMode::Prefer),
            "require" => Ok(SslMode::Require),
            "verify-ca" => Ok(SslMode::VerifyCa),
            "verify-full" => Ok(SslMode::VerifyFull),
            _ => Err(Error::Config(format!(
                "{source} {value:?} is not an sslmode: use disable, allow, prefer, require, \
                 verify-ca or verify-full (verify-full is recommended)"
            ))),
        }
    }

    fn sqlx(self) -> PgSslMode {
        match self {
            SslMode::Disable => PgSslMode::Disable,
            SslMode::Prefer => PgSslMode::Prefer,
            SslMode::Require => PgSslMode::Require,
            SslMode::VerifyCa => PgSslMode::VerifyCa,
            SslMode::VerifyFull => PgSslMode::VerifyFull,
        }
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The TLS settings of a connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PgTls {
    /// The effective mode (`require` with a root certificate is `verify-ca`, as in libpq).
    pub mode: SslMode,
    /// PEM file of the CA certificates to trust (`sslrootcert`). Without it the system's
    /// roots are trusted; with it, sqlx's pools trust these and the system's roots, the
    /// replication session these alone.
    pub root_cert: Option<PathBuf>,
    /// The client certificate (`sslcert`, PEM), for servers that authenticate by certificate.
    pub client_cert: Option<PathBuf>,
    /// The client certificate's private key (`sslkey`, PEM).
    pub client_key: Option<PathBuf>,
}

/// A PostgreSQL URL, parsed and checked: where to connect, as whom, and how.
#[derive(Clone)]
pub struct PgUrl {
    url: String,
    /// Host name or IP address.
    pub host: String,
    /// TCP port.
    pub port: u16,
    /// Role name.
    pub user: String,
    password: Option<String>,
    /// Database name (the user's name when the URL names none).
    pub database: String,
    /// TLS settings.
    pub tls: PgTls,
}

impl fmt::Debug for PgUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgUrl")
            .field("url", &crate::redact(&self.url))
            .field("host", &self.host)
            .field("port", &self.port)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("database", &self.database)
            .field("tls", &self.tls)
            .finish()
    }
}

/// The parameters read from the query string; anything else is refused.
const PARAMETERS: &[&str] = &[
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "application_name",
    "options",
    "statement-cache-capacity",
];

/// The environment a URL is read in (libpq's variables), apart so that tests choose it.
pub(crate) trait Env {
    fn var(&self, name: &str) -> Option<String>;
}

struct ProcessEnv;

impl Env for ProcessEnv {
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok().filter(|v| !v.is_empty())
    }
}

impl FromStr for PgUrl {
    type Err = Error;

    fn from_str(url: &str) -> Result<PgUrl> {
        PgUrl::parse_in(url, &ProcessEnv)
    }
}

impl PgUrl {
    /// Parses `url` (`postgres://user:password@host:port/db?sslmode=verify-full&…`).
    pub fn parse(url: &str) -> Result<PgUrl> {
        url.parse()
    }

    pub(crate) fn parse_in(url: &str, env: &dyn Env) -> Result<PgUrl> {
        let shown = || crate::redact(url);
        let parsed = url::Url::parse(url).map_err(|e| {
            Error::Config(format!(
                "the database URL {} is not a URL ({e}): use postgres://user:password@host:port/db",
                shown()
            ))
        })?;
        if !matches!(parsed.scheme(), "postgres" | "postgresql") {
            return Err(Error::Config(format!(
                "{} is not a PostgreSQL URL: use postgres://user:password@host:port/db",
                shown()
            )));
        }
        let mut p = Raw::from_url(&parsed)?;
        for (key, value) in parsed.query_pairs() {
            p.set(&key, value.into_owned(), &shown)?;
        }
        p.finish(url, env)
    }

    /// The password, if the URL (or `PGPASSWORD`) gives one. Never printed by `Debug`.
    pub fn password(&self) -> Option<&str> {
        self.password.as_deref()
    }

    /// The URL as given, its password hidden, for messages.
    pub fn redacted(&self) -> String {
        crate::redact(&self.url)
    }

    /// The sqlx connection options: the URL as sqlx reads it, with the effective `sslmode`.
    ///
    /// Installs ring as the process's TLS crypto provider when none is installed yet: sqlx's
    /// `verify-ca` verifier asks rustls for the process default, which rustls cannot choose when
    /// a build holds two providers (pgwire-replication's rustls brings aws-lc-rs beside ring).
    pub fn connect_options(&self) -> Result<PgConnectOptions> {
        install_crypto_provider();
        let opts: PgConnectOptions = self.url.parse().map_err(|e| {
            Error::Config(format!(
                "the database URL {} cannot be read: {e}",
                self.redacted()
            ))
        })?;
        let mut opts = opts.ssl_mode(self.tls.mode.sqlx());
        if let Some(p) = &self.tls.root_cert {
            opts = opts.ssl_root_cert(p);
        }
        if let (Some(c), Some(k)) = (&self.tls.client_cert, &self.tls.client_key) {
            opts = opts.ssl_client_cert(c).ssl_client_key(k);
        }
        Ok(opts)
    }
}

/// Makes ring the process's rustls provider unless one is installed (idempotent: a second
/// install is refused and ignored).
pub(crate) fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// What the URL says, before the environment's defaults and the checks.
#[derive(Default)]
struct Raw {
    host: Option<String>,
    port: Option<u16>,
    user: Option<String>,
    password: Option<String>,
    database: Option<String>,
    mode: Option<SslMode>,
    root_cert: Option<PathBuf>,
    client_cert: Option<PathBuf>,
    client_key: Option<PathBuf>,
}

fn decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}

impl Raw {
    fn from_url(u: &url::Url) -> Result<Raw> {
        let database = u.path().trim_start_matches('/');
        Ok(Raw {
            host: u.host_str().map(|h| h.trim_matches(['[', ']']).to_owned()),
            port: u.port(),
            user: Some(u.username()).filter(|s| !s.is_empty()).map(decode),
            password: u.password().map(decode),
            database: Some(database).filter(|s| !s.is_empty()).map(decode),
            ..Raw::default()
        })
    }

    fn set(&mut self, key: &str, value: String, shown: &dyn Fn() -> String) -> Result<()> {
        match key {
            "sslmode" | "ssl-mode" => self.mode = Some(SslMode::parse(&value, "sslmode")?),
            "sslrootcert" | "ssl-root-cert" | "ssl-ca" => self.root_cert = Some(value.into()),
            "sslcert" | "ssl-cert" => self.client_cert = Some(value.into()),
            "sslkey" | "ssl-key" => self.client_key = Some(value.into()),
            "host" | "hostaddr" => self.host = Some(value),
            "port" => {
                self.port = Some(value.parse().map_err(|_| {
                    Error::Config(format!(
                        "port {value:?} in {} is not a port number",
                        shown()
                    ))
                })?)
            }
            "dbname" => self.database = Some(value),
            "user" => self.user = Some(value),
            "password" => self.password = Some(value),
            k if PARAMETERS.contains(&k) || k.starts_with("options[") => {}
            k => {
                return Err(Error::Config(format!(
                    "the database URL {} has a parameter {k:?} that idem does not read: \
                     remove it, or use one of {}",
                    shown(),
                    PARAMETERS.join(", ")
                )));
            }
        }
        Ok(())
    }

    fn finish(self, url: &str, env: &dyn Env) -> Result<PgUrl> {
        let mode = match self.mode {
            Some(m) => m,
            None => match env.var("PGSSLMODE") {
                Some(v) => SslMode::parse(&v, "PGSSLMODE")?,
                None => SslMode::Prefer,
            },
        };
        let path = |p: Option<PathBuf>, var: &str| p.or_else(|| env.var(var).map(PathBuf::from));
        let root_cert = path(self.root_cert, "PGSSLROOTCERT");
        let client_cert = path(self.client_cert, "PGSSLCERT");
        let client_key = path(self.client_key, "PGSSLKEY");
        let tls = checked_tls(mode, root_cert, client_cert, client_key)?;
        let user = self
            .user
            .or_else(|| env.var("PGUSER"))
            .unwrap_or_else(|| "postgres".to_owned());
        Ok(PgUrl {
            url: url.to_owned(),
            host: self.host.unwrap_or_else(|| "localhost".to_owned()),
            port: self.port.unwrap_or(5432),
            database: self.database.unwrap_or_else(|| user.clone()),
            user,
            password: self.password.or_else(|| env.var("PGPASSWORD")),
            tls,
        })
    }
}

/// The TLS settings, refused when they cannot work: a certificate without its key, a file that
/// is not there, a root certificate or a client certificate under `sslmode=disable`.
fn checked_tls(
    mode: SslMode,
    root_cert: Option<PathBuf>,
    client_cert: Option<PathBuf>,
    client_key: Option<PathBuf>,
) -> Result<PgTls> {
    match (&client_cert, &client_key) {
        (Some(_), None) => {
            return Err(Error::Config(
                "sslcert is set without sslkey: give the client certificate's private key with \
                 sslkey=<file> (PEM)"
                    .to_owned(),
            ));
        }
        (None, Some(_)) => {
            return Err(Error::Config(
                "sslkey is set without sslcert: give the client certificate with sslcert=<file> \
                 (PEM)"
                    .to_owned(),
            ));
        }
        _ => {}
    }
    for (name, p) in [
        ("sslrootcert", &root_cert),
        ("sslcert", &client_cert),
        ("sslkey", &client_key),
    ] {
        if let Some(p) = p {
            readable(name, p)?;
        }
    }
    if mode == SslMode::Disable && (root_cert.is_some() || client_cert.is_some()) {
        return Err(Error::Config(
            "sslmode=disable with a certificate (sslrootcert or sslcert): the connection would \
             go in clear and ignore it; use sslmode=verify-full"
                .to_owned(),
        ));
    }
    // libpq: "if a root CA file exists, sslmode=require behaves as verify-ca".
    let mode = match (mode, &root_cert) {
        (SslMode::Require, Some(_)) => SslMode::VerifyCa,
        (m, _) => m,
    };
    Ok(PgTls {
        mode,
        root_cert,
        client_cert,
        client_key,
    })
}

fn readable(name: &str, p: &Path) -> Result<()> {
    match std::fs::metadata(p) {
        Ok(m) if m.is_file() => Ok(()),
        Ok(_) => Err(Error::Config(format!(
            "{name} {} is not a file: give the path of a PEM file",
            p.display()
        ))),
        Err(e) => Err(Error::Config(format!(
            "{name} {} cannot be read ({e}): give the path of a PEM file this process can read",
            p.display()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    struct Vars(HashMap<&'static str, String>);
    impl Env for Vars {
        fn var(&self, name: &str) -> Option<String> {
            self.0.get(name).cloned()
        }
    }
    fn none() -> Vars {
        Vars(HashMap::new())
    }

    fn parse(url: &str) -> Result<PgUrl> {
        PgUrl::parse_in(url, &none())
    }

    fn err(url: &str) -> String {
        match parse(url) {
            Ok(u) => panic!("{url} was accepted: {u:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn a_plain_url_prefers_tls_as_libpq_does() {
        let u =
            parse("postgres://app:p%40ss@db.local:6543/orders").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (
                u.host.as_str(),
                u.port,
                u.user.as_str(),
                u.password(),
                u.database.as_str()
            ),
            ("db.local", 6543, "app", Some("p@ss"), "orders")
        );
        assert_eq!(u.tls.mode, SslMode::Prefer);
        assert!(!format!("{u:?}").contains("p@ss"), "{u:?}");
    }

    #[test]
    fn parameters_override_the_url_and_allow_reads_as_prefer() {
        let u = parse("postgres://h/d?user=u&password=s3cret&port=7000&dbname=x&sslmode=allow")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (u.user.as_str(), u.port, u.database.as_str()),
            ("u", 7000, "x")
        );
        assert_eq!(u.password(), Some("s3cret"));
        assert_eq!(u.tls.mode, SslMode::Prefer);
        assert!(!u.redacted().contains("s3cret"), "{}", u.redacted());
        assert!(!format!("{u:?}").contains("s3cret"));
    }

    #[test]
    fn the_environment_gives_defaults_the_url_overrides() {
        let env = Vars(HashMap::from([
            ("PGSSLMODE", "verify-full".to_owned()),
            ("PGPASSWORD", "fromenv".to_owned()),
        ]));
        let u = PgUrl::parse_in("postgres://u@h/d", &env).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (u.tls.mode, u.password()),
            (SslMode::VerifyFull, Some("fromenv"))
        );
        let u = PgUrl::parse_in("postgres://u@h/d?sslmode=disable", &env)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(u.tls.mode, SslMode::Disable);
    }

    #[test]
    fn require_with_a_root_certificate_verifies_the_chain() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, "x").unwrap_or_else(|e| panic!("{e}"));
        let u = parse(&format!(
            "postgres://h/d?sslmode=require&sslrootcert={}",
            ca.display()
        ))
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(u.tls.mode, SslMode::VerifyCa);
    }

    #[test]
    fn settings_that_cannot_work_are_refused_with_what_to_do() {
        assert!(err("postgres://h/d?sslmode=verify_full").contains("is not an sslmode"));
        assert!(err("postgres://h/d?sslcert=/x").contains("without sslkey"));
        assert!(err("postgres://h/d?sslkey=/x").contains("without sslcert"));
        let e = err("postgres://h/d?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem");
        assert!(
            e.contains("sslrootcert /nonexistent/ca.pem cannot be read"),
            "{e}"
        );
        assert!(err("mysql://h/d").contains("not a PostgreSQL URL"));
    }

    #[test]
    fn an_unknown_parameter_is_refused_without_its_value() {
        let e = err("postgres://h/d?sslpassword=topsecret");
        assert!(e.contains("\"sslpassword\""), "{e}");
        assert!(!e.contains("topsecret"), "{e}");
    }

    #[test]
    fn the_sqlx_options_carry_the_effective_mode() {
        let u = parse("postgres://u:pw@127.0.0.1/d?sslmode=verify-full")
            .unwrap_or_else(|e| panic!("{e}"));
        let o = u.connect_options().unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(o.get_ssl_mode(), PgSslMode::VerifyFull));
        assert_eq!(o.get_host(), "127.0.0.1");
    }
}
