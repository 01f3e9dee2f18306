//! The store: runs, the work queue of their items, attempts and results,
//! the response cache, events and the fleet mailbox, each concern a trait of
//! its own; [`Store`] is all of them, as a backend implements them.
//!
//! The traits are synchronous: each thread of a session (the reader, the
//! writer, the fleet's housekeeping) owns a connection of its own. Several
//! workers (sessions, in one process or many) share a run through the work
//! queue: each claims items for a lease, renews it while it works, and
//! commits their results under it; a commit under a lease that has expired
//! is refused, so every item gets exactly one result whoever answers it.
//! SQLite implements them in `evalfleet-store`, opened by URL; PostgreSQL
//! goes beside it.

use serde::Serialize;
use serde_json::Value;

use evalfleet_types::{
    AgentCall, Assessment, AttemptRecord, CacheEntry, EndpointSnapshot, ErrorClass, Event, Fault,
    FleetChange, ItemStatus, ResourcePoint, ResultRecord, RunSample, RunStatus, Scores,
    StateCounts, Verdict,
};

use evalfleet_io::dataset::{DatasetError, DatasetIdentity};
use evalfleet_io::fingerprint::Fingerprint;
use evalfleet_io::template::TemplateError;

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
    /// The file is there, but it is not an evalfleet store.
    #[error("{} is not an evalfleet store ({why}); pass --store PATH to name one", path.display())]
    NotAStore {
        path: std::path::PathBuf,
        why: String,
    },
    /// A store written by a newer evalfleet, which this one cannot read.
    #[error(
        "{} was written by a newer evalfleet (store version {version}; this one reads up to {known}): upgrade evalfleet to read it",
        path.display()
    )]
    NewerStore {
        path: std::path::PathBuf,
        version: i64,
        known: i64,
    },
    /// `--store` (or `store:`) names no store this evalfleet can open.
    #[error("--store: {0}")]
    BadLocation(String),
    #[error("store invariant broken: {0}")]
    Invariant(String),
}

impl StoreError {
    pub fn fault(&self) -> Fault {
        match self {
            Self::NoSuchRun(_)
            | Self::NoStore(_)
            | Self::NotAStore { .. }
            | Self::NewerStore { .. }
            | Self::BadLocation(_) => Fault::BadInput,
            Self::Backend { .. } | Self::Invariant(_) => Fault::Failure,
        }
    }

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
    /// A template problem placed in the config file, with its line.
    #[error(transparent)]
    Config(evalfleet_config::ConfigError),
    #[error(
        "a run with id '{0}' already exists in this store (resume it with `evalfleet resume {0}`)"
    )]
    RunExists(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl CreateRunError {
    pub fn fault(&self) -> Fault {
        match self {
            Self::Store(err) => err.fault(),
            Self::Dataset(_)
            | Self::DuplicateId { .. }
            | Self::Template(_)
            | Self::Config(_)
            | Self::RunExists(_) => Fault::BadInput,
        }
    }
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

/// An item a worker claimed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingItem {
    pub item_id: String,
    pub seq: u64,
    pub line: u64,
    pub offset: u64,
    /// Attempts made for it in earlier sessions: the highest attempt
    /// number stored (calls answered from the cache take a number and
    /// store no row), so that its next attempt's number is new.
    pub prior_attempts: u32,
}

/// A claim's id, unique in the store.
pub type ClaimId = i64;

/// Items a worker holds until its lease runs out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub id: ClaimId,
    /// In `seq` order.
    pub items: Vec<PendingItem>,
}

/// What a worker's request for items got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claimed {
    Items(Claim),
    /// Every pending item is held by another worker's live lease, or waits
    /// out a stored wait: ask again later (they finish, their lease runs
    /// out, the wait passes).
    HeldByOthers,
    /// No pending item is left outside this worker's own claims.
    Nothing,
}

/// What one transaction commits: attempts and results, each under the
/// claim it was made for, and answers for the cache.
#[derive(Debug, Clone, Default)]
pub struct Batch {
    pub attempts: Vec<(ClaimId, AttemptRecord)>,
    pub results: Vec<(ClaimId, ResultRecord)>,
    pub cache: Vec<CacheEntry>,
    /// Calls agents made through the gateway (`kind: exec`), stored with
    /// the attempts that made them and refused with them.
    pub calls: Vec<(ClaimId, AgentCall)>,
    /// Items to be sent again no sooner than a while from the commit (a
    /// server's `Retry-After`, a backoff): the wait is stored with the
    /// item, so that whichever worker takes it next (this one, or another
    /// after this one died) waits it out.
    pub waits: Vec<(ClaimId, NotBefore)>,
}

impl Batch {
    pub fn is_empty(&self) -> bool {
        self.attempts.is_empty()
            && self.results.is_empty()
            && self.cache.is_empty()
            && self.calls.is_empty()
            && self.waits.is_empty()
    }
}

/// An item that is not to be sent again before `wait` has passed, counted
/// from when its commit is stored (on the store's clock: a worker's clock
/// may be wrong).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotBefore {
    pub seq: u64,
    pub wait: std::time::Duration,
}

/// What a heartbeat learned.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Renewal {
    /// Claims the worker holds.
    pub claims: u64,
    /// Items (`seq`) the worker lost since its last heartbeat: what it
    /// makes of them will be refused (PostgreSQL says; SQLite, whose
    /// claims are ranges, does not).
    pub lost: Vec<u64>,
}

/// What a commit stored.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Committed {
    /// Results stored.
    pub results: u64,
    /// Items (`seq`) whose attempts and results were refused: their claim
    /// is no longer this worker's (its lease ran out). Another worker
    /// answers them.
    pub refused: Vec<u64>,
}

/// What `evalfleet cache stats` shows.
#[derive(Debug, Clone, Default, PartialEq, Serialize, utoipa::ToSchema)]
pub struct CacheStats {
    pub entries: u64,
    /// Bytes of cached answers.
    pub content_bytes: u64,
    pub oldest_ms: Option<i64>,
    pub newest_ms: Option<i64>,
    /// Calls answered from the cache, over every run of the store.
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
    /// `completion_tokens` was counted from the stream's chunks (shown
    /// only when it was).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub tokens_estimated: bool,
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
    /// Why the answer could not be used (it did not parse, or broke the
    /// schema), when it could not.
    pub check_error: Option<String>,
    /// The rule of `task.prompts` that made its messages (`default`:
    /// `task.messages`), when the task has rules (left out otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    /// The images the item's request sent: source, page, SHA-256 and size
    /// (shown only when there were any).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub images: Vec<evalfleet_types::ImageRef>,
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
    /// For a failed item, the class of its last failed call (`None` when
    /// no call failed: an item its task could not ask).
    pub failure: Option<ErrorClass>,
    /// The rule of `task.prompts` that made its messages.
    pub prompt: Option<String>,
}

/// The order of a page of results.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResultOrder {
    /// Dataset order (`seq`).
    Seq,
    /// Item-id order (byte order of the ids).
    Key,
}

/// A result as a page of them hands it, borrowed from the store: what a
/// comparison needs, and nothing it must copy or parse unless it keeps it.
#[derive(Debug, Clone, Copy)]
pub struct ResultView<'a> {
    pub seq: u64,
    pub item_id: &'a str,
    pub status: ItemStatus,
    pub verdict: Option<Verdict>,
    /// The scores, as stored (JSON: metric key → score).
    pub scores: Option<&'a str>,
    /// The input row (JSON), when asked for.
    pub item: Option<&'a str>,
    /// For a failed item, the class of its last failed call.
    pub failure: Option<ErrorClass>,
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

/// What a report needs of an agent's call: its item, attempt and API, and
/// what it cost.
#[derive(Debug, Clone, PartialEq)]
pub struct CallSample {
    pub seq: u64,
    pub attempt: u32,
    pub api: String,
    pub latency_ms: f64,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    /// Answered from the response cache.
    pub cached: bool,
    /// The agent got an error (an error class, or a status other than
    /// 2xx).
    pub failed: bool,
}

impl CallSample {
    /// The sample of a whole call.
    pub fn of(call: &AgentCall) -> Self {
        Self {
            seq: call.seq,
            attempt: call.attempt,
            api: call.api.clone(),
            latency_ms: call.telemetry.latency_ms,
            prompt_tokens: call.telemetry.prompt_tokens,
            completion_tokens: call.telemetry.completion_tokens,
            cached: call.cached,
            failed: call.error_class.is_some() || !(200..300).contains(&call.http_status),
        }
    }
}

/// The endpoints of a run as its workers last wrote them.
#[derive(Debug, Clone, PartialEq)]
pub struct EndpointStates {
    pub updated_at_ms: i64,
    pub endpoints: Vec<EndpointSnapshot>,
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

    fn set_status(
        &mut self,
        run_id: &str,
        status: RunStatus,
        message: Option<&str>,
    ) -> Result<(), StoreError>;

    fn counts(&mut self, run_id: &str) -> Result<StateCounts, StoreError>;

    /// The run's registered workers, live or not: whether each still lives
    /// is for the reader to judge (by its process, or its heartbeat).
    fn workers(&mut self, run_id: &str) -> Result<Vec<WorkerInfo>, StoreError>;

    /// What each worker that committed results of the run committed, by
    /// worker name, whether it still lives or not.
    fn worker_work(&mut self, run_id: &str) -> Result<Vec<WorkerWork>, StoreError>;
}

/// The work queue: items handed out by claims with a lease.
pub trait WorkQueue {
    /// Claims up to `limit` pending items that no live lease holds, in `seq`
    /// order from just after `after` (or from the start), for `lease`.
    /// Expired claims of any worker are dropped first, so their items are
    /// claimed again. An item whose stored wait ([`NotBefore`]) has not
    /// passed is not claimed: it counts as held by others until it has.
    fn claim(
        &mut self,
        run_id: &str,
        worker: &str,
        after: Option<u64>,
        limit: usize,
        lease: std::time::Duration,
    ) -> Result<Claimed, StoreError>;

    /// Extends every live claim of `worker` (and its heartbeat) by `lease`
    /// from now; returns how many claims it holds, and the items it lost
    /// since it last asked (their lease ran out and another worker's claim
    /// returned them to pending) where the backend keeps track of them. A
    /// claim that already ran out stays lost.
    fn renew(
        &mut self,
        run_id: &str,
        worker: &str,
        lease: std::time::Duration,
    ) -> Result<Renewal, StoreError>;

    /// Commits attempts and results, and moves the results' items out of
    /// pending, in one transaction. What was made under a claim that is no
    /// longer `worker`'s and live is refused, not stored. A result for an
    /// item of a live claim that is not pending is an invariant error and
    /// nothing is committed. A claim whose items have all ended is dropped.
    fn commit(
        &mut self,
        run_id: &str,
        worker: &str,
        batch: &Batch,
    ) -> Result<Committed, StoreError>;

    /// Ends `worker`'s part: its claims are dropped (their pending items are
    /// free for others at once) and it is no longer registered.
    fn release(&mut self, run_id: &str, worker: &str) -> Result<(), StoreError>;
}

/// Results and attempts, read back; and new assessments of stored answers.
pub trait Results {
    /// Calls `each` for every attempt of the run.
    fn scan_attempts(
        &mut self,
        run_id: &str,
        each: &mut dyn FnMut(AttemptSample),
    ) -> Result<(), StoreError>;

    /// Every result of a run, in dataset order.
    fn scan_results(
        &mut self,
        run_id: &str,
        each: &mut dyn FnMut(StoredResult),
    ) -> Result<(), StoreError>;

    fn export(
        &mut self,
        run_id: &str,
        each: &mut dyn FnMut(ExportRow) -> std::io::Result<()>,
    ) -> Result<(), ExportError>;

    /// Hands `each` up to `limit` results of a run in `order`, those after
    /// `after` (the last one of the page before: its id and seq), each as
    /// the store reads it, with its item only when `with_item`; returns
    /// how many it handed. Pages of this read two runs side by side.
    fn results_page(
        &mut self,
        run_id: &str,
        order: ResultOrder,
        after: Option<(&str, u64)>,
        limit: usize,
        with_item: bool,
        each: &mut dyn FnMut(ResultView<'_>) -> Result<(), StoreError>,
    ) -> Result<usize, StoreError>;

    /// Calls `each` for every call agents made through the gateway for the
    /// run's items (`kind: exec`), in (`seq`, `attempt`, `index`) order.
    fn scan_calls(
        &mut self,
        run_id: &str,
        each: &mut dyn FnMut(AgentCall),
    ) -> Result<(), StoreError> {
        self.scan_calls_of(run_id, 0..=u64::MAX, each)
    }

    /// Calls `each` with the figures of every agent call of the run, in
    /// the order of [`Results::scan_calls`], without their bodies (what a
    /// report needs of them).
    fn scan_call_samples(
        &mut self,
        run_id: &str,
        each: &mut dyn FnMut(CallSample),
    ) -> Result<(), StoreError> {
        self.scan_calls(run_id, &mut |call| each(CallSample::of(&call)))
    }

    /// [`Results::scan_calls`] for the items whose `seq` is in `seqs`: a
    /// page of results read with its calls.
    fn scan_calls_of(
        &mut self,
        run_id: &str,
        seqs: std::ops::RangeInclusive<u64>,
        each: &mut dyn FnMut(AgentCall),
    ) -> Result<(), StoreError>;

    /// Replaces results' assessments and the run's stored config, in one
    /// transaction (`evalfleet score`).
    fn put_assessments(
        &mut self,
        run_id: &str,
        assessments: &[(u64, Assessment)],
        config: &Value,
    ) -> Result<(), StoreError>;
}

/// The response cache, shared by every run of the store (or kept in a file
/// of its own).
pub trait ResponseCache {
    /// The cached answer for `key`, if stored at or after `since_ms`.
    fn cache_get(&mut self, key: &str, since_ms: i64) -> Result<Option<CacheEntry>, StoreError>;

    /// The cached answers for `keys`, in their order (in one read of the
    /// store).
    fn cache_get_many(
        &mut self,
        keys: &[&str],
        since_ms: i64,
    ) -> Result<Vec<Option<CacheEntry>>, StoreError>;

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
}

/// Lifecycle facts and what the workers last saw of their endpoints.
pub trait Events {
    fn add_events(&mut self, run_id: &str, events: &[Event]) -> Result<(), StoreError>;

    fn events(&mut self, run_id: &str) -> Result<Vec<Event>, StoreError>;

    /// Replaces the run's snapshots of these endpoints.
    fn put_endpoint_states(
        &mut self,
        run_id: &str,
        states: &[EndpointSnapshot],
    ) -> Result<(), StoreError>;

    /// The run's endpoint snapshots, if a worker wrote any.
    fn endpoint_states(&mut self, run_id: &str) -> Result<Option<EndpointStates>, StoreError>;

    /// Adds a second of the run as a worker saw it (its timeline).
    fn add_sample(&mut self, run_id: &str, sample: &RunSample) -> Result<(), StoreError>;

    /// The run's samples after `after_ms` (every worker's), oldest first,
    /// at most `limit`.
    fn samples(
        &mut self,
        run_id: &str,
        after_ms: i64,
        limit: usize,
    ) -> Result<Vec<RunSample>, StoreError>;
}

/// Requests to change the fleet of a running run (`evalfleet fleet`),
/// read by each of its workers.
pub trait FleetMailbox {
    /// Posts a change; returns it with its id.
    fn request_fleet_change(
        &mut self,
        run_id: &str,
        change: &FleetChange,
    ) -> Result<FleetChange, StoreError>;

    /// The changes posted after `after_id`, oldest first.
    fn fleet_changes(
        &mut self,
        run_id: &str,
        after_id: i64,
    ) -> Result<Vec<FleetChange>, StoreError>;
}

/// Where an item is in its run.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, serde::Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum ItemState {
    Pending,
    Done,
    Failed,
}

impl ItemState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Done => "done",
            Self::Failed => "failed",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "pending" => Some(Self::Pending),
            "done" => Some(Self::Done),
            "failed" => Some(Self::Failed),
            _ => None,
        }
    }
}

/// What a page of a run's items is sorted by (then by `seq`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum SortKey {
    /// Dataset order.
    #[default]
    Seq,
    Latency,
    Ttft,
    Tpot,
    CompletionTokens,
    Attempts,
    /// When the item ended.
    Finished,
    /// A metric's score (its key, `exact_match@1`, or its `as:`).
    Score(String),
}

/// A score between bounds (either may be open).
#[derive(Debug, Clone, PartialEq)]
pub struct ScoreRange {
    pub metric: String,
    pub min: Option<f64>,
    pub max: Option<f64>,
}

/// Where the previous page ended: the sort key's value (`None` for an item
/// without one, which sorts first) and the item's `seq`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ItemCursor {
    pub value: Option<f64>,
    pub seq: u64,
}

/// Which of a run's items to list, in what order, from where. Every filter
/// given must hold; the rows come a page at a time, each page starting
/// after the last row of the one before (keyset paging: a page costs the
/// same wherever it is).
#[derive(Debug, Clone, Default)]
pub struct ItemQuery {
    /// Items in these states (none: every state).
    pub states: Vec<ItemState>,
    /// Items whose dataset row has these values (`field` = `value`, the
    /// value as text; numbers as JSON writes them). Pending items have no
    /// row stored yet and never match.
    pub fields: Vec<(String, String)>,
    pub scores: Vec<ScoreRange>,
    /// Items one of whose calls failed with this class.
    pub error_class: Option<ErrorClass>,
    /// Items answered by this endpoint.
    pub endpoint: Option<String>,
    pub latency_ms: (Option<f64>, Option<f64>),
    pub completion_tokens: (Option<u64>, Option<u64>),
    /// Items whose answer (or error) contains this text (any case).
    pub text: Option<String>,
    pub sort: SortKey,
    pub descending: bool,
    pub after: Option<ItemCursor>,
    /// Rows on a page.
    pub limit: u32,
}

/// An item as a row of the results table.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ItemRow {
    pub seq: u64,
    pub item_id: String,
    pub state: ItemState,
    /// The answer (on a page, its first [`OUTPUT_PREVIEW`] characters).
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
    /// Whether the answer parsed and met the schema, when the task checks.
    pub verdict: Option<evalfleet_types::Verdict>,
    pub scores: Option<Scores>,
    /// The dataset row (stored with the item's result).
    pub item: Option<Value>,
    pub finished_at_ms: Option<i64>,
    /// The code judge's verdict on the answer, when a code task judged it.
    pub judged: Option<JudgedRow>,
}

/// The code judge's judgement of an answer, in short.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct JudgedRow {
    /// `success`, `wrong_answer`, `runtime_error`, `timeout`, ...
    pub verdict: String,
    /// Tests passed, of `total`.
    pub passed: u64,
    pub total: u64,
}

/// Characters of an answer a page shows.
pub const OUTPUT_PREVIEW: usize = 300;

/// A page of items, and where the next begins (`None`: this is the last).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ItemPage {
    pub rows: Vec<ItemRow>,
    #[serde(skip)]
    pub next: Option<ItemCursor>,
}

/// One item in full: its row, what checking made of its answer, the code
/// judge's judgement, and every attempt.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ItemRecord {
    #[serde(flatten)]
    pub row: ItemRow,
    pub parsed: Option<Value>,
    pub check_error: Option<String>,
    pub reasks: u32,
    pub judge: Option<Value>,
    /// Every attempt, in order (`attempts` is their count).
    pub attempt_records: Vec<AttemptRecord>,
    /// Calls answered from the cache.
    pub cached: u32,
    /// The rule of `task.prompts` that made its messages (left out when
    /// the task has no rules).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    /// The calls its agent made through the gateway (`kind: exec`), every
    /// attempt's, in order (left out when there were none).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub calls: Vec<AgentCall>,
}

/// A run's items explored: pages of them, filtered and sorted, and one in
/// full.
pub trait Explore {
    fn items(&mut self, run_id: &str, query: &ItemQuery) -> Result<ItemPage, StoreError>;

    /// The item with this id, with its attempts and its agent's calls;
    /// `None` if the run has no such item.
    fn item(&mut self, run_id: &str, item_id: &str) -> Result<Option<ItemRecord>, StoreError>;

    /// The first `chars` characters of the answer of each of `item_ids`
    /// (`None` where there is none), without the rest of the item: what a
    /// comparison shows of the items it lists.
    fn answers(
        &mut self,
        run_id: &str,
        item_ids: &[&str],
        chars: usize,
    ) -> Result<Vec<Option<String>>, StoreError>;
}

/// A report or comparison computed once and kept with the runs it reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptReport {
    /// The generations of the runs it was computed from (see
    /// [`RunRecord::generation`]): it holds while they are unchanged.
    pub fingerprint: String,
    /// The report, as served.
    pub body: String,
}

/// Reports kept per run, at most.
pub const KEPT_PER_RUN: usize = 32;

/// Reports and comparisons kept, so that a finished run's are computed
/// once for every process that shares the store.
pub trait KeptReports {
    /// What was kept for `run_id` under `key`, whatever its fingerprint.
    fn kept_report(&mut self, run_id: &str, key: &str) -> Result<Option<KeptReport>, StoreError>;

    /// Keeps `report` for `run_id` under `key`, replacing what was; of a
    /// run's reports only the [`KEPT_PER_RUN`] kept last stay (the
    /// questions asked of a run are chosen by whoever asks).
    fn keep_report(
        &mut self,
        run_id: &str,
        key: &str,
        report: &KeptReport,
    ) -> Result<(), StoreError>;
}

/// A run's resource telemetry (`telemetry:`): bounded series of points.
pub trait Resources {
    /// Adds points (single samples) to the run's series. A series keeps at
    /// most [`evalfleet_types::POINTS_PER_SERIES`] points: past that,
    /// neighbours are merged into points of even width
    /// ([`evalfleet_types::merge_evenly`]), peaks and means kept exact. A point at the same time as a stored one
    /// of its series is merged into it.
    fn add_resource_points(
        &mut self,
        run_id: &str,
        points: &[ResourcePoint],
    ) -> Result<(), StoreError>;

    /// The run's points whose last sample is after `after_ms`, by series,
    /// then time.
    fn resource_points(
        &mut self,
        run_id: &str,
        after_ms: i64,
    ) -> Result<Vec<ResourcePoint>, StoreError>;
}

/// What a shared quota counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuotaKind {
    /// Calls (a provider's requests per minute).
    Requests,
    /// Prompt and completion tokens (its tokens per minute).
    Tokens,
}

impl QuotaKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Requests => "requests",
            Self::Tokens => "tokens",
        }
    }
}

/// A provider's quota as every worker using the same API key for the same
/// model shares it: the quota belongs to the key, not to a worker, so
/// workers pacing themselves each to the whole of it would together send
/// several times it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SharedQuota {
    /// The SHA-256 of the API key, in hex: the key itself is never stored.
    pub key: String,
    pub model: String,
    pub kind: QuotaKind,
    /// Units a minute (as `rpm` or `tpm` says).
    pub per_minute: u64,
}

impl SharedQuota {
    /// The seconds one unit takes to come back.
    pub fn unit_secs(&self) -> f64 {
        60.0 / self.per_minute.max(1) as f64
    }

    /// Units that may be taken at once when none was for a while: one
    /// second's worth (at least one), as the endpoint's own bucket allows.
    pub fn burst(&self) -> f64 {
        (self.per_minute as f64 / 60.0).max(1.0)
    }
}

/// What a take of a shared quota got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Granted {
    /// Units granted (at most those asked for).
    pub units: u64,
    /// When none was: how long until one is (the rest of a cool-down, or
    /// the next unit's time). Zero when some were.
    pub wait: std::time::Duration,
}

/// Quotas shared by every worker of the store (see [`SharedQuota`]). A
/// store that workers do not share (SQLite, one machine's file) shares
/// nothing: its defaults grant whatever is asked, and each worker's own
/// rate limiter is then the only one.
pub trait Quotas {
    /// Whether takes are shared with other workers; when not, there is no
    /// point in asking.
    fn shares_quotas(&self) -> bool {
        false
    }

    /// Takes up to `want` units of `quota` now: as many as its burst
    /// allows, none during a cool-down.
    fn take_quota(&mut self, quota: &SharedQuota, want: u64) -> Result<Granted, StoreError> {
        let _ = quota;
        Ok(Granted {
            units: want,
            wait: std::time::Duration::ZERO,
        })
    }

    /// Gives back `units` taken and not used (a lease that ran out, a call
    /// that used fewer tokens than estimated); a negative number takes that
    /// many more, whatever is left (a call that used more than estimated
    /// has used them).
    fn refund_quota(&mut self, quota: &SharedQuota, units: i64) -> Result<(), StoreError> {
        let _ = (quota, units);
        Ok(())
    }

    /// Stops every take of `quota` for `wait` from now (a 429's
    /// `Retry-After`); a cool-down already longer stays.
    fn cool_quota(
        &mut self,
        quota: &SharedQuota,
        wait: std::time::Duration,
    ) -> Result<(), StoreError> {
        let _ = (quota, wait);
        Ok(())
    }
}

/// The store's traits, to call their methods on a `dyn Store`.
pub mod prelude {
    pub use super::{
        Events, Explore, FleetMailbox, KeptReports, Quotas, Resources, ResponseCache, Results,
        Runs, Store, WorkQueue,
    };
}

/// Every concern of a store, as a backend implements them.
pub trait Store:
    Runs
    + WorkQueue
    + Results
    + ResponseCache
    + Events
    + FleetMailbox
    + Explore
    + KeptReports
    + Resources
    + Quotas
    + Send
{
}

impl<
    T: Runs
        + WorkQueue
        + Results
        + ResponseCache
        + Events
        + FleetMailbox
        + Explore
        + KeptReports
        + Resources
        + Quotas
        + Send,
> Store for T
{
}

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot write the export: {0}")]
    Write(#[from] std::io::Error),
}

impl ExportError {
    pub fn fault(&self) -> Fault {
        match self {
            Self::Store(err) => err.fault(),
            Self::Write(_) => Fault::Failure,
        }
    }
}
