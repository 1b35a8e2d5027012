//! The Kafka connection flags every command that talks to Kafka flattens (`idem relay`, `idem
//! cdc relay`, `idem topic …`, the lab's consumers): TLS, SASL (PLAIN, SCRAM, OAUTHBEARER) and
//! the start-up connection check. Each flag is also an `IDEM_KAFKA_…` environment variable;
//! each secret also comes from a file (`--…-file`, `IDEM_KAFKA_…_FILE`), and the values of
//! secret variables are hidden from `--help`. docs/operating/kafka-security.md lists them.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use idem_kafka::{
    ConnectError, Connection, KafkaSecurity, OAuthBearer, SaslMechanism, Secret, SecurityProtocol,
};

use crate::util::parse_duration;

/// How to reach and authenticate to the Kafka cluster.
#[derive(Args, Clone, Default)]
pub struct KafkaArgs {
    /// Kafka security protocol: PLAINTEXT, SSL (TLS, with --kafka-ssl-cert for mutual TLS),
    /// SASL_PLAINTEXT or SASL_SSL.
    #[arg(long, env = "IDEM_KAFKA_SECURITY_PROTOCOL", value_name = "PROTOCOL")]
    pub kafka_security_protocol: Option<String>,
    /// SASL mechanism (SASL_* protocols): PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER.
    #[arg(long, env = "IDEM_KAFKA_SASL_MECHANISM", value_name = "MECHANISM")]
    pub kafka_sasl_mechanism: Option<String>,
    /// SASL user (PLAIN, SCRAM; a Confluent Cloud API key).
    #[arg(long, env = "IDEM_KAFKA_SASL_USERNAME", value_name = "USER")]
    pub kafka_sasl_username: Option<String>,
    /// SASL password (prefer --kafka-sasl-password-file or the environment: a command line is
    /// visible to every user of the host).
    #[arg(
        long,
        env = "IDEM_KAFKA_SASL_PASSWORD",
        hide_env_values = true,
        value_name = "PASSWORD"
    )]
    pub kafka_sasl_password: Option<String>,
    /// File holding the SASL password (one trailing newline is dropped).
    #[arg(long, env = "IDEM_KAFKA_SASL_PASSWORD_FILE", value_name = "FILE")]
    pub kafka_sasl_password_file: Option<PathBuf>,
    /// PEM file of the CA(s) that signed the brokers' certificates (default: the system's
    /// CA bundle).
    #[arg(long, env = "IDEM_KAFKA_SSL_CA", value_name = "FILE")]
    pub kafka_ssl_ca: Option<PathBuf>,
    /// This client's PEM certificate, for mutual TLS.
    #[arg(long, env = "IDEM_KAFKA_SSL_CERT", value_name = "FILE")]
    pub kafka_ssl_cert: Option<PathBuf>,
    /// The PEM private key of --kafka-ssl-cert.
    #[arg(long, env = "IDEM_KAFKA_SSL_KEY", value_name = "FILE")]
    pub kafka_ssl_key: Option<PathBuf>,
    /// Passphrase of an encrypted --kafka-ssl-key.
    #[arg(
        long,
        env = "IDEM_KAFKA_SSL_KEY_PASSWORD",
        hide_env_values = true,
        value_name = "PASSWORD"
    )]
    pub kafka_ssl_key_password: Option<String>,
    /// File holding the passphrase of --kafka-ssl-key.
    #[arg(long, env = "IDEM_KAFKA_SSL_KEY_PASSWORD_FILE", value_name = "FILE")]
    pub kafka_ssl_key_password_file: Option<PathBuf>,
    /// OAUTHBEARER: the OIDC token endpoint (https://…/token) tokens are fetched from with
    /// client credentials.
    #[arg(long, env = "IDEM_KAFKA_OAUTH_TOKEN_ENDPOINT", value_name = "URL")]
    pub kafka_oauth_token_endpoint: Option<String>,
    /// OAUTHBEARER: the OIDC client id.
    #[arg(long, env = "IDEM_KAFKA_OAUTH_CLIENT_ID", value_name = "ID")]
    pub kafka_oauth_client_id: Option<String>,
    /// OAUTHBEARER: the OIDC client secret (prefer the -file form or the environment).
    #[arg(
        long,
        env = "IDEM_KAFKA_OAUTH_CLIENT_SECRET",
        hide_env_values = true,
        value_name = "SECRET"
    )]
    pub kafka_oauth_client_secret: Option<String>,
    /// OAUTHBEARER: file holding the OIDC client secret.
    #[arg(long, env = "IDEM_KAFKA_OAUTH_CLIENT_SECRET_FILE", value_name = "FILE")]
    pub kafka_oauth_client_secret_file: Option<PathBuf>,
    /// OAUTHBEARER: the scope to ask the token for.
    #[arg(long, env = "IDEM_KAFKA_OAUTH_SCOPE", value_name = "SCOPE")]
    pub kafka_oauth_scope: Option<String>,
    /// How long the start-up check may take to reach the cluster (a refused login, an
    /// untrusted certificate or the wrong protocol stop the command at once; an unreachable
    /// cluster is only warned about, and the command goes on trying).
    #[arg(long, env = "IDEM_KAFKA_CONNECT_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub kafka_connect_timeout: Duration,
}

impl fmt::Debug for KafkaArgs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secret = |s: &Option<String>| s.as_ref().map(|_| idem_kafka::security::REDACTED);
        f.debug_struct("KafkaArgs")
            .field("kafka_security_protocol", &self.kafka_security_protocol)
            .field("kafka_sasl_mechanism", &self.kafka_sasl_mechanism)
            .field("kafka_sasl_username", &self.kafka_sasl_username)
            .field("kafka_sasl_password", &secret(&self.kafka_sasl_password))
            .field("kafka_sasl_password_file", &self.kafka_sasl_password_file)
            .field("kafka_ssl_ca", &self.kafka_ssl_ca)
            .field("kafka_ssl_cert", &self.kafka_ssl_cert)
            .field("kafka_ssl_key", &self.kafka_ssl_key)
            .field(
                "kafka_ssl_key_password",
                &secret(&self.kafka_ssl_key_password),
            )
            .field(
                "kafka_ssl_key_password_file",
                &self.kafka_ssl_key_password_file,
            )
            .field(
                "kafka_oauth_token_endpoint",
                &self.kafka_oauth_token_endpoint,
            )
            .field("kafka_oauth_client_id", &self.kafka_oauth_client_id)
            .field(
                "kafka_oauth_client_secret",
                &secret(&self.kafka_oauth_client_secret),
            )
            .field(
                "kafka_oauth_client_secret_file",
                &self.kafka_oauth_client_secret_file,
            )
            .field("kafka_oauth_scope", &self.kafka_oauth_scope)
            .field("kafka_connect_timeout", &self.kafka_connect_timeout)
            .finish()
    }
}

/// A secret given inline or in a file, not both.
fn secret(
    inline: Option<&String>,
    file: Option<&PathBuf>,
    what: &str,
    flag: &str,
) -> anyhow::Result<Option<Secret>> {
    match (inline, file) {
        (Some(_), Some(_)) => anyhow::bail!(
            "the {what} is given twice: use either --{flag} or --{flag}-file (or their environment variables), not both"
        ),
        (Some(s), None) => Ok(Some(Secret::new(s.clone()))),
        (None, Some(path)) => Ok(Some(Secret::from_file(path, what)?)),
        (None, None) => Ok(None),
    }
}

impl KafkaArgs {
    /// The security these flags describe, validated ([`KafkaSecurity::validate`]).
    pub fn security(&self) -> anyhow::Result<KafkaSecurity> {
        let protocol = match &self.kafka_security_protocol {
            Some(p) => p.parse::<SecurityProtocol>()?,
            None => SecurityProtocol::Plaintext,
        };
        let mechanism = match &self.kafka_sasl_mechanism {
            Some(m) => Some(m.parse::<SaslMechanism>()?),
            None => None,
        };
        let oauth_secret = secret(
            self.kafka_oauth_client_secret.as_ref(),
            self.kafka_oauth_client_secret_file.as_ref(),
            "OIDC client secret",
            "kafka-oauth-client-secret",
        )?;
        let oauth = match (
            &self.kafka_oauth_token_endpoint,
            &self.kafka_oauth_client_id,
            oauth_secret,
        ) {
            (None, None, None) if self.kafka_oauth_scope.is_none() => None,
            (Some(endpoint), Some(id), Some(client_secret)) => Some(OAuthBearer {
                token_endpoint: endpoint.clone(),
                client_id: id.clone(),
                client_secret,
                scope: self.kafka_oauth_scope.clone(),
            }),
            _ => anyhow::bail!(
                "OAUTHBEARER needs all of --kafka-oauth-token-endpoint, --kafka-oauth-client-id and --kafka-oauth-client-secret[-file] (IDEM_KAFKA_OAUTH_TOKEN_ENDPOINT, IDEM_KAFKA_OAUTH_CLIENT_ID, IDEM_KAFKA_OAUTH_CLIENT_SECRET[_FILE]); some are missing"
            ),
        };
        let security = KafkaSecurity {
            protocol,
            mechanism,
            username: self.kafka_sasl_username.clone(),
            password: secret(
                self.kafka_sasl_password.as_ref(),
                self.kafka_sasl_password_file.as_ref(),
                "SASL password",
                "kafka-sasl-password",
            )?,
            ca_file: self.kafka_ssl_ca.clone(),
            cert_file: self.kafka_ssl_cert.clone(),
            key_file: self.kafka_ssl_key.clone(),
            key_password: secret(
                self.kafka_ssl_key_password.as_ref(),
                self.kafka_ssl_key_password_file.as_ref(),
                "TLS key password",
                "kafka-ssl-key-password",
            )?,
            oauth,
        };
        security.validate()?;
        Ok(security)
    }

    /// A validated connection to `brokers` with these flags' security.
    pub fn connection(&self, brokers: &str) -> anyhow::Result<Connection> {
        Ok(Connection::new(brokers, self.security()?)?)
    }

    /// Connects once with `config` (its servers and security) before `bin` starts working: a
    /// refusal (login, certificate, protocol) is an error saying what to change; a cluster
    /// that does not answer within --kafka-connect-timeout is a warning, and the command goes
    /// on (librdkafka keeps trying, as it does when a broker goes down later).
    pub async fn check(&self, config: &idem_kafka::ClientConfig, bin: &str) -> anyhow::Result<()> {
        match idem_kafka::security::check_client(config.clone(), self.kafka_connect_timeout).await {
            Ok(()) => Ok(()),
            Err(ConnectError::Unreachable(e)) => {
                let e = with_flag_names(&e);
                eprintln!("{bin}: warning: {e}; going on, librdkafka keeps trying");
                Ok(())
            }
            Err(e) => Err(anyhow::Error::new(e))
                .with_context(|| format!("{bin} cannot use the Kafka cluster")),
        }
    }
}

/// The flag (and environment variables) that sets each setting the Kafka client's messages
/// name in backquotes, by its librdkafka name.
const FLAG_OF_SETTING: &[(&str, &str)] = &[
    (
        "`security.protocol`",
        "--kafka-security-protocol (IDEM_KAFKA_SECURITY_PROTOCOL)",
    ),
    (
        "`sasl.mechanism`",
        "--kafka-sasl-mechanism (IDEM_KAFKA_SASL_MECHANISM)",
    ),
    (
        "`sasl.username`",
        "--kafka-sasl-username (IDEM_KAFKA_SASL_USERNAME)",
    ),
    (
        "`sasl.password`",
        "--kafka-sasl-password-file (IDEM_KAFKA_SASL_PASSWORD or IDEM_KAFKA_SASL_PASSWORD_FILE)",
    ),
    ("`ssl.ca.location`", "--kafka-ssl-ca (IDEM_KAFKA_SSL_CA)"),
    (
        "`ssl.certificate.location`",
        "--kafka-ssl-cert (IDEM_KAFKA_SSL_CERT)",
    ),
    ("`ssl.key.location`", "--kafka-ssl-key (IDEM_KAFKA_SSL_KEY)"),
    (
        "`ssl.key.password`",
        "--kafka-ssl-key-password-file (IDEM_KAFKA_SSL_KEY_PASSWORD or IDEM_KAFKA_SSL_KEY_PASSWORD_FILE)",
    ),
    (
        "`sasl.oauthbearer.token.endpoint.url`",
        "--kafka-oauth-token-endpoint (IDEM_KAFKA_OAUTH_TOKEN_ENDPOINT)",
    ),
    (
        "`sasl.oauthbearer.client.id`",
        "--kafka-oauth-client-id (IDEM_KAFKA_OAUTH_CLIENT_ID)",
    ),
    (
        "`sasl.oauthbearer.client.secret`",
        "--kafka-oauth-client-secret-file (IDEM_KAFKA_OAUTH_CLIENT_SECRET or IDEM_KAFKA_OAUTH_CLIENT_SECRET_FILE)",
    ),
    ("`sasl.oauthbearer.*`", "--kafka-oauth-*"),
    ("`bootstrap.servers`", "--brokers"),
    ("the `brokers` argument", "--brokers"),
    (
        "through the security settings (`KafkaSecurity`)",
        "with its --kafka-* flag",
    ),
];

/// `message` with each Kafka setting it names replaced by the flag that sets it on this
/// command line: the library names settings, a person at a shell changes flags.
pub fn with_flag_names(message: &str) -> String {
    FLAG_OF_SETTING
        .iter()
        .fold(message.to_owned(), |m, (setting, flag)| {
            m.replace(setting, flag)
        })
}

/// Every `IDEM_KAFKA_…` environment variable these flags read: what a parent clears from a
/// child's environment before it gives the child [`child_env`].
pub fn env_names() -> Vec<String> {
    let cmd = <KafkaArgs as Args>::augment_args(clap::Command::new("kafka"));
    cmd.get_arguments()
        .filter_map(clap::Arg::get_env)
        .map(|e| e.to_string_lossy().into_owned())
        .collect()
}

/// The environment that gives a child process (`idem relay`, `idem-lab settlement`, …) the
/// Kafka security `security`: the `IDEM_KAFKA_…` variables of these flags, each secret written
/// to a file of its own (mode 0600) in `secret_dir` and named by its `…_FILE` variable, so that
/// no secret is on a command line or in an environment. The parent clears the child's inherited
/// variables ([`env_names`]) first: an inherited secret beside its file is refused as given
/// twice.
pub fn child_env(
    security: &KafkaSecurity,
    secret_dir: &Path,
) -> anyhow::Result<Vec<(&'static str, String)>> {
    let path = |p: &PathBuf| p.display().to_string();
    let mut env = vec![(
        "IDEM_KAFKA_SECURITY_PROTOCOL",
        security.protocol.to_string(),
    )];
    let mut secret = |var: &'static str, name: &str, s: &Secret| -> anyhow::Result<()> {
        let file = secret_dir.join(name);
        write_secret(&file, s.expose())?;
        env.push((var, file.display().to_string()));
        Ok(())
    };
    if let Some(p) = &security.password {
        secret("IDEM_KAFKA_SASL_PASSWORD_FILE", "kafka-sasl-password", p)?;
    }
    if let Some(p) = &security.key_password {
        secret(
            "IDEM_KAFKA_SSL_KEY_PASSWORD_FILE",
            "kafka-ssl-key-password",
            p,
        )?;
    }
    if let Some(o) = &security.oauth {
        secret(
            "IDEM_KAFKA_OAUTH_CLIENT_SECRET_FILE",
            "kafka-oauth-client-secret",
            &o.client_secret,
        )?;
        env.push(("IDEM_KAFKA_OAUTH_TOKEN_ENDPOINT", o.token_endpoint.clone()));
        env.push(("IDEM_KAFKA_OAUTH_CLIENT_ID", o.client_id.clone()));
        if let Some(scope) = &o.scope {
            env.push(("IDEM_KAFKA_OAUTH_SCOPE", scope.clone()));
        }
    }
    if let Some(m) = security.mechanism {
        env.push(("IDEM_KAFKA_SASL_MECHANISM", m.to_string()));
    }
    if let Some(u) = &security.username {
        env.push(("IDEM_KAFKA_SASL_USERNAME", u.clone()));
    }
    for (var, file) in [
        ("IDEM_KAFKA_SSL_CA", &security.ca_file),
        ("IDEM_KAFKA_SSL_CERT", &security.cert_file),
        ("IDEM_KAFKA_SSL_KEY", &security.key_file),
    ] {
        if let Some(f) = file {
            env.push((var, path(f)));
        }
    }
    Ok(env)
}

/// Writes `value` to a new file `path` that only its owner can read.
fn write_secret(path: &Path, value: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    f.write_all(value.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

/// The topic naming of `--topic-prefix` and `--topic AGGREGATE_TYPE=TOPIC`, refused at start
/// when Kafka cannot take a topic it names (the relay would otherwise start and park every event
/// of that aggregate type).
pub fn topic_naming(
    prefix: &str,
    topics: &[(String, String)],
) -> anyhow::Result<idem_core::wire::TopicNaming> {
    let naming = idem_core::wire::TopicNaming {
        prefix: prefix.to_owned(),
        overrides: topics.iter().cloned().collect(),
    };
    naming
        .validate()
        .map_err(|e| anyhow::anyhow!("--topic-prefix / --topic: {e}"))?;
    Ok(naming)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        kafka: KafkaArgs,
    }

    #[test]
    fn a_child_given_child_env_reads_the_same_security() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, "-----BEGIN CERTIFICATE-----\n").unwrap();
        let security = KafkaSecurity {
            protocol: SecurityProtocol::SaslSsl,
            mechanism: Some(SaslMechanism::ScramSha512),
            username: Some("idem_scram".to_owned()),
            password: Some(Secret::new("s3cret")),
            ca_file: Some(ca),
            ..KafkaSecurity::default()
        };
        let env = child_env(&security, dir.path()).unwrap();
        let names = env_names();
        for (var, value) in &env {
            assert!(
                names.iter().any(|n| n == var),
                "{var} is no flag's variable"
            );
            assert!(!value.contains("s3cret"), "{var} holds the secret");
        }
        // The variables as the flags they stand for: the child's reading of them.
        let flag = |var: &str| {
            format!(
                "--{}",
                var["IDEM_".len()..].to_ascii_lowercase().replace('_', "-")
            )
        };
        let argv = std::iter::once("idem".to_owned())
            .chain(env.iter().flat_map(|(k, v)| [flag(k), v.clone()]));
        let cli = Cli::try_parse_from(argv).unwrap();
        assert_eq!(cli.kafka.security().unwrap(), security);
    }

    #[test]
    fn the_settings_a_message_names_become_the_flags_that_set_them() {
        let m = with_flag_names(
            "SASL mechanism SCRAM-SHA-512 is set but the security protocol is PLAINTEXT, which \
             does not log in with SASL: set `security.protocol` to SASL_SSL, or drop \
             `sasl.mechanism`",
        );
        assert!(
            m.ends_with(
                "set --kafka-security-protocol (IDEM_KAFKA_SECURITY_PROTOCOL) to SASL_SSL, or \
                 drop --kafka-sasl-mechanism (IDEM_KAFKA_SASL_MECHANISM)"
            ),
            "{m}"
        );
        let every: String = FLAG_OF_SETTING
            .iter()
            .map(|(s, _)| format!("{s} "))
            .collect();
        let flags = with_flag_names(&every);
        assert!(!flags.contains('`'), "a setting left unnamed: {flags}");
        let cmd = <KafkaArgs as Args>::augment_args(clap::Command::new("kafka"));
        for (_, flag) in FLAG_OF_SETTING {
            let name = flag
                .split_whitespace()
                .find(|w| w.starts_with("--"))
                .unwrap_or_default();
            let name = name.trim_start_matches("--").trim_end_matches("-*");
            let known = name == "brokers"
                || cmd
                    .get_arguments()
                    .any(|a| a.get_long().is_some_and(|l| l.starts_with(name)));
            assert!(known, "{flag} is not a flag of this command line");
        }
    }
}
