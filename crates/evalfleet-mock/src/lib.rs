//! An OpenAI-compatible mock endpoint whose behaviour is configurable:
//! latency, time to first token and inter-token delay, answer length, injected
//! 5xx errors and a seeded mix of failures, 429 quotas with `Retry-After` and
//! OpenAI's `x-ratelimit-*` headers, a capacity-limited queue (whose
//! requests running and waiting it tells as llama.cpp, vLLM and SGLang tell
//! theirs), hangs, stalls, truncated or cut streams (and streams
//! interrupted by the next request, as llama-cpp-python's server does), and
//! a scripted outage. Answers are derived
//! from the prompt (by default the last user message, verbatim), so a test can
//! tell which item an answer belongs to. Every random decision is seeded.
//!
//! [`sheets`] is a stand-in of the Google Sheets API and of Google's token
//! endpoint, which the Sheets dataset source and results sink are tested
//! and benchmarked against.
//!
//! Without the `server` feature the crate is only [`MockSettings`] and the
//! types of its fields.

mod settings;
pub use settings::{Fault, MockSettings, Outage, Quota, QuotaMode};

#[cfg(feature = "server")]
mod server;
#[cfg(feature = "server")]
pub use server::{MockServer, Stats, StatsSnapshot, app, serve};
/// A stand-in of the Google Sheets API and Google's token endpoint.
#[cfg(feature = "server")]
pub mod sheets;
