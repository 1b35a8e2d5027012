//! `idem console` as a child process of this binary, and an operator's browser: logged in with
//! the console's token, one keep-alive HTTP/1.1 connection over loopback.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use reqwest::StatusCode;
use reqwest::header::{COOKIE, SET_COOKIE};

use crate::bench::child::Child;
use crate::bench::kafka::TempDir;

/// The session cookie's name (`idem_console::auth`).
const SESSION_COOKIE: &str = "idem_console";
/// How long the console may take to serve its first page.
const READY_WITHIN: Duration = Duration::from_secs(60);

/// A running console and a logged-in client of it.
pub(super) struct Console {
    child: Child,
    base: String,
    client: reqwest::Client,
    cookie: String,
    _logs: TempDir,
}

impl Console {
    /// Starts `idem console` over `url` on a free loopback port, sampling every `sample_every`,
    /// with a token of the run's own (in the environment, never on its command line), waits
    /// until it serves, and logs in as the operator `bench`.
    pub(super) async fn start(url: &str, sample_every: Duration) -> anyhow::Result<Self> {
        let logs = TempDir::new("console")?;
        let token = format!("{}", uuid::Uuid::new_v4().simple());
        let port = free_port()?;
        let args = [
            "console".to_owned(),
            "--db".to_owned(),
            url.to_owned(),
            "--listen".to_owned(),
            format!("127.0.0.1:{port}"),
            "--sample-every".to_owned(),
            format!("{}ms", sample_every.as_millis()),
        ];
        let child = Child::spawn(
            "console",
            &args,
            &[("IDEM_CONSOLE_TOKEN", token.clone())],
            &logs.0,
        )?;
        let client = reqwest::Client::builder()
            .no_proxy()
            .http1_only()
            .tcp_nodelay(true)
            .redirect(reqwest::redirect::Policy::none())
            .pool_max_idle_per_host(1)
            .build()
            .context("building the HTTP client")?;
        let mut console = Console {
            child,
            base: format!("http://127.0.0.1:{port}"),
            client,
            cookie: String::new(),
            _logs: logs,
        };
        console.wait_ready().await?;
        console.log_in(&token).await?;
        Ok(console)
    }

    /// Waits until `GET /login` answers 200.
    async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let started = Instant::now();
        loop {
            self.child.check_alive()?;
            let answer = self.client.get(self.url("/login")).send().await;
            if answer.is_ok_and(|r| r.status() == StatusCode::OK) {
                return Ok(());
            }
            if started.elapsed() > READY_WITHIN {
                bail!(
                    "idem console did not serve within {} s; its log ends with:\n{}",
                    READY_WITHIN.as_secs(),
                    self.child.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `POST /login`; keeps the session cookie.
    async fn log_in(&mut self, token: &str) -> anyhow::Result<()> {
        let answer = self
            .client
            .post(self.url("/login"))
            .form(&[("actor", "bench"), ("token", token)])
            .send()
            .await
            .context("logging in to the console")?;
        let cookie = answer
            .headers()
            .get_all(SET_COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .filter_map(|v| v.split(';').next())
            .find(|kv| kv.starts_with(&format!("{SESSION_COOKIE}=")))
            .map(str::to_owned);
        match cookie {
            Some(c) if answer.status().is_redirection() => {
                self.cookie = c;
                Ok(())
            }
            _ => bail!(
                "the console refused the login ({}): no session cookie",
                answer.status()
            ),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// `GET path` with the session; its body, which must be a non-empty 200.
    pub(super) async fn get(&self, path: &str) -> anyhow::Result<String> {
        let answer = self
            .client
            .get(self.url(path))
            .header(COOKIE, &self.cookie)
            .send()
            .await
            .with_context(|| format!("GET {path}"))?;
        let status = answer.status();
        let body = answer
            .text()
            .await
            .with_context(|| format!("reading GET {path}"))?;
        if status != StatusCode::OK || body.is_empty() {
            let start: String = body.chars().take(300).collect();
            bail!(
                "GET {path} answered {status} with {} bytes: {start}",
                body.len()
            );
        }
        Ok(body)
    }

    /// How old the console's newest sample is, as the overview says it (`4 s`).
    pub(super) async fn sample_age(&self) -> anyhow::Result<String> {
        let page = self.get("/").await?;
        let age = page
            .split_once("Sampled ")
            .and_then(|(_, rest)| rest.split_once(" ago"))
            .map(|(age, _)| age.to_owned());
        age.context("the overview does not say when it sampled")
    }

    /// Stops the console (SIGTERM).
    pub(super) async fn stop(self) -> anyhow::Result<()> {
        self.child.stop().await
    }
}

/// A loopback port no one listens on right now.
fn free_port() -> anyhow::Result<u16> {
    let socket = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(socket.local_addr()?.port())
}

/// The seconds an age the overview shows (`12 s`, `3 min`, `1.5 h`) stands for.
pub(super) fn age_seconds(age: &str) -> Option<f64> {
    let (value, unit) = age.split_once(' ')?;
    let value: f64 = value.parse().ok()?;
    match unit {
        "s" => Some(value),
        "min" => Some(value * 60.0),
        "h" => Some(value * 3600.0),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_the_overviews_ages() {
        assert_eq!(super::age_seconds("4 s"), Some(4.0));
        assert_eq!(super::age_seconds("3 min"), Some(180.0));
        assert_eq!(super::age_seconds("1.5 h"), Some(5400.0));
        assert_eq!(super::age_seconds("soon"), None);
    }
}
