//! The console's pages and actions over HTTP, against real PostgreSQL: every action changes
//! what it says and writes its audit row; every refusal (no login, a wrong token, a missing or
//! wrong CSRF token, another site's origin, read-only) changes nothing; a hostile row shows as
//! text.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::extract::Path;
use axum::http::{Request, StatusCode, header};
use idem_conformance::backend::{Backend, Pg};
use idem_console::{Compensations, Console, ConsoleConfig, Database, Token};
use idem_core::TableNames;
use idem_effects::{DispatcherConfig, EffectPolicy, HttpCompensation};
use idem_sql::{AnyPool, AnyStore};
use tower::ServiceExt;

const TOKEN: &str = "0123456789abcdef-console";
const PARKED: &str = "topic outbox.event.shipment does not exist";
const HOSTILE: &str = "<script>alert(1)</script>";

/// A migrated database: 6 outbox rows (2 pending `order`, 4 `shipment` parked with one reason,
/// one of them with a hostile payload), 3 open dead letters of `settlement`, one unknown and
/// one parked effect intent.
async fn seeded() -> Pg {
    let pg = Pg::new().await;
    for sql in [
        "INSERT INTO idem_outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), CASE WHEN g <= 2 THEN 'order' ELSE 'shipment' END, 'a-' || g, 'e', \
         jsonb_build_object('n', g, 'note', '<script>alert(1)</script>') FROM generate_series(1, 6) g",
        "UPDATE idem_outbox SET status = 'parked', last_error = 'topic outbox.event.shipment does not exist' \
         WHERE aggregate_type = 'shipment'",
        "INSERT INTO idem_inbox (consumer_group, event_id, event_type, aggregate_type, aggregate_id, payload_hash) \
         VALUES ('settlement', gen_random_uuid(), 'e', 'order', 'a', 'h')",
        "INSERT INTO idem_dead_letters (consumer_group, topic, record_partition, record_offset, reason, payload) \
         SELECT 'settlement', 't', 0, g, 'the order is unknown', '{}' FROM generate_series(1, 3) g",
        "INSERT INTO idem_effect_intents (idem_key, effect, target, event_id, body, status, last_error) VALUES \
         ('k1', 'points.award', 'http://127.0.0.1:9/awards', gen_random_uuid(), '{}', 'unknown', 'timed out'), \
         ('k2', 'points.award', 'http://127.0.0.1:9/awards', gen_random_uuid(), '{}', 'parked', 'HTTP 422')",
    ] {
        pg.exec(sql).await.unwrap();
    }
    pg
}

fn console(pg: &Pg, read_only: bool) -> Router {
    let store = AnyStore::open(AnyPool::Postgres(pg.pool().clone()), TableNames::default());
    let config = ConsoleConfig {
        token: Some(Token::new(TOKEN).unwrap()),
        read_only,
        ..ConsoleConfig::default()
    };
    let db = Database {
        name: "orders".into(),
        store,
    };
    Console::new(vec![db], config).router()
}

/// One request; the status, the `Location` and `Set-Cookie` headers, and the body.
struct Answer {
    status: StatusCode,
    location: Option<String>,
    cookie: Option<String>,
    body: String,
}

async fn send(app: &Router, req: Request<Body>) -> Answer {
    let res = app.clone().oneshot(req).await.unwrap();
    let h = |n| {
        res.headers()
            .get(n)
            .map(|v: &header::HeaderValue| v.to_str().unwrap().to_owned())
    };
    let (status, location, cookie) = (res.status(), h(header::LOCATION), h(header::SET_COOKIE));
    let bytes = axum::body::to_bytes(res.into_body(), 1 << 24)
        .await
        .unwrap();
    Answer {
        status,
        location,
        cookie,
        body: String::from_utf8(bytes.to_vec()).unwrap(),
    }
}

fn get(path: &str, cookie: Option<&str>) -> Request<Body> {
    let mut b = Request::get(path).header(header::HOST, "127.0.0.1:9480");
    if let Some(c) = cookie {
        b = b.header(header::COOKIE, c);
    }
    b.body(Body::empty()).unwrap()
}

fn post(path: &str, cookie: Option<&str>, form: &[(&str, &str)]) -> Request<Body> {
    let body: Vec<String> = form
        .iter()
        .map(|(k, v)| format!("{k}={}", enc(v)))
        .collect();
    let mut b = Request::post(path)
        .header(header::HOST, "127.0.0.1:9480")
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded");
    if let Some(c) = cookie {
        b = b.header(header::COOKIE, c);
    }
    b.body(Body::from(body.join("&"))).unwrap()
}

fn enc(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Logs in as `ana`: the session cookie and the CSRF token of the pages.
async fn login(app: &Router) -> (String, String) {
    let a = send(
        app,
        post("/login", None, &[("actor", "ana"), ("token", TOKEN)]),
    )
    .await;
    assert_eq!(a.status, StatusCode::SEE_OTHER, "{}", a.body);
    let cookie = a.cookie.unwrap().split(';').next().unwrap().to_owned();
    let page = send(app, get("/", Some(&cookie))).await.body;
    let at = page.find("name=\"csrf\" value=\"").unwrap() + 19;
    let csrf = page[at..at + 64].to_owned();
    (cookie, csrf)
}

async fn scalar(pg: &Pg, sql: &str) -> i64 {
    pg.scalar(sql).await
}

const PARKED_ROWS: &str = "SELECT count(*) FROM idem_outbox WHERE status = 'parked'";
const AUDIT_ROWS: &str = "SELECT count(*) FROM idem_audit";

#[tokio::test]
async fn every_page_needs_a_login_and_a_wrong_token_opens_none() {
    let pg = seeded().await;
    let app = console(&pg, false);
    for path in ["/", "/outbox", "/consumers", "/effects", "/proof", "/audit"] {
        let a = send(&app, get(path, None)).await;
        assert_eq!(
            (a.status, a.location.as_deref()),
            (StatusCode::SEE_OTHER, Some("/login")),
            "{path}"
        );
    }
    let wrong = send(
        &app,
        post(
            "/login",
            None,
            &[("actor", "eve"), ("token", "0123456789abcdef-guess")],
        ),
    )
    .await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);
    assert!(wrong.cookie.is_none());
    let forged = send(&app, get("/", Some("idem_console=0123456789abcdef"))).await;
    assert_eq!(
        forged.status,
        StatusCode::SEE_OTHER,
        "a made-up session is none"
    );
    let (cookie, _) = login(&app).await;
    for path in ["/", "/outbox", "/consumers", "/effects", "/proof", "/audit"] {
        let a = send(&app, get(path, Some(&cookie))).await;
        assert_eq!(a.status, StatusCode::OK, "{path}: {}", a.body);
        assert!(!a.body.contains(TOKEN), "{path} shows the token");
        assert!(!a.body.contains(pg.url()), "{path} shows the database URL");
    }
}

#[tokio::test]
async fn an_action_without_a_session_or_with_a_bad_csrf_token_changes_nothing() {
    let pg = seeded().await;
    let app = console(&pg, false);
    let (cookie, csrf) = login(&app).await;
    let retry = |cookie: Option<&str>, csrf: Option<&str>, origin: Option<&str>| {
        let mut form = vec![("why", "topic created"), ("reason", PARKED)];
        if let Some(c) = csrf {
            form.push(("csrf", c));
        }
        let mut req = post("/outbox/retry", cookie, &form);
        if let Some(o) = origin {
            req.headers_mut().insert(header::ORIGIN, o.parse().unwrap());
        }
        req
    };
    let refusals = [
        (
            "no session",
            retry(None, Some(&csrf), None),
            StatusCode::SEE_OTHER,
        ),
        (
            "no CSRF token",
            retry(Some(&cookie), None, None),
            StatusCode::FORBIDDEN,
        ),
        (
            "a wrong CSRF token",
            retry(Some(&cookie), Some(&"0".repeat(64)), None),
            StatusCode::FORBIDDEN,
        ),
        (
            "another site",
            retry(Some(&cookie), Some(&csrf), Some("https://evil.example")),
            StatusCode::FORBIDDEN,
        ),
    ];
    for (what, req, status) in refusals {
        let a = send(&app, req).await;
        assert_eq!(a.status, status, "{what}: {}", a.body);
        assert_eq!(scalar(&pg, PARKED_ROWS).await, 4, "{what} moved rows");
        assert_eq!(
            scalar(&pg, AUDIT_ROWS).await,
            0,
            "{what} was audited as done"
        );
    }
    let a = send(
        &app,
        retry(Some(&cookie), Some(&csrf), Some("http://127.0.0.1:9480")),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(scalar(&pg, PARKED_ROWS).await, 0);
}

#[tokio::test]
async fn read_only_renders_no_action_and_serves_none() {
    let pg = seeded().await;
    let app = console(&pg, true);
    let (cookie, _) = {
        let a = send(
            &app,
            post("/login", None, &[("actor", "ana"), ("token", TOKEN)]),
        )
        .await;
        (a.cookie.unwrap().split(';').next().unwrap().to_owned(), ())
    };
    for path in [
        "/",
        "/outbox",
        "/consumers",
        "/consumers/letters?group=settlement",
        "/effects",
        "/proof",
        "/audit",
    ] {
        let a = send(&app, get(path, Some(&cookie))).await;
        assert_eq!(a.status, StatusCode::OK, "{path}");
        assert!(
            !a.body.contains("method=\"post\""),
            "{path} offers an action: {}",
            a.body
        );
        assert!(!a.body.contains("replay…"), "{path} links a replay");
    }
    for path in [
        "/outbox/retry",
        "/consumers/replay",
        "/effects/resolve",
        "/effects/retry",
        "/proof/run",
    ] {
        let a = send(
            &app,
            post(path, Some(&cookie), &[("csrf", "x"), ("why", "y")]),
        )
        .await;
        assert!(
            a.status == StatusCode::NOT_FOUND || a.status == StatusCode::METHOD_NOT_ALLOWED,
            "{path}: {}",
            a.status
        );
    }
    assert_eq!(scalar(&pg, PARKED_ROWS).await, 4);
}

#[tokio::test]
async fn parked_rows_return_to_pending_by_reason_with_an_audit_row_and_show_as_text() {
    let pg = seeded().await;
    let app = console(&pg, false);
    let (cookie, csrf) = login(&app).await;
    let page = send(&app, get("/outbox", Some(&cookie))).await.body;
    assert!(
        page.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
        "escaped"
    );
    assert!(!page.contains(HOSTILE), "a payload is never markup");
    assert!(page.contains(PARKED));
    let empty_why = send(
        &app,
        post(
            "/outbox/retry",
            Some(&cookie),
            &[("csrf", &csrf), ("why", " "), ("reason", PARKED)],
        ),
    )
    .await;
    assert_eq!(empty_why.status, StatusCode::BAD_REQUEST);
    let a = send(
        &app,
        post(
            "/outbox/retry",
            Some(&cookie),
            &[
                ("csrf", &csrf),
                ("why", "topic created"),
                ("reason", PARKED),
            ],
        ),
    )
    .await;
    assert!(
        a.body.contains("4 row(s) returned to pending"),
        "{}",
        a.body
    );
    assert_eq!(scalar(&pg, PARKED_ROWS).await, 0);
    let audit = send(&app, get("/audit", Some(&cookie))).await.body;
    assert!(
        audit.contains("outbox.retry")
            && audit.contains("topic created")
            && audit.contains(">ana<"),
        "{audit}"
    );
    assert_eq!(
        scalar(&pg, "SELECT count(*) FROM idem_audit WHERE actor = 'ana' AND action = 'outbox.retry' AND affected = 4").await,
        1
    );
}

#[tokio::test]
async fn a_replay_is_dry_run_first_then_requested_with_an_audit_row() {
    let pg = seeded().await;
    let app = console(&pg, false);
    let (cookie, csrf) = login(&app).await;
    let requested = "SELECT count(*) FROM idem_dead_letters WHERE replay_requested_at IS NOT NULL";
    let dry = send(
        &app,
        get(
            "/consumers/replay?group=settlement&reason=the%20order%20is%20unknown",
            Some(&cookie),
        ),
    )
    .await;
    assert_eq!(dry.status, StatusCode::OK);
    assert!(
        dry.body.contains("nothing has changed") && dry.body.contains("Confirm the replay"),
        "{}",
        dry.body
    );
    assert_eq!(
        scalar(&pg, requested).await,
        0,
        "the dry run requests nothing"
    );
    let form = [
        ("csrf", csrf.as_str()),
        ("why", "order service fixed"),
        ("group", "settlement"),
        ("reason", "the order is unknown"),
    ];
    let a = send(&app, post("/consumers/replay", Some(&cookie), &form)).await;
    assert!(a.body.contains("3 replay(s) requested"), "{}", a.body);
    assert_eq!(scalar(&pg, requested).await, 3);
    assert_eq!(
        scalar(
            &pg,
            "SELECT count(*) FROM idem_dead_letters WHERE replay_requested_by = 'ana'"
        )
        .await,
        3
    );
    assert_eq!(
        scalar(
            &pg,
            "SELECT count(*) FROM idem_audit WHERE action = 'dead_letters.replay' AND affected = 3"
        )
        .await,
        1
    );
}

#[tokio::test]
async fn an_unknown_intent_resolved_by_a_click_leaves_an_audit_row() {
    let pg = seeded().await;
    let app = console(&pg, false);
    let (cookie, csrf) = login(&app).await;
    let id = scalar(
        &pg,
        "SELECT id FROM idem_effect_intents WHERE status = 'unknown'",
    )
    .await
    .to_string();
    let form = [
        ("csrf", csrf.as_str()),
        ("why", "the remote shows the award"),
        ("id", id.as_str()),
        ("resolution", "applied"),
    ];
    let a = send(&app, post("/effects/resolve", Some(&cookie), &form)).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(
        scalar(
            &pg,
            &format!(
                "SELECT count(*) FROM idem_effect_intents WHERE id = {id} AND status = 'done'"
            )
        )
        .await,
        1
    );
    assert_eq!(
        scalar(
            &pg,
            "SELECT count(*) FROM idem_audit WHERE action = 'effects.applied' AND affected = 1"
        )
        .await,
        1
    );
    let again = send(&app, post("/effects/resolve", Some(&cookie), &form)).await;
    assert_eq!(
        again.status,
        StatusCode::CONFLICT,
        "a done intent is not settled twice"
    );
    assert_eq!(
        scalar(
            &pg,
            "SELECT count(*) FROM idem_audit WHERE outcome LIKE 'refused%'"
        )
        .await,
        1
    );
}

/// A compensation endpoint on loopback: `POST /compensations/ok` answers 200 and
/// `/compensations/fail` 500; each request's `Idempotency-Key` is kept.
async fn compensation_remote() -> (String, Arc<Mutex<Vec<String>>>) {
    let keys = Arc::new(Mutex::new(Vec::new()));
    let seen = keys.clone();
    let app = Router::new().route(
        "/compensations/{outcome}",
        axum::routing::post(
            move |Path(outcome): Path<String>, headers: axum::http::HeaderMap| async move {
                let key = headers
                    .get("idempotency-key")
                    .map(|v| v.to_str().unwrap().to_owned());
                seen.lock().unwrap().push(key.unwrap_or_default());
                if outcome == "ok" {
                    (StatusCode::OK, "reversed")
                } else {
                    (StatusCode::INTERNAL_SERVER_ERROR, "down")
                }
            },
        ),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (base, keys)
}

fn compensating_console(pg: &Pg, template: String) -> Router {
    let store = AnyStore::open(AnyPool::Postgres(pg.pool().clone()), TableNames::default());
    let policy = EffectPolicy {
        compensation: Some(Arc::new(HttpCompensation::new(template, None))),
        ..EffectPolicy::default()
    };
    let config = ConsoleConfig {
        token: Some(Token::new(TOKEN).unwrap()),
        read_only: false,
        compensations: Some(Compensations {
            dispatcher: DispatcherConfig::default(),
            effects: vec![("points.award".into(), policy)],
        }),
        ..ConsoleConfig::default()
    };
    let db = Database {
        name: "orders".into(),
        store,
    };
    Console::new(vec![db], config).router()
}

#[tokio::test]
async fn a_compensation_by_a_click_runs_once_parks_the_intent_and_is_audited() {
    let pg = seeded().await;
    let (base, keys) = compensation_remote().await;
    let plain = console(&pg, false);
    let (cookie, _) = login(&plain).await;
    let page = send(&plain, get("/effects", Some(&cookie))).await.body;
    assert!(
        !page.contains("value=\"compensate\""),
        "no compensation is offered without one configured"
    );

    let app = compensating_console(&pg, format!("{base}/compensations/ok"));
    let (cookie, csrf) = login(&app).await;
    let page = send(&app, get("/effects", Some(&cookie))).await.body;
    assert!(page.contains("value=\"compensate\""), "{page}");
    let id = scalar(
        &pg,
        "SELECT id FROM idem_effect_intents WHERE status = 'unknown'",
    )
    .await
    .to_string();
    let form = [
        ("csrf", csrf.as_str()),
        ("why", "the customer cancelled"),
        ("id", id.as_str()),
        ("resolution", "compensate"),
    ];
    let a = send(&app, post("/effects/resolve", Some(&cookie), &form)).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(keys.lock().unwrap().len(), 1, "the compensation ran once");
    assert!(keys.lock().unwrap()[0].ends_with("points.award.compensate\""));
    let status =
        format!("SELECT count(*) FROM idem_effect_intents WHERE id = {id} AND status = 'parked'");
    assert_eq!(scalar(&pg, &status).await, 1, "parked for review");
    let audited = "SELECT count(*) FROM idem_audit WHERE action = 'effects.compensate' \
                   AND affected = 1 AND outcome LIKE 'done: compensated by%'";
    assert_eq!(scalar(&pg, audited).await, 1);

    let fail = compensating_console(&pg, format!("{base}/compensations/fail"));
    let (cookie, csrf) = login(&fail).await;
    let parked = scalar(
        &pg,
        "SELECT id FROM idem_effect_intents WHERE idem_key = 'k2'",
    )
    .await
    .to_string();
    let before = scalar(
        &pg,
        "SELECT count(*) FROM idem_effect_intents WHERE status = 'parked'",
    )
    .await;
    let form = [
        ("csrf", csrf.as_str()),
        ("why", "the customer cancelled"),
        ("id", parked.as_str()),
        ("resolution", "compensate_retry"),
    ];
    let a = send(&fail, post("/effects/resolve", Some(&cookie), &form)).await;
    assert_eq!(a.status, StatusCode::CONFLICT, "{}", a.body);
    assert!(
        a.body.contains("500"),
        "the remote's refusal is shown: {}",
        a.body
    );
    assert_eq!(
        scalar(
            &pg,
            "SELECT count(*) FROM idem_effect_intents WHERE status = 'parked'"
        )
        .await,
        before,
        "a failed compensation leaves the intent as it was"
    );
    let failed = "SELECT count(*) FROM idem_audit WHERE action = 'effects.compensate_retry' \
                  AND affected = 0 AND outcome LIKE 'failed:%'";
    assert_eq!(scalar(&pg, failed).await, 1);
}

#[tokio::test]
async fn the_overview_shows_the_databases_numbers() {
    let pg = seeded().await;
    let app = console(&pg, false);
    let (cookie, _) = login(&app).await;
    let page = send(&app, get("/", Some(&cookie))).await.body;
    let text = strip(&page);
    assert!(
        text.contains("Outbox · orders amber pending 2 parked 4"),
        "{text}"
    );
    assert!(text.contains("Group settlement amber"), "{text}");
    assert!(text.contains("dead letters 3"), "{text}");
    assert!(text.contains("unknown 1 parked 1"), "{text}");
}

/// The page's text, tags removed, spaces squeezed.
fn strip(html: &str) -> String {
    let mut out = String::new();
    let mut tag = false;
    for c in html.chars() {
        match c {
            '<' => {
                tag = true;
                out.push(' ');
            }
            '>' => tag = false,
            c if !tag => out.push(c),
            _ => {}
        }
    }
    out.split_whitespace().collect::<Vec<_>>().join(" ")
}
