//! A streamed answer, step by step: role, tokens, finish reason, usage and
//! `[DONE]`, with its stalls, cuts and interruptions.

use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, header};
use axum::response::Response;
use futures_util::stream;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::reply::{HoldStream, Reply, cut_off, sse};
use super::request::Kind;
use super::response::with_content_type;
use super::state::{Held, MockState};

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
pub(super) struct Streaming {
    pub(super) state: Arc<MockState>,
    pub(super) reply: Reply,
    pub(super) include_usage: bool,
    /// Cancelled when another request interrupts this stream.
    pub(super) interrupt: CancellationToken,
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

pub(super) fn stream_reply(streaming: Streaming, held: Held) -> Response {
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
