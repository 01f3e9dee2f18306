//! How the mock endpoint behaves. The same settings come from the command
//! line (`evalfleet mock --latency 200ms`) and from a config file (`kind: mock`
//! endpoints, under `mock:`), so the doc comments here are the user documentation
//! of both.

use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

/// Behaviour of the mock OpenAI-compatible endpoint.
///
/// Every random decision (errors, faults, hangs, stalls, truncations, cuts) is
/// drawn from a generator seeded by `seed`, the request's prompt and how many
/// times that prompt was seen, so a test gets the same behaviour for the same
/// item whatever the arrival order.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "cli", derive(clap::Args))]
#[serde(deny_unknown_fields, default)]
pub struct MockSettings {
    /// Model id listed by `GET /v1/models` and echoed in responses. In a
    /// config, the endpoint's `model` when this is not given (default
    /// `mock`).
    #[cfg_attr(feature = "cli", arg(long, default_value = "mock"))]
    pub model: String,

    /// Delay before the first token (or before the whole response when not
    /// streaming), e.g. `500ms`.
    #[cfg_attr(feature = "cli", arg(long, value_parser = humantime::parse_duration, default_value = "0s"))]
    #[cfg_attr(
        feature = "schema",
        serde(serialize_with = "duration_text"),
        schemars(schema_with = "duration_schema")
    )]
    #[serde(deserialize_with = "duration")]
    pub latency: Duration,

    /// Delay between tokens. A non-streaming response waits the same total time.
    #[cfg_attr(feature = "cli", arg(long, value_parser = humantime::parse_duration, default_value = "0s"))]
    #[cfg_attr(
        feature = "schema",
        serde(serialize_with = "duration_text"),
        schemars(schema_with = "duration_schema")
    )]
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
    #[cfg_attr(
        feature = "schema",
        serde(serialize_with = "duration_text"),
        schemars(schema_with = "duration_schema")
    )]
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

    /// Injected failures, independent of load: each request is answered with
    /// at most one of them, each taking its `rate` of the requests (the rates
    /// add up to at most 1). A 408, 429 or 503 with a `retry_after` carries
    /// `Retry-After` (whole seconds, rounded up). On the command line
    /// `--fault STATUS:RATE[:RETRY_AFTER]`, repeated (`--fault 500:0.08
    /// --fault 503:0.05:1s`); in a config `faults: [{status: 503, rate: 0.05,
    /// retry_after: 1s}]`. Default: none.
    #[cfg_attr(
        feature = "cli",
        arg(long = "fault", value_name = "STATUS:RATE[:RETRY_AFTER]")
    )]
    pub faults: Vec<Fault>,

    /// Fraction of responses that stop for `stall` half-way through the
    /// stream and then finish normally (a response not streamed comes
    /// `stall` later).
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 0.0))]
    pub stall_rate: f64,

    /// How long a stalled response (`stall_rate`) sends nothing.
    #[cfg_attr(feature = "cli", arg(long, value_parser = humantime::parse_duration, default_value = "20s"))]
    #[cfg_attr(
        feature = "schema",
        serde(serialize_with = "duration_text"),
        schemars(schema_with = "duration_schema")
    )]
    #[serde(deserialize_with = "duration")]
    pub stall: Duration,

    /// Fraction of streamed responses that end half-way with `data: [DONE]`
    /// and no chunk carrying a `finish_reason`: a clean end of the stream
    /// (as llama-cpp-python's server ends an interrupted one), unlike
    /// `truncate_rate`'s dropped connection.
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 0.0))]
    pub cut_rate: f64,

    /// Fraction of streamed responses whose connection closes cleanly right
    /// after the chunk carrying the `finish_reason`: no usage chunk and no
    /// `data: [DONE]` (a stream that never ended, as some proxies and
    /// servers leave one they drop).
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 0.0))]
    pub unended_rate: f64,

    /// A chat request (or `GET /v1/models`) that arrives ends every stream
    /// being sent at once, the way `cut_rate` ends one (llama-cpp-python's
    /// server serves one request at a time and interrupts the running one
    /// for any request that waits for the model, its model list included).
    /// `GET /health` interrupts nothing.
    #[cfg_attr(feature = "cli", arg(long))]
    pub interrupt_on_arrival: bool,

    /// Streams end with a usage chunk when the request asks for one
    /// (`stream_options.include_usage`). `--no-stream-usage` (in a config
    /// `stream_usage: false`): never, as llama-cpp-python's server.
    #[cfg_attr(
        feature = "cli",
        arg(long = "no-stream-usage", action = clap::ArgAction::SetFalse)
    )]
    pub stream_usage: bool,

    /// A request quota reported the way OpenAI reports it: every answer to a
    /// well-formed chat request (outside an `outage`) carries
    /// `x-ratelimit-limit-requests`, `x-ratelimit-remaining-requests` and
    /// `x-ratelimit-reset-requests` (e.g. `1s`, `6m0s`, `100ms`); past it,
    /// 429 with `Retry-After` (whole seconds) and `retry-after-ms`. Mode `refill` (the default): a bucket
    /// of `limit` requests refilling `limit` per `window` continuously, reset
    /// being when it would be full again; `fixed`: `limit` requests per
    /// window, windows starting at the first request, reset being the end of
    /// the current one. On the command line `LIMIT/WINDOW[:MODE]`
    /// (`--quota 600/60s`, `--quota 100/1m:fixed`); in a config
    /// `quota: {limit: 600, window: 60s, mode: fixed}`. Independent of `rpm`.
    /// Default: none.
    #[cfg_attr(feature = "cli", arg(long, value_name = "LIMIT/WINDOW[:MODE]"))]
    pub quota: Option<Quota>,

    /// A scripted outage: from `after` past the first chat request, for
    /// `for`, every chat request, `GET /v1/models` and `GET /health` are
    /// answered at once with `status` (503 unless given, no `Retry-After`);
    /// then all is normal again. On the command line
    /// `AFTER:FOR[:STATUS]` (`--outage 30s:10s`, `--outage 30s:10s:502`);
    /// in a config `outage: {after: 30s, for: 10s, status: 502}`. Default:
    /// none.
    #[cfg_attr(feature = "cli", arg(long, value_name = "AFTER:FOR[:STATUS]"))]
    pub outage: Option<Outage>,

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
    /// samples of one question). A line may give `"image": SHA256` (the
    /// hex SHA-256 of an image's bytes) instead of `prompt`: a request whose
    /// every image has such a line gets their replies, one line each. Other
    /// requests are answered as usual. A reply may be a tool call,
    /// `{"tool": NAME, "arguments": {...}, "then": REPLY}`: a request that
    /// offers `tools` and holds no tool result since its last user message
    /// gets that call (finish_reason `tool_calls`); one whose last tool
    /// result follows it gets `then` (text, or the next call), `{result}`
    /// in it replaced by that result; one without `tools` gets the last
    /// text of the chain. Assistant messages that are tool calls do not
    /// count in k.
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
            faults: Vec::new(),
            stall_rate: 0.0,
            stall: Duration::from_secs(20),
            cut_rate: 0.0,
            unended_rate: 0.0,
            interrupt_on_arrival: false,
            stream_usage: true,
            quota: None,
            outage: None,
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
            ("stall_rate", self.stall_rate),
            ("cut_rate", self.cut_rate),
            ("unended_rate", self.unended_rate),
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
        for (i, fault) in self.faults.iter().enumerate() {
            let at = format!("entry {} ({})", i + 1, fault.status);
            if !(400..=599).contains(&fault.status) {
                out.push((
                    "faults",
                    format!("{at}: status must be an HTTP error status (400 to 599)"),
                ));
            }
            if !(0.0..=1.0).contains(&fault.rate) {
                out.push((
                    "faults",
                    format!("{at}: rate must be between 0 and 1, got {}", fault.rate),
                ));
            }
            if fault.retry_after.is_some() && !RETRY_AFTER_STATUSES.contains(&fault.status) {
                out.push((
                    "faults",
                    format!("{at}: retry_after goes only with 408, 429 or 503"),
                ));
            }
        }
        let total: f64 = self.faults.iter().map(|f| f.rate).sum();
        // A little slack, so that rates written in decimals may add up to 1.
        if total > 1.0 + 1e-9 {
            out.push((
                "faults",
                format!("the rates must add up to at most 1, got {total}"),
            ));
        }
        if let Some(quota) = &self.quota {
            if quota.limit == 0 {
                out.push(("quota", "limit must be at least 1, got 0".to_owned()));
            }
            if quota.window.is_zero() {
                out.push(("quota", "window must be longer than 0s".to_owned()));
            }
        }
        if let Some(outage) = &self.outage {
            if !(400..=599).contains(&outage.status) {
                out.push((
                    "outage",
                    format!(
                        "status must be an HTTP error status (400 to 599), got {}",
                        outage.status
                    ),
                ));
            }
            if outage.duration.is_zero() {
                out.push(("outage", "`for` must be longer than 0s".to_owned()));
            }
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
            || !self.faults.is_empty()
            || self.stall_rate > 0.0
            || self.cut_rate > 0.0
            || self.unended_rate > 0.0
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

/// A duration's schema: text like `250ms` or `2s`, as [`duration`] reads it.
#[cfg(feature = "schema")]
fn duration_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({"type": "string", "format": "humantime"})
}

/// A duration as [`duration`] reads it, for the schema's defaults.
#[cfg(feature = "schema")]
fn duration_text<S: serde::Serializer>(value: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.collect_str(&humantime::format_duration(*value))
}

fn optional_duration<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Duration>, D::Error> {
    duration(deserializer).map(Some)
}

/// The statuses that may carry `Retry-After` in [`MockSettings::faults`].
const RETRY_AFTER_STATUSES: [u16; 3] = [408, 429, 503];

/// One injected failure of [`MockSettings::faults`].
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct Fault {
    /// The status answered.
    pub status: u16,
    /// The fraction of requests (0 to 1) answered with it.
    pub rate: f64,
    /// `Retry-After` sent with it, in whole seconds rounded up (408, 429 and
    /// 503 only).
    #[serde(default, deserialize_with = "optional_duration")]
    #[cfg_attr(feature = "schema", schemars(schema_with = "duration_schema"))]
    pub retry_after: Option<Duration>,
}

/// Reads `STATUS:RATE[:RETRY_AFTER]` (`503:0.05:1s`).
impl FromStr for Fault {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        let mut parts = text.split(':');
        let (Some(status), Some(rate)) = (parts.next(), parts.next()) else {
            return Err(format!("expected STATUS:RATE[:RETRY_AFTER], got '{text}'"));
        };
        let retry_after = parts.next();
        if parts.next().is_some() {
            return Err(format!("expected STATUS:RATE[:RETRY_AFTER], got '{text}'"));
        }
        Ok(Self {
            status: status
                .trim()
                .parse()
                .map_err(|_| format!("expected a status code, got '{status}'"))?,
            rate: rate
                .trim()
                .parse()
                .map_err(|_| format!("expected a rate between 0 and 1, got '{rate}'"))?,
            retry_after: retry_after.map(parse_duration).transpose()?,
        })
    }
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim())
        .map_err(|err| format!("expected a duration like 250ms or 2s, got '{text}' ({err})"))
}

/// How a [`Quota`] gives requests back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum QuotaMode {
    /// A bucket refilling continuously, `limit` per `window`.
    #[default]
    Refill,
    /// `limit` requests per window, windows following one another from the
    /// first request.
    Fixed,
}

/// A request quota with OpenAI's headers (see [`MockSettings::quota`]).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct Quota {
    /// Requests allowed per window (and held by the bucket when full).
    pub limit: u32,
    /// The window, e.g. `60s`.
    #[serde(deserialize_with = "duration")]
    #[cfg_attr(feature = "schema", schemars(schema_with = "duration_schema"))]
    pub window: Duration,
    /// `refill` or `fixed`. Default `refill`.
    #[serde(default)]
    pub mode: QuotaMode,
}

/// Reads `LIMIT/WINDOW[:MODE]` (`600/60s`, `100/1m:fixed`).
impl FromStr for Quota {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        let expected =
            || format!("expected LIMIT/WINDOW[:MODE] like 600/60s or 100/1m:fixed, got '{text}'");
        let (limit, rest) = text.split_once('/').ok_or_else(expected)?;
        let (window, mode) = match rest.split_once(':') {
            Some((window, mode)) => (window, Some(mode)),
            None => (rest, None),
        };
        Ok(Self {
            limit: limit
                .trim()
                .parse()
                .map_err(|_| format!("expected a number of requests, got '{limit}'"))?,
            window: parse_duration(window)?,
            mode: match mode.map(str::trim) {
                None | Some("refill") => QuotaMode::Refill,
                Some("fixed") => QuotaMode::Fixed,
                Some(other) => return Err(format!("expected mode refill or fixed, got '{other}'")),
            },
        })
    }
}

/// A scripted outage (see [`MockSettings::outage`]).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct Outage {
    /// When it starts, after the first chat request.
    #[serde(deserialize_with = "duration")]
    #[cfg_attr(feature = "schema", schemars(schema_with = "duration_schema"))]
    pub after: Duration,
    /// How long it lasts (`for` in a config).
    #[serde(rename = "for", deserialize_with = "duration")]
    #[cfg_attr(feature = "schema", schemars(schema_with = "duration_schema"))]
    pub duration: Duration,
    /// The status answered during it.
    #[serde(default = "outage_status")]
    pub status: u16,
}

fn outage_status() -> u16 {
    503
}

/// Reads `AFTER:FOR[:STATUS]` (`30s:10s`, `30s:10s:502`).
impl FromStr for Outage {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        let parts: Vec<&str> = text.split(':').collect();
        let (after, duration, status) = match parts[..] {
            [after, duration] => (after, duration, None),
            [after, duration, status] => (after, duration, Some(status)),
            _ => {
                return Err(format!(
                    "expected AFTER:FOR[:STATUS] like 30s:10s, got '{text}'"
                ));
            }
        };
        Ok(Self {
            after: parse_duration(after)?,
            duration: parse_duration(duration)?,
            status: match status {
                None => outage_status(),
                Some(status) => status
                    .trim()
                    .parse()
                    .map_err(|_| format!("expected a status code, got '{status}'"))?,
            },
        })
    }
}

/// One scripted reply (see [`MockSettings::answers`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// A text; `{result}` in it is replaced by the last tool result.
    Text(String),
    /// A call of the tool `name` with `arguments` (JSON text), and what
    /// answers its result.
    Tool {
        name: String,
        arguments: String,
        then: Box<Answer>,
    },
}

impl Answer {
    /// Reads a reply: a string, or `{"tool": NAME, "arguments": ANY,
    /// "then": REPLY}` (`arguments` an object by default `{}`, or a string
    /// sent as it is; `then` by default `"{result}"`).
    fn from_value(value: &serde_json::Value, at: &str) -> Result<Self, String> {
        use serde_json::Value;
        match value {
            Value::String(text) => Ok(Self::Text(text.clone())),
            Value::Object(fields) => {
                if let Some(key) = fields
                    .keys()
                    .find(|k| !["tool", "arguments", "then"].contains(&k.as_str()))
                {
                    return Err(format!(
                        "{at}: unknown key '{key}' in a tool call (tool, arguments, then)"
                    ));
                }
                let Some(Value::String(name)) = fields.get("tool") else {
                    return Err(format!("{at}: a tool call needs \"tool\": NAME"));
                };
                let arguments = match fields.get("arguments") {
                    None => "{}".to_owned(),
                    Some(Value::String(text)) => text.clone(),
                    Some(other) => other.to_string(),
                };
                let then = match fields.get("then") {
                    None => Self::Text("{result}".to_owned()),
                    Some(then) => Self::from_value(then, at)?,
                };
                Ok(Self::Tool {
                    name: name.clone(),
                    arguments,
                    then: Box::new(then),
                })
            }
            _ => Err(format!(
                "{at}: a reply is a string or a tool call {{\"tool\": NAME, \"arguments\": {{...}}, \"then\": REPLY}}"
            )),
        }
    }
}

/// Scripted answers for one prompt (see [`MockSettings::answers`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Script {
    /// By the number of assistant messages in the request (tool calls
    /// aside); from `hang_from` of them on, no answer.
    Replies {
        replies: Vec<Answer>,
        hang_from: Option<usize>,
    },
    /// By how many requests for the prompt came before.
    Samples(Vec<String>),
}

/// The key of an image's script among the scripted answers.
pub fn image_key(sha256: &str) -> String {
    format!("\0image:{sha256}")
}

/// Reads a scripted-answers file (see [`MockSettings::answers`]): first user
/// message (or [`image_key`]) → its script.
pub fn load_answers(
    path: &std::path::Path,
) -> Result<std::collections::HashMap<String, Script>, String> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Line {
        prompt: Option<String>,
        image: Option<String>,
        replies: Option<Vec<serde_json::Value>>,
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
                replies: replies
                    .iter()
                    .map(|reply| Answer::from_value(reply, &at()))
                    .collect::<Result<_, _>>()?,
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
        let key = match (parsed.prompt, parsed.image) {
            (Some(prompt), None) => prompt,
            (None, Some(sha)) if sha.len() == 64 && sha.bytes().all(|b| b.is_ascii_hexdigit()) => {
                image_key(&sha.to_ascii_lowercase())
            }
            (None, Some(sha)) => {
                return Err(format!(
                    "{}: image must be a SHA-256 in hex, got '{sha}'",
                    at()
                ));
            }
            _ => return Err(format!("{}: give prompt or image, not both", at())),
        };
        out.insert(key, script);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from_config(value: serde_json::Value) -> MockSettings {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn a_config_gives_faults_quota_and_outage_as_maps() {
        let settings = from_config(serde_json::json!({
            "faults": [
                {"status": 500, "rate": 0.08},
                {"status": 503, "rate": 0.05, "retry_after": "1s"},
            ],
            "stall_rate": 0.1,
            "stall": "5s",
            "cut_rate": 0.2,
            "interrupt_on_arrival": true,
            "stream_usage": false,
            "quota": {"limit": 600, "window": "60s", "mode": "fixed"},
            "outage": {"after": "30s", "for": "10s"},
        }));
        assert_eq!(
            settings.faults,
            [
                Fault {
                    status: 500,
                    rate: 0.08,
                    retry_after: None
                },
                Fault {
                    status: 503,
                    rate: 0.05,
                    retry_after: Some(Duration::from_secs(1))
                },
            ]
        );
        assert_eq!(settings.stall, Duration::from_secs(5));
        assert!(settings.interrupt_on_arrival && !settings.stream_usage);
        assert_eq!(
            settings.quota,
            Some(Quota {
                limit: 600,
                window: Duration::from_secs(60),
                mode: QuotaMode::Fixed
            })
        );
        assert_eq!(
            settings.outage,
            Some(Outage {
                after: Duration::from_secs(30),
                duration: Duration::from_secs(10),
                status: 503
            })
        );
        assert!(settings.problems().is_empty());
        let refill: Quota =
            serde_json::from_value(serde_json::json!({"limit": 5, "window": "1s"})).unwrap();
        assert_eq!(refill.mode, QuotaMode::Refill);
        let unknown = serde_json::from_value::<MockSettings>(
            serde_json::json!({"quota": {"limit": 5, "window": "1s", "burst": 2}}),
        );
        assert!(unknown.is_err());
    }

    #[test]
    fn every_wrong_new_setting_is_reported() {
        let settings = MockSettings {
            faults: vec![
                "200:0.5".parse().unwrap(),
                "500:0.7:1s".parse().unwrap(),
                "503:-0.1".parse().unwrap(),
            ],
            stall_rate: 1.5,
            cut_rate: -1.0,
            quota: Some("0/0s".parse().unwrap()),
            outage: Some("1s:0s:200".parse().unwrap()),
            ..MockSettings::default()
        };
        let problems = settings.problems();
        let fields: Vec<&str> = problems.iter().map(|(f, _)| *f).collect();
        assert_eq!(
            fields,
            [
                "stall_rate",
                "cut_rate",
                "faults",
                "faults",
                "faults",
                "faults",
                "quota",
                "quota",
                "outage",
                "outage",
            ],
            "{problems:?}"
        );
        assert!(
            problems[5].1.contains("add up to at most 1"),
            "{problems:?}"
        );
        assert!(
            problems[4].1.starts_with("entry 3 (503): rate"),
            "{problems:?}"
        );
    }

    #[test]
    fn command_line_forms_are_read_and_bad_ones_refused() {
        let fault: Fault = "503:0.05:1s".parse().unwrap();
        assert_eq!(fault.retry_after, Some(Duration::from_secs(1)));
        let quota: Quota = "100/1m:fixed".parse().unwrap();
        assert_eq!((quota.limit, quota.window), (100, Duration::from_secs(60)));
        assert_eq!(quota.mode, QuotaMode::Fixed);
        let outage: Outage = "30s:10s:502".parse().unwrap();
        assert_eq!(outage.status, 502);
        for bad in ["503", "503:x", "503:0.1:soon", "503:0.1:1s:2"] {
            assert!(bad.parse::<Fault>().is_err(), "{bad}");
        }
        for bad in ["600", "600/x", "600/60s:sliding"] {
            assert!(bad.parse::<Quota>().is_err(), "{bad}");
        }
        for bad in ["30s", "30s:10s:x", "a:b"] {
            assert!(bad.parse::<Outage>().is_err(), "{bad}");
        }
    }

    #[cfg(feature = "cli")]
    #[test]
    fn command_line_defaults_are_the_config_defaults() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            settings: MockSettings,
        }
        let defaults = Cli::try_parse_from(["mock"]).unwrap().settings;
        assert_eq!(defaults, MockSettings::default());
        let given = Cli::try_parse_from([
            "mock",
            "--fault",
            "500:0.08",
            "--fault",
            "503:0.05:1s",
            "--stall-rate",
            "0.1",
            "--stall",
            "300ms",
            "--cut-rate",
            "0.2",
            "--interrupt-on-arrival",
            "--no-stream-usage",
            "--quota",
            "600/60s",
            "--outage",
            "30s:10s",
        ])
        .unwrap()
        .settings;
        assert_eq!(given.faults.len(), 2);
        assert_eq!(given.stall, Duration::from_millis(300));
        assert!(given.interrupt_on_arrival && !given.stream_usage);
        assert_eq!(given.quota.map(|q| q.mode), Some(QuotaMode::Refill));
        assert_eq!(given.outage.map(|o| o.status), Some(503));
        assert!(Cli::try_parse_from(["mock", "--fault", "oops"]).is_err());
    }
}
