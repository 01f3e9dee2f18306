//! `endpoints[].health`: how an endpoint is watched, and after how many
//! failures and successes it is taken out and brought back.

use std::time::Duration;

use schemars::JsonSchema;
use serde::Deserialize;

use crate::path;
use crate::problems::Problems;

/// `health:` how an endpoint is watched. Its calls are the signal while
/// they go well; a monitor probes it once it has shown no sign of life
/// (an answer, a streamed token) for `interval`, so when it is idle or its
/// calls fail or hang; failed calls count too. After `max_failures`
/// failures in a row it is unhealthy and gets no new items (its calls in
/// flight go to other endpoints); after `recover_after` successes it is
/// healthy again.
#[derive(Debug, Clone, PartialEq)]
pub struct HealthSettings {
    /// The probe's path on the server (`/health`); default: the engine
    /// preset's, else `models` under the base URL.
    pub path: Option<String>,
    /// Default `5s`.
    pub interval: Duration,
    /// Default `10s`.
    pub timeout: Duration,
    /// Default 3.
    pub max_failures: u32,
    /// Default 2.
    pub recover_after: u32,
    /// How long an endpoint whose calls fail far more often than its
    /// peers' (or all fail while it answers probes) is taken out the first
    /// time; each ejection soon after another lasts one more of these
    /// (up to ten). Default `30s`.
    pub ejection: Duration,
    /// An engine evalfleet started is hung when calls are in flight and
    /// none has shown a sign of life for this long (four times its calls'
    /// usual latency when that is longer; five times this before any call
    /// has answered), even while it answers probes. Default `60s`.
    pub hang_after: Duration,
}

impl Default for HealthSettings {
    fn default() -> Self {
        Self {
            path: None,
            interval: Duration::from_secs(5),
            timeout: Duration::from_secs(10),
            max_failures: 3,
            recover_after: 2,
            ejection: Duration::from_secs(30),
            hang_after: Duration::from_secs(60),
        }
    }
}

/// How an endpoint is watched. While its calls go well they are the
/// signal, and it is not probed: a monitor probes it once it has shown no
/// sign of life (an answer, a streamed token) for `interval`, which is when
/// it is idle or its calls fail or hang. Failed calls count too. After
/// `max_failures` failures in a row it is unhealthy and gets no new items
/// (its calls in flight go to other endpoints); after `recover_after`
/// successes it is healthy again. Default: every key's default.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub(super) struct RawHealth {
    /// The probe's path on the server (`/health`): one that costs the
    /// server nothing, as a probe of an endpoint whose calls hang competes
    /// with them. Default: for an engine evalfleet starts with a preset,
    /// the engine's own (`/health` for llama.cpp, vLLM and SGLang,
    /// `/api/version` for Ollama); else `models` under the base URL (every
    /// OpenAI-compatible server has it; llama-cpp-python's waits for the
    /// model while a call runs).
    path: Option<String>,
    /// How long the endpoint may show no sign of life (no answer, no
    /// streamed token) before it is probed; an unhealthy one is probed
    /// five times as often. Default `5s`.
    #[schemars(with = "Option<crate::schema::Duration>")]
    interval: Option<String>,
    /// The time a probe may take. Default `10s`.
    #[schemars(with = "Option<crate::schema::Duration>")]
    timeout: Option<String>,
    /// Failures in a row after which the endpoint is unhealthy. Default 3.
    max_failures: Option<u32>,
    /// Successes in a row after which it is healthy again. Default 2.
    recover_after: Option<u32>,
    /// How long an endpoint whose calls fail far more often than its
    /// peers' (or all fail while it answers probes) is taken out the first
    /// time; each ejection soon after another lasts one more of these (up
    /// to ten). Default `30s`.
    #[schemars(with = "Option<crate::schema::Duration>")]
    ejection: Option<String>,
    /// For an engine evalfleet starts (`local`, `remote`): how long its
    /// calls may be in flight with none showing a sign of life (an answer,
    /// a streamed token) before it is taken for hung, even while it
    /// answers probes, and restarted (its calls go again). Four times its
    /// calls' usual latency when that is longer; five times this before
    /// any of its calls has answered. Default `60s`.
    #[schemars(with = "Option<crate::schema::Duration>")]
    hang_after: Option<String>,
}

pub(super) fn health(raw: RawHealth, at: &str, p: &mut Problems<'_>) -> Option<HealthSettings> {
    let defaults = HealthSettings::default();
    let field = |name: &str| path::key(at, name);
    let path = match raw.path {
        Some(path) if !path.starts_with('/') => {
            p.push(&field("path"), format!("must start with '/', got '{path}'"))
        }
        other => Some(other),
    };
    let interval = p.duration(&field("interval"), raw.interval.as_deref(), "5s");
    let timeout = p.duration(&field("timeout"), raw.timeout.as_deref(), "10s");
    let ejection = p.duration(&field("ejection"), raw.ejection.as_deref(), "30s");
    let hang_after = p.duration(&field("hang_after"), raw.hang_after.as_deref(), "60s");
    let max_failures = match raw.max_failures {
        Some(0) => p.push(&field("max_failures"), "must be at least 1, got 0"),
        other => Some(other.unwrap_or(defaults.max_failures)),
    };
    let recover_after = match raw.recover_after {
        Some(0) => p.push(&field("recover_after"), "must be at least 1, got 0"),
        other => Some(other.unwrap_or(defaults.recover_after)),
    };
    Some(HealthSettings {
        path: path?,
        interval: interval?,
        timeout: timeout?,
        max_failures: max_failures?,
        recover_after: recover_after?,
        ejection: ejection?,
        hang_after: hang_after?,
    })
}
