//! Who may act: an operator logs in with the console's token and their name, and gets a
//! session (an `HttpOnly`, `SameSite=Strict` cookie) and a CSRF token that every action's form
//! carries back. Pure decisions; the handlers are in `pages::login`.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The session cookie's name.
pub(crate) const COOKIE: &str = "idem_console";
/// How long a session lasts.
pub(crate) const SESSION_TTL: Duration = Duration::from_secs(8 * 3600);
/// Longest operator name.
const MAX_ACTOR: usize = 64;

/// The console's operator token. Never shown: its `Debug` says only that it is set.
#[derive(Clone)]
pub struct Token(String);

impl Token {
    /// A token; refused when shorter than 16 characters (a guessable one would let anyone act).
    pub fn new(token: impl Into<String>) -> Result<Token, String> {
        let token = token.into().trim().to_owned();
        if token.chars().count() < 16 {
            return Err("the console token must be at least 16 characters".to_owned());
        }
        Ok(Token(token))
    }

    /// Whether `given` is the token, in time that does not depend on where they differ.
    pub fn matches(&self, given: &str) -> bool {
        same(self.0.as_bytes(), given.trim().as_bytes())
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(set)")
    }
}

/// Equality whose time depends only on the lengths.
fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A random secret of 244 bits (two v4 UUIDs, from the operating system's generator).
pub(crate) fn secret() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// An operator's name as the audit records it: 1 to 64 characters, letters, digits, spaces and
/// `.-_@`, trimmed.
pub(crate) fn actor(name: &str) -> Result<String, String> {
    let name = name.trim();
    let fine = |c: char| c.is_alphanumeric() || " .-_@".contains(c);
    if name.is_empty() || name.chars().count() > MAX_ACTOR || !name.chars().all(fine) {
        return Err(format!(
            "your name: 1 to {MAX_ACTOR} letters, digits, spaces or . - _ @"
        ));
    }
    Ok(name.to_owned())
}

/// A logged-in operator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Session {
    /// Their name, recorded with each action.
    pub(crate) actor: String,
    /// The token each action's form must carry.
    pub(crate) csrf: String,
    expires: Instant,
}

/// The open sessions, by cookie value.
#[derive(Debug, Default)]
pub(crate) struct Sessions(Mutex<HashMap<String, Session>>);

impl Sessions {
    /// Opens a session for `actor`; returns the cookie value.
    pub(crate) fn open(&self, actor: String) -> String {
        let id = secret();
        let session = Session {
            actor,
            csrf: secret(),
            expires: Instant::now() + SESSION_TTL,
        };
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        map.retain(|_, s| s.expires > Instant::now());
        map.insert(id.clone(), session);
        id
    }

    /// The session of cookie value `id`, if it is open.
    pub(crate) fn get(&self, id: &str) -> Option<Session> {
        let map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        map.get(id).filter(|s| s.expires > Instant::now()).cloned()
    }

    /// Ends the session of cookie value `id`.
    pub(crate) fn close(&self, id: &str) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).remove(id);
    }
}

/// The session cookie's value in a `Cookie` header.
pub(crate) fn cookie(header: &str) -> Option<&str> {
    header
        .split(';')
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v)
}

/// The `Set-Cookie` value that opens (or, with an empty id, ends) a session.
pub(crate) fn set_cookie(id: &str) -> String {
    let age = if id.is_empty() {
        0
    } else {
        SESSION_TTL.as_secs()
    };
    format!("{COOKIE}={id}; Path=/; HttpOnly; SameSite=Strict; Max-Age={age}")
}

/// Why an action is refused, before it runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// No session: log in first.
    NoCredential,
    /// The form's CSRF token is missing or not the session's.
    BadCsrf,
    /// The request came from another site (its `Origin` is not this console).
    CrossSite,
}

/// Whether an action may run: a session, the session's CSRF token in the form, and no
/// `Origin` other than the console's own `host` (an opaque `null` origin, which a sandboxed
/// frame or a `data:` page sends, is another site's).
pub(crate) fn check_action(
    session: Option<&Session>,
    form_csrf: &str,
    origin: Option<&str>,
    host: Option<&str>,
) -> Result<(), Refusal> {
    let Some(session) = session else {
        return Err(Refusal::NoCredential);
    };
    if let Some(origin) = origin {
        let origin_host = origin.split_once("://").map_or(origin, |(_, h)| h);
        if Some(origin_host) != host {
            return Err(Refusal::CrossSite);
        }
    }
    if !same(session.csrf.as_bytes(), form_csrf.as_bytes()) {
        return Err(Refusal::BadCsrf);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_long_matched_whole_and_never_printed() {
        assert!(Token::new("short").is_err());
        let t = Token::new("0123456789abcdef-secret").unwrap_or_else(|e| panic!("{e}"));
        assert!(t.matches("0123456789abcdef-secret"));
        assert!(t.matches(" 0123456789abcdef-secret\n"));
        assert!(!t.matches("0123456789abcdef-secreT"));
        assert!(!t.matches("0123456789abcdef-secret-and-more"));
        assert!(!t.matches(""));
        assert_eq!(format!("{t:?}"), "Token(set)");
    }

    #[test]
    fn names_are_checked_before_they_reach_the_audit() {
        assert_eq!(actor("  ana@ops "), Ok("ana@ops".to_owned()));
        assert!(actor("").is_err());
        assert!(actor("<script>").is_err());
        assert!(actor(&"a".repeat(65)).is_err());
    }

    #[test]
    fn an_action_needs_a_session_its_csrf_token_and_no_foreign_origin() {
        let sessions = Sessions::default();
        let id = sessions.open("ana".into());
        let s = sessions.get(&id).unwrap_or_else(|| panic!("no session"));
        let host = Some("127.0.0.1:9480");
        assert_eq!(
            check_action(None, &s.csrf, None, host),
            Err(Refusal::NoCredential)
        );
        assert_eq!(
            check_action(Some(&s), "", None, host),
            Err(Refusal::BadCsrf)
        );
        assert_eq!(
            check_action(Some(&s), "x", None, host),
            Err(Refusal::BadCsrf)
        );
        assert_eq!(
            check_action(Some(&s), &s.csrf, Some("https://evil.example"), host),
            Err(Refusal::CrossSite)
        );
        assert_eq!(
            check_action(Some(&s), &s.csrf, Some("http://127.0.0.1:9480"), host),
            Ok(())
        );
        assert_eq!(check_action(Some(&s), &s.csrf, None, host), Ok(()));
        assert_eq!(
            check_action(Some(&s), &s.csrf, Some("null"), host),
            Err(Refusal::CrossSite)
        );
        sessions.close(&id);
        assert!(sessions.get(&id).is_none());
    }

    #[test]
    fn the_cookie_is_read_back_and_set_http_only_and_same_site() {
        assert_eq!(cookie("a=b; idem_console=xyz; c=d"), Some("xyz"));
        assert_eq!(cookie("a=b"), None);
        let set = set_cookie("xyz");
        assert!(
            set.contains("HttpOnly") && set.contains("SameSite=Strict"),
            "{set}"
        );
        assert!(set_cookie("").contains("Max-Age=0"));
    }
}
