//! Engines' own account of their load (`fleet::load`): the answers of
//! llama.cpp, vLLM and SGLang read from recorded fixtures
//! (`tests/data/load/`, see its README), hostile answers, the `load:`
//! keys, and the poller against real HTTP servers on 127.0.0.1:0 serving
//! recorded answers, and against the mock.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use evalfleet_config::{EndpointConfig, LoadEngine};
use evalfleet_fleet::load::{LoadError, read_answer, read_metrics, read_props, read_slots};
use evalfleet_fleet::{Endpoint, EngineLoad, LoadState, Phase};
use serde_json::{Value, json};
use tokio::sync::watch;

fn fixture(name: &str) -> Vec<u8> {
    let path = format!("{}/tests/data/load/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|err| panic!("{path}: {err}"))
}

fn text(name: &str) -> String {
    String::from_utf8(fixture(name)).unwrap()
}

fn load(
    capacity: Option<usize>,
    running: usize,
    waiting: Option<usize>,
    kv: Option<f64>,
) -> EngineLoad {
    EngineLoad {
        capacity,
        running: Some(running),
        waiting,
        kv_cache: kv,
    }
}

#[test]
fn llama_cpp_answers_recorded_from_a_real_server_read_as_its_load() {
    assert_eq!(read_props(&fixture("llama.cpp-props.json")), Ok(4));
    assert_eq!(
        read_slots(&fixture("llama.cpp-slots-idle.json")),
        Ok(load(Some(4), 0, None, None))
    );
    assert_eq!(
        read_slots(&fixture("llama.cpp-slots-busy.json")),
        Ok(load(Some(4), 4, None, None))
    );
    let engine = LoadEngine::LlamaCpp;
    assert_eq!(
        read_metrics(engine, &text("llama.cpp-metrics-idle.txt")),
        Ok(load(None, 0, Some(0), None))
    );
    // Six streams on four slots: four run, two are deferred.
    assert_eq!(
        read_metrics(engine, &text("llama.cpp-metrics-busy.txt")),
        Ok(load(None, 4, Some(2), None))
    );
    // An answer is read by its shape: a list is its slots.
    assert_eq!(
        read_answer(engine, &fixture("llama.cpp-slots-busy.json")),
        Ok(load(Some(4), 4, None, None))
    );
    assert_eq!(
        read_answer(engine, &fixture("llama.cpp-metrics-busy.txt")),
        Ok(load(None, 4, Some(2), None))
    );
    // Before late 2024, a slot said `state`, 0 when idle.
    let old = br#"[{"id":0,"state":0},{"id":1,"state":1},{"id":2,"state":3}]"#;
    assert_eq!(read_slots(old), Ok(load(Some(3), 2, None, None)));
}

#[test]
fn vllm_and_sglang_metrics_read_as_their_load() {
    let vllm = LoadEngine::Vllm;
    // Two data-parallel engines: their requests add up; the fuller KV
    // cache counts.
    assert_eq!(
        read_metrics(vllm, &text("vllm-busy-dp2.txt")),
        Ok(load(None, 21, Some(3), Some(0.8712)))
    );
    assert_eq!(
        read_metrics(vllm, &text("vllm-idle.txt")),
        Ok(load(None, 0, Some(0), Some(0.0)))
    );
    // The old engine: swapped requests wait too; the KV cache under its
    // old name.
    assert_eq!(
        read_metrics(vllm, &text("vllm-v0-busy.txt")),
        Ok(load(None, 32, Some(7), Some(0.9731)))
    );
    let sglang = LoadEngine::Sglang;
    // Tensor-parallel ranks repeat the first one's requests: counted once.
    assert_eq!(
        read_metrics(sglang, &text("sglang-busy-tp2.txt")),
        Ok(load(None, 48, Some(7), Some(0.62)))
    );
    // Data-parallel ranks each have their own.
    assert_eq!(
        read_metrics(sglang, &text("sglang-dp2.txt")),
        Ok(load(None, 45, Some(4), Some(0.55)))
    );
}

fn not_reported(result: Result<impl std::fmt::Debug, LoadError>) -> String {
    match result {
        Err(LoadError::NotReported(why)) => why,
        other => panic!("expected 'not reported', got {other:?}"),
    }
}

fn unusable(result: Result<impl std::fmt::Debug, LoadError>) -> String {
    match result {
        Err(LoadError::Unusable(why)) => why,
        other => panic!("expected 'unusable', got {other:?}"),
    }
}

#[test]
fn an_answer_in_another_format_is_no_report_of_load() {
    let why = not_reported(read_metrics(LoadEngine::Vllm, &text("sglang-busy-tp2.txt")));
    assert!(why.contains("no vllm:* metric"), "{why}");
    let why = not_reported(read_metrics(LoadEngine::LlamaCpp, &text("vllm-idle.txt")));
    assert!(why.contains("llamacpp:"), "{why}");
    // The engine's metrics, without the one that tells its running
    // requests.
    let without: String = text("vllm-busy-dp2.txt")
        .lines()
        .filter(|l| !l.contains("num_requests_running"))
        .map(|l| format!("{l}\n"))
        .collect();
    let why = not_reported(read_metrics(LoadEngine::Vllm, &without));
    assert!(why.contains("no vllm:num_requests_running"), "{why}");
    for body in [
        &b""[..],
        b"<html><body>Not here</body></html>",
        b"\xff\xfe\x00garbage\x00\x01",
        b"{\"error\": \"nope\"}",
    ] {
        not_reported(read_answer(LoadEngine::Vllm, body));
        not_reported(read_answer(LoadEngine::LlamaCpp, body));
    }
    // llama.cpp's answer when a path is off is no list of slots, nor props.
    not_reported(read_slots(&fixture("llama.cpp-metrics-off-501.json")));
    not_reported(read_props(&fixture("llama.cpp-metrics-off-501.json")));
    for slots in [&b"[]"[..], b"[{\"id\": 0}]", b"[1, 2]", b"{\"slots\": []}"] {
        not_reported(read_slots(slots));
    }
    for props in [
        r#"{"total_slots": 0}"#,
        r#"{"total_slots": -1}"#,
        r#"{"total_slots": 4.5}"#,
        r#"{"total_slots": "4"}"#,
        r#"{"total_slots": 1e12}"#,
        r#"{"total_slots": 18446744073709551615}"#,
        r#"{"model_alias": "x"}"#,
        "[4]",
    ] {
        not_reported(read_props(props.as_bytes()));
    }
}

#[test]
fn hostile_values_make_one_reading_unusable_and_garbage_lines_are_skipped() {
    let engine = LoadEngine::Vllm;
    let with = |running: &str| {
        format!(
            "vllm:num_requests_running{{model_name=\"m\"}} {running}\nvllm:num_requests_waiting{{model_name=\"m\"}} 1\n"
        )
    };
    for value in [
        "NaN",
        "+Inf",
        "-Inf",
        "-1",
        "2.5",
        "1e300",
        "18446744073709551616",
        "0x10",
        "lots",
        "",
    ] {
        let why = unusable(read_metrics(engine, &with(value)));
        assert!(why.contains("vllm:num_requests_running"), "{value}: {why}");
    }
    // Counts add up without overflowing, each one within bounds.
    let many: String = (0..100)
        .map(|i| format!("vllm:num_requests_running{{engine=\"{i}\"}} 1e9\n"))
        .collect();
    assert_eq!(
        read_metrics(engine, &many).map(|l| l.running),
        Ok(Some(100_000_000_000))
    );
    let why = unusable(read_metrics(
        engine,
        "vllm:num_requests_running 1\nvllm:kv_cache_usage_perc 1.5\n",
    ));
    assert!(why.contains("kv_cache_usage_perc"), "{why}");
    // Lines that are not samples of the metrics read, whatever they hold,
    // do not matter; a label value may hold anything.
    let noisy = concat!(
        "garbage without a value\n",
        "{{{{ }}}} ===\n",
        "\u{0}\u{7f}binary\n",
        "vllm:num_requests_running_total 99\n",
        "vllm:num_requests_runningx 99\n",
        "# vllm:num_requests_running 99\n",
        "   vllm:num_requests_running{model_name=\"a \\\"}\\\" b\",engine=\"0\"} 3 1700000000000\n",
        "vllm:num_requests_waiting{engine=\"0\"} 2 # {trace_id=\"x\"} 1.0\n",
        "# EOF\n",
    );
    assert_eq!(
        read_metrics(engine, noisy),
        Ok(load(None, 3, Some(2), None))
    );
}

/// A run's config with one endpoint of `endpoint`'s keys (name `e`).
fn endpoint_config(endpoint: Value) -> Result<EndpointConfig, String> {
    let dataset = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let mut fields = json!({"name": "e", "model": "m"});
    for (key, value) in endpoint.as_object().unwrap() {
        fields[key] = value.clone();
    }
    let config = json!({
        "name": "t",
        "dataset": {"path": dataset, "format": "jsonl"},
        "endpoints": [fields],
        "task": {"messages": [{"role": "user", "content": "{{ q }}"}]},
    });
    evalfleet_config::load_snapshot(&config, std::path::Path::new("."))
        .map(|loaded| loaded.config.endpoints[0].clone())
        .map_err(|err| err.to_string())
}

#[test]
fn a_preset_reads_its_engine_and_its_command_tells_what_it_runs_at_once() {
    let local = |preset: &str, args: &str| {
        endpoint_config(json!({"kind": "local", "preset": preset, "args": args})).unwrap()
    };
    let cases = [
        ("llama.cpp", "-np 4", Some(LoadEngine::LlamaCpp), Some(4)),
        (
            "llama.cpp",
            "--parallel=8 -c 4096",
            Some(LoadEngine::LlamaCpp),
            Some(8),
        ),
        ("llama.cpp", "", Some(LoadEngine::LlamaCpp), None),
        (
            "vllm",
            "--max-num-seqs 64 --max-num-seqs 32",
            Some(LoadEngine::Vllm),
            Some(32),
        ),
        ("vllm", "--max-num-seqs-x 64", Some(LoadEngine::Vllm), None),
        ("vllm", "--max-num-seqs 0", Some(LoadEngine::Vllm), None),
        (
            "sglang",
            "--max-running-requests 128",
            Some(LoadEngine::Sglang),
            Some(128),
        ),
        ("ollama", "", None, None),
    ];
    for (preset, args, engine, capacity) in cases {
        let config = local(preset, args);
        assert_eq!(config.load.engine, engine, "{preset} {args}");
        assert_eq!(config.load.interval, Duration::from_secs(1));
        let endpoint = Endpoint::new(&config, Duration::from_secs(60));
        assert_eq!(endpoint.engine_capacity(), capacity, "{preset} {args}");
        // Nothing read yet.
        assert_eq!(endpoint.engine_load(), None);
    }
    // The presets turn on the paths their load is read from.
    assert!(
        local("llama.cpp", "")
            .kind
            .engine()
            .unwrap()
            .command
            .contains("--metrics")
    );
    assert!(
        local("sglang", "")
            .kind
            .engine()
            .unwrap()
            .command
            .contains("--enable-metrics")
    );
    // A server someone else runs is read when said so, and not otherwise.
    let external = json!({"kind": "external", "base_url": "http://127.0.0.1:9/v1"});
    assert_eq!(endpoint_config(external.clone()).unwrap().load.engine, None);
    let mut with_load = external.clone();
    with_load["load"] = json!({"engine": "vllm", "path": "/engine/metrics", "interval": "250ms"});
    let config = endpoint_config(with_load).unwrap();
    assert_eq!(config.load.engine, Some(LoadEngine::Vllm));
    assert_eq!(config.load.path.as_deref(), Some("/engine/metrics"));
    assert_eq!(config.load.interval, Duration::from_millis(250));
    // And a preset's reading may be turned off.
    let off =
        endpoint_config(json!({"kind": "local", "preset": "vllm", "load": {"engine": "none"}}));
    assert_eq!(off.unwrap().load.engine, None);
}

#[test]
fn load_keys_are_checked_and_each_problem_named_with_its_place() {
    let err = endpoint_config(json!({
        "kind": "external",
        "base_url": "http://127.0.0.1:9/v1",
        "load": {"engine": "tgi", "path": "metrics", "interval": "50ms", "every": "1s"},
    }))
    .unwrap_err();
    for expected in [
        "endpoints[0].load.engine: must be vllm, sglang, llama.cpp or none, got 'tgi'",
        "endpoints[0].load.path: must start with '/', got 'metrics'",
        "endpoints[0].load.interval: must be at least 100ms, got 50ms",
        "endpoints[0].load",
        "every",
    ] {
        assert!(err.contains(expected), "missing '{expected}' in:\n{err}");
    }
}

/// What a stand-in engine answers on each path: a status and a body.
type Answers = HashMap<String, (u16, Vec<u8>)>;

/// One path's answer, as a test gives it.
type Answer<'a> = (&'a str, u16, Vec<u8>);

/// A stand-in engine on 127.0.0.1:0: answers each path with what it is
/// given (404 otherwise) and counts the requests of each.
struct Engine {
    addr: SocketAddr,
    answers: Arc<Mutex<Answers>>,
    hits: Arc<Mutex<HashMap<String, usize>>>,
    hit: watch::Sender<usize>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Clone)]
struct EngineState {
    answers: Arc<Mutex<Answers>>,
    hits: Arc<Mutex<HashMap<String, usize>>>,
    hit: watch::Sender<usize>,
}

async fn answer(State(state): State<EngineState>, uri: Uri) -> Response {
    let path = uri.path().to_owned();
    *state.hits.lock().unwrap().entry(path.clone()).or_default() += 1;
    state.hit.send_modify(|n| *n += 1);
    let answer = state.answers.lock().unwrap().get(&path).cloned();
    match answer {
        Some((status, body)) => {
            (StatusCode::from_u16(status).unwrap(), Bytes::from(body)).into_response()
        }
        None => (StatusCode::NOT_FOUND, "Not found").into_response(),
    }
}

impl Engine {
    async fn start(answers: &[Answer<'_>]) -> Self {
        let answers: Answers = answers
            .iter()
            .map(|(path, status, body)| ((*path).to_owned(), (*status, body.clone())))
            .collect();
        let state = EngineState {
            answers: Arc::new(Mutex::new(answers)),
            hits: Arc::default(),
            hit: watch::channel(0).0,
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = axum::Router::new()
            .fallback(answer)
            .with_state(state.clone());
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self {
            addr,
            answers: state.answers,
            hits: state.hits,
            hit: state.hit,
            task,
        }
    }

    fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    fn set(&self, path: &str, status: u16, body: Vec<u8>) {
        self.answers
            .lock()
            .unwrap()
            .insert(path.to_owned(), (status, body));
    }

    fn hits(&self, path: &str) -> usize {
        self.hits.lock().unwrap().get(path).copied().unwrap_or(0)
    }

    /// Its requests, all paths together.
    fn total(&self) -> usize {
        *self.hit.borrow()
    }

    /// Waits (at most 10 s) until it has had `n` requests in all.
    async fn wait_hits(&self, n: usize) {
        let mut rx = self.hit.subscribe();
        tokio::time::timeout(Duration::from_secs(10), rx.wait_for(|hits| *hits >= n))
            .await
            .unwrap_or_else(|_| panic!("fewer than {n} requests in 10 s"))
            .unwrap();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An endpoint at `base_url` that reads its load as `load` says, ready.
fn serving(base_url: &str, load: Value) -> Arc<Endpoint> {
    let config = endpoint_config(json!({
        "kind": "external", "base_url": base_url, "load": load,
    }))
    .unwrap();
    let endpoint = Arc::new(Endpoint::new(&config, Duration::from_secs(60)));
    endpoint.set_phase(Phase::Ready);
    endpoint
}

/// Starts `endpoint`'s poller.
fn poll(endpoint: &Endpoint, base_url: &str) -> tokio::task::JoinHandle<()> {
    let poller = endpoint.load_poller(base_url).expect("its load is read");
    tokio::spawn(poller.run())
}

/// Waits (at most 10 s) until what is known of `endpoint`'s load meets
/// `condition`, and returns it.
async fn wait_load(endpoint: &Endpoint, condition: impl FnMut(&LoadState) -> bool) -> LoadState {
    let mut rx = endpoint.load_updates();
    tokio::time::timeout(Duration::from_secs(10), rx.wait_for(condition))
        .await
        .unwrap_or_else(|_| panic!("not within 10 s: {:?}", endpoint.load_updates().borrow()))
        .unwrap()
        .clone()
}

fn latest(state: &LoadState) -> Option<EngineLoad> {
    state.latest.map(|reading| reading.load)
}

#[tokio::test]
async fn llama_cpp_is_read_from_its_props_then_its_metrics_and_only_while_busy() {
    let engine = Engine::start(&[
        ("/props", 200, fixture("llama.cpp-props.json")),
        ("/metrics", 200, fixture("llama.cpp-metrics-idle.txt")),
        ("/slots", 200, fixture("llama.cpp-slots-idle.json")),
    ])
    .await;
    let url = engine.base_url();
    let endpoint = serving(&url, json!({"engine": "llama.cpp", "interval": "100ms"}));
    // Its command says nothing: the capacity is unknown until it says it.
    assert_eq!(endpoint.engine_capacity(), None);
    let task = poll(&endpoint, &url);

    // Read once at once, idle as it is: four slots, nothing running.
    let state = wait_load(&endpoint, |s| s.latest.is_some()).await;
    assert_eq!(state.capacity, Some(4));
    assert_eq!(state.reported, Some(true));
    assert_eq!(latest(&state), Some(load(Some(4), 0, Some(0), None)));
    assert_eq!(endpoint.engine_capacity(), Some(4));
    // The adaptive limit (8 to start with) starts over at the engine's
    // slots.
    assert_eq!(endpoint.limit.current(), 4);
    assert_eq!(
        endpoint.engine_load(),
        Some(load(Some(4), 0, Some(0), None))
    );
    assert_eq!(engine.hits("/props"), 1);
    assert_eq!(engine.hits("/slots"), 0, "the metrics answered");

    // While calls are in flight it is read every interval.
    engine.set("/metrics", 200, fixture("llama.cpp-metrics-busy.txt"));
    endpoint.counters.in_flight.store(6, Ordering::Relaxed);
    let state = wait_load(&endpoint, |s| {
        latest(s).is_some_and(|l| l.running == Some(4))
    })
    .await;
    assert_eq!(latest(&state), Some(load(Some(4), 4, Some(2), None)));
    engine.wait_hits(engine.total() + 2).await;

    // Idle again, it is left alone: no request in three intervals (but
    // the one that may be under way).
    endpoint.counters.in_flight.store(0, Ordering::Relaxed);
    let allowed = engine.total() + 1;
    let more =
        tokio::time::timeout(Duration::from_millis(350), engine.wait_hits(allowed + 1)).await;
    assert!(
        more.is_err(),
        "read while idle: {} requests",
        engine.total()
    );
    assert_eq!(engine.hits("/props"), 1, "props are read once");

    // Out of service, it stops, and its reading is gone; the capacity
    // stays known.
    endpoint.set_phase(Phase::Idle);
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("the poller stops")
        .unwrap();
    assert_eq!(endpoint.engine_load(), None);
    assert_eq!(endpoint.engine_capacity(), Some(4));
}

#[tokio::test]
async fn llama_cpp_without_metrics_is_read_from_its_slots() {
    let engine = Engine::start(&[
        ("/props", 200, fixture("llama.cpp-props.json")),
        ("/metrics", 501, fixture("llama.cpp-metrics-off-501.json")),
        ("/slots", 200, fixture("llama.cpp-slots-busy.json")),
    ])
    .await;
    let url = engine.base_url();
    let endpoint = serving(&url, json!({"engine": "llama.cpp", "interval": "100ms"}));
    let task = poll(&endpoint, &url);
    let state = wait_load(&endpoint, |s| s.latest.is_some()).await;
    assert_eq!(latest(&state), Some(load(Some(4), 4, None, None)));
    assert_eq!(
        engine.hits("/metrics"),
        1,
        "a path that is off is not asked again"
    );
    endpoint.counters.in_flight.store(1, Ordering::Relaxed);
    engine.wait_hits(engine.total() + 2).await;
    assert_eq!(engine.hits("/metrics"), 1);
    task.abort();
}

#[tokio::test]
async fn an_engine_that_does_not_report_its_load_is_read_no_more() {
    let huge = vec![b'#'; 5 << 20];
    let cases: [(&str, Vec<Answer<'_>>, &str); 5] = [
        ("vllm", vec![], "HTTP 404"),
        ("llama.cpp", vec![
            ("/metrics", 501, fixture("llama.cpp-metrics-off-501.json")),
            ("/slots", 501, b"{\"error\":{\"code\":501,\"message\":\"This server does not support slots endpoint. Start it with `--slots`\"}}".to_vec()),
        ], "Start it with `--slots`"),
        ("vllm", vec![("/metrics", 200, fixture("sglang-dp2.txt"))], "no vllm:* metric"),
        ("sglang", vec![("/metrics", 200, huge)], "larger than 4 MiB"),
        ("vllm", vec![("/metrics", 401, b"unauthorised".to_vec())], "HTTP 401"),
    ];
    for (kind, answers, why) in cases {
        let engine = Engine::start(&answers).await;
        let url = engine.base_url();
        let endpoint = serving(&url, json!({"engine": kind, "interval": "100ms"}));
        endpoint.counters.in_flight.store(3, Ordering::Relaxed);
        let task = poll(&endpoint, &url);
        // It gives up of itself: never an error for the run.
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .unwrap_or_else(|_| panic!("{kind}: still reading after 10 s ({why})"))
            .unwrap();
        let state = endpoint.load_updates().borrow().clone();
        assert_eq!(state.reported, Some(false), "{kind} ({why})");
        assert_eq!(state.latest, None);
        assert_eq!(endpoint.engine_load(), None);
        let total: usize = ["/metrics", "/slots"].iter().map(|p| engine.hits(p)).sum();
        let expected = if kind == "llama.cpp" { 2 } else { 1 };
        assert_eq!(total, expected, "{kind} ({why}): each path is asked once");
    }
}

#[tokio::test]
async fn a_passing_server_error_or_bad_value_skips_a_reading_and_no_more() {
    let engine = Engine::start(&[("/metrics", 503, b"loading".to_vec())]).await;
    let url = engine.base_url();
    let endpoint = serving(&url, json!({"engine": "vllm", "interval": "100ms"}));
    let task = poll(&endpoint, &url);
    engine.wait_hits(2).await;
    assert_eq!(endpoint.load_updates().borrow().reported, None);
    engine.set("/metrics", 200, b"vllm:num_requests_running NaN\n".to_vec());
    engine.wait_hits(engine.total() + 2).await;
    assert_eq!(endpoint.load_updates().borrow().reported, None);
    engine.set("/metrics", 200, fixture("vllm-busy-dp2.txt"));
    let state = wait_load(&endpoint, |s| s.latest.is_some()).await;
    assert_eq!(state.reported, Some(true));
    assert_eq!(latest(&state), Some(load(None, 21, Some(3), Some(0.8712))));
    assert!(!task.is_finished());
    task.abort();
}

#[tokio::test]
async fn the_mock_is_read_like_an_engine_its_capacity_as_slots_and_its_queue() {
    let mock = evalfleet_mock::MockServer::start_local(evalfleet_mock::MockSettings {
        capacity: Some(2),
        latency: Duration::from_secs(300),
        ..evalfleet_mock::MockSettings::default()
    })
    .await
    .unwrap();
    let url = mock.base_url();
    let endpoint = serving(&url, json!({"engine": "llama.cpp", "interval": "100ms"}));
    let task = poll(&endpoint, &url);
    let state = wait_load(&endpoint, |s| s.latest.is_some()).await;
    assert_eq!(latest(&state), Some(load(Some(2), 0, Some(0), None)));

    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::new();
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..5 {
        let (http, url) = (http.clone(), url.clone());
        calls.spawn(async move {
            let body =
                json!({"model": "mock", "messages": [{"role": "user", "content": format!("{i}")}]});
            http.post(format!("{url}/chat/completions"))
                .header("content-type", "application/json")
                .body(serde_json::to_vec(&body).unwrap())
                .send()
                .await
        });
    }
    endpoint.counters.in_flight.store(5, Ordering::Relaxed);
    let state = wait_load(&endpoint, |s| {
        latest(s).is_some_and(|l| l.waiting == Some(3))
    })
    .await;
    assert_eq!(latest(&state), Some(load(Some(2), 2, Some(3), None)));
    task.abort();
    mock.shutdown().await.unwrap();
    while let Some(call) = calls.join_next().await {
        call.unwrap().ok();
    }
}
