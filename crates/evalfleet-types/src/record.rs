//! What is stored of runs, items, calls and results.

use serde::{Deserialize, Serialize};

use crate::{Assessment, ErrorClass};

/// Where a run stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunStatus {
    /// A worker is running it, or was when it died.
    Running,
    /// Stopped before every item ended; resumable.
    Interrupted,
    /// Every item ended, done or failed.
    Finished,
}

crate::names!(RunStatus, "run status", {
    Running => "running",
    Interrupted => "interrupted",
    Finished => "finished",
});

/// An item's terminal state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ItemStatus {
    Done,
    Failed,
}

crate::names!(ItemStatus, "item status", {
    Done => "done",
    Failed => "failed",
});

/// Item counts by state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct StateCounts {
    pub pending: u64,
    pub done: u64,
    pub failed: u64,
}

impl StateCounts {
    pub fn total(&self) -> u64 {
        self.pending + self.done + self.failed
    }
}

/// What was measured of one call (or, for a result, of the call that gave
/// its answer).
#[derive(Debug, Clone, Default, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Telemetry {
    pub endpoint: String,
    pub model: String,
    /// Send to the last byte.
    pub latency_ms: f64,
    /// Send to the first content token (streams).
    pub ttft_ms: Option<f64>,
    /// (latency - TTFT) / (completion tokens - 1).
    pub tpot_ms: Option<f64>,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    /// `completion_tokens` was counted from a stream's content chunks, the
    /// stream having carried no usage.
    pub tokens_estimated: bool,
    pub finish_reason: Option<String>,
}

/// One call to one endpoint (a call answered from the cache is not one:
/// its item's result counts it).
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct AttemptRecord {
    /// The item's `seq`.
    pub seq: u64,
    /// 1-based, counted over every session of the run.
    pub attempt: u32,
    pub session: u32,
    pub sent_at_ms: i64,
    #[serde(flatten)]
    pub telemetry: Telemetry,
    pub http_status: Option<u16>,
    /// `None` for a success, and for a call moved to another endpoint (its
    /// `error` says so).
    pub error_class: Option<ErrorClass>,
    pub error: Option<String>,
}

/// One call an agent made through the gateway under an item's address
/// (`kind: exec`): what it asked, what it got, and what was measured. An
/// item's calls are stored with the attempt of the agent that made them,
/// in the order they were made.
#[derive(Debug, Clone, Default, PartialEq, Serialize, utoipa::ToSchema)]
pub struct AgentCall {
    /// The item's `seq`.
    pub seq: u64,
    /// The item's attempt (one run of the agent) that made it.
    pub attempt: u32,
    /// 1-based, in the order the calls were made within the attempt.
    pub index: u32,
    /// Unique in the run: `<seq>.<attempt>.<index>`, also sent back to the
    /// agent in the `x-evalfleet-call-id` header.
    pub call_id: String,
    /// The API called: `chat.completions`, `completions`, `responses`,
    /// `embeddings` or `models`.
    pub api: String,
    /// The model name the agent asked for (before aliases).
    pub asked_model: String,
    pub sent_at_ms: i64,
    /// The endpoint that answered (empty when none did), its model,
    /// latency, TTFT, TPOT and tokens.
    #[serde(flatten)]
    pub telemetry: Telemetry,
    pub stream: bool,
    /// Answered from the response cache (no endpoint was called).
    pub cached: bool,
    /// The status the agent got.
    pub http_status: u16,
    pub error_class: Option<ErrorClass>,
    pub error: Option<String>,
    /// The request body as the agent sent it (JSON text), whole: stored
    /// compressed when long. Cut to `BODY_KEPT` bytes only where the
    /// gateway refused it as too large, or in a store written before
    /// bodies were kept whole (then not valid JSON): `request_cut` says so.
    pub request: String,
    pub request_cut: bool,
    /// What the agent got: for a chat completion the assistant's message
    /// (content and tool calls), assembled from a stream; else the response
    /// body (JSON text, whole up to `BODY_KEPT` bytes).
    pub response: Option<String>,
    /// Tags the agent sent: `traceparent`, `user`, `metadata` (a JSON
    /// object), when it sent any.
    pub tags: Option<String>,
    /// Tries of the call that failed before their first byte on another
    /// endpoint, after which the gateway tried the next one (the agent saw
    /// only the last): in the order they were made.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failovers: Vec<Failover>,
}

/// A try of an agent's call that failed on one endpoint before its first
/// byte, and was made again on another (see [`AgentCall::failovers`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Failover {
    pub endpoint: String,
    pub latency_ms: f64,
    /// The endpoint's status, when it answered one.
    pub http_status: Option<u16>,
    pub error_class: Option<ErrorClass>,
    pub error: Option<String>,
}

/// How much of a call's request or response body is kept: as much as the
/// gateway takes in a request, so that every request it takes is kept
/// whole.
pub const BODY_KEPT: usize = 16 << 20;

/// An item's terminal outcome.
#[derive(Debug, Clone, PartialEq)]
pub struct ResultRecord {
    pub seq: u64,
    pub item_id: String,
    pub status: ItemStatus,
    pub output: Option<String>,
    pub error: Option<String>,
    /// The call that gave the answer (or the last that failed); `None` when
    /// no call was made.
    pub telemetry: Option<Telemetry>,
    /// Calls made for the item, over every session (answered from the
    /// cache included).
    pub attempts: u32,
    /// Of those, calls answered from the cache (no endpoint was called).
    pub cached: u32,
    /// The input row, as JSON text.
    pub item: Option<String>,
    pub finished_at_ms: i64,
    pub assessment: Assessment,
    /// The rule of `task.prompts` that made its messages (`default`:
    /// `task.messages`); `None` when the task has no rules.
    pub prompt: Option<String>,
    /// The images its request sent: where each came from and the hash of
    /// the bytes sent, never the bytes.
    pub images: Vec<ImageRef>,
}

/// An image sent with an item's request, as the store keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageRef {
    /// The value it came from: a path as the dataset gives it, a URL, or a
    /// data URL or base64 shortened to its kind and length.
    pub source: String,
    /// The page of a PDF it is (from 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page: Option<u32>,
    /// SHA-256 of the bytes sent (hex); `None` when the URL itself was sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// Bytes sent (before base64).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
}

/// One stored answer of the response cache.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheEntry {
    /// Hex SHA-256 of the request.
    pub key: String,
    pub content: String,
    /// The endpoint that answered, and its model.
    pub endpoint: String,
    pub model: String,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub finish_reason: Option<String>,
    pub latency_ms: f64,
    pub created_at_ms: i64,
}
