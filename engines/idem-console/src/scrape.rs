//! The services' metrics endpoints ([`crate::ConsoleConfig::metrics_urls`]): what only the running processes know —
//! a consumer stalled on a transient failure, its retries. Plain HTTP on the operator's
//! network; the text exposition format read for the few series the console shows.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Largest metrics page read.
const MAX_BODY: u64 = 8 << 20;
/// How long one endpoint may take.
const TIMEOUT: Duration = Duration::from_secs(3);

/// What the endpoints said, summed over them.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Scraped {
    /// Per (group, topic): the Unix time its batch first failed transiently (0: committing).
    pub(crate) stalled_since: BTreeMap<(String, String), f64>,
    /// Per group: transactions rolled back and retried, since the processes started.
    pub(crate) retries: BTreeMap<String, f64>,
    /// Endpoints that did not answer, with why.
    pub(crate) unreachable: Vec<String>,
}

impl Scraped {
    /// How long `group` has been stalled at `now` (the longest of its topics), if it is.
    pub(crate) fn stalled_for(&self, group: &str, now: f64) -> Option<f64> {
        self.stalled_since
            .iter()
            .filter(|((g, _), since)| g == group && **since > 0.0)
            .map(|(_, since)| now - since)
            .reduce(f64::max)
    }

    /// Adds the series of one exposition page.
    pub(crate) fn read(&mut self, page: &str) {
        for line in page.lines().filter(|l| !l.starts_with('#')) {
            let Some((name, labels, value)) = sample(line) else {
                continue;
            };
            let label = |k: &str| {
                labels
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| (*v).to_owned())
                    .unwrap_or_default()
            };
            match name {
                "idem_consumer_stalled_since_seconds" => {
                    let since = self
                        .stalled_since
                        .entry((label("consumer_group"), label("topic")))
                        .or_default();
                    *since = since.max(value);
                }
                "idem_consumer_retry_total" => {
                    *self.retries.entry(label("consumer_group")).or_default() += value;
                }
                _ => {}
            }
        }
    }
}

/// A series' labels: (name, value).
type Labels<'a> = Vec<(&'a str, &'a str)>;

/// One line of the text format: name, labels, value. `None` for what it is not.
fn sample(line: &str) -> Option<(&str, Labels<'_>, f64)> {
    let (series, value) = line.rsplit_once(' ')?;
    let value: f64 = value.parse().ok()?;
    let Some((name, rest)) = series.split_once('{') else {
        return Some((series, vec![], value));
    };
    let body = rest.strip_suffix('}')?;
    let labels = body
        .split("\",")
        .filter_map(|pair| {
            let (k, v) = pair.split_once("=\"")?;
            Some((k.trim_matches(','), v.trim_end_matches('"')))
        })
        .collect();
    Some((name, labels, value))
}

/// Reads every endpoint; one that fails is listed, the others count.
pub(crate) async fn all(urls: &[String]) -> Scraped {
    let mut out = Scraped::default();
    for url in urls {
        match tokio::time::timeout(TIMEOUT, get(url)).await {
            Ok(Ok(page)) => out.read(&page),
            Ok(Err(e)) => out.unreachable.push(format!("{url}: {e}")),
            Err(_) => out
                .unreachable
                .push(format!("{url}: no answer within {TIMEOUT:?}")),
        }
    }
    out
}

/// The host:port and path of an `http://` URL.
pub(crate) fn split(url: &str) -> Result<(&str, &str), String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("{url} is not an http:// URL"))?;
    Ok(match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/metrics"),
    })
}

async fn get(url: &str) -> Result<String, String> {
    let (host, path) = split(url)?;
    let mut s = tokio::net::TcpStream::connect(host)
        .await
        .map_err(|e| e.to_string())?;
    let req = format!("GET {path} HTTP/1.0\r\nHost: {host}\r\nAccept: text/plain\r\n\r\n");
    s.write_all(req.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut buf = Vec::new();
    s.take(MAX_BODY)
        .read_to_end(&mut buf)
        .await
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&buf);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| "not an HTTP answer".to_owned())?;
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        return Err(head.lines().next().unwrap_or_default().to_owned());
    }
    Ok(body.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_series_shown_are_read_and_summed_over_endpoints() {
        let page = "# HELP x\n\
            idem_consumer_stalled_since_seconds{topic=\"t\",consumer_group=\"settlement\"} 1700000000\n\
            idem_consumer_stalled_since_seconds{topic=\"u\",consumer_group=\"settlement\"} 0\n\
            idem_consumer_retry_total{topic=\"t\",consumer_group=\"settlement\",event_type=\"e\",aggregate_type=\"a\"} 3\n\
            idem_other 1\n";
        let mut s = Scraped::default();
        s.read(page);
        s.read(page);
        assert_eq!(s.retries.get("settlement"), Some(&6.0));
        assert_eq!(s.stalled_for("settlement", 1_700_000_100.0), Some(100.0));
        assert_eq!(s.stalled_for("audit", 1_700_000_100.0), None);
    }

    #[test]
    fn only_http_urls_are_read() {
        assert_eq!(
            split("http://127.0.0.1:9465/metrics"),
            Ok(("127.0.0.1:9465", "/metrics"))
        );
        assert_eq!(
            split("http://127.0.0.1:9465"),
            Ok(("127.0.0.1:9465", "/metrics"))
        );
        assert!(split("https://x/metrics").is_err());
    }
}
