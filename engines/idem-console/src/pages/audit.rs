//! The audit: every operator action, newest first, page by page.

use std::sync::Arc;

use axum::Extension;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use maud::html;

use super::{Nav, PAGE, Viewer, layout, table};
use crate::auth::Session;
use crate::{Shared, ops};

/// `?before=…`.
#[derive(serde::Deserialize)]
pub(crate) struct Filter {
    db: Option<String>,
    before: Option<i64>,
}

/// `GET /audit`.
pub(crate) async fn page(
    State(state): State<Arc<Shared>>,
    session: Option<Extension<Session>>,
    Query(f): Query<Filter>,
) -> Response {
    let viewer = Viewer::new(&state, session.map(|Extension(s)| s));
    let db = match super::pick(&state, f.db.as_deref(), |_| true) {
        Ok(db) => db,
        Err(r) => return *r,
    };
    let rows = match ops!(&db.store, o => o.audit_rows(f.before.unwrap_or(i64::MAX), PAGE).await) {
        Ok(r) => r,
        Err(e) => {
            return super::error(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("reading the audit failed: {e}"),
            );
        }
    };
    let full = i64::try_from(rows.len()).is_ok_and(|n| n >= PAGE);
    let body = html! {
        (super::databases(&state, &db.name, "/audit"))
        @if rows.is_empty() { p.muted { "No action yet." } } @else {
            (table(&["when", "who", "what", "on", "why", "#rows", "outcome"], html! {
                @for a in &rows {
                    tr { td.mono.time { (super::when(&a.at)) } td { (a.actor) } td { (a.action) } td { (a.target) }
                         td { (a.reason) } td.num { (a.affected) } td { (a.outcome) } }
                }
            }))
        }
        @if let (true, Some(last)) = (full, rows.last()) {
            p.pager { a href=(format!("/audit?db={}&before={}", super::overview::urlencode(&db.name), last.id)) { "older →" } }
        }
    };
    layout("Audit", Nav::Audit, &viewer, body).into_response()
}
