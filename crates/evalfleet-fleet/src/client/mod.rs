//! The OpenAI chat completions client: non-streaming and streaming (SSE with
//! `stream_options.include_usage`), per-attempt telemetry, and errors that
//! say their class so that retry logic never parses messages.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use reqwest::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use tokio::time::Instant;

use evalfleet_config::EndpointConfig;
use evalfleet_io::images::Images;

use crate::limit::FirstToken;

mod error;
mod forward;
mod headers;
mod http;
mod sse;
mod stalls;
mod stream;
mod tls;
mod whole;

pub use error::{CallError, Unanswered};
pub(crate) use error::{HTML_HINT, is_html};
pub use forward::{Api, Forwarded, Head, cut_body};
pub use headers::{Quota, parse_reset, quota_headers, retry_after};
pub use http::{POOL_IDLE, http_client};
pub use stalls::{Gaps, Pulse, Stalls};

use error::{body_error, request_error, status_error};
use http::{Target, Transport};
use stream::read_stream;
use whole::parse_completion;

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
    http: Transport,
    /// Keeps them for less, once the server said it does
    /// (`Keep-Alive: timeout=N`); then used instead of `http`.
    http_short: std::sync::Arc<std::sync::OnceLock<Transport>>,
    /// Keeps none: a request sent again after its connection was closed
    /// under it goes on a new one.
    http_fresh: Transport,
    /// Sent with every request; what the clients are made with, to make
    /// `http_short`.
    headers: HeaderMap,
    pool_size: usize,
    models_url: Target,
    /// Where each API's requests go, by [`Api::index`] (chat completions
    /// for the task's calls; all of them for the gateway's).
    api_urls: std::sync::Arc<[Target]>,
    /// `{"model":"NAME","messages":` — the body up to the messages.
    body_head: Bytes,
    /// `,"param":value,...,"stream":...}` — the body after the messages.
    body_tail: Bytes,
    stream: bool,
    stalls: Stalls,
    gaps: std::sync::Arc<Gaps>,
    pulse: std::sync::Arc<Pulse>,
    /// Errors are told without what the endpoint wrote
    /// (`EndpointConfig::quiet_errors`).
    quiet: bool,
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
        headers.insert(ACCEPT, HeaderValue::from_static("*/*"));
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
        let base = base_url.trim_end_matches('/');
        let api_urls = Api::ALL
            .iter()
            .map(|api| Target::parse(&format!("{base}/{}", api.path())))
            .collect::<Result<std::sync::Arc<[Target]>, String>>()?;
        let completions_url = &api_urls[Api::ChatCompletions.index()];
        let build = |pool_size, idle| {
            Transport::new(&completions_url.url, pool_size, idle, &headers)
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
        Ok(Self {
            http,
            http_short: std::sync::Arc::default(),
            http_fresh,
            headers,
            pool_size,
            models_url: Target::parse(&format!("{base}/models"))?,
            api_urls,
            body_head: Bytes::from(head),
            body_tail: Bytes::from(tail),
            stream,
            stalls: Stalls::default(),
            gaps: std::sync::Arc::default(),
            pulse: std::sync::Arc::default(),
            quiet: endpoint.quiet_errors,
        })
    }

    /// Where chat completions are asked for.
    fn completions_url(&self) -> &Target {
        self.api_url(Api::ChatCompletions)
    }

    /// Where `api`'s requests go.
    fn api_url(&self, api: Api) -> &Target {
        &self.api_urls[api.index()]
    }

    /// When the endpoint last showed it works (see [`Pulse`]).
    pub fn pulse(&self) -> &Pulse {
        &self.pulse
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
        self.complete_watched(messages, images, &FirstToken::none())
            .await
    }

    /// [`ChatClient::complete_with`], telling `first` when a stream's
    /// first token comes.
    pub async fn complete_watched(
        &self,
        messages: &RawValue,
        images: &Images,
        first: &FirstToken,
    ) -> CallOutcome {
        let sent_at = SystemTime::now();
        let started = Instant::now();
        let mut ttft = None;
        let mut quota = None;
        let result = self
            .call(messages, images, started, (&mut ttft, first), &mut quota)
            .await
            .map_err(|err| self.told(err));
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
        (ttft, first): (&mut Option<Duration>, &FirstToken),
        quota: &mut Option<Quota>,
    ) -> Result<Completion, CallError> {
        let body = Bytes::from(self.body(messages, images));
        let request = self.send(Some(&body), self.completions_url());
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
        if error::is_html(response.headers()) {
            return Err(CallError::BadResponse(error::HTML_HINT.to_owned()));
        }
        if self.stream {
            let idle = self.gaps.limit(self.stalls.idle);
            let (completion, longest) = read_stream(
                response,
                started,
                (ttft, first),
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

    /// `err` as this client tells it: without what the endpoint wrote, when
    /// its replies are not the reader's to see.
    pub(crate) fn told(&self, err: CallError) -> CallError {
        if self.quiet { err.quieted() } else { err }
    }

    /// `GET /models`: the model ids the endpoint serves.
    pub async fn models(&self) -> Result<Vec<String>, CallError> {
        self.list_models().await.map_err(|err| self.told(err))
    }

    async fn list_models(&self) -> Result<Vec<String>, CallError> {
        let response = self
            .send(None, &self.models_url)
            .await
            .map_err(request_error)?;
        if !response.status().is_success() {
            return Err(status_error(response).await);
        }
        if error::is_html(response.headers()) {
            return Err(CallError::BadResponse(error::HTML_HINT.to_owned()));
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

#[derive(Deserialize)]
struct Usage {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
}

#[cfg(test)]
mod tests;
