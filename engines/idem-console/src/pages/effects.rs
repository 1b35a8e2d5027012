//! The effects: intents by status, the parked and unknown ones with their attempts and the
//! remote's last answer; and settling them — send again with the same key, mark done (or not
//! applied) after checking the remote, or run the effect's compensation.

use std::sync::Arc;

use axum::Extension;
use axum::extract::{Form, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use idem_core::idempotency::{IntentStore, Resolution};
use idem_effects::{CompensateError, Dispatcher, EffectMetrics};
use idem_sql::ops::{Action, IntentRow};
use maud::{Markup, html};

use super::overview::{latest, urlencode};
use super::{Nav, PAGE, Viewer, count, layout, next_page, table};
use crate::auth::Session;
use crate::sample::DbSample;
use crate::{Compensations, Database, Shared, ops};

/// `?status=parked|unknown&after=…`.
#[derive(serde::Deserialize)]
pub(crate) struct Filter {
    db: Option<String>,
    status: Option<String>,
    after: Option<i64>,
}

/// `GET /effects`.
pub(crate) async fn page(
    State(state): State<Arc<Shared>>,
    session: Option<Extension<Session>>,
    Query(f): Query<Filter>,
) -> Response {
    let viewer = Viewer::new(&state, session.map(|Extension(s)| s));
    let status = f
        .status
        .as_deref()
        .filter(|s| ["parked", "unknown"].contains(s));
    let (s, _) = latest(&state).await;
    let db = match super::pick(&state, f.db.as_deref(), DbSample::has_intents) {
        Ok(db) => db,
        Err(r) => return *r,
    };
    let part = s
        .dbs
        .iter()
        .find(|d| d.name == db.name)
        .cloned()
        .unwrap_or_default();
    let rows = match ops!(&db.store, o => o.intent_rows(f.after.unwrap_or(0), status, PAGE).await) {
        Ok(r) => r,
        Err(e) => {
            return super::error(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("reading the effect intents failed: {e}"),
            );
        }
    };
    let here = format!("/effects?db={}", urlencode(&db.name));
    let base = status.map_or_else(|| here.clone(), |s| format!("{here}&status={s}"));
    let body = html! {
        (super::databases(&state, &db.name, "/effects"))
        @if let Some(c) = &part.intents {
            p { (count(c.pending)) " pending, " (count(c.unknown)) " of unknown outcome, " (count(c.parked)) " parked." }
        }
        p { "Show: " a href=(here) { "parked and unknown" } " · " a href=(format!("{here}&status=unknown")) { "unknown" }
            " · " a href=(format!("{here}&status=parked")) { "parked" } }
        (intent_table(&viewer, &db.name, state.config.compensations.as_ref(), &rows))
        (next_page(&base, rows.len(), rows.last().map(|r| r.id)))
    };
    layout("Effects", Nav::Effects, &viewer, body).into_response()
}

fn intent_table(
    viewer: &Viewer,
    db: &str,
    compensations: Option<&Compensations>,
    rows: &[IntentRow],
) -> Markup {
    if rows.is_empty() {
        return html! { p.muted { "No parked or unknown effect." } };
    }
    table(
        &[
            "#id",
            "effect",
            "status",
            "#attempts",
            "remote's answer",
            "why",
            "changed",
            "",
        ],
        html! {
            @for i in rows {
                tr id=(format!("intent-{}", i.id)) {
                    td.num { (i.id) }
                    td { (i.effect) br; span.mono.muted { (i.target) } br; span.mono.muted { "key " (i.key) } }
                    td { (i.status) }
                    td.num { (i.attempts) }
                    td.mono { @if let Some(s) = i.response_status { "HTTP " (s) " " } (i.response) }
                    td { (i.reason) }
                    td.mono.time { (super::when(&i.updated_at)) }
                    td { @if viewer.actions {
                        (forms(viewer, db, i.id, compensations.is_some_and(|c| c.offers(&i.effect))))
                    } }
                }
            }
        },
    )
}

fn forms(viewer: &Viewer, db: &str, id: i64, compensable: bool) -> Markup {
    html! {
        form.inline method="post" action="/effects/resolve" {
            (viewer.csrf())
            input type="hidden" name="db" value=(db);
            input type="hidden" name="id" value=(id);
            input type="text" name="why" placeholder="why" required maxlength="500" aria-label="why";
            select name="resolution" aria-label="resolution" {
                option value="retry" { "send again (same key)" }
                option value="applied" { "it happened: mark done" }
                option value="not_applied" { "it did not happen: send again" }
                @if compensable {
                    option value="compensate" { "compensate, then park for review" }
                    option value="compensate_retry" { "compensate, then send again" }
                }
            }
            button type="submit" { "settle" }
        }
    }
}

/// The settle form's fields.
#[derive(serde::Deserialize)]
pub(crate) struct Settle {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    why: String,
    db: Option<String>,
    id: i64,
    resolution: String,
}

/// `POST /effects/retry`: the same as `resolve` with `resolution=retry`.
pub(crate) async fn retry(
    state: State<Arc<Shared>>,
    session: Option<Extension<Session>>,
    headers: HeaderMap,
    Form(mut f): Form<Settle>,
) -> Response {
    "retry".clone_into(&mut f.resolution);
    resolve(state, session, headers, Form(f)).await
}

/// `POST /effects/resolve`: sends a parked or unknown intent again (same key), or settles it
/// as applied or not applied after a person checked the remote.
pub(crate) async fn resolve(
    State(state): State<Arc<Shared>>,
    session: Option<Extension<Session>>,
    headers: HeaderMap,
    Form(f): Form<Settle>,
) -> Response {
    let act = match super::act(&state, session, &headers, &f.csrf, Some(&f.why)) {
        Ok(a) => a,
        Err(r) => return *r,
    };
    let super::Act { viewer, actor, why } = act;
    let db = match super::pick(&state, f.db.as_deref(), DbSample::has_intents) {
        Ok(db) => db,
        Err(r) => return *r,
    };
    let note = format!("{why} (by {actor}, in the console)");
    let Some(settled) = settle(&state, db, f.id, &f.resolution, &note).await else {
        return super::error(
            StatusCode::BAD_REQUEST,
            "resolution is retry, applied, not_applied, compensate or compensate_retry",
        );
    };
    let (affected, outcome) = match settled {
        Ok(Some(outcome)) => (1, outcome),
        Ok(None) => (
            0,
            "refused: the intent does not exist or is neither parked nor unknown".to_owned(),
        ),
        Err(e) => (0, format!("failed: {e}")),
    };
    let id = f.id;
    let target = format!("{}: effect intent {id}", db.name);
    let action = Action {
        actor: &actor,
        action: &format!("effects.{}", f.resolution),
        target: &target,
        reason: &why,
        affected,
        outcome: &outcome,
    };
    super::record(db, action).await;
    if affected == 0 {
        return super::error(
            StatusCode::CONFLICT,
            &format!("effect intent {id}: {outcome}"),
        );
    }
    super::done(
        &viewer,
        "Effects",
        &format!("effect intent {id}: {}", f.resolution.replace('_', " ")),
        "/effects",
    )
}

/// Settles intent `id` as `resolution` says: `None` for an unknown resolution; otherwise what
/// happened — the audit's outcome when the intent changed, `Ok(None)` when it does not exist or is
/// neither parked nor unknown, the error when the store or the compensation failed.
async fn settle(
    state: &Shared,
    db: &Database,
    id: i64,
    resolution: &str,
    note: &str,
) -> Option<Result<Option<String>, String>> {
    let changed = |r: idem_core::Result<bool>| {
        r.map(|done| done.then(|| "done".to_owned()))
            .map_err(|e| e.to_string())
    };
    Some(match resolution {
        "retry" => changed(
            idem_sql::with_store!(&db.store, s => s.intents().retry_stuck(Some(&[id])).await)
                .map(|n| n > 0),
        ),
        "applied" => changed(
            idem_sql::with_store!(&db.store, s => s.intents().resolve(id, Resolution::Applied, note).await),
        ),
        "not_applied" => changed(
            idem_sql::with_store!(&db.store, s => s.intents().resolve(id, Resolution::Pending, note).await),
        ),
        "compensate" | "compensate_retry" => {
            compensate(state, db, id, resolution == "compensate_retry").await
        }
        _ => return None,
    })
}

/// Runs the compensation of intent `id` with the console's [`Compensations`], then parks it
/// for review or sends it again (`then_retry`).
async fn compensate(
    state: &Shared,
    db: &Database,
    id: i64,
    then_retry: bool,
) -> Result<Option<String>, String> {
    let Some(c) = &state.config.compensations else {
        let why = "the console is configured without compensations \
                   (`ConsoleConfig::compensations` is empty)";
        return Err(why.into());
    };
    let run = idem_sql::with_store!(&db.store, s => {
        let metrics = EffectMetrics::unregistered().map_err(|e| e.to_string())?;
        let mut d = Dispatcher::new(s.intents(), c.dispatcher.clone(), metrics)
            .map_err(|e| e.to_string())?;
        for (effect, policy) in &c.effects {
            d = d.with_policy(effect.clone(), policy.clone());
        }
        d.compensate(id, then_retry).await
    });
    match run {
        Ok(note) => Ok(Some(format!("done: {note}"))),
        Err(CompensateError::NotFound(_) | CompensateError::NotStuck { .. }) => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}
