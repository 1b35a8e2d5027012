//! An OAuth 2 identity provider for tests, on 127.0.0.1 over HTTP: the client-credentials
//! grant at `/token` (RFC 6749 §4.4; the client authenticates with HTTP Basic, as librdkafka
//! does, or with `client_id`/`client_secret` in the form) answers with an ES256-signed JWT, and
//! `/jwks` serves the JWK set of the signing key.
//!
//! The key, its id, the issuer and the audience are those `scripts/kafka prepare --security
//! sasl_ssl_oauth` writes to `DIR/oauth` (`signing.key`, `jwks.json`, `kid`, `issuer`,
//! `audience`); they are read at each request, so the provider can listen (and its JWKS URL be
//! handed to `prepare`) before they exist. A token carries `iss`, `sub` (the client's subject:
//! the broker's principal), `aud`, `iat`, `nbf`, `exp` (an hour on), `client_id`, and `scope`
//! when one was asked for. A wrong client secret gets `401` with
//! `{"error":"invalid_client",…}`, whose body never repeats a credential.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use ring::signature::{ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair};

/// A client the provider knows.
#[derive(Clone, Debug)]
pub struct OidcClient {
    /// The client id.
    pub id: String,
    /// The client secret.
    pub secret: String,
    /// The `sub` of its tokens.
    pub subject: String,
    /// The `aud` of its tokens (none: the audience the broker expects, `DIR/oauth/audience`).
    pub audience: Option<String>,
}

/// A token the provider issued, or a request it refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Grant {
    /// A token for this client id.
    Issued(String),
    /// A refused request, and the `error` code it got.
    Refused(&'static str),
}

struct Provider {
    dir: PathBuf,
    clients: Mutex<Vec<OidcClient>>,
    grants: Mutex<Vec<Grant>>,
}

/// The running provider. Its thread serves until the test binary exits.
pub struct IdentityProvider {
    addr: SocketAddr,
    provider: Arc<Provider>,
}

impl IdentityProvider {
    /// Starts serving on a free loopback port; `dir` is `DIR/oauth` of the broker's run.
    pub fn start(dir: &Path) -> Self {
        let provider = Arc::new(Provider {
            dir: dir.to_owned(),
            clients: Mutex::new(Vec::new()),
            grants: Mutex::new(Vec::new()),
        });
        let listener = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap_or_else(|e| panic!("cannot bind the identity provider: {e}"));
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new()
            .route("/token", post(token))
            .route("/jwks", get(jwks))
            .with_state(provider.clone());
        std::thread::Builder::new()
            .name("identity-provider".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async move {
                    let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                    axum::serve(listener, app).await.unwrap();
                });
            })
            .unwrap();
        IdentityProvider { addr, provider }
    }

    /// `http://127.0.0.1:PORT/token`.
    pub fn token_endpoint(&self) -> String {
        format!("http://{}/token", self.addr)
    }

    /// `http://127.0.0.1:PORT/jwks`.
    pub fn jwks_url(&self) -> String {
        format!("http://{}/jwks", self.addr)
    }

    /// Registers `client` (a later client of the same id replaces it).
    pub fn add_client(&self, client: OidcClient) {
        let mut clients = self.provider.clients.lock().unwrap();
        clients.retain(|c| c.id != client.id);
        clients.push(client);
    }

    /// Registers a client `id` with a random secret and subject `service-account-ID`, its
    /// tokens for the broker's audience.
    pub fn new_client(&self, id: &str) -> OidcClient {
        let client = OidcClient {
            id: id.to_owned(),
            secret: format!("secret-{}", uuid::Uuid::new_v4().simple()),
            subject: format!("service-account-{id}"),
            audience: None,
        };
        self.add_client(client.clone());
        client
    }

    /// Every grant so far, in order.
    pub fn grants(&self) -> Vec<Grant> {
        self.provider.grants.lock().unwrap().clone()
    }
}

fn oauth_error(status: StatusCode, error: &'static str, description: &str) -> Response {
    let body = serde_json::json!({ "error": error, "error_description": description });
    let mut response = (status, axum::Json(body)).into_response();
    if status == StatusCode::UNAUTHORIZED {
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Basic realm=\"idem-test-idp\""),
        );
    }
    response
}

/// `application/x-www-form-urlencoded` into its fields.
fn form(body: &str) -> HashMap<String, String> {
    body.split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                match u8::from_str_radix(s.get(i + 1..i + 3).unwrap_or(""), 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn read(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(name))
        .unwrap_or_else(|e| panic!("{}/{name}: {e}", dir.display()))
        .trim()
        .to_owned()
}

async fn token(State(p): State<Arc<Provider>>, headers: HeaderMap, body: String) -> Response {
    let refuse = |status, error, description: &str| {
        p.grants.lock().unwrap().push(Grant::Refused(error));
        oauth_error(status, error, description)
    };
    let fields = form(&body);
    let basic = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Basic "))
        .and_then(|b| STANDARD.decode(b.trim()).ok())
        .and_then(|b| String::from_utf8(b).ok())
        .and_then(|s| s.split_once(':').map(|(i, s)| (i.to_owned(), s.to_owned())));
    let credentials = basic.or_else(|| {
        Some((
            fields.get("client_id")?.clone(),
            fields.get("client_secret")?.clone(),
        ))
    });
    let Some((id, secret)) = credentials else {
        return refuse(
            StatusCode::UNAUTHORIZED,
            "invalid_client",
            "no client credentials",
        );
    };
    let client = p
        .clients
        .lock()
        .unwrap()
        .iter()
        .find(|c| c.id == id && c.secret == secret)
        .cloned();
    let Some(client) = client else {
        return refuse(
            StatusCode::UNAUTHORIZED,
            "invalid_client",
            "client authentication failed",
        );
    };
    if fields.get("grant_type").map(String::as_str) != Some("client_credentials") {
        return refuse(
            StatusCode::BAD_REQUEST,
            "unsupported_grant_type",
            "only client_credentials is supported",
        );
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let audience = client
        .audience
        .clone()
        .unwrap_or_else(|| read(&p.dir, "audience"));
    let scope = fields.get("scope").filter(|s| !s.is_empty()).cloned();
    let mut claims = serde_json::json!({
        "iss": read(&p.dir, "issuer"),
        "sub": client.subject,
        "aud": audience,
        "iat": now,
        "nbf": now,
        "exp": now + 3600,
        "client_id": client.id,
    });
    if let Some(scope) = &scope {
        claims["scope"] = scope.clone().into();
    }
    let header = serde_json::json!({ "alg": "ES256", "typ": "JWT", "kid": read(&p.dir, "kid") });
    let jwt = sign(&p.dir, &header, &claims);
    p.grants
        .lock()
        .unwrap()
        .push(Grant::Issued(client.id.clone()));
    let mut response = serde_json::json!({
        "access_token": jwt,
        "token_type": "Bearer",
        "expires_in": 3600,
    });
    if let Some(scope) = scope {
        response["scope"] = scope.into();
    }
    axum::Json(response).into_response()
}

/// The compact JWS of `claims` under `header`, signed with `DIR/oauth/signing.key`.
fn sign(dir: &Path, header: &serde_json::Value, claims: &serde_json::Value) -> String {
    let pem = read(dir, "signing.key");
    let der: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
    let der = STANDARD.decode(der).unwrap();
    let rng = ring::rand::SystemRandom::new();
    let key = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &der, &rng)
        .unwrap_or_else(|e| panic!("{}/signing.key: {e}", dir.display()));
    let input = format!(
        "{}.{}",
        URL_SAFE_NO_PAD.encode(header.to_string()),
        URL_SAFE_NO_PAD.encode(claims.to_string())
    );
    let signature = key.sign(&rng, input.as_bytes()).unwrap();
    format!("{input}.{}", URL_SAFE_NO_PAD.encode(signature.as_ref()))
}

async fn jwks(State(p): State<Arc<Provider>>) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        read(&p.dir, "jwks.json"),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn form_fields_are_percent_decoded() {
        let f = form("grant_type=client_credentials&scope=kafka%3Awrite+read&x=%zz");
        assert_eq!(f["grant_type"], "client_credentials");
        assert_eq!(f["scope"], "kafka:write read");
        assert_eq!(f["x"], "%zz");
    }
}
