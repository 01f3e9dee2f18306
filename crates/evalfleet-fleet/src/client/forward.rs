//! Requests an agent sent through the gateway, forwarded to an endpoint as
//! they came (the gateway has put the endpoint's model in them): the
//! answer goes back to the agent as it arrives, a stream chunk by chunk,
//! while what the fleet learns of any call (time to first token, tokens,
//! how it ended) is read on the way.
//!
//! The agent gets nothing before the endpoint's first byte, so that a call
//! that fails before it can be made again elsewhere ([`Head::Failed`]).

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures_util::StreamExt;
use reqwest::header::{CONTENT_TYPE, HeaderValue};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::error::{CallError, ERROR_BODY_LIMIT, body_error, error_message, request_error};
use super::headers::{Quota, quota_headers, retry_after};
#[cfg(test)]
use super::sse::LINE_LIMIT;
use super::{CallOutcome, ChatClient, Completion, Timing, sse};

/// The APIs the gateway forwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    ChatCompletions,
    Completions,
    Responses,
    Embeddings,
}

impl Api {
    /// Every API, in the order of [`Api::index`].
    pub(super) const ALL: [Api; 4] = [
        Self::ChatCompletions,
        Self::Completions,
        Self::Responses,
        Self::Embeddings,
    ];

    /// Its place in [`Api::ALL`].
    pub(super) fn index(self) -> usize {
        self as usize
    }

    /// Its path under the base URL.
    pub fn path(self) -> &'static str {
        match self {
            Self::ChatCompletions => "chat/completions",
            Self::Completions => "completions",
            Self::Responses => "responses",
            Self::Embeddings => "embeddings",
        }
    }

    /// Its name in records: `chat.completions`, ...
    pub fn name(self) -> &'static str {
        match self {
            Self::ChatCompletions => "chat.completions",
            Self::Completions => "completions",
            Self::Responses => "responses",
            Self::Embeddings => "embeddings",
        }
    }

    /// Whether its streams end with `data: [DONE]`.
    fn ends_with_done(self) -> bool {
        matches!(self, Self::ChatCompletions | Self::Completions)
    }
}

/// What the agent gets first.
#[derive(Debug)]
pub enum Head {
    /// The whole answer.
    Whole {
        status: u16,
        content_type: Option<HeaderValue>,
        body: Bytes,
    },
    /// A stream: its chunks as they come (the first is there already).
    Stream {
        status: u16,
        content_type: Option<HeaderValue>,
        chunks: mpsc::Receiver<Bytes>,
        /// Set once the stream has ended whole: a channel closed before
        /// is a stream cut short, which the agent must see as such.
        complete: std::sync::Arc<std::sync::atomic::AtomicBool>,
    },
    /// Nothing was sent to the agent: the call failed before the first
    /// byte of an answer (the outcome says how); `status` and `body` are
    /// the endpoint's error response, when it gave one.
    Failed {
        status: Option<u16>,
        content_type: Option<HeaderValue>,
        body: Bytes,
    },
}

/// What a forwarded call came to.
pub struct Forwarded {
    pub outcome: CallOutcome,
    /// What is kept of the answer: a chat completion's message (content
    /// and tool calls, assembled from a stream), or the body (cut to
    /// [`evalfleet_types::BODY_KEPT`]).
    pub response: Option<String>,
    /// The agent got this answer (whole, or as a stream begun): nothing
    /// of the call may be made again.
    pub delivered: bool,
}

impl ChatClient {
    /// Sends `body` (JSON) to `api`, streamed or not; the agent's part goes
    /// to `head` as soon as it is known (a stream's chunks follow on its
    /// channel).
    /// `delivered` is set as the agent is handed the answer: it stays
    /// set if this future is dropped (a timeout) after that.
    pub async fn forward(
        &self,
        api: Api,
        body: Bytes,
        stream: bool,
        head: oneshot::Sender<Head>,
        delivered: &std::sync::atomic::AtomicBool,
    ) -> Forwarded {
        let sent_at = SystemTime::now();
        let started = Instant::now();
        let mut reading = Reading::new(api, started);
        let mut quota = None;
        let mut head = Some(head);
        let result = self
            .forward_inner(body, stream, &mut head, &mut reading, &mut quota, delivered)
            .await
            .map_err(|err| self.told(err));
        if let (Err(_), Some(head)) = (&result, head.take()) {
            // Failed before any byte reached the agent (no response, or one
            // cut before its first chunk).
            let _ = head.send(Head::Failed {
                status: None,
                content_type: None,
                body: Bytes::new(),
            });
        }
        Forwarded {
            outcome: CallOutcome {
                result,
                timing: Timing {
                    sent_at,
                    ttft: reading.ttft,
                    latency: started.elapsed(),
                },
                quota,
            },
            response: reading.kept(),
            delivered: reading.delivered,
        }
    }

    /// [`ChatClient::forward`], for `reading`'s API.
    async fn forward_inner(
        &self,
        body: Bytes,
        stream: bool,
        head: &mut Option<oneshot::Sender<Head>>,
        reading: &mut Reading,
        quota: &mut Option<Quota>,
        delivered: &std::sync::atomic::AtomicBool,
    ) -> Result<Completion, CallError> {
        use std::sync::atomic::Ordering;
        let request = self.send(Some(&body), self.api_url(reading.api));
        let first_byte_by = reading.started + self.stalls.first_byte;
        let response = tokio::time::timeout_at(first_byte_by, request)
            .await
            .map_err(|_| CallError::FirstByteTimeout(self.stalls.first_byte))?
            .map_err(request_error)?;
        *quota = quota_headers(response.headers());
        let status = response.status();
        let content_type = response.headers().get(CONTENT_TYPE).cloned();
        if !status.is_server_error() {
            self.pulse.beat();
        }
        if !status.is_success() {
            let retry_after = retry_after(response.headers());
            let mut bytes = Vec::new();
            let mut chunks = response.bytes_stream();
            while let Some(Ok(chunk)) = chunks.next().await {
                bytes.extend_from_slice(&chunk);
                if bytes.len() >= ERROR_BODY_LIMIT {
                    bytes.truncate(ERROR_BODY_LIMIT);
                    break;
                }
            }
            let message = evalfleet_io::images::redact(&error_message(&bytes));
            if let Some(head) = head.take() {
                let _ = head.send(Head::Failed {
                    status: Some(status.as_u16()),
                    content_type,
                    body: Bytes::from(bytes),
                });
            }
            return Err(CallError::Status {
                status: status.as_u16(),
                message,
                retry_after,
            });
        }
        let status = status.as_u16();
        if !stream {
            let bytes = response.bytes().await.map_err(body_error)?;
            self.pulse.beat();
            reading.whole(&bytes);
            if let Some(head) = head.take() {
                reading.delivered = true;
                delivered.store(true, Ordering::Release);
                let _ = head.send(Head::Whole {
                    status,
                    content_type,
                    body: bytes,
                });
            }
            return reading.completion(status, true);
        }
        let mut chunks = response.bytes_stream();
        let first = tokio::time::timeout_at(first_byte_by, chunks.next())
            .await
            .map_err(|_| CallError::FirstByteTimeout(self.stalls.first_byte))?;
        let first = match first {
            Some(Ok(chunk)) => chunk,
            Some(Err(_)) | None => return Err(CallError::Truncated),
        };
        self.pulse.beat();
        let (tx, rx) = mpsc::channel(64);
        let complete = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        if let Some(head) = head.take() {
            reading.delivered = true;
            delivered.store(true, Ordering::Release);
            let _ = head.send(Head::Stream {
                status,
                content_type,
                chunks: rx,
                complete: complete.clone(),
            });
        }
        reading.feed(&first);
        // The agent may stop reading (it went away): the stream is read to
        // its end all the same, for its usage.
        let mut agent = Some(tx);
        send_or_drop(&mut agent, first).await;
        loop {
            let next = tokio::time::timeout(self.stalls.idle, chunks.next())
                .await
                .map_err(|_| CallError::Stalled(self.stalls.idle))?;
            let chunk = match next {
                Some(Ok(chunk)) => chunk,
                Some(Err(_)) => return Err(CallError::Truncated),
                None => break,
            };
            self.pulse.beat();
            reading.feed(&chunk);
            send_or_drop(&mut agent, chunk).await;
        }
        let completion = reading.completion(status, false);
        // The agent's stream ends whole only when ours did; otherwise its
        // connection is cut, as the endpoint's was.
        if completion.is_ok() || matches!(completion, Err(CallError::Unfinished)) {
            complete.store(true, Ordering::Release);
        }
        completion
    }
}

/// Sends `chunk` to the agent, waiting while it reads; forgets the agent
/// once it went away.
async fn send_or_drop(agent: &mut Option<mpsc::Sender<Bytes>>, chunk: Bytes) {
    if let Some(tx) = agent.as_ref()
        && tx.send(chunk).await.is_err()
    {
        *agent = None;
    }
}

/// What is read of an answer on its way to the agent.
struct Reading {
    api: Api,
    started: Instant,
    ttft: Option<Duration>,
    /// What of a stream makes no whole event yet.
    pending: sse::Decoder,
    done: bool,
    /// A whole answer's body, kept (cut) for the record.
    body: Option<String>,
    content: String,
    tool_calls: Vec<Value>,
    finish_reason: Option<String>,
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    /// Chunks that carried something of the answer (its tokens when the
    /// stream says nothing of its usage).
    pieces: u64,
    bad: Option<String>,
    delivered: bool,
}

impl Reading {
    fn new(api: Api, started: Instant) -> Self {
        Self {
            api,
            started,
            ttft: None,
            pending: sse::Decoder::default(),
            done: false,
            body: None,
            content: String::new(),
            tool_calls: Vec::new(),
            finish_reason: None,
            prompt_tokens: None,
            completion_tokens: None,
            pieces: 0,
            bad: None,
            delivered: false,
        }
    }

    /// A whole (not streamed) answer.
    fn whole(&mut self, bytes: &[u8]) {
        self.ttft = Some(self.started.elapsed());
        self.done = true;
        let value: Value = match serde_json::from_slice(bytes) {
            Ok(value) => value,
            Err(err) => {
                self.bad = Some(format!("not JSON: {err}"));
                self.body = Some(cut_body(&String::from_utf8_lossy(bytes)));
                return;
            }
        };
        self.usage(&value);
        match self.api {
            Api::ChatCompletions => {
                let choice = value.pointer("/choices/0");
                self.finish_reason = choice
                    .and_then(|c| c.get("finish_reason"))
                    .and_then(Value::as_str)
                    .map(str::to_owned);
                if let Some(message) = choice.and_then(|c| c.get("message")) {
                    self.content = message
                        .get("content")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_owned();
                    self.body = Some(cut_body(&message.to_string()));
                    return;
                }
            }
            Api::Completions => {
                let choice = value.pointer("/choices/0");
                self.finish_reason = choice
                    .and_then(|c| c.get("finish_reason"))
                    .and_then(Value::as_str)
                    .map(str::to_owned);
                self.content = choice
                    .and_then(|c| c.get("text"))
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned();
            }
            Api::Responses => {
                self.finish_reason = value
                    .get("status")
                    .and_then(Value::as_str)
                    .map(str::to_owned);
                self.content = value
                    .get("output_text")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned();
            }
            Api::Embeddings => self.finish_reason = Some("stop".to_owned()),
        }
        self.body = Some(cut_body(&String::from_utf8_lossy(bytes)));
    }

    /// The usage an answer (or a chunk) reports.
    fn usage(&mut self, value: &Value) {
        let usage = value
            .get("usage")
            .or_else(|| value.pointer("/response/usage"))
            .filter(|u| u.is_object());
        let Some(usage) = usage else {
            return;
        };
        let number = |keys: &[&str]| keys.iter().find_map(|k| usage.get(*k)?.as_u64());
        if let Some(prompt) = number(&["prompt_tokens", "input_tokens"]) {
            self.prompt_tokens = Some(prompt);
        }
        if let Some(completion) = number(&["completion_tokens", "output_tokens"]) {
            self.completion_tokens = Some(completion);
        } else if self.api == Api::Embeddings {
            self.completion_tokens = Some(0);
        }
    }

    /// Bytes of a stream.
    fn feed(&mut self, bytes: &[u8]) {
        if self.bad.is_some() {
            // Past what makes the answer bad (a line too long, an event
            // not JSON, an error), the stream is passed on unread.
            return;
        }
        self.pending.push(bytes);
        while let Some(event) = self.pending.next() {
            match event {
                Ok(data) => self.event(data.trim()),
                Err(err) => {
                    self.bad = Some(err.to_string());
                    return;
                }
            }
        }
    }

    /// The data of one event of a stream.
    fn event(&mut self, data: &str) {
        if data == "[DONE]" {
            self.done = true;
            return;
        }
        if data.is_empty() {
            return;
        }
        let Ok(value) = serde_json::from_str::<Value>(data) else {
            self.bad = Some("an event of the stream is not JSON".to_owned());
            return;
        };
        if let Some(error) = value.get("error").filter(|e| !e.is_null()) {
            let message = error
                .get("message")
                .and_then(Value::as_str)
                .map_or_else(|| error.to_string(), str::to_owned);
            self.bad = Some(format!("error in stream: {message}"));
        }
        self.usage(&value);
        if self.api == Api::Responses {
            match value.get("type").and_then(Value::as_str) {
                Some("response.output_text.delta") => {
                    if let Some(delta) = value.get("delta").and_then(Value::as_str) {
                        self.piece();
                        self.content.push_str(delta);
                    }
                }
                Some("response.function_call_arguments.delta") => self.piece(),
                Some("response.completed" | "response.incomplete" | "response.failed") => {
                    self.done = true;
                    self.finish_reason = value
                        .pointer("/response/status")
                        .and_then(Value::as_str)
                        .map(str::to_owned);
                }
                _ => {}
            }
            return;
        }
        let Some(choices) = value.get("choices").and_then(Value::as_array) else {
            return;
        };
        for choice in choices {
            if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
                self.finish_reason = Some(reason.to_owned());
            }
            if self.api == Api::Completions {
                if let Some(text) = choice.get("text").and_then(Value::as_str)
                    && !text.is_empty()
                {
                    self.piece();
                    self.content.push_str(text);
                }
                continue;
            }
            let Some(delta) = choice.get("delta") else {
                continue;
            };
            let text = |key: &str| delta.get(key).and_then(Value::as_str).unwrap_or_default();
            let content = text("content");
            let thinking = !text("reasoning_content").is_empty() || !text("reasoning").is_empty();
            let calls = delta.get("tool_calls").and_then(Value::as_array);
            if !content.is_empty() || thinking || calls.is_some() {
                self.piece();
            }
            self.content.push_str(content);
            for call in calls.into_iter().flatten() {
                self.tool_call(call);
            }
        }
    }

    /// A chunk with something of the answer: the first sets the time to
    /// the first token.
    fn piece(&mut self) {
        self.pieces += 1;
        if self.ttft.is_none() {
            self.ttft = Some(self.started.elapsed());
        }
    }

    /// Merges a streamed piece of a tool call into the calls so far.
    fn tool_call(&mut self, piece: &Value) {
        let index = piece
            .get("index")
            .and_then(Value::as_u64)
            .unwrap_or(self.tool_calls.len().saturating_sub(1) as u64) as usize;
        if index > 1024 {
            return;
        }
        while self.tool_calls.len() <= index {
            self.tool_calls.push(serde_json::json!({
                "id": "", "type": "function", "function": {"name": "", "arguments": ""}
            }));
        }
        let call = &mut self.tool_calls[index];
        for key in ["id", "type"] {
            if let Some(value) = piece.get(key).and_then(Value::as_str) {
                call[key] = Value::String(value.to_owned());
            }
        }
        if let Some(function) = piece.get("function") {
            for key in ["name", "arguments"] {
                if let Some(more) = function.get(key).and_then(Value::as_str) {
                    let mut so_far = call["function"][key]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned();
                    so_far.push_str(more);
                    call["function"][key] = Value::String(so_far);
                }
            }
        }
    }

    /// What the answer came to, as the fleet judges calls.
    fn completion(&self, status: u16, whole: bool) -> Result<Completion, CallError> {
        if let Some(bad) = &self.bad {
            return Err(CallError::BadResponse(bad.clone()));
        }
        if !whole && !self.done && (self.api.ends_with_done() || self.api == Api::Responses) {
            return Err(if self.finish_reason.is_some() {
                CallError::Unended
            } else {
                CallError::Truncated
            });
        }
        if self.finish_reason.is_none() && self.api != Api::Embeddings {
            return Err(CallError::Unfinished);
        }
        let counted = self.completion_tokens;
        Ok(Completion {
            content: self.content.clone(),
            finish_reason: self.finish_reason.clone(),
            prompt_tokens: self.prompt_tokens,
            completion_tokens: counted.or((!whole).then_some(self.pieces)),
            tokens_estimated: counted.is_none() && !whole,
            http_status: status,
        })
    }

    /// What the record keeps of the answer.
    fn kept(&self) -> Option<String> {
        if self.body.is_some() {
            return self.body.clone();
        }
        if self.content.is_empty() && self.tool_calls.is_empty() {
            return None;
        }
        let mut message = serde_json::json!({"role": "assistant", "content": self.content});
        if self.api == Api::ChatCompletions && !self.tool_calls.is_empty() {
            message["tool_calls"] = Value::Array(self.tool_calls.clone());
        }
        Some(cut_body(&message.to_string()))
    }
}

/// `text`, cut to what a record keeps.
pub fn cut_body(text: &str) -> String {
    if text.len() <= evalfleet_types::BODY_KEPT {
        return text.to_owned();
    }
    let mut end = evalfleet_types::BODY_KEPT;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_api_has_its_own_place() {
        for (at, api) in Api::ALL.iter().enumerate() {
            assert_eq!(api.index(), at, "{api:?}");
        }
    }

    #[test]
    fn a_streamed_tool_call_is_assembled_from_its_pieces() {
        let mut reading = Reading::new(Api::ChatCompletions, Instant::now());
        let events = [
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"lookup","arguments":""}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"q\":"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\"x\"}"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":7}}"#,
        ];
        let mut stream = String::new();
        for event in events {
            stream.push_str(&format!("data: {event}\r\n\r\n"));
        }
        stream.push_str("data: [DONE]\n\n");
        // Split anywhere: chunks do not follow lines.
        for piece in stream.as_bytes().chunks(7) {
            reading.feed(piece);
        }
        let completion = reading.completion(200, false).unwrap();
        assert_eq!(completion.finish_reason.as_deref(), Some("tool_calls"));
        assert_eq!(completion.prompt_tokens, Some(12));
        assert_eq!(completion.completion_tokens, Some(7));
        let kept: Value = serde_json::from_str(&reading.kept().unwrap()).unwrap();
        assert_eq!(kept["tool_calls"][0]["id"], "call_1");
        assert_eq!(kept["tool_calls"][0]["function"]["name"], "lookup");
        assert_eq!(
            kept["tool_calls"][0]["function"]["arguments"],
            "{\"q\":\"x\"}"
        );
    }

    #[test]
    fn a_stream_line_without_end_is_not_held_past_its_limit() {
        let mut reading = Reading::new(Api::ChatCompletions, Instant::now());
        let chunk = vec![b'x'; 1 << 20];
        for _ in 0..6 {
            reading.feed(&chunk);
        }
        assert!(reading.pending.capacity() <= LINE_LIMIT + (1 << 20));
        assert!(reading.pending.is_empty());
        assert!(matches!(
            reading.completion(200, false),
            Err(CallError::BadResponse(_))
        ));
    }

    #[test]
    fn an_event_of_several_data_lines_is_read_whole_as_an_sdk_reads_it() {
        let mut reading = Reading::new(Api::ChatCompletions, Instant::now());
        reading.feed(b": keep-alive\n\ndata: {\"choices\":[{\"delta\":\r\n");
        reading.feed(b"data: {\"content\":\"hi\"},\"finish_reason\":\"stop\"}]}\r\n\r\n");
        reading.feed(b"data: [DONE]\n\n");
        let completion = reading.completion(200, false).unwrap();
        assert_eq!(completion.content, "hi");
        assert_eq!(completion.finish_reason.as_deref(), Some("stop"));
    }

    #[test]
    fn a_stream_cut_before_done_is_truncated() {
        let mut reading = Reading::new(Api::ChatCompletions, Instant::now());
        reading.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n");
        assert!(matches!(
            reading.completion(200, false),
            Err(CallError::Truncated)
        ));
    }
}
