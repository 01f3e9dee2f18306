//! A small WebDriver client (the W3C protocol over HTTP, with reqwest) and
//! a headless Chromium driven through chromedriver: enough to open pages,
//! find elements, type, click, wait for what a page shows, and save
//! screenshots. Tests that need it skip, saying so, where Chromium or
//! chromedriver is absent (`.ci/run` installs both).

use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine;
use serde_json::{Value, json};
use tokio::process::{Child, Command};

const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

fn found(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    })
}

/// A browser session in a headless Chromium.
pub struct Browser {
    _driver: Child,
    _profile: tempfile::TempDir,
    http: reqwest::Client,
    session: String,
}

impl Drop for Browser {
    fn drop(&mut self) {
        if let Some(group) = self._driver.id() {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", "--", &format!("-{group}")])
                .stderr(std::process::Stdio::null())
                .status();
        }
    }
}

/// A page element.
pub struct Element<'a> {
    browser: &'a Browser,
    id: String,
}

impl Browser {
    /// A new browser, or `None` (saying why) where Chromium or chromedriver
    /// is not installed.
    pub async fn start() -> Option<Self> {
        let chromium = found("chromium").or_else(|| found("chromium-browser"));
        let (Some(chromium), Some(driver)) = (chromium, found("chromedriver")) else {
            evalfleet_testkit::skip!(
                "chromium and chromedriver are not installed (apt-get install chromium chromium-driver)"
            );
            return None;
        };
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        // In a process group of its own, which the browsers it starts join:
        // dropping the browser ends them all (killing chromedriver alone
        // would leave every Chromium it started running).
        let child = Command::new(driver)
            .arg(format!("--port={port}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::new();
        let base = format!("http://127.0.0.1:{port}");
        // chromedriver answers /status once it listens.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(r) = http.get(format!("{base}/status")).send().await
                && r.status().is_success()
            {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "chromedriver did not start"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let profile = tempfile::tempdir().unwrap();
        let capabilities = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium,
                "args": [
                    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                    "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync",
                    "--window-size=1400,1000",
                    format!("--user-data-dir={}", profile.path().display()),
                ],
            },
        }}});
        let created: Value = http
            .post(format!("{base}/session"))
            .json(&capabilities)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let session = created["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no browser session: {created}"))
            .to_owned();
        Some(Self {
            _driver: child,
            _profile: profile,
            http,
            session: format!("{base}/session/{session}"),
        })
    }

    async fn post(&self, path: &str, body: Value) -> Value {
        let answer: Value = self
            .http
            .post(format!("{}{path}", self.session))
            .json(&body)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        answer["value"].clone()
    }

    async fn get(&self, path: &str) -> Value {
        let answer: Value = self
            .http
            .get(format!("{}{path}", self.session))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        answer["value"].clone()
    }

    pub async fn open(&self, url: &str) {
        self.post("/url", json!({"url": url})).await;
    }

    pub async fn url(&self) -> String {
        self.get("/url")
            .await
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// The elements matching `css` now.
    pub async fn all(&self, css: &str) -> Vec<Element<'_>> {
        let found = self
            .post("/elements", json!({"using": "css selector", "value": css}))
            .await;
        found
            .as_array()
            .map(|list| {
                list.iter()
                    .filter_map(|e| e[ELEMENT].as_str())
                    .map(|id| Element {
                        browser: self,
                        id: id.to_owned(),
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Waits (for at most `limit`) until `condition` holds of the page, as
    /// a script that returns true or false.
    pub async fn wait_for(&self, what: &str, script: &str, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let value = self
                .post("/execute/sync", json!({"script": script, "args": []}))
                .await;
            if value == Value::Bool(true) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the page never showed {what} (last: {value})"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Runs a Chrome DevTools Protocol command in the page, with its answer.
    pub async fn cdp(&self, cmd: &str, params: Value) -> Value {
        self.post("/goog/cdp/execute", json!({"cmd": cmd, "params": params}))
            .await
    }

    /// The value of a script run in the page.
    pub async fn eval(&self, script: &str) -> Value {
        self.post("/execute/sync", json!({"script": script, "args": []}))
            .await
    }

    /// The one element matching `css`, waiting for it to appear.
    pub async fn find(&self, css: &str) -> Element<'_> {
        let script = format!(
            "return document.querySelector({}) !== null;",
            serde_json::to_string(css).unwrap()
        );
        self.wait_for(css, &script, Duration::from_secs(20)).await;
        self.all(css).await.into_iter().next().unwrap()
    }

    /// Saves a screenshot as `dir/name.png`.
    pub async fn screenshot(&self, dir: &Path, name: &str) -> PathBuf {
        let data = self.get("/screenshot").await;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(data.as_str().unwrap_or_default())
            .unwrap();
        std::fs::create_dir_all(dir).unwrap();
        let path = dir.join(format!("{name}.png"));
        std::fs::write(&path, bytes).unwrap();
        path
    }
}

impl Element<'_> {
    pub async fn click(&self) {
        self.browser
            .post(&format!("/element/{}/click", self.id), json!({}))
            .await;
    }

    pub async fn type_text(&self, text: &str) {
        self.browser
            .post(&format!("/element/{}/clear", self.id), json!({}))
            .await;
        self.browser
            .post(
                &format!("/element/{}/value", self.id),
                json!({"text": text}),
            )
            .await;
    }

    pub async fn text(&self) -> String {
        self.browser
            .get(&format!("/element/{}/text", self.id))
            .await
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }
}

/// Where screenshots go: `target/test-artifacts/dashboard` (or
/// `$EVALFLEET_ARTIFACTS`).
pub fn artifacts() -> PathBuf {
    std::env::var_os("EVALFLEET_ARTIFACTS").map_or_else(
        || {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../target/test-artifacts/dashboard"
            ))
        },
        PathBuf::from,
    )
}
