//! The pages: one module each, sharing the layout and the small pieces below. Everything is
//! rendered on the server with maud, which escapes every value it inserts: a payload, a
//! reason or a group name written by anyone shows as text, never as markup.

pub(crate) mod audit;
pub(crate) mod consumers;
pub(crate) mod effects;
pub(crate) mod login;
pub(crate) mod outbox;
pub(crate) mod overview;
pub(crate) mod proof;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use maud::{DOCTYPE, Markup, html};

use crate::Shared;
use crate::auth::{Refusal, Session};
use crate::health::Colour;
use crate::sample::CAP;

/// Rows per page of a list.
pub(crate) const PAGE: i64 = 50;

/// The sections, in the navigation's order.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Nav {
    Overview,
    Outbox,
    Consumers,
    Effects,
    Proof,
    Audit,
    None,
}

const SECTIONS: [(Nav, &str, &str); 6] = [
    (Nav::Overview, "/", "Overview"),
    (Nav::Outbox, "/outbox", "Outbox"),
    (Nav::Consumers, "/consumers", "Consumers"),
    (Nav::Effects, "/effects", "Effects"),
    (Nav::Proof, "/proof", "Proof"),
    (Nav::Audit, "/audit", "Audit"),
];

/// Who is looking, and whether they may act.
pub(crate) struct Viewer {
    pub(crate) session: Option<Session>,
    pub(crate) actions: bool,
}

impl Viewer {
    pub(crate) fn new(state: &Shared, session: Option<Session>) -> Viewer {
        let actions = state.config.actions() && session.is_some();
        Viewer { session, actions }
    }

    /// The hidden CSRF field of an action's form.
    pub(crate) fn csrf(&self) -> Markup {
        let token = self
            .session
            .as_ref()
            .map(|s| s.csrf.as_str())
            .unwrap_or_default();
        html! { input type="hidden" name="csrf" value=(token); }
    }
}

/// A whole page.
pub(crate) fn layout(title: &str, nav: Nav, viewer: &Viewer, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · idem console" }
                style { (maud::PreEscaped(CSS)) }
            }
            body {
                header {
                    strong.brand { "idem" }
                    nav {
                        @for (n, href, label) in SECTIONS {
                            a href=(href) class=[(n == nav).then_some("here")] { (label) }
                        }
                    }
                    div.who {
                        @if let Some(s) = &viewer.session {
                            span { (s.actor) }
                            @if viewer.actions {
                                form method="post" action="/logout" {
                                    (viewer.csrf())
                                    button.link type="submit" { "log out" }
                                }
                            } @else {
                                span.tag { "read-only" }
                            }
                        } @else {
                            span.tag { "read-only" }
                        }
                    }
                }
                main {
                    h1 { (title) }
                    (body)
                }
            }
        }
    }
}

/// The database a page shows: the one `name`d, or the first `prefer` picks; an error page when
/// there is no such database.
pub(crate) fn pick<'a>(
    state: &'a Shared,
    name: Option<&str>,
    prefer: impl Fn(&crate::sample::DbSample) -> bool,
) -> Result<&'a crate::Database, Box<Response>> {
    state.database(name, prefer).ok_or_else(|| {
        Box::new(error(
            StatusCode::NOT_FOUND,
            &format!("the console shows no database named {}", name.unwrap_or("")),
        ))
    })
}

/// Links to the same page for each database, when there are several.
pub(crate) fn databases(state: &Shared, current: &str, path: &str) -> Markup {
    html! {
        @if state.databases.len() > 1 {
            p.dbs { "Database: "
                @for d in &state.databases {
                    @if d.name == current { strong { (d.name) } } @else {
                        a href=(format!("{path}?db={}", overview::urlencode(&d.name))) { (d.name) }
                    }
                    " "
                }
            }
        }
    }
}

/// A colour badge with its word (colour is never the only sign).
pub(crate) fn badge(c: Colour) -> Markup {
    html! { span class=(format!("badge {}", c.name())) { (c.name()) } }
}

/// A count, with "≥" when it reached the cap it was read with.
pub(crate) fn count(n: i64) -> Markup {
    html! {
        @if n >= CAP { "≥ " (crate::chart::fmt(lossy(CAP))) } @else { (crate::chart::fmt(lossy(n))) }
    }
}

/// A count as a float for display: exact below 2^53, far above any count shown.
#[allow(clippy::cast_precision_loss)]
pub(crate) fn lossy(n: i64) -> f64 {
    n as f64
}

/// A database timestamp to the second (`2026-12-06 08:10:12`), the rest dropped.
pub(crate) fn when(at: &str) -> &str {
    at.get(..19).unwrap_or(at)
}

/// An age in seconds, as people read it.
pub(crate) fn age(seconds: f64) -> String {
    match seconds {
        s if s < 120.0 => format!("{s:.0} s"),
        s if s < 7200.0 => format!("{:.0} min", s / 60.0),
        s => format!("{:.1} h", s / 3600.0),
    }
}

/// A table; on a phone each row is a card whose cells carry their column's name (the
/// stylesheet reads `data-label`). A heading written `#name` is a numeric column's (aligned
/// right, like its cells).
pub(crate) fn table(head: &[&str], rows: Markup) -> Markup {
    let names: Vec<&str> = head.iter().map(|h| h.trim_start_matches('#')).collect();
    html! {
        div.scroll {
            table.cards {
                thead { tr { @for h in head {
                    @if let Some(n) = h.strip_prefix('#') { th.num scope="col" { (n) } }
                    @else { th scope="col" { (h) } }
                } } }
                tbody { (labelled(&rows.into_string(), &names)) }
            }
        }
    }
}

/// `rows` (rendered `<tr>`s of this module's pages, every text in them escaped, so `<tr` and
/// `<td` only open elements) with each cell labelled by its column: `<td data-label="…">`.
fn labelled(rows: &str, names: &[&str]) -> maud::PreEscaped<String> {
    let mut out = String::with_capacity(rows.len() + rows.len() / 4);
    let mut column = 0;
    let mut rest = rows;
    while let Some(at) = rest.find('<') {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        let opens = |tag: &str| {
            rest.strip_prefix(tag)
                .is_some_and(|r| r.starts_with([' ', '>']))
        };
        if opens("<tr") {
            column = 0;
        } else if opens("<td") {
            out.push_str("<td");
            rest = &rest[3..];
            if let Some(name) = names.get(column).filter(|n| !n.is_empty()) {
                out.push_str(" data-label=\"");
                out.push_str(&html! { (name) }.into_string());
                out.push('"');
            }
            column += 1;
            continue;
        }
        out.push('<');
        rest = &rest[1..];
    }
    out.push_str(rest);
    maud::PreEscaped(out)
}

/// The "next page" link of a keyset page whose last id is `last`, when the page was full.
pub(crate) fn next_page(base: &str, shown: usize, last: Option<i64>) -> Markup {
    let full = i64::try_from(shown).is_ok_and(|n| n >= PAGE);
    html! {
        @if let (true, Some(last)) = (full, last) {
            p.pager { a href=(format!("{base}{}after={last}", if base.contains('?') { "&" } else { "?" })) { "next page →" } }
        }
    }
}

/// An error page: what failed and what to do.
pub(crate) fn error(status: StatusCode, what: &str) -> Response {
    let viewer = Viewer {
        session: None,
        actions: false,
    };
    let body = html! { p.error { (what) } p { a href="/" { "back to the overview" } } };
    (status, layout("Not done", Nav::None, &viewer, body)).into_response()
}

/// The answer to an action refused before it ran.
pub(crate) fn refused(r: Refusal) -> Response {
    match r {
        Refusal::NoCredential => error(
            StatusCode::UNAUTHORIZED,
            "log in first: every action needs the console's token",
        ),
        Refusal::BadCsrf => error(
            StatusCode::FORBIDDEN,
            "refused: the form's CSRF token is not this session's (reload the page and try again)",
        ),
        Refusal::CrossSite => error(
            StatusCode::FORBIDDEN,
            "refused: the request came from another site",
        ),
    }
}

/// The page after an action: what it did, and where to look next.
pub(crate) fn done(viewer: &Viewer, title: &str, what: &str, back: &str) -> Response {
    let body = html! {
        p.done role="status" { (what) }
        p { a href=(back) { "back" } " · " a href="/audit" { "the audit" } }
    };
    layout(title, Nav::None, viewer, body).into_response()
}

/// An action allowed to run: who asked, and why.
pub(crate) struct Act {
    /// The page the answer renders for.
    pub(crate) viewer: Viewer,
    /// The operator's name.
    pub(crate) actor: String,
    /// Their reason (empty for an action that asks none).
    pub(crate) why: String,
}

/// Lets an action run or answers its refusal: a session, the session's CSRF token, no foreign
/// origin ([`crate::auth::check_action`]), and a reason when `why` is asked for.
pub(crate) fn act(
    state: &Shared,
    session: Option<axum::Extension<Session>>,
    headers: &axum::http::HeaderMap,
    csrf: &str,
    why: Option<&str>,
) -> Result<Act, Box<Response>> {
    let session = session.map(|axum::Extension(s)| s);
    check(session.as_ref(), headers, csrf)?;
    let why = why.map(reason).transpose()?.unwrap_or_default();
    let actor = session
        .as_ref()
        .map(|s| s.actor.clone())
        .unwrap_or_default();
    Ok(Act {
        viewer: Viewer::new(state, session),
        actor,
        why,
    })
}

/// Writes an action's audit row in the database it acted on; a failure is logged (the action
/// has run).
pub(crate) async fn record(db: &crate::Database, action: idem_sql::ops::Action<'_>) {
    if let Err(e) = crate::ops!(&db.store, o => o.audit(action).await) {
        tracing::error!(error = %e, action = action.action, "an action ran and its audit row could not be written");
    }
}

/// Checks an action's credential and CSRF token (see [`crate::auth::check_action`]).
fn check(
    session: Option<&Session>,
    headers: &axum::http::HeaderMap,
    csrf: &str,
) -> Result<(), Box<Response>> {
    let text = |h| {
        headers
            .get(h)
            .and_then(|v: &axum::http::HeaderValue| v.to_str().ok())
    };
    let (origin, host) = (
        text(axum::http::header::ORIGIN),
        text(axum::http::header::HOST),
    );
    crate::auth::check_action(session, csrf, origin, host).map_err(|r| {
        tracing::warn!(refusal = ?r, origin, host, "a console action was refused");
        Box::new(refused(r))
    })
}

/// A reason typed into a form: required, at most 500 characters.
pub(crate) fn reason(text: &str) -> Result<String, Box<Response>> {
    let text = text.trim();
    if text.is_empty() || text.chars().count() > 500 {
        return Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            "say why (1 to 500 characters): the audit keeps it with the action",
        )));
    }
    Ok(text.to_owned())
}

/// The one style sheet, inlined in every page (the page loads nothing else).
const CSS: &str = include_str!("console.css");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_cell_is_labelled_by_its_column_and_text_is_left_alone() {
        let rows = html! {
            tr { td.num { "1" } td { "<td>&lt;tr" } td { form { "x" } } }
            tr id="r2" { td { "2" } td { "b" } }
        };
        let out = labelled(&rows.into_string(), &["id", "why \"it\"", ""]).into_string();
        assert_eq!(
            out,
            "<tr><td data-label=\"id\" class=\"num\">1</td>\
             <td data-label=\"why &quot;it&quot;\">&lt;td&gt;&amp;lt;tr</td><td><form>x</form></td></tr>\
             <tr id=\"r2\"><td data-label=\"id\">2</td><td data-label=\"why &quot;it&quot;\">b</td></tr>"
        );
    }
}
