//! The consumer groups: lag per partition from Kafka, stalls and retries from the services'
//! metrics, dead letters by reason and one by one; and replaying them — a dry run first, then a
//! request the group's running consumer serves through its own handler.

use std::sync::Arc;

use axum::Extension;
use axum::extract::{Form, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use idem_consumer::replay::{ReplayResult, preview};
use idem_core::store::InboxStore;
use idem_sql::ops::{Action, LetterRow};
use maud::{Markup, html};

use super::overview::{latest, urlencode};
use super::{Nav, PAGE, Viewer, age, count, layout, next_page, table};
use crate::auth::Session;
use crate::chart::fmt;
use crate::{Shared, ops};

/// Letters a dry run decodes and lists.
const DRY_RUN_SHOWN: i64 = 100;

/// `GET /consumers`.
pub(crate) async fn page(
    State(state): State<Arc<Shared>>,
    session: Option<Extension<Session>>,
) -> Response {
    let viewer = Viewer::new(&state, session.map(|Extension(s)| s));
    let (s, rates) = latest(&state).await;
    let mut groups = vec![];
    for db in &state.databases {
        match ops!(&db.store, o => o.letter_groups(crate::sample::LETTER_CAP).await) {
            Ok(g) => groups.extend(g.into_iter().map(|g| (db.name.as_str(), g))),
            Err(e) => {
                return super::error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &format!("reading the dead letters of {} failed: {e}", db.name),
                );
            }
        }
    }
    let body = html! {
        h2 { "Groups" }
        (table(&["group", "#lag", "#consumed", "stalled", "#retries", "#open dead letters"], html! {
            @for (db, g) in s.groups() {
                tr {
                    td { a href=(letters_href(db, g, None)) { (g) } }
                    td.num { @match s.group_lag(g) { Some(l) => (fmt(super::lossy(l))), None => "—" } }
                    td.num { @match rates.consumed.get(g) { Some(r) => { (fmt(*r)) "/s" }, None => "—" } }
                    td { @match s.scraped.stalled_for(g, s.at) { Some(a) => { "for " (age(a)) }, None => "no" } }
                    td.num { @match s.scraped.retries.get(g) { Some(r) => (fmt(*r)), None => "—" } }
                    td.num { (count(s.open_letters(g))) }
                }
            }
        }))
        @if s.lag.is_empty() { p.muted { "Lag per partition needs the Kafka cluster: the console was given none." } }
        @for (group, parts) in &s.lag {
            h2 { "Partitions of " (group) }
            (table(&["topic", "#partition", "#committed", "#high watermark", "#lag"], html! {
                @for p in parts {
                    tr { td { (p.topic) } td.num { (p.partition) }
                         td.num { @match p.committed { Some(c) => (c), None => "—" } }
                         td.num { (p.high) } td.num { (p.lag()) } }
                }
            }))
        }
        @if !s.scraped.unreachable.is_empty() {
            p.error { "Metrics endpoints not read: " @for u in &s.scraped.unreachable { (u) "; " } }
        }
        h2 { "Open dead letters, by reason" }
        @if groups.is_empty() { p.muted { "No open dead letter." } } @else {
            (table(&["group", "reason", "#letters", "#replay requested", ""], html! {
                @for (db, g) in &groups {
                    tr {
                        td { (g.consumer_group) }
                        td { a href=(letters_href(db, &g.consumer_group, Some(&g.reason))) { (g.reason) } }
                        td.num { (count(g.letters)) }
                        td.num { (g.requested) }
                        td { @if viewer.actions {
                            a href=(format!("/consumers/replay?db={}&group={}&reason={}", urlencode(db), urlencode(&g.consumer_group), urlencode(&g.reason))) { "replay…" }
                        } }
                    }
                }
            }))
        }
    };
    layout("Consumers", Nav::Consumers, &viewer, body).into_response()
}

fn letters_href(db: &str, group: &str, reason: Option<&str>) -> String {
    let base = format!(
        "/consumers/letters?db={}&group={}",
        urlencode(db),
        urlencode(group)
    );
    match reason {
        Some(r) => format!("{base}&reason={}", urlencode(r)),
        None => base,
    }
}

/// `?group=…&reason=…&after=…&all=1`.
#[derive(serde::Deserialize)]
pub(crate) struct LetterFilter {
    db: Option<String>,
    group: String,
    reason: Option<String>,
    after: Option<i64>,
    all: Option<u8>,
}

/// `GET /consumers/letters`: a group's dead letters (open ones unless `all=1`), page by page.
pub(crate) async fn letters(
    State(state): State<Arc<Shared>>,
    session: Option<Extension<Session>>,
    Query(f): Query<LetterFilter>,
) -> Response {
    let viewer = Viewer::new(&state, session.map(|Extension(s)| s));
    let open = f.all != Some(1);
    let db = match super::pick(&state, f.db.as_deref(), |d| d.groups.contains(&f.group)) {
        Ok(db) => db,
        Err(r) => return *r,
    };
    let rows = ops!(&db.store, o => o.letter_rows(&f.group, f.after.unwrap_or(0), f.reason.as_deref(), open, PAGE).await);
    let rows = match rows {
        Ok(r) => r,
        Err(e) => {
            return super::error(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("reading the dead letters failed: {e}"),
            );
        }
    };
    let base = format!(
        "{}{}",
        letters_href(&db.name, &f.group, f.reason.as_deref()),
        if open { "" } else { "&all=1" }
    );
    let body = html! {
        p {
            @if open { "Open letters (never replayed, or whose replay failed). "
                a href=(format!("{}&all=1", letters_href(&db.name, &f.group, f.reason.as_deref()))) { "Show every letter." } }
            @else { "Every letter. " a href=(letters_href(&db.name, &f.group, f.reason.as_deref())) { "Show the open ones." } }
        }
        (letter_table(&viewer, &db.name, &f.group, &rows))
        (next_page(&base, rows.len(), rows.last().map(|r| r.id)))
    };
    layout(
        &format!("Dead letters of {}", f.group),
        Nav::Consumers,
        &viewer,
        body,
    )
    .into_response()
}

fn letter_table(viewer: &Viewer, db: &str, group: &str, rows: &[LetterRow]) -> Markup {
    if rows.is_empty() {
        return html! { p.muted { "None." } };
    }
    table(
        &[
            "#id", "record", "event", "reason", "stored", "value", "replay", "",
        ],
        html! {
            @for l in rows {
                tr id=(format!("letter-{}", l.id)) {
                    td.num { (l.id) }
                    td.mono { (l.topic) "/" (l.partition) "@" (l.offset) }
                    td { (l.event_type) br; span.mono.muted { (l.event_id.clone().unwrap_or_else(|| "no event id".into())) } }
                    td { (l.reason) }
                    td.mono.time { (super::when(&l.created_at)) }
                    td { span.mono.preview { (l.preview) } }
                    td { @if let Some(at) = &l.replay_requested_at { "requested at " (at) } @else { (l.replay_outcome) } }
                    td { @if viewer.actions && l.replay_outcome != "applied" && l.replay_outcome != "already_applied" {
                        a href=(format!("/consumers/replay?db={}&group={}&id={}", urlencode(db), urlencode(group), l.id)) { "replay…" }
                    } }
                }
            }
        },
    )
}

/// Which letters a replay is about: one by id, or every open one with a reason.
#[derive(serde::Deserialize)]
pub(crate) struct Selection {
    db: Option<String>,
    group: String,
    id: Option<i64>,
    reason: Option<String>,
}

impl Selection {
    fn target(&self) -> String {
        match (self.id, &self.reason) {
            (Some(id), _) => format!("dead letter #{id} of group {}", self.group),
            (None, Some(r)) => format!(
                "open dead letters of group {} with reason “{r}”",
                self.group
            ),
            (None, None) => format!("every open dead letter of group {}", self.group),
        }
    }
}

/// `GET /consumers/replay`: the dry run. Decodes the letters as the consumer would (the first
/// [`DRY_RUN_SHOWN`]), says how many would be handed to the group's consumer, and offers the
/// confirmation.
pub(crate) async fn dry_run(
    State(state): State<Arc<Shared>>,
    session: Option<Extension<Session>>,
    Query(sel): Query<Selection>,
) -> Response {
    let viewer = Viewer::new(&state, session.map(|Extension(s)| s));
    if sel.id.is_none() && sel.reason.is_none() {
        return super::error(
            StatusCode::BAD_REQUEST,
            "name one letter (id) or one reason",
        );
    }
    let db = match super::pick(&state, sel.db.as_deref(), |d| d.groups.contains(&sel.group)) {
        Ok(db) => db,
        Err(r) => return *r,
    };
    let rows = ops!(&db.store, o => o.letter_rows(&sel.group, sel.id.map_or(0, |i| i - 1), sel.reason.as_deref(), true, DRY_RUN_SHOWN).await);
    let rows: Vec<LetterRow> = match rows {
        Ok(r) => r
            .into_iter()
            .filter(|l| sel.id.is_none_or(|id| l.id == id))
            .collect(),
        Err(e) => {
            return super::error(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("reading the dead letters failed: {e}"),
            );
        }
    };
    let mut verdicts = vec![];
    for l in &rows {
        let v = idem_sql::with_store!(&db.store, s => preview(&s.inbox(), &sel.group, Some(l.id)).await);
        match v {
            Ok(v) => verdicts.extend(v),
            Err(e) => {
                return super::error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &format!("decoding the letters failed: {e}"),
                );
            }
        }
    }
    let replayable = verdicts
        .iter()
        .filter(|v| v.result == ReplayResult::WouldReplay)
        .count();
    let body = html! {
        p { "Dry run for " (sel.target()) ": nothing has changed." }
        @if verdicts.is_empty() { p.muted { "No open letter matches: nothing to replay." } }
        @else {
            (table(&["#id", "record", "event", "would"], html! {
                @for v in &verdicts {
                    tr { td.num { (v.id) } td.mono { (v.topic) "/" (v.partition) "@" (v.offset) }
                         td.mono { (v.event_id.map(|e| e.to_string()).unwrap_or_else(|| "—".into())) }
                         td { @match &v.result {
                             ReplayResult::Undecodable(why) => { "not be replayed: " (why) },
                             _ => "be handed to the group's consumer",
                         } } }
                }
            }))
            @if i64::try_from(verdicts.len()).is_ok_and(|n| n >= DRY_RUN_SHOWN) { p.muted { "The first " (DRY_RUN_SHOWN) " shown; the request covers every open letter with this reason." } }
            p { "Confirming asks group " strong { (sel.group) } "'s running consumer to apply "
                (replayable) " decodable letter(s) through its own handler, each once (its inbox row is the fence); "
                "a letter that does not decode is recorded as a failed replay." }
            form.inline method="post" action="/consumers/replay" {
                (viewer.csrf())
                input type="hidden" name="db" value=(db.name);
                input type="hidden" name="group" value=(sel.group);
                @if let Some(id) = sel.id { input type="hidden" name="id" value=(id); }
                @if let Some(r) = &sel.reason { input type="hidden" name="reason" value=(r); }
                input type="text" name="why" placeholder="why" required maxlength="500" aria-label="why";
                button.primary type="submit" { "Confirm the replay" }
            }
        }
    };
    layout("Replay dead letters", Nav::Consumers, &viewer, body).into_response()
}

/// The confirmation's fields.
#[derive(serde::Deserialize)]
pub(crate) struct Confirm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    why: String,
    db: Option<String>,
    group: String,
    id: Option<i64>,
    reason: Option<String>,
}

/// `POST /consumers/replay`: requests the replays; the group's consumer serves them.
pub(crate) async fn replay(
    State(state): State<Arc<Shared>>,
    session: Option<Extension<Session>>,
    headers: HeaderMap,
    Form(f): Form<Confirm>,
) -> Response {
    let act = match super::act(&state, session, &headers, &f.csrf, Some(&f.why)) {
        Ok(a) => a,
        Err(r) => return *r,
    };
    if f.id.is_none() && f.reason.is_none() {
        return super::error(
            StatusCode::BAD_REQUEST,
            "name one letter (id) or one reason",
        );
    }
    let super::Act { viewer, actor, why } = act;
    let db = match super::pick(&state, f.db.as_deref(), |d| d.groups.contains(&f.group)) {
        Ok(db) => db,
        Err(r) => return *r,
    };
    let requested = idem_sql::with_store!(&db.store, s => s.inbox().request_replays(&f.group, f.id, f.reason.as_deref(), &actor).await);
    let ids = match requested {
        Ok(ids) => ids,
        Err(e) => {
            return super::error(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("requesting the replays failed: {e}"),
            );
        }
    };
    let sel = Selection {
        db: Some(db.name.clone()),
        group: f.group.clone(),
        id: f.id,
        reason: f.reason.clone(),
    };
    let target = sel.target();
    let affected = i64::try_from(ids.len()).unwrap_or(i64::MAX);
    let action = Action {
        actor: &actor,
        action: "dead_letters.replay",
        target: &target,
        reason: &why,
        affected,
        outcome: "requested",
    };
    super::record(db, action).await;
    let what = format!(
        "{} replay(s) requested: group {}'s running consumer serves them through its handler within a second (a consumer that is not running serves them when it starts).",
        ids.len(),
        f.group
    );
    super::done(
        &viewer,
        "Replay dead letters",
        &what,
        &letters_href(&db.name, &f.group, f.reason.as_deref()),
    )
}
