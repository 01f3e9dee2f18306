//! The run config: YAML as the user wrote it, read into raw sections, then
//! validated in one pure step that reports every problem of the file at once,
//! each with its path and line.
//!
//! The doc comments on the raw structs (the config as written) are the user
//! documentation of the config file: `docs/config.md` is generated from them
//! ([`reference`]), and unknown keys are matched against the keys they
//! declare ([`schema`]).

mod admission;
pub mod bench;
pub mod cache;
mod conversation;
mod endpoint;
mod env;
mod eval;
mod exec;
mod images;
pub mod original;
pub mod path;
mod problems;
mod prompts;
mod raw;
mod read;
pub mod reference;
mod request;
pub mod schema;
mod sheets;
mod telemetry;
mod validate;
mod yaml;

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Map, Value};

pub use admission::Admission;
pub use conversation::{
    AlarmSettings, CallSettings, ConversationSettings, EmaFormula, HistoryWindows, Persona,
    PolicyKind, PolicySettings, Rules, ScorerKind, ScorerSettings, ToneWords,
};
pub use endpoint::{
    AimdSettings, EndpointConfig, EndpointKind, EndpointRole, Engine, HealthSettings, LimitMode,
    LoadEngine, LoadSettings, Preset, Remote,
};
pub use env::{Vars, is_name as is_variable_name};
pub use evalfleet_mock::MockSettings;
pub use evalfleet_types::BudgetSettings;
use evalfleet_types::Fault;
/// `retry:` how failed attempts are retried: `max_attempts` (per call: an
/// item's answer, a re-ask, a judge's call; the first included; default
/// 10: with the retry budget bounding retries, a 20% fault rate fails
/// one call in 10^7), `backoff_base` (default `100ms`), `backoff_max` (default `30s`).
pub use evalfleet_types::RetryPolicy;
pub use exec::{AgentMode, AgentNetwork, Budget, ExecInput, ExecSettings, split_words};
pub use images::{ImageFormat, ImageSettings, Part, PdfPages};
pub use prompts::{DEFAULT_PROMPT, PromptRule, glob_matches};
pub use sheets::{
    Blocks, DEFAULT_KEY_ENV, ID_FIELD as SHEET_ID_FIELD, SHEETS_API, SheetConfig, WriteValue,
    column_index, column_letters, snapshot_dir,
};
pub use telemetry::{GpuSelection, TelemetryLimits, TelemetrySettings};
pub use yaml::{Document, YamlError, parse as parse_yaml};

/// The replacement for a secret written literally in a config, wherever the
/// config is stored or shown.
pub const MASK: &str = "***";

/// A value that must never be printed, logged, stored or exported: an API key
/// or a credential header.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret itself, for the one place that sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(MASK)
    }
}

/// A validated run config.
#[derive(Debug, Clone)]
pub struct Config {
    /// The run's name; run ids start with it.
    pub name: String,
    pub dataset: DatasetConfig,
    /// The endpoints that serve the run (at least one).
    pub endpoints: Vec<EndpointConfig>,
    pub task: TaskConfig,
    pub retry: RetryPolicy,
    /// `retry.budget` (retries per first try over the last 10 s, default
    /// 0.5) and `retry.budget_floor` (retries a second allowed whatever,
    /// default 10): an outage does not multiply the load.
    pub retry_budget: BudgetSettings,
    /// `retry.judge_for`: how long a call to a named endpoint (an LLM
    /// judge's) is tried again whatever `max_attempts` says, while it fails
    /// in a way a retry may fix or its endpoint is down. Default 2 minutes.
    pub judge_retry_for: std::time::Duration,
    pub timeouts: Timeouts,
    pub writer: WriterSettings,
    /// `cache: {mode, ttl, max_entries}`: answers stored by request, in the
    /// run's store. Default mode `off`.
    pub cache: crate::cache::CacheSettings,
    pub report: ReportSettings,
    /// After the first Ctrl-C, how long in-flight calls may take to finish
    /// before they are abandoned (their items stay pending). Default `30s`.
    pub shutdown_grace: Duration,
    /// The SQLite store, resolved against the current directory (like
    /// `--store`), so `evalfleet resume`, `status` and `export` find it from
    /// the same place. Default `runs/evalfleet.db`.
    pub store: Option<PathBuf>,
    /// `telemetry:` resource sampling during the run, and its limits.
    pub telemetry: TelemetrySettings,
}

impl Config {
    /// What `endpoint`'s requests are, for the cache (its model, and the
    /// task's parameters with its own over them): the same requests to
    /// another endpoint of the same model are answered from the cache.
    pub fn cache_identity(&self, endpoint: &EndpointConfig) -> String {
        crate::cache::identity(&endpoint.model, &self.task.params, &endpoint.params)
    }
}

/// `dataset:` where items come from.
#[derive(Debug, Clone, PartialEq)]
pub struct DatasetConfig {
    /// The file (or, for Parquet, the folder of shards), resolved against
    /// the config file's directory.
    pub path: PathBuf,
    /// `jsonl`, `csv` or `parquet`; by default from the file's extension
    /// (`.jsonl`, `.ndjson`, `.csv`, `.parquet`; a folder is Parquet).
    pub format: DatasetFormat,
    /// Of a folder of Parquet shards, the split to read; `None`: the only
    /// split, else `train`.
    pub split: Option<String>,
    /// The field that holds each item's id. Without it an item's id is a hash
    /// of its content, which is stable across shuffles, samples and resumes.
    pub id_field: Option<String>,
    /// A deterministic sample: the same `n` and `seed` pick the same items.
    pub sample: Option<Sample>,
    /// Only the first this many rows are items (`--limit N`).
    pub limit: Option<u64>,
    /// Record a malformed line as a failed item and go on, instead of refusing
    /// the dataset. Default `false`.
    pub skip_invalid: bool,
    /// A conversation without `dataset:` simulates this many episodes
    /// (`task.conversation.sessions`): items `{"episode": i}`, written to
    /// `path` by the command that starts the run.
    pub episodes: Option<u64>,
    /// A Google Sheet as the dataset (and the results' place): its rows are
    /// read into `path` (JSONL, ids in `_id`) by the command that starts or
    /// resumes the run.
    pub sheet: Option<SheetConfig>,
    /// A config from outside (`evalfleet serve`): the roots its files are
    /// opened beneath (`--allow-root`), links never leading out. `None`: a
    /// config of the user's own, whose files are opened as named.
    pub roots: Option<Vec<PathBuf>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DatasetFormat {
    Jsonl,
    Csv,
    Parquet,
}

impl DatasetFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Jsonl => "jsonl",
            Self::Csv => "csv",
            Self::Parquet => "parquet",
        }
    }
}

/// `sample: {n, seed}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// How many items to take (all of them when the dataset has fewer).
    pub n: u64,
    /// Seed of the choice. Default 0.
    pub seed: u64,
}

/// `task:` how an item becomes requests and a result.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskConfig {
    /// `kind`: what the task does with an item (see [`TaskKind`]). Default
    /// `code` when `task.code` is given, else `chat`.
    pub kind: TaskKind,
    /// Chat messages; each `content` is a minijinja template over the item's
    /// fields (`{{ question }}`).
    pub messages: Vec<MessageTemplate>,
    /// `prompts`: rules that choose other messages for some items or
    /// models, in order; `messages` is the default (empty: none).
    pub prompts: Vec<PromptRule>,
    /// `images`: how image values become the bytes sent.
    pub images: ImageSettings,
    /// Generation parameters sent with every request (`max_tokens`,
    /// `temperature`, ...).
    pub params: Map<String, Value>,
    /// Stream responses (SSE), which measures time to first token. Default
    /// `false`.
    pub stream: bool,
    /// `n`: samples per dataset row (default 1). With K > 1 each row becomes
    /// K items, `ID#0` to `ID#K-1`, distinct requests (and cache keys) for
    /// pass@k and majority votes; use a temperature above 0.
    pub samples: u32,
    /// `parse`, `schema` / `schema_file`, `max_reasks`,
    /// `structured_output` and `metrics`: what is done with the answer.
    pub eval: evalfleet_eval::EvalSpec,
}

/// `task.kind`: a closed set, like an endpoint's `kind`; each kind is one
/// module of the task layer.
#[derive(Debug, Clone, PartialEq)]
pub enum TaskKind {
    /// One call (and re-asks of answers that cannot be used); the answer is
    /// parsed, checked and scored, by LLM judges too.
    Chat,
    /// A chat whose answer is a program, judged against the item's tests
    /// (`task.code`).
    Code(evalfleet_sandbox::CodeSettings),
    /// Ask, then ask the model to improve its answer (`task.refine`), then
    /// check and score the last answer.
    Refine(RefineSettings),
    /// A simulated three-person conversation with a robot that may
    /// intervene (`task.conversation`); an item is an episode.
    Conversation(Box<ConversationSettings>),
    /// The user's program (an agent) run once per item, calling models
    /// through the run's gateway (`task.command`, ...); its output is
    /// checked and scored.
    Exec(Box<ExecSettings>),
}

impl TaskKind {
    pub fn name(&self) -> &'static str {
        match self {
            Self::Chat => "chat",
            Self::Code(_) => "code",
            Self::Refine(_) => "refine",
            Self::Conversation(_) => "conversation",
            Self::Exec(_) => "exec",
        }
    }

    /// The conversation's settings, for a conversation task.
    pub fn conversation(&self) -> Option<&ConversationSettings> {
        match self {
            Self::Conversation(settings) => Some(settings),
            _ => None,
        }
    }

    /// The program's settings, for an exec task.
    pub fn exec(&self) -> Option<&ExecSettings> {
        match self {
            Self::Exec(settings) => Some(settings),
            _ => None,
        }
    }

    /// The code judge's settings, for a code task.
    pub fn code(&self) -> Option<&evalfleet_sandbox::CodeSettings> {
        match self {
            Self::Code(settings) => Some(settings),
            _ => None,
        }
    }
}

/// `task.refine:` how a refine task asks for a better answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefineSettings {
    /// The user message that asks for a better answer: a template over the
    /// item's fields and `answer` (the answer so far). Default: "Review your
    /// answer and improve it. Reply with the improved answer only, in the
    /// same format."
    pub prompt: String,
    /// How many times to ask (each a call of its own). Default 1.
    pub rounds: u32,
}

/// What a refine task asks when `task.refine.prompt` is not given.
pub const REFINE_PROMPT: &str =
    "Review your answer and improve it. Reply with the improved answer only, in the same format.";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageTemplate {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text template (empty when the content is `parts`).
    pub content: String,
    /// The content as parts (text and images), in their order; empty when
    /// the content is the one text `content`.
    pub parts: Vec<Part>,
}

impl MessageTemplate {
    /// A message whose content is one text template.
    pub fn text(role: &str, content: &str) -> Self {
        Self {
            role: role.to_owned(),
            content: content.to_owned(),
            parts: Vec::new(),
        }
    }
}

/// `timeouts:`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// One call, from send to the last byte. Default `300s`.
    pub attempt: Duration,
    /// An item from its first attempt to its result, retries included; when
    /// passed, the item fails. Default `1h`.
    pub item: Duration,
    /// How long the run waits with no endpoint able to take items (all
    /// unhealthy, or none taking part) before it stops, interrupted and
    /// resumable. Default `10m`.
    pub no_endpoint: Duration,
    /// How long the run waits for a first answer when no endpoint has ever
    /// answered since it started. Default `30s`.
    pub first_answer: Duration,
    /// How long a worker's claim on items lasts unless renewed (it renews
    /// every third of it while it lives). When a worker dies on another
    /// host, its items go to the run's other workers after this; one on
    /// this host that dies frees them at once. Default `30s`.
    pub lease: Duration,
    /// How long a streamed call may wait for the first byte of its answer
    /// (its headers and its first event, both within this from the send)
    /// before it is given up and retried. A non-streamed answer comes
    /// whole: only `attempt` bounds it. Default `120s`.
    pub first_byte: Duration,
    /// How long a stream may send nothing before it is given up as stalled
    /// and retried. Default `30s`.
    pub stream_idle: Duration,
}

/// `writer:` how results are committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriterSettings {
    /// Results per transaction, at most. Default 512.
    pub batch_size: usize,
    /// Longest wait before a partial batch is committed. Default `200ms`.
    pub flush_interval: Duration,
}

/// `report:` what makes a run's scores unusable, and how they are grouped.
#[derive(Debug, Clone, PartialEq)]
pub struct ReportSettings {
    /// The share of the answers it could judge that a metric may fail to
    /// score (no usable reference, a failed judge) before `run` and
    /// `report` exit non-zero. Default 1: only a metric that could score
    /// none of them.
    pub max_unscored: f64,
    /// The item fields reports group by when not told (`--by`); `None`:
    /// `doc_type` when the items have it, else none.
    pub by: Option<Vec<String>>,
}

impl Default for ReportSettings {
    fn default() -> Self {
        Self {
            max_unscored: 1.0,
            by: None,
        }
    }
}

/// Command-line settings that replace the file's.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    /// `--n-sample N`.
    pub sample_n: Option<u64>,
    /// `--seed S`.
    pub sample_seed: Option<u64>,
    /// `--limit N`: `dataset.limit`.
    pub limit: Option<u64>,
    /// `--set KEY=VALUE`, each: any key of the document.
    pub sets: Vec<String>,
    /// `simulate --sessions N`: `task.conversation.sessions`.
    pub sessions: Option<u64>,
    /// `simulate --max-steps M`: `task.conversation.max_steps`.
    pub max_steps: Option<u32>,
    /// `env --batch-size N`: `task.conversation.batch_size`.
    pub batch_size: Option<u32>,
    /// `env`: `task.conversation.policy.kind: external` (a trainer
    /// decides; the policy's messages make its prompt).
    pub external_policy: bool,
}

/// A config with what a run stores of it.
#[derive(Debug, Clone)]
pub struct LoadedConfig {
    pub config: Config,
    /// The document before `${VAR}` expansion, with CLI overrides applied and
    /// literal secrets masked: what the store keeps, and what `resume` reads.
    pub snapshot: Value,
    /// The directory relative paths were resolved against.
    pub dir: PathBuf,
    /// Where the config came from (a file's path, "the stored config").
    pub origin: String,
    /// The line of each path in the file (none for a stored config).
    lines: std::sync::Arc<std::collections::HashMap<String, usize>>,
    /// A config of the original system (`original`): each of its keys that
    /// had no place here, `FILE:LINE: KEY: not converted: WHY`, for the
    /// command to show.
    pub notes: Vec<String>,
}

impl LoadedConfig {
    /// Problems found after loading (`(path, message)`, the message
    /// starting with the path), reported as the config's own are: each
    /// with its line.
    pub fn problems(&self, problems: Vec<(String, String)>) -> ConfigError {
        let document = yaml::Document {
            value: Value::Null,
            lines: (*self.lines).clone(),
        };
        validate::invalid(self.origin.clone(), &document, problems)
    }
}

/// One problem in a config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The line in the file, when the config came from one.
    pub line: Option<usize>,
    /// What is wrong, starting with the path (`endpoints[1].concurrency: ...`).
    pub message: String,
}

/// A config that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}:{}:{}: invalid YAML: {}", path.display(), error.line, error.column, error.message)]
    Yaml { path: PathBuf, error: YamlError },
    #[error("{}", render_problems(origin, problems))]
    Invalid {
        origin: String,
        problems: Vec<Problem>,
    },
    /// A config from outside asks for what the server does not allow
    /// ([`Admission`]).
    #[error("{} (refused)", render_problems(origin, problems))]
    Refused {
        origin: String,
        problems: Vec<Problem>,
    },
}

impl ConfigError {
    /// A config is the user's to fix.
    pub fn fault(&self) -> Fault {
        Fault::BadInput
    }

    /// The problems, for callers that show them their own way.
    pub fn problems(&self) -> Vec<Problem> {
        match self {
            Self::Invalid { problems, .. } | Self::Refused { problems, .. } => problems.clone(),
            Self::Yaml { error, .. } => vec![Problem {
                line: Some(error.line),
                message: format!("invalid YAML: {}", error.message),
            }],
            Self::Read { .. } => vec![Problem {
                line: None,
                message: self.to_string(),
            }],
        }
    }
}

fn render_problems(origin: &str, problems: &[Problem]) -> String {
    let mut out = match problems.len() {
        1 => format!("{origin} has 1 problem:"),
        n => format!("{origin} has {n} problems:"),
    };
    for problem in problems {
        out.push_str("\n  ");
        match problem.line {
            Some(line) => out.push_str(&format!("{origin}:{line}: {}", problem.message)),
            None => out.push_str(&problem.message),
        }
    }
    out
}

/// Reads, expands and validates a config file.
pub fn load_file(file: &Path, overrides: Overrides) -> Result<LoadedConfig, ConfigError> {
    load_file_admitted(file, overrides, None)
}

/// [`load_file`], of a file named by a request from outside when
/// `admission` is given: what it may do is checked first.
pub fn load_file_admitted(
    file: &Path,
    overrides: Overrides,
    admission: Option<&Admission>,
) -> Result<LoadedConfig, ConfigError> {
    let (document, dir) = read_document(file)?;
    let origin = file.display().to_string();
    if original::is_original(&document.value) {
        let conversion = convert_original(&document, file, &dir, admission)?;
        let mut loaded = validate::load(
            conversion.document,
            &dir,
            overrides,
            origin.clone(),
            admission,
        )?;
        loaded.notes = conversion.notes.iter().map(|n| n.render(&origin)).collect();
        return Ok(loaded);
    }
    validate::load(document, &dir, overrides, origin, admission)
}

/// Reads a config of the original system (`original`) and converts it:
/// `evalfleet convert`.
pub fn convert_original_file(file: &Path) -> Result<original::Conversion, ConfigError> {
    let (document, dir) = read_document(file)?;
    if !original::is_original(&document.value) {
        return Err(validate::invalid(
            file.display().to_string(),
            &document,
            vec![(
                String::new(),
                "not a config of the original system: it has no top-level `env:` mapping, or it has `task:` (an evalfleet config)".to_owned(),
            )],
        ));
    }
    convert_original(&document, file, &dir, None)
}

/// `document`, a config of the original read from `file` in `dir`,
/// converted with the variables `admission` lets it read.
fn convert_original(
    document: &Document,
    file: &Path,
    dir: &Path,
    admission: Option<&Admission>,
) -> Result<original::Conversion, ConfigError> {
    let origin = file.display().to_string();
    let vars = Vars::load(dir)
        .map(|vars| match admission {
            Some(admission) => vars.only(admission.env.clone()),
            None => vars,
        })
        .map_err(|message| {
            validate::invalid(origin.clone(), document, vec![(String::new(), message)])
        })?;
    let name = original::run_name(file);
    original::convert(document, &origin, &name, &vars)
        .map_err(|problems| validate::invalid(origin, document, problems))
}

/// A config file's document, and the absolute directory its relative
/// paths are resolved against.
fn read_document(file: &Path) -> Result<(Document, PathBuf), ConfigError> {
    let text = std::fs::read_to_string(file).map_err(|source| ConfigError::Read {
        path: file.to_owned(),
        source,
    })?;
    let document = yaml::parse(&text).map_err(|error| ConfigError::Yaml {
        path: file.to_owned(),
        error,
    })?;
    let dir = match file.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.to_owned());
    Ok((document, dir))
}

/// Reads, expands and validates a config given as text (from a request,
/// which may do only what `admission` allows): its relative paths are
/// resolved against `dir`, and problems name `origin` and their lines.
pub fn load_text(
    text: &str,
    dir: &Path,
    overrides: Overrides,
    origin: &str,
    admission: Option<&Admission>,
) -> Result<LoadedConfig, ConfigError> {
    let document = yaml::parse(text).map_err(|error| ConfigError::Yaml {
        path: PathBuf::from(origin),
        error,
    })?;
    let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.to_owned());
    validate::load(document, &dir, overrides, origin.to_owned(), admission)
}

/// Rebuilds a config from a stored snapshot, expanding `${VAR}` again from the
/// environment and the `.env` in `dir`.
pub fn load_snapshot(snapshot: &Value, dir: &Path) -> Result<LoadedConfig, ConfigError> {
    let document = Document {
        value: snapshot.clone(),
        lines: Default::default(),
    };
    validate::load(
        document,
        dir,
        Overrides::default(),
        "the stored config".to_owned(),
        None,
    )
}

/// Rebuilds a stored config as [`load_snapshot`] does, with the endpoints
/// of `file` in place of its own: a file whose only key is `endpoints:`,
/// written as in a config (`evalfleet worker --endpoints FILE`, the
/// engines of the worker's own host). Its problems are named with its
/// lines.
pub fn load_snapshot_with_endpoints(
    snapshot: &Value,
    dir: &Path,
    file: &Path,
) -> Result<LoadedConfig, ConfigError> {
    let (document, _) = read_document(file)?;
    let origin = file.display().to_string();
    let problem = |line: Option<usize>, message: String| ConfigError::Invalid {
        origin: origin.clone(),
        problems: vec![Problem { line, message }],
    };
    let Some(map) = document.value.as_object() else {
        return Err(problem(
            None,
            "expected a mapping with one key, `endpoints:` (a list of endpoints, as in a config)"
                .to_owned(),
        ));
    };
    if let Some(other) = map.keys().find(|key| *key != "endpoints") {
        return Err(problem(
            document.lines.get(other.as_str()).copied(),
            format!("unknown key `{other}`: an endpoints file holds only `endpoints:`"),
        ));
    }
    let Some(endpoints) = map.get("endpoints") else {
        return Err(problem(None, "no `endpoints:` in the file".to_owned()));
    };
    let mut value = snapshot.clone();
    if let Some(config) = value.as_object_mut() {
        config.insert("endpoints".to_owned(), endpoints.clone());
    }
    let lines = document
        .lines
        .into_iter()
        .filter(|(path, _)| path.starts_with("endpoints"))
        .collect();
    validate::load(
        Document { value, lines },
        dir,
        Overrides::default(),
        origin.clone(),
        None,
    )
}

/// Rebuilds a stored config to read a run's results by (its task, its
/// metrics, its templates), not to call its endpoints: their secrets
/// (`api_key`, `headers`, an engine's `env`) are left out, so that a key
/// written literally (masked when stored) or a variable not set where the
/// results are read does not stand in the way.
pub fn load_snapshot_to_read(snapshot: &Value, dir: &Path) -> Result<LoadedConfig, ConfigError> {
    let mut snapshot = snapshot.clone();
    if let Some(endpoints) = snapshot.get_mut("endpoints").and_then(Value::as_array_mut) {
        for endpoint in endpoints.iter_mut().filter_map(Value::as_object_mut) {
            for secret in ["api_key", "headers", "env"] {
                endpoint.remove(secret);
            }
        }
    }
    load_snapshot(&snapshot, dir)
}

/// Rebuilds a stored config to report a run's stored results by (its
/// task, its metrics, its templates, its report settings), needing nothing
/// but the store: each endpoint stands as a mock of its name (its address,
/// model, secrets and engine are not read; an LLM judge's metric still
/// names its endpoint), and no `${VAR}` is read from the environment: each
/// is kept as the text it is, so that a variable set when the run ran and
/// not where it is reported does not stand in the way.
pub fn load_snapshot_to_report(snapshot: &Value, dir: &Path) -> Result<LoadedConfig, ConfigError> {
    let mut snapshot = snapshot.clone();
    if let Some(endpoints) = snapshot.get_mut("endpoints").and_then(Value::as_array_mut) {
        for endpoint in endpoints.iter_mut() {
            let mut mock = serde_json::json!({"kind": "mock"});
            // Its name and role: what the task's keys name it by.
            for key in ["name", "role"] {
                if let Some(value) = endpoint.get(key) {
                    mock[key] = value.clone();
                }
            }
            *endpoint = mock;
        }
    }
    keep_references(&mut snapshot);
    load_snapshot(&snapshot, dir)
}

fn keep_references(value: &mut Value) {
    match value {
        Value::String(text) if text.contains("${") => {
            *text = text
                .replace("$${", "\u{0}")
                .replace("${", "$${")
                .replace("\u{0}", "$${");
        }
        Value::Array(items) => items.iter_mut().for_each(keep_references),
        Value::Object(map) => map.values_mut().for_each(keep_references),
        _ => {}
    }
}

#[cfg(test)]
mod tests;
