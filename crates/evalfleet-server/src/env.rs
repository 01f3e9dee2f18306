//! The environment server (`evalfleet env`): a conversation run's decisions
//! taken by a trainer over HTTP, Gymnasium-style. JSON in and out:
//!
//! - `POST /v1/reset` → `{env_id, observation, info}`: an episode at its
//!   first decision (410 when every episode has been handed out);
//! - `POST /v1/step` with `{env_id, action}` (1 validate, 2 bridge, 3 plan,
//!   4 no_intervention) → `{observation, reward, terminated, truncated,
//!   info}`: the episode's next decision, or its end (`observation` null);
//! - `GET /v1/spec`: the actions and the run.
//!
//! Many environments at once: each reset hands out another episode, and
//! each episode runs its personas and scorer through the fleet meanwhile.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Json, State, rejection::JsonRejection};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use evalfleet_core::eval::balance::Strategy;
use evalfleet_core::task::conversation::gym::{Gym, GymError};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// The environment server's settings.
pub struct EnvServer {
    pub gym: Arc<Gym>,
    pub run_id: String,
    pub episodes: u64,
    /// How long a reset waits for an episode to reach a decision.
    pub reset_wait: Duration,
    /// How long a step waits for the episode's next decision.
    pub step_wait: Duration,
}

#[derive(Deserialize)]
struct StepBody {
    env_id: String,
    action: Value,
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, axum::Json(json!({"error": message.into()}))).into_response()
}

fn gym_error(err: &GymError) -> Response {
    let status = match err {
        GymError::NoEpisodes => StatusCode::GONE,
        GymError::UnknownEnv(_) => StatusCode::NOT_FOUND,
        GymError::Dropped(_) => StatusCode::CONFLICT,
        GymError::ResetTimeout(_) | GymError::StepTimeout(..) => StatusCode::GATEWAY_TIMEOUT,
    };
    error(status, err.to_string())
}

async fn reset(State(env): State<Arc<EnvServer>>) -> Response {
    match env.gym.reset(env.reset_wait).await {
        Ok((env_id, t)) => {
            axum::Json(json!({"env_id": env_id, "observation": t.observation, "info": t.info}))
                .into_response()
        }
        Err(err) => gym_error(&err),
    }
}

async fn step(
    State(env): State<Arc<EnvServer>>,
    body: Result<Json<StepBody>, JsonRejection>,
) -> Response {
    let body = match body {
        Ok(Json(body)) => body,
        Err(rejection) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!(
                    "the body must be JSON {{\"env_id\": \"...\", \"action\": 1..4}}: {rejection}"
                ),
            );
        }
    };
    let action = body
        .action
        .as_u64()
        .and_then(|n| u8::try_from(n).ok())
        .and_then(Strategy::from_digit);
    let Some(action) = action else {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "action must be 1 (validate), 2 (bridge), 3 (plan) or 4 (no_intervention), got {}",
                body.action
            ),
        );
    };
    match env
        .gym
        .step(&body.env_id, Some(action), env.step_wait)
        .await
    {
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

async fn spec(State(env): State<Arc<EnvServer>>) -> Response {
    let actions: serde_json::Map<String, Value> = Strategy::ALL
        .iter()
        .map(|s| (s.digit().to_string(), Value::from(s.as_str())))
        .collect();
    axum::Json(json!({
        "run_id": env.run_id,
        "episodes": env.episodes,
        "actions": actions,
        "edges": ["AB", "BC", "CA"],
        "speakers": ["A", "B", "C"],
    }))
    .into_response()
}

/// The environment server's routes, answering only requests addressed to
/// `hosts` (a page whose name was rebound to the loopback cannot play).
pub fn env_app(env: Arc<EnvServer>, hosts: crate::HostPolicy) -> Router {
    Router::new()
        .route("/v1/reset", post(reset))
        .route("/v1/step", post(step))
        .route("/v1/spec", get(spec))
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
