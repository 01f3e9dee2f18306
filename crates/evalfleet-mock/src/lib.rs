//! An OpenAI-compatible mock endpoint whose behaviour is configurable:
//! latency, time to first token and inter-token delay, answer length, injected
//! 5xx errors, 429 quotas with `Retry-After`, a capacity-limited queue, hangs
//! and truncated responses. Answers are derived from the prompt (by default
//! the last user message, verbatim), so a test can tell which item an answer
//! belongs to. Every random decision is seeded.
//!
//! Without the `server` feature the crate is only [`MockSettings`].

mod settings;
pub use settings::MockSettings;

#[cfg(feature = "server")]
mod server;
#[cfg(feature = "server")]
pub use server::{MockServer, Stats, StatsSnapshot, app, serve};
