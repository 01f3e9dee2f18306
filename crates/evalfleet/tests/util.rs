//! Test helpers: a temporary working directory, the real `evalfleet` binary,
//! mock endpoints on 127.0.0.1:0 and the store the binary writes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use evalfleet_mock::{MockServer, MockSettings};
use evalfleet_store::SqliteStore;
use evalfleet_store::prelude::*;
use evalfleet_types::StateCounts;
use serde_json::Value;
use tokio::process::{Child, Command};

pub const BIN: &str = env!("CARGO_BIN_EXE_evalfleet");

/// A working directory for one test; the binary runs in it.
pub struct Env {
    pub dir: tempfile::TempDir,
}

/// What a finished command printed and returned.
pub struct Ran {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl From<Output> for Ran {
    fn from(out: Output) -> Self {
        Self {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }
}

impl Ran {
    /// The run id the `run` command prints as its one line of stdout.
    pub fn run_id(&self) -> String {
        self.stdout
            .lines()
            .next()
            .unwrap_or_default()
            .trim()
            .to_owned()
    }
}

impl Env {
    pub fn new() -> Self {
        Self {
            dir: tempfile::tempdir().expect("a temporary directory"),
        }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.path(name);
        std::fs::write(&path, text).expect("write a test file");
        path
    }

    /// A JSONL dataset of `n` items `{id, question}`; the mock echoes the
    /// question, so each answer names its item.
    pub fn dataset(&self, name: &str, n: usize) -> PathBuf {
        let mut text = String::new();
        for i in 0..n {
            text.push_str(&format!(
                "{{\"id\": \"item-{i:05}\", \"question\": \"question {i} of {n}\"}}\n"
            ));
        }
        self.write(name, &text)
    }

    pub fn command(&self, args: &[&str]) -> Command {
        self.program(BIN, args)
    }

    /// `program ARGS` in the test's folder, with the environment
    /// [`Env::command`] gives the binary.
    pub fn program(&self, program: &str, args: &[&str]) -> Command {
        let mut command = Command::new(program);
        command
            .args(args)
            .current_dir(self.dir.path())
            .env_remove("EVALFLEET_STORE")
            .env_remove("EVALFLEET_LOG")
            .kill_on_drop(true);
        command
    }

    pub async fn evalfleet(&self, args: &[&str]) -> Ran {
        self.command(args)
            .output()
            .await
            .expect("the evalfleet binary runs")
            .into()
    }

    /// Starts `python3 ARGS` in the test's folder: a server that prints
    /// its port once it listens. Its port, and the process, killed when
    /// dropped however the test ends.
    pub async fn python_server(&self, args: &[&str]) -> (Child, u16) {
        use tokio::io::AsyncBufReadExt;
        let mut server = Command::new("python3")
            .args(args)
            .current_dir(self.dir.path())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 starts");
        // It listens before it prints its port.
        let mut line = String::new();
        tokio::io::BufReader::new(server.stdout.take().unwrap())
            .read_line(&mut line)
            .await
            .unwrap();
        let port = line
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("python3 {args:?} printed no port: {line:?}"));
        (server, port)
    }

    /// Starts the binary without waiting for it.
    pub fn spawn(&self, args: &[&str]) -> Child {
        self.command(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("the evalfleet binary starts")
    }

    pub fn store_path(&self) -> PathBuf {
        self.path("runs/evalfleet.db")
    }

    pub fn store(&self) -> SqliteStore {
        SqliteStore::open_existing(&self.store_path()).expect("the store exists")
    }

    pub fn counts(&self, run_id: &str) -> StateCounts {
        self.store().counts(run_id).expect("the run's counts")
    }

    /// Attempts stored per session of `run_id`, read while the run may be
    /// writing (none while the store's tables are still being made).
    pub fn attempts_by_session(&self, run_id: &str) -> BTreeMap<i64, i64> {
        let conn = rusqlite::Connection::open(self.store_path()).unwrap();
        conn.busy_timeout(Duration::from_secs(30)).unwrap();
        let Ok(mut stmt) = conn.prepare(
            "SELECT a.session, COUNT(*) FROM attempts a JOIN runs r ON r.rid = a.rid
             WHERE r.run_id = ?1 GROUP BY a.session",
        ) else {
            return BTreeMap::new();
        };
        stmt.query_map([run_id], |row| Ok((row.get(0)?, row.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    }

    /// The CSV export of a run: its header and its records.
    pub async fn export_csv(&self, run_id: &str) -> (Vec<String>, Vec<csv::StringRecord>) {
        let ran = self.evalfleet(&["export", run_id, "--format", "csv"]).await;
        assert_eq!(ran.code, Some(0), "export failed: {}", ran.stderr);
        let mut reader = csv::Reader::from_reader(ran.stdout.as_bytes());
        let header = reader
            .headers()
            .unwrap()
            .iter()
            .map(str::to_owned)
            .collect();
        let records = reader.records().map(Result::unwrap).collect();
        (header, records)
    }

    /// The JSONL export of a run, one value per line.
    pub async fn export(&self, run_id: &str) -> Vec<Value> {
        let ran = self
            .evalfleet(&["export", run_id, "--format", "jsonl"])
            .await;
        assert_eq!(ran.code, Some(0), "export failed: {}", ran.stderr);
        ran.stdout
            .lines()
            .map(|line| serde_json::from_str(line).expect("an export line is JSON"))
            .collect()
    }
}

/// A config with `endpoints` (YAML list items, already indented) over
/// `dataset`, echoing the question.
pub fn config(dataset: &Path, endpoints: &str, extra: &str) -> String {
    format!(
        "name: test\n\
         dataset:\n  path: {}\n  id_field: id\n\
         endpoints:\n{endpoints}\n\
         task:\n  messages:\n    - {{ role: user, content: \"{{{{ question }}}}\" }}\n  params: {{ max_tokens: 64 }}\n\
         {extra}\n",
        dataset.display()
    )
}

/// An `external` endpoint entry pointing at `mock`.
pub fn external(name: &str, mock: &MockServer, concurrency: u32) -> String {
    external_with(name, mock, concurrency, "")
}

/// The same, with more keys (`extra` is `key: value, ...`).
pub fn external_with(name: &str, mock: &MockServer, concurrency: u32, extra: &str) -> String {
    let extra = if extra.is_empty() {
        String::new()
    } else {
        format!(", {extra}")
    };
    format!(
        "  - {{ name: {name}, kind: external, base_url: \"{}\", model: m, concurrency: {concurrency}{extra} }}\n",
        mock.base_url()
    )
}

/// Health settings that never mark an endpoint unhealthy, for tests about
/// something else.
pub const NO_HEALTH: &str = "health: { max_failures: 1000000 }";

pub async fn mock(settings: MockSettings) -> MockServer {
    MockServer::start_local(settings)
        .await
        .expect("a mock endpoint starts")
}

/// A mock that answers from a script (`MockSettings::answers`).
pub async fn scripted(answers: PathBuf) -> MockServer {
    mock(MockSettings {
        answers: Some(answers),
        ..MockSettings::default()
    })
    .await
}

pub fn ms(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

/// Polls `condition` every 20 ms until it holds, failing after `limit`.
pub async fn wait_until(limit: Duration, what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + limit;
    while !condition() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(ms(20)).await;
    }
}

/// Export rows by item id, checking that no id appears twice.
pub fn by_id(rows: &[Value]) -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    for row in rows {
        let id = row["item_id"].as_str().expect("an item id").to_owned();
        assert!(
            out.insert(id.clone(), row.clone()).is_none(),
            "item {id} exported twice"
        );
    }
    out
}

/// Sends a signal to a child with the system's `kill`.
pub async fn signal(child: &Child, name: &str) {
    signal_pid(child.id().expect("the child is running"), name).await;
}

/// Sends a signal to the process `pid` with the system's `kill`.
pub async fn signal_pid(pid: u32, name: &str) {
    let status = Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()
        .await
        .expect("kill runs");
    assert!(status.success(), "kill -{name} {pid} failed");
}

/// `../shared/data/NAME` (or `$EVALFLEET_TEST_DATA/NAME`), or `None` when it
/// is absent: tests that need a real dataset skip then (and fail under CI).
pub fn shared_data(name: &str) -> Option<PathBuf> {
    evalfleet_testkit::shared_data!(name)
}

/// `evalfleet cache stats --json` of the store at `store`.
pub async fn cache_stats(env: &Env, store: &Path) -> Value {
    let ran = env
        .evalfleet(&[
            "cache",
            "stats",
            "--json",
            "--store",
            store.to_str().unwrap(),
        ])
        .await;
    serde_json::from_str(&ran.stdout).unwrap()
}

/// The Python that `.ci/run` prepares in `$VAR`, else `python3`, whichever
/// first imports `modules`; `None`, saying so, when neither does.
pub fn python_with(var: &str, modules: &str, what: &str) -> Option<String> {
    let candidates = std::env::var(var)
        .ok()
        .into_iter()
        .chain(["python3".to_owned()]);
    for python in candidates {
        if imports(&python, modules) {
            return Some(python);
        }
    }
    evalfleet_testkit::skip!("no Python with {what} (set {var}; .ci/run makes one)");
    None
}

/// Whether `python` runs and imports `modules`.
pub fn imports(python: &str, modules: &str) -> bool {
    std::process::Command::new(python)
        .args(["-c", &format!("import {modules}")])
        .status()
        .is_ok_and(|s| s.success())
}
