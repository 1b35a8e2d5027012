//! The proof: `idem verify` run on demand with the console's verify config, its verdict, and
//! every lost event with the stage where it stopped, linked to where that stage is shown.

use std::sync::Arc;
use std::time::Instant;

use axum::Extension;
use axum::extract::{Form, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use idem_sql::ops::Action;
use idem_verify::report::{Loss, Stage};
use idem_verify::{Options, Report};
use maud::{Markup, html};

use super::{Nav, Viewer, age, layout, table};
use crate::Shared;
use crate::auth::Session;

/// The last verification, and whether one runs.
#[derive(Debug, Default)]
pub(crate) struct ProofState {
    running: bool,
    last: Option<(f64, Instant, Result<Report, String>)>,
}

impl ProofState {
    /// Violations the last finished run found; `None` before one (or after a failed one).
    pub(crate) fn violations(&self) -> Option<u64> {
        match &self.last {
            Some((_, _, Ok(r))) => Some(violations(r)),
            _ => None,
        }
    }
}

/// Every violation of a report: each check's, the keys held more than once, and the rows that
/// must not exist.
fn violations(r: &Report) -> u64 {
    let checks: u64 = r.checks.iter().map(|c| c.total().violations()).sum();
    checks + r.unique.iter().map(|u| u.duplicated_keys).sum::<u64>() + r.invariant_violations()
}

/// `GET /proof`.
pub(crate) async fn page(
    State(state): State<Arc<Shared>>,
    session: Option<Extension<Session>>,
) -> Response {
    let viewer = Viewer::new(&state, session.map(|Extension(s)| s));
    let body = {
        let proof = state.proof.lock().unwrap_or_else(|p| p.into_inner());
        html! {
            @if state.config.verify.is_none() {
                p.muted { "The console was given no verify config (the checks idem verify runs): there is nothing to run." }
            } @else {
                @if proof.running { p role="status" { "A verification is running; reload to see its verdict." } }
                @else if viewer.actions {
                    form.inline method="post" action="/proof/run" {
                        (viewer.csrf())
                        button.primary type="submit" { "Verify now" }
                    }
                }
            }
            @match &proof.last {
                None => p.muted { "Not verified since the console started." },
                Some((_, at, Err(e))) => p.error { "The verification ran " (age(at.elapsed().as_secs_f64())) " ago and could not finish: " (e) },
                Some((_, at, Ok(r))) => (verdict(r, at.elapsed().as_secs_f64())),
            }
        }
    };
    layout("Proof", Nav::Proof, &viewer, body).into_response()
}

fn verdict(r: &Report, ago: f64) -> Markup {
    let n = violations(r);
    html! {
        p { "Verified " (age(ago)) " ago: "
            @if n == 0 { strong.done { "clean" } } @else { strong.error { (n) " violation(s)" } } "." }
        (table(&["check", "#source rows", "#target rows", "#lost", "#duplicate effects", "#other violations"], html! {
            @for c in &r.checks {
                @let t = c.total();
                tr { td { (c.name) } td.num { (t.source_rows) } td.num { (t.target_rows) } td.num { (t.missing) }
                     td.num { (t.duplicate_effects) }
                     td.num { (t.violations() - t.missing - t.duplicate_effects) } }
            }
            @for u in &r.unique {
                tr { td { (u.name) } td.num { (u.rows) } td.num { "—" } td.num { "—" } td.num { (u.duplicated_keys) } td.num { "—" } }
            }
            @for e in &r.empty {
                tr { td { (e.name) } td.num { (e.rows) } td.num { "—" } td.num { "—" } td.num { "—" } td.num { (e.rows) } }
            }
        }))
        @for e in r.empty.iter().filter(|e| !e.keys.is_empty()) {
            h2 { "Rows that must not exist in " (e.name) }
            ul { @for k in &e.keys { li.mono { (k) } } }
        }
        @for c in r.checks.iter().filter(|c| !c.losses.is_empty()) {
            h2 { "Lost in " (c.name) }
            (table(&["key", "event", "stopped at", "why", ""], html! {
                @for l in &c.losses {
                    tr { td.mono { (l.key) } td.mono { (l.event_id.clone().unwrap_or_default()) }
                         td { (l.stage.describe()) } td { (l.detail.clone().unwrap_or_default()) }
                         td { @if let Some(href) = where_shown(l) { a href=(href) { "look" } } } }
                }
            }))
        }
        @for c in r.checks.iter().filter(|c| !c.duplicates.is_empty()) {
            h2 { "Duplicate effects in " (c.name) }
            (table(&["key", "#rows"], html! { @for d in &c.duplicates { tr { td.mono { (d.key) } td.num { (d.rows) } } } }))
        }
    }
}

/// The page that shows the stage a lost event stopped at.
fn where_shown(l: &Loss) -> Option<&'static str> {
    match l.stage {
        Stage::PendingInOutbox | Stage::ParkedInOutbox => Some("/outbox"),
        Stage::PublishedButNotProcessed | Stage::DeadLettered => Some("/consumers"),
        Stage::EffectPending | Stage::EffectParked | Stage::EffectUnknown => Some("/effects"),
        _ => None,
    }
}

/// The run form's field.
#[derive(serde::Deserialize)]
pub(crate) struct Run {
    #[serde(default)]
    csrf: String,
}

/// `POST /proof/run`: starts a verification (one at a time) and returns to the page.
pub(crate) async fn run(
    State(state): State<Arc<Shared>>,
    session: Option<Extension<Session>>,
    headers: HeaderMap,
    Form(f): Form<Run>,
) -> Response {
    let act = match super::act(&state, session, &headers, &f.csrf, None) {
        Ok(a) => a,
        Err(r) => return *r,
    };
    let Some(config) = state.config.verify.clone() else {
        return super::error(
            StatusCode::NOT_FOUND,
            "the console was given no verify config",
        );
    };
    {
        let mut proof = state.proof.lock().unwrap_or_else(|p| p.into_inner());
        if proof.running {
            return axum::response::Redirect::to("/proof").into_response();
        }
        proof.running = true;
    }
    let actor = act.actor;
    let action = Action {
        actor: &actor,
        action: "proof.verify",
        target: "the verify config",
        reason: "on demand",
        affected: 0,
        outcome: "started",
    };
    // The audit of a verification goes to the first database (it acts on none).
    if let Some(db) = state.databases.first() {
        super::record(db, action).await;
    }
    let shared = state.clone();
    tokio::spawn(async move {
        let report = idem_verify::verify(&config, &Options::default())
            .await
            .map_err(|e| e.to_string());
        let mut proof = shared.proof.lock().unwrap_or_else(|p| p.into_inner());
        proof.running = false;
        proof.last = Some((crate::sample::now(), Instant::now(), report));
    });
    axum::response::Redirect::to("/proof").into_response()
}

/// Runs the verification now and waits for it ([`crate::Console::verify_now`]).
pub(crate) async fn verify_now(state: &Shared) {
    let Some(config) = state.config.verify.clone() else {
        return;
    };
    let report = idem_verify::verify(&config, &Options::default())
        .await
        .map_err(|e| e.to_string());
    let mut proof = state.proof.lock().unwrap_or_else(|p| p.into_inner());
    proof.last = Some((crate::sample::now(), Instant::now(), report));
}
