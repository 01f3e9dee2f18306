//! `evalfleet serve`: runs started, watched, stopped and resumed over HTTP
//! by a real server process, and who it lets in.

use std::time::Duration;

use serde_json::{Value, json};
use tokio::process::{Child, Command};

use crate::util::{BIN, Env, wait_until};

/// An `evalfleet serve` process in `env` with `args`, and its address.
pub async fn serve(env: &Env, args: &[&str], key: Option<&str>) -> (Child, String) {
    let vars: Vec<(&str, &str)> = key.iter().map(|k| ("EVALFLEET_API_KEY", *k)).collect();
    serve_with(env, args, &vars).await
}

/// The same, with the environment variables `vars` (the key among them).
pub async fn serve_with(env: &Env, args: &[&str], vars: &[(&str, &str)]) -> (Child, String) {
    let mut command = Command::new(BIN);
    command
        .arg("serve")
        .args(["--bind", "127.0.0.1:0"])
        .args(args);
    started(command, env, vars).await
}

/// `command` (a server, or what execs one) started in `env` with the
/// environment variables `vars`, and the address its server printed.
async fn started(mut command: Command, env: &Env, vars: &[(&str, &str)]) -> (Child, String) {
    command
        .current_dir(env.dir.path())
        .env_remove("EVALFLEET_STORE")
        .env_remove("EVALFLEET_API_KEY")
        .envs(vars.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true);
    let mut child = command.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
    let url = lines.next_line().await.unwrap().unwrap();
    (child, url)
}

pub fn client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

pub async fn get(url: &str) -> Value {
    get_keyed(url, None).await
}

/// A GET with the server's `key`, as JSON.
pub async fn get_keyed(url: &str, key: Option<&str>) -> Value {
    let mut request = client().get(url);
    if let Some(key) = key {
        request = request.header("x-api-key", key);
    }
    request.send().await.unwrap().json().await.unwrap()
}

/// Polls the run until it is in `state` (every 50 ms, for at most 60 s).
pub async fn wait_for_state(base: &str, run_id: &str, state: &str) -> Value {
    wait_for_state_keyed(base, run_id, state, None).await
}

/// The same, on a server with a `key`.
pub async fn wait_for_state_keyed(
    base: &str,
    run_id: &str,
    state: &str,
    key: Option<&str>,
) -> Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let run = get_keyed(&format!("{base}/api/v1/runs/{run_id}"), key).await;
        if run["state"] == state {
            return run;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "run {run_id} never became {state}: {run}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A config of `items` questions answered by a built-in mock taking
/// `latency`, its endpoint with `extra` keys.
pub fn config(env: &Env, items: usize, latency: &str, concurrency: u32, extra: &str) -> String {
    let dataset = env.dataset("items.jsonl", items);
    format!(
        "name: served\n\
         dataset: {{ path: {}, id_field: id }}\n\
         endpoints:\n  - {{ name: m, kind: mock, concurrency: {concurrency}{extra}, mock: {{ latency: {latency} }} }}\n\
         task:\n  messages:\n    - {{ role: user, content: \"{{{{ question }}}}\" }}\n  \
         metrics:\n    - {{ name: exact_match, reference: \"{{{{ question }}}}\" }}\n",
        dataset.display()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_started_over_http_is_answered_and_shows_no_secret() {
    let env = Env::new();
    let (_server, base) = serve(&env, &[], None).await;
    let text = config(&env, 40, "5ms", 4, ", api_key: sk-literal-secret");
    let run_id = start_run(&base, &text).await;
    let run = wait_for_state(&base, &run_id, "finished").await;
    assert_eq!(
        run["counts"],
        json!({"pending": 0, "done": 40, "failed": 0})
    );
    let page = get(&format!("{base}/api/v1/runs/{run_id}/items?limit=40")).await;
    let rows = page["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 40);
    assert!(rows.iter().all(|r| r["output"] == r["item"]["question"]));
    // The secret is in no answer about the run.
    for path in ["", "/events", "/report"] {
        let body = client()
            .get(format!("{base}/api/v1/runs/{run_id}{path}"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(!body.contains("sk-literal-secret"), "{path}: {body}");
    }
    // Scored as it went; and again, calling no model.
    let report = get(&format!("{base}/api/v1/runs/{run_id}/report")).await;
    assert_eq!(report["metrics"][0]["mean"], 1.0, "{report}");
    let response = client()
        .post(format!("{base}/api/v1/runs/{run_id}/rescore"))
        .json(&json!({"metrics": ["exact_match"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let rescored: Value = response.json().await.unwrap();
    assert_eq!(rescored["answers"], 40, "{rescored}");
    assert_eq!(rescored["metrics"], json!(["exact_match@1"]));
    let response = client()
        .post(format!("{base}/api/v1/runs/{run_id}/rescore"))
        .json(&json!({"metrics": ["f1"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 422);
    // A config with problems: each named with its line, nothing stored.
    let response = client()
        .post(format!("{base}/api/v1/runs"))
        .json(&json!({"config": "name: bad\nendpoints: []\n"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 422);
    let body: Value = response.json().await.unwrap();
    assert!(
        !body["error"]["problems"].as_array().unwrap().is_empty(),
        "{body}"
    );
    let runs = get(&format!("{base}/api/v1/runs")).await;
    assert_eq!(runs.as_array().unwrap().len(), 1);
    // A config file outside the allowed directories is not read.
    let response = client()
        .post(format!("{base}/api/v1/runs"))
        .json(&json!({"config_path": "/etc/passwd"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 403);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_stopped_over_http_is_resumed_over_http_and_ends_once_each() {
    let env = Env::new();
    let (_server, base) = serve(&env, &[], None).await;
    let path = env.write("slow.yaml", &config(&env, 300, "100ms", 2, ""));
    let response = client()
        .post(format!("{base}/api/v1/runs"))
        .json(&json!({"config_path": path, "run_id": "slow-1"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let server = get(&format!("{base}/api/v1/server")).await;
    assert_eq!(server["running"], json!(["slow-1"]));
    wait_until(Duration::from_secs(30), "some items are done", || {
        env.counts("slow-1").done >= 4
    })
    .await;
    // Prometheus sees the running run and its endpoint (once the worker has
    // written its endpoints' state, within a second).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let metrics = loop {
        let text = client()
            .get(format!("{base}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        // Its resource telemetry too (on by default; stored each second).
        if text.contains("evalfleet_latency_seconds_bucket")
            && text.contains("evalfleet_process_rss_mib{")
        {
            break text;
        }
        assert!(tokio::time::Instant::now() < deadline, "{text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for line in metrics.lines().filter(|l| !l.starts_with('#')) {
        let (series, value) = line.rsplit_once(' ').unwrap();
        assert!(series.starts_with("evalfleet_"), "{line}");
        assert!(value.parse::<f64>().is_ok(), "{line}");
    }
    for expected in [
        "evalfleet_items{run=\"slow-1\",state=\"done\"}",
        "evalfleet_concurrency_limit{run=\"slow-1\",endpoint=\"m\"} 2",
        "evalfleet_calls_total{run=\"slow-1\",endpoint=\"m\",outcome=\"answered\"}",
        "evalfleet_latency_seconds_bucket{le=\"+Inf\",run=\"slow-1\",endpoint=\"m\"}",
        "evalfleet_in_flight{run=\"slow-1\",endpoint=\"m\"}",
        "evalfleet_process_rss_mib{run=\"slow-1\"}",
    ] {
        assert!(metrics.contains(expected), "no {expected} in:\n{metrics}");
    }
    // The same samples, as series with their peak and mean.
    let resources = get(&format!("{base}/api/v1/runs/slow-1/resources")).await;
    let own = resources["summary"]["series"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["series"] == json!({"source": "evalfleet", "name": "", "metric": "rss_mb"}))
        .unwrap_or_else(|| panic!("{resources}"))
        .clone();
    assert!(own["peak"].as_f64().unwrap() >= own["mean"].as_f64().unwrap());
    assert!(own["mean"].as_f64().unwrap() > 1.0, "{own}");
    assert!(
        resources["points"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["series"]["metric"] == "rss_mb"),
        "{resources}"
    );
    let response = client()
        .post(format!("{base}/api/v1/runs/slow-1/cancel"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 202);
    let stopped = wait_for_state(&base, "slow-1", "interrupted").await;
    let done = stopped["counts"]["done"].as_u64().unwrap();
    assert!(done < 300, "it was not stopped: {stopped}");
    // Cancelling a run this server is not running says so.
    let response = client()
        .post(format!("{base}/api/v1/runs/slow-1/cancel"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 409);
    let response = client()
        .post(format!("{base}/api/v1/runs/slow-1/resume"))
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 202, "{}", response.text().await.unwrap());
    let run = wait_for_state(&base, "slow-1", "finished").await;
    assert_eq!(
        run["counts"],
        json!({"pending": 0, "done": 300, "failed": 0})
    );
    assert_eq!(run["sessions"], 2);
    let rows = env.export("slow-1").await;
    let ids: std::collections::BTreeSet<&str> = rows
        .iter()
        .map(|r| r["item_id"].as_str().unwrap())
        .collect();
    assert_eq!(
        (rows.len(), ids.len()),
        (300, 300),
        "each item exactly once"
    );
    // Nothing left: a resume is refused, saying why.
    let response = client()
        .post(format!("{base}/api/v1/runs/slow-1/resume"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 409);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_loopback_address_needs_a_key_and_a_key_lets_only_its_holders_in() {
    let env = Env::new();
    let ran = env
        .command(&["serve", "--bind", "0.0.0.0:0"])
        .env_remove("EVALFLEET_API_KEY")
        .output()
        .await
        .unwrap();
    assert_eq!(ran.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&ran.stderr);
    assert!(stderr.contains("EVALFLEET_API_KEY"), "{stderr}");

    let (_server, base) = serve(&env, &[], Some("s3cret-key")).await;
    let response = client()
        .get(format!("{base}/api/v1/runs"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
    let response = client()
        .get(format!("{base}/api/v1/runs"))
        .header("x-api-key", "s3cret-key")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let response = client()
        .get(format!("{base}/api/v1/runs"))
        .bearer_auth("s3cret-key")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runs_live_stream_follows_it_second_by_second_to_its_end() {
    let env = Env::new();
    let (_server, base) = serve(&env, &[], None).await;
    let response = client()
        .post(format!("{base}/api/v1/runs"))
        .json(&json!({"config": config(&env, 120, "40ms", 4, ""), "run_id": "live-1"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let mut stream = client()
        .get(format!("{base}/api/v1/runs/live-1/stream"))
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    // Read the events until the server ends the stream (the run ended).
    let mut text = String::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while let Some(chunk) = tokio::time::timeout_at(deadline, stream.chunk())
        .await
        .expect("the stream ended in time")
        .unwrap()
    {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    let mut messages = Vec::new();
    let mut kind = "";
    for line in text.lines() {
        if let Some(k) = line.strip_prefix("event: ") {
            kind = k;
        } else if let Some(data) = line.strip_prefix("data: ") {
            messages.push((
                kind.to_owned(),
                serde_json::from_str::<Value>(data).unwrap(),
            ));
        }
    }
    assert_eq!(messages[0].0, "snapshot", "{text}");
    assert!(messages[1..].iter().all(|(k, _)| k == "update"), "{text}");
    let (_, last) = messages.last().unwrap();
    assert_eq!(last["run"]["state"], "finished", "{last}");
    assert_eq!(last["run"]["counts"]["done"], 120);
    // Seconds of the run came as they went, with the endpoint's calls.
    let points: Vec<&Value> = messages
        .iter()
        .flat_map(|(_, m)| {
            m["points"]
                .as_array()
                .or_else(|| m["timeline"].as_array())
                .into_iter()
                .flatten()
        })
        .collect();
    assert!(!points.is_empty(), "{text}");
    assert!(
        points
            .iter()
            .any(|p| p["endpoints"][0]["calls_per_s"].as_f64().unwrap_or(0.0) > 0.0),
        "{text}"
    );
    // And its events (the session's start, its end).
    let events: Vec<&Value> = messages
        .iter()
        .flat_map(|(_, m)| {
            m["events"]
                .as_array()
                .or_else(|| m["run"]["events"].as_array())
                .into_iter()
                .flatten()
        })
        .collect();
    assert!(events.iter().any(|e| e["kind"] == "finished"), "{text}");
}

/// Prometheus shows each stopped run's outcome, as every other surface
/// does: 1 for the one it came to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_shows_each_stopped_run_s_outcome() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 4);
    let endpoint = "  - { name: m, kind: mock }\n";
    env.write("run.yaml", &crate::util::config(&dataset, endpoint, ""));
    let whole = env
        .evalfleet(&["run", "run.yaml", "-q", "--run-id", "whole"])
        .await;
    assert_eq!(whole.code, Some(0), "{}", whole.stderr);
    env.write(
        "run.yaml",
        &crate::util::config(
            &dataset,
            endpoint,
            "  parse: { regex: \"^(question [01]) \" }\n  max_reasks: 0",
        ),
    );
    let part = env
        .evalfleet(&["run", "run.yaml", "-q", "--run-id", "part"])
        .await;
    assert_eq!(part.code, Some(1), "{}", part.stderr);
    let (_server, base) = serve(&env, &["--read-only"], None).await;
    let metrics = client()
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for expected in [
        "evalfleet_run_outcome{run=\"whole\",outcome=\"complete\"} 1",
        "evalfleet_run_outcome{run=\"whole\",outcome=\"incomplete\"} 0",
        "evalfleet_run_outcome{run=\"part\",outcome=\"incomplete\"} 1",
        "evalfleet_run_scored_items{run=\"part\"} 2",
        "evalfleet_run_scored_items{run=\"whole\"} 4",
    ] {
        assert!(metrics.contains(expected), "no {expected} in:\n{metrics}");
    }
}

/// The endpoint limit that run `run_id`'s last snapshot in `env`'s store
/// holds (`status --json`).
async fn stored_limit(env: &Env, run_id: &str) -> u64 {
    let state = env.evalfleet(&["status", run_id, "--json"]).await;
    assert_eq!(state.code, Some(0), "{}", state.stderr);
    let state: Value = serde_json::from_str(&state.stdout).unwrap();
    state["endpoint_states"]["endpoints"][0]["limit"]
        .as_u64()
        .unwrap_or_else(|| panic!("no endpoint limit stored: {state}"))
}

/// Posts `text` as a run to `base`; its id.
async fn start_run(base: &str, text: &str) -> String {
    let response = client()
        .post(format!("{base}/api/v1/runs"))
        .json(&json!({"config": text}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    response.json::<Value>().await.unwrap()["run_id"]
        .as_str()
        .unwrap()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_served_side_by_side_share_the_open_files() {
    // A server that may keep 1,024 files open: (1,024 - 128) / 2 = 448
    // calls at once, two files a call to its built-in mock.
    let env = Env::new();
    let mut command = Command::new("sh");
    command.args([
        "-c",
        "ulimit -n 1024 && exec \"$0\" serve --bind 127.0.0.1:0",
        BIN,
    ]);
    let (_server, base) = started(command, &env, &[]).await;

    // A long run takes its 448 calls' files...
    let long = start_run(&base, &config(&env, 1500, "1s", 1000, "")).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let run = get(&format!("{base}/api/v1/runs/{long}")).await;
        if run["counts"]["done"].as_u64().unwrap_or(0) > 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no item done: {run}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // ...and a run started beside it gets what is left: one call.
    let beside = start_run(&base, &config(&env, 10, "5ms", 1000, "")).await;
    wait_for_state(&base, &beside, "finished").await;
    let long_run = get(&format!("{base}/api/v1/runs/{long}")).await;
    assert_eq!(
        long_run["state"], "running",
        "the long run ended first: {long_run}"
    );
    wait_for_state(&base, &long, "finished").await;
    assert_eq!(stored_limit(&env, &long).await, 448);
    assert_eq!(stored_limit(&env, &beside).await, 1);
    // Once both have ended, their files are back: a new run gets 448.
    let after = start_run(&base, &config(&env, 10, "5ms", 1000, "")).await;
    wait_for_state(&base, &after, "finished").await;
    assert_eq!(stored_limit(&env, &after).await, 448);
}
