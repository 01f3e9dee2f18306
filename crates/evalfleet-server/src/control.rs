//! Runs this process starts, resumes and stops: the server asks, the
//! binary (which has the fleet's engines, the mock and the store backends)
//! does.

use std::future::Future;
use std::pin::Pin;

use evalfleet_config::LoadedConfig;

use serde::{Deserialize, Serialize};

use crate::error::ApiError;

/// A future of the control.
pub type Pending<T> = Pin<Box<dyn Future<Output = Result<T, ApiError>> + Send>>;

/// How a new run is started: its config, loaded by the server and
/// admitted (it asks for nothing the server does not allow), and its id.
#[derive(Debug, Clone)]
pub struct StartRun {
    pub config: Box<LoadedConfig>,
    pub run_id: Option<String>,
}

/// What the server may ask of runs.
pub trait RunControl: Send + Sync {
    /// Registers a new run and starts answering it in the background;
    /// ends once it is registered, with its id.
    fn start(&self, run: StartRun) -> Pending<String>;

    /// Starts a session of a stored run in the background (`retry_failed`:
    /// its failed items too).
    fn resume(&self, run_id: String, retry_failed: bool) -> Pending<()>;

    /// Stops a run this process is answering, as a Ctrl-C would; `false`
    /// when it answers no such run.
    fn cancel(&self, run_id: &str) -> bool;

    /// The runs this process is answering now.
    fn running(&self) -> Vec<String>;

    /// Checks and scores a stopped run's stored answers again with its
    /// stored task (only `metrics`, when given), calling no model.
    fn rescore(&self, run_id: String, metrics: Vec<String>) -> Pending<Rescored>;
}

/// What scoring again did.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Rescored {
    pub run_id: String,
    /// Done items scored again, and of those, usable answers.
    pub answers: u64,
    pub usable: u64,
    /// The task's metrics.
    pub metrics: Vec<String>,
}

/// `POST /api/v1/runs/{run_id}/rescore`.
#[derive(Debug, Default, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RescoreRequest {
    /// Only these metrics (names or keys); the others keep their scores.
    #[serde(default)]
    pub metrics: Vec<String>,
}

/// `POST /api/v1/runs`: a config as YAML text, or a path on the server.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateRun {
    /// The config, as YAML text.
    pub config: Option<String>,
    /// Or a config file on the server, under one of its allowed roots.
    pub config_path: Option<String>,
    /// The run's id (default: the config's name and the time).
    pub run_id: Option<String>,
    /// Answer a sample of this many items.
    pub n_sample: Option<u64>,
    /// The sample's seed.
    pub seed: Option<u64>,
}
