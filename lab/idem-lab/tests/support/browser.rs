//! Chromium under chromedriver, driven over WebDriver, for the tests of the operator console;
//! and the console itself as a process of the lab binary.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use fantoccini::{Client, ClientBuilder, Locator};
use idem_conformance::process::{Proc, eventually};

/// The operators' token the consoles of the tests run with.
pub(crate) const TOKEN: &str = "console-token-for-the-browser-tests";

/// Starts `cmd` (an `idem-lab console …` command) with [`TOKEN`]; the process and the URL
/// it serves on.
pub(crate) fn console(mut cmd: Command) -> (Proc, String) {
    cmd.env("IDEM_CONSOLE_TOKEN", TOKEN);
    let p = Proc::spawn("console", cmd);
    let line = p.wait_for_line("listening on http://", Duration::from_secs(30));
    let at = line.find("http://").unwrap();
    let url = line[at..].split_whitespace().next().unwrap().to_owned();
    (p, url)
}

/// Chromium under chromedriver, headless, at 1280×800.
pub(crate) struct Browser {
    driver: Proc,
    pub(crate) client: Client,
    base: String,
    shots: PathBuf,
}

impl Browser {
    pub(crate) async fn open(base: &str) -> Browser {
        let mut cmd = Command::new("sh");
        // chromedriver says its port on standard output; the harness reads standard error.
        cmd.args(["-c", "exec chromedriver --port=0 >&2"]);
        let driver = Proc::spawn("chromedriver", cmd);
        let line = driver.wait_for_line("started successfully on port", Duration::from_secs(30));
        let port = line
            .trim_end_matches('.')
            .rsplit(' ')
            .next()
            .unwrap()
            .to_owned();
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            serde_json::json!({
                "binary": "/usr/bin/chromium",
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1280,800", "--hide-scrollbars"],
            }),
        );
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        let client = ClientBuilder::new(connector)
            .capabilities(caps)
            .connect(&format!("http://127.0.0.1:{port}"))
            .await
            .unwrap();
        let shots = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("console-screenshots");
        std::fs::create_dir_all(&shots).unwrap();
        Browser {
            driver,
            client,
            base: base.to_owned(),
            shots,
        }
    }

    pub(crate) async fn go(&self, path: &str) {
        self.client
            .goto(&format!("{}{path}", self.base))
            .await
            .unwrap();
    }

    /// The text of the page's main part.
    pub(crate) async fn text(&self) -> String {
        let main = self.client.find(Locator::Css("main")).await.unwrap();
        main.text().await.unwrap()
    }

    /// Saves the page at 1280×800 (`<name>.png`) and at a phone's width (`<name>-phone.png`).
    pub(crate) async fn shot(&self, name: &str) {
        for (w, h, suffix) in [(1280, 800, ""), (390, 844, "-phone")] {
            self.client.set_window_size(w, h).await.unwrap();
            let png = self.client.screenshot().await.unwrap();
            std::fs::write(self.shots.join(format!("{name}{suffix}.png")), png).unwrap();
        }
        self.client.set_window_size(1280, 800).await.unwrap();
    }

    pub(crate) async fn type_in(&self, css: &str, text: &str) {
        let e = self.client.find(Locator::Css(css)).await.unwrap();
        e.send_keys(text).await.unwrap();
    }

    /// Clicks a form's button and waits until the browser shows the answer: the page is marked
    /// before the click, and the answer is a complete document without the mark.
    pub(crate) async fn click(&self, css: &str) {
        self.client
            .execute("window.idemOld = true", vec![])
            .await
            .unwrap();
        let button = self.client.find(Locator::Css(css)).await.unwrap();
        button.click().await.unwrap();
        let answer = "return window.idemOld === undefined && document.readyState === 'complete'";
        eventually("the next page", Duration::from_secs(20), || async {
            let done = self.client.execute(answer, vec![]).await.ok()?;
            (done == serde_json::Value::Bool(true)).then_some(())
        })
        .await;
    }

    pub(crate) async fn login(&self) {
        self.go("/login").await;
        self.type_in("input[name=actor]", "ana").await;
        self.type_in("input[name=token]", TOKEN).await;
        self.click("form.login button").await;
    }

    pub(crate) async fn forms(&self) -> usize {
        self.client
            .find_all(Locator::Css("form[method=post]"))
            .await
            .unwrap()
            .len()
    }

    pub(crate) async fn close(self) {
        self.client.close().await.unwrap();
        drop(self.driver);
    }
}
