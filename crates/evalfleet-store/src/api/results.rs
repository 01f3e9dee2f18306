//! Results and attempts read back: exported, scanned, paged side by side,
//! summarised; and new assessments of stored answers.

use serde::Serialize;
use serde_json::Value;

use evalfleet_types::{AgentCall, Assessment, ErrorClass, Failover, ItemStatus, Scores, Verdict};

use super::errors::{ExportError, StoreError};

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
    /// Why a failed item failed, as stored.
    pub error: Option<String>,
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
/// what it cost; which endpoint answered it, and its tries that failed on
/// others.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CallSample {
    pub seq: u64,
    pub attempt: u32,
    pub api: String,
    /// The endpoint that answered (empty when none did, or the cache).
    pub endpoint: String,
    pub latency_ms: f64,
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub error_class: Option<ErrorClass>,
    pub failovers: Vec<Failover>,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    /// Answered from the response cache.
    pub cached: bool,
    /// The agent got an error (an error class, or a status other than
    /// 2xx).
    pub failed: bool,
}

/// An agent call's failovers as a column holds them: JSON, or NULL for
/// none.
pub fn failovers_column(failovers: &[Failover]) -> Option<String> {
    (!failovers.is_empty()).then(|| serde_json::to_string(failovers).unwrap_or_default())
}

/// A failovers column read back (see [`failovers_column`]).
pub fn failovers_of(column: Option<String>) -> Result<Vec<Failover>, StoreError> {
    match column {
        None => Ok(Vec::new()),
        Some(text) => serde_json::from_str(&text).map_err(|err| {
            StoreError::Invariant(format!("an agent call's failovers are not readable: {err}"))
        }),
    }
}

impl CallSample {
    /// The sample of a whole call.
    pub fn of(call: &AgentCall) -> Self {
        Self {
            seq: call.seq,
            attempt: call.attempt,
            api: call.api.clone(),
            endpoint: call.telemetry.endpoint.clone(),
            latency_ms: call.telemetry.latency_ms,
            ttft_ms: call.telemetry.ttft_ms,
            tpot_ms: call.telemetry.tpot_ms,
            error_class: call.error_class,
            failovers: call.failovers.clone(),
            prompt_tokens: call.telemetry.prompt_tokens,
            completion_tokens: call.telemetry.completion_tokens,
            cached: call.cached,
            failed: call.error_class.is_some() || !(200..300).contains(&call.http_status),
        }
    }
}

/// How one of an item's attempts ended, as its record has it.
#[derive(Debug, Clone, PartialEq)]
pub struct AttemptEnd {
    pub seq: u64,
    pub attempt: u32,
    /// Why it failed; `None` when it succeeded.
    pub error: Option<String>,
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

    /// How the attempts of the items whose `seq` is in `seqs` ended, in
    /// (`seq`, `attempt`) order (an attempt still running, or cut short by
    /// a stop or a crash, has no record: it is not there).
    fn attempt_ends_of(
        &mut self,
        run_id: &str,
        seqs: std::ops::RangeInclusive<u64>,
        each: &mut dyn FnMut(AttemptEnd),
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
