//! The routes that tell of the mock rather than answer a prompt: its model,
//! health and counters, and its load as llama.cpp, vLLM and SGLang tell
//! theirs.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::time::Instant;

use super::response::{error_response, json_response};
use super::state::MockState;

pub(super) async fn models(State(state): State<Arc<MockState>>) -> Response {
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

pub(super) async fn health(State(state): State<Arc<MockState>>) -> Response {
    state.stats.health_checks.fetch_add(1, Ordering::Relaxed);
    match state.outage_now(Instant::now()) {
        Some(status) => error_response(status, "mock outage"),
        None => "ok".into_response(),
    }
}

pub(super) async fn stats_handler(State(state): State<Arc<MockState>>) -> Response {
    json_response(StatusCode::OK, &state.stats.snapshot())
}

/// llama.cpp's `GET /props`: its slots are the mock's `capacity` (none
/// without one: every request is served at once).
pub(super) async fn props(State(state): State<Arc<MockState>>) -> Response {
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
pub(super) async fn slots(State(state): State<Arc<MockState>>) -> Response {
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
pub(super) async fn metrics(State(state): State<Arc<MockState>>) -> Response {
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
