//! The HTTP server: `GET /v1/models`, `POST /v1/chat/completions` (streaming
//! and not), `GET /mock/stats` (counters for tests and benchmarks) and
//! `GET /health`.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use futures_util::{StreamExt, stream};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::settings::MockSettings;

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
    in_flight: AtomicU64,
    max_in_flight: AtomicU64,
    model_listings: AtomicU64,
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
            in_flight: AtomicU64::new(0),
            max_in_flight: AtomicU64::new(0),
            model_listings: AtomicU64::new(0),
            first_request_at_ms: AtomicU64::new(0),
            last_completed_at_ms: AtomicU64::new(0),
            served_ms: (0..=SERVED_BUCKETS).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

/// A copy of [`Stats`] at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatsSnapshot {
    /// Chat completion requests received (answered or not).
    pub requests: u64,
    /// Requests answered in full with 200.
    pub completed: u64,
    /// Requests answered with an injected error status.
    pub injected_errors: u64,
    /// Requests answered with 429.
    pub rate_limited: u64,
    /// Requests accepted and never answered.
    pub hung: u64,
    /// Responses cut off half-way.
    pub truncated: u64,
    /// Requests whose body was not a valid chat completion request.
    pub bad_requests: u64,
    /// Chat completion requests being handled now.
    pub in_flight: u64,
    /// The most chat completion requests handled at once.
    pub max_in_flight: u64,
    /// `GET /v1/models` requests.
    pub model_listings: u64,
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
            in_flight: load(&self.in_flight),
            max_in_flight: load(&self.max_in_flight),
            model_listings: load(&self.model_listings),
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

struct MockState {
    settings: MockSettings,
    stats: Arc<Stats>,
    prompt_counts: Mutex<HashMap<u64, u32>>,
    bucket: Option<Mutex<Bucket>>,
    admitted: AtomicU64,
    capacity: Option<Arc<Semaphore>>,
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
        admitted: AtomicU64::new(0),
        capacity,
        shutdown,
        next_id: AtomicU64::new(0),
    });
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/mock/stats", get(stats_handler))
        .route("/health", get(|| async { "ok" }))
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
    json_response(
        StatusCode::OK,
        &json!({
            "object": "list",
            "data": [{"id": state.settings.model, "object": "model", "owned_by": "evalfleet-mock"}],
        }),
    )
}

async fn stats_handler(State(state): State<Arc<MockState>>) -> Response {
    json_response(StatusCode::OK, &state.stats.snapshot())
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
}

#[derive(Deserialize)]
struct ChatMessage {
    role: String,
    #[serde(default)]
    content: Value,
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
    Answer { truncate: bool },
    Fail,
    Hang,
}

impl MockState {
    fn fate(&self, prompt_key: u64) -> Fate {
        let settings = &self.settings;
        if !settings.needs_prompt_counts() {
            return Fate::Answer { truncate: false };
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
            Fate::Hang
        } else if rng.f64() < settings.error_rate {
            Fate::Fail
        } else {
            Fate::Answer {
                truncate: rng.f64() < settings.truncate_rate,
            }
        }
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
}

async fn chat(State(state): State<Arc<MockState>>, body: Bytes) -> Response {
    let arrived = Instant::now();
    if state.stats.requests.fetch_add(1, Ordering::Relaxed) == 0 {
        state
            .stats
            .first_request_at_ms
            .store(unix_now_ms(), Ordering::Relaxed);
    }
    let in_flight = InFlight::enter(&state);
    let request: ChatRequest = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(err) => {
            state.stats.bad_requests.fetch_add(1, Ordering::Relaxed);
            return error_response(
                StatusCode::BAD_REQUEST,
                &format!("invalid chat completion request: {err}"),
            );
        }
    };

    if let Some(bucket) = &state.bucket {
        let verdict = bucket
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take(Instant::now());
        if let Err(wait) = verdict {
            return rate_limited(&state, wait);
        }
    }
    let admitted = match state.settings.max_concurrency {
        Some(max) => {
            let now = state.admitted.fetch_add(1, Ordering::Relaxed) + 1;
            let guard = Admitted(state.clone());
            if now > u64::from(max) {
                drop(guard);
                return rate_limited(&state, state.settings.retry_after);
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
    let truncate = match state.fate(hasher.finish()) {
        Fate::Fail => {
            state.stats.injected_errors.fetch_add(1, Ordering::Relaxed);
            let status = StatusCode::from_u16(state.settings.error_status)
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return error_response(status, "injected error");
        }
        Fate::Hang => {
            state.stats.hung.fetch_add(1, Ordering::Relaxed);
            state.shutdown.cancelled().await;
            return error_response(StatusCode::SERVICE_UNAVAILABLE, "mock shutting down");
        }
        Fate::Answer { truncate } => truncate,
    };

    let slot = match &state.capacity {
        Some(semaphore) => {
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
    };

    let max_tokens = request.max_completion_tokens.or(request.max_tokens);
    let scripted = match &state.answers {
        Err(err) => return error_response(StatusCode::INTERNAL_SERVER_ERROR, err),
        Ok(answers) if !answers.is_empty() => {
            let first_user = request
                .messages
                .iter()
                .find(|m| m.role == "user")
                .map(|m| message_text(&m.content));
            let asked = request
                .messages
                .iter()
                .filter(|m| m.role == "assistant")
                .count();
            first_user.and_then(|u| match answers.get(&u)? {
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
                    let i = seen.entry(u).or_insert(0);
                    let reply = samples[*i % samples.len()].clone();
                    *i += 1;
                    Some(Some(reply))
                }
            })
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
    let (tokens, finish_reason) = match scripted.as_deref() {
        Some(text) => {
            let settings = MockSettings {
                output_tokens: None,
                ..MockSettings::default()
            };
            answer(&settings, text, max_tokens)
        }
        None => answer(&state.settings, &last_user, max_tokens),
    };
    let prompt_tokens = tokens_in(&request.messages);
    let id = state.next_id.fetch_add(1, Ordering::Relaxed);
    let reply = Reply {
        id: format!("chatcmpl-mock-{id}"),
        model: state.settings.model.clone(),
        tokens,
        finish_reason,
        prompt_tokens,
        truncate,
        arrived,
    };
    if truncate {
        state.stats.truncated.fetch_add(1, Ordering::Relaxed);
    }
    if request.stream {
        let include_usage = request.stream_options.is_some_and(|o| o.include_usage);
        stream_reply(state, reply, include_usage, held)
    } else {
        let total = state.settings.latency
            + state.settings.itl * (reply.tokens.len().saturating_sub(1) as u32);
        if !pause(&state, total).await {
            return error_response(StatusCode::SERVICE_UNAVAILABLE, "mock shutting down");
        }
        whole_reply(&state, reply, held)
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

struct Reply {
    id: String,
    model: String,
    tokens: Vec<String>,
    finish_reason: &'static str,
    prompt_tokens: usize,
    truncate: bool,
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

    fn chunk(&self, delta: Value, finish_reason: Option<&str>) -> Bytes {
        let chunk = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": 0,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        });
        sse(&chunk)
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
    let body = json!({
        "id": reply.id,
        "object": "chat.completion",
        "created": 0,
        "model": reply.model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": reply.tokens.concat()},
            "finish_reason": reply.finish_reason,
        }],
        "usage": reply.usage(),
    });
    let bytes = serde_json::to_vec(&body).unwrap_or_default();
    if reply.truncate {
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
    Finish,
    Usage,
    Done,
    End,
}

fn stream_reply(state: Arc<MockState>, reply: Reply, include_usage: bool, held: Held) -> Response {
    let latency = state.settings.latency;
    let itl = state.settings.itl;
    let cut_at = reply.tokens.len() / 2;
    let steps = stream::unfold(
        (Step::Role, reply, state),
        move |(step, reply, state)| async move {
            match step {
                Step::Role => {
                    let bytes = reply.chunk(json!({"role": "assistant", "content": ""}), None);
                    let next = if reply.tokens.is_empty() {
                        Step::Finish
                    } else {
                        Step::Token(0)
                    };
                    Some((Ok(bytes), (next, reply, state)))
                }
                Step::Token(i) => {
                    if reply.truncate && i == cut_at {
                        return Some((cut_off().await, (Step::End, reply, state)));
                    }
                    if !pause(&state, if i == 0 { latency } else { itl }).await {
                        return None;
                    }
                    let bytes = reply.chunk(json!({"content": reply.tokens[i]}), None);
                    let next = if i + 1 < reply.tokens.len() {
                        Step::Token(i + 1)
                    } else {
                        Step::Finish
                    };
                    Some((Ok(bytes), (next, reply, state)))
                }
                Step::Finish => {
                    if reply.tokens.is_empty() && !pause(&state, latency).await {
                        return None;
                    }
                    let bytes = reply.chunk(json!({}), Some(reply.finish_reason));
                    let next = if include_usage {
                        Step::Usage
                    } else {
                        Step::Done
                    };
                    Some((Ok(bytes), (next, reply, state)))
                }
                Step::Usage => {
                    let bytes = sse(&json!({
                        "id": reply.id,
                        "object": "chat.completion.chunk",
                        "created": 0,
                        "model": reply.model,
                        "choices": [],
                        "usage": reply.usage(),
                    }));
                    Some((Ok(bytes), (Step::Done, reply, state)))
                }
                Step::Done => {
                    state.stats.completed(reply.arrived);
                    Some((
                        Ok(Bytes::from_static(b"data: [DONE]\n\n")),
                        (Step::End, reply, state),
                    ))
                }
                Step::End => None,
            }
        },
    );
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
