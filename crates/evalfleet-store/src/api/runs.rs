//! Runs: a new run and its items registered, a run as stored, the
//! sessions and workers that work on it.

use serde::Serialize;
use serde_json::Value;

use evalfleet_types::{RunStatus, StateCounts};

use evalfleet_io::dataset::DatasetIdentity;
use evalfleet_io::fingerprint::Fingerprint;

use super::errors::{CreateRunError, StoreError};

/// A run about to be created.
#[derive(Debug, Clone)]
pub struct NewRun {
    pub run_id: String,
    pub name: String,
    /// The config snapshot (secrets masked).
    pub config: Value,
    /// The directory the config's relative paths are resolved against.
    pub config_dir: String,
    pub created_at_ms: i64,
}

/// One item registered with a new run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewItem {
    pub item_id: String,
    /// Position among the dataset's rows; items are dispatched in this order.
    pub seq: u64,
    pub line: u64,
    pub offset: u64,
    /// Orders items for sampling (see [`evalfleet_io::dataset::sample_key`]).
    pub sample_key: i64,
    /// Why the row cannot be used: the item is registered as failed.
    pub invalid: Option<String>,
}

/// What a finished registration learned, stored with the run.
#[derive(Debug, Clone)]
pub struct RunIdentity {
    pub fingerprint: Fingerprint,
    pub dataset: DatasetIdentity,
    /// Keep only the `n` items with the smallest sample keys.
    pub sample_n: Option<u64>,
}

/// Items for a new run, pulled by [`Runs::create_run`] inside its
/// transaction.
pub trait ItemSource {
    fn next_item(&mut self) -> Result<Option<NewItem>, CreateRunError>;
    /// Called after the last item; an error here still undoes everything.
    fn finish(&mut self) -> Result<RunIdentity, CreateRunError>;
    /// The dataset's path, for messages.
    fn path(&self) -> String;
}

impl RunIdentity {
    /// The identity of items that come from no dataset file (tests,
    /// benchmarks): a file `path`, empty, hashed as zeros, its invalid
    /// rows skipped; `sample_n` kept.
    pub fn of_no_file(path: &str, sample_n: Option<u64>) -> Self {
        use evalfleet_io::fingerprint::DatasetOptions;
        Self {
            fingerprint: Fingerprint {
                dataset_sha256: "0".repeat(64),
                dataset_options: DatasetOptions {
                    format: "jsonl".to_owned(),
                    id_field: None,
                    sample_n,
                    sample_seed: None,
                    skip_invalid: true,
                    split: None,
                },
                messages_sha256: String::new(),
                params_sha256: String::new(),
                samples: 1,
                images_sha256: None,
            },
            dataset: DatasetIdentity {
                path: path.into(),
                size: 0,
                mtime_ns: 0,
                sha256: "0".repeat(64),
            },
            sample_n,
        }
    }
}

/// Items registered from a list, as from a file `data.jsonl` that is not
/// there (tests, benchmarks: see [`RunIdentity::of_no_file`]).
pub struct ListedItems {
    items: std::vec::IntoIter<NewItem>,
    sample_n: Option<u64>,
}

impl ListedItems {
    /// `items` in their order; `sample_n`: keep only so many.
    pub fn new(items: Vec<NewItem>, sample_n: Option<u64>) -> Self {
        Self {
            items: items.into_iter(),
            sample_n,
        }
    }
}

impl ItemSource for ListedItems {
    fn next_item(&mut self) -> Result<Option<NewItem>, CreateRunError> {
        Ok(self.items.next())
    }

    fn finish(&mut self) -> Result<RunIdentity, CreateRunError> {
        Ok(RunIdentity::of_no_file(&self.path(), self.sample_n))
    }

    fn path(&self) -> String {
        "data.jsonl".to_owned()
    }
}

/// A stored run.
#[derive(Debug, Clone)]
pub struct RunRecord {
    pub run_id: String,
    pub name: String,
    pub status: RunStatus,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    pub config: Value,
    pub config_dir: String,
    pub fingerprint: Fingerprint,
    pub dataset: DatasetIdentity,
    /// Items in the run (after sampling).
    pub total: u64,
    /// How many sessions worked on it (the run, resumes, workers that
    /// joined).
    pub sessions: u32,
    /// Why it stopped, when it stopped early.
    pub message: Option<String>,
    /// Changes whenever its results may have: each commit of results, each
    /// new session (a resume, `--retry-failed`, a worker joining) and each
    /// rescore. What was computed from its results at one generation holds
    /// until the next.
    pub generation: u64,
}

/// The start of a session (a run, a resume, a worker joining).
#[derive(Debug, Clone, Copy)]
pub struct SessionStart {
    /// 1 for the first run, 2 for the next session, ...
    pub session: u32,
    /// Failed items put back to pending (`--retry-failed`).
    pub reset: u64,
    pub counts: StateCounts,
}

/// A worker of a run: one session of one process, as it registered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct WorkerInfo {
    /// Unique among the run's workers.
    pub worker: String,
    pub session: u32,
    pub host: String,
    pub pid: u32,
    /// Where its pid means it: the kernel it runs on and its pid
    /// namespace (`BOOT_ID/pid:[INODE]`). Only a worker of the same scope
    /// can tell by pid whether it lives; containers that share a hostname
    /// do not share it. Empty for workers registered before it was kept.
    pub pid_scope: String,
    /// When the process started, in the kernel's clock ticks since boot: with
    /// the pid, it tells the process from a later one that got its pid.
    pub process_start: u64,
    pub started_at_ms: i64,
    /// Its last renewal.
    pub heartbeat_at_ms: i64,
    /// How long its claims last without a renewal.
    pub lease_ms: i64,
}

/// What one worker of a run committed: results of items done and failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct WorkerWork {
    pub worker: String,
    pub done: u64,
    pub failed: u64,
}

/// Runs and their registration.
pub trait Runs {
    /// Creates a run and registers its items in one transaction: on any error
    /// nothing is stored. A duplicate id is a [`CreateRunError::DuplicateId`].
    fn create_run(
        &mut self,
        run: &NewRun,
        items: &mut dyn ItemSource,
    ) -> Result<RunRecord, CreateRunError>;

    fn run(&mut self, run_id: &str) -> Result<RunRecord, StoreError>;

    /// Every run, newest first.
    fn runs(&mut self) -> Result<Vec<RunRecord>, StoreError>;

    /// Marks the run running, counts a new session and registers `worker`
    /// for it (its `session` is set here); with `retry_failed`, failed
    /// items (but not invalid rows) go back to pending and lose their
    /// result.
    fn begin_session(
        &mut self,
        run_id: &str,
        worker: &mut WorkerInfo,
        retry_failed: bool,
    ) -> Result<SessionStart, StoreError>;

    /// Sets the run's status and message; whether the status changed (of
    /// two workers that end a run at once, one changes it: the other's
    /// status was already set).
    fn set_status(
        &mut self,
        run_id: &str,
        status: RunStatus,
        message: Option<&str>,
    ) -> Result<bool, StoreError>;

    fn counts(&mut self, run_id: &str) -> Result<StateCounts, StoreError>;

    /// The run's registered workers, live or not: whether each still lives
    /// is for the reader to judge (by its process, or its heartbeat).
    fn workers(&mut self, run_id: &str) -> Result<Vec<WorkerInfo>, StoreError>;

    /// What each worker that committed results of the run committed, by
    /// worker name, whether it still lives or not.
    fn worker_work(&mut self, run_id: &str) -> Result<Vec<WorkerWork>, StoreError>;
}

/// The run a command was given: an id as it is, `latest` (the run made
/// last), or the beginning of exactly one run's id, as lm-eval's and
/// inspect's users name runs.
pub fn resolve_run_id(store: &mut dyn super::Store, given: &str) -> Result<String, StoreError> {
    match store.run(given) {
        Ok(run) => return Ok(run.run_id),
        Err(StoreError::NoSuchRun(_)) => {}
        Err(err) => return Err(err),
    }
    let runs = store.runs()?;
    if given == "latest" {
        return runs
            .iter()
            .max_by_key(|r| (r.created_at_ms, r.run_id.clone()))
            .map(|r| r.run_id.clone())
            .ok_or_else(|| StoreError::NoSuchRun(given.to_owned()));
    }
    let mut matches: Vec<String> = runs
        .into_iter()
        .filter(|r| !given.is_empty() && r.run_id.starts_with(given))
        .map(|r| r.run_id)
        .collect();
    match matches.len() {
        0 => Err(StoreError::NoSuchRun(given.to_owned())),
        1 => Ok(matches.remove(0)),
        _ => {
            matches.sort();
            Err(StoreError::AmbiguousRun {
                given: given.to_owned(),
                matches,
            })
        }
    }
}
