//! The HTTP server: `GET /v1/models`, `POST /v1/chat/completions` (streaming
//! and not; scripted tool calls), `POST /v1/completions` (legacy text
//! completions, answered as chat is), `POST /v1/embeddings` (vectors drawn
//! from a hash of each input), `GET /mock/stats` (counters for tests and benchmarks),
//! `GET /health`, and its load told as engines tell theirs: `GET /props`
//! and `GET /slots` as llama.cpp's server answers them, and `GET /metrics`
//! with llama.cpp's, vLLM's and SGLang's gauges of requests running and
//! waiting.

use std::collections::{BTreeMap, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use futures_util::{StreamExt, stream};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::settings::{Answer, Fault, MockSettings, Quota, QuotaMode};

/// Counters kept by a running mock. Tests read them to count what reached the
/// endpoint; `GET /mock/stats` serves them as JSON.
#[derive(Debug)]
pub struct Stats {
    requests: AtomicU64,
    completed: AtomicU64,
    injected_errors: AtomicU64,
    rate_limited: AtomicU64,
    hung: AtomicU64,
    truncated: AtomicU64,
    bad_requests: AtomicU64,
    images: AtomicU64,
    image_bytes: AtomicU64,
    bad_images: AtomicU64,
    faults: AtomicU64,
    faults_by_status: Mutex<BTreeMap<u16, u64>>,
    stalled: AtomicU64,
    cut: AtomicU64,
    unended: AtomicU64,
    interrupted: AtomicU64,
    outage_refused: AtomicU64,
    in_flight: AtomicU64,
    max_in_flight: AtomicU64,
    model_listings: AtomicU64,
    load_readings: AtomicU64,
    health_checks: AtomicU64,
    first_request_at_ms: AtomicU64,
    last_completed_at_ms: AtomicU64,
    /// Served latencies: bucket `i` counts responses that took `i` ms from
    /// arrival to their last byte; the last bucket holds everything longer.
    served_ms: Box<[AtomicU64]>,
}

/// Served latencies above this many milliseconds share the last bucket.
const SERVED_BUCKETS: usize = 60_000;

impl Default for Stats {
    fn default() -> Self {
        Self {
            requests: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            injected_errors: AtomicU64::new(0),
            rate_limited: AtomicU64::new(0),
            hung: AtomicU64::new(0),
            truncated: AtomicU64::new(0),
            bad_requests: AtomicU64::new(0),
            images: AtomicU64::new(0),
            image_bytes: AtomicU64::new(0),
            bad_images: AtomicU64::new(0),
            faults: AtomicU64::new(0),
            faults_by_status: Mutex::new(BTreeMap::new()),
            stalled: AtomicU64::new(0),
            cut: AtomicU64::new(0),
            unended: AtomicU64::new(0),
            interrupted: AtomicU64::new(0),
            outage_refused: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            max_in_flight: AtomicU64::new(0),
            model_listings: AtomicU64::new(0),
            load_readings: AtomicU64::new(0),
            health_checks: AtomicU64::new(0),
            first_request_at_ms: AtomicU64::new(0),
            last_completed_at_ms: AtomicU64::new(0),
            served_ms: (0..=SERVED_BUCKETS).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

/// A copy of [`Stats`] at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct StatsSnapshot {
    /// Chat completion requests received (answered or not).
    pub requests: u64,
    /// Requests answered in full with 200.
    pub completed: u64,
    /// Requests answered with an injected error status.
    pub injected_errors: u64,
    /// Requests refused with 429 by `rpm`, `quota` or `max_concurrency`.
    pub rate_limited: u64,
    /// Requests accepted and never answered.
    pub hung: u64,
    /// Responses cut off half-way.
    pub truncated: u64,
    /// Requests whose body was not a valid chat completion request.
    pub bad_requests: u64,
    /// Images received in requests (data URLs and base64 decoded and
    /// checked; URLs counted as they are).
    pub images: u64,
    /// Their decoded bytes (data URLs and base64 only).
    pub image_bytes: u64,
    /// Requests refused with 400 because an image could not be decoded.
    pub bad_images: u64,
    /// Requests answered with one of `faults`.
    pub faults: u64,
    /// The same, by status.
    pub faults_by_status: BTreeMap<u16, u64>,
    /// Responses that stalled (`stall_rate`).
    pub stalled: u64,
    /// Streams ended early with `data: [DONE]` (`cut_rate`).
    pub cut: u64,
    /// Streams closed after their finish_reason without `[DONE]`
    /// (`unended_rate`).
    pub unended: u64,
    /// Streams ended early by the arrival of another request
    /// (`interrupt_on_arrival`).
    pub interrupted: u64,
    /// Chat completion requests refused by the `outage`.
    pub outage_refused: u64,
    /// Chat completion requests being handled now.
    pub in_flight: u64,
    /// The most chat completion requests handled at once.
    pub max_in_flight: u64,
    /// `GET /v1/models` requests.
    pub model_listings: u64,
    /// `GET /props`, `GET /slots` and `GET /metrics` requests (readings
    /// of its load).
    pub load_readings: u64,
    /// `GET /health` requests.
    pub health_checks: u64,
    /// When the first chat completion request arrived, in milliseconds since
    /// the Unix epoch (0: none yet). Benchmarks time start-up with it.
    pub first_request_at_ms: u64,
    /// When the last request answered in full finished, in milliseconds
    /// since the Unix epoch (0: none yet).
    pub last_completed_at_ms: u64,
    /// The median time from a request's arrival to its last byte, over the
    /// requests answered in full, in whole milliseconds (0: none yet).
    /// Benchmarks compare clients by it: it includes time queued at the
    /// server.
    pub served_p50_ms: u64,
    /// The 99th percentile of the same.
    pub served_p99_ms: u64,
}

fn unix_now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Stats {
    /// The counters now.
    pub fn snapshot(&self) -> StatsSnapshot {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StatsSnapshot {
            requests: load(&self.requests),
            completed: load(&self.completed),
            injected_errors: load(&self.injected_errors),
            rate_limited: load(&self.rate_limited),
            hung: load(&self.hung),
            truncated: load(&self.truncated),
            bad_requests: load(&self.bad_requests),
            images: load(&self.images),
            image_bytes: load(&self.image_bytes),
            bad_images: load(&self.bad_images),
            faults: load(&self.faults),
            faults_by_status: self
                .faults_by_status
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone(),
            stalled: load(&self.stalled),
            cut: load(&self.cut),
            unended: load(&self.unended),
            interrupted: load(&self.interrupted),
            outage_refused: load(&self.outage_refused),
            in_flight: load(&self.in_flight),
            max_in_flight: load(&self.max_in_flight),
            model_listings: load(&self.model_listings),
            load_readings: load(&self.load_readings),
            health_checks: load(&self.health_checks),
            first_request_at_ms: load(&self.first_request_at_ms),
            last_completed_at_ms: load(&self.last_completed_at_ms),
            served_p50_ms: self.served_quantile(0.5),
            served_p99_ms: self.served_quantile(0.99),
        }
    }

    /// A request answered in full, `arrived` when it came in.
    fn completed(&self, arrived: Instant) {
        self.completed.fetch_add(1, Ordering::Relaxed);
        let ms = (arrived.elapsed().as_millis() as usize).min(SERVED_BUCKETS);
        self.served_ms[ms].fetch_add(1, Ordering::Relaxed);
        self.last_completed_at_ms
            .fetch_max(unix_now_ms(), Ordering::Relaxed);
    }

    fn fault(&self, status: u16) {
        self.faults.fetch_add(1, Ordering::Relaxed);
        *self
            .faults_by_status
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(status)
            .or_insert(0) += 1;
    }

    fn served_quantile(&self, q: f64) -> u64 {
        let counts: Vec<u64> = self
            .served_ms
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return 0;
        }
        let rank = ((q * total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (ms, count) in counts.iter().enumerate() {
            seen += count;
            if seen >= rank {
                return ms as u64;
            }
        }
        SERVED_BUCKETS as u64
    }
}

/// Counts a request as in flight until dropped.
struct InFlight(Arc<MockState>);

impl InFlight {
    fn enter(state: &Arc<MockState>) -> Self {
        let now = state.stats.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        state.stats.max_in_flight.fetch_max(now, Ordering::Relaxed);
        Self(state.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A token bucket for the `rpm` quota.
struct Bucket {
    tokens: f64,
    last: Instant,
    per_second: f64,
    capacity: f64,
}

impl Bucket {
    /// Takes one request's token, or says how long until one is available.
    fn take(&mut self, now: Instant) -> Result<(), Duration> {
        let elapsed = now.duration_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.per_second).min(self.capacity);
        self.last = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64(
                (1.0 - self.tokens) / self.per_second,
            ))
        }
    }
}

/// A [`Quota`] and what is left of it.
struct QuotaBucket {
    quota: Quota,
    state: QuotaState,
}

enum QuotaState {
    /// Requests in the bucket (a fraction of one is refilling), as of `last`.
    Refill { tokens: f64, last: Instant },
    /// Requests taken in the window that began at `start` (none yet: no
    /// window has begun).
    Fixed { start: Option<Instant>, used: u32 },
}

/// What a [`QuotaBucket`] said of one request.
#[derive(Debug, Clone, Copy, PartialEq)]
struct QuotaVerdict {
    limit: u32,
    /// Whole requests left after this one.
    remaining: u32,
    /// How long until the quota is whole again.
    reset: Duration,
    /// `None`: the request may go on; else how long until one could.
    refused_for: Option<Duration>,
}

/// Lets a refill that float arithmetic left a hair short of a whole request
/// count as one.
const TOKEN_SLACK: f64 = 1e-9;

impl QuotaBucket {
    fn new(quota: Quota, now: Instant) -> Self {
        let state = match quota.mode {
            QuotaMode::Refill => QuotaState::Refill {
                tokens: f64::from(quota.limit),
                last: now,
            },
            QuotaMode::Fixed => QuotaState::Fixed {
                start: None,
                used: 0,
            },
        };
        Self { quota, state }
    }

    /// Takes one request from the quota if it has one.
    fn take(&mut self, now: Instant) -> QuotaVerdict {
        let limit = self.quota.limit;
        let window = self.quota.window;
        match &mut self.state {
            QuotaState::Refill { tokens, last } => {
                let capacity = f64::from(limit);
                let per_second = capacity / window.as_secs_f64();
                let refilled = now.saturating_duration_since(*last).as_secs_f64() * per_second;
                *tokens = (*tokens + refilled).min(capacity);
                *last = now;
                let refused_for = if *tokens + TOKEN_SLACK >= 1.0 {
                    *tokens = (*tokens - 1.0).max(0.0);
                    None
                } else {
                    Some(seconds((1.0 - *tokens) / per_second))
                };
                QuotaVerdict {
                    limit,
                    remaining: (*tokens + TOKEN_SLACK).floor() as u32,
                    reset: seconds((capacity - *tokens) / per_second),
                    refused_for,
                }
            }
            QuotaState::Fixed { start, used } => {
                let start = start.get_or_insert(now);
                let elapsed = now.saturating_duration_since(*start);
                if elapsed >= window {
                    // Windows stay aligned to the first request's.
                    let whole = elapsed.as_nanos() / window.as_nanos() * window.as_nanos();
                    *start += Duration::from_nanos(u64::try_from(whole).unwrap_or(u64::MAX));
                    *used = 0;
                }
                let reset = (*start + window).saturating_duration_since(now);
                let refused_for = if *used < limit {
                    *used += 1;
                    None
                } else {
                    Some(reset)
                };
                QuotaVerdict {
                    limit,
                    remaining: limit - *used,
                    reset,
                    refused_for,
                }
            }
        }
    }
}

impl QuotaVerdict {
    /// OpenAI's `x-ratelimit-*-requests` headers.
    fn add_headers(&self, headers: &mut HeaderMap) {
        headers.insert("x-ratelimit-limit-requests", HeaderValue::from(self.limit));
        headers.insert(
            "x-ratelimit-remaining-requests",
            HeaderValue::from(self.remaining),
        );
        if let Ok(reset) = HeaderValue::from_str(&openai_duration(self.reset)) {
            headers.insert("x-ratelimit-reset-requests", reset);
        }
    }
}

fn seconds(value: f64) -> Duration {
    Duration::try_from_secs_f64(value.max(0.0)).unwrap_or(Duration::MAX)
}

/// A duration the way OpenAI writes `x-ratelimit-reset-*` (Go's format, to
/// the millisecond, rounded up): `0s`, `100ms`, `1s`, `1m30.5s`, `6m0s`,
/// `1h0m0s`.
fn openai_duration(duration: Duration) -> String {
    // To the microsecond first, so that float noise does not round up a
    // whole millisecond.
    let ms = duration.as_micros().div_ceil(1000);
    if ms == 0 {
        return "0s".to_owned();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let hours = ms / 3_600_000;
    let minutes = ms / 60_000 % 60;
    let mut seconds = (ms / 1000 % 60).to_string();
    let fraction = ms % 1000;
    if fraction > 0 {
        seconds.push('.');
        seconds.push_str(format!("{fraction:03}").trim_end_matches('0'));
    }
    match (hours, minutes) {
        (0, 0) => format!("{seconds}s"),
        (0, minutes) => format!("{minutes}m{seconds}s"),
        (hours, minutes) => format!("{hours}h{minutes}m{seconds}s"),
    }
}

struct MockState {
    settings: MockSettings,
    stats: Arc<Stats>,
    prompt_counts: Mutex<HashMap<u64, u32>>,
    bucket: Option<Mutex<Bucket>>,
    quota: Option<Mutex<QuotaBucket>>,
    /// When the first chat request arrived (the `outage` counts from it).
    first_chat: OnceLock<Instant>,
    /// Cancelled when the next chat request arrives, with
    /// `interrupt_on_arrival`: the streams being sent end.
    running: Mutex<CancellationToken>,
    admitted: AtomicU64,
    capacity: Option<Arc<Semaphore>>,
    /// Chat requests being answered (holding a slot of `capacity`, when
    /// it is set).
    answering: AtomicU64,
    /// Chat requests waiting for a slot of `capacity`.
    queued: AtomicU64,
    shutdown: CancellationToken,
    next_id: AtomicU64,
    /// Scripted answers by first user message, or why they could not be
    /// read (then every request gets a 500 saying so).
    answers: Result<HashMap<String, crate::settings::Script>, String>,
    /// Requests seen per scripted prompt (for `samples`).
    scripted_seen: Mutex<HashMap<String, usize>>,
}

/// The mock's router, for tests that call it without a socket.
pub fn app(settings: MockSettings, stats: Arc<Stats>, shutdown: CancellationToken) -> Router {
    let bucket = settings.rpm.map(|rpm| {
        Mutex::new(Bucket {
            tokens: f64::from(settings.burst),
            last: Instant::now(),
            per_second: f64::from(rpm) / 60.0,
            capacity: f64::from(settings.burst),
        })
    });
    let quota = settings
        .quota
        .map(|quota| Mutex::new(QuotaBucket::new(quota, Instant::now())));
    let capacity = settings
        .capacity
        .map(|k| Arc::new(Semaphore::new(k as usize)));
    let answers = settings
        .answers
        .as_deref()
        .map_or_else(|| Ok(HashMap::new()), crate::settings::load_answers);
    let state = Arc::new(MockState {
        answers,
        scripted_seen: Mutex::new(HashMap::new()),
        settings,
        stats,
        prompt_counts: Mutex::new(HashMap::new()),
        bucket,
        quota,
        first_chat: OnceLock::new(),
        running: Mutex::new(CancellationToken::new()),
        admitted: AtomicU64::new(0),
        capacity,
        answering: AtomicU64::new(0),
        queued: AtomicU64::new(0),
        shutdown,
        next_id: AtomicU64::new(0),
    });
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/mock/stats", get(stats_handler))
        .route("/health", get(health))
        .route("/props", get(props))
        .route("/slots", get(slots))
        .route("/metrics", get(metrics))
        // Requests with images are large: 64 MB, where axum's default is 2.
        .layer(axum::extract::DefaultBodyLimit::max(64 << 20))
        .with_state(state)
}

/// Serves the mock on `listener` until `shutdown` is cancelled. Requests held
/// open (hangs, queues) end when it is.
pub async fn serve(
    listener: TcpListener,
    settings: MockSettings,
    stats: Arc<Stats>,
    shutdown: CancellationToken,
) -> io::Result<()> {
    let router = app(settings, stats, shutdown.clone());
    // Streams are many small writes; without TCP_NODELAY each can wait for
    // the client's delayed ACK.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, router)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
}

/// A mock running in this process, stopped when [`MockServer::shutdown`] is
/// called or the handle is dropped.
pub struct MockServer {
    addr: SocketAddr,
    stats: Arc<Stats>,
    shutdown: CancellationToken,
    task: Option<tokio::task::JoinHandle<io::Result<()>>>,
}

impl MockServer {
    /// Binds `bind` (use port 0 for any free port) and starts serving.
    pub async fn start(bind: SocketAddr, settings: MockSettings) -> io::Result<Self> {
        let listener = TcpListener::bind(bind).await?;
        let addr = listener.local_addr()?;
        let stats = Arc::new(Stats::default());
        let shutdown = CancellationToken::new();
        // The server's task is owned by this handle: dropping it (or
        // `stop`) shuts it down.
        #[allow(clippy::disallowed_methods)]
        let task = tokio::spawn(serve(listener, settings, stats.clone(), shutdown.clone()));
        Ok(Self {
            addr,
            stats,
            shutdown,
            task: Some(task),
        })
    }

    /// Starts a mock on a free port of 127.0.0.1.
    pub async fn start_local(settings: MockSettings) -> io::Result<Self> {
        Self::start(SocketAddr::from(([127, 0, 0, 1], 0)), settings).await
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The OpenAI base URL, `http://ADDR/v1`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// The counters now.
    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// Stops accepting, ends held requests and waits for the server to stop.
    pub async fn shutdown(mut self) -> io::Result<()> {
        self.shutdown.cancel();
        match self.task.take() {
            Some(task) => task.await.unwrap_or_else(|err| Err(io::Error::other(err))),
            None => Ok(()),
        }
    }
}

impl Drop for MockServer {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

async fn models(State(state): State<Arc<MockState>>) -> Response {
    state.stats.model_listings.fetch_add(1, Ordering::Relaxed);
    // llama-cpp-python's model list waits for the model, as a chat request
    // does: it interrupts the running stream as one would.
    drop(state.arrival());
    if let Some(status) = state.outage_now(Instant::now()) {
        return error_response(status, "mock outage");
    }
    json_response(
        StatusCode::OK,
        &json!({
            "object": "list",
            "data": [{"id": state.settings.model, "object": "model", "owned_by": "evalfleet-mock"}],
        }),
    )
}

async fn health(State(state): State<Arc<MockState>>) -> Response {
    state.stats.health_checks.fetch_add(1, Ordering::Relaxed);
    match state.outage_now(Instant::now()) {
        Some(status) => error_response(status, "mock outage"),
        None => "ok".into_response(),
    }
}

async fn stats_handler(State(state): State<Arc<MockState>>) -> Response {
    json_response(StatusCode::OK, &state.stats.snapshot())
}

/// llama.cpp's `GET /props`: its slots are the mock's `capacity` (none
/// without one: every request is served at once).
async fn props(State(state): State<Arc<MockState>>) -> Response {
    state.stats.load_readings.fetch_add(1, Ordering::Relaxed);
    let mut props = json!({
        "model_alias": state.settings.model,
        "endpoint_slots": state.settings.capacity.is_some(),
        "endpoint_metrics": true,
    });
    if let Some(k) = state.settings.capacity {
        props["total_slots"] = json!(k);
    }
    json_response(StatusCode::OK, &props)
}

/// llama.cpp's `GET /slots`: one entry per slot of `capacity`, busy or
/// not; 501 without a capacity, as llama.cpp's server answers with
/// `--no-slots`.
async fn slots(State(state): State<Arc<MockState>>) -> Response {
    state.stats.load_readings.fetch_add(1, Ordering::Relaxed);
    let Some(k) = state.settings.capacity else {
        return json_response(
            StatusCode::NOT_IMPLEMENTED,
            &json!({"error": {
                "code": 501,
                "message": "The mock has no slots: it serves every request at once (set capacity).",
                "type": "not_supported_error",
            }}),
        );
    };
    let busy = state.answering.load(Ordering::Relaxed);
    let slots: Vec<Value> = (0..k)
        .map(|id| json!({"id": id, "n_ctx": 4096, "is_processing": u64::from(id) < busy}))
        .collect();
    json_response(StatusCode::OK, &Value::Array(slots))
}

/// `GET /metrics`: the requests being answered and those waiting for a
/// slot, under the gauges of llama.cpp, vLLM and SGLang alike, so that an
/// endpoint may read the mock as any of them.
async fn metrics(State(state): State<Arc<MockState>>) -> Response {
    state.stats.load_readings.fetch_add(1, Ordering::Relaxed);
    let running = state.answering.load(Ordering::Relaxed);
    let waiting = state.queued.load(Ordering::Relaxed);
    let model = state
        .settings
        .model
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n");
    let mut text = String::new();
    for (name, labels, value) in [
        ("llamacpp:requests_processing", String::new(), running),
        ("llamacpp:requests_deferred", String::new(), waiting),
        (
            "vllm:num_requests_running",
            format!("{{engine=\"0\",model_name=\"{model}\"}}"),
            running,
        ),
        (
            "vllm:num_requests_waiting",
            format!("{{engine=\"0\",model_name=\"{model}\"}}"),
            waiting,
        ),
        (
            "sglang:num_running_reqs",
            format!("{{model_name=\"{model}\",tp_rank=\"0\"}}"),
            running,
        ),
        (
            "sglang:num_queue_reqs",
            format!("{{model_name=\"{model}\",tp_rank=\"0\"}}"),
            waiting,
        ),
    ] {
        text.push_str(&format!("# TYPE {name} gauge\n{name}{labels} {value}\n"));
    }
    let mut response = text.into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    response
}

#[derive(Deserialize)]
struct ChatRequest {
    #[serde(default)]
    messages: Vec<ChatMessage>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    /// The tools offered: any, for scripted tool calls.
    #[serde(default)]
    tools: Option<Vec<Value>>,
}

#[derive(Deserialize)]
struct ChatMessage {
    role: String,
    #[serde(default)]
    content: Value,
    #[serde(default)]
    tool_calls: Option<Value>,
}

impl ChatMessage {
    /// An assistant's message that calls tools.
    fn calls_tools(&self) -> bool {
        self.role == "assistant"
            && self
                .tool_calls
                .as_ref()
                .and_then(Value::as_array)
                .is_some_and(|calls| !calls.is_empty())
    }
}

/// A legacy text completion request: answered as a chat request whose one
/// user message is its prompt.
#[derive(Deserialize)]
struct CompletionRequest {
    #[serde(default)]
    prompt: Value,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    max_tokens: Option<u32>,
}

impl CompletionRequest {
    fn into_chat(self) -> Result<ChatRequest, String> {
        let prompt = match self.prompt {
            Value::String(text) => text,
            Value::Array(mut prompts)
                if prompts.len() == 1 && prompts.first().is_some_and(Value::is_string) =>
            {
                match prompts.pop() {
                    Some(Value::String(text)) => text,
                    _ => String::new(),
                }
            }
            _ => {
                return Err(
                    "invalid completion request: the mock answers one prompt, a string, at a time"
                        .to_owned(),
                );
            }
        };
        Ok(ChatRequest {
            messages: vec![ChatMessage {
                role: "user".to_owned(),
                content: Value::String(prompt),
                tool_calls: None,
            }],
            stream: self.stream,
            stream_options: self.stream_options,
            max_tokens: self.max_tokens,
            max_completion_tokens: None,
            tools: None,
        })
    }
}

/// Which API a request came by: it decides the answer's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

/// What a scripted reply comes to for a request.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Resolved {
    Text(String),
    Call { name: String, arguments: String },
}

/// Follows a scripted reply past the tool results the request holds since
/// its last user message: a call not yet answered is made where the
/// request offers tools (and skipped where it does not); a text gets
/// `{result}` replaced by the last tool result.
fn resolve(script: &Answer, messages: &[ChatMessage], offers_tools: bool) -> Resolved {
    let since_user = messages
        .iter()
        .rposition(|m| m.role == "user")
        .map_or(messages, |i| &messages[i + 1..]);
    let mut results = since_user.iter().filter(|m| m.role == "tool");
    let mut last_result = String::new();
    let mut at = script;
    loop {
        match at {
            Answer::Text(text) => return Resolved::Text(text.replace("{result}", &last_result)),
            Answer::Tool {
                name,
                arguments,
                then,
            } => {
                match results.next() {
                    Some(result) => last_result = message_text(&result.content),
                    None if offers_tools => {
                        return Resolved::Call {
                            name: name.clone(),
                            arguments: arguments.clone(),
                        };
                    }
                    None => {}
                }
                at = then;
            }
        }
    }
}

/// A tool call's arguments in the pieces a stream sends: 8 characters each.
fn pieces(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    chars.chunks(8).map(|c| c.iter().collect()).collect()
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// The text of a message: a string, or the text parts of a list of parts.
fn message_text(content: &Value) -> String {
    match content {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|part| part.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

/// Splits text into tokens: each token is a run of non-space characters with
/// the whitespace that follows it, so the tokens concatenate back to the text.
fn tokens(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut after_space = false;
    for (i, c) in text.char_indices() {
        if c.is_whitespace() {
            after_space = true;
        } else if after_space {
            out.push(&text[start..i]);
            start = i;
            after_space = false;
        }
    }
    if start < text.len() {
        out.push(&text[start..]);
    }
    out
}

/// The answer's tokens for a prompt, and its finish reason.
fn answer(
    settings: &MockSettings,
    prompt: &str,
    max_tokens: Option<u32>,
) -> (Vec<String>, &'static str) {
    let source = tokens(prompt);
    let mut out: Vec<String> = match settings.output_tokens {
        None => source.iter().map(|t| (*t).to_owned()).collect(),
        Some(n) => {
            let n = n as usize;
            (0..n)
                .map(|i| {
                    let token = source
                        .get(i % source.len().max(1))
                        .copied()
                        .unwrap_or("token");
                    if i + 1 == n {
                        token.trim_end().to_owned()
                    } else if !token.ends_with(char::is_whitespace) {
                        format!("{token} ")
                    } else {
                        token.to_owned()
                    }
                })
                .collect()
        }
    };
    match max_tokens {
        Some(max) if out.len() > max as usize => {
            out.truncate(max as usize);
            if let Some(last) = out.last_mut() {
                last.truncate(last.trim_end().len());
            }
            (out, "length")
        }
        _ => (out, "stop"),
    }
}

/// What the mock decided to do with one request.
enum Fate {
    Answer(Mishaps),
    Fail,
    Fault(Fault),
    Hang,
}

/// What goes wrong with an answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Mishaps {
    /// The connection drops half-way (`truncate_rate`).
    truncate: bool,
    /// Nothing is sent for `stall` half-way (`stall_rate`).
    stall: bool,
    /// A stream ends half-way with `data: [DONE]` (`cut_rate`).
    cut: bool,
    /// A stream closes after its finish_reason, never ended (`unended_rate`).
    unended: bool,
}

impl MockState {
    fn fate(&self, prompt_key: u64) -> Fate {
        let settings = &self.settings;
        if !settings.needs_prompt_counts() {
            return Fate::Answer(Mishaps::default());
        }
        let seen = {
            let mut counts = self
                .prompt_counts
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let entry = counts.entry(prompt_key).or_insert(0);
            let seen = *entry;
            *entry += 1;
            seen
        };
        if seen < settings.fail_first {
            return Fate::Fail;
        }
        let mut hasher = DefaultHasher::new();
        (settings.seed, prompt_key, seen).hash(&mut hasher);
        let mut rng = fastrand::Rng::with_seed(hasher.finish());
        if rng.f64() < settings.hang_rate {
            return Fate::Hang;
        }
        if rng.f64() < settings.error_rate {
            return Fate::Fail;
        }
        let truncate = rng.f64() < settings.truncate_rate;
        // Later decisions draw from a generator of their own, so that a seed
        // keeps the fates it gave before they existed.
        let mut hasher = DefaultHasher::new();
        (settings.seed, prompt_key, seen, "faults, stalls, cuts").hash(&mut hasher);
        let mut rng = fastrand::Rng::with_seed(hasher.finish());
        let fault = pick_fault(&settings.faults, rng.f64());
        let stall = rng.f64() < settings.stall_rate;
        let cut = rng.f64() < settings.cut_rate;
        let unended = rng.f64() < settings.unended_rate;
        match fault {
            Some(fault) => Fate::Fault(fault),
            None => Fate::Answer(Mishaps {
                truncate,
                stall,
                cut: cut && !truncate,
                unended: unended && !truncate && !cut,
            }),
        }
    }

    /// The status the `outage` answers with at `now`, if it is on.
    fn outage_now(&self, now: Instant) -> Option<StatusCode> {
        let outage = self.settings.outage?;
        let since_first = now.saturating_duration_since(*self.first_chat.get()?);
        (outage.after..outage.after + outage.duration)
            .contains(&since_first)
            .then(|| StatusCode::from_u16(outage.status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE))
    }

    /// A token that is cancelled when the next chat request arrives, if the
    /// mock interrupts streams (`interrupt_on_arrival`); the streams running
    /// now are interrupted.
    fn arrival(&self) -> CancellationToken {
        let fresh = CancellationToken::new();
        if self.settings.interrupt_on_arrival {
            let mut running = self
                .running
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            std::mem::replace(&mut *running, fresh.clone()).cancel();
        }
        fresh
    }
}

/// The fault whose share of `[0, 1)` holds `draw`: each takes the next
/// `rate` of it, so at most one is picked.
fn pick_fault(faults: &[Fault], draw: f64) -> Option<Fault> {
    let mut upto = 0.0;
    faults.iter().copied().find(|fault| {
        upto += fault.rate;
        draw < upto
    })
}

/// What the mock's fate for a request (keyed by `key`) comes to: the
/// mishaps of its answer, or the error it gets instead (after hanging, for
/// a hang, until the mock stops).
async fn decide(state: &MockState, key: u64) -> Result<Mishaps, Response> {
    match state.fate(key) {
        Fate::Fail => {
            state.stats.injected_errors.fetch_add(1, Ordering::Relaxed);
            let status = StatusCode::from_u16(state.settings.error_status)
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            Err(error_response(status, "injected error"))
        }
        Fate::Fault(fault) => {
            state.stats.fault(fault.status);
            let status =
                StatusCode::from_u16(fault.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let mut response = error_response(status, "injected fault");
            if let Some(after) = fault.retry_after {
                let seconds = after.as_secs_f64().ceil() as u64;
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
            }
            Err(response)
        }
        Fate::Hang => {
            state.stats.hung.fetch_add(1, Ordering::Relaxed);
            state.shutdown.cancelled().await;
            Err(error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "mock shutting down",
            ))
        }
        Fate::Answer(mishaps) => Ok(mishaps),
    }
}

/// Releases an admission slot of `max_concurrency` when dropped.
struct Admitted(Arc<MockState>);

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.admitted.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a response holds on to while it is being produced.
struct Held {
    _in_flight: InFlight,
    _admitted: Option<Admitted>,
    _slot: Option<OwnedSemaphorePermit>,
    _answering: Counted,
}

/// Counts a request in one of the mock's load gauges until dropped.
struct Counted {
    state: Arc<MockState>,
    gauge: fn(&MockState) -> &AtomicU64,
}

impl Counted {
    fn enter(state: &Arc<MockState>, gauge: fn(&MockState) -> &AtomicU64) -> Self {
        gauge(state).fetch_add(1, Ordering::Relaxed);
        Self {
            state: state.clone(),
            gauge,
        }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        (self.gauge)(&self.state).fetch_sub(1, Ordering::Relaxed);
    }
}

async fn chat(State(state): State<Arc<MockState>>, body: Bytes) -> Response {
    respond(state, body, Kind::Chat).await
}

async fn completions(State(state): State<Arc<MockState>>, body: Bytes) -> Response {
    respond(state, body, Kind::Completion).await
}

/// Counts a request that arrived at `arrived`; during an outage, the
/// refusal it gets.
fn arrive(state: &MockState, arrived: Instant) -> Option<Response> {
    if state.stats.requests.fetch_add(1, Ordering::Relaxed) == 0 {
        state
            .stats
            .first_request_at_ms
            .store(unix_now_ms(), Ordering::Relaxed);
    }
    state.first_chat.get_or_init(|| arrived);
    if let Some(status) = state.outage_now(arrived) {
        state.stats.outage_refused.fetch_add(1, Ordering::Relaxed);
        return Some(error_response(status, "mock outage"));
    }
    None
}

/// Answers a chat or text completion request.
async fn respond(state: Arc<MockState>, body: Bytes, kind: Kind) -> Response {
    let arrived = Instant::now();
    if let Some(refused) = arrive(&state, arrived) {
        return refused;
    }
    let in_flight = InFlight::enter(&state);
    let parsed = match kind {
        Kind::Chat => serde_json::from_slice::<ChatRequest>(&body)
            .map_err(|err| format!("invalid chat completion request: {err}")),
        Kind::Completion => serde_json::from_slice::<CompletionRequest>(&body)
            .map_err(|err| format!("invalid completion request: {err}"))
            .and_then(CompletionRequest::into_chat),
    };
    let request = match parsed {
        Ok(request) => request,
        Err(problem) => {
            state.stats.bad_requests.fetch_add(1, Ordering::Relaxed);
            return error_response(StatusCode::BAD_REQUEST, &problem);
        }
    };
    let images = match checked_images(&request.messages).await {
        Ok(images) => images,
        Err(problem) => {
            state.stats.bad_images.fetch_add(1, Ordering::Relaxed);
            return error_response(StatusCode::BAD_REQUEST, &problem);
        }
    };
    for image in &images {
        state.stats.images.fetch_add(1, Ordering::Relaxed);
        state
            .stats
            .image_bytes
            .fetch_add(image.bytes, Ordering::Relaxed);
    }
    let request = Checked { request, images };
    let interrupt = state.arrival();

    let Some(quota) = &state.quota else {
        return answer_chat(&state, request, kind, arrived, in_flight, interrupt).await;
    };
    let verdict = quota
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take(Instant::now());
    let mut response = match verdict.refused_for {
        Some(wait) => rate_limited(&state, wait),
        None => answer_chat(&state, request, kind, arrived, in_flight, interrupt).await,
    };
    verdict.add_headers(response.headers_mut());
    response
}

/// An image of a request, decoded.
struct ReceivedImage {
    /// SHA-256 of its bytes (hex); `None` for a URL, not fetched.
    sha256: Option<String>,
    bytes: u64,
}

/// A chat request with its images checked.
struct Checked {
    request: ChatRequest,
    images: Vec<ReceivedImage>,
}

/// The images of `messages` (`image_url` parts: a data URL, bare base64,
/// or an http(s) URL, which is not fetched), each decoded to check that
/// it is an image, and hashed; or why one is not, naming its part.
async fn checked_images(messages: &[ChatMessage]) -> Result<Vec<ReceivedImage>, String> {
    let mut urls = Vec::new();
    for (i, message) in messages.iter().enumerate() {
        let Value::Array(parts) = &message.content else {
            continue;
        };
        for (j, part) in parts.iter().enumerate() {
            if part.get("type").and_then(Value::as_str) != Some("image_url") {
                continue;
            }
            let url = part
                .get("image_url")
                .and_then(|u| u.get("url"))
                .and_then(Value::as_str)
                .ok_or_else(|| format!("messages[{i}].content[{j}]: image_url.url is missing"))?;
            urls.push((format!("messages[{i}].content[{j}]"), url.to_owned()));
        }
    }
    if urls.is_empty() {
        return Ok(Vec::new());
    }
    // Decoding is CPU work: off the async threads, awaited in place by the
    // request it is for.
    #[allow(clippy::disallowed_methods)]
    tokio::task::spawn_blocking(move || {
        urls.iter().map(|(at, url)| decode_image(at, url)).collect()
    })
    .await
    .map_err(|err| format!("image check failed: {err}"))?
}

fn decode_image(at: &str, url: &str) -> Result<ReceivedImage, String> {
    use base64::Engine as _;
    use sha2::Digest as _;
    if url.starts_with("http://") || url.starts_with("https://") {
        return Ok(ReceivedImage {
            sha256: None,
            bytes: 0,
        });
    }
    let data = match url.strip_prefix("data:") {
        Some(rest) => match rest.split_once(',') {
            Some((head, data)) if head.ends_with(";base64") => data,
            _ => {
                return Err(format!(
                    "{at}: a data URL of an image must be base64 (data:TYPE;base64,...)"
                ));
            }
        },
        None => url,
    };
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .map_err(|err| format!("{at}: the image is not valid base64: {err}"))?;
    image::load_from_memory(&bytes)
        .map_err(|err| format!("{at}: the image cannot be decoded: {err}"))?;
    Ok(ReceivedImage {
        sha256: Some(hex::encode(sha2::Sha256::digest(&bytes))),
        bytes: bytes.len() as u64,
    })
}

/// Answers a chat request the quota let through.
async fn answer_chat(
    state: &Arc<MockState>,
    request: Checked,
    kind: Kind,
    arrived: Instant,
    in_flight: InFlight,
    interrupt: CancellationToken,
) -> Response {
    let Checked { request, images } = request;
    if let Some(bucket) = &state.bucket {
        let verdict = bucket
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take(Instant::now());
        if let Err(wait) = verdict {
            return rate_limited(state, wait);
        }
    }
    let admitted = match state.settings.max_concurrency {
        Some(max) => {
            let now = state.admitted.fetch_add(1, Ordering::Relaxed) + 1;
            let guard = Admitted(state.clone());
            if now > u64::from(max) {
                drop(guard);
                return rate_limited(state, state.settings.retry_after);
            }
            Some(guard)
        }
        None => None,
    };

    let mut prompt = String::new();
    let mut last_user = String::new();
    for message in &request.messages {
        let text = message_text(&message.content);
        prompt.push_str(&message.role);
        prompt.push('\n');
        prompt.push_str(&text);
        prompt.push('\n');
        if message.role == "user" {
            last_user = text;
        }
    }
    let mut hasher = DefaultHasher::new();
    prompt.hash(&mut hasher);
    let mishaps = match decide(state, hasher.finish()).await {
        Ok(mishaps) => mishaps,
        Err(response) => return response,
    };

    let slot = match &state.capacity {
        Some(semaphore) => {
            let _queued = Counted::enter(state, |s| &s.queued);
            tokio::select! {
                permit = semaphore.clone().acquire_owned() => permit.ok(),
                () = state.shutdown.cancelled() => {
                    return error_response(StatusCode::SERVICE_UNAVAILABLE, "mock shutting down");
                }
            }
        }
        None => None,
    };
    let held = Held {
        _in_flight: in_flight,
        _admitted: admitted,
        _slot: slot,
        _answering: Counted::enter(state, |s| &s.answering),
    };

    let max_tokens = request.max_completion_tokens.or(request.max_tokens);
    let scripted = match &state.answers {
        Err(err) => return error_response(StatusCode::INTERNAL_SERVER_ERROR, err),
        Ok(answers) if !answers.is_empty() => {
            // Re-asks count; a tool call and its result are one turn.
            let asked = request
                .messages
                .iter()
                .filter(|m| m.role == "assistant" && !m.calls_tools())
                .count();
            let reply = |key: String| -> Option<Option<Answer>> {
                match answers.get(&key)? {
                    crate::settings::Script::Replies { replies, hang_from } => {
                        if hang_from.is_some_and(|from| asked >= from) {
                            Some(None)
                        } else {
                            replies.get(asked.min(replies.len() - 1)).cloned().map(Some)
                        }
                    }
                    crate::settings::Script::Samples(samples) => {
                        let mut seen = state
                            .scripted_seen
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner);
                        let i = seen.entry(key).or_insert(0);
                        let reply = samples[*i % samples.len()].clone();
                        *i += 1;
                        Some(Some(Answer::Text(reply)))
                    }
                }
            };
            // By its images, when every one of them has a script: their
            // replies, a line each.
            let by_image: Option<Vec<Option<Answer>>> = images
                .iter()
                .map(|image| {
                    image
                        .sha256
                        .as_ref()
                        .and_then(|sha| reply(crate::settings::image_key(sha)))
                })
                .collect();
            match by_image {
                Some(replies) if !replies.is_empty() => {
                    let replies: Option<Vec<Answer>> = replies.into_iter().collect();
                    Some(replies.map(|replies| {
                        let texts: Vec<String> = replies
                            .iter()
                            .map(|r| match resolve(r, &request.messages, false) {
                                Resolved::Text(text) => text,
                                Resolved::Call { arguments, .. } => arguments,
                            })
                            .collect();
                        Answer::Text(texts.join("\n"))
                    }))
                }
                _ => request
                    .messages
                    .iter()
                    .find(|m| m.role == "user")
                    .map(|m| message_text(&m.content))
                    .and_then(reply),
            }
        }
        Ok(_) => None,
    };
    // A script that says to hang: no answer until the mock stops.
    let scripted = match scripted {
        Some(None) => {
            state.stats.hung.fetch_add(1, Ordering::Relaxed);
            state.shutdown.cancelled().await;
            return error_response(StatusCode::SERVICE_UNAVAILABLE, "mock shutting down");
        }
        Some(Some(reply)) => Some(reply),
        None => None,
    };
    let offers_tools = kind == Kind::Chat
        && request
            .tools
            .as_ref()
            .is_some_and(|tools| !tools.is_empty());
    let id = state.next_id.fetch_add(1, Ordering::Relaxed);
    let (tokens, finish_reason, tool_call) = match scripted.as_ref() {
        Some(script) => match resolve(script, &request.messages, offers_tools) {
            Resolved::Text(text) => {
                let settings = MockSettings {
                    output_tokens: None,
                    ..MockSettings::default()
                };
                let (tokens, finish_reason) = answer(&settings, &text, max_tokens);
                (tokens, finish_reason, None)
            }
            Resolved::Call { name, arguments } => (
                pieces(&arguments),
                "tool_calls",
                Some(ToolCall {
                    id: format!("call_mock{id}"),
                    name,
                }),
            ),
        },
        None => {
            let (tokens, finish_reason) = answer(&state.settings, &last_user, max_tokens);
            (tokens, finish_reason, None)
        }
    };
    let prompt_tokens = tokens_in(&request.messages);
    let reply = Reply {
        id: match kind {
            Kind::Chat => format!("chatcmpl-mock-{id}"),
            Kind::Completion => format!("cmpl-mock-{id}"),
        },
        model: state.settings.model.clone(),
        kind,
        tool_call,
        tokens,
        finish_reason,
        prompt_tokens,
        mishaps,
        arrived,
    };
    if mishaps.truncate {
        state.stats.truncated.fetch_add(1, Ordering::Relaxed);
    }
    if request.stream {
        let include_usage =
            state.settings.stream_usage && request.stream_options.is_some_and(|o| o.include_usage);
        stream_reply(
            Streaming {
                state: state.clone(),
                reply,
                include_usage,
                interrupt,
            },
            held,
        )
    } else {
        let mut total = state.settings.latency
            + state.settings.itl * (reply.tokens.len().saturating_sub(1) as u32);
        if mishaps.stall {
            state.stats.stalled.fetch_add(1, Ordering::Relaxed);
            total += state.settings.stall;
        }
        if !pause(state, total).await {
            return error_response(StatusCode::SERVICE_UNAVAILABLE, "mock shutting down");
        }
        whole_reply(state, reply, held)
    }
}

/// Waits `duration`, or less if the mock shuts down (then `false`).
async fn pause(state: &MockState, duration: Duration) -> bool {
    if duration.is_zero() {
        return true;
    }
    tokio::select! {
        () = tokio::time::sleep(duration) => true,
        () = state.shutdown.cancelled() => false,
    }
}

fn tokens_in(messages: &[ChatMessage]) -> usize {
    messages
        .iter()
        .map(|m| message_text(&m.content).split_whitespace().count())
        .sum()
}

/// A tool call being answered: one per reply.
struct ToolCall {
    id: String,
    name: String,
}

struct Reply {
    id: String,
    model: String,
    kind: Kind,
    /// The call this reply makes: its `tokens` are then the pieces of its
    /// arguments.
    tool_call: Option<ToolCall>,
    tokens: Vec<String>,
    finish_reason: &'static str,
    prompt_tokens: usize,
    mishaps: Mishaps,
    arrived: Instant,
}

impl Reply {
    fn usage(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.tokens.len(),
            "total_tokens": self.prompt_tokens + self.tokens.len(),
        })
    }

    /// A chunk with `piece` of the answer (`None`: nothing new, as the
    /// first chunk of a chat answer and the last of any).
    fn chunk(&self, piece: Option<&str>, finish_reason: Option<&str>) -> Bytes {
        let chunk = match self.kind {
            Kind::Completion => json!({
                "id": self.id,
                "object": "text_completion",
                "created": 0,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "text": piece.unwrap_or(""),
                    "logprobs": null,
                    "finish_reason": finish_reason,
                }],
            }),
            Kind::Chat => {
                let delta = match (&self.tool_call, piece) {
                    (_, None) if finish_reason.is_some() => json!({}),
                    (None, None) => json!({"role": "assistant", "content": ""}),
                    (None, Some(piece)) => json!({"content": piece}),
                    // As OpenAI streams a call: its id, type and name
                    // first, then its arguments in pieces.
                    (Some(call), None) => json!({
                        "role": "assistant",
                        "content": null,
                        "tool_calls": [{
                            "index": 0,
                            "id": call.id,
                            "type": "function",
                            "function": {"name": call.name, "arguments": ""},
                        }],
                    }),
                    (Some(_), Some(piece)) => json!({
                        "tool_calls": [{"index": 0, "function": {"arguments": piece}}],
                    }),
                };
                json!({
                    "id": self.id,
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": self.model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
                })
            }
        };
        sse(&chunk)
    }

    /// The whole answer, as a response body.
    fn body(&self) -> Value {
        let text = self.tokens.concat();
        match (self.kind, &self.tool_call) {
            (Kind::Completion, _) => json!({
                "id": self.id,
                "object": "text_completion",
                "created": 0,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "text": text,
                    "logprobs": null,
                    "finish_reason": self.finish_reason,
                }],
                "usage": self.usage(),
            }),
            (Kind::Chat, call) => {
                let message = match call {
                    None => json!({"role": "assistant", "content": text}),
                    Some(call) => json!({
                        "role": "assistant",
                        "content": null,
                        "tool_calls": [{
                            "id": call.id,
                            "type": "function",
                            "function": {"name": call.name, "arguments": text},
                        }],
                    }),
                };
                json!({
                    "id": self.id,
                    "object": "chat.completion",
                    "created": 0,
                    "model": self.model,
                    "choices": [{
                        "index": 0,
                        "message": message,
                        "finish_reason": self.finish_reason,
                    }],
                    "usage": self.usage(),
                })
            }
        }
    }
}

fn sse(value: &Value) -> Bytes {
    let mut out = b"data: ".to_vec();
    // Serialising a `Value` cannot fail.
    serde_json::to_writer(&mut out, value).ok();
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

fn whole_reply(state: &Arc<MockState>, reply: Reply, held: Held) -> Response {
    let body = reply.body();
    let bytes = serde_json::to_vec(&body).unwrap_or_default();
    if reply.mishaps.truncate {
        let half = Bytes::copy_from_slice(&bytes[..bytes.len() / 2]);
        let parts = stream::once(async move { Ok(half) }).chain(stream::once(cut_off()));
        let body = Body::from_stream(HoldStream {
            inner: Box::pin(parts),
            _held: held,
        });
        return with_content_type(Response::new(body), "application/json");
    }
    state.stats.completed(reply.arrived);
    drop(held);
    with_content_type(Response::new(Body::from(bytes)), "application/json")
}

/// How long a cut-off response waits after its last bytes before the
/// connection drops, so that those bytes reach the client first.
const CUT_DELAY: Duration = Duration::from_millis(5);

/// The end of a truncated response: the connection drops.
async fn cut_off() -> io::Result<Bytes> {
    tokio::time::sleep(CUT_DELAY).await;
    Err(io::Error::other("truncated by the mock"))
}

/// A body stream that keeps the request's slots until the body ends.
struct HoldStream<S> {
    inner: S,
    _held: Held,
}

impl<S: futures_util::Stream + Unpin> futures_util::Stream for HoldStream<S> {
    type Item = S::Item;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        std::pin::Pin::new(&mut self.inner).poll_next(cx)
    }
}

/// Steps of a streamed answer.
enum Step {
    Role,
    Token(usize),
    /// Before the second half of the tokens: where a stream stalls, is
    /// truncated or cut.
    HalfWay,
    Finish,
    Usage,
    Done,
    End,
}

/// The bytes of one step and the step after it; `None` ends the stream.
type Next = Option<(io::Result<Bytes>, Step)>;

/// A streamed answer being sent.
struct Streaming {
    state: Arc<MockState>,
    reply: Reply,
    include_usage: bool,
    /// Cancelled when another request interrupts this stream.
    interrupt: CancellationToken,
}

const DONE: &[u8] = b"data: [DONE]\n\n";

impl Streaming {
    /// Sends `step`; one that has nothing to send goes on to the next.
    async fn step(&self, mut step: Step) -> Next {
        let reply = &self.reply;
        let settings = &self.state.settings;
        let stats = &self.state.stats;
        loop {
            match step {
                Step::Role => {
                    // A text completion's stream has no role chunk.
                    if reply.kind == Kind::Completion {
                        step = self.after(None);
                        continue;
                    }
                    let bytes = reply.chunk(None, None);
                    return Some((Ok(bytes), self.after(None)));
                }
                Step::HalfWay => {
                    if reply.mishaps.stall {
                        stats.stalled.fetch_add(1, Ordering::Relaxed);
                        if let Err(end) = self.wait(settings.stall).await {
                            return end;
                        }
                    }
                    if reply.mishaps.truncate {
                        return Some((cut_off().await, Step::End));
                    }
                    if reply.mishaps.cut {
                        stats.cut.fetch_add(1, Ordering::Relaxed);
                        return Some((Ok(Bytes::from_static(DONE)), Step::End));
                    }
                    let half = reply.tokens.len() / 2;
                    step = if half < reply.tokens.len() {
                        Step::Token(half)
                    } else {
                        Step::Finish
                    };
                }
                Step::Token(i) => {
                    let delay = if i == 0 {
                        settings.latency
                    } else {
                        settings.itl
                    };
                    if let Err(end) = self.wait(delay).await {
                        return end;
                    }
                    let bytes = reply.chunk(Some(&reply.tokens[i]), None);
                    return Some((Ok(bytes), self.after(Some(i))));
                }
                Step::Finish => {
                    let delay = if reply.tokens.is_empty() {
                        settings.latency
                    } else {
                        Duration::ZERO
                    };
                    if let Err(end) = self.wait(delay).await {
                        return end;
                    }
                    let bytes = reply.chunk(None, Some(reply.finish_reason));
                    if reply.mishaps.unended {
                        stats.unended.fetch_add(1, Ordering::Relaxed);
                        return Some((Ok(bytes), Step::End));
                    }
                    let next = if self.include_usage {
                        Step::Usage
                    } else {
                        Step::Done
                    };
                    return Some((Ok(bytes), next));
                }
                Step::Usage => {
                    let bytes = sse(&json!({
                        "id": reply.id,
                        "object": match reply.kind {
                            Kind::Chat => "chat.completion.chunk",
                            Kind::Completion => "text_completion",
                        },
                        "created": 0,
                        "model": reply.model,
                        "choices": [],
                        "usage": reply.usage(),
                    }));
                    return Some((Ok(bytes), Step::Done));
                }
                Step::Done => {
                    stats.completed(reply.arrived);
                    return Some((Ok(Bytes::from_static(DONE)), Step::End));
                }
                Step::End => return None,
            }
        }
    }

    /// The step after the token `sent` (`None`: after the role).
    fn after(&self, sent: Option<usize>) -> Step {
        let next = sent.map_or(0, |i| i + 1);
        if next == self.reply.tokens.len() / 2 {
            Step::HalfWay
        } else if next < self.reply.tokens.len() {
            Step::Token(next)
        } else {
            Step::Finish
        }
    }

    /// Waits `duration`, or says how the stream ends instead: with
    /// `data: [DONE]` at once when another request interrupts it, with
    /// nothing more when the mock shuts down.
    async fn wait(&self, duration: Duration) -> Result<(), Next> {
        let interrupted = || {
            self.state.stats.interrupted.fetch_add(1, Ordering::Relaxed);
            Err(Some((Ok(Bytes::from_static(DONE)), Step::End)))
        };
        if self.interrupt.is_cancelled() {
            return interrupted();
        }
        if duration.is_zero() {
            return Ok(());
        }
        tokio::select! {
            () = tokio::time::sleep(duration) => Ok(()),
            () = self.interrupt.cancelled() => interrupted(),
            () = self.state.shutdown.cancelled() => Err(None),
        }
    }
}

fn stream_reply(streaming: Streaming, held: Held) -> Response {
    let steps = stream::unfold((Step::Role, streaming), |(step, streaming)| async move {
        let (bytes, next) = streaming.step(step).await?;
        Some((bytes, (next, streaming)))
    });
    let body = Body::from_stream(HoldStream {
        inner: Box::pin(steps),
        _held: held,
    });
    let mut response = with_content_type(Response::new(body), "text/event-stream");
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// Dimensions of an embedding whose request gives no `dimensions`.
const EMBEDDING_DIMENSIONS: usize = 64;
/// The most `dimensions` a request may ask for.
const MAX_EMBEDDING_DIMENSIONS: usize = 8192;

#[derive(Deserialize)]
struct EmbeddingRequest {
    input: Value,
    #[serde(default)]
    dimensions: Option<usize>,
    #[serde(default)]
    encoding_format: Option<String>,
}

/// The inputs of an embedding request: each one's key (its text, or its
/// tokens as JSON) and its tokens' count.
fn embedding_inputs(input: &Value) -> Result<Vec<(String, usize)>, String> {
    let tokens = |value: &Value| -> Option<(String, usize)> {
        let ids = value.as_array()?;
        ids.iter()
            .all(Value::is_u64)
            .then(|| (value.to_string(), ids.len()))
    };
    let one = |value: &Value| match value {
        Value::String(text) => Some((text.clone(), text.split_whitespace().count())),
        other => tokens(other),
    };
    let inputs = match input {
        Value::String(_) => one(input).into_iter().collect(),
        Value::Array(items) if items.is_empty() => Vec::new(),
        Value::Array(items) if items.iter().all(Value::is_u64) => tokens(input).into_iter().collect(),
        Value::Array(items) => items.iter().map(one).collect::<Option<Vec<_>>>().ok_or(
            "invalid embedding request: input is a string, a list of strings, a list of token ids, or a list of such lists",
        )?,
        _ => Vec::new(),
    };
    if inputs.is_empty() {
        return Err(
            "invalid embedding request: input is a string, a list of strings, a list of token ids, or a list of such lists, not empty"
                .to_owned(),
        );
    }
    Ok(inputs)
}

/// A unit vector of `dimensions` drawn from a hash of `key` (and the seed):
/// the same input gets the same vector, always.
fn embedding(key: &str, dimensions: usize, seed: u64) -> Vec<f32> {
    let mut hasher = DefaultHasher::new();
    (seed, "embedding", key).hash(&mut hasher);
    let mut rng = fastrand::Rng::with_seed(hasher.finish());
    let mut vector: Vec<f32> = (0..dimensions).map(|_| rng.f32() * 2.0 - 1.0).collect();
    let norm = vector.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        for x in &mut vector {
            *x /= norm;
        }
    }
    vector
}

/// `POST /v1/embeddings`: a vector per input, after the latency, faults,
/// errors and hangs chat requests get (not the quotas and queues).
async fn embeddings(State(state): State<Arc<MockState>>, body: Bytes) -> Response {
    use base64::Engine as _;
    let arrived = Instant::now();
    if let Some(refused) = arrive(&state, arrived) {
        return refused;
    }
    let _in_flight = InFlight::enter(&state);
    let bad = |problem: &str| {
        state.stats.bad_requests.fetch_add(1, Ordering::Relaxed);
        error_response(StatusCode::BAD_REQUEST, problem)
    };
    let request: EmbeddingRequest = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(err) => return bad(&format!("invalid embedding request: {err}")),
    };
    let inputs = match embedding_inputs(&request.input) {
        Ok(inputs) => inputs,
        Err(problem) => return bad(&problem),
    };
    let dimensions = request.dimensions.unwrap_or(EMBEDDING_DIMENSIONS);
    if !(1..=MAX_EMBEDDING_DIMENSIONS).contains(&dimensions) {
        return bad(&format!(
            "invalid embedding request: dimensions must be from 1 to {MAX_EMBEDDING_DIMENSIONS}, got {dimensions}"
        ));
    }
    let base64 = match request.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return bad(&format!(
                "invalid embedding request: encoding_format is float or base64, got '{other}'"
            ));
        }
    };
    let mut hasher = DefaultHasher::new();
    inputs.hash(&mut hasher);
    if let Err(response) = decide(&state, hasher.finish()).await {
        return response;
    }
    if !pause(&state, state.settings.latency).await {
        return error_response(StatusCode::SERVICE_UNAVAILABLE, "mock shutting down");
    }
    let seed = state.settings.seed;
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(index, (key, _))| {
            let vector = embedding(key, dimensions, seed);
            let embedding = if base64 {
                let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(vector)
            };
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    let prompt_tokens: usize = inputs.iter().map(|(_, tokens)| tokens).sum();
    state.stats.completed(arrived);
    json_response(
        StatusCode::OK,
        &json!({
            "object": "list",
            "data": data,
            "model": state.settings.model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }),
    )
}

fn rate_limited(state: &MockState, wait: Duration) -> Response {
    state.stats.rate_limited.fetch_add(1, Ordering::Relaxed);
    let mut response = error_response(StatusCode::TOO_MANY_REQUESTS, "rate limit exceeded");
    // `Retry-After` holds whole seconds; `retry-after-ms` (as OpenAI and Azure
    // send it) the exact wait.
    let seconds = wait.as_secs_f64().ceil().max(1.0) as u64;
    let headers = response.headers_mut();
    headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    headers.insert("retry-after-ms", HeaderValue::from(wait.as_millis() as u64));
    response
}

fn error_response(status: StatusCode, message: &str) -> Response {
    json_response(
        status,
        &json!({"error": {"message": message, "type": "mock_error", "code": status.as_u16()}}),
    )
}

fn json_response<T: Serialize>(status: StatusCode, body: &T) -> Response {
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    let mut response = with_content_type(Response::new(Body::from(bytes)), "application/json");
    *response.status_mut() = status;
    response
}

fn with_content_type(mut response: Response, content_type: &'static str) -> Response {
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_concatenate_back_to_the_text() {
        for text in ["", "one", "  lead", "a b  c\nd ", "tab\tsep"] {
            assert_eq!(tokens(text).concat(), text);
        }
        assert_eq!(tokens("a b  c"), vec!["a ", "b  ", "c"]);
    }

    #[test]
    fn openai_durations_are_written_as_go_writes_them() {
        let ms = Duration::from_millis;
        for (duration, text) in [
            (Duration::ZERO, "0s"),
            (Duration::from_micros(400), "1ms"),
            (ms(100), "100ms"),
            (Duration::from_nanos(100_000_001), "100ms"),
            (ms(1000), "1s"),
            (ms(8640), "8.64s"),
            (ms(90_500), "1m30.5s"),
            (ms(360_000), "6m0s"),
            (ms(3_600_000), "1h0m0s"),
            (ms(3_723_004), "1h2m3.004s"),
        ] {
            assert_eq!(openai_duration(duration), text, "{duration:?}");
        }
    }

    fn quota(limit: u32, window: Duration, mode: QuotaMode) -> QuotaBucket {
        QuotaBucket::new(
            Quota {
                limit,
                window,
                mode,
            },
            Instant::now(),
        )
    }

    /// Whether two durations computed in floating point are the same to the
    /// microsecond.
    fn about(a: Option<Duration>, b: Duration) -> bool {
        a.is_some_and(|a| a.abs_diff(b) < Duration::from_micros(1))
    }

    #[test]
    fn a_refilling_quota_counts_down_and_refills_at_its_rate() {
        let start = Instant::now();
        let mut bucket = quota(10, Duration::from_secs(1), QuotaMode::Refill);
        let first = bucket.take(start);
        assert_eq!(first.remaining, 9);
        assert!(
            about(Some(first.reset), Duration::from_millis(100)),
            "{first:?}"
        );
        assert_eq!(first.refused_for, None);
        for left in (0..9).rev() {
            assert_eq!(bucket.take(start).remaining, left);
        }
        let refused = bucket.take(start);
        assert_eq!(refused.remaining, 0);
        assert!(
            about(refused.refused_for, Duration::from_millis(100)),
            "{refused:?}"
        );
        assert!(
            about(Some(refused.reset), Duration::from_secs(1)),
            "{refused:?}"
        );
        // Half a request back: still refused, for the other half.
        let refused = bucket.take(start + Duration::from_millis(50));
        assert!(
            about(refused.refused_for, Duration::from_millis(50)),
            "{refused:?}"
        );
        let taken = bucket.take(start + Duration::from_millis(100));
        assert_eq!((taken.remaining, taken.refused_for), (0, None));
        // Long idle: full again, never more.
        let later = bucket.take(start + Duration::from_secs(60));
        assert_eq!(later.remaining, 9);
    }

    #[test]
    fn a_fixed_quota_gives_everything_back_when_its_window_ends() {
        let ms = Duration::from_millis;
        let mut bucket = quota(3, ms(300), QuotaMode::Fixed);
        // The window begins with the first request, not with the bucket.
        let start = Instant::now() + ms(1000);
        let verdicts: Vec<_> = [0, 100, 200, 250]
            .map(|at| bucket.take(start + ms(at)))
            .into_iter()
            .map(|v| (v.remaining, v.reset, v.refused_for))
            .collect();
        assert_eq!(
            verdicts,
            [
                (2, ms(300), None),
                (1, ms(200), None),
                (0, ms(100), None),
                (0, ms(50), Some(ms(50))),
            ]
        );
        // Windows stay aligned to the first: 700 ms is 100 ms into the third.
        let next = bucket.take(start + ms(700));
        assert_eq!(
            (next.remaining, next.reset, next.refused_for),
            (2, ms(200), None)
        );
    }

    #[test]
    fn faults_take_consecutive_shares_of_one_draw() {
        let fault = |status, rate| Fault {
            status,
            rate,
            retry_after: None,
        };
        let faults = [fault(500, 0.1), fault(503, 0.2)];
        let picked = |draw| pick_fault(&faults, draw).map(|f| f.status);
        assert_eq!(picked(0.05), Some(500));
        assert_eq!(picked(0.1), Some(503));
        assert_eq!(picked(0.29), Some(503));
        assert_eq!(picked(0.31), None);
    }

    #[test]
    fn output_tokens_repeat_the_prompt_and_max_tokens_cuts() {
        let settings = MockSettings {
            output_tokens: Some(5),
            ..MockSettings::default()
        };
        let (out, reason) = answer(&settings, "x y", None);
        assert_eq!(out.concat(), "x y x y x");
        assert_eq!(reason, "stop");
        let (out, reason) = answer(&settings, "x y", Some(2));
        assert_eq!(out.concat(), "x y");
        assert_eq!(reason, "length");
    }
}
