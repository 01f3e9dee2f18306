//! An answer's bodies: whole, as server-sent-event chunks, or cut off
//! half-way.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::response::Response;
use futures_util::{StreamExt, stream};
use serde_json::{Value, json};
use tokio::time::Instant;

use super::fate::Mishaps;
use super::request::Kind;
use super::response::with_content_type;
use super::state::{Held, MockState};

/// A tool call being answered: one per reply.
pub(super) struct ToolCall {
    pub(super) id: String,
    pub(super) name: String,
}

pub(super) struct Reply {
    pub(super) id: String,
    pub(super) model: String,
    pub(super) kind: Kind,
    /// The call this reply makes: its `tokens` are then the pieces of its
    /// arguments.
    pub(super) tool_call: Option<ToolCall>,
    pub(super) tokens: Vec<String>,
    pub(super) finish_reason: &'static str,
    pub(super) prompt_tokens: usize,
    pub(super) mishaps: Mishaps,
    pub(super) arrived: Instant,
}

impl Reply {
    pub(super) fn usage(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.tokens.len(),
            "total_tokens": self.prompt_tokens + self.tokens.len(),
        })
    }

    /// A chunk with `piece` of the answer (`None`: nothing new, as the
    /// first chunk of a chat answer and the last of any).
    pub(super) fn chunk(&self, piece: Option<&str>, finish_reason: Option<&str>) -> Bytes {
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

pub(super) fn sse(value: &Value) -> Bytes {
    let mut out = b"data: ".to_vec();
    // Serialising a `Value` cannot fail.
    serde_json::to_writer(&mut out, value).ok();
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

pub(super) fn whole_reply(state: &Arc<MockState>, reply: Reply, held: Held) -> Response {
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
pub(super) async fn cut_off() -> io::Result<Bytes> {
    tokio::time::sleep(CUT_DELAY).await;
    Err(io::Error::other("truncated by the mock"))
}

/// A body stream that keeps the request's slots until the body ends.
pub(super) struct HoldStream<S> {
    pub(super) inner: S,
    pub(super) _held: Held,
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
