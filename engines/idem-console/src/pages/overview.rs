//! The pipeline as its stages — outbox, relay, topics, consumer groups, effects, remotes —
//! each with its backlog, rate, oldest age and health; the rate charts of the last hour; the
//! last verdict of the verification.

use std::sync::Arc;

use axum::Extension;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};

use super::{Nav, Viewer, age, badge, count, layout};
use crate::Shared;
use crate::auth::Session;
use crate::chart::{fmt, rate_chart};
use crate::health::{self, Health};
use crate::sample::{DbSample, Rates, Sample, total};

/// The newest sample, taking one first when there is none yet.
pub(crate) async fn latest(state: &Shared) -> (Sample, Rates) {
    let known = {
        let h = state.history.lock().unwrap_or_else(|p| p.into_inner());
        h.latest().cloned().map(|s| (s, h.current()))
    };
    if let Some(k) = known {
        return k;
    }
    let s = crate::sample::take(state).await;
    let mut h = state.history.lock().unwrap_or_else(|p| p.into_inner());
    h.push(s.clone());
    (s, Rates::default())
}

/// `GET /`.
pub(crate) async fn page(
    State(state): State<Arc<Shared>>,
    session: Option<Extension<Session>>,
) -> Response {
    let viewer = Viewer::new(&state, session.map(|Extension(s)| s));
    let (s, rates) = latest(&state).await;
    let verdict = state
        .proof
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .violations();
    let charts = charts(&state);
    let several = state.databases.len() > 1;
    let body = html! {
        @if !s.errors.is_empty() {
            div.error role="alert" { @for e in &s.errors { p { (e) } } }
        }
        p.muted { "Sampled " (age(crate::sample::now() - s.at)) " ago; every count stops at "
            (fmt(super::lossy(crate::sample::CAP))) "." }
        section.stages aria-label="stages" {
            @for d in s.dbs.iter().filter(|d| d.has_outbox() || !several) { (outbox_stage(d, &rates)) }
            (relay_stage(&s))
            (topics_stage(&s, &rates))
            @for (db, g) in s.groups() { (group_stage(&s, &rates, db, g)) }
            @for d in s.dbs.iter().filter(|d| d.has_intents() || !several) { (effects_stage(d, &rates)) }
            (proof_stage(verdict))
        }
        h2 { "The last hour" }
        (charts)
    };
    layout("Overview", Nav::Overview, &viewer, body).into_response()
}

fn stage(title: &str, href: &str, h: &Health, rows: Markup) -> Markup {
    html! {
        article.stage {
            h2 { a href=(href) { (title) } (badge(h.colour)) }
            dl { (rows) }
            @if !h.reasons.is_empty() { ul { @for r in &h.reasons { li { (r) } } } }
        }
    }
}

fn rate(r: Option<f64>, unit: &str) -> Markup {
    html! { @match r { Some(v) => { (fmt(v)) " " (unit) }, None => "—" } }
}

fn outbox_stage(d: &DbSample, r: &Rates) -> Markup {
    let href = format!("/outbox?db={}", urlencode(&d.name));
    let title = format!("Outbox · {}", d.name);
    let Some(o) = &d.outbox else {
        return stage(&title, &href, &grey("not read"), html! {});
    };
    stage(
        &title,
        &href,
        &health::outbox(o),
        html! {
            dt { "pending" } dd { (count(o.pending)) }
            dt { "parked" } dd { (count(o.parked)) }
            dt { "oldest pending" } dd { @match o.oldest_pending_age { Some(a) => (age(a)), None => "—" } }
            dt { "written" } dd { (rate(r.written.get(&d.name).copied(), "/s")) }
        },
    )
}

fn relay_stage(s: &Sample) -> Markup {
    let slots: Vec<_> = s.dbs.iter().flat_map(|d| d.slots.iter().cloned()).collect();
    let relayed = s.dbs.iter().filter(|d| d.has_outbox());
    stage(
        "Relay",
        "/outbox#cdc",
        &health::slots(&slots),
        html! {
            dt { "CDC slots" } dd { (slots.len()) }
            @for slot in &slots {
                dt { (slot.name) } dd { @if slot.active { "reading" } @else { "no reader" } }
            }
            @for d in relayed {
                dt { "oldest in " (d.name) }
                dd { @match d.outbox.as_ref().and_then(|o| o.oldest_pending_age) { Some(a) => (age(a)), None => "—" } }
            }
        },
    )
}

fn topics_stage(s: &Sample, r: &Rates) -> Markup {
    let h = if s.lag.is_empty() {
        grey("the console was given no Kafka cluster")
    } else {
        Health {
            colour: crate::health::Colour::Green,
            reasons: vec![],
        }
    };
    stage(
        "Topics",
        "/consumers",
        &h,
        html! {
            dt { "relayed" } dd { (rate(total(&r.relayed), "/s")) }
            dt { "appended" } dd { (rate(r.appended, "/s")) }
        },
    )
}

fn group_stage(s: &Sample, r: &Rates, db: &str, group: &str) -> Markup {
    let lag = s.group_lag(group);
    let stalled = s.scraped.stalled_for(group, s.at);
    let h = health::consumer(lag, stalled, s.open_letters(group));
    stage(
        &format!("Group {group}"),
        &format!(
            "/consumers/letters?db={}&group={}",
            urlencode(db),
            urlencode(group)
        ),
        &h,
        html! {
            dt { "lag" } dd { @match lag { Some(l) => (fmt(super::lossy(l))), None => "—" } }
            dt { "consumed" } dd { (rate(r.consumed.get(group).copied(), "/s")) }
            dt { "dead letters" } dd { (count(s.open_letters(group))) }
            dt { "stalled" } dd { @match stalled { Some(a) => (age(a)), None => "no" } }
        },
    )
}

fn effects_stage(d: &DbSample, r: &Rates) -> Markup {
    let href = format!("/effects?db={}", urlencode(&d.name));
    let title = format!("Effects → remotes · {}", d.name);
    let Some(c) = &d.intents else {
        return stage(&title, &href, &grey("not read"), html! {});
    };
    stage(
        &title,
        &href,
        &health::effects(c),
        html! {
            dt { "pending" } dd { (count(c.pending)) }
            dt { "unknown" } dd { (count(c.unknown)) }
            dt { "parked" } dd { (count(c.parked)) }
            dt { "settled" } dd { (rate(r.settled.get(&d.name).copied(), "/s")) }
        },
    )
}

fn proof_stage(violations: Option<u64>) -> Markup {
    let h = health::proof(violations);
    stage(
        "Proof",
        "/proof",
        &h,
        html! {
            dt { "last verdict" }
            dd { @match violations { None => "none yet", Some(0) => "clean", Some(n) => { (n) " violation(s)" } } }
        },
    )
}

fn grey(why: &str) -> Health {
    Health {
        colour: crate::health::Colour::Grey,
        reasons: vec![why.to_owned()],
    }
}

fn charts(state: &Shared) -> Markup {
    let h = state.history.lock().unwrap_or_else(|p| p.into_inner());
    let span = h.span();
    html! {
        div.charts {
            (rate_chart("Outbox writes", "rows/s", &h.series(|r| total(&r.written)), span))
            (rate_chart("Relayed", "rows/s", &h.series(|r| total(&r.relayed)), span))
            (rate_chart("Appended to the topics", "records/s", &h.series(|r| r.appended), span))
            (rate_chart("Consumed, all groups", "records/s", &h.series(|r| total(&r.consumed)), span))
            (rate_chart("Effects settled", "intents/s", &h.series(|r| total(&r.settled)), span))
        }
    }
}

/// `s` for a URL's query string.
pub(crate) fn urlencode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(char::from(b));
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}
