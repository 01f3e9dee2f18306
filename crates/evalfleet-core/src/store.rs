//! The store: runs, items and their state, attempts, results and events.
//!
//! The trait is synchronous: a run gives its store to one writer thread, which
//! commits results in batches, one transaction per batch. SQLite implements it
//! in `evalfleet-store`; a PostgreSQL implementation sits beside it.

use serde::Serialize;
use serde_json::Value;

use evalfleet_types::{
    Assessment, AttemptRecord, CacheEntry, EndpointSnapshot, ErrorClass, Event, FleetChange,
    ItemStatus, ResultRecord, RunStatus, Scores, StateCounts,
};

use crate::dataset::{DatasetError, DatasetIdentity};
use crate::fingerprint::Fingerprint;
use crate::template::TemplateError;

/// A failure of the store itself (I/O, corruption, a broken invariant).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store: {message}")]
    Backend {
        message: String,
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    #[error("no run '{0}' in this store")]
    NoSuchRun(String),
    #[error("no store at {} (pass --store PATH to name another)", .0.display())]
    NoStore(std::path::PathBuf),
    #[error("run '{0}' is in progress in another process")]
    RunBusy(String),
    #[error("store invariant broken: {0}")]
    Invariant(String),
}

impl StoreError {
    pub fn backend(
        message: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self::Backend {
            message: message.into(),
            source: Some(Box::new(source)),
        }
    }
}

/// Why a run could not be created. Nothing of it is stored.
#[derive(Debug, thiserror::Error)]
pub enum CreateRunError {
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    #[error("{path}:{second_line}: duplicate item id '{id}' (first on line {first_line})")]
    DuplicateId {
        path: String,
        id: String,
        first_line: u64,
        second_line: u64,
    },
    #[error(transparent)]
    Template(#[from] TemplateError),
    #[error(
        "a run with id '{0}' already exists in this store (resume it with `evalfleet resume {0}`)"
    )]
    RunExists(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

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
    /// Orders items for sampling (see [`crate::dataset::sample_key`]).
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

/// Items for a new run, pulled by [`Store::create_run`] inside its
/// transaction.
pub trait ItemSource {
    fn next_item(&mut self) -> Result<Option<NewItem>, CreateRunError>;
    /// Called after the last item; an error here still undoes everything.
    fn finish(&mut self) -> Result<RunIdentity, CreateRunError>;
    /// The dataset's path, for messages.
    fn path(&self) -> String;
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
    /// How many times the run was started (1 + resumes).
    pub sessions: u32,
    /// Why it stopped, when it stopped early.
    pub message: Option<String>,
}

/// The start of a session (a run or a resume).
#[derive(Debug, Clone, Copy)]
pub struct SessionStart {
    /// 1 for the first run, 2 for the first resume, ...
    pub session: u32,
    /// Failed items put back to pending (`--retry-failed`).
    pub reset: u64,
    pub counts: StateCounts,
}

/// An item still to be answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingItem {
    pub item_id: String,
    pub seq: u64,
    pub line: u64,
    pub offset: u64,
    /// Attempts made for it in earlier sessions.
    pub prior_attempts: u32,
}

/// What one transaction commits.
#[derive(Debug, Clone, Default)]
pub struct Batch {
    pub attempts: Vec<AttemptRecord>,
    pub results: Vec<ResultRecord>,
    /// Answers for the cache.
    pub cache: Vec<CacheEntry>,
}

impl Batch {
    pub fn is_empty(&self) -> bool {
        self.attempts.is_empty() && self.results.is_empty() && self.cache.is_empty()
    }
}

/// What `evalfleet cache stats` shows.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CacheStats {
    pub entries: u64,
    /// Bytes of cached answers.
    pub content_bytes: u64,
    pub oldest_ms: Option<i64>,
    pub newest_ms: Option<i64>,
    /// Attempts answered from the cache, over every run of the store.
    pub hits: u64,
}

/// A row of `evalfleet export`, in the column order of the export contract.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ExportRow {
    pub item_id: String,
    pub status: ItemStatus,
    pub output: Option<String>,
    pub error: Option<String>,
    pub endpoint: Option<String>,
    pub model: Option<String>,
    pub attempts: u32,
    pub latency_ms: Option<f64>,
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub item: Value,
    /// The extracted answer (JSON), when the task parses answers.
    pub parsed: Option<Value>,
    /// Whether the answer parsed and met the schema, when the task checks.
    pub valid: Option<bool>,
    /// Metric key → item score.
    pub scores: Option<Scores>,
    /// The code judge's judgement: verdict, passed/total, error counts,
    /// failing tests.
    pub judge: Option<Value>,
}

/// A stored result, as `evalfleet score` and `report` read it.
#[derive(Debug, Clone)]
pub struct StoredResult {
    pub seq: u64,
    pub item_id: String,
    pub status: ItemStatus,
    pub output: Option<String>,
    pub endpoint: Option<String>,
    pub model: Option<String>,
    /// The input row, as JSON text.
    pub item: Option<String>,
    pub assessment: Assessment,
}

/// The part of an attempt that status summaries need.
#[derive(Debug, Clone, PartialEq)]
pub struct AttemptSample {
    pub endpoint: String,
    pub latency_ms: f64,
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub completion_tokens: Option<u64>,
    pub error_class: Option<ErrorClass>,
    /// The attempt did not succeed (with a class, an error; without one, a
    /// call moved to another endpoint).
    pub failed: bool,
}

/// Held while a process runs a run; released when dropped (or when the
/// process dies).
pub struct RunGuard(pub Box<dyn Send>);

/// The endpoints of a run as its process last wrote them.
#[derive(Debug, Clone, PartialEq)]
pub struct EndpointStates {
    pub updated_at_ms: i64,
    pub endpoints: Vec<EndpointSnapshot>,
}

pub trait Store: Send {
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

    /// Takes the run's lock, or fails with [`StoreError::RunBusy`].
    fn lock_run(&mut self, run_id: &str) -> Result<RunGuard, StoreError>;

    /// Whether a live process holds the run's lock.
    fn is_run_active(&mut self, run_id: &str) -> Result<bool, StoreError>;

    /// Marks the run running and counts a new session; with `retry_failed`,
    /// failed items (but not invalid rows) go back to pending and lose their
    /// result.
    fn begin_session(
        &mut self,
        run_id: &str,
        retry_failed: bool,
    ) -> Result<SessionStart, StoreError>;

    /// Pending items after `after_seq`, in `seq` order.
    fn pending_items(
        &mut self,
        run_id: &str,
        after_seq: Option<u64>,
        limit: usize,
    ) -> Result<Vec<PendingItem>, StoreError>;

    /// Commits attempts and results, and moves the results' items out of
    /// pending, in one transaction. An item that is not pending is an
    /// invariant error and nothing is committed.
    fn commit(&mut self, run_id: &str, batch: &Batch) -> Result<(), StoreError>;

    fn set_status(
        &mut self,
        run_id: &str,
        status: RunStatus,
        message: Option<&str>,
    ) -> Result<(), StoreError>;

    fn counts(&mut self, run_id: &str) -> Result<StateCounts, StoreError>;

    fn add_event(&mut self, run_id: &str, event: &Event) -> Result<(), StoreError>;

    fn events(&mut self, run_id: &str) -> Result<Vec<Event>, StoreError>;

    /// Calls `each` for every attempt of the run.
    fn scan_attempts(
        &mut self,
        run_id: &str,
        each: &mut dyn FnMut(AttemptSample),
    ) -> Result<(), StoreError>;

    /// Replaces the run's endpoint snapshots.
    fn put_endpoint_states(
        &mut self,
        run_id: &str,
        states: &[EndpointSnapshot],
    ) -> Result<(), StoreError>;

    /// The run's endpoint snapshots, if its process wrote any.
    fn endpoint_states(&mut self, run_id: &str) -> Result<Option<EndpointStates>, StoreError>;

    /// Records a fleet change for the running process to apply.
    fn request_fleet_change(
        &mut self,
        run_id: &str,
        change: &FleetChange,
    ) -> Result<(), StoreError>;

    /// The fleet changes not yet taken, oldest first; marks them taken.
    fn take_fleet_changes(&mut self, run_id: &str) -> Result<Vec<FleetChange>, StoreError>;

    /// Calls `each` for every result, in dataset order; stops at its first
    /// error.
    /// The cached answer for `key`, if stored at or after `since_ms`.
    fn cache_get(&mut self, key: &str, since_ms: i64) -> Result<Option<CacheEntry>, StoreError>;

    /// Drops entries older than `before_ms`, then the oldest beyond
    /// `max_entries`; returns how many went.
    fn cache_evict(
        &mut self,
        before_ms: Option<i64>,
        max_entries: Option<u64>,
    ) -> Result<u64, StoreError>;

    fn cache_stats(&mut self) -> Result<CacheStats, StoreError>;

    /// Empties the cache; returns how many entries went.
    fn cache_clear(&mut self) -> Result<u64, StoreError>;

    /// Every result of a run, in dataset order.
    fn scan_results(
        &mut self,
        run_id: &str,
        each: &mut dyn FnMut(StoredResult),
    ) -> Result<(), StoreError>;

    /// Replaces results' parsing, checks and scores, and the run's stored
    /// config, in one transaction (`evalfleet score`).
    fn put_assessments(
        &mut self,
        run_id: &str,
        assessments: &[(u64, Assessment)],
        config: &Value,
    ) -> Result<(), StoreError>;

    fn export(
        &mut self,
        run_id: &str,
        each: &mut dyn FnMut(ExportRow) -> std::io::Result<()>,
    ) -> Result<(), ExportError>;
}

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot write the export: {0}")]
    Write(#[from] std::io::Error),
}
