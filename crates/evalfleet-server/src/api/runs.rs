//! Runs: listed, looked at, started, stopped, resumed, scored again, and
//! their fleets changed.

use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;

use axum::Json;
use axum::extract::State;

use crate::extract::{Path, Query};
use axum::http::StatusCode;
use evalfleet_config::{self as config, Overrides};
use evalfleet_reports::view::{self, RunDetail, RunState, RunSummary};
use evalfleet_types::{Event, FleetAction, FleetChange, now_ms};
use serde::{Deserialize, Serialize};

use crate::control::{CreateRun, RescoreRequest, Rescored, StartRun};
use crate::error::{ApiError, ErrorBody};
use crate::state::AppState;

/// The query of `GET /api/v1/runs`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct RunsParams {
    /// Only runs in these states, comma-separated: `running`, `stopped`,
    /// `interrupted`, `finished`.
    pub state: Option<String>,
    /// Only runs whose name or id contains this text.
    pub q: Option<String>,
    /// At most this many, newest first (default 500).
    pub limit: Option<usize>,
}

/// The runs in the store, newest first.
#[utoipa::path(
    get,
    path = "/runs",
    tag = "runs",
    params(RunsParams),
    responses(
        (status = 200, description = "The runs", body = Vec<RunSummary>),
        (status = 400, description = "A parameter is wrong", body = ErrorBody),
    )
)]
pub async fn list(
    State(state): State<Arc<AppState>>,
    Query(params): Query<RunsParams>,
) -> Result<Json<Vec<RunSummary>>, ApiError> {
    let states: Vec<RunState> = match &params.state {
        None => Vec::new(),
        Some(text) => text
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| match s {
                "running" => Ok(RunState::Running),
                "stopped" => Ok(RunState::Stopped),
                "interrupted" => Ok(RunState::Interrupted),
                "finished" => Ok(RunState::Finished),
                other => Err(ApiError::BadRequest(format!(
                    "state: '{other}' is not running, stopped, interrupted or finished"
                ))),
            })
            .collect::<Result<_, _>>()?,
    };
    let limit = params.limit.unwrap_or(500);
    let text = params.q.map(|q| q.to_lowercase());
    let runs = state
        .with_store(move |store| Ok(view::summaries(store)?))
        .await?;
    Ok(Json(
        runs.into_iter()
            .filter(|r| states.is_empty() || states.contains(&r.state))
            .filter(|r| {
                text.as_deref().is_none_or(|t| {
                    r.name.to_lowercase().contains(t) || r.run_id.to_lowercase().contains(t)
                })
            })
            .take(limit)
            .collect(),
    ))
}

/// One run: its state and counts, dataset, endpoints as its workers last
/// saw them, live workers and latest events.
#[utoipa::path(
    get,
    path = "/runs/{run_id}",
    tag = "runs",
    params(("run_id" = String, Path, description = "The run's id")),
    responses(
        (status = 200, description = "The run", body = RunDetail),
        (status = 404, description = "No such run", body = ErrorBody),
    )
)]
pub async fn get(
    State(state): State<Arc<AppState>>,
    Path(run_id): Path<String>,
) -> Result<Json<RunDetail>, ApiError> {
    let detail = state
        .with_store(move |store| Ok(view::detail(store, &run_id)?))
        .await?;
    Ok(Json(detail))
}

/// Every event of a run, oldest first.
#[utoipa::path(
    get,
    path = "/runs/{run_id}/events",
    tag = "runs",
    params(("run_id" = String, Path, description = "The run's id")),
    responses(
        (status = 200, description = "The events", body = Vec<Event>),
        (status = 404, description = "No such run", body = ErrorBody),
    )
)]
pub async fn events(
    State(state): State<Arc<AppState>>,
    Path(run_id): Path<String>,
) -> Result<Json<Vec<Event>>, ApiError> {
    let events = state
        .with_store(move |store| Ok(store.events(&run_id)?))
        .await?;
    Ok(Json(events))
}

/// What starting, resuming or stopping a run answered.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Started {
    pub run_id: String,
}

fn control(state: &AppState) -> Result<Arc<dyn crate::control::RunControl>, ApiError> {
    state.control.clone().ok_or_else(|| {
        ApiError::NotHere(
            "this server does not run evaluations (it only reads the store: evalfleet serve --read-only)"
                .to_owned(),
        )
    })
}

/// Registers a new run from a config (its YAML text, or a file on the
/// server under an allowed root) and starts answering it in this process.
#[utoipa::path(
    post,
    path = "/runs",
    tag = "runs",
    request_body = CreateRun,
    responses(
        (status = 201, description = "Registered and started", body = Started),
        (status = 400, description = "The request is wrong", body = ErrorBody),
        (status = 403, description = "The config asks for what this server does not allow (a file outside its roots, a command, a variable), or it does not run evaluations", body = ErrorBody),
        (status = 422, description = "The config cannot be used (problems with their lines)", body = ErrorBody),
    )
)]
pub async fn create(
    State(state): State<Arc<AppState>>,
    crate::extract::Json(body): crate::extract::Json<CreateRun>,
) -> Result<(StatusCode, Json<Started>), ApiError> {
    let control = control(&state)?;
    let admission = state.admission.clone();
    let overrides = Overrides {
        sample_n: body.n_sample,
        sample_seed: body.seed,
        ..Overrides::default()
    };
    // Read and checked on a blocking thread: the config's files are read.
    let loaded = state
        .blocking(move || {
            let loaded = match (body.config, body.config_path) {
                (Some(yaml), None) => {
                    // Relative paths in a config sent as text are read
                    // from the first allowed root.
                    let dir = admission
                        .roots
                        .first()
                        .cloned()
                        .unwrap_or_else(|| PathBuf::from("."));
                    config::load_text(&yaml, &dir, overrides, "the config", Some(&admission))
                }
                (None, Some(path)) => {
                    // Refused alike whether the file exists or not.
                    let Some(file) = admission.confined(FsPath::new(&path)) else {
                        return Err(ApiError::Forbidden(format!(
                            "config_path: '{path}' is not under the directories this server reads from (--allow-root)"
                        )));
                    };
                    config::load_file_admitted(&file, overrides, Some(&admission))
                }
                _ => {
                    return Err(ApiError::BadRequest(
                        "give the config as `config` (YAML text) or `config_path`, not both"
                            .to_owned(),
                    ));
                }
            };
            Ok(loaded?)
        })
        .await?;
    let run_id = control
        .start(StartRun {
            config: Box::new(loaded),
            run_id: body.run_id,
        })
        .await?;
    Ok((StatusCode::CREATED, Json(Started { run_id })))
}

/// What a resume asks for.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResumeRun {
    /// Answer the failed items again too.
    #[serde(default)]
    pub retry_failed: bool,
}

/// Starts a session of a stored run in this process: its pending items
/// (and, with `retry_failed`, its failed ones) are answered.
#[utoipa::path(
    post,
    path = "/runs/{run_id}/resume",
    tag = "runs",
    params(("run_id" = String, Path, description = "The run's id")),
    request_body = ResumeRun,
    responses(
        (status = 202, description = "Resumed", body = Started),
        (status = 404, description = "No such run", body = ErrorBody),
        (status = 409, description = "Nothing to resume, or this process already runs it", body = ErrorBody),
        (status = 403, description = "This server does not run evaluations", body = ErrorBody),
    )
)]
pub async fn resume(
    State(state): State<Arc<AppState>>,
    Path(run_id): Path<String>,
    crate::extract::OptionalJson(body): crate::extract::OptionalJson<ResumeRun>,
) -> Result<(StatusCode, Json<Started>), ApiError> {
    let control = control(&state)?;
    let retry_failed = body.is_some_and(|b| b.retry_failed);
    control.resume(run_id.clone(), retry_failed).await?;
    Ok((StatusCode::ACCEPTED, Json(Started { run_id })))
}

/// Stops a run this process is answering, as a Ctrl-C would: no new items,
/// calls in flight may finish; it stays resumable.
#[utoipa::path(
    post,
    path = "/runs/{run_id}/cancel",
    tag = "runs",
    params(("run_id" = String, Path, description = "The run's id")),
    responses(
        (status = 202, description = "Stopping", body = Started),
        (status = 409, description = "This process is not running it", body = ErrorBody),
        (status = 403, description = "This server does not run evaluations", body = ErrorBody),
    )
)]
pub async fn cancel(
    State(state): State<Arc<AppState>>,
    Path(run_id): Path<String>,
) -> Result<(StatusCode, Json<Started>), ApiError> {
    let control = control(&state)?;
    if control.cancel(&run_id) {
        Ok((StatusCode::ACCEPTED, Json(Started { run_id })))
    } else {
        Err(ApiError::Conflict(format!(
            "this server is not running {run_id} (a run started elsewhere is stopped where it runs)"
        )))
    }
}

/// A change of a running run's fleet.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FleetRequest {
    /// `add` or `remove`.
    pub action: String,
    /// One of the run's configured endpoints.
    pub endpoint: String,
}

/// Adds one of the run's configured endpoints to it, or takes one out (its
/// calls in flight move to the others); the run's workers apply it within
/// a second.
#[utoipa::path(
    post,
    path = "/runs/{run_id}/fleet",
    tag = "runs",
    params(("run_id" = String, Path, description = "The run's id")),
    request_body = FleetRequest,
    responses(
        (status = 202, description = "Posted for the run's workers", body = FleetChange),
        (status = 400, description = "No such action", body = ErrorBody),
        (status = 404, description = "No such run", body = ErrorBody),
        (status = 422, description = "No such endpoint in the run's config", body = ErrorBody),
    )
)]
pub async fn fleet(
    State(state): State<Arc<AppState>>,
    Path(run_id): Path<String>,
    crate::extract::Json(body): crate::extract::Json<FleetRequest>,
) -> Result<(StatusCode, Json<FleetChange>), ApiError> {
    let action = FleetAction::parse(&body.action).map_err(|_| {
        ApiError::BadRequest(format!("action: '{}' is not add or remove", body.action))
    })?;
    let change = state
        .with_store(move |store| {
            let run = store.run(&run_id)?;
            let known = run.config["endpoints"]
                .as_array()
                .is_some_and(|list| list.iter().any(|e| e["name"] == body.endpoint.as_str()));
            if !known {
                return Err(ApiError::NotFound(format!(
                    "run {run_id} has no endpoint '{}' in its config",
                    body.endpoint
                )));
            }
            Ok(store.request_fleet_change(
                &run_id,
                &FleetChange {
                    id: 0,
                    at_ms: now_ms(),
                    action,
                    endpoint: body.endpoint,
                },
            )?)
        })
        .await?;
    Ok((StatusCode::ACCEPTED, Json(change)))
}

/// Checks and scores a stopped run's stored answers again with its stored
/// task, calling no model; the report then shows the new scores.
#[utoipa::path(
    post,
    path = "/runs/{run_id}/rescore",
    tag = "runs",
    params(("run_id" = String, Path, description = "The run's id")),
    request_body = RescoreRequest,
    responses(
        (status = 200, description = "Scored again", body = Rescored),
        (status = 404, description = "No such run", body = ErrorBody),
        (status = 409, description = "The run is running", body = ErrorBody),
        (status = 422, description = "A metric is not the task's", body = ErrorBody),
        (status = 403, description = "This server does not run evaluations, or the run's metric backends would run commands and it was started without --allow-commands", body = ErrorBody),
    )
)]
pub async fn rescore(
    State(state): State<Arc<AppState>>,
    Path(run_id): Path<String>,
    crate::extract::OptionalJson(body): crate::extract::OptionalJson<RescoreRequest>,
) -> Result<Json<Rescored>, ApiError> {
    let control = control(&state)?;
    let metrics = body.map(|b| b.metrics).unwrap_or_default();
    Ok(Json(control.rescore(run_id, metrics).await?))
}
