//! The outbox: pending and parked rows by aggregate type, parked rows by reason and one by one
//! with their payload's start, the CDC slots; and returning parked rows to pending.

use std::sync::Arc;

use axum::Extension;
use axum::extract::{Form, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use idem_core::EventId;
use idem_core::store::OutboxStore;
use idem_sql::AnyStore;
use idem_sql::ops::{Action, ParkedOutboxRow};

use crate::sample::DbSample;
use maud::{Markup, html};

use super::overview::{latest, urlencode};
use super::{Nav, PAGE, Viewer, age, count, layout, next_page, table};
use crate::auth::Session;
use crate::{Shared, ops};

/// Most rows one "retry every row with this reason" returns to pending.
const RETRY_ALL_MAX: i64 = 10_000;

/// `?reason=…&after=…`.
#[derive(serde::Deserialize, Default)]
pub(crate) struct Filter {
    db: Option<String>,
    reason: Option<String>,
    after: Option<i64>,
}

/// `GET /outbox`.
pub(crate) async fn page(
    State(state): State<Arc<Shared>>,
    session: Option<Extension<Session>>,
    Query(f): Query<Filter>,
) -> Response {
    let viewer = Viewer::new(&state, session.map(|Extension(s)| s));
    let (s, _) = latest(&state).await;
    let db = match super::pick(&state, f.db.as_deref(), DbSample::has_outbox) {
        Ok(db) => db,
        Err(r) => return *r,
    };
    let part = s
        .dbs
        .iter()
        .find(|d| d.name == db.name)
        .cloned()
        .unwrap_or_default();
    let reasons = ops!(&db.store, o => o.parked_reasons(crate::sample::CAP).await);
    let rows =
        ops!(&db.store, o => o.parked_rows(f.after.unwrap_or(0), f.reason.as_deref(), PAGE).await);
    let (reasons, rows) = match (reasons, rows) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => {
            return super::error(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("reading the outbox failed: {e}"),
            );
        }
    };
    let here = format!("/outbox?db={}", urlencode(&db.name));
    let base = match &f.reason {
        Some(r) => format!("{here}&reason={}", urlencode(r)),
        None => here.clone(),
    };
    let body = html! {
        (super::databases(&state, &db.name, "/outbox"))
        @if let Some(o) = &part.outbox {
            p { (count(o.pending)) " pending, " (count(o.parked)) " parked; "
                @match o.oldest_pending_age { Some(a) => { "the oldest pending row waits for " (age(a)) "." }, None => "no row is pending." } }
        }
        h2 { "By aggregate type" }
        (table(&["aggregate type", "#pending", "#parked"], html! {
            @for t in &part.types {
                tr { td { (t.aggregate_type) } td.num { (count(t.pending)) } td.num { (count(t.parked)) } }
            }
        }))
        h2 { "Parked, by reason" }
        @if reasons.is_empty() { p.muted { "No parked row." } } @else {
            (table(&["reason", "#rows", ""], html! {
                @for r in &reasons {
                    tr {
                        td { a href=(format!("{here}&reason={}", urlencode(&r.reason))) { (shown(&r.reason)) } }
                        td.num { (count(r.rows)) }
                        td { @if viewer.actions { (retry_form(&viewer, &db.name, None, Some(&r.reason), "return all to pending")) } }
                    }
                }
            }))
        }
        h2 { "Parked rows" @if let Some(r) = &f.reason { " with reason “" (r) "”" } }
        (parked_rows(&viewer, &db.name, &rows))
        (next_page(&base, rows.len(), rows.last().map(|r| r.id)))
        h2 id="cdc" { "CDC slots" }
        @if part.slots.is_empty() { p.muted { "No logical replication slot." } } @else {
            (table(&["slot", "plugin", "reader", "confirmed", "#WAL held"], html! {
                @for slot in &part.slots {
                    tr { td { (slot.name) } td { (slot.plugin) }
                         td { @if slot.active { "attached" } @else { "none" } }
                         td.mono { (slot.confirmed.clone().unwrap_or_default()) }
                         td.num { @if let Some(b) = slot.wal_held { (crate::chart::fmt(super::lossy(b))) " B" } } }
                }
            }))
        }
    };
    layout("Outbox", Nav::Outbox, &viewer, body).into_response()
}

fn shown(reason: &str) -> &str {
    if reason.is_empty() {
        "(none recorded)"
    } else {
        reason
    }
}

fn parked_rows(viewer: &Viewer, db: &str, rows: &[ParkedOutboxRow]) -> Markup {
    if rows.is_empty() {
        return html! { p.muted { "None." } };
    }
    table(
        &[
            "#id",
            "aggregate",
            "event",
            "reason",
            "#attempts",
            "written",
            "payload",
            "",
        ],
        html! {
            @for r in rows {
                tr id=(format!("row-{}", r.id)) {
                    td.num { (r.id) }
                    td { (r.aggregate_type) " " span.mono { (r.aggregate_id) } }
                    td { (r.event_type) br; span.mono.muted { (r.event_id) } }
                    td { (shown(&r.reason)) }
                    td.num { (r.attempts) }
                    td.mono.time { (super::when(&r.created_at)) }
                    td { span.mono.preview { (r.preview) } }
                    td { @if viewer.actions { (retry_form(viewer, db, Some(&r.event_id), None, "return to pending")) } }
                }
            }
        },
    )
}

fn retry_form(
    viewer: &Viewer,
    db: &str,
    event_id: Option<&str>,
    reason: Option<&str>,
    label: &str,
) -> Markup {
    html! {
        form.inline method="post" action="/outbox/retry" {
            (viewer.csrf())
            input type="hidden" name="db" value=(db);
            @if let Some(e) = event_id { input type="hidden" name="event_id" value=(e); }
            @if let Some(r) = reason { input type="hidden" name="reason" value=(r); }
            input type="text" name="why" placeholder="why" required maxlength="500" aria-label="why";
            button type="submit" { (label) }
        }
    }
}

/// The retry form's fields: one row by event id, or every row with a reason.
#[derive(serde::Deserialize)]
pub(crate) struct Retry {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    why: String,
    db: Option<String>,
    event_id: Option<String>,
    reason: Option<String>,
}

/// `POST /outbox/retry`: returns parked rows to pending, one at a time, so that a row the
/// writer's rules refuse (it stays parked with the rule's name) leaves the others to go.
pub(crate) async fn retry(
    State(state): State<Arc<Shared>>,
    session: Option<Extension<Session>>,
    headers: HeaderMap,
    Form(f): Form<Retry>,
) -> Response {
    let act = match super::act(&state, session, &headers, &f.csrf, Some(&f.why)) {
        Ok(a) => a,
        Err(r) => return *r,
    };
    let db = match super::pick(&state, f.db.as_deref(), DbSample::has_outbox) {
        Ok(db) => db,
        Err(r) => return *r,
    };
    let (ids, target) = match (&f.event_id, &f.reason) {
        (Some(e), None) => match e.parse::<EventId>() {
            Ok(id) => (vec![id], format!("{}: outbox event {id}", db.name)),
            Err(_) => return super::error(StatusCode::BAD_REQUEST, "that is not an event id"),
        },
        (None, Some(reason)) => match parked_with(&db.store, reason).await {
            Ok(ids) => (
                ids,
                format!("{}: outbox rows parked with reason “{reason}”", db.name),
            ),
            Err(e) => return super::error(StatusCode::SERVICE_UNAVAILABLE, &e),
        },
        _ => return super::error(StatusCode::BAD_REQUEST, "name one row or one reason"),
    };
    let (moved, refusals) = retry_each(&db.store, &ids).await;
    let outcome = match refusals.first() {
        None => "done".to_owned(),
        Some(first) => format!("{} refused; the first: {first}", refusals.len()),
    };
    let super::Act { viewer, actor, why } = act;
    let action = Action {
        actor: &actor,
        action: "outbox.retry",
        target: &target,
        reason: &why,
        affected: moved,
        outcome: &outcome,
    };
    super::record(db, action).await;
    let what = format!("{moved} row(s) returned to pending; {outcome}.");
    let back = format!("/outbox?db={}", urlencode(&db.name));
    super::done(&viewer, "Outbox", &what, &back)
}

/// The event ids of the rows parked with `reason` (at most [`RETRY_ALL_MAX`]).
async fn parked_with(store: &AnyStore, reason: &str) -> Result<Vec<EventId>, String> {
    let mut ids = vec![];
    let mut after = 0;
    while i64::try_from(ids.len()).is_ok_and(|n| n < RETRY_ALL_MAX) {
        let page = ops!(store, o => o.parked_rows(after, Some(reason), 500).await)
            .map_err(|e| format!("reading the parked rows failed: {e}"))?;
        let Some(last) = page.last() else { break };
        after = last.id;
        ids.extend(
            page.iter()
                .filter_map(|r| r.event_id.parse::<EventId>().ok()),
        );
    }
    Ok(ids)
}

/// Returns each row to pending on its own; the rows moved and the refusals.
async fn retry_each(store: &AnyStore, ids: &[EventId]) -> (i64, Vec<String>) {
    let mut moved = 0;
    let mut refusals = vec![];
    for id in ids {
        let one = std::slice::from_ref(id);
        match idem_sql::with_store!(store, s => s.relay().retry_parked(Some(one)).await) {
            Ok(n) => moved += i64::try_from(n).unwrap_or(i64::MAX),
            Err(e) => refusals.push(format!("{id}: {e}")),
        }
    }
    (moved, refusals)
}
