//! `POST /v1/chat/completions` and `POST /v1/completions`: a request read,
//! its images checked, let past the quotas and queues, and answered whole or
//! streamed.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::answer::{Resolved, answer, pieces, resolve};
use super::fate::decide;
use super::images::{Checked, checked_images};
use super::reply::{Reply, ToolCall, whole_reply};
use super::request::{ChatRequest, CompletionRequest, Kind, message_text, tokens_in};
use super::response::error_response;
use super::state::{Admitted, Counted, Held, InFlight, MockState, arrive, pause};
use super::stream::{Streaming, stream_reply};
use crate::settings::{Answer, MockSettings};

pub(super) async fn chat(State(state): State<Arc<MockState>>, body: Bytes) -> Response {
    respond(state, body, Kind::Chat).await
}

pub(super) async fn completions(State(state): State<Arc<MockState>>, body: Bytes) -> Response {
    respond(state, body, Kind::Completion).await
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
