//! `endpoints[].load`: how an engine's own account of its load is read, and
//! the engines that give one.

use std::time::Duration;

use schemars::JsonSchema;
use serde::Deserialize;

use crate::path;
use crate::problems::Problems;

/// `load:` how the engine's own account of its load is read: how many
/// requests it can run at once, runs and queues (see `docs/fleet.md`).
#[derive(Debug, Clone, PartialEq)]
pub struct LoadSettings {
    /// Whose answers they are; `None`: not read.
    pub engine: Option<LoadEngine>,
    /// Where the reading is, on the server's origin; default the engine's.
    pub path: Option<String>,
    /// Between readings while calls are in flight. Default `1s`.
    pub interval: Duration,
}

impl Default for LoadSettings {
    fn default() -> Self {
        Self {
            engine: None,
            path: None,
            interval: Duration::from_secs(1),
        }
    }
}

/// The engines whose load evalfleet can read, each in its own format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadEngine {
    /// llama.cpp's server: `/props` (its slots), then `/metrics` (with
    /// `--metrics`) or `/slots`.
    LlamaCpp,
    /// vLLM's `/metrics`.
    Vllm,
    /// SGLang's `/metrics` (with `--enable-metrics`).
    Sglang,
}

impl LoadEngine {
    const ALL: [(&'static str, LoadEngine); 3] = [
        ("llama.cpp", LoadEngine::LlamaCpp),
        ("vllm", LoadEngine::Vllm),
        ("sglang", LoadEngine::Sglang),
    ];

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.iter().find(|(n, _)| *n == name).map(|(_, e)| *e)
    }

    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(_, e)| *e == self)
            .map_or("?", |(n, _)| n)
    }

    /// The option of its command that sets how many requests it runs at
    /// once (short and long form).
    pub fn capacity_options(self) -> &'static [&'static str] {
        match self {
            Self::LlamaCpp => &["-np", "--parallel"],
            Self::Vllm => &["--max-num-seqs"],
            Self::Sglang => &["--max-running-requests"],
        }
    }
}

/// How the engine's own account of its load is read (how many requests it
/// can run at once, how many it runs and how many wait in its queue), for
/// the concurrency controller (see `docs/fleet.md`). Read once when the
/// endpoint is ready, then every `interval` while it has
/// calls in flight; an engine that does not report its load (the path is
/// absent, or its answer is not the engine's format) is read no more, and
/// the limit is found from the calls' answers alone. Default: every key's
/// default.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub(super) struct RawLoad {
    /// Whose answers to read: `vllm` (`GET /metrics`), `sglang` (`GET
    /// /metrics`, served with `--enable-metrics`), `llama.cpp` (`GET
    /// /props` for its slots, then `GET /metrics`, served with
    /// `--metrics`, or else `GET /slots`), or `none`. Default: for `local`
    /// and `remote`, the preset's engine (`none` for `ollama` and for a
    /// `command` without a preset); else `none`.
    engine: Option<String>,
    /// The path of the reading on the server's origin (`/metrics`), read
    /// in the engine's format (for `llama.cpp`, a JSON list is its slots,
    /// anything else its metrics). Default: the engine's (see `engine`).
    path: Option<String>,
    /// The time between readings while the endpoint has calls in flight
    /// (at least `100ms`). Default `1s`.
    #[schemars(with = "Option<crate::schema::Duration>")]
    interval: Option<String>,
}

/// The least time between two readings of an engine's load.
const LOAD_INTERVAL_FLOOR: Duration = Duration::from_millis(100);

pub(super) fn load(
    raw: RawLoad,
    default_engine: Option<LoadEngine>,
    at: &str,
    p: &mut Problems<'_>,
) -> Option<LoadSettings> {
    let field = |name: &str| path::key(at, name);
    let engine = match raw.engine.as_deref() {
        None => Some(default_engine),
        Some("none") => Some(None),
        Some(name) => match LoadEngine::parse(name) {
            Some(engine) => Some(Some(engine)),
            None => p.push(
                &field("engine"),
                format!("must be vllm, sglang, llama.cpp or none, got '{name}'"),
            ),
        },
    };
    let path = match raw.path {
        Some(path) if !path.starts_with('/') => {
            p.push(&field("path"), format!("must start with '/', got '{path}'"))
        }
        other => Some(other),
    };
    let interval = match p.duration(&field("interval"), raw.interval.as_deref(), "1s") {
        Some(d) if d < LOAD_INTERVAL_FLOOR => p.push(
            &field("interval"),
            format!(
                "must be at least 100ms, got {}",
                humantime::format_duration(d)
            ),
        ),
        other => other,
    };
    Some(LoadSettings {
        engine: engine?,
        path: path?,
        interval: interval?,
    })
}
