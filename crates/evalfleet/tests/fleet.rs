//! The fleet: endpoints that die or hang, engines the run starts, restarts
//! and stops, remote engines over SSH, changes during a run, quotas.

use std::path::Path;

use evalfleet_core::store::prelude::*;
use evalfleet_mock::MockSettings;
use serde_json::Value;
use tokio::process::{Child, Command};

use crate::util::{BIN, Env, by_id, config, external, external_with, mock, ms, wait_until};

/// Whether a process runs (a zombie does not count).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z')),
        Err(_) => false,
    }
}

/// The run's events, from its store.
fn events(env: &Env, run_id: &str) -> Vec<(String, String)> {
    let Ok(mut store) = evalfleet_store::SqliteStore::open_existing(&env.store_path()) else {
        return Vec::new();
    };
    store
        .events(run_id)
        .unwrap_or_default()
        .into_iter()
        .map(|e| (e.kind.to_string(), e.message))
        .collect()
}

/// The pids of engines the run started (from its `started` events), in order.
fn engine_pids(env: &Env, run_id: &str) -> Vec<u32> {
    events(env, run_id)
        .iter()
        .filter(|(kind, _)| kind == "started")
        .filter_map(|(_, message)| {
            let rest = message.split("(pid ").nth(1)?;
            rest.split([',', ')']).next()?.parse().ok()
        })
        .collect()
}

fn done(env: &Env, run_id: &str) -> u64 {
    evalfleet_store::SqliteStore::open_existing(&env.store_path())
        .ok()
        .and_then(|mut s| s.counts(run_id).ok())
        .map_or(0, |c| c.done)
}

/// An `evalfleet mock` process on `port` (0: any), and its base URL.
async fn mock_process(args: &[&str]) -> (Child, String) {
    let mut child = Command::new(BIN)
        .arg("mock")
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
    let url = lines.next_line().await.unwrap().unwrap();
    (child, url)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_endpoint_loses_nothing_its_items_finish_on_the_others() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 600);
    let mut endpoints = String::new();
    let mut servers = Vec::new();
    for name in ["a", "b", "c"] {
        let (child, url) = mock_process(&["--latency", "20ms"]).await;
        endpoints.push_str(&format!(
            "  - {{ name: {name}, kind: external, base_url: \"{url}\", model: m, concurrency: 4, \
             health: {{ interval: 200ms, timeout: 300ms }} }}\n"
        ));
        servers.push(child);
    }
    env.write(
        "run.yaml",
        &config(&dataset, &endpoints, "retry: { backoff_base: 20ms }"),
    );
    let mut run = env.spawn(&["run", "run.yaml", "-q", "--run-id", "r"]);
    wait_until(ms(30_000), "100 items are done", || done(&env, "r") >= 100).await;
    servers[1].kill().await.unwrap();
    let status = run.wait().await.unwrap();
    assert_eq!(status.code(), Some(0));

    let rows = by_id(&env.export("r").await);
    assert_eq!(rows.len(), 600, "every item exactly once");
    let mut served = std::collections::BTreeMap::<String, u64>::new();
    for row in rows.values() {
        assert_eq!(row["status"], "done");
        assert_eq!(row["output"], row["item"]["question"]);
        *served
            .entry(row["endpoint"].as_str().unwrap().to_owned())
            .or_default() += 1;
    }
    assert!(
        served["a"] + served["c"] > 400,
        "the others took over: {served:?}"
    );
    let events = events(&env, "r");
    assert!(
        events
            .iter()
            .any(|(kind, m)| kind == "unhealthy" && m.contains("Endpoint b")),
        "{events:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_endpoint_is_marked_unhealthy_in_time_and_routed_around() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 200);
    // Accepts connections and never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hang_url = format!("http://{}/v1", listener.local_addr().unwrap());
    let held = tokio::spawn(async move {
        let mut sockets = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            sockets.push(socket);
        }
    });
    let good = mock(MockSettings {
        latency: ms(10),
        ..MockSettings::default()
    })
    .await;
    let endpoints = format!(
        "  - {{ name: hang, kind: external, base_url: \"{hang_url}\", model: m, concurrency: 4, \
         health: {{ interval: 200ms, timeout: 300ms, max_failures: 2 }} }}\n"
    ) + &external("good", &good, 4);
    env.write(
        "run.yaml",
        &config(
            &dataset,
            &endpoints,
            "timeouts: { attempt: 5s }\nretry: { backoff_base: 10ms }",
        ),
    );
    let ran = env
        .evalfleet(&["run", "run.yaml", "-q", "--run-id", "h"])
        .await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let rows = by_id(&env.export("h").await);
    assert_eq!(rows.len(), 200);
    assert!(
        rows.values()
            .all(|r| r["status"] == "done" && r["endpoint"] == "good")
    );

    // Two failed probes of 300 ms, 200 ms apart: unhealthy within about a
    // second, long before the 5 s attempt timeout of the calls sent to it
    // first. That order is what the test holds, read from the store, not
    // how long it took (a busy machine slows every timer).
    let mut store = env.store();
    let all = store.events("h").unwrap();
    let unhealthy = all
        .iter()
        .find(|e| e.kind.as_str() == "unhealthy" && e.endpoint.as_deref() == Some("hang"))
        .unwrap_or_else(|| panic!("hang was never marked unhealthy: {all:?}"))
        .at_ms;
    let conn = rusqlite::Connection::open(env.store_path()).unwrap();
    let on_hang: Vec<(i64, f64)> = conn
        .prepare("SELECT sent_at, latency_ms FROM attempts WHERE endpoint = 'hang'")
        .unwrap()
        .query_map([], |row| Ok((row.get(0)?, row.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert!(!on_hang.is_empty(), "no call was sent to hang");
    for &(sent, latency) in &on_hang {
        assert!(sent <= unhealthy, "a call sent to hang once unhealthy");
        assert!(
            sent as f64 + latency >= unhealthy as f64,
            "a call on hang timed out before it was marked unhealthy: {on_hang:?}, unhealthy at {unhealthy}"
        );
    }
    held.abort();
}

fn local_engine(dataset: &Path, latency: &str, extra: &str) -> String {
    let endpoint = format!(
        "  - name: engine\n    kind: local\n    command: \"{BIN} mock --bind 127.0.0.1:{{port}} --latency {latency}\"\n    \
         model: mock\n    concurrency: 4\n    restart_delay: 200ms\n    stop_grace: 2s\n    \
         health: {{ interval: 200ms, timeout: 500ms }}\n{extra}"
    );
    config(dataset, &endpoint, "retry: { backoff_base: 20ms }")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_engine_killed_from_outside_is_restarted_and_stopped_at_the_end() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 600);
    env.write("run.yaml", &local_engine(&dataset, "20ms", ""));
    let mut run = env.spawn(&["run", "run.yaml", "-q", "--run-id", "e"]);
    wait_until(ms(30_000), "the engine serves", || {
        done(&env, "e") >= 50 && !engine_pids(&env, "e").is_empty()
    })
    .await;
    let first = engine_pids(&env, "e")[0];
    assert!(alive(first));
    let killed = Command::new("kill")
        .args(["-KILL", &first.to_string()])
        .status()
        .await
        .unwrap();
    assert!(killed.success());
    wait_until(ms(30_000), "a second engine is started", || {
        engine_pids(&env, "e").len() >= 2
    })
    .await;
    let status = run.wait().await.unwrap();
    assert_eq!(status.code(), Some(0));

    let rows = by_id(&env.export("e").await);
    assert_eq!(rows.len(), 600);
    assert!(rows.values().all(|r| r["status"] == "done"));
    let pids = engine_pids(&env, "e");
    assert_ne!(pids[0], pids[1]);
    for pid in &pids {
        assert!(!alive(*pid), "engine pid {pid} outlived the run");
    }
    let kinds: Vec<String> = events(&env, "e").into_iter().map(|(k, _)| k).collect();
    for kind in ["started", "ready", "died", "restarting", "stopped"] {
        assert!(
            kinds.iter().any(|k| k == kind),
            "no {kind} event in {kinds:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_does_not_outlive_a_run_killed_with_sigkill() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 2000);
    env.write("run.yaml", &local_engine(&dataset, "200ms", ""));
    let mut run = env.spawn(&["run", "run.yaml", "-q", "--run-id", "k"]);
    wait_until(ms(30_000), "the engine serves", || {
        done(&env, "k") >= 8 && !engine_pids(&env, "k").is_empty()
    })
    .await;
    let pid = engine_pids(&env, "k")[0];
    assert!(alive(pid));
    run.kill().await.unwrap();
    wait_until(ms(20_000), "the engine is gone", || !alive(pid)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_keeps_failing_is_left_out_and_the_run_stops_resumable() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 10);
    // A judge endpoint takes no items: it alone does not keep the run going.
    let endpoint = "  - name: broken\n    kind: local\n    command: \"exit 3\"\n    model: m\n    \
                    restarts: 1\n    restart_delay: 100ms\n    startup_timeout: 5s\n\
                    \x20 - name: judge\n    kind: mock\n    role: judge\n    model: m\n";
    env.write("run.yaml", &config(&dataset, endpoint, ""));
    let ran = env
        .evalfleet(&["run", "run.yaml", "-q", "--run-id", "x"])
        .await;
    assert_eq!(ran.code, Some(130), "{}", ran.stderr);
    assert!(ran.stderr.contains("No endpoint is left"), "{}", ran.stderr);
    let counts = env.counts("x");
    assert_eq!(counts.pending, 10, "nothing lost, everything resumable");
    let kinds: Vec<String> = events(&env, "x").into_iter().map(|(k, _)| k).collect();
    assert_eq!(
        kinds.iter().filter(|k| *k == "start_failed").count(),
        2,
        "{kinds:?}"
    );
    assert!(kinds.iter().any(|k| k == "excluded"));
    let run = env.store().run("x").unwrap();
    assert!(run.message.unwrap().contains("No endpoint is left"));
}

/// An `ssh` stand-in: records its arguments, runs "remote" commands here, and
/// plays the tunnel (the engine listens on the forwarded port itself).
const FAKE_SSH: &str = r#"#!/usr/bin/env bash
printf '%s\n' "$*" >> "$EF_SSH_LOG"
for arg in "$@"; do
  if [ "$arg" = "-N" ]; then exec sleep 100000; fi
done
tmux() {
  case "$1" in
    new-session)
      shift; session=""
      while [ $# -gt 1 ]; do
        case "$1" in -s) session="$2"; shift 2;; *) shift;; esac
      done
      setsid bash -c "$1" > "$EF_SSH_DIR/$session.out" 2>&1 &
      echo $! > "$EF_SSH_DIR/$session.pid" ;;
    kill-session)
      session="$3"
      kill -TERM -- "-$(cat "$EF_SSH_DIR/$session.pid")" 2>/dev/null
      rm -f "$EF_SSH_DIR/$session.pid" ;;
  esac
}
eval "${@: -1}"
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_engine_starts_over_ssh_in_tmux_is_reached_through_the_tunnel_and_stopped() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 100);
    let ssh = env.write("fake-ssh", FAKE_SSH);
    std::fs::set_permissions(&ssh, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let endpoint = format!(
        "  - name: box\n    kind: remote\n    host: me@gpu-box\n    ssh: {}\n    \
         command: \"{BIN} mock --bind 127.0.0.1:{{port}}\"\n    model: mock\n    port: {port}\n    \
         local_port: {port}\n    gpu: 1\n    concurrency: 4\n    stop_grace: 2s\n",
        ssh.display()
    );
    env.write("run.yaml", &config(&dataset, &endpoint, ""));
    let log = env.path("ssh.log");

    let dry = env.evalfleet(&["run", "run.yaml", "--dry-run"]).await;
    assert_eq!(dry.code, Some(0), "{}", dry.stderr);
    assert!(
        dry.stdout.contains("tmux new-session -d -s evalfleet-box"),
        "{}",
        dry.stdout
    );
    assert!(
        dry.stdout
            .contains(&format!("-L {port}:127.0.0.1:{port} me@gpu-box")),
        "{}",
        dry.stdout
    );
    assert!(
        dry.stdout.contains("tmux kill-session -t evalfleet-box"),
        "{}",
        dry.stdout
    );
    assert!(
        !log.exists() && !env.store_path().exists(),
        "a dry run runs and writes nothing"
    );

    let ran = env
        .command(&["run", "run.yaml", "-q", "--run-id", "rm"])
        .env("EF_SSH_LOG", &log)
        .env("EF_SSH_DIR", env.dir.path())
        .output()
        .await
        .unwrap();
    let ran: crate::util::Ran = ran.into();
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let rows = by_id(&env.export("rm").await);
    assert_eq!(rows.len(), 100);
    assert!(
        rows.values()
            .all(|r| r["status"] == "done" && r["endpoint"] == "box")
    );

    let calls = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = calls.lines().collect();
    assert_eq!(lines.len(), 3, "start, tunnel, stop: {calls}");
    assert!(
        lines[0].starts_with("me@gpu-box tmux new-session -d -s evalfleet-box"),
        "{calls}"
    );
    assert!(lines[0].contains("CUDA_VISIBLE_DEVICES=1"), "{calls}");
    assert!(
        lines[1].contains(&format!(
            "-N -o ExitOnForwardFailure=yes -L {port}:127.0.0.1:{port} me@gpu-box"
        )),
        "{calls}"
    );
    assert_eq!(
        lines[2], "me@gpu-box tmux kill-session -t evalfleet-box",
        "{calls}"
    );
    assert!(
        !env.path("evalfleet-box.pid").exists(),
        "the session was ended"
    );
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "the remote engine still listens"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_join_and_leave_a_running_run() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 300);
    let a = mock(MockSettings {
        latency: ms(30),
        ..MockSettings::default()
    })
    .await;
    let b = mock(MockSettings {
        latency: ms(30),
        ..MockSettings::default()
    })
    .await;
    let endpoints = external("a", &a, 2) + &external("b", &b, 2);
    env.write("run.yaml", &config(&dataset, &endpoints, ""));
    let mut run = env.spawn(&["run", "run.yaml", "-q", "--run-id", "f", "--endpoints", "a"]);
    wait_until(ms(30_000), "a serves", || done(&env, "f") >= 20).await;
    assert_eq!(b.stats().requests, 0, "b is not in the run yet");

    let added = env.evalfleet(&["fleet", "add", "f", "b"]).await;
    assert_eq!(added.code, Some(0), "{}", added.stderr);
    wait_until(ms(30_000), "b serves", || b.stats().completed >= 10).await;
    let removed = env.evalfleet(&["fleet", "remove", "f", "a"]).await;
    assert_eq!(removed.code, Some(0), "{}", removed.stderr);
    wait_until(ms(30_000), "a has left", || {
        events(&env, "f").iter().any(|(kind, _)| kind == "removed")
    })
    .await;
    let a_after_removal = a.stats().requests;
    assert_eq!(run.wait().await.unwrap().code(), Some(0));
    assert!(
        a.stats().requests <= a_after_removal + 2,
        "a kept getting items after it left"
    );

    let rows = by_id(&env.export("f").await);
    assert_eq!(rows.len(), 300);
    assert!(rows.values().all(|r| r["status"] == "done"));
    let unknown = env.evalfleet(&["fleet", "add", "f", "nope"]).await;
    assert_eq!(unknown.code, Some(2));
    let stopped = env.evalfleet(&["fleet", "add", "f", "a"]).await;
    assert_eq!(stopped.code, Some(2), "the run is over: {}", stopped.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_pauses_the_endpoint_instead_of_collecting_429s() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 80);
    // 20 requests a second, bursts of 5, 429 with Retry-After beyond.
    let quota = mock(MockSettings {
        rpm: Some(1200),
        burst: 5,
        ..MockSettings::default()
    })
    .await;
    env.write(
        "run.yaml",
        &config(
            &dataset,
            &external_with("hosted", &quota, 16, "health: { max_failures: 1000000 }"),
            "",
        ),
    );
    let ran = env
        .evalfleet(&["run", "run.yaml", "-q", "--run-id", "q"])
        .await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let stats = quota.stats();
    assert_eq!(stats.completed, 80);
    let per_success = stats.rate_limited as f64 / stats.completed as f64;
    assert!(
        per_success < 0.5,
        "{} 429s for 80 answers",
        stats.rate_limited
    );
    let learned: Vec<String> = events(&env, "q")
        .into_iter()
        .filter(|(kind, _)| kind == "quota")
        .map(|(_, m)| m)
        .collect();
    assert!(!learned.is_empty(), "no quota event");
    let status: Value =
        serde_json::from_str(&env.evalfleet(&["status", "q", "--json"]).await.stdout).unwrap();
    let state = &status["endpoint_states"]["endpoints"][0];
    assert!(state["learned_rate"].as_f64().is_some(), "{state}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_endpoint_is_not_probed_and_an_idle_one_once_per_interval() {
    // As llama-cpp-python's server, one call at a time: its model list
    // waits for the model and cuts the running stream. Probed on it every
    // 150 ms while it streams answers one after another, it would lose
    // one answer a probe; its answers are the signal that it works.
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 20);
    let busy = mock(MockSettings {
        interrupt_on_arrival: true,
        stream_usage: false,
        latency: ms(20),
        itl: ms(5),
        output_tokens: Some(20),
        ..MockSettings::default()
    })
    .await;
    // Answers nothing during the run: it is probed as before.
    let idle = mock(MockSettings::default()).await;
    let health = "health: { interval: 150ms, timeout: 1s }";
    let endpoints = external_with("busy", &busy, 1, health)
        + &external_with("idle", &idle, 1, &format!("role: judge, {health}"));
    let text = config(&dataset, &endpoints, "")
        .replace("max_tokens: 64 }", "max_tokens: 64 }\n  stream: true");
    env.write("run.yaml", &text);
    let started = std::time::Instant::now();
    let ran = env
        .evalfleet(&["run", "run.yaml", "-q", "--run-id", "p"])
        .await;
    let elapsed = started.elapsed();
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let rows = by_id(&env.export("p").await);
    assert!(rows.values().all(|r| r["status"] == "done"), "{rows:?}");
    let stats = busy.stats();
    assert_eq!(
        (stats.interrupted, stats.model_listings),
        (0, 0),
        "probes cut the busy endpoint's answers ({:?} for 20 items)",
        elapsed
    );
    assert_eq!(stats.requests, 20);
    // The idle one: one probe per interval, not a loop, and not none. The
    // run lasts several intervals (20 answers of 120 ms one at a time).
    let probes = idle.stats().model_listings as f64;
    let intervals = elapsed.as_secs_f64() / 0.15;
    assert!(
        intervals >= 6.0 && probes >= intervals / 3.0 && probes <= intervals + 4.0,
        "{probes} probes of the idle endpoint in {elapsed:?}"
    );
}

#[tokio::test]
async fn an_endpoint_reads_its_engines_load_while_it_serves_and_one_that_reports_none_once() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 30);
    let engine = || {
        mock(MockSettings {
            capacity: Some(2),
            latency: ms(100),
            ..MockSettings::default()
        })
    };
    let (reports, silent, unread) = (engine().await, engine().await, engine().await);
    let endpoints = [
        external_with("a", &reports, 4, "load: { engine: vllm, interval: 100ms }"),
        external_with(
            "b",
            &silent,
            4,
            // Its answer there is no vLLM's.
            "load: { engine: vllm, path: /props, interval: 100ms }",
        ),
        external("c", &unread, 4),
    ]
    .concat();
    env.write("run.yaml", &config(&dataset, &endpoints, ""));
    let started = std::time::Instant::now();
    // The readings end with the endpoints: a reader left running would
    // keep the run from ending.
    let ran = tokio::time::timeout(
        std::time::Duration::from_secs(120),
        env.evalfleet(&["run", "run.yaml", "-q", "--run-id", "l"]),
    )
    .await
    .expect("the run ends");
    let elapsed = started.elapsed();
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    // Read while it had calls in flight, once per interval at most.
    let readings = reports.stats().load_readings;
    let most = elapsed.as_secs_f64() / 0.1 + 4.0;
    assert!(
        readings >= 2 && readings as f64 <= most,
        "{readings} readings in {elapsed:?} (at most {most:.0})"
    );
    // An engine that does not report its load is asked once; one whose
    // load is not to be read, never.
    assert_eq!(silent.stats().load_readings, 1);
    assert_eq!(unread.stats().load_readings, 0);
    assert!(silent.stats().completed > 0 && unread.stats().completed > 0);
}
