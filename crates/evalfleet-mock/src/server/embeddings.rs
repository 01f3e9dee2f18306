//! `POST /v1/embeddings`: a vector per input, drawn from a hash of it.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::time::Instant;

use super::fate::decide;
use super::response::{error_response, json_response};
use super::state::{InFlight, MockState, arrive, pause};

/// Dimensions of an embedding whose request gives no `dimensions`.
const EMBEDDING_DIMENSIONS: usize = 64;
/// The most `dimensions` a request may ask for.
const MAX_EMBEDDING_DIMENSIONS: usize = 8192;

#[derive(Deserialize)]
struct EmbeddingRequest {
    input: Value,
    #[serde(default)]
    dimensions: Option<usize>,
    #[serde(default)]
    encoding_format: Option<String>,
}

/// The inputs of an embedding request: each one's key (its text, or its
/// tokens as JSON) and its tokens' count.
fn embedding_inputs(input: &Value) -> Result<Vec<(String, usize)>, String> {
    let tokens = |value: &Value| -> Option<(String, usize)> {
        let ids = value.as_array()?;
        ids.iter()
            .all(Value::is_u64)
            .then(|| (value.to_string(), ids.len()))
    };
    let one = |value: &Value| match value {
        Value::String(text) => Some((text.clone(), text.split_whitespace().count())),
        other => tokens(other),
    };
    let inputs = match input {
        Value::String(_) => one(input).into_iter().collect(),
        Value::Array(items) if items.is_empty() => Vec::new(),
        Value::Array(items) if items.iter().all(Value::is_u64) => tokens(input).into_iter().collect(),
        Value::Array(items) => items.iter().map(one).collect::<Option<Vec<_>>>().ok_or(
            "invalid embedding request: input is a string, a list of strings, a list of token ids, or a list of such lists",
        )?,
        _ => Vec::new(),
    };
    if inputs.is_empty() {
        return Err(
            "invalid embedding request: input is a string, a list of strings, a list of token ids, or a list of such lists, not empty"
                .to_owned(),
        );
    }
    Ok(inputs)
}

/// A unit vector of `dimensions` drawn from a hash of `key` (and the seed):
/// the same input gets the same vector, always.
fn embedding(key: &str, dimensions: usize, seed: u64) -> Vec<f32> {
    let mut hasher = DefaultHasher::new();
    (seed, "embedding", key).hash(&mut hasher);
    let mut rng = fastrand::Rng::with_seed(hasher.finish());
    let mut vector: Vec<f32> = (0..dimensions).map(|_| rng.f32() * 2.0 - 1.0).collect();
    let norm = vector.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        for x in &mut vector {
            *x /= norm;
        }
    }
    vector
}

/// `POST /v1/embeddings`: a vector per input, after the latency, faults,
/// errors and hangs chat requests get (not the quotas and queues).
pub(super) async fn embeddings(State(state): State<Arc<MockState>>, body: Bytes) -> Response {
    use base64::Engine as _;
    let arrived = Instant::now();
    if let Some(refused) = arrive(&state, arrived) {
        return refused;
    }
    let _in_flight = InFlight::enter(&state);
    let bad = |problem: &str| {
        state.stats.bad_requests.fetch_add(1, Ordering::Relaxed);
        error_response(StatusCode::BAD_REQUEST, problem)
    };
    let request: EmbeddingRequest = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(err) => return bad(&format!("invalid embedding request: {err}")),
    };
    let inputs = match embedding_inputs(&request.input) {
        Ok(inputs) => inputs,
        Err(problem) => return bad(&problem),
    };
    let dimensions = request.dimensions.unwrap_or(EMBEDDING_DIMENSIONS);
    if !(1..=MAX_EMBEDDING_DIMENSIONS).contains(&dimensions) {
        return bad(&format!(
            "invalid embedding request: dimensions must be from 1 to {MAX_EMBEDDING_DIMENSIONS}, got {dimensions}"
        ));
    }
    let base64 = match request.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return bad(&format!(
                "invalid embedding request: encoding_format is float or base64, got '{other}'"
            ));
        }
    };
    let mut hasher = DefaultHasher::new();
    inputs.hash(&mut hasher);
    if let Err(response) = decide(&state, hasher.finish()).await {
        return response;
    }
    if !pause(&state, state.settings.latency).await {
        return error_response(StatusCode::SERVICE_UNAVAILABLE, "mock shutting down");
    }
    let seed = state.settings.seed;
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(index, (key, _))| {
            let vector = embedding(key, dimensions, seed);
            let embedding = if base64 {
                let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(vector)
            };
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    let prompt_tokens: usize = inputs.iter().map(|(_, tokens)| tokens).sum();
    state.stats.completed(arrived);
    json_response(
        StatusCode::OK,
        &json!({
            "object": "list",
            "data": data,
            "model": state.settings.model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }),
    )
}
