//! Google Sheets as a run's dataset and as its results' place, against the
//! stand-in of the Sheets API and of Google's token endpoint
//! (`evalfleet_mock::sheets`), which checks the signed token requests and
//! records every write.

use std::collections::BTreeMap;
use std::time::Duration;

use evalfleet_mock::sheets::{StandIn, Trusted};
use evalfleet_mock::{MockServer, MockSettings};
use serde_json::{Value, json};

use crate::util::{Env, Ran, by_id, external, mock, wait_until};

const SHEET: &str = "1TestSheetIdForEvalfleet_x";
const KEY_VAR: &str = "EVALFLEET_TEST_SHEET_KEY";

/// A service account's key file made for the test (a fresh RSA key from
/// `openssl`), and the stand-in trusting it, serving on 127.0.0.1:0.
struct Google {
    standin: StandIn,
    url: String,
    key_file: std::path::PathBuf,
    /// The private key's PEM, to look for where it must never be.
    pem: String,
}

async fn google(env: &Env) -> Google {
    let pem_path = env.path("key.pem");
    let made = std::process::Command::new("openssl")
        .args([
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
            "-out",
        ])
        .arg(&pem_path)
        .output()
        .expect("openssl runs (apt install openssl)");
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let pem = std::fs::read_to_string(&pem_path).unwrap();
    std::fs::remove_file(&pem_path).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let key = json!({
        "type": "service_account",
        "project_id": "evalfleet-test",
        "private_key_id": "k1",
        "private_key": pem,
        "client_email": "runner@evalfleet-test.iam.gserviceaccount.com",
        "client_id": "1",
        "token_uri": format!("{url}/token"),
    })
    .to_string();
    let key_file = env.write("service-account.json", &key);
    let standin = StandIn::new(Trusted::from_key_json(&key).unwrap());
    tokio::spawn(standin.clone().serve(listener));
    Google {
        standin,
        url,
        key_file,
        pem,
    }
}

/// A run over tab `Items` of the stand-in's sheet, the mock echoing the
/// question, `exact_match` against `reference`; `sheet` adds keys to
/// `dataset.sheet`. Tries again soon, and its writes are paced to 100 a
/// second, not Google's one.
fn sheet_config(google: &Google, endpoint: &str, sheet: &str) -> String {
    format!(
        "name: sheet\n\
         dataset:\n  sheet:\n    spreadsheet: https://docs.google.com/spreadsheets/d/{SHEET}/edit#gid=0\n    tab: Items\n    key_env: {KEY_VAR}\n    api_url: {}\n    retry_backoff: 10ms\n    quota_wait: 50ms\n    writes_per_minute: 6000\n{sheet}\n\
         endpoints:\n{endpoint}\n\
         task:\n  messages:\n    - {{ role: user, content: \"{{{{ question }}}}\" }}\n  params: {{ max_tokens: 64 }}\n  metrics:\n    - {{ name: exact_match, reference: \"{{{{ reference }}}}\" }}\n",
        google.url
    )
}

/// Rows 2..=n+1 of a tab: `question`, `reference` (wrong for every third
/// row), and the columns results go to (C, D) empty.
fn items(n: usize) -> Vec<Vec<Value>> {
    let mut rows = vec![vec![
        json!("question"),
        json!("reference"),
        json!("answer"),
        json!("score"),
    ]];
    for i in 0..n {
        let reference = if i % 3 == 0 {
            format!("no {i}")
        } else {
            format!("q{i}")
        };
        rows.push(vec![json!(format!("q{i}")), json!(reference)]);
    }
    rows
}

const WRITE: &str = "    write: { C: answer, D: score.exact_match }";

/// Writes `run.yaml`: [`sheet_config`] over a fresh echoing mock that
/// answers in `latency`, at `concurrency`, with `top` (top-level keys)
/// after it. The mock serves while it is kept.
async fn write_run(
    env: &Env,
    google: &Google,
    latency: Duration,
    concurrency: u32,
    sheet: &str,
    top: &str,
) -> MockServer {
    let server = mock(MockSettings {
        latency,
        ..MockSettings::default()
    })
    .await;
    let config = sheet_config(google, &external("m", &server, concurrency), sheet);
    env.write("run.yaml", &format!("{config}{top}"));
    server
}

/// Runs [`sheet_config`] over a fresh echoing mock at `concurrency`.
async fn run_sheet(env: &Env, google: &Google, concurrency: u32, sheet: &str) -> Ran {
    let _server = write_run(env, google, Duration::ZERO, concurrency, sheet, "").await;
    env.with_key(google, &["run", "run.yaml", "-q"]).await
}

impl Env {
    /// The binary with `args`, the key's variable holding `key` (a path,
    /// or the key's JSON), and a cache folder of the test's own.
    fn keyed(&self, key: impl AsRef<std::ffi::OsStr>, args: &[&str]) -> tokio::process::Command {
        let mut command = self.command(args);
        command
            .env(KEY_VAR, key)
            .env("XDG_CACHE_HOME", self.path("cache"));
        command
    }

    async fn with_key(&self, google: &Google, args: &[&str]) -> Ran {
        run(self.keyed(&google.key_file, args)).await
    }
}

async fn run(mut command: tokio::process::Command) -> Ran {
    command.output().await.expect("evalfleet runs").into()
}

/// What the sheet should hold for `n` items of [`items`].
fn expected(n: usize) -> BTreeMap<u32, (Value, Value)> {
    (0..n)
        .map(|i| {
            let score = if i % 3 == 0 { json!(0.0) } else { json!(1.0) };
            (
                u32::try_from(i).unwrap() + 2,
                (json!(format!("q{i}")), score),
            )
        })
        .collect()
}

/// The results the tab holds, by row.
fn written(google: &Google, tab: &str) -> BTreeMap<u32, (Value, Value)> {
    google
        .standin
        .tab(SHEET, tab)
        .into_iter()
        .enumerate()
        .skip(1)
        .filter(|(_, row)| row.len() > 2)
        .map(|(i, row)| {
            let score = row.get(3).cloned().unwrap_or(Value::Null);
            (u32::try_from(i).unwrap() + 1, (row[2].clone(), score))
        })
        .collect()
}

fn twice(google: &Google) -> Vec<(String, u32, u32)> {
    google
        .standin
        .cell_writes()
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .map(|(cell, _)| cell)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sheet_is_read_answered_and_its_results_written_back_fifty_rows_a_write() {
    let env = Env::new();
    let google = google(&env).await;
    google.standin.put_tab(SHEET, "Items", items(120));
    // Only the row count and the end flush a write: the interval is long.
    let sheet = format!("{WRITE}\n    flush_interval: 1h");
    let _server = write_run(&env, &google, Duration::ZERO, 8, &sheet, "").await;
    let checked = env.with_key(&google, &["check", "run.yaml"]).await;
    assert!(
        checked.stdout.contains("120 rows, 0 invalid"),
        "{}{}",
        checked.stdout,
        checked.stderr
    );
    let ran = env.with_key(&google, &["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert_eq!(written(&google, "Items"), expected(120));
    assert!(
        twice(&google).is_empty(),
        "cells written twice: {:?}",
        twice(&google)
    );
    let writes = google.standin.writes();
    let rows: Vec<usize> = writes.iter().map(|w| w.rows).collect();
    assert_eq!(rows.iter().sum::<usize>(), 120, "{rows:?}");
    assert!(writes.iter().all(|w| w.status == 200), "{rows:?}");
    // Every write but the end's waited for 50 rows.
    assert!(
        rows.len() >= 2,
        "results are written as they come, not only at the end: {rows:?}"
    );
    assert!(rows[..rows.len() - 1].iter().all(|r| *r >= 50), "{rows:?}");
    // The rows read are kept where only their owner reads them.
    let snapshots = env.path("cache/evalfleet/sheets");
    let mode = |p: &std::path::Path| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    };
    assert_eq!(mode(&snapshots), 0o700);
    for file in std::fs::read_dir(&snapshots).unwrap() {
        assert_eq!(mode(&file.unwrap().path()), 0o600);
    }

    // The items are the sheet's rows, by place; the export says so.
    let exported = by_id(&env.export(&ran.run_id()).await);
    assert_eq!(exported["r6"]["item"]["question"], "q4");
    assert_eq!(exported["r6"]["item"]["reference"], "q4");
    assert_eq!(exported["r5"]["item"]["reference"], "no 3");

    // The key is in no output, no stored byte, and never sent.
    let mut stored = std::fs::read(env.store_path()).unwrap();
    for wal in ["-wal", "-shm"] {
        let mut path = env.store_path().into_os_string();
        path.push(wal);
        stored.extend(std::fs::read(path).unwrap_or_default());
    }
    let secret: &str = google.pem.lines().nth(3).unwrap();
    assert!(secret.len() > 40);
    let stored = String::from_utf8_lossy(&stored);
    for (place, text) in [
        ("the store", stored.as_ref()),
        ("stdout", &ran.stdout),
        ("stderr", &ran.stderr),
        ("the requests", &google.standin.seen_text()),
    ] {
        assert!(!text.contains(secret), "the private key is in {place}");
        assert!(
            !text.contains("PRIVATE KEY"),
            "the private key is in {place}"
        );
    }
    assert!(
        stored.contains(KEY_VAR),
        "the stored config names the key's variable"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_are_written_every_flush_interval_when_results_come_slowly() {
    let env = Env::new();
    let google = google(&env).await;
    google.standin.put_tab(SHEET, "Items", items(20));
    // 20 answers one at a time, 150 ms each, each committed at once: 3 s.
    let _server = write_run(
        &env,
        &google,
        Duration::from_millis(150),
        1,
        &format!("{WRITE}\n    flush_interval: 500ms"),
        "writer: { batch_size: 1, flush_interval: 10ms }\n",
    )
    .await;
    let ran = env.with_key(&google, &["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert_eq!(written(&google, "Items"), expected(20));
    let rows: Vec<usize> = google.standin.writes().iter().map(|w| w.rows).collect();
    // Far fewer than 50 rows came, so only the interval wrote before the end.
    assert!(rows.len() >= 3, "{rows:?}");
    assert_eq!(rows.iter().sum::<usize>(), 20, "{rows:?}");
    // Every 500 ms, but no two writes closer than min_write_interval (1 s
    // by default), but the last, once the run has ended.
    let at: Vec<u64> = google.standin.writes().iter().map(|w| w.at_ms).collect();
    let paced = &at[..at.len() - 1];
    assert!(paced.windows(2).all(|w| w[1] - w[0] >= 990), "{at:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_go_on_through_429s_and_500s_and_nothing_is_written_twice() {
    let env = Env::new();
    let google = google(&env).await;
    google.standin.put_tab(SHEET, "Items", items(60));
    google.standin.fail_next(&[429, 500, 503, 429]);
    let ran = run_sheet(&env, &google, 8, &format!("{WRITE}\n    flush_rows: 10")).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert_eq!(written(&google, "Items"), expected(60));
    assert!(twice(&google).is_empty(), "{:?}", twice(&google));
    let statuses: Vec<u16> = google.standin.writes().iter().map(|w| w.status).collect();
    assert_eq!(statuses[..4], [429, 500, 503, 429], "{statuses:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sheet_that_keeps_failing_stops_its_writes_not_the_run_and_sync_writes_them_later() {
    let env = Env::new();
    let google = google(&env).await;
    google.standin.put_tab(SHEET, "Items", items(30));
    google.standin.fail_always(Some(500));
    let ran = run_sheet(&env, &google, 8, &format!("{WRITE}\n    retries: 2")).await;
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    assert!(ran.stderr.contains("500"), "{}", ran.stderr);
    assert!(
        ran.stderr
            .contains(&format!("evalfleet sync {}", ran.run_id())),
        "{}",
        ran.stderr
    );
    let run_id = ran.run_id();
    assert_eq!(env.counts(&run_id).done, 30, "every result is in the store");
    let tried = google.standin.writes().len();
    assert_eq!(
        tried, 3,
        "one write, tried again twice, then no more: {tried}"
    );
    assert!(written(&google, "Items").is_empty());

    // Someone edits row 4 meanwhile: its results no longer belong there.
    let mut tab = google.standin.tab(SHEET, "Items");
    tab[3][0] = json!("edited");
    google.standin.put_tab(SHEET, "Items", tab);
    google.standin.fail_always(None);
    let synced = env.with_key(&google, &["sync", &run_id]).await;
    assert_eq!(synced.code, Some(1), "{}{}", synced.stdout, synced.stderr);
    assert!(
        synced
            .stdout
            .contains("29 written, 0 already in the sheet, 1 not written"),
        "{}",
        synced.stdout
    );
    assert!(synced.stderr.contains("r4"), "{}", synced.stderr);
    let mut want = expected(30);
    want.remove(&4);
    assert_eq!(written(&google, "Items"), want);

    // Again: nothing is missing, nothing is written.
    let calls = google.standin.writes().len();
    let again = env.with_key(&google, &["sync", &run_id]).await;
    assert!(
        again.stdout.contains("0 written, 29 already in the sheet"),
        "{}",
        again.stdout
    );
    assert_eq!(google.standin.writes().len(), calls);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_killed_mid_way_resumes_writing_only_the_rows_the_sheet_lacks() {
    let env = Env::new();
    let google = google(&env).await;
    let n = 120;
    google.standin.put_tab(SHEET, "Items", items(n));
    // Results are committed (and so written) as they come: killed after
    // the third write, long before the end (120 answers, 2 at a time,
    // 100 ms each).
    let _server = write_run(
        &env,
        &google,
        Duration::from_millis(100),
        2,
        &format!("{WRITE}\n    flush_rows: 10\n    min_write_interval: 100ms"),
        "writer: { batch_size: 8, flush_interval: 50ms }\n",
    )
    .await;
    let mut child = env
        .keyed(
            &google.key_file,
            &["run", "run.yaml", "-q", "--run-id", "killed"],
        )
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let standin = google.standin.clone();
    wait_until(Duration::from_secs(60), "a few writes", || {
        standin.writes().iter().filter(|w| w.status == 200).count() >= 3
    })
    .await;
    child.kill().await.unwrap();
    let at_kill = written(&google, "Items");
    assert!(
        at_kill.len() < n,
        "killed too late to test anything: {} rows written, writes {:?}",
        at_kill.len(),
        google
            .standin
            .writes()
            .iter()
            .map(|w| (w.at_ms, w.rows))
            .collect::<Vec<_>>()
    );
    let resumed = env.with_key(&google, &["resume", "killed"]).await;
    assert_eq!(resumed.code, Some(0), "{}", resumed.stderr);
    assert_eq!(written(&google, "Items"), expected(n));
    assert!(
        twice(&google).is_empty(),
        "cells written twice: {:?}",
        twice(&google)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_of_a_row_are_items_of_their_own_written_to_their_own_columns() {
    const TAB: &str = "Reviewer's items";
    let env = Env::new();
    let google = google(&env).await;
    // A text, then three blocks of (category, verdict).
    google.standin.put_tab(
        SHEET,
        TAB,
        vec![
            vec![
                json!("text"),
                json!("c1"),
                json!("v1"),
                json!("c2"),
                json!("v2"),
                json!("c3"),
                json!("v3"),
            ],
            vec![
                json!("t1"),
                json!("tone"),
                json!(""),
                json!("topic"),
                json!(""),
                json!("length"),
            ],
            vec![json!("t2"), json!("tone")],
        ],
    );
    let server = mock(MockSettings::default()).await;
    env.write(
        "run.yaml",
        &format!(
            "name: blocks\n\
             dataset:\n  sheet:\n    spreadsheet: {SHEET}\n    tab: \"{TAB}\"\n    key_env: {KEY_VAR}\n    api_url: {}\n    columns: {{ text: A, category: B }}\n    blocks: {{ count: 3, stride: 2, fields: [category] }}\n    write: {{ C: answer }}\n\
             endpoints:\n{}\n\
             task:\n  messages:\n    - {{ role: user, content: \"{{{{ text }}}}/{{{{ category }}}}\" }}\n",
            google.url,
            external("m", &server, 4)
        ),
    );
    let ran = env.with_key(&google, &["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let tab = google.standin.tab(SHEET, TAB);
    assert_eq!(tab[1][2], "t1/tone");
    assert_eq!(tab[1][4], "t1/topic");
    assert_eq!(tab[1][6], "t1/length");
    assert_eq!(tab[2][2], "t2/tone");
    assert_eq!(
        tab[2].len(),
        3,
        "row 3's empty blocks are no items: {:?}",
        tab[2]
    );
    assert_eq!(env.counts(&ran.run_id()).done, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_or_foreign_key_is_refused_before_the_run_saying_why() {
    let env = Env::new();
    let google = google(&env).await;
    google.standin.put_tab(SHEET, "Items", items(3));
    let _server = write_run(&env, &google, Duration::ZERO, 1, WRITE, "").await;
    let unset = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(unset.code, Some(2), "{}", unset.stderr);
    assert!(
        unset.stderr.contains(&format!("{KEY_VAR}: is not set")),
        "{}",
        unset.stderr
    );

    // A key the stand-in does not trust, sent to its token endpoint: the
    // token is refused.
    let other = Env::new();
    let stranger = self::google(&other).await;
    let mut key: Value =
        serde_json::from_str(&std::fs::read_to_string(&stranger.key_file).unwrap()).unwrap();
    key["token_uri"] = json!(format!("{}/token", google.url));
    let foreign = env.write("foreign.json", &key.to_string());
    let refused = run(env.keyed(&foreign, &["run", "run.yaml", "-q"])).await;
    assert_ne!(refused.code, Some(0), "{}", refused.stderr);
    assert!(
        refused.stderr.contains("refused a token"),
        "{}",
        refused.stderr
    );
    assert!(
        !refused
            .stderr
            .contains(stranger.pem.lines().nth(3).unwrap())
    );
    assert!(google.standin.writes().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sheet_example_is_a_valid_config() {
    let env = Env::new();
    let example =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/sheets.yaml");
    let checked = env
        .evalfleet(&["run", example.to_str().unwrap(), "--dry-run"])
        .await;
    assert_eq!(
        checked.code,
        Some(0),
        "{}{}",
        checked.stdout,
        checked.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_the_api_refuses_is_halved_down_to_the_row_it_refuses() {
    let env = Env::new();
    let google = google(&env).await;
    google.standin.put_tab(SHEET, "Items", items(4));
    // The batch of 4, then its first half, then that half's first row.
    google.standin.fail_next(&[400, 400, 400]);
    let ran = run_sheet(
        &env,
        &google,
        4,
        &format!("{WRITE}\n    flush_rows: 4\n    flush_interval: 1h\n    min_write_interval: 0s"),
    )
    .await;
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    assert!(
        ran.stderr.contains("refused 1 rows' cells"),
        "{}",
        ran.stderr
    );
    assert!(ran.stderr.contains("'Items'!C2:D2"), "{}", ran.stderr);
    let rows: Vec<(u16, usize)> = google
        .standin
        .writes()
        .iter()
        .map(|w| (w.status, w.rows))
        .collect();
    assert_eq!(rows, [(400, 4), (400, 2), (400, 1), (200, 1), (200, 2)]);
    let mut want = expected(4);
    want.remove(&2);
    assert_eq!(written(&google, "Items"), want);
    // The row was left out, not lost: sync writes it.
    let synced = env.with_key(&google, &["sync", &ran.run_id()]).await;
    assert_eq!(synced.code, Some(0), "{}{}", synced.stdout, synced.stderr);
    assert!(
        synced.stdout.contains("1 written, 3 already in the sheet"),
        "{}",
        synced.stdout
    );
    assert_eq!(written(&google, "Items"), expected(4));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sheet_edited_before_a_resume_is_refused_naming_the_sheet() {
    let env = Env::new();
    let google = google(&env).await;
    google.standin.put_tab(SHEET, "Items", items(6));
    let ran = run_sheet(&env, &google, 2, WRITE).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    // A row inserted at the top: every item moves down one row.
    let mut tab = google.standin.tab(SHEET, "Items");
    tab.insert(1, vec![json!("new"), json!("new")]);
    google.standin.put_tab(SHEET, "Items", tab);
    let resumed = env
        .with_key(&google, &["resume", &ran.run_id(), "--retry-failed"])
        .await;
    assert_eq!(resumed.code, Some(2), "{}", resumed.stderr);
    assert!(
        resumed
            .stderr
            .contains("the rows read from the sheet are not those run"),
        "{}",
        resumed.stderr
    );
    // sync writes nowhere: every item's row now holds another item.
    let synced = env.with_key(&google, &["sync", &ran.run_id()]).await;
    assert_eq!(synced.code, Some(1));
    assert!(synced.stdout.contains("0 written"), "{}", synced.stdout);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_given_as_json_in_the_variable_works_and_is_never_shown() {
    let env = Env::new();
    let google = google(&env).await;
    google.standin.put_tab(SHEET, "Items", items(3));
    let _server = write_run(&env, &google, Duration::ZERO, 1, WRITE, "").await;
    let key = std::fs::read_to_string(&google.key_file).unwrap();
    let ran = run(env.keyed(&key, &["run", "run.yaml", "-q"])).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert_eq!(written(&google, "Items"), expected(3));

    // JSON that is not a key: the message says what is wrong, not what it holds.
    let broken = key.replace("service_account", "authorized_user");
    let refused = run(env.keyed(&broken, &["run", "run.yaml", "-q"])).await;
    assert_eq!(refused.code, Some(2), "{}", refused.stderr);
    assert!(
        refused.stderr.contains("holds JSON, not a usable key"),
        "{}",
        refused.stderr
    );
    assert!(!refused.stderr.contains(google.pem.lines().nth(3).unwrap()));
    assert!(!refused.stderr.contains("PRIVATE KEY"));
}

/// An answer that cannot be used (it does not parse) leaves the cells it
/// has no value for as they were (no empty update over earlier values, as
/// seed 001 asks), and the status column says what happened; the run is
/// incomplete, and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unusable_answer_keeps_the_earlier_values_of_its_row_and_says_so() {
    let env = Env::new();
    let google = google(&env).await;
    let mut rows = items(6);
    rows[0].push(json!("status"));
    for row in rows.iter_mut().skip(1) {
        row.truncate(2);
        row.extend([json!("earlier"), json!("earlier"), json!("")]);
    }
    google.standin.put_tab(SHEET, "Items", rows);
    // The mock echoes `q0`..`q5`: only q0 to q2 parse.
    let sheet = "    write: { C: parsed, D: score.exact_match, E: status }";
    let _server = write_run(&env, &google, Duration::ZERO, 2, sheet, "").await;
    let config = std::fs::read_to_string(env.path("run.yaml"))
        .unwrap()
        .replace(
            "  params: { max_tokens: 64 }\n",
            "  params: { max_tokens: 64 }\n  parse: { regex: \"^(q[0-2])$\" }\n  max_reasks: 0\n",
        );
    env.write("run.yaml", &config);
    let ran = env.with_key(&google, &["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    assert!(
        ran.stderr
            .contains("finished, incomplete: 3 of 6 items scored (3 unusable)"),
        "{}",
        ran.stderr
    );
    let tab = google.standin.tab(SHEET, "Items");
    for (i, row) in tab.iter().enumerate().skip(1) {
        if i <= 3 {
            assert_eq!(row[2], json!(format!("q{}", i - 1)), "row {i}: {row:?}");
            assert_eq!(row[4], json!("done"), "row {i}: {row:?}");
        } else {
            assert_eq!(row[2], json!("earlier"), "kept: row {i}: {row:?}");
            assert_eq!(row[3], json!("earlier"), "kept: row {i}: {row:?}");
            assert_eq!(row[4], json!("unusable"), "row {i}: {row:?}");
        }
    }
}

/// Two runs at once, writing as one service account, each to a tab of its
/// own (`A`, `B`: `n` items each), run `a` with the store `stores[0]` and
/// `b` with `stores[1]`. The account may write 17 times in any 2 s (the
/// stand-in's quota, Google's 60 a minute scaled down); the runs each keep
/// to 300 writes a minute (5 a second, 5 at once: at most 15 in 2 s),
/// writing each result as it comes (some 25 a second each), or with the
/// next write when it comes while one waits for its turn. Checks that
/// every result is written; returns the writes answered 429 and the
/// seconds it took.
async fn two_writers(env: &Env, google: &Google, stores: [&str; 2], n: usize) -> (usize, f64) {
    let server = mock(MockSettings {
        latency: Duration::from_millis(40),
        ..MockSettings::default()
    })
    .await;
    let sheet =
        format!("{WRITE}\n    flush_rows: 1\n    flush_interval: 10ms\n    min_write_interval: 0s");
    let config = sheet_config(google, &external("m", &server, 1), &sheet)
        .replace("writes_per_minute: 6000", "writes_per_minute: 300")
        // A 429 waits out the quota's window, as Google's minute is.
        .replace("quota_wait: 50ms", "quota_wait: 2s");
    let config = format!("{config}writer: {{ batch_size: 1, flush_interval: 10ms }}\n");
    for tab in ["A", "B"] {
        google.standin.put_tab(SHEET, tab, items(n));
        env.write(
            &format!("{tab}.yaml"),
            &config.replace("tab: Items", &format!("tab: {tab}")),
        );
    }
    google
        .standin
        .write_quota(Some((17, Duration::from_secs(2))));
    let before = google.standin.writes().len();
    let started = std::time::Instant::now();
    let args = |file, store| ["run", file, "-q", "--store", store];
    let (a, b) = (args("A.yaml", stores[0]), args("B.yaml", stores[1]));
    let (a, b) = tokio::join!(env.with_key(google, &a), env.with_key(google, &b));
    let took = started.elapsed().as_secs_f64();
    for (tab, ran) in [("A", a), ("B", b)] {
        assert_eq!(ran.code, Some(0), "{tab}: {}", ran.stderr);
        assert_eq!(written(google, tab), expected(n), "{tab}");
    }
    google.standin.write_quota(None);
    let writes = google.standin.writes();
    let refused = writes[before..].iter().filter(|w| w.status == 429).count();
    eprintln!(
        "DEBUG {:?}",
        writes[before..]
            .iter()
            .map(|w| (w.at_ms, w.status, w.rows))
            .collect::<Vec<_>>()
    );
    (refused, took)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_writing_as_one_account_share_its_write_quota_through_postgres() {
    let Some(db) = evalfleet_testkit::scratch_db!() else {
        return;
    };
    let env = Env::new();
    let google = google(&env).await;
    const N: usize = 60;
    // Each on a SQLite store of its own, the runs share nothing: each
    // keeps to the quota alone, and together they pass it.
    let (alone, alone_took) = two_writers(&env, &google, ["a.db", "b.db"], N).await;
    // On one PostgreSQL store, they take turns at the account's quota.
    let (shared, shared_took) = two_writers(&env, &google, [&db.url, &db.url], N).await;
    eprintln!("429s: {alone} alone ({alone_took:.1} s), {shared} sharing ({shared_took:.1} s)");
    let quotas: i64 = tokio::task::block_in_place(|| {
        let mut client = postgres::Client::connect(&db.url, postgres::NoTls).unwrap();
        client
            .query_one(
                "SELECT count(*) FROM evalfleet.quotas WHERE model = 'google-sheets'",
                &[],
            )
            .unwrap()
            .get(0)
    });
    assert_eq!(quotas, 1, "the store keeps one write quota, the account's");
    assert!(
        alone >= 2,
        "pacing alone, the two runs pass the account's quota: {alone} 429s"
    );
    assert!(
        shared <= 1,
        "sharing the quota, the two runs keep within it: {shared} 429s"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_quota_spent_for_longer_than_the_sink_waits_stops_its_writes_naming_it() {
    let env = Env::new();
    let google = google(&env).await;
    google.standin.put_tab(SHEET, "Items", items(20));
    // Other writers of the account have spent its quota, for an hour.
    google
        .standin
        .write_quota(Some((0, Duration::from_secs(3600))));
    let ran = run_sheet(&env, &google, 4, &format!("{WRITE}\n    retries: 2")).await;
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    for said in [
        "Write requests per minute per user",
        "the write quota of runner@evalfleet-test.iam.gserviceaccount.com, 6000 writes a minute",
        "through 3 tries",
        &format!("evalfleet sync {}", ran.run_id()),
    ] {
        assert!(ran.stderr.contains(said), "{said}: {}", ran.stderr);
    }
    let run_id = ran.run_id();
    assert_eq!(env.counts(&run_id).done, 20, "the run went on");
    let statuses: Vec<u16> = google.standin.writes().iter().map(|w| w.status).collect();
    assert_eq!(statuses, [429; 3], "one write, tried again twice");
    assert!(written(&google, "Items").is_empty());

    // The quota comes back: sync writes what the sheet lacks.
    google.standin.write_quota(None);
    let synced = env.with_key(&google, &["sync", &run_id]).await;
    assert_eq!(synced.code, Some(0), "{}{}", synced.stdout, synced.stderr);
    assert!(
        synced.stdout.contains("20 written, 0 already in the sheet"),
        "{}",
        synced.stdout
    );
    assert_eq!(written(&google, "Items"), expected(20));
}
