//! A run's items explored: pages of them, filtered and sorted, and one in
//! full.

use serde::Serialize;
use serde_json::Value;

use evalfleet_types::{AgentCall, AttemptRecord, ErrorClass, Scores};

use super::errors::StoreError;

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
