//! A run as people look at it: a summary for lists (its state, counts and
//! times) and its detail for a page (its dataset, endpoints as its workers
//! last saw them, workers, events), typed for the CLI, the HTTP API and
//! the dashboard to render. Read from the store alone, so a run is seen the
//! same whichever process runs it.

use serde::Serialize;
use serde_json::Value;

use evalfleet_types::{EndpointSnapshot, Event, RunStatus, StateCounts};

use crate::store::{RunRecord, Store, StoreError, WorkerInfo};
use crate::worker;

/// Where a run is, as a person means it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    /// A worker is answering its items.
    Running,
    /// Marked running, but no worker of it lives: its process crashed or
    /// was killed. Resume it.
    Stopped,
    /// Stopped before every item ended (Ctrl-C, no endpoint left).
    Interrupted,
    /// Every item ended.
    Finished,
}

impl RunState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Stopped => "stopped",
            Self::Interrupted => "interrupted",
            Self::Finished => "finished",
        }
    }
}

/// A run in a list.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct RunSummary {
    pub run_id: String,
    pub name: String,
    pub state: RunState,
    /// As stored (`running` for a run whose process is gone too).
    pub status: RunStatus,
    /// Workers of it that live now.
    pub workers: usize,
    /// Why it stopped, when it stopped early.
    pub message: Option<String>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    /// Items in the run.
    pub total: u64,
    pub counts: StateCounts,
    pub sessions: u32,
}

/// The run's dataset as registered.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct DatasetView {
    pub path: String,
    pub size: u64,
    pub sha256: String,
}

/// The endpoints as the run's workers last wrote them.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct EndpointsView {
    pub updated_at_ms: i64,
    /// Whether a worker lives (the states are live) or not (as last seen).
    pub live: bool,
    pub endpoints: Vec<EndpointSnapshot>,
}

/// A run in full.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct RunDetail {
    #[serde(flatten)]
    pub summary: RunSummary,
    pub dataset: DatasetView,
    /// What determines the run's results, as a digest.
    pub fingerprint: String,
    /// The config as stored: secrets masked.
    #[schema(value_type = Object)]
    pub config: Value,
    pub endpoints: Option<EndpointsView>,
    pub live_workers: Vec<WorkerInfo>,
    /// The latest events, oldest first (at most [`EVENTS`]).
    pub events: Vec<Event>,
}

/// Events a detail holds.
pub const EVENTS: usize = 200;

/// What `run`'s stored status means now.
pub fn state(run: &RunRecord, live_workers: usize) -> RunState {
    match run.status {
        RunStatus::Running if live_workers == 0 => RunState::Stopped,
        RunStatus::Running => RunState::Running,
        RunStatus::Interrupted => RunState::Interrupted,
        RunStatus::Finished => RunState::Finished,
    }
}

fn summary_of(run: &RunRecord, counts: StateCounts, workers: usize) -> RunSummary {
    RunSummary {
        run_id: run.run_id.clone(),
        name: run.name.clone(),
        state: state(run, workers),
        status: run.status,
        workers,
        message: run.message.clone(),
        created_at_ms: run.created_at_ms,
        updated_at_ms: run.updated_at_ms,
        total: run.total,
        counts,
        sessions: run.sessions,
    }
}

/// One run's summary.
pub fn summary(store: &mut dyn Store, run: &RunRecord) -> Result<RunSummary, StoreError> {
    let counts = store.counts(&run.run_id)?;
    let workers = if run.status == RunStatus::Running {
        worker::live_workers(store, &run.run_id)?.len()
    } else {
        0
    };
    Ok(summary_of(run, counts, workers))
}

/// Every run's summary, newest first.
pub fn summaries(store: &mut dyn Store) -> Result<Vec<RunSummary>, StoreError> {
    let runs = store.runs()?;
    runs.iter().map(|run| summary(store, run)).collect()
}

/// One run in full.
pub fn detail(store: &mut dyn Store, run_id: &str) -> Result<RunDetail, StoreError> {
    let run = store.run(run_id)?;
    let live_workers = worker::live_workers(store, run_id)?;
    let counts = store.counts(run_id)?;
    let summary = summary_of(&run, counts, live_workers.len());
    let live = !live_workers.is_empty();
    let endpoints = store.endpoint_states(run_id)?.map(|s| EndpointsView {
        updated_at_ms: s.updated_at_ms,
        live,
        endpoints: s.endpoints,
    });
    let mut events = store.events(run_id)?;
    if events.len() > EVENTS {
        events.drain(..events.len() - EVENTS);
    }
    Ok(RunDetail {
        summary,
        dataset: DatasetView {
            path: run.dataset.path.display().to_string(),
            size: run.dataset.size,
            sha256: run.dataset.sha256.clone(),
        },
        fingerprint: run.fingerprint.digest(),
        config: run.config.clone(),
        endpoints,
        live_workers,
        events,
    })
}
