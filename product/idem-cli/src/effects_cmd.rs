//! `idem effects dispatch | stuck | retry | resolve | compensate`: the effect dispatcher as its
//! own process, and the commands a person uses on parked and unknown intents.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;
use clap::{Args, Subcommand};
use idem_core::idempotency::{IntentStore, Resolution};
use idem_effects::{
    AppliedWhen, Dispatcher, DispatcherConfig, EffectMetrics, EffectPolicy, HttpCompensation,
    HttpStatusProbe, HttpTls,
};

use crate::DbArgs;
use crate::audit::Audited;
use crate::db;

/// How the remote of one effect is treated (remotes that do not store Idempotency-Key).
#[derive(Args, Debug, Clone)]
pub struct PolicyArgs {
    /// The effect (the name its intents are recorded under) these switches apply to: needed
    /// with any of them. Intents of other effects are delivered with the default policy.
    #[arg(long)]
    effect: Option<String>,
    /// The remote ignores Idempotency-Key: a sending mark is committed before every request,
    /// and after an ambiguous failure, or an attempt that died after its mark, nothing is
    /// re-sent without asking the status probe; without a probe the intent becomes `unknown`.
    #[arg(long, requires = "effect")]
    remote_ignores_keys: bool,
    /// Status probe URL template, asked before every re-attempt: `{key}`, `{event_id}` or a
    /// body field such as `{payment_id}`. Its answer: 200 with a non-empty JSON array →
    /// applied, `[]` or 404 → not applied, any other body → the intent becomes `unknown`
    /// (see `--probe-applied-pointer`).
    #[arg(long, requires = "effect")]
    probe_url: Option<String>,
    /// The probe's 200 answer is a JSON object: the JSON pointer (RFC 6901, e.g. `/awards`)
    /// whose value says whether the effect happened (`[]`, `{}`, `null`, `false`, `0`, `""` →
    /// not applied; any other value → applied; no value there → unknown).
    #[arg(long, requires = "probe_url")]
    probe_applied_pointer: Option<String>,
    /// Compensation URL template (same placeholders), POSTed with the intent's body by
    /// `idem effects compensate`.
    #[arg(long, requires = "effect")]
    compensate_url: Option<String>,
    /// Shortest wait before probing after an ambiguous attempt: longer than the remote's
    /// longest processing time.
    #[arg(long, default_value = "2s", value_parser = crate::util::parse_duration)]
    settle: Duration,
    #[command(flatten)]
    remote: RemoteArgs,
    /// Requests in flight at once. A claim takes at most the free slots, and the dispatcher
    /// claims again as soon as half of them are free: a slow request holds only its own slot
    /// (until the timeout), never the others.
    #[arg(long, default_value_t = default_concurrency(), value_parser = clap::value_parser!(u16).range(1..=1024))]
    concurrency: u16,
}

/// [`DispatcherConfig::default`]'s concurrency, as the flag reads it.
fn default_concurrency() -> u16 {
    u16::try_from(DispatcherConfig::default().concurrency).unwrap_or(u16::MAX)
}

/// A secret flag's value: its `Debug` never shows it.
#[derive(Clone)]
pub(crate) struct Secret(String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

fn secret(value: &str) -> Result<Secret, String> {
    if value.trim().is_empty() {
        return Err("the value is empty".to_owned());
    }
    Ok(Secret(value.to_owned()))
}

/// A secret read from `path`: its first line without the line ending. Errors name the file,
/// never its content.
fn read_secret_file(flag: &str, path: &Path) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        anyhow::anyhow!(
            "{flag} {}: cannot read it ({e}); check the path and that this process may read it",
            path.display()
        )
    })?;
    let value = text.strip_suffix('\n').unwrap_or(&text);
    let value = value.strip_suffix('\r').unwrap_or(value);
    if value.trim().is_empty() || value.contains('\n') {
        bail!(
            "{flag} {}: the file must hold the value on one line (it is empty or holds several \
             lines)",
            path.display()
        );
    }
    Ok(value.to_owned())
}

/// HTTPS to the remotes (the requests, the status probe and the compensation): the CA bundle
/// trusted besides the system's roots, and the client certificate for mutual TLS. The files
/// are read and checked at start; a TLS failure parks the intent with the reason.
#[derive(Args, Debug, Clone)]
pub(crate) struct TlsArgs {
    /// Trust the CA certificate(s) in this PEM file besides the system's roots (a remote
    /// whose certificate a private CA issued).
    #[arg(long, env = "IDEM_EFFECTS_CA_BUNDLE")]
    ca_bundle: Option<PathBuf>,
    /// Trust only `--ca-bundle`, not the system's roots.
    #[arg(long, env = "IDEM_EFFECTS_CA_BUNDLE_ONLY", requires = "ca_bundle")]
    ca_bundle_only: bool,
    /// Present this client certificate (PEM, the certificate first, then its
    /// intermediates) to remotes that require one; needs `--client-key`.
    #[arg(long, env = "IDEM_EFFECTS_CLIENT_CERT", requires = "client_key")]
    client_cert: Option<PathBuf>,
    /// The private key of `--client-cert` (PEM file; read at start, never logged).
    #[arg(long, env = "IDEM_EFFECTS_CLIENT_KEY", requires = "client_cert")]
    client_key: Option<PathBuf>,
}

impl TlsArgs {
    fn tls(&self) -> HttpTls {
        HttpTls {
            ca_bundle: self.ca_bundle.clone(),
            ca_bundle_only: self.ca_bundle_only,
            client_cert: self.client_cert.clone(),
            client_key: self.client_key.clone(),
        }
    }
}

/// `idem console`'s compensations: the flags of `idem effects compensate` that say how to
/// compensate one effect's intents from the Effects page.
#[derive(Args, Debug, Clone)]
pub(crate) struct CompensateArgs {
    /// The effect (the name its intents are recorded under) the Effects page can compensate
    /// with --compensate-url (alone, it offers nothing).
    #[arg(long)]
    effect: Option<String>,
    /// Compensation URL template (`{key}`, `{event_id}` or a body field such as
    /// `{payment_id}`), POSTed with the intent's body, as `idem effects compensate` does.
    #[arg(long, requires = "effect")]
    compensate_url: Option<String>,
    #[command(flatten)]
    remote: RemoteArgs,
}

/// How requests reach a remote: its `Authorization` header and HTTPS.
#[derive(Args, Debug, Clone)]
pub(crate) struct RemoteArgs {
    /// `Authorization` header sent to the remote (it scopes keys per client). A secret: prefer
    /// `--authorization-file` or the environment; its value is never shown or logged.
    #[arg(long, env = "IDEM_EFFECTS_AUTHORIZATION", hide_env_values = true, value_parser = secret)]
    authorization: Option<Secret>,
    /// Read the `Authorization` header from this file (one line; the trailing newline is
    /// dropped), as container platforms mount secrets.
    #[arg(
        long,
        env = "IDEM_EFFECTS_AUTHORIZATION_FILE",
        conflicts_with = "authorization"
    )]
    authorization_file: Option<PathBuf>,
    #[command(flatten)]
    tls: TlsArgs,
}

impl RemoteArgs {
    /// The `Authorization` header: the flag (or its variable), or the file's line.
    fn authorization(&self) -> anyhow::Result<Option<String>> {
        match (&self.authorization, &self.authorization_file) {
            (Some(Secret(v)), _) => Ok(Some(v.clone())),
            (None, Some(path)) => read_secret_file("--authorization-file", path).map(Some),
            (None, None) => Ok(None),
        }
    }
}

impl CompensateArgs {
    /// What the console's Effects page may run; `None` without `--effect`. The TLS files and
    /// the authorization are read and checked here, at start.
    pub(crate) fn compensations(&self) -> anyhow::Result<Option<idem_console::Compensations>> {
        let (Some(effect), Some(url)) = (&self.effect, &self.compensate_url) else {
            return Ok(None);
        };
        let authorization = self.remote.authorization()?;
        let tls = self.remote.tls.tls();
        tls.load()?;
        let policy = EffectPolicy {
            compensation: Some(Arc::new(HttpCompensation::new(
                url.clone(),
                authorization.clone(),
            ))),
            ..EffectPolicy::default()
        };
        Ok(Some(idem_console::Compensations {
            dispatcher: DispatcherConfig {
                authorization,
                tls,
                ..DispatcherConfig::default()
            },
            effects: vec![(effect.clone(), policy)],
        }))
    }
}

impl PolicyArgs {
    /// The `Authorization` header: the flag (or its variable), or the file's line.
    fn authorization(&self) -> anyhow::Result<Option<String>> {
        self.remote.authorization()
    }

    fn policy(&self, authorization: Option<&String>) -> EffectPolicy {
        EffectPolicy {
            remote_ignores_keys: self.remote_ignores_keys,
            probe: self.probe_url.as_ref().map(|u| {
                let rule = match &self.probe_applied_pointer {
                    Some(p) => AppliedWhen::Pointer(p.clone()),
                    None => AppliedWhen::NonEmptyArray,
                };
                Arc::new(HttpStatusProbe::new(u.clone(), authorization.cloned()).applied_when(rule))
                    as Arc<_>
            }),
            compensation: self.compensate_url.as_ref().map(|u| {
                Arc::new(HttpCompensation::new(u.clone(), authorization.cloned())) as Arc<_>
            }),
            settle: self.settle,
        }
    }
}

#[derive(Subcommand, Debug)]
pub enum EffectsCommand {
    /// Deliver effect intents until SIGTERM, the same Idempotency-Key on every attempt.
    Dispatch {
        #[command(flatten)]
        db: DbArgs,
        #[command(flatten)]
        policy: PolicyArgs,
        /// Per-request timeout.
        #[arg(long, default_value = crate::util::duration_text(DispatcherConfig::default().timeout), value_parser = crate::util::parse_duration)]
        timeout: Duration,
        /// Serve Prometheus metrics on this address.
        #[arg(long)]
        metrics_addr: Option<SocketAddr>,
    },
    /// List parked and unknown intents with their reasons.
    Stuck {
        #[command(flatten)]
        db: DbArgs,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Return parked and unknown intents to pending (same key).
    Retry {
        #[command(flatten)]
        db: DbArgs,
        /// Only these intent ids (repeatable); default all.
        #[arg(long = "id")]
        ids: Vec<i64>,
        /// Why (kept in the audit table with who ran it).
        #[arg(long, default_value = "sent again with idem effects retry")]
        reason: String,
    },
    /// Settle an unknown or parked intent after checking the remote yourself.
    Resolve {
        #[command(flatten)]
        db: DbArgs,
        /// The intent.
        #[arg(long)]
        id: i64,
        /// The effect happened: mark it done (never sent again).
        #[arg(
            long,
            conflicts_with = "not_applied",
            required_unless_present = "not_applied"
        )]
        applied: bool,
        /// The effect did not happen: send it again with the same key.
        #[arg(long)]
        not_applied: bool,
        /// Why (kept as the intent's reason).
        #[arg(long, default_value = "resolved by a person")]
        note: String,
    },
    /// Run the compensation of an unknown or parked intent, then park it for review (or send it
    /// again with `--retry`).
    Compensate {
        #[command(flatten)]
        db: DbArgs,
        #[command(flatten)]
        policy: PolicyArgs,
        /// The intent.
        #[arg(long)]
        id: i64,
        /// Send the effect again after compensating.
        #[arg(long)]
        retry: bool,
    },
}

impl EffectsCommand {
    fn db(&self) -> &DbArgs {
        match self {
            EffectsCommand::Dispatch { db, .. }
            | EffectsCommand::Stuck { db, .. }
            | EffectsCommand::Retry { db, .. }
            | EffectsCommand::Resolve { db, .. }
            | EffectsCommand::Compensate { db, .. } => db,
        }
    }
}

fn dispatcher<S: IntentStore>(
    store: S,
    policy: &PolicyArgs,
    timeout: Duration,
    registry: &prometheus::Registry,
) -> anyhow::Result<Dispatcher<S>> {
    let authorization = policy.authorization()?;
    // A probe and a request (2 × timeout) and the margin fit in the lease.
    let config = DispatcherConfig {
        timeout,
        lease: timeout.saturating_mul(3),
        lease_margin: timeout / 2,
        authorization: authorization.clone(),
        tls: policy.remote.tls.tls(),
        concurrency: usize::from(policy.concurrency),
        batch_size: u32::from(policy.concurrency).max(DispatcherConfig::default().batch_size),
        ..DispatcherConfig::default()
    };
    let dispatcher = Dispatcher::new(store, config, EffectMetrics::new(registry)?)?;
    Ok(match &policy.effect {
        Some(effect) => {
            dispatcher.with_policy(effect.clone(), policy.policy(authorization.as_ref()))
        }
        None => dispatcher,
    })
}

/// Runs `cmd`; what it changed, for the audit, when it changes rows.
async fn run_on<S: IntentStore>(store: S, cmd: EffectsCommand) -> anyhow::Result<Option<Audited>> {
    match cmd {
        EffectsCommand::Dispatch {
            policy,
            timeout,
            metrics_addr,
            ..
        } => {
            let registry = prometheus::Registry::new();
            // Ready while its database answers: the remotes are the intents' outcomes.
            let health = idem_core::health::Health::new();
            let d = dispatcher(store, &policy, timeout, &registry)?.with_health(health.clone());
            if let Some(addr) = metrics_addr {
                let bound =
                    crate::metrics_server::serve_with(addr, registry.clone(), health).await?;
                eprintln!(
                    "idem effects: metrics on http://{bound}/metrics (probes /healthz, /readyz)"
                );
            }
            if let Some(bundle) = &policy.remote.tls.ca_bundle {
                eprintln!(
                    "idem effects: HTTPS trusts the CA bundle {}{}",
                    bundle.display(),
                    if policy.remote.tls.ca_bundle_only {
                        " only"
                    } else {
                        " and the system's roots"
                    }
                );
            }
            if let Some(cert) = &policy.remote.tls.client_cert {
                eprintln!(
                    "idem effects: HTTPS presents the client certificate {}",
                    cert.display()
                );
            }
            eprintln!("idem effects: dispatching");
            // Claims while there is work; idle waits from 5 ms doubling to 200 ms.
            d.run(crate::util::shutdown_signal()?).await?;
            eprintln!("idem effects: stopped cleanly");
        }
        EffectsCommand::Stuck { json, .. } => {
            let rows = store.stuck(1000).await?;
            if json {
                println!("{}", serde_json::to_string(&rows)?);
            } else if rows.is_empty() {
                println!("no parked or unknown intents");
            }
            for r in rows.iter().filter(|_| !json) {
                println!(
                    "{}  {}  {}  {}  attempts={}  reason: {}",
                    r.id,
                    r.status,
                    r.effect,
                    r.key,
                    r.attempts,
                    r.reason.as_deref().unwrap_or_default()
                );
            }
        }
        cmd => return settle(store, cmd).await,
    }
    Ok(None)
}

/// `idem effects retry|resolve|compensate`: what they changed, for the audit.
async fn settle<S: IntentStore>(store: S, cmd: EffectsCommand) -> anyhow::Result<Option<Audited>> {
    match cmd {
        EffectsCommand::Retry { ids, reason, .. } => {
            let target = if ids.is_empty() {
                "every parked and unknown effect intent".to_owned()
            } else {
                format!("effect intents {ids:?}")
            };
            let ids = (!ids.is_empty()).then_some(ids.as_slice());
            let n = store.retry_stuck(ids).await?;
            println!("returned {n} intent(s) to pending");
            Ok(Some(Audited {
                action: "effects.retry",
                target,
                reason,
                affected: n,
                outcome: "done".to_owned(),
            }))
        }
        EffectsCommand::Resolve {
            id, applied, note, ..
        } => {
            let resolution = if applied {
                Resolution::Applied
            } else {
                Resolution::Pending
            };
            if !store.resolve(id, resolution, &note).await? {
                bail!("effect intent {id} does not exist or is neither parked nor unknown");
            }
            println!("intent {id} is now {}", resolution.status());
            Ok(Some(Audited {
                action: if applied {
                    "effects.applied"
                } else {
                    "effects.not_applied"
                },
                target: format!("effect intent {id}"),
                reason: note,
                affected: 1,
                outcome: "done".to_owned(),
            }))
        }
        EffectsCommand::Compensate {
            policy, id, retry, ..
        } => {
            if policy.compensate_url.is_none() {
                bail!("--compensate-url is required: it is the compensation to run");
            }
            let d = dispatcher(
                store,
                &policy,
                Duration::from_secs(10),
                &prometheus::Registry::new(),
            )?;
            let note = d.compensate(id, retry).await?;
            println!("intent {id}: {note}");
            Ok(Some(Audited {
                action: "effects.compensate",
                target: format!("effect intent {id}"),
                reason: "compensated with idem effects compensate".to_owned(),
                affected: 1,
                outcome: note,
            }))
        }
        _ => Ok(None),
    }
}

pub(crate) async fn run(cmd: EffectsCommand) -> anyhow::Result<()> {
    let args = cmd.db().clone();
    // The dispatcher is a service: it waits for a database it cannot reach yet.
    let store = match cmd {
        EffectsCommand::Dispatch { .. } => db::open_waiting(&args, 2).await?,
        _ => db::open(&args, 2).await?,
    };
    let done = idem_sql::with_store!(&store, s => run_on(s.intents(), cmd).await)?;
    if let Some(done) = done {
        crate::audit::record(&store, None, done).await;
    }
    Ok(())
}
