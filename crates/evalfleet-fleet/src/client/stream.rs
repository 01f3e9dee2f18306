//! A streamed answer, read event by event: the answer and its usage, the
//! time to its first token and the gaps between its events, and how it
//! ended (whole, cut, quiet for too long, or with an error).

use std::time::Duration;

use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::Value;
use tokio::time::Instant;

use super::error::CallError;
use super::sse;
use super::stalls::{GAP_FLOOR, Gaps, PEERS_PASSED, Pulse, Stalls};
use super::{Completion, Usage};

/// Reads a stream to its end: the completion, and the longest gap between
/// its events.
pub(super) async fn read_stream(
    response: reqwest::Response,
    started: Instant,
    (ttft, first): (&mut Option<Duration>, &crate::limit::FirstToken),
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
                        first.came();
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
