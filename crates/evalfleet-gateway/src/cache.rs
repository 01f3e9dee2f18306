//! The response cache at the gateway: a call's key, an answer kept, and a
//! kept answer given to the agent again (whole, or as a stream).

use std::sync::Arc;

use bytes::Bytes;
use evalfleet_types::{AgentCall, CacheEntry, now_ms};
use reqwest::header::HeaderValue;
use serde_json::{Map, Value};

use evalfleet_fleet::client::{Api, Head};

use super::{Answer, Gateway};

/// Looks a key up in the response cache.
pub type CacheGet = Arc<
    dyn Fn(String) -> futures_util::future::BoxFuture<'static, Option<CacheEntry>> + Send + Sync,
>;
/// Hands an answer to the response cache (with the session's writer).
pub type CachePut = Arc<dyn Fn(CacheEntry) + Send + Sync>;

/// How the gateway reaches the session's response cache (`cache.mode`).
pub struct CacheLink {
    pub get: Option<CacheGet>,
    pub put: Option<CachePut>,
}

impl Gateway {
    /// The cache key of call `index` of an attempt of sample `sample` of a
    /// row: its API, the models that may answer it, its place in the
    /// attempt (an agent that asks the same twice means to ask twice; the
    /// same agent run again asks the same things in the same order), the
    /// sample, and its body without the model's name. `None` where the cache is not used: it is off, or the API is
    /// neither chat completions nor embeddings.
    pub(crate) fn cache_key(
        &self,
        api: Api,
        sample: u32,
        index: u32,
        candidates: &[usize],
        body: &Map<String, Value>,
    ) -> Option<String> {
        self.cache.get()?;
        if !matches!(api, Api::ChatCompletions | Api::Embeddings) {
            return None;
        }
        let mut models: Vec<&str> = candidates
            .iter()
            .map(|i| self.endpoints[*i].model.as_str())
            .collect();
        models.sort_unstable();
        models.dedup();
        let identity = format!("gateway\n{}\n{}\n{index}", api.name(), models.join("\n"));
        let mut body = body.clone();
        body.remove("model");
        // Whether it is streamed changes nothing of the answer.
        body.remove("stream");
        body.remove("stream_options");
        let text = serde_json::value::to_raw_value(&body).ok()?;
        Some(evalfleet_config::cache::key(&identity, sample, &text))
    }
}

/// The longest answer the cache keeps (longer ones are made again).
const CACHED_AT_MOST: usize = 256 * 1024;

/// A call's answer as the cache keeps it: a whole response body (a chat
/// completion, put together from a stream's message; embeddings as they
/// came).
pub(crate) fn to_cache(key: String, api: Api, record: &AgentCall) -> Option<CacheEntry> {
    let response = record.response.as_deref()?;
    if response.len() >= CACHED_AT_MOST {
        return None;
    }
    let content = match api {
        Api::ChatCompletions => {
            let message: Value = serde_json::from_str(response).ok()?;
            serde_json::json!({
                "id": format!("chatcmpl-cached-{}", record.call_id),
                "object": "chat.completion",
                "created": record.sent_at_ms / 1000,
                "model": record.telemetry.model,
                "choices": [{"index": 0, "message": message, "finish_reason": record.telemetry.finish_reason}],
                "usage": {
                    "prompt_tokens": record.telemetry.prompt_tokens,
                    "completion_tokens": record.telemetry.completion_tokens,
                    "total_tokens": record.telemetry.prompt_tokens.unwrap_or(0) + record.telemetry.completion_tokens.unwrap_or(0),
                },
            })
            .to_string()
        }
        Api::Embeddings => response.to_owned(),
        Api::Completions | Api::Responses => return None,
    };
    Some(CacheEntry {
        key,
        content,
        endpoint: record.telemetry.endpoint.clone(),
        model: record.telemetry.model.clone(),
        prompt_tokens: record.telemetry.prompt_tokens,
        completion_tokens: record
            .telemetry
            .completion_tokens
            .filter(|_| !record.telemetry.tokens_estimated),
        finish_reason: record.telemetry.finish_reason.clone(),
        latency_ms: record.telemetry.latency_ms,
        created_at_ms: now_ms(),
    })
}

/// The assistant's message of a cached chat completion (what a call's
/// record keeps), or the body.
pub(crate) fn message_of(content: &str) -> Option<String> {
    let value: Value = serde_json::from_str(content).ok()?;
    Some(match value.pointer("/choices/0/message") {
        Some(message) => message.to_string(),
        None => content.to_owned(),
    })
}

/// What the agent gets from a cached answer: the body, or a stream made
/// of it (the whole message in one chunk, then its finish and usage).
pub(crate) fn from_cache(hit: &CacheEntry, stream: bool) -> Option<Answer> {
    let json = Some(HeaderValue::from_static("application/json"));
    if !stream {
        return Some(Answer::Head(Head::Whole {
            status: 200,
            content_type: json,
            body: Bytes::from(hit.content.clone()),
        }));
    }
    let value: Value = serde_json::from_str(&hit.content).ok()?;
    let mut message = value.pointer("/choices/0/message")?.clone();
    if let Some(calls) = message.get_mut("tool_calls").and_then(Value::as_array_mut) {
        for (i, call) in calls.iter_mut().enumerate() {
            call["index"] = Value::from(i);
        }
    }
    let base = serde_json::json!({
        "id": value.get("id"), "object": "chat.completion.chunk",
        "created": value.get("created"), "model": value.get("model"),
    });
    let chunk = |choices: Value, usage: Option<&Value>| {
        let mut chunk = base.clone();
        chunk["choices"] = choices;
        if let Some(usage) = usage {
            chunk["usage"] = usage.clone();
        }
        format!("data: {chunk}\n\n")
    };
    let mut text = chunk(
        serde_json::json!([{"index": 0, "delta": message, "finish_reason": null}]),
        None,
    );
    text.push_str(&chunk(
        serde_json::json!([{"index": 0, "delta": {}, "finish_reason": value.pointer("/choices/0/finish_reason")}]),
        None,
    ));
    text.push_str(&chunk(serde_json::json!([]), value.get("usage")));
    text.push_str("data: [DONE]\n\n");
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let _ = tx.try_send(Bytes::from(text));
    Some(Answer::Head(Head::Stream {
        status: 200,
        content_type: Some(HeaderValue::from_static("text/event-stream")),
        chunks: rx,
        complete: Arc::new(std::sync::atomic::AtomicBool::new(true)),
    }))
}
