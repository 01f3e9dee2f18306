//! Metric backends: a metric scored by an outside program (a Python script
//! here) over JSON lines, in a run and through `score`; a backend that
//! crashes, hangs or writes garbage gives errors, never scores; its setup
//! runs once.

use std::path::{Path, PathBuf};
use std::time::Duration;

use evalfleet_mock::MockSettings;
use serde_json::Value;

use crate::util::{Env, by_id, config, external, mock, signal, wait_until};

const PYTHON: &str = "/usr/bin/python3";

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/metric_backends/score.py")
}

/// `n` items whose reference is the question (the mock's echo scores 1),
/// the question with its last character changed (an ANLS between 0 and 1)
/// or other text (0).
fn dataset(env: &Env, n: usize) -> PathBuf {
    let mut text = String::new();
    for i in 0..n {
        let question = format!("the answer to question number {i}");
        let answer = match i % 3 {
            0 => question.clone(),
            1 => format!("{}x", &question[..question.len() - 1]),
            _ => "something else entirely".to_owned(),
        };
        text.push_str(&format!(
            "{{\"id\": \"item-{i:05}\", \"question\": \"{question}\", \"answer\": \"{answer}\"}}\n"
        ));
    }
    env.write("items.jsonl", &text)
}

/// Task keys: the native metrics and the backend's (declared with
/// `backend`: its YAML mapping's keys after `name`).
fn metrics(backend: &str) -> String {
    format!(
        "  metrics:\n\
         \x20   - {{ name: anls, reference: \"{{{{ answer }}}}\" }}\n\
         \x20   - {{ name: exact_match, reference: \"{{{{ answer }}}}\" }}\n\
         \x20   - {{ name: anls@scorer, reference: \"{{{{ answer }}}}\", threshold: 0.5 }}\n\
         \x20   - {{ name: exact_match@scorer@1, reference: \"{{{{ answer }}}}\" }}\n\
         \x20 metric_backends:\n\
         \x20   - {{ name: scorer, metrics: [anls, exact_match], {backend} }}\n"
    )
}

/// A `command:` running the test script with `args`.
fn command(args: &[&str]) -> String {
    let mut argv = vec![PYTHON.to_owned(), script().display().to_string()];
    argv.extend(args.iter().map(|a| (*a).to_owned()));
    format!("command: {}", serde_json::to_string(&argv).unwrap())
}

async fn run_with(env: &Env, items: usize, backend: &str) -> (crate::util::Ran, Vec<Value>) {
    let server = mock(MockSettings::default()).await;
    let dataset = dataset(env, items);
    env.write(
        "run.yaml",
        &config(&dataset, &external("m", &server, 8), &metrics(backend)),
    );
    let ran = env.evalfleet(&["run", "run.yaml", "--quiet"]).await;
    let rows = if ran.run_id().is_empty() {
        Vec::new()
    } else {
        env.export(&ran.run_id()).await
    };
    (ran, rows)
}

/// Every row's backend scores: each equals the native one, or is an error
/// (returned: item, error); a backend never gives a score the native metric
/// would not.
fn same_or_errors(rows: &[Value]) -> Vec<(String, String)> {
    let mut errors = Vec::new();
    for row in rows {
        let id = row["item_id"].as_str().unwrap_or_default().to_owned();
        assert_eq!(row["status"], "done", "{row}");
        let scores = &row["scores"];
        for (native, outside) in [
            ("anls@1", "anls@scorer@1"),
            ("exact_match@1", "exact_match@scorer@1"),
        ] {
            let theirs = &scores[outside];
            match theirs["value"].as_f64() {
                Some(v) => {
                    assert_eq!(
                        Some(v),
                        scores[native]["value"].as_f64(),
                        "{id} {outside}: {scores}"
                    );
                    assert_eq!(theirs["by"], "score.py", "{id}: details are kept: {theirs}");
                }
                None => {
                    let error = theirs["error"].as_str().unwrap_or_else(|| {
                        panic!("{id} {outside}: neither a score nor an error: {scores}")
                    });
                    errors.push((id.clone(), error.to_owned()));
                }
            }
        }
    }
    errors
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_backend_scores_as_the_native_metric_in_a_run_and_again_through_score() {
    let env = Env::new();
    let marker = env.path("starts.log");
    let (ran, rows) = run_with(
        &env,
        30,
        &command(&["--marker", &marker.display().to_string()]),
    )
    .await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert_eq!(rows.len(), 30);
    assert_eq!(same_or_errors(&rows), Vec::new());
    // The three kinds of answers are there: 1, 0 and in between.
    let anls: Vec<f64> = rows
        .iter()
        .map(|r| r["scores"]["anls@scorer@1"]["value"].as_f64().unwrap())
        .collect();
    assert!(
        anls.contains(&1.0) && anls.contains(&0.0) && anls.iter().any(|v| *v > 0.0 && *v < 1.0),
        "{anls:?}"
    );
    // One process scored the run.
    assert_eq!(std::fs::read_to_string(&marker).unwrap().lines().count(), 1);

    // Scored again, by the backend's process again.
    let run_id = ran.run_id();
    let scored = env.evalfleet(&["score", &run_id]).await;
    assert_eq!(scored.code, Some(0), "{}", scored.stderr);
    assert!(
        scored
            .stderr
            .contains("Sent 30 usable answers to the metric backends"),
        "{}",
        scored.stderr
    );
    assert_eq!(std::fs::read_to_string(&marker).unwrap().lines().count(), 2);
    let again = env.export(&run_id).await;
    assert_eq!(same_or_errors(&again), Vec::new());
    let before = by_id(&rows);
    for row in &again {
        let id = row["item_id"].as_str().unwrap();
        assert_eq!(row["scores"], before[id]["scores"], "{id}");
    }
    // Only the backend's metric, named as the registry names it.
    let only = env
        .evalfleet(&[
            "score",
            &run_id,
            "--metrics",
            "anls@scorer,exact_match@native@1",
        ])
        .await;
    assert_eq!(only.code, Some(0), "{}", only.stderr);
    assert_eq!(std::fs::read_to_string(&marker).unwrap().lines().count(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_that_crashes_gives_errors_with_its_stderr_not_zeros() {
    let env = Env::new();
    let (ran, rows) = run_with(&env, 30, &command(&["--crash-after", "4"])).await;
    assert_eq!(rows.len(), 30, "{}", ran.stderr);
    let errors = same_or_errors(&rows);
    assert!(
        !errors.is_empty(),
        "a backend that exits after 4 scores must leave answers unscored"
    );
    for (id, error) in &errors {
        assert!(
            error.contains("metric backend 'scorer' exited (exit status: 3) before scoring it")
                && error.contains("crashing on purpose after 4 scores"),
            "{id}: {error}"
        );
    }
    // The run's summary says which scores are missing, and why.
    assert!(
        ran.stderr.contains("not scored") && ran.stderr.contains("exited (exit status: 3)"),
        "{}",
        ran.stderr
    );
    // One answer at a time, it is started again after each crash: each
    // process scores 4 answers and leaves the fifth unscored.
    let backend = format!("{}, queue: 1", command(&["--crash-after", "4"]));
    let (ran, rows) = run_with(&env, 30, &backend).await;
    // Some answers are not scored: the run is incomplete, and says so.
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    assert!(
        ran.stderr.contains("finished, incomplete: "),
        "{}",
        ran.stderr
    );
    let errors = same_or_errors(&rows);
    assert_eq!(errors.len(), 60 / 5, "{errors:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_that_hangs_times_out_into_errors_and_is_started_again() {
    let env = Env::new();
    // One answer at a time: the hang meets item-00003's two answers alone
    // (2s: a new Python process answers well within it, even on a busy
    // machine).
    let backend = format!(
        "{}, timeout: 2s, queue: 1",
        command(&["--hang-on", "item-00003"])
    );
    let (ran, rows) = run_with(&env, 12, &backend).await;
    // Some answers are not scored: the run is incomplete, and says so.
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    assert!(
        ran.stderr.contains("finished, incomplete: "),
        "{}",
        ran.stderr
    );
    let errors = same_or_errors(&rows);
    let hung: Vec<&String> = errors
        .iter()
        .filter(|(id, _)| id == "item-00003")
        .map(|(_, e)| e)
        .collect();
    assert!(!hung.is_empty(), "{errors:?}");
    for (id, error) in &errors {
        assert!(
            error.contains("gave no score within 2s") && error.contains("hanging on item-00003"),
            "{id}: {error}"
        );
    }
    // The answers after were scored by a new process.
    assert_eq!(errors.len(), 2, "{errors:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_that_exits_at_once_is_given_up_after_three_starts() {
    let env = Env::new();
    // One answer at a time: each start meets one.
    let backend = "command: [sh, -c, \"echo dying >&2; exit 4\"], queue: 1";
    let (ran, rows) = run_with(&env, 10, backend).await;
    assert_eq!(ran.code, Some(1), "no backend score at all: {}", ran.stderr);
    let errors = same_or_errors(&rows);
    assert_eq!(
        errors.len(),
        20,
        "every backend score is an error: {errors:?}"
    );
    for (id, error) in &errors {
        assert!(
            (error.contains("exited (exit status: 4)") || error.contains("was given up"))
                && error.contains("dying"),
            "{id}: {error}"
        );
    }
    assert!(
        errors
            .iter()
            .any(|(_, e)| e.contains("stopped 3 times in a row without a score")),
        "{errors:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_lines_give_errors_that_name_the_line() {
    let env = Env::new();
    // One answer at a time, so that each misbehaviour meets only its item
    // (and the anls line only: a backend stopped three times in a row with
    // no score between is given up).
    let backend = format!(
        "{}, queue: 1",
        command(&[
            "--nan-on",
            "item-00002",
            "--garbage-on",
            "item-00004",
            "--wrong-id-on",
            "item-00006"
        ])
    );
    let (ran, rows) = run_with(&env, 9, &backend).await;
    // Some answers are not scored: the run is incomplete, and says so.
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    assert!(
        ran.stderr.contains("finished, incomplete: "),
        "{}",
        ran.stderr
    );
    let errors = same_or_errors(&rows);
    let of = |item: &str| -> Vec<&str> {
        errors
            .iter()
            .filter(|(id, _)| id == item)
            .map(|(_, e)| e.as_str())
            .collect()
    };
    // NaN is not JSON, but the line names its id: that answer alone.
    for error in of("item-00002") {
        assert!(
            error.contains("line ") && error.contains("is not JSON") && error.contains("NaN"),
            "{error}"
        );
    }
    for error in of("item-00004") {
        assert!(
            error.contains("which is not JSON")
                && error.contains("this is not json for item-00004"),
            "{error}"
        );
    }
    for error in of("item-00006") {
        assert!(error.contains("answers id no-such-id"), "{error}");
    }
    let items: std::collections::BTreeSet<&str> =
        errors.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(
        items.into_iter().collect::<Vec<_>>(),
        ["item-00002", "item-00004", "item-00006"],
        "{errors:?}"
    );
    assert_eq!(
        errors.len(),
        3,
        "one line each, and no other answer: {errors:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_line_too_long_is_an_error_of_its_answer_and_not_held() {
    let env = Env::new();
    let backend = format!("{}, queue: 1", command(&["--huge-on", "item-00001"]));
    let (ran, rows) = run_with(&env, 4, &backend).await;
    // Some answers are not scored: the run is incomplete, and says so.
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    assert!(
        ran.stderr.contains("finished, incomplete: "),
        "{}",
        ran.stderr
    );
    let errors = same_or_errors(&rows);
    assert_eq!(errors.len(), 1, "{errors:?}");
    let (item, error) = &errors[0];
    assert_eq!(item, "item-00001");
    assert!(
        error.contains("longer than 1048576 bytes") && error.contains("xxx"),
        "{error}"
    );
    assert!(error.len() < 10_000, "the line is not in the error whole");
}

/// Whether process `pid` is gone (or dead and not yet reaped).
fn gone(pid: &str) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

/// A setup that never ends: it writes its process group's pids (its shell,
/// and a child it started) to `pids` in the folder, then waits.
fn endless_setup(pids: &Path) -> String {
    format!(
        "{}, setup: [sh, -c, \"echo installing; sleep 1000 & echo $$ $! > {}; wait\"]",
        command(&[]),
        pids.display()
    )
}

/// Waits until every process of `pids` is gone.
async fn all_gone(pids: Vec<String>) {
    for pid in pids {
        wait_until(
            Duration::from_secs(10),
            "the setup's processes are gone",
            || gone(&pid),
        )
        .await;
    }
}

async fn pids_in(pids: &Path) -> Vec<String> {
    wait_until(Duration::from_secs(30), "the setup writes its pids", || {
        std::fs::read_to_string(pids).is_ok_and(|t| t.split_whitespace().count() == 2)
    })
    .await;
    let text = std::fs::read_to_string(pids).unwrap();
    text.split_whitespace().map(str::to_owned).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_stopped_during_its_setup_kills_the_setup_and_exits_130() {
    let env = Env::new();
    let server = mock(MockSettings::default()).await;
    let dataset = dataset(&env, 3);
    let pids = env.path("pids");
    env.write(
        "slow.yaml",
        &config(
            &dataset,
            &external("m", &server, 2),
            &metrics(&endless_setup(&pids)),
        ),
    );
    let mut run = env.command(&["run", "slow.yaml", "--quiet"]);
    let child = run
        .env("XDG_CACHE_HOME", env.path("cache"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = pids_in(&pids).await;
    signal(&child, "INT").await;
    let out = child.wait_with_output().await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(
        stderr.contains("stopped while the task started"),
        "{stderr}"
    );
    all_gone(started).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_rescores_with_backends_only_when_it_may_run_commands() {
    let env = Env::new();
    let marker = env.path("starts.log");
    let (ran, _) = run_with(
        &env,
        3,
        &command(&["--marker", &marker.display().to_string()]),
    )
    .await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let run_id = ran.run_id();
    let starts = || std::fs::read_to_string(&marker).unwrap().lines().count();
    assert_eq!(starts(), 1);
    let rescore = |base: String, metrics: Value| {
        let run_id = run_id.clone();
        async move {
            let response = crate::serve::client()
                .post(format!("{base}/api/v1/runs/{run_id}/rescore"))
                .json(&serde_json::json!({ "metrics": metrics }))
                .send()
                .await
                .unwrap();
            (response.status().as_u16(), response.text().await.unwrap())
        }
    };
    {
        let (_server, base) = crate::serve::serve(&env, &[], None).await;
        let (status, body) = rescore(base.clone(), serde_json::json!([])).await;
        assert_eq!(status, 403, "{body}");
        assert!(
            body.contains("--allow-commands") && body.contains("scorer"),
            "{body}"
        );
        // The built-in metrics only: no backend is started.
        let (status, body) = rescore(base, serde_json::json!(["anls@native"])).await;
        assert_eq!(status, 200, "{body}");
    }
    assert_eq!(starts(), 1, "no backend was started");
    let (_server, base) = crate::serve::serve(&env, &["--allow-commands"], None).await;
    let (status, body) = rescore(base, serde_json::json!(["anls@scorer"])).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(starts(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_setup_runs_once_and_a_changed_setup_makes_a_new_folder() {
    let env = Env::new();
    let server = mock(MockSettings::default()).await;
    let dataset = dataset(&env, 6);
    let cache = env.path("cache");
    let setups = env.path("setups.log");
    let write = |name: &str, token: &str| {
        let backend = format!(
            "{}, setup: [sh, -c, \"echo made >> {}; sleep 0.3; echo {token} > token\"]",
            command(&["--marker", "{setup_dir}/started"]),
            setups.display()
        );
        env.write(
            name,
            &config(&dataset, &external("m", &server, 4), &metrics(&backend)),
        );
    };
    write("one.yaml", "one");
    write("two.yaml", "two");
    // Each run its own store: two processes making one new store at once
    // is not what this test is about.
    let run_in = |file: &'static str, store: &'static str| {
        let mut command = env.command(&["run", file, "--quiet", "--store", store]);
        command.env("XDG_CACHE_HOME", &cache);
        command
    };
    let run = |file: &'static str| run_in(file, "runs/evalfleet.db");
    // Two runs at once make the folder once (the second waits on the lock).
    let (a, b) = tokio::join!(
        run_in("one.yaml", "runs/a.db").output(),
        run_in("one.yaml", "runs/b.db").output()
    );
    for out in [a.unwrap(), b.unwrap()] {
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert_eq!(std::fs::read_to_string(&setups).unwrap().lines().count(), 1);
    let again = run("one.yaml").output().await.unwrap();
    assert_eq!(again.status.code(), Some(0));
    assert_eq!(std::fs::read_to_string(&setups).unwrap().lines().count(), 1);
    let changed = run("two.yaml").output().await.unwrap();
    assert_eq!(
        changed.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&changed.stderr)
    );
    assert_eq!(std::fs::read_to_string(&setups).unwrap().lines().count(), 2);
    // One folder per setup, each with its token, and the backend was run
    // with the folder in its arguments (three runs, then one).
    let root = cache.join("evalfleet/metric-backends");
    let mut folders: Vec<(String, usize)> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .map(|p| {
            let token = std::fs::read_to_string(p.join("token"))
                .unwrap()
                .trim()
                .to_owned();
            let starts = std::fs::read_to_string(p.join("started"))
                .unwrap()
                .lines()
                .count();
            (token, starts)
        })
        .collect();
    folders.sort();
    assert_eq!(folders, [("one".to_owned(), 3), ("two".to_owned(), 1)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_that_cannot_start_stops_the_run_before_its_first_call() {
    let env = Env::new();
    let server = mock(MockSettings::default()).await;
    let dataset = dataset(&env, 3);
    let pids = env.path("pids");
    let cases = [
        (
            "setup: [sh, -c, \"echo 'ERROR: no matching distribution for evalscope' >&2; exit 1\"], command: [python3, x.py]".to_owned(),
            "no matching distribution for evalscope",
        ),
        (
            "command: [/no/such/program]".to_owned(),
            "cannot start /no/such/program",
        ),
        // A setup past its timeout is killed, with all it started.
        (
            format!("{}, setup_timeout: 1s", endless_setup(&pids)),
            "did not finish within 1s",
        ),
    ];
    for (backend, expected) in cases {
        env.write(
            "bad.yaml",
            &config(&dataset, &external("m", &server, 2), &metrics(&backend)),
        );
        let ran = env
            .command(&["run", "bad.yaml", "--quiet"])
            .env("XDG_CACHE_HOME", env.path("cache"))
            .output()
            .await
            .unwrap();
        let stderr = String::from_utf8_lossy(&ran.stderr);
        assert_eq!(ran.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains("metric backend 'scorer'") && stderr.contains(expected),
            "{stderr}"
        );
    }
    all_gone(pids_in(&pids).await).await;
    assert_eq!(
        server.stats().requests,
        0,
        "no call before the backends are ready"
    );
    // A name no backend declares is a config error with its place.
    env.write(
        "unknown.yaml",
        &config(
            &dataset,
            &external("m", &server, 2),
            "  metrics:\n    - { name: anls@evalscope, reference: \"{{ answer }}\" }\n",
        ),
    );
    let ran = env.evalfleet(&["run", "unknown.yaml"]).await;
    assert_eq!(ran.code, Some(2));
    assert!(
        ran.stderr.contains("task.metrics[0]")
            && ran.stderr.contains("unknown metric backend 'evalscope'"),
        "{}",
        ran.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_item_killed_while_its_backend_scores_it_is_scored_on_resume() {
    let env = Env::new();
    let marker = env.path("marker.log");
    let hold = env.write("hold", "");
    let backend = command(&[
        "--hang-on",
        "item-00005",
        "--hang-while",
        &hold.display().to_string(),
        "--marker",
        &marker.display().to_string(),
    ]);
    let server = mock(MockSettings::default()).await;
    let dataset = dataset(&env, 12);
    env.write(
        "run.yaml",
        &config(&dataset, &external("m", &server, 4), &metrics(&backend)),
    );
    let child = env.spawn(&["run", "run.yaml", "--run-id", "held"]);
    wait_until(
        Duration::from_secs(60),
        "the backend holds item-00005",
        || std::fs::read_to_string(&marker).is_ok_and(|m| m.contains("hanging on item-00005")),
    )
    .await;
    signal(&child, "KILL").await;
    let _ = child.wait_with_output().await;
    std::fs::remove_file(&hold).unwrap();
    let counts = env.counts("held");
    assert!(
        counts.pending >= 1,
        "item-00005 is not done before its backend scores it: {counts:?}"
    );

    let resumed = env.evalfleet(&["resume", "held"]).await;
    assert_eq!(resumed.code, Some(0), "{}", resumed.stderr);
    let rows = env.export("held").await;
    assert_eq!(rows.len(), 12);
    assert_eq!(same_or_errors(&rows), Vec::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_lists_the_registry_and_a_configs_backends() {
    let env = Env::new();
    let listed = env.evalfleet(&["metrics"]).await;
    assert_eq!(listed.code, Some(0), "{}", listed.stderr);
    let header = listed.stdout.lines().next().unwrap();
    for column in [
        "NAME", "BACKEND", "VERSION", "KEY", "PARAMS", "BETTER", "SUMMARY",
    ] {
        assert!(header.contains(column), "{header}");
    }
    assert!(
        listed.stdout.lines().any(|l| l.starts_with("anls ")
            && l.contains("native")
            && l.contains("anls@1")
            && l.contains("threshold")),
        "{}",
        listed.stdout
    );
    let server = mock(MockSettings::default()).await;
    let dataset = dataset(&env, 1);
    let backend = "command: [python3, score.py], metrics: [anls, { name: cer, higher_is_better: false, summary: character errors }]";
    env.write(
        "run.yaml",
        &config(
            &dataset,
            &external("m", &server, 1),
            &format!("  metric_backends:\n    - {{ name: evalscope, version: 3, {backend} }}\n"),
        ),
    );
    let json = env.evalfleet(&["metrics", "run.yaml", "--json"]).await;
    assert_eq!(json.code, Some(0), "{}", json.stderr);
    let list: Vec<Value> = serde_json::from_str(&json.stdout).unwrap();
    let cer = list.iter().find(|m| m["key"] == "cer@evalscope@3").unwrap();
    assert_eq!(cer["backend"], "evalscope");
    assert_eq!(cer["higher_is_better"], false);
    assert_eq!(cer["summary"], "character errors");
    assert!(list.iter().any(|m| m["key"] == "anls@evalscope@3"));
    assert!(
        list.iter()
            .any(|m| m["key"] == "anls@1" && m["backend"] == "native")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_backend_in_its_virtual_environment_agrees_with_the_built_in_anls() {
    let env = Env::new();
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/metric-backend.yaml"
    );
    let ran = env
        .command(&["run", config, "--quiet"])
        .env("XDG_CACHE_HOME", env.path("cache"))
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&ran.stderr);
    assert_eq!(ran.status.code(), Some(0), "{stderr}");
    let run_id = String::from_utf8_lossy(&ran.stdout).trim().to_owned();
    let rows = env.export(&run_id).await;
    assert_eq!(rows.len(), 50);
    for row in &rows {
        let scores = &row["scores"];
        assert_eq!(
            scores["anls@example@1"]["value"].as_f64(),
            scores["anls@1"]["value"].as_f64(),
            "{scores}"
        );
    }
}
