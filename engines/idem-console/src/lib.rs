//! The operator console of an idem pipeline: `idem console`, or the same [`axum::Router`]
//! mounted in a service ([`Console::router`]).
//!
//! * **Pages**: the overview (each stage with its backlog, rate, oldest age and a health colour
//!   by the rules of `deploy/prometheus/idem-alerts.yml`, a rate chart of the last hour, the
//!   last verdict of `idem verify`), the outbox, the consumers and their dead letters, the
//!   effects, the proof and the audit. Lists are paged and filtered on the server; every count
//!   is bounded (at 100 000) and the overview reads the console's own samples, so a page
//!   costs the same over any table size.
//! * **Actions** (none with [`ConsoleConfig::read_only`], and none without a token): return
//!   parked outbox rows to pending, request dead-letter replays (served by the group's running
//!   consumer through its own handler, after a dry run), retry, resolve or compensate an
//!   effect intent, run the verification. Each needs a session opened with the token, carries the session's CSRF
//!   token, and is written to the audit table (who, when, what, why, how many rows).
//! * **Safety**: the console reads through its own pool (give it its own: [`Console::new`]
//!   takes any store, `idem console` opens one with a statement timeout), so a slow console
//!   never holds the pipeline's connections; database URLs and the token are never rendered.

mod auth;
mod chart;
mod health;
mod pages;
mod sample;
mod scrape;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use idem_sql::AnyStore;

pub use auth::Token;

use crate::auth::{Session, Sessions};
use crate::sample::History;

/// Runs `$body` with `$o` bound to the [`idem_sql::ops::Ops`] of an [`AnyStore`].
macro_rules! ops {
    ($store:expr, $o:ident => $body:expr) => {
        idem_sql::with_store!($store, s => { let $o = s.ops(); $body })
    };
}
pub(crate) use ops;

/// What the console shows and allows.
#[derive(Clone, Debug)]
pub struct ConsoleConfig {
    /// The operators' token. Without one the console is read-only.
    pub token: Option<Token>,
    /// Show no action at all, whoever is logged in.
    pub read_only: bool,
    /// The checks the Proof page runs (the file `idem verify` reads, parsed).
    pub verify: Option<idem_verify::VerifyConfig>,
    /// The Kafka cluster, to show each group's committed offsets and lag.
    pub kafka: Option<idem_kafka::Connection>,
    /// The topics whose lag is read (empty: every topic of the cluster, at most 50).
    pub topics: Vec<String>,
    /// The services' metrics endpoints (`http://host:port/metrics`), for what only they know:
    /// a stalled consumer, its retries.
    pub metrics_urls: Vec<String>,
    /// How often the console samples (the rate charts' step).
    pub sample_every: Duration,
    /// The compensations the Effects page offers (none: it offers none).
    pub compensations: Option<Compensations>,
}

/// The compensations the Effects page can run on an unknown or parked intent, as
/// `idem effects compensate` runs them: each effect's policy (its compensation) and the
/// dispatcher settings the requests go out with (the `Authorization` header, HTTPS, the
/// timeout). An intent whose effect has a compensation gets two more choices in its settle
/// form: compensate then park it for review, or compensate then send it again.
#[derive(Clone, Debug)]
pub struct Compensations {
    /// The requests' settings.
    pub dispatcher: idem_effects::DispatcherConfig,
    /// Each effect's policy; only those with a compensation are offered.
    pub effects: Vec<(String, idem_effects::EffectPolicy)>,
}

impl Compensations {
    /// Whether intents of `effect` can be compensated.
    pub fn offers(&self, effect: &str) -> bool {
        self.effects
            .iter()
            .any(|(name, p)| name == effect && p.compensation.is_some())
    }
}

impl Default for ConsoleConfig {
    /// Read-only, no broker, no endpoints, no compensation, a sample every 10 s.
    fn default() -> Self {
        ConsoleConfig {
            token: None,
            read_only: true,
            verify: None,
            kafka: None,
            topics: vec![],
            metrics_urls: vec![],
            sample_every: Duration::from_secs(10),
            compensations: None,
        }
    }
}

impl ConsoleConfig {
    /// Whether actions are offered: a token, and not read-only.
    pub fn actions(&self) -> bool {
        self.token.is_some() && !self.read_only
    }
}

/// A database whose idem tables the console shows: a service's (its outbox), a consumer's (its
/// inbox, dead letters and effect intents), or one holding both.
#[derive(Clone, Debug)]
pub struct Database {
    /// Its name on the pages (`orders`, `settlement`).
    pub name: String,
    /// Its store; give the console a pool of its own.
    pub store: AnyStore,
}

/// The console over a pipeline's databases.
#[derive(Clone, Debug)]
pub struct Console {
    state: Arc<Shared>,
}

/// What every handler shares.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) databases: Vec<Database>,
    pub(crate) config: ConsoleConfig,
    pub(crate) sessions: Sessions,
    pub(crate) history: Mutex<History>,
    pub(crate) proof: Mutex<pages::proof::ProofState>,
}

/// The span of the rate charts.
const SPAN: Duration = Duration::from_secs(3600);

impl Console {
    /// A console over `databases` (give each a pool of its own: the pages then never wait for
    /// the pipeline's connections, nor the pipeline for theirs). Names must differ.
    pub fn new(databases: Vec<Database>, config: ConsoleConfig) -> Console {
        Console {
            state: Arc::new(Shared {
                databases,
                config,
                sessions: Sessions::default(),
                history: Mutex::new(History::new(SPAN)),
                proof: Mutex::default(),
            }),
        }
    }

    /// The pages and, unless read-only, the actions.
    pub fn router(&self) -> Router {
        let mut pages = Router::new()
            .route("/", get(pages::overview::page))
            .route("/outbox", get(pages::outbox::page))
            .route("/consumers", get(pages::consumers::page))
            .route("/consumers/letters", get(pages::consumers::letters))
            .route("/effects", get(pages::effects::page))
            .route("/proof", get(pages::proof::page))
            .route("/audit", get(pages::audit::page));
        if self.state.config.actions() {
            pages = pages
                .route("/outbox/retry", post(pages::outbox::retry))
                .route("/consumers/replay", get(pages::consumers::dry_run))
                .route("/consumers/replay", post(pages::consumers::replay))
                .route("/effects/retry", post(pages::effects::retry))
                .route("/effects/resolve", post(pages::effects::resolve))
                .route("/proof/run", post(pages::proof::run))
                .route("/logout", post(pages::login::logout));
        }
        let pages = pages.layer(axum::middleware::from_fn_with_state(
            self.state.clone(),
            require_login,
        ));
        Router::new()
            .route("/login", get(pages::login::form).post(pages::login::login))
            .merge(pages)
            .layer(axum::middleware::from_fn(security_headers))
            .with_state(self.state.clone())
    }

    /// Takes one sample now (the sampler does it every [`ConsoleConfig::sample_every`]).
    pub async fn sample(&self) {
        let s = sample::take(&self.state).await;
        self.state
            .history
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(s);
    }

    /// Runs the verification of [`ConsoleConfig::verify`] now and waits for its verdict (the
    /// Proof page's button starts one without waiting).
    pub async fn verify_now(&self) {
        pages::proof::verify_now(&self.state).await;
    }

    /// Samples every [`ConsoleConfig::sample_every`] until the returned task is aborted.
    pub fn spawn_sampler(&self) -> tokio::task::JoinHandle<()> {
        let console = self.clone();
        tokio::spawn(async move {
            loop {
                console.sample().await;
                tokio::time::sleep(console.state.config.sample_every).await;
            }
        })
    }
}

impl Shared {
    /// The database named `name`; without a name, the first for which `prefer` holds in the
    /// newest sample (the first database when none does).
    pub(crate) fn database(
        &self,
        name: Option<&str>,
        prefer: impl Fn(&sample::DbSample) -> bool,
    ) -> Option<&Database> {
        if let Some(name) = name {
            return self.databases.iter().find(|d| d.name == name);
        }
        let h = self.history.lock().unwrap_or_else(|p| p.into_inner());
        let preferred = h
            .latest()
            .and_then(|s| s.dbs.iter().find(|d| prefer(d)))
            .map(|d| d.name.clone());
        drop(h);
        preferred
            .and_then(|p| self.databases.iter().find(|d| d.name == p))
            .or_else(|| self.databases.first())
    }
}

/// Refuses a metrics endpoint the console cannot read (only `http://host:port[/path]`).
pub fn check_metrics_url(url: &str) -> Result<(), String> {
    scrape::split(url).map(|_| ())
}

/// The session of a request, if its cookie names an open one.
pub(crate) fn session_of(state: &Shared, headers: &axum::http::HeaderMap) -> Option<Session> {
    let cookies = headers.get(header::COOKIE)?.to_str().ok()?;
    state.sessions.get(auth::cookie(cookies)?)
}

/// With a token set, every page needs a session: they show payloads and reasons, which are
/// the business's data. Without one the console is read-only and open (it listens on loopback
/// unless told otherwise).
async fn require_login(State(state): State<Arc<Shared>>, mut req: Request, next: Next) -> Response {
    let session = session_of(&state, req.headers());
    if state.config.token.is_some() && session.is_none() {
        return Redirect::to("/login").into_response();
    }
    if let Some(s) = session {
        req.extensions_mut().insert(s);
    }
    next.run(req).await
}

/// No page is framed, cached, or allowed a script; forms post only here.
async fn security_headers(req: Request, next: Next) -> Response {
    let mut res = next.run(req).await;
    let h = res.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    // `same-origin`, not `no-referrer`: under `no-referrer` a browser sends `Origin: null` with
    // a form, and the actions' origin check could not tell the console from a sandboxed frame.
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    res
}
