//! Logging in with the console's token and one's name, and out.

use std::sync::Arc;

use axum::Extension;
use axum::extract::{Form, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use maud::html;

use super::{Nav, Viewer, layout};
use crate::Shared;
use crate::auth::{self, Session};

/// The login form's fields.
#[derive(serde::Deserialize)]
pub(crate) struct Login {
    actor: String,
    token: String,
}

/// The logout form's field.
#[derive(serde::Deserialize)]
pub(crate) struct Logout {
    #[serde(default)]
    csrf: String,
}

fn page(state: &Shared, status: StatusCode, message: Option<&str>) -> Response {
    let viewer = Viewer {
        session: None,
        actions: false,
    };
    let body = html! {
        @if state.config.token.is_none() {
            p { "This console has no token: it is read-only and needs no login. "
                a href="/" { "Open the overview." } }
        } @else {
            form.login method="post" action="/login" {
                @if let Some(m) = message { p.error role="alert" { (m) } }
                label { "Your name (recorded with each action)"
                    br; input type="text" name="actor" required autocomplete="username" maxlength="64"; }
                label { "Console token"
                    br; input type="password" name="token" required autocomplete="current-password"; }
                button.primary type="submit" { "Log in" }
            }
        }
    };
    (status, layout("Log in", Nav::None, &viewer, body)).into_response()
}

/// `GET /login`.
pub(crate) async fn form(State(state): State<Arc<Shared>>) -> Response {
    page(&state, StatusCode::OK, None)
}

/// `POST /login`: a session for a right token and a valid name.
pub(crate) async fn login(State(state): State<Arc<Shared>>, Form(f): Form<Login>) -> Response {
    let Some(token) = &state.config.token else {
        return page(&state, StatusCode::NOT_FOUND, None);
    };
    if !token.matches(&f.token) {
        tracing::warn!("a console login was refused: wrong token");
        return page(&state, StatusCode::UNAUTHORIZED, Some("wrong token"));
    }
    let actor = match auth::actor(&f.actor) {
        Ok(a) => a,
        Err(why) => return page(&state, StatusCode::BAD_REQUEST, Some(&why)),
    };
    tracing::info!(actor, "an operator logged in to the console");
    let id = state.sessions.open(actor);
    (
        [(header::SET_COOKIE, auth::set_cookie(&id))],
        Redirect::to("/"),
    )
        .into_response()
}

/// `POST /logout`.
pub(crate) async fn logout(
    State(state): State<Arc<Shared>>,
    session: Option<Extension<Session>>,
    headers: HeaderMap,
    Form(f): Form<Logout>,
) -> Response {
    if let Err(r) = super::act(&state, session, &headers, &f.csrf, None) {
        return *r;
    }
    if let Some(id) = headers
        .get(header::COOKIE)
        .and_then(|v| v.to_str().ok())
        .and_then(auth::cookie)
    {
        state.sessions.close(id);
    }
    (
        [(header::SET_COOKIE, auth::set_cookie(""))],
        Redirect::to("/login"),
    )
        .into_response()
}
