//! The environment server (`evalfleet env`): a conversation run's decisions
//! taken by a trainer over HTTP, Gymnasium-style. JSON in and out:
//!
//! - `POST /v1/reset` (optionally `{"wait_s": S}`) → `{env_id, observation,
//!   info}`: an episode at its first decision (410 once none is left to
//!   hand out, 504 when none came to a decision within the wait);
//! - `POST /v1/step` with `{env_id, action}` (1 validate, 2 bridge, 3 plan,
//!   4 no_intervention; `"invalid"` or null: the trainer's model gave
//!   nothing readable) → `{observation, reward, terminated, truncated,
//!   info}`: the episode's next decision, or its end (`observation` null);
//! - `POST /v1/close` with `{env_id}`: the trainer gives the episode up;
//! - `GET /v1/spec`: the actions, the run and live counts.
//!
//! With an API key (`EVALFLEET_API_KEY`, which any address but a loopback
//! one needs), every request carries it as `X-API-Key` or
//! `Authorization: Bearer`; without, 401.
//!
//! Many environments at once: each reset hands out another episode, and
//! each episode runs its personas and scorer through the fleet meanwhile.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Json, State, rejection::JsonRejection};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use evalfleet_eval::balance::Strategy;
use evalfleet_pipeline::task::conversation::gym::{Action, Gym, GymError};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// The environment server's settings.
pub struct EnvServer {
    pub gym: Arc<Gym>,
    pub run_id: String,
    pub episodes: u64,
    /// The longest a reset waits for an episode to reach a decision (a
    /// reset may ask for less).
    pub reset_wait: Duration,
    /// How long a step waits for the episode's next decision.
    pub step_wait: Duration,
    /// The key every request must carry (`None`: none is asked for, which
    /// [`crate::open_bind_refusal`] allows on a loopback address only).
    pub api_key: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StepBody {
    env_id: String,
    #[serde(default)]
    action: Value,
    /// The model's raw output instead of an action: read by the rules of
    /// the run.
    output: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CloseBody {
    env_id: String,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ResetBody {
    /// Seconds to wait for an episode at its first decision (at most the
    /// server's `--reset-wait`).
    wait_s: Option<f64>,
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, axum::Json(json!({"error": message.into()}))).into_response()
}

fn gym_error(err: &GymError) -> Response {
    let status = match err {
        GymError::NoEpisodes => StatusCode::GONE,
        GymError::UnknownEnv(_) | GymError::NotHeld(_) => StatusCode::NOT_FOUND,
        GymError::Dropped(_) => StatusCode::CONFLICT,
        GymError::ResetTimeout(_) | GymError::StepTimeout(..) => StatusCode::GATEWAY_TIMEOUT,
    };
    error(status, err.to_string())
}

/// A JSON body, or why it is not one of `shape` (a 400).
fn read<T>(body: Result<Json<T>, JsonRejection>, shape: &str) -> Result<T, String> {
    body.map(|Json(body)| body)
        .map_err(|rejection| format!("the body must be JSON {shape}: {rejection}"))
}

/// The wait a reset asks for, in its body (none, empty or `{}`: the
/// server's), capped by the server's.
fn reset_wait(body: &[u8], most: Duration) -> Result<Duration, String> {
    let body = if body.iter().all(u8::is_ascii_whitespace) {
        ResetBody::default()
    } else {
        serde_json::from_slice::<ResetBody>(body).map_err(|err| {
            format!("the body must be JSON {{}} or {{\"wait_s\": seconds}}: {err}")
        })?
    };
    match body.wait_s {
        None => Ok(most),
        Some(s) if s.is_finite() && s >= 0.0 => {
            Ok(Duration::from_secs_f64(s.min(most.as_secs_f64())))
        }
        Some(s) => Err(format!(
            "wait_s must be a number of seconds, 0 or more, got {s}"
        )),
    }
}

async fn reset(State(env): State<Arc<EnvServer>>, body: Bytes) -> Response {
    let wait = match reset_wait(&body, env.reset_wait) {
        Ok(wait) => wait,
        Err(message) => return error(StatusCode::BAD_REQUEST, message),
    };
    match env.gym.reset(wait).await {
        Ok((env_id, t)) => {
            axum::Json(json!({"env_id": env_id, "observation": t.observation, "info": t.info}))
                .into_response()
        }
        Err(err) => gym_error(&err),
    }
}

/// A step's action: a digit 1 to 4, or `"invalid"` / null.
fn action_of(value: &Value) -> Option<Action> {
    match value {
        Value::Null => Some(Action::Invalid),
        Value::String(s) if s == "invalid" => Some(Action::Invalid),
        _ => value
            .as_u64()
            .and_then(|n| u8::try_from(n).ok())
            .and_then(Strategy::from_digit)
            .map(Action::Strategy),
    }
}

async fn step(
    State(env): State<Arc<EnvServer>>,
    body: Result<Json<StepBody>, JsonRejection>,
) -> Response {
    let body = match read(
        body,
        r#"{"env_id": "...", "action": 1..4 or "invalid"} or {"env_id": "...", "output": "the model's raw output"}"#,
    ) {
        Ok(body) => body,
        Err(message) => return error(StatusCode::BAD_REQUEST, message),
    };
    let action = match body.output {
        Some(output) if body.action.is_null() => Some(Action::Output(output)),
        Some(_) => {
            return error(
                StatusCode::BAD_REQUEST,
                "give an action or the model's output, not both",
            );
        }
        None => action_of(&body.action),
    };
    let Some(action) = action else {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "action must be 1 (validate), 2 (bridge), 3 (plan), 4 (no_intervention), or \"invalid\" (or null) when the model's output could not be read; got {}",
                body.action
            ),
        );
    };
    match env.gym.step(&body.env_id, action, env.step_wait).await {
        Ok(t) => axum::Json(json!({
            "observation": t.observation,
            "reward": t.reward,
            "terminated": t.terminated,
            "truncated": t.truncated,
            "info": t.info,
        }))
        .into_response(),
        Err(err) => gym_error(&err),
    }
}

async fn close(
    State(env): State<Arc<EnvServer>>,
    body: Result<Json<CloseBody>, JsonRejection>,
) -> Response {
    let body = match read(body, r#"{"env_id": "..."}"#) {
        Ok(body) => body,
        Err(message) => return error(StatusCode::BAD_REQUEST, message),
    };
    match env.gym.close(&body.env_id) {
        Ok(()) => axum::Json(json!({"env_id": body.env_id, "closed": true})).into_response(),
        Err(err) => gym_error(&err),
    }
}

async fn spec(State(env): State<Arc<EnvServer>>) -> Response {
    let actions: serde_json::Map<String, Value> = Strategy::ALL
        .iter()
        .map(|s| (s.digit().to_string(), Value::from(s.as_str())))
        .collect();
    axum::Json(json!({
        "run_id": env.run_id,
        "episodes": env.episodes,
        "actions": actions,
        "invalid_action": "invalid",
        "edges": ["AB", "BC", "CA"],
        "speakers": ["A", "B", "C"],
        "now": env.gym.counts(),
    }))
    .into_response()
}

/// Refuses a request without the server's key, when it has one.
async fn keyed(
    State(expected): State<Arc<Option<[u8; 32]>>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if let Some(expected) = expected.as_ref() {
        let given = crate::auth::header_key(request.headers());
        if !given.is_some_and(|key| crate::keys::same(expected, &crate::keys::digest(&key))) {
            return error(
                StatusCode::UNAUTHORIZED,
                "an API key is required: send it as X-API-Key or Authorization: Bearer",
            );
        }
    }
    next.run(request).await
}

/// The environment server's routes, answering only requests addressed to
/// `hosts` (a page whose name was rebound to the loopback cannot play) and
/// carrying the server's key, when it has one.
pub fn env_app(env: Arc<EnvServer>, hosts: crate::HostPolicy) -> Router {
    let key = Arc::new(env.api_key.as_deref().map(crate::keys::digest));
    Router::new()
        .route("/v1/reset", post(reset))
        .route("/v1/step", post(step))
        .route("/v1/close", post(close))
        .route("/v1/spec", get(spec))
        .layer(axum::middleware::from_fn_with_state(key, keyed))
        .layer(axum::middleware::from_fn_with_state(
            Arc::new(hosts),
            crate::hosts::guard,
        ))
        .layer(axum::extract::DefaultBodyLimit::max(64 * 1024))
        .with_state(env)
}

/// Serves `env` on `listener` until `shutdown`.
pub async fn serve_env(
    listener: tokio::net::TcpListener,
    env: Arc<EnvServer>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let hosts = crate::HostPolicy::new(listener.local_addr()?, &[]);
    axum::serve(listener, env_app(env, hosts))
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reset_waits_what_it_asks_up_to_the_servers_wait() {
        let most = Duration::from_secs(10);
        assert_eq!(reset_wait(b"", most), Ok(most));
        assert_eq!(reset_wait(b" {} ", most), Ok(most));
        assert_eq!(
            reset_wait(br#"{"wait_s": 0.5}"#, most),
            Ok(Duration::from_millis(500))
        );
        assert_eq!(reset_wait(br#"{"wait_s": 600}"#, most), Ok(most));
        let bad = reset_wait(br#"{"wait_s": -1}"#, most).unwrap_err();
        assert!(bad.contains("got -1"), "{bad}");
        let bad = reset_wait(br#"{"wait": 5}"#, most).unwrap_err();
        assert!(bad.contains("unknown field `wait`"), "{bad}");
    }

    #[test]
    fn actions_are_digits_or_invalid() {
        assert_eq!(
            action_of(&json!(2)),
            Some(Action::Strategy(Strategy::Bridge))
        );
        assert_eq!(action_of(&json!("invalid")), Some(Action::Invalid));
        assert_eq!(action_of(&Value::Null), Some(Action::Invalid));
        for bad in [json!(0), json!(5), json!("2"), json!(2.5), json!([1])] {
            assert_eq!(action_of(&bad), None, "{bad}");
        }
    }
}
