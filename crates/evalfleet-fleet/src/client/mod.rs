//! The OpenAI chat completions client: non-streaming and streaming (SSE with
//! `stream_options.include_usage`), per-attempt telemetry, and errors that
//! say their class so that retry logic never parses messages.

use std::sync::Once;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use evalfleet_types::{ErrorClass, FadingMax};
use futures_util::StreamExt;
use reqwest::header::{
    AUTHORIZATION, CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue, RETRY_AFTER,
};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use tokio::time::Instant;

use evalfleet_config::EndpointConfig;
use evalfleet_io::images::Images;

mod forward;
mod sse;
pub use forward::{Api, Forwarded, Head, cut_body};

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("cannot connect: {0}")]
    Connect(#[source] Unanswered),
    #[error("no answer within {}", humantime::format_duration(*.0))]
    Timeout(Duration),
    #[error("HTTP {status}: {message}")]
    Status {
        status: u16,
        message: String,
        retry_after: Option<Duration>,
    },
    #[error("the connection failed: {0}")]
    Transport(#[source] Unanswered),
    #[error("bad response: {0}")]
    BadResponse(String),
    #[error("the response ended before the answer was complete")]
    Truncated,
    /// The stream ended cleanly (`[DONE]`, or the body was whole) but no
    /// choice said why it finished: by the OpenAI contract every choice
    /// ends with a `finish_reason`, so the answer is incomplete (servers
    /// that cut a running stream when another request arrives do this).
    #[error("the answer ended without a finish_reason (cut off by the server)")]
    Unfinished,
    /// The stream said why it finished, then closed without `data:
    /// [DONE]`: it was cut before its end (its usage chunk, if asked for,
    /// never came), or the server never ends its streams so.
    #[error(
        "the stream closed without data: [DONE] after its finish_reason (cut short; a server that never sends [DONE] needs task.stream: false)"
    )]
    Unended,
    #[error("no first byte of the answer within {}", humantime::format_duration(*.0))]
    FirstByteTimeout(Duration),
    #[error("the stream sent nothing for {}", humantime::format_duration(*.0))]
    Stalled(Duration),
}

impl CallError {
    pub fn class(&self) -> ErrorClass {
        match self {
            Self::Connect(_) | Self::Transport(_) => ErrorClass::Retryable,
            Self::Timeout(_) => ErrorClass::BackPressure,
            Self::Status { status, .. } => match *status {
                408 | 429 | 503 => ErrorClass::BackPressure,
                400..=499 => ErrorClass::Fatal,
                _ => ErrorClass::Retryable,
            },
            Self::BadResponse(_) | Self::Truncated | Self::Unfinished | Self::Unended => {
                ErrorClass::BadResponse
            }
            Self::FirstByteTimeout(_) => ErrorClass::FirstByteTimeout,
            Self::Stalled(_) => ErrorClass::Stalled,
        }
    }

    /// How long the endpoint asked us to wait (`Retry-After`, `retry-after-ms`).
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Status { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    pub fn http_status(&self) -> Option<u16> {
        match self {
            Self::Status { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// A request that got no HTTP answer, told by its innermost cause
/// ("Connection refused (os error 111)", "connection closed before message
/// completed", "Connection reset by peer (os error 104)", a DNS or TLS
/// failure), which is also its source: the HTTP client's wrappers around
/// it ("error sending request for url (...)", "client error
/// (SendRequest)") say nothing of why, and the URL they show may carry a
/// key in its query.
#[derive(Debug)]
pub struct Unanswered(reqwest::Error);

impl Unanswered {
    /// The URL the request went to.
    pub fn url(&self) -> Option<&reqwest::Url> {
        self.0.url()
    }

    /// The innermost error under the client's.
    fn cause(&self) -> Option<&(dyn std::error::Error + 'static)> {
        let mut cause = std::error::Error::source(&self.0)?;
        while let Some(inner) = cause.source() {
            cause = inner;
        }
        Some(cause)
    }
}

impl std::fmt::Display for Unanswered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.cause() {
            Some(cause) => std::fmt::Display::fmt(cause, f),
            None => std::fmt::Display::fmt(&self.0, f),
        }
    }
}

impl std::error::Error for Unanswered {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.cause()
    }
}

/// A successful answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub content: String,
    pub finish_reason: Option<String>,
    pub prompt_tokens: Option<u64>,
    /// From the response's `usage`; for a stream without usage, the
    /// number of content chunks (`tokens_estimated`).
    pub completion_tokens: Option<u64>,
    /// `completion_tokens` was counted from the stream's chunks, not read
    /// from its usage (servers that send none in streams).
    pub tokens_estimated: bool,
    pub http_status: u16,
}

/// How long a call may wait for the first byte of its answer, and how
/// long a stream may then send nothing (`timeouts.first_byte`,
/// `timeouts.stream_idle`). A non-streamed answer comes whole, so only the
/// attempt timeout bounds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stalls {
    pub first_byte: Duration,
    pub idle: Duration,
}

impl Default for Stalls {
    fn default() -> Self {
        Self {
            first_byte: Duration::from_secs(120),
            idle: Duration::from_secs(30),
        }
    }
}

/// Streams an endpoint answered in full before its quiet spells say what
/// is normal for it.
const GAPS_KNOWN: u32 = 20;
/// A stream is stalled once quiet this many times its endpoint's longest
/// recent quiet spell...
const GAP_MARGIN: f64 = 8.0;
/// ...and never sooner than this (nor later than `timeouts.stream_idle`).
const GAP_FLOOR: Duration = Duration::from_secs(1);
/// Each stream, the longest spell known fades by this.
const GAP_FADE: f64 = 0.99;

/// Complete streams of the endpoint, while one is quiet, that show it has
/// stalled once it has been quiet for [`GAP_FLOOR`] too: its neighbours
/// went from their first token to their last while it sent nothing.
const PEERS_PASSED: u64 = 20;

/// What is a normal quiet spell in an endpoint's streams: the longest gap
/// between events of its recent complete streams, as a maximum that fades.
/// A stream quiet for [`GAP_MARGIN`] times that has stalled, however long
/// `timeouts.stream_idle` would still wait: a server that streams a token
/// every 20 ms and then sends nothing for 20 s is not thinking. Before
/// enough streams are known (at the start of a run), a stream quiet for
/// [`GAP_FLOOR`] while [`PEERS_PASSED`] others were answered in full has
/// stalled too.
#[derive(Debug)]
pub struct Gaps {
    longest: std::sync::Mutex<FadingMax>,
    /// Streams answered in full.
    completed: std::sync::atomic::AtomicU64,
}

impl Default for Gaps {
    fn default() -> Self {
        Self {
            longest: std::sync::Mutex::new(FadingMax::new(GAP_FADE)),
            completed: std::sync::atomic::AtomicU64::new(0),
        }
    }
}

impl Gaps {
    fn longest(&self) -> std::sync::MutexGuard<'_, FadingMax> {
        self.longest
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// How long a stream may be quiet, at most `idle`.
    pub fn limit(&self, idle: Duration) -> Duration {
        match self.longest().value(GAPS_KNOWN) {
            None => idle,
            Some(longest) => longest.mul_f64(GAP_MARGIN).max(GAP_FLOOR).min(idle),
        }
    }

    /// A stream answered in full, its longest gap `longest`.
    pub fn record(&self, longest: Duration) {
        self.longest().record(longest);
        self.completed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Streams answered in full so far.
    pub fn completed(&self) -> u64 {
        self.completed.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// When an endpoint last showed that it works: an answer that was not a
/// 5xx, an event of a stream, a whole body. The health monitor probes an
/// endpoint only when it has shown nothing for a while, so that a probe
/// never competes with calls that go well (a server that serves one
/// request at a time cuts its running stream for any request that waits,
/// a probe's included).
#[derive(Debug)]
pub struct Pulse {
    origin: Instant,
    /// Milliseconds from `origin` to the last sign, plus one (0: none yet).
    last: std::sync::atomic::AtomicU64,
}

impl Default for Pulse {
    fn default() -> Self {
        Self {
            origin: Instant::now(),
            last: std::sync::atomic::AtomicU64::new(0),
        }
    }
}

impl Pulse {
    /// The endpoint showed it works, now.
    pub fn beat(&self) {
        let since = Instant::now().saturating_duration_since(self.origin);
        let ms = u64::try_from(since.as_millis()).unwrap_or(u64::MAX - 1) + 1;
        self.last
            .fetch_max(ms, std::sync::atomic::Ordering::Relaxed);
    }

    /// When it last did (to the millisecond), if ever.
    pub fn last(&self) -> Option<Instant> {
        match self.last.load(std::sync::atomic::Ordering::Relaxed) {
            0 => None,
            ms => Some(self.origin + Duration::from_millis(ms - 1)),
        }
    }
}

/// When an attempt happened. Latencies are from the moment the request was
/// sent; TTFT only for streams.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// Wall-clock time the request was sent.
    pub sent_at: SystemTime,
    /// Send to the first content token (streaming only).
    pub ttft: Option<Duration>,
    /// Send to the last byte (or to the failure).
    pub latency: Duration,
}

impl Timing {
    /// TPOT = (E2E - TTFT) / (completion_tokens - 1), as vLLM's benchmark
    /// defines it; only for streams with more than one token.
    pub fn tpot(&self, completion_tokens: Option<u64>) -> Option<Duration> {
        let ttft = self.ttft?;
        let tokens = completion_tokens?;
        if tokens < 2 {
            return None;
        }
        Some(self.latency.saturating_sub(ttft) / (tokens - 1) as u32)
    }
}

/// A quota a response reported (`x-ratelimit-*` headers).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Quota {
    pub limit_requests: Option<u64>,
    pub remaining_requests: Option<u64>,
    pub reset_requests: Option<Duration>,
    pub limit_tokens: Option<u64>,
    pub remaining_tokens: Option<u64>,
    pub reset_tokens: Option<Duration>,
}

impl Quota {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// A reset time in OpenAI's format (`1s`, `6m0s`, `20ms`, `1m30.5s`), or plain
/// seconds.
pub fn parse_reset(text: &str) -> Option<Duration> {
    let text = text.trim();
    if let Ok(seconds) = text.parse::<f64>() {
        return (seconds.is_finite() && seconds >= 0.0).then(|| Duration::from_secs_f64(seconds));
    }
    let mut total = 0.0;
    let mut rest = text;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let value: f64 = rest[..number_len].parse().ok()?;
        rest = &rest[number_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        total += value * scale;
        rest = &rest[unit_len..];
    }
    (total.is_finite() && total >= 0.0).then(|| Duration::from_secs_f64(total))
}

/// One call's outcome with its timing.
#[derive(Debug)]
pub struct CallOutcome {
    pub result: Result<Completion, CallError>,
    pub timing: Timing,
    /// The quota the response reported (`x-ratelimit-*`), if any.
    pub quota: Option<Quota>,
}

/// A client for one endpoint.
#[derive(Clone)]
pub struct ChatClient {
    /// Keeps connections for [`POOL_IDLE`].
    http: reqwest::Client,
    /// Keeps them for less, once the server said it does
    /// (`Keep-Alive: timeout=N`); then used instead of `http`.
    http_short: std::sync::Arc<std::sync::OnceLock<reqwest::Client>>,
    /// Keeps none: a request sent again after its connection was closed
    /// under it goes on a new one.
    http_fresh: reqwest::Client,
    /// What the clients are made with, to make `http_short`.
    headers: HeaderMap,
    pool_size: usize,
    completions_url: reqwest::Url,
    models_url: reqwest::Url,
    /// The base URL, without its last `/`.
    base: String,
    /// `{"model":"NAME","messages":` — the body up to the messages.
    body_head: Bytes,
    /// `,"param":value,...,"stream":...}` — the body after the messages.
    body_tail: Bytes,
    stream: bool,
    stalls: Stalls,
    gaps: std::sync::Arc<Gaps>,
    pulse: std::sync::Arc<Pulse>,
}

/// Bodies of error responses are read up to this size for their message.
pub(crate) const ERROR_BODY_LIMIT: usize = 8 * 1024;

/// Installs the TLS crypto provider once per process.
fn install_crypto() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Fails only when another provider was installed first, which is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// Connections idle for longer than this are not reused: less than the 5 s
/// for which uvicorn (vLLM, SGLang, llama-cpp-python), llama.cpp's server,
/// Node and Apache keep an idle connection open, few of which say so in a
/// `Keep-Alive` header. A server that says it keeps them for less is
/// followed ([`reuse_within`]).
pub const POOL_IDLE: Duration = Duration::from_secs(4);

/// An HTTP client for probes and tests.
pub fn http_client(pool_size: usize) -> Result<reqwest::Client, reqwest::Error> {
    http_builder(pool_size, POOL_IDLE).build()
}

/// The settings of every HTTP client evalfleet makes: at most `pool_size`
/// idle connections to a host, each reused only within `idle`.
fn http_builder(pool_size: usize, idle: Duration) -> reqwest::ClientBuilder {
    install_crypto();
    reqwest::Client::builder()
        .pool_max_idle_per_host(pool_size)
        .pool_idle_timeout(idle)
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(10))
        // An API answers where it is asked; a redirect of a POST is a
        // misconfigured base URL, better reported than followed.
        .redirect(reqwest::redirect::Policy::none())
}

impl ChatClient {
    /// A client for `endpoint` at `base_url`, sending `task_params` overlaid
    /// with the endpoint's own `params`.
    pub fn new(
        endpoint: &EndpointConfig,
        base_url: &str,
        task_params: &Map<String, Value>,
        stream: bool,
    ) -> Result<Self, String> {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Some(key) = &endpoint.api_key {
            headers.insert(
                AUTHORIZATION,
                secret_header(&format!("Bearer {}", key.expose()))?,
            );
        }
        for (name, value) in &endpoint.headers {
            let name = HeaderName::from_bytes(name.as_bytes()).map_err(|err| err.to_string())?;
            headers.insert(name, secret_header(value.expose())?);
        }
        let pool_size = endpoint.max_concurrency();
        let build = |pool_size, idle| {
            http_builder(pool_size, idle)
                .default_headers(headers.clone())
                .build()
                .map_err(|err| err.to_string())
        };
        let http = build(pool_size, POOL_IDLE)?;
        let http_fresh = build(0, POOL_IDLE)?;
        let mut params = task_params.clone();
        params.extend(endpoint.params.clone());
        let model = serde_json::to_string(&endpoint.model).map_err(|err| err.to_string())?;
        let head = format!("{{\"model\":{model},\"messages\":");
        let mut tail = String::new();
        for (key, value) in &params {
            tail.push(',');
            tail.push_str(&serde_json::to_string(key).map_err(|err| err.to_string())?);
            tail.push(':');
            tail.push_str(&serde_json::to_string(value).map_err(|err| err.to_string())?);
        }
        if stream {
            tail.push_str(",\"stream\":true,\"stream_options\":{\"include_usage\":true}}");
        } else {
            tail.push_str(",\"stream\":false}");
        }
        let base = base_url.trim_end_matches('/');
        let url = |path: &str| {
            reqwest::Url::parse(&format!("{base}/{path}"))
                .map_err(|err| format!("{base}/{path}: {err}"))
        };
        Ok(Self {
            http,
            http_short: std::sync::Arc::default(),
            http_fresh,
            headers,
            pool_size,
            completions_url: url("chat/completions")?,
            models_url: url("models")?,
            base: base.to_owned(),
            body_head: Bytes::from(head),
            body_tail: Bytes::from(tail),
            stream,
            stalls: Stalls::default(),
            gaps: std::sync::Arc::default(),
            pulse: std::sync::Arc::default(),
        })
    }

    /// When the endpoint last showed it works (see [`Pulse`]).
    pub fn pulse(&self) -> &Pulse {
        &self.pulse
    }

    /// The client whose pooled connections the server keeps open.
    fn pooled(&self) -> &reqwest::Client {
        self.http_short.get().unwrap_or(&self.http)
    }

    /// Follows a server that says it closes idle connections sooner than
    /// [`POOL_IDLE`]: later requests go on a client that reuses them only
    /// within what it allows. Learned once (a server says the same each
    /// time).
    fn learn_keep_alive(&self, headers: &HeaderMap) {
        if self.http_short.get().is_some() {
            return;
        }
        let Some(idle) = keep_alive_timeout(headers).map(reuse_within) else {
            return;
        };
        if idle >= POOL_IDLE {
            return;
        }
        let built = http_builder(self.pool_size, idle)
            .default_headers(self.headers.clone())
            .build();
        let client = match built {
            Ok(client) => {
                tracing::debug!(
                    "Reusing connections only within {idle:?}, as the server keeps them."
                );
                client
            }
            Err(err) => {
                // Said once: the usual client goes on, and closed
                // connections are sent again.
                tracing::warn!(
                    "Cannot make an HTTP client that follows the server's keep-alive: {err}."
                );
                self.http.clone()
            }
        };
        // Another call may have learned it first: the same.
        let _ = self.http_short.set(client);
    }

    /// Sends the request `build` makes on a pooled connection; when that
    /// connection was closed under it (the server's keep-alive ended as it
    /// was sent), once more at once on a new connection: the server never
    /// took it up, so it costs no attempt.
    async fn send(
        &self,
        build: impl Fn(&reqwest::Client) -> reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, reqwest::Error> {
        match build(self.pooled()).send().await {
            Err(err) if closed_under_it(&err) => {
                tracing::debug!(
                    "The connection was closed as the request was sent ({}); sending it again on a new one.",
                    evalfleet_types::root_cause(&err)
                );
                build(&self.http_fresh).send().await
            }
            Ok(response) => {
                self.learn_keep_alive(response.headers());
                Ok(response)
            }
            Err(err) => Err(err),
        }
    }

    /// The same client with these limits on a call's waits.
    #[must_use]
    pub fn with_stalls(mut self, stalls: Stalls) -> Self {
        self.stalls = stalls;
        self
    }

    /// The request body for these messages, with the data URLs of
    /// `images` where the messages name them by hash.
    pub fn body(&self, messages: &RawValue, images: &Images) -> Vec<u8> {
        let json = messages.get();
        let sent: usize = images
            .iter()
            .filter_map(|image| image.reference.bytes)
            .map(|n| n as usize * 4 / 3 + 64)
            .sum();
        let mut body =
            Vec::with_capacity(self.body_head.len() + json.len() + sent + self.body_tail.len());
        body.extend_from_slice(&self.body_head);
        if images.is_empty() {
            body.extend_from_slice(json.as_bytes());
        } else {
            evalfleet_io::images::write_body(json, images, &mut body);
        }
        body.extend_from_slice(&self.body_tail);
        body
    }

    /// Sends one chat completion request.
    pub async fn complete(&self, messages: &RawValue) -> CallOutcome {
        self.complete_with(messages, &Images::default()).await
    }

    /// Sends one chat completion request whose messages name `images`.
    pub async fn complete_with(&self, messages: &RawValue, images: &Images) -> CallOutcome {
        let sent_at = SystemTime::now();
        let started = Instant::now();
        let mut ttft = None;
        let mut quota = None;
        let result = self
            .call(messages, images, started, &mut ttft, &mut quota)
            .await;
        CallOutcome {
            result,
            timing: Timing {
                sent_at,
                ttft,
                latency: started.elapsed(),
            },
            quota,
        }
    }

    async fn call(
        &self,
        messages: &RawValue,
        images: &Images,
        started: Instant,
        ttft: &mut Option<Duration>,
        quota: &mut Option<Quota>,
    ) -> Result<Completion, CallError> {
        let request = self.send(|http| {
            http.post(self.completions_url.clone())
                .body(self.body(messages, images))
        });
        // A stream's first byte (its headers, then its first event) is due
        // by then.
        let first_byte_by = started + self.stalls.first_byte;
        let response = if self.stream {
            tokio::time::timeout_at(first_byte_by, request)
                .await
                .map_err(|_| CallError::FirstByteTimeout(self.stalls.first_byte))?
        } else {
            request.await
        }
        .map_err(request_error)?;
        *quota = quota_headers(response.headers());
        let status = response.status();
        // An answer that is not the server's fault shows it works.
        if !status.is_server_error() {
            self.pulse.beat();
        }
        if !status.is_success() {
            return Err(status_error(response).await);
        }
        if self.stream {
            let idle = self.gaps.limit(self.stalls.idle);
            let (completion, longest) = read_stream(
                response,
                started,
                ttft,
                Stalls {
                    first_byte: self.stalls.first_byte,
                    idle,
                },
                first_byte_by,
                &self.gaps,
                &self.pulse,
            )
            .await?;
            self.gaps.record(longest);
            Ok(completion)
        } else {
            let bytes = response.bytes().await.map_err(body_error)?;
            self.pulse.beat();
            parse_completion(&bytes, status.as_u16())
        }
    }

    /// `GET /models`: the model ids the endpoint serves.
    pub async fn models(&self) -> Result<Vec<String>, CallError> {
        let response = self
            .send(|http| http.get(self.models_url.clone()))
            .await
            .map_err(request_error)?;
        if !response.status().is_success() {
            return Err(status_error(response).await);
        }
        let bytes = response.bytes().await.map_err(body_error)?;
        #[derive(Deserialize)]
        struct Models {
            data: Vec<Model>,
        }
        #[derive(Deserialize)]
        struct Model {
            id: String,
        }
        let models: Models = serde_json::from_slice(&bytes)
            .map_err(|err| CallError::BadResponse(format!("not a model list: {err}")))?;
        Ok(models.data.into_iter().map(|m| m.id).collect())
    }
}

/// A URL as it may be shown (in a message, a log, the run's record): its
/// user, password and query (where keys are sometimes passed) left out.
pub fn shown_url(url: &reqwest::Url) -> String {
    let mut shown = url.clone();
    let _ = shown.set_username("");
    let _ = shown.set_password(None);
    shown.set_query(None);
    shown.to_string()
}

fn secret_header(value: &str) -> Result<HeaderValue, String> {
    let mut header = HeaderValue::from_str(value)
        .map_err(|_| "a header value is not valid in HTTP".to_owned())?;
    header.set_sensitive(true);
    Ok(header)
}

pub(crate) fn request_error(err: reqwest::Error) -> CallError {
    if err.is_connect() {
        CallError::Connect(Unanswered(err))
    } else {
        CallError::Transport(Unanswered(err))
    }
}

/// Whether a request failed because the connection it went on was closed
/// under it (closed before any byte of an answer, reset, or broken) rather
/// than because no connection could be made: what a server does to a
/// connection it keeps idle when its keep-alive ends just as a request is
/// sent on it. Such a request was never taken up by the server.
fn closed_under_it(err: &reqwest::Error) -> bool {
    if err.is_connect() || err.is_timeout() {
        return false;
    }
    let mut cause = std::error::Error::source(err);
    while let Some(inner) = cause {
        if inner
            .downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_incomplete_message)
        {
            return true;
        }
        if let Some(io) = inner.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe
            );
        }
        cause = inner.source();
    }
    false
}

/// How long the server keeps an idle connection open, as its
/// `Keep-Alive: timeout=N` header says.
fn keep_alive_timeout(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get("keep-alive")?.to_str().ok()?;
    value.split(',').find_map(|part| {
        let (key, seconds) = part.split_once('=')?;
        if !key.trim().eq_ignore_ascii_case("timeout") {
            return None;
        }
        let seconds: f64 = seconds.trim().parse().ok()?;
        (seconds.is_finite() && seconds >= 0.0).then(|| Duration::from_secs_f64(seconds))
    })
}

/// How long a connection may stay idle and still be reused, when the
/// server closes idle ones after `timeout`: a second less (half of it when
/// shorter), so that a request sent on it gets there before the server
/// closes it.
fn reuse_within(timeout: Duration) -> Duration {
    timeout.saturating_sub(Duration::from_secs(1).min(timeout / 2))
}

pub(crate) fn body_error(err: reqwest::Error) -> CallError {
    if err.is_decode() {
        CallError::BadResponse(err.to_string())
    } else {
        CallError::Truncated
    }
}

async fn status_error(response: reqwest::Response) -> CallError {
    let status = response.status().as_u16();
    let retry_after = retry_after(response.headers());
    let mut body = Vec::new();
    let mut stream = response.bytes_stream();
    while let Some(Ok(chunk)) = stream.next().await {
        body.extend_from_slice(&chunk);
        if body.len() >= ERROR_BODY_LIMIT {
            body.truncate(ERROR_BODY_LIMIT);
            break;
        }
    }
    CallError::Status {
        status,
        // An endpoint that quotes the request would put images' bytes in
        // the attempt's record.
        message: evalfleet_io::images::redact(&error_message(&body)),
        retry_after,
    }
}

/// The message of an error body: OpenAI's `error.message` when present.
pub(crate) fn error_message(body: &[u8]) -> String {
    if let Ok(value) = serde_json::from_slice::<Value>(body) {
        let message = value
            .pointer("/error/message")
            .or_else(|| value.get("message"))
            .or_else(|| value.get("detail"))
            .and_then(Value::as_str);
        if let Some(message) = message {
            return message.to_owned();
        }
    }
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    if text.is_empty() {
        "(no message)".to_owned()
    } else {
        text.chars().take(300).collect()
    }
}

/// The `x-ratelimit-*` headers of a response (OpenAI's names).
pub fn quota_headers(headers: &HeaderMap) -> Option<Quota> {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let number = |name: &str| text(name).and_then(|v| v.trim().parse::<u64>().ok());
    let reset = |name: &str| text(name).and_then(parse_reset);
    let quota = Quota {
        limit_requests: number("x-ratelimit-limit-requests"),
        remaining_requests: number("x-ratelimit-remaining-requests"),
        reset_requests: reset("x-ratelimit-reset-requests"),
        limit_tokens: number("x-ratelimit-limit-tokens"),
        remaining_tokens: number("x-ratelimit-remaining-tokens"),
        reset_tokens: reset("x-ratelimit-reset-tokens"),
    };
    (!quota.is_empty()).then_some(quota)
}

/// `retry-after-ms` (milliseconds), or `Retry-After` in seconds or as an
/// HTTP date.
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    if let Some(ms) = headers
        .get("retry-after-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|ms| ms.is_finite() && *ms >= 0.0)
    {
        return Some(Duration::from_secs_f64(ms / 1000.0));
    }
    let text = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(seconds) = text.parse::<f64>() {
        return (seconds.is_finite() && seconds >= 0.0).then(|| Duration::from_secs_f64(seconds));
    }
    let date = httpdate::parse_http_date(text).ok()?;
    Some(
        date.duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

#[derive(Deserialize)]
struct Usage {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
}

fn parse_completion(bytes: &[u8], status: u16) -> Result<Completion, CallError> {
    #[derive(Deserialize)]
    struct Response {
        choices: Vec<Choice>,
        usage: Option<Usage>,
    }
    #[derive(Deserialize)]
    struct Choice {
        message: ChoiceMessage,
        finish_reason: Option<String>,
    }
    #[derive(Deserialize)]
    struct ChoiceMessage {
        content: Option<String>,
    }
    let response: Response = serde_json::from_slice(bytes)
        .map_err(|err| CallError::BadResponse(format!("not a chat completion: {err}")))?;
    let choice = response
        .choices
        .into_iter()
        .next()
        .ok_or_else(|| CallError::BadResponse("the completion has no choices".to_owned()))?;
    if choice.finish_reason.is_none() {
        return Err(CallError::Unfinished);
    }
    Ok(Completion {
        content: choice.message.content.unwrap_or_default(),
        finish_reason: choice.finish_reason,
        prompt_tokens: response.usage.as_ref().and_then(|u| u.prompt_tokens),
        completion_tokens: response.usage.as_ref().and_then(|u| u.completion_tokens),
        tokens_estimated: false,
        http_status: status,
    })
}

/// Reads a stream to its end: the completion, and the longest gap between
/// its events.
async fn read_stream(
    response: reqwest::Response,
    started: Instant,
    ttft: &mut Option<Duration>,
    stalls: Stalls,
    first_byte_by: Instant,
    gaps: &Gaps,
    pulse: &Pulse,
) -> Result<(Completion, Duration), CallError> {
    #[derive(Deserialize)]
    struct Chunk {
        #[serde(default)]
        choices: Vec<ChunkChoice>,
        usage: Option<Usage>,
        error: Option<Value>,
    }
    #[derive(Deserialize)]
    struct ChunkChoice {
        #[serde(default)]
        delta: Option<Delta>,
        finish_reason: Option<String>,
    }
    #[derive(Deserialize)]
    struct Delta {
        content: Option<String>,
        /// Thinking, as DeepSeek's API, SGLang and older vLLM name it...
        reasoning_content: Option<String>,
        /// ...and as newer vLLM, Ollama and OpenRouter do.
        reasoning: Option<String>,
        /// A tool call being streamed: tokens too.
        tool_calls: Option<Value>,
    }

    let status = response.status().as_u16();
    let mut events = sse::Events::new(response.bytes_stream());
    let mut content = String::new();
    let mut finish_reason = None;
    let mut usage = None;
    // Chunks that carried content: the completion's tokens when the
    // stream says nothing of its usage (one token a chunk, as servers
    // stream them).
    let mut pieces = 0u64;
    let mut done = false;
    let mut last = Instant::now();
    let mut longest = Duration::ZERO;
    // Until the first token, the wait is the first byte's; after each, a
    // stream that goes quiet for `idle` has stalled, and so has one quiet
    // for `GAP_FLOOR` while `PEERS_PASSED` others were answered in full.
    // One timer, moved on.
    let quiet = tokio::time::sleep_until(first_byte_by);
    tokio::pin!(quiet);
    // Streams the endpoint had answered in full when the last event came.
    let mut passed_from = gaps.completed();
    loop {
        let next = tokio::select! {
            biased;
            event = events.next() => event,
            () = &mut quiet => {
                // Until the answer's first token (a role chunk may come at
                // once, the token after the prompt is read), the wait is
                // the first byte's, however many others end meanwhile.
                if ttft.is_none() {
                    return Err(CallError::FirstByteTimeout(stalls.first_byte));
                }
                let now = Instant::now();
                let quiet_for = now - last;
                if quiet_for >= stalls.idle
                    || gaps.completed().saturating_sub(passed_from) >= PEERS_PASSED
                {
                    let quiet_for = Duration::from_millis(quiet_for.as_millis() as u64);
                    return Err(CallError::Stalled(quiet_for));
                }
                quiet.as_mut().reset((now + GAP_FLOOR).min(last + stalls.idle));
                continue;
            }
        };
        let Some(event) = next else {
            break;
        };
        let now = Instant::now();
        // Gaps count from the first token on: before it, the time to it.
        let flowing = ttft.is_some();
        if flowing {
            longest = longest.max(now - last);
        }
        last = now;
        passed_from = gaps.completed();
        let quiet_until = now + stalls.idle.min(GAP_FLOOR.max(Duration::from_millis(1)));
        if flowing {
            quiet.as_mut().reset(quiet_until);
        }
        let event = event.map_err(|err| match err {
            sse::Broken::Transport(_) => CallError::Truncated,
            sse::Broken::TooLong(err) => {
                CallError::BadResponse(format!("invalid event stream: {err}"))
            }
        })?;
        pulse.beat();
        let data = event.trim();
        if data == "[DONE]" {
            done = true;
            break;
        }
        if data.is_empty() {
            continue;
        }
        let chunk: Chunk = serde_json::from_str(data)
            .map_err(|err| CallError::BadResponse(format!("invalid stream chunk: {err}")))?;
        if let Some(error) = chunk.error {
            let message = error
                .get("message")
                .and_then(Value::as_str)
                .map_or_else(|| error.to_string(), str::to_owned);
            return Err(CallError::BadResponse(format!(
                "error in stream: {message}"
            )));
        }
        for choice in chunk.choices {
            if let Some(delta) = choice.delta {
                let piece = delta.content.unwrap_or_default();
                let thinking = [delta.reasoning_content, delta.reasoning]
                    .iter()
                    .any(|t| t.as_deref().is_some_and(|t| !t.is_empty()));
                let calling = delta.tool_calls.is_some_and(|c| !c.is_null());
                if !piece.is_empty() || thinking || calling {
                    pieces += 1;
                    if ttft.is_none() {
                        *ttft = Some(started.elapsed());
                    }
                }
                content.push_str(&piece);
            }
            if choice.finish_reason.is_some() {
                finish_reason = choice.finish_reason;
            }
        }
        if chunk.usage.is_some() {
            usage = chunk.usage;
        }
        if !flowing && ttft.is_some() {
            // The first token: from now on, a quiet stream is a stall.
            quiet.as_mut().reset(quiet_until);
        }
    }
    // A stream is whole only when it ended: without `[DONE]` it was cut on
    // the way, whatever it said before (a finish_reason may come before the
    // usage chunk and the end). One that ended before any choice said why
    // it finished is incomplete too: the server closed it early.
    if !done {
        return Err(if finish_reason.is_some() {
            CallError::Unended
        } else {
            CallError::Truncated
        });
    }
    if finish_reason.is_none() {
        return Err(CallError::Unfinished);
    }
    let counted = usage.as_ref().and_then(|u| u.completion_tokens);
    let completion = Completion {
        content,
        finish_reason,
        prompt_tokens: usage.as_ref().and_then(|u| u.prompt_tokens),
        completion_tokens: counted.or(Some(pieces)),
        tokens_estimated: counted.is_none(),
        http_status: status,
    };
    Ok((completion, longest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_follow_status_codes() {
        let status = |status| CallError::Status {
            status,
            message: String::new(),
            retry_after: None,
        };
        assert_eq!(status(429).class(), ErrorClass::BackPressure);
        assert_eq!(status(503).class(), ErrorClass::BackPressure);
        assert_eq!(status(408).class(), ErrorClass::BackPressure);
        assert_eq!(status(500).class(), ErrorClass::Retryable);
        assert_eq!(status(502).class(), ErrorClass::Retryable);
        assert_eq!(status(400).class(), ErrorClass::Fatal);
        assert_eq!(status(401).class(), ErrorClass::Fatal);
        assert_eq!(CallError::Truncated.class(), ErrorClass::BadResponse);
        assert_eq!(
            CallError::Timeout(Duration::from_secs(1)).class(),
            ErrorClass::BackPressure
        );
        assert!(!ErrorClass::Fatal.is_retryable());
    }

    #[test]
    fn retry_after_reads_seconds_milliseconds_and_dates() {
        let mut headers = HeaderMap::new();
        headers.insert(RETRY_AFTER, HeaderValue::from_static("3"));
        assert_eq!(retry_after(&headers), Some(Duration::from_secs(3)));
        headers.insert("retry-after-ms", HeaderValue::from_static("250"));
        assert_eq!(retry_after(&headers), Some(Duration::from_millis(250)));
        let mut headers = HeaderMap::new();
        let later = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(120));
        headers.insert(RETRY_AFTER, HeaderValue::from_str(&later).unwrap());
        let wait = retry_after(&headers).unwrap();
        assert!(
            wait > Duration::from_secs(100) && wait <= Duration::from_secs(120),
            "{wait:?}"
        );
    }

    #[test]
    fn a_keep_alive_header_says_how_long_connections_may_be_reused() {
        let said = |value: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert("keep-alive", HeaderValue::from_static(value));
            keep_alive_timeout(&headers)
        };
        assert_eq!(said("timeout=5, max=100"), Some(Duration::from_secs(5)));
        assert_eq!(said("max=100, Timeout = 2"), Some(Duration::from_secs(2)));
        assert_eq!(said("max=100"), None);
        assert_eq!(said("timeout=soon"), None);
        assert_eq!(keep_alive_timeout(&HeaderMap::new()), None);
        // A second's margin, or half of a shorter timeout.
        assert_eq!(reuse_within(Duration::from_secs(5)), POOL_IDLE);
        assert_eq!(
            reuse_within(Duration::from_secs(1)),
            Duration::from_millis(500)
        );
        assert_eq!(reuse_within(Duration::ZERO), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn a_pulse_remembers_the_last_sign_of_life() {
        let pulse = Pulse::default();
        assert_eq!(pulse.last(), None);
        tokio::time::advance(Duration::from_secs(3)).await;
        let now = Instant::now();
        pulse.beat();
        assert_eq!(pulse.last(), Some(now));
    }

    #[test]
    fn error_messages_come_from_openai_error_bodies() {
        assert_eq!(
            error_message(br#"{"error": {"message": "slow down"}}"#),
            "slow down"
        );
        assert_eq!(error_message(b"plain text"), "plain text");
        assert_eq!(error_message(b""), "(no message)");
    }

    #[test]
    fn resets_parse_in_openai_format() {
        assert_eq!(parse_reset("1s"), Some(Duration::from_secs(1)));
        assert_eq!(parse_reset("6m0s"), Some(Duration::from_secs(360)));
        assert_eq!(parse_reset("20ms"), Some(Duration::from_millis(20)));
        assert_eq!(parse_reset("1m30.5s"), Some(Duration::from_millis(90_500)));
        assert_eq!(parse_reset("2.5"), Some(Duration::from_millis(2500)));
        assert_eq!(parse_reset("soon"), None);
    }

    #[test]
    fn tpot_follows_the_vllm_definition() {
        let timing = Timing {
            sent_at: SystemTime::now(),
            ttft: Some(Duration::from_millis(100)),
            latency: Duration::from_millis(1100),
        };
        assert_eq!(timing.tpot(Some(11)), Some(Duration::from_millis(100)));
        assert_eq!(timing.tpot(Some(1)), None);
    }

    /// A server on 127.0.0.1:0 that answers one request with `head` and
    /// then each `(pause, text)` in turn, and closes the connection.
    async fn serve_once(head: &'static str, parts: Vec<(Duration, &'static str)>) -> String {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // The test's own server: it ends with the connection.
        #[allow(clippy::disallowed_methods)]
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            read_request(&mut socket).await;
            for (pause, text) in std::iter::once((Duration::ZERO, head)).chain(parts) {
                tokio::time::sleep(pause).await;
                if socket.write_all(text.as_bytes()).await.is_err() {
                    return;
                }
            }
        });
        format!("http://{addr}/v1")
    }

    /// What the keep-alive server does with a request it has read.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Then {
        /// Answers it and keeps the connection open.
        Answer,
        /// Closes the connection without an answer (FIN), as a server
        /// whose idle timeout ends just as the request arrives.
        Close,
        /// Resets the connection without an answer (RST).
        Reset,
    }

    /// The requests a keep-alive server read: `(connection, request)`, each
    /// counted from 0 in the order they came.
    type Seen = std::sync::Arc<std::sync::Mutex<Vec<(usize, usize)>>>;

    /// Reads one request (headers, then a body of Content-Length bytes) from
    /// `socket`; `false` when the client closed the connection first.
    async fn read_request(socket: &mut tokio::net::TcpStream) -> bool {
        use tokio::io::AsyncReadExt;
        let mut request = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            let Ok(n) = socket.read(&mut buf).await else {
                return false;
            };
            if n == 0 {
                return false;
            }
            request.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&request);
            if let Some(end) = text.find("\r\n\r\n") {
                let length = text[..end]
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase()
                            .strip_prefix("content-length:")
                            .map(|v| v.trim().parse::<usize>().unwrap())
                    })
                    .unwrap_or(0);
                if request.len() >= end + 4 + length {
                    return true;
                }
            }
        }
    }

    /// A server on 127.0.0.1:0 that keeps its connections open: it does
    /// `plan(connection, request)` with each request it reads, answering
    /// with a whole completion and the `extra` headers. Returns its base
    /// URL and what it read.
    async fn keep_alive_server(
        extra: &'static str,
        plan: fn(usize, usize) -> Then,
    ) -> (String, Seen) {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Seen::default();
        let log = seen.clone();
        // The test's own server: it ends with the test's runtime.
        #[allow(clippy::disallowed_methods)]
        tokio::spawn(async move {
            let mut connection = 0;
            while let Ok((mut socket, _)) = listener.accept().await {
                let log = log.clone();
                let this = connection;
                connection += 1;
                #[allow(clippy::disallowed_methods)]
                tokio::spawn(async move {
                    let mut request = 0;
                    while read_request(&mut socket).await {
                        log.lock().unwrap().push((this, request));
                        match plan(this, request) {
                            Then::Answer => {
                                let body = r#"{"choices":[{"message":{"content":"ok"},"finish_reason":"stop"}]}"#;
                                let answer = format!(
                                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{extra}\r\n{body}",
                                    body.len()
                                );
                                if socket.write_all(answer.as_bytes()).await.is_err() {
                                    return;
                                }
                            }
                            Then::Close => return,
                            Then::Reset => {
                                socket.set_zero_linger().unwrap();
                                return;
                            }
                        }
                        request += 1;
                    }
                });
            }
        });
        (format!("http://{addr}/v1"), seen)
    }

    fn hi() -> Box<RawValue> {
        RawValue::from_string(r#"[{"role":"user","content":"hi"}]"#.to_owned()).unwrap()
    }

    #[tokio::test]
    async fn a_call_on_a_connection_the_server_closed_goes_again_on_a_new_one() {
        // The second request on the first connection finds it closed (or
        // reset) by the server, as when its idle timeout ends just as the
        // request arrives. The server never read it as a request to answer:
        // it is sent again at once on a new connection, and the call
        // succeeds.
        for then in [Then::Close, Then::Reset] {
            let plan = match then {
                Then::Close => |c: usize, r: usize| {
                    if (c, r) == (0, 1) {
                        Then::Close
                    } else {
                        Then::Answer
                    }
                },
                _ => |c: usize, r: usize| {
                    if (c, r) == (0, 1) {
                        Then::Reset
                    } else {
                        Then::Answer
                    }
                },
            };
            let (url, seen) = keep_alive_server("", plan).await;
            let client = client(&url, false, Stalls::default());
            assert_eq!(client.complete(&hi()).await.result.unwrap().content, "ok");
            let second = client.complete(&hi()).await.result;
            assert_eq!(second.map(|c| c.content).unwrap(), "ok", "{then:?}");
            assert_eq!(*seen.lock().unwrap(), [(0, 0), (0, 1), (1, 0)], "{then:?}");
        }
    }

    #[tokio::test]
    async fn a_connection_that_fails_on_every_try_says_why() {
        // Every connection is closed (then reset) as the request arrives:
        // the call fails after one more try on a new connection, and its
        // error names the cause, not only "error sending request".
        for (then, cause) in [
            (Then::Close, "connection closed before message completed"),
            (Then::Reset, "reset by peer"),
        ] {
            let plan = match then {
                Then::Close => |_: usize, _: usize| Then::Close,
                _ => |_: usize, _: usize| Then::Reset,
            };
            let (url, seen) = keep_alive_server("", plan).await;
            let err = complete(&url, false, Stalls::default()).await.unwrap_err();
            assert!(matches!(err, CallError::Transport(_)), "{err:?}");
            // Said once, the same in a log line as in the stored attempt.
            let text = evalfleet_types::error_text(&err);
            assert_eq!(text, err.to_string());
            assert!(
                text.starts_with("the connection failed: ") && text.contains(cause),
                "{then:?}: {text}"
            );
            assert_eq!(*seen.lock().unwrap(), [(0, 0), (1, 0)], "{then:?}");
        }
    }

    #[tokio::test]
    async fn a_connection_is_not_reused_past_the_keep_alive_the_server_announced() {
        // The server keeps idle connections for 2 s, and says so. Calls
        // close together share a connection; a call after the connection
        // was idle for 1.2 s (more than the second's margin) goes on a new
        // one, not on one the server may be closing.
        let (url, seen) =
            keep_alive_server("keep-alive: timeout=2, max=100\r\n", |_, _| Then::Answer).await;
        let client = client(&url, false, Stalls::default());
        for _ in 0..3 {
            client.complete(&hi()).await.result.unwrap();
        }
        let (reused, _) = seen.lock().unwrap()[2];
        assert_eq!(seen.lock().unwrap()[1].0, reused, "{seen:?}");
        // The time the connection stays idle is what this test is about.
        tokio::time::sleep(Duration::from_millis(1200)).await;
        client.complete(&hi()).await.result.unwrap();
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 4);
        assert!(seen[3].0 > reused && seen[3].1 == 0, "{seen:?}");
    }

    const SSE: &str =
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";
    const JSON: &str =
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n";

    fn client(base_url: &str, stream: bool, stalls: Stalls) -> ChatClient {
        // The config names a dataset that exists; the client reads none.
        let dataset = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
        let config = serde_json::json!({
            "name": "t",
            "dataset": {"path": dataset, "format": "jsonl"},
            "endpoints": [{"name": "e", "kind": "external", "base_url": base_url, "model": "m"}],
            "task": {"messages": [{"role": "user", "content": "{{ q }}"}]},
        });
        let loaded = evalfleet_config::load_snapshot(&config, std::path::Path::new(".")).unwrap();
        ChatClient::new(&loaded.config.endpoints[0], base_url, &Map::new(), stream)
            .unwrap()
            .with_stalls(stalls)
    }

    async fn complete(
        base_url: &str,
        stream: bool,
        stalls: Stalls,
    ) -> Result<Completion, CallError> {
        let messages =
            RawValue::from_string(r#"[{"role":"user","content":"hi"}]"#.to_owned()).unwrap();
        client(base_url, stream, stalls)
            .complete(&messages)
            .await
            .result
    }

    /// Limits a stream meets within a test: 300 ms to the first token, and
    /// between events.
    const SHORT_STALLS: Stalls = Stalls {
        first_byte: Duration::from_millis(300),
        idle: Duration::from_millis(300),
    };

    /// A streamed call to `base_url` while, from 200 ms on,
    /// [`PEERS_PASSED`] other streams of the endpoint end in full.
    async fn complete_while_neighbours_end(
        base_url: &str,
        stalls: Stalls,
    ) -> Result<Completion, CallError> {
        let client = client(base_url, true, stalls);
        let messages =
            RawValue::from_string(r#"[{"role":"user","content":"hi"}]"#.to_owned()).unwrap();
        let call = client.complete(&messages);
        tokio::pin!(call);
        let neighbours = async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            for _ in 0..PEERS_PASSED {
                client.gaps.record(Duration::from_millis(5));
            }
            std::future::pending::<()>().await;
        };
        tokio::select! {
            outcome = &mut call => outcome.result,
            () = neighbours => unreachable!(),
        }
    }

    fn chunk(content: &str, finish: Option<&str>) -> String {
        let finish = finish.map_or("null".to_owned(), |f| format!("\"{f}\""));
        format!(
            "data: {{\"choices\":[{{\"delta\":{{\"content\":\"{content}\"}},\"finish_reason\":{finish}}}]}}\n\n"
        )
    }

    fn leak(text: String) -> &'static str {
        Box::leak(text.into_boxed_str())
    }

    #[tokio::test]
    async fn a_stream_closed_without_a_finish_reason_is_not_an_answer() {
        // As llama-cpp-python's server ends a stream it interrupts.
        let parts = vec![
            (Duration::ZERO, leak(chunk("Den", None))),
            (Duration::ZERO, leak(chunk("ver", None))),
            (Duration::ZERO, "data: [DONE]\n\n"),
        ];
        let url = serve_once(SSE, parts).await;
        let err = complete(&url, true, Stalls::default()).await.unwrap_err();
        assert!(matches!(err, CallError::Unfinished), "{err}");
        assert_eq!(err.class(), ErrorClass::BadResponse);
        // A whole body without one is not either.
        let body = r#"{"choices":[{"message":{"content":"Den"},"finish_reason":null}]}"#;
        let url = serve_once(JSON, vec![(Duration::ZERO, body)]).await;
        let err = complete(&url, false, Stalls::default()).await.unwrap_err();
        assert!(matches!(err, CallError::Unfinished), "{err}");
    }

    #[tokio::test]
    async fn a_stream_that_never_said_done_is_truncated() {
        // The finish_reason came, then the connection closed cleanly before
        // the usage chunk and `[DONE]`.
        let parts = vec![
            (Duration::ZERO, leak(chunk("Denver", None))),
            (Duration::ZERO, leak(chunk("", Some("stop")))),
        ];
        let url = serve_once(SSE, parts).await;
        let err = complete(&url, true, Stalls::default()).await.unwrap_err();
        assert!(matches!(err, CallError::Unended), "{err}");
        assert_eq!(err.class(), ErrorClass::BadResponse);
        // The same stream with its end is an answer.
        let parts = vec![
            (Duration::ZERO, leak(chunk("Denver", None))),
            (Duration::ZERO, leak(chunk("", Some("stop")))),
            (Duration::ZERO, "data: [DONE]\n\n"),
        ];
        let url = serve_once(SSE, parts).await;
        let answer = complete(&url, true, Stalls::default()).await.unwrap();
        assert_eq!(answer.content, "Denver");
    }

    #[tokio::test]
    async fn a_stream_without_usage_counts_its_chunks_as_estimated_tokens() {
        let parts = vec![
            (Duration::ZERO, leak(chunk("The", None))),
            (Duration::ZERO, leak(chunk(" Denver", None))),
            (Duration::ZERO, leak(chunk(" Broncos", Some("stop")))),
            (Duration::ZERO, "data: [DONE]\n\n"),
        ];
        let url = serve_once(SSE, parts).await;
        let answer = complete(&url, true, Stalls::default()).await.unwrap();
        assert_eq!(answer.content, "The Denver Broncos");
        assert_eq!(answer.finish_reason.as_deref(), Some("stop"));
        assert_eq!(
            (answer.completion_tokens, answer.tokens_estimated),
            (Some(3), true)
        );
        // With usage, the count is the server's.
        let parts = vec![
            (
                Duration::ZERO,
                leak(chunk("The Denver Broncos", Some("stop"))),
            ),
            (
                Duration::ZERO,
                "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":4}}\n\n",
            ),
            (Duration::ZERO, "data: [DONE]\n\n"),
        ];
        let url = serve_once(SSE, parts).await;
        let answer = complete(&url, true, Stalls::default()).await.unwrap();
        assert_eq!(
            (answer.completion_tokens, answer.tokens_estimated),
            (Some(4), false)
        );
    }

    #[test]
    fn a_stall_is_told_by_what_is_normal_for_the_endpoint() {
        let idle = Duration::from_secs(30);
        let gaps = Gaps::default();
        // Until enough streams are known, the configured limit.
        for _ in 1..GAPS_KNOWN {
            gaps.record(Duration::from_millis(300));
        }
        assert_eq!(gaps.limit(idle), idle);
        gaps.record(Duration::from_millis(300));
        // Then eight times its longest recent gap...
        assert_eq!(gaps.limit(idle), Duration::from_millis(2400));
        // ...which fades when streams flow faster, down to a floor...
        for _ in 0..1000 {
            gaps.record(Duration::from_millis(5));
        }
        assert_eq!(gaps.limit(idle), GAP_FLOOR);
        // ...and never past the configured limit.
        gaps.record(Duration::from_secs(20));
        assert_eq!(gaps.limit(idle), idle);
    }

    #[tokio::test]
    async fn a_stream_that_goes_quiet_or_never_starts_is_given_up() {
        let short = SHORT_STALLS;
        // Quiet for 10 s after its first chunk.
        let parts = vec![
            (Duration::ZERO, leak(chunk("Den", None))),
            (Duration::from_secs(10), leak(chunk("ver", Some("stop")))),
        ];
        let url = serve_once(SSE, parts).await;
        let err = complete(&url, true, short).await.unwrap_err();
        assert!(matches!(err, CallError::Stalled(_)), "{err}");
        assert_eq!(err.class(), ErrorClass::Stalled);
        // Headers, then nothing for 10 s.
        let url = serve_once(SSE, vec![(Duration::from_secs(10), "data: [DONE]\n\n")]).await;
        let err = complete(&url, true, short).await.unwrap_err();
        assert!(matches!(err, CallError::FirstByteTimeout(_)), "{err}");
        assert_eq!(err.class(), ErrorClass::FirstByteTimeout);
        // A slow but steady stream is fine: each chunk within the idle limit.
        let parts = (0..4)
            .map(|_| (Duration::from_millis(100), leak(chunk("x", None))))
            .chain([
                (Duration::from_millis(100), leak(chunk("y", Some("stop")))),
                (Duration::ZERO, "data: [DONE]\n\n"),
            ])
            .collect();
        let url = serve_once(SSE, parts).await;
        assert_eq!(complete(&url, true, short).await.unwrap().content, "xxxxy");
    }

    #[tokio::test]
    async fn the_wait_for_the_first_token_after_a_role_chunk_is_no_stall() {
        // The role chunk comes at once, the first token later, under load;
        // meanwhile twenty others of the endpoint end. That is the time to
        // the first token, bounded by the first byte's limit: no stall.
        let patient = Stalls {
            first_byte: Duration::from_secs(30),
            idle: Duration::from_secs(30),
        };
        let role = "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n";
        let parts = vec![
            (Duration::ZERO, role),
            (
                GAP_FLOOR + Duration::from_millis(500),
                leak(chunk("Denver", Some("stop"))),
            ),
            (Duration::ZERO, "data: [DONE]\n\n"),
        ];
        let url = serve_once(SSE, parts).await;
        let answer = complete_while_neighbours_end(&url, patient).await;
        assert_eq!(answer.unwrap().content, "Denver");
    }

    #[tokio::test]
    async fn thinking_under_any_name_is_the_answer_under_way() {
        // A model that thinks for longer than the first byte's limit, in
        // `reasoning` (newer vLLM, Ollama): its tokens keep the call alive.
        let short = SHORT_STALLS;
        let thought =
            "data: {\"choices\":[{\"delta\":{\"reasoning\":\"hmm\"},\"finish_reason\":null}]}\n\n";
        let parts = (0..5)
            .map(|_| (Duration::from_millis(100), thought))
            .chain([
                (Duration::from_millis(100), leak(chunk("42", Some("stop")))),
                (Duration::ZERO, "data: [DONE]\n\n"),
            ])
            .collect();
        let url = serve_once(SSE, parts).await;
        assert_eq!(complete(&url, true, short).await.unwrap().content, "42");
    }

    #[tokio::test]
    async fn a_stream_quiet_while_its_neighbours_are_answered_in_full_has_stalled() {
        // No normal gap is known yet and the idle limit is long; but while
        // this stream sends nothing, twenty others of the endpoint end.
        let patient = Stalls {
            first_byte: Duration::from_secs(30),
            idle: Duration::from_secs(30),
        };
        let parts = vec![
            (Duration::ZERO, leak(chunk("Den", None))),
            (Duration::from_secs(10), leak(chunk("ver", Some("stop")))),
        ];
        let url = serve_once(SSE, parts).await;
        let err = complete_while_neighbours_end(&url, patient)
            .await
            .unwrap_err();
        assert!(matches!(err, CallError::Stalled(_)), "{err}");
    }
}
