//! How the mock endpoint behaves. The same settings come from the command
//! line (`evalfleet mock --latency 200ms`) and from a config file (`kind: mock`
//! endpoints, under `mock:`), so the doc comments here are the user documentation
//! of both.

use std::time::Duration;

use serde::{Deserialize, Deserializer};

/// Behaviour of the mock OpenAI-compatible endpoint.
///
/// Every random decision (errors, hangs, truncations) is drawn from a generator
/// seeded by `seed`, the request's prompt and how many times that prompt was seen,
/// so a test gets the same behaviour for the same item whatever the arrival order.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
#[serde(deny_unknown_fields, default)]
pub struct MockSettings {
    /// Model id listed by `GET /v1/models` and echoed in responses.
    #[cfg_attr(feature = "cli", arg(long, default_value = "mock"))]
    pub model: String,

    /// Delay before the first token (or before the whole response when not
    /// streaming), e.g. `500ms`.
    #[cfg_attr(feature = "cli", arg(long, value_parser = humantime::parse_duration, default_value = "0s"))]
    #[serde(deserialize_with = "duration")]
    pub latency: Duration,

    /// Delay between tokens. A non-streaming response waits the same total time.
    #[cfg_attr(feature = "cli", arg(long, value_parser = humantime::parse_duration, default_value = "0s"))]
    #[serde(deserialize_with = "duration")]
    pub itl: Duration,

    /// Number of tokens in each answer. Unset: the answer is the last user
    /// message, verbatim, one token per whitespace-separated piece. Set: those
    /// pieces are repeated until the answer has this many tokens.
    #[cfg_attr(feature = "cli", arg(long))]
    pub output_tokens: Option<u32>,

    /// Fraction of requests (0 to 1) answered with `error_status`.
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 0.0))]
    pub error_rate: f64,

    /// Status code of injected errors (`error_rate`, `fail_first`).
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 500))]
    pub error_status: u16,

    /// The first N requests carrying each distinct prompt fail with `error_status`.
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 0))]
    pub fail_first: u32,

    /// Requests per minute allowed; beyond it the mock answers 429 with a
    /// `Retry-After` that says when the next request will be allowed.
    #[cfg_attr(feature = "cli", arg(long))]
    pub rpm: Option<u32>,

    /// Requests the `rpm` bucket holds when full (a burst allowed at once).
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 1))]
    pub burst: u32,

    /// Requests served at once; beyond it the mock answers 429 with
    /// `Retry-After: retry_after`.
    #[cfg_attr(feature = "cli", arg(long))]
    pub max_concurrency: Option<u32>,

    /// `Retry-After` sent with 429s caused by `max_concurrency`.
    #[cfg_attr(feature = "cli", arg(long, value_parser = humantime::parse_duration, default_value = "1s"))]
    #[serde(deserialize_with = "duration")]
    pub retry_after: Duration,

    /// Requests served at once; the rest wait in a queue (latency grows with
    /// load and no 429 is ever sent), like an engine with K sequence slots.
    #[cfg_attr(feature = "cli", arg(long))]
    pub capacity: Option<u32>,

    /// Fraction of requests that are accepted and never answered.
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 0.0))]
    pub hang_rate: f64,

    /// Fraction of responses cut off half-way (the connection is dropped before
    /// the stream or body is complete).
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 0.0))]
    pub truncate_rate: f64,

    /// Seed of every random decision.
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 0))]
    pub seed: u64,

    /// Scripted answers: a JSONL file of `{"prompt": ..., "replies": [...]}`
    /// or `{"prompt": ..., "samples": [...]}`. A request whose first user
    /// message is a `prompt` gets `replies[k]`, where k is the number of
    /// assistant messages in the request (so a re-ask gets the next reply;
    /// past the end, the last), and never an answer when k is at least the
    /// line's `hang_from` (it hangs, as `hang_rate` does); with `samples`,
    /// the i-th request for that prompt gets `samples[i mod len]` (repeated
    /// samples of one question). Other requests are answered as usual.
    #[cfg_attr(feature = "cli", arg(long, value_name = "FILE"))]
    pub answers: Option<std::path::PathBuf>,
}

impl Default for MockSettings {
    fn default() -> Self {
        Self {
            model: "mock".to_owned(),
            latency: Duration::ZERO,
            itl: Duration::ZERO,
            output_tokens: None,
            error_rate: 0.0,
            error_status: 500,
            fail_first: 0,
            rpm: None,
            burst: 1,
            max_concurrency: None,
            retry_after: Duration::from_secs(1),
            capacity: None,
            hang_rate: 0.0,
            truncate_rate: 0.0,
            seed: 0,
            answers: None,
        }
    }
}

impl MockSettings {
    /// Every problem with these settings, as `(field, message)` pairs.
    pub fn problems(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        for (field, rate) in [
            ("error_rate", self.error_rate),
            ("hang_rate", self.hang_rate),
            ("truncate_rate", self.truncate_rate),
        ] {
            if !(0.0..=1.0).contains(&rate) {
                out.push((field, format!("must be between 0 and 1, got {rate}")));
            }
        }
        if !(100..=599).contains(&self.error_status) {
            out.push((
                "error_status",
                format!("must be an HTTP status code, got {}", self.error_status),
            ));
        }
        for (field, value) in [
            ("rpm", self.rpm),
            ("max_concurrency", self.max_concurrency),
            ("capacity", self.capacity),
            ("output_tokens", self.output_tokens),
        ] {
            if value == Some(0) {
                out.push((field, "must be at least 1, got 0".to_owned()));
            }
        }
        if self.burst == 0 {
            out.push(("burst", "must be at least 1, got 0".to_owned()));
        }
        if let Some(path) = &self.answers
            && let Err(err) = load_answers(path)
        {
            out.push(("answers", err));
        }
        out
    }

    /// Whether any decision depends on how often a prompt was seen (so the
    /// server must count prompts).
    pub fn needs_prompt_counts(&self) -> bool {
        self.fail_first > 0
            || self.error_rate > 0.0
            || self.hang_rate > 0.0
            || self.truncate_rate > 0.0
    }
}

fn duration<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(deserializer)?;
    humantime::parse_duration(&text).map_err(|err| {
        serde::de::Error::custom(format!(
            "expected a duration like 250ms or 2s, got '{text}' ({err})"
        ))
    })
}

/// Scripted answers for one prompt (see [`MockSettings::answers`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Script {
    /// By the number of assistant messages in the request; from `hang_from`
    /// of them on, no answer.
    Replies {
        replies: Vec<String>,
        hang_from: Option<usize>,
    },
    /// By how many requests for the prompt came before.
    Samples(Vec<String>),
}

/// Reads a scripted-answers file (see [`MockSettings::answers`]): first user
/// message → its script.
pub fn load_answers(
    path: &std::path::Path,
) -> Result<std::collections::HashMap<String, Script>, String> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Line {
        prompt: String,
        replies: Option<Vec<String>>,
        samples: Option<Vec<String>>,
        hang_from: Option<usize>,
    }
    let text = std::fs::read_to_string(path)
        .map_err(|err| format!("cannot read {}: {err}", path.display()))?;
    let mut out = std::collections::HashMap::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{}:{}", path.display(), i + 1);
        let parsed: Line = serde_json::from_str(line).map_err(|err| format!("{}: {err}", at()))?;
        let script = match (parsed.replies, parsed.samples) {
            (Some(replies), None) if !replies.is_empty() => Script::Replies {
                replies,
                hang_from: parsed.hang_from,
            },
            (None, Some(s)) if !s.is_empty() && parsed.hang_from.is_none() => Script::Samples(s),
            _ => {
                return Err(format!(
                    "{}: give a non-empty replies or samples list, not both (hang_from goes with replies)",
                    at()
                ));
            }
        };
        out.insert(parsed.prompt, script);
    }
    Ok(out)
}
