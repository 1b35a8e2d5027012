//! A pipeline run over a secured Kafka node (`[kafka] security = "sasl_ssl"`) and databases
//! whose URLs ask for TLS: the components log in with the placeholders the node defines
//! (`{kafka.user}`, `{kafka.password_file}`, `{tls.ca}`, …) and take their database passwords
//! the way libpq clients do (`PGPASSFILE` or `PGPASSWORD` in the runner's environment, which
//! they inherit), so no password is on a command line. While the faults run, every backend on
//! a database whose URL asks for TLS must be encrypted and of the URL's role; afterwards the
//! broker's log must name the SCRAM principal, and no log of the run may hold a password.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use idem_kafka::Secret;
use serde::Serialize;
use sqlx::postgres::{PgConnectOptions, PgPool, PgSslMode};

use super::file::SECURED_PLACEHOLDERS;
use super::secrets::{Backends, KafkaLogin, LogSearch, MECHANISM, search};

/// What a secured pipeline run reports.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub(crate) struct PipelineTls {
    /// How Kafka was reached: `SASL_SSL SCRAM-SHA-512 as <user>`.
    pub kafka: String,
    /// The broker's log names the SCRAM principal (`User:<user>`).
    pub scram_principal_logged: bool,
    /// The components' backends on the databases whose URL asks for TLS (the runner's own
    /// sessions left out), summed over the samples taken every 2 s while the faults ran; none
    /// when no URL asks for it.
    pub pg_backends: Option<Backends>,
    /// Every log of the run searched for every password of the run.
    pub secret_search: LogSearch,
}

/// The placeholders of a secured node ([`SECURED_PLACEHOLDERS`], in its order), filled in.
pub(super) fn places(login: &KafkaLogin) -> BTreeMap<String, String> {
    let path = |p: &Path| p.display().to_string();
    let values: [String; SECURED_PLACEHOLDERS.len()] = [
        login.user.clone(),
        path(&login.password_file),
        MECHANISM.as_str().to_owned(),
        path(&login.ca),
        path(&login.cert),
        path(&login.key),
    ];
    SECURED_PLACEHOLDERS
        .iter()
        .map(|k| (*k).to_owned())
        .zip(values)
        .collect()
}

/// The databases whose URL asks for TLS, each watched through one session of the runner's.
pub(super) struct BackendWatch {
    watched: Vec<(PgPool, String)>,
    seen: Backends,
    next: Instant,
}

impl BackendWatch {
    /// Connects to every PostgreSQL database of `databases` whose URL has `sslmode=require`,
    /// `verify-ca` or `verify-full`; refuses a PostgreSQL URL it cannot read (its TLS would go
    /// unchecked).
    pub(super) async fn open(databases: &BTreeMap<String, String>) -> anyhow::Result<Self> {
        let mut watched = vec![];
        for (name, url) in databases {
            if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
                continue;
            }
            let options = url
                .parse::<PgConnectOptions>()
                .with_context(|| format!("reading the URL of database {name}"))?;
            let asks = matches!(
                options.get_ssl_mode(),
                PgSslMode::Require | PgSslMode::VerifyCa | PgSslMode::VerifyFull
            );
            if asks {
                let user = options.get_username().to_owned();
                let pool = super::postgres::runner_pool(url, 1)
                    .await
                    .with_context(|| format!("connecting to database {name}"))?;
                watched.push((pool, user));
            }
        }
        Ok(Self {
            watched,
            seen: Backends::default(),
            next: Instant::now(),
        })
    }

    /// Samples the backends when a sample is due (every 2 s); a database that does not
    /// answer now (crashed, cut off) is sampled next time.
    pub(super) async fn tick(&mut self, now: Instant) {
        if now < self.next {
            return;
        }
        self.next = now + Duration::from_secs(2);
        // The runner's own sessions (this one, the burst's, the locks', the foreign
        // writer's) are left out: a backend seen is a component's.
        let sql = "SELECT count(*)::bigint, \
                          count(*) FILTER (WHERE s.ssl IS NOT TRUE)::bigint, \
                          count(*) FILTER (WHERE a.usename IS DISTINCT FROM $1)::bigint \
                   FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
                   WHERE a.datname = current_database() \
                     AND a.application_name IS DISTINCT FROM $2";
        for (pool, user) in &self.watched {
            let Ok((all, clear, other)) = sqlx::query_as::<_, (i64, i64, i64)>(sql)
                .bind(user)
                .bind(super::postgres::RUNNER)
                .fetch_one(pool)
                .await
            else {
                continue;
            };
            let count = |n: i64| u64::try_from(n).unwrap_or(0);
            self.seen.all += count(all);
            self.seen.in_clear += count(clear);
            self.seen.other_roles += count(other);
        }
    }

    /// What the samples saw; none when no database was watched.
    pub(super) fn seen(&self) -> Option<Backends> {
        (!self.watched.is_empty()).then_some(self.seen)
    }
}

/// The database passwords of the run: those in the URLs, `PGPASSWORD`, and every line's of
/// the password file (`PGPASSFILE`, else `~/.pgpass`, as libpq reads it).
pub(super) fn database_secrets(databases: &BTreeMap<String, String>) -> Vec<Secret> {
    let mut out: Vec<Secret> = databases
        .values()
        .filter_map(|url| url_password(url).map(Secret::new))
        .collect();
    out.extend(std::env::var("PGPASSWORD").ok().map(Secret::new));
    let passfile = std::env::var_os("PGPASSFILE")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".pgpass")));
    if let Some(text) = passfile.and_then(|f| std::fs::read_to_string(f).ok()) {
        out.extend(text.lines().filter_map(passfile_password).map(Secret::new));
    }
    out
}

/// The password a URL holds (`scheme://user:PASSWORD@host…`), as written.
fn url_password(url: &str) -> Option<String> {
    let start = url.find("://")? + 3;
    let at = start + url[start..].rfind('@')?;
    let (_, password) = url[start..at].split_once(':')?;
    (!password.is_empty()).then(|| password.to_owned())
}

/// The password of a `.pgpass` line (`host:port:database:user:password`), read as libpq reads
/// it: after the fourth unescaped `:`, up to the next one, `\` escaping the character after
/// it; none for a comment or a line of fewer fields.
fn passfile_password(line: &str) -> Option<String> {
    if line.starts_with('#') {
        return None;
    }
    let mut chars = line.chars();
    let mut colons = 0;
    while colons < 4 {
        match chars.next()? {
            '\\' => {
                chars.next()?;
            }
            ':' => colons += 1,
            _ => {}
        }
    }
    let mut password = String::new();
    while let Some(c) = chars.next() {
        match c {
            '\\' => password.extend(chars.next()),
            ':' => break,
            c => password.push(c),
        }
    }
    (!password.is_empty()).then_some(password)
}

/// The report of a secured run whose logs are in `dir`.
pub(super) fn report(
    login: &KafkaLogin,
    backends: Option<Backends>,
    dir: &Path,
    database_secrets: &[Secret],
) -> PipelineTls {
    let mut secrets = login.secrets.clone();
    secrets.extend(database_secrets.iter().cloned());
    PipelineTls {
        kafka: login.described(),
        scram_principal_logged: login.principal_logged(),
        pg_backends: backends,
        secret_search: search(dir, &secrets),
    }
}

/// Why a secured run's connections or logs fail it; none: secured as it should be.
pub(super) fn shortfalls(tls: &PipelineTls) -> Vec<String> {
    let mut out = vec![];
    if let Some(b) = tls.pg_backends {
        if b.all == 0 {
            out.push(
                "no component's backend on a database whose URL asks for TLS was seen".to_owned(),
            );
        }
        if b.in_clear > 0 {
            out.push(format!(
                "{} PostgreSQL backend(s) in clear on a database whose URL asks for TLS",
                b.in_clear
            ));
        }
        if b.other_roles > 0 {
            out.push(format!(
                "{} PostgreSQL backend(s) not of the role its database's URL names",
                b.other_roles
            ));
        }
    }
    if !tls.scram_principal_logged {
        out.push("the broker's log never names the SCRAM principal".to_owned());
    }
    if let Some(first) = tls.secret_search.hits.first() {
        out.push(format!(
            "a password of the run in the logs: {} line(s), first at {first}",
            tls.secret_search.hits.len()
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_urls_password_is_found_as_written() {
        assert_eq!(
            url_password("postgres://u:s3cret@h:5/db?sslmode=verify-full"),
            Some("s3cret".to_owned())
        );
        assert_eq!(
            url_password("postgres://u:a@b@h/db"),
            Some("a@b".to_owned())
        );
        assert_eq!(url_password("postgres://u@h/db"), None);
        assert_eq!(url_password("sqlite://ledger.db"), None);
    }

    #[test]
    fn a_passfile_line_gives_its_fifth_field_unescaped() {
        assert_eq!(
            passfile_password("127.0.0.1:*:*:idem_tls:s3cr\\\\et\\:x:ignored"),
            Some("s3cr\\et:x".to_owned())
        );
        assert_eq!(
            passfile_password("h\\:x:5432:db:u:pw"),
            Some("pw".to_owned())
        );
        assert_eq!(
            passfile_password("h:5432:db:u:p\\:w"),
            Some("p:w".to_owned())
        );
        assert_eq!(passfile_password("# h:5432:db:u:p"), None);
        assert_eq!(passfile_password("h:5432:db:u"), None);
        assert_eq!(passfile_password("h:5432:db:u:"), None);
    }

    #[test]
    fn a_secured_run_fails_on_clear_backends_a_missing_principal_or_a_hit() {
        let clean = PipelineTls {
            kafka: "SASL_SSL SCRAM-SHA-512 as u".to_owned(),
            scram_principal_logged: true,
            pg_backends: Some(Backends {
                all: 10,
                in_clear: 0,
                other_roles: 0,
            }),
            secret_search: LogSearch::default(),
        };
        assert_eq!(shortfalls(&clean), Vec::<String>::new());
        let none_watched = PipelineTls {
            pg_backends: None,
            ..clean.clone()
        };
        assert_eq!(shortfalls(&none_watched), Vec::<String>::new());
        let bad = PipelineTls {
            scram_principal_logged: false,
            pg_backends: Some(Backends {
                all: 0,
                in_clear: 1,
                other_roles: 2,
            }),
            secret_search: LogSearch {
                hits: vec!["relay-0.log:3".to_owned()],
                ..LogSearch::default()
            },
            ..clean
        };
        assert_eq!(shortfalls(&bad).len(), 5, "{:?}", shortfalls(&bad));
    }
}
