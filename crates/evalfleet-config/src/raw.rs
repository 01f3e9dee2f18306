//! The config as written: every field optional, so that one pass can read all
//! of a file and the validator can report every problem at once. Unknown keys
//! are collected (not silently ignored) while deserialising.
//!
//! The doc comments of these structs are the user documentation of the
//! config file: `docs/config.md` is generated from them (see
//! [`super::reference`]). Each key says what it does and, in a sentence of
//! its own, its default (`Default ...`) or that it is required
//! (`Required ...`); the validator applies the defaults.

use std::borrow::Cow;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::Deserialize;
use serde_json::{Map, Value};

use super::request::RawMessage;
use super::schema;

/// A run's config: one YAML file. Paths in it are relative to the file;
/// `${VAR}` reads the environment, then a `.env` file beside the config
/// (`${VAR:-default}` gives a default, `$${` is a literal `${`).
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct RawConfig {
    /// The run's name; run ids start with it. Required.
    pub name: Option<String>,
    #[schemars(with = "Option<RawDataset>")]
    pub dataset: Option<Value>,
    /// The endpoints that serve the run: at least one, and at least one
    /// that answers items (not `role: judge`). Required.
    #[schemars(with = "Option<Vec<super::endpoint::RawEndpoint>>")]
    pub endpoints: Option<Value>,
    #[schemars(with = "Option<RawTask>")]
    pub task: Option<Value>,
    #[schemars(with = "Option<RawRetry>")]
    pub retry: Option<Value>,
    #[schemars(with = "Option<RawTimeouts>")]
    pub timeouts: Option<Value>,
    #[schemars(with = "Option<RawWriter>")]
    pub writer: Option<Value>,
    #[schemars(with = "Option<RawCache>")]
    pub cache: Option<Value>,
    #[schemars(with = "Option<RawReport>")]
    pub report: Option<Value>,
    /// After the first Ctrl-C, how long calls in flight may take to finish
    /// before they are abandoned (their items stay pending, for a resume).
    /// Default `30s`.
    #[schemars(with = "Option<schema::Duration>")]
    pub shutdown_grace: Option<String>,
    /// The SQLite store: a path or `sqlite://PATH`, relative to the current
    /// directory (like `--store`), so that `evalfleet resume`, `status` and
    /// `export` find it from the same place. `--store` comes before it.
    /// Default: `$EVALFLEET_STORE`, else `runs/evalfleet.db`.
    pub store: Option<String>,
    #[schemars(with = "Option<super::telemetry::RawTelemetry>")]
    pub telemetry: Option<Value>,
}

/// The schema of a whole config, every subschema in place (no `$ref`).
pub fn config() -> Value {
    schema::of::<RawConfig>()
}

/// Where the items come from: one row of the file is one item, whose fields
/// the templates read. Required, except for a conversation, whose episodes
/// are made up (`task.conversation.sessions`).
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct RawDataset {
    /// The file, relative to the config file: JSONL, CSV or Parquet; for
    /// Parquet also a folder of shards in the Hugging Face layout
    /// (`data/train-00000-of-00003.parquet`, ...). Required, unless the
    /// dataset is a Google Sheet (`sheet`).
    pub path: Option<String>,
    /// `jsonl`, `csv` or `parquet`. Default: from the file's extension
    /// (`.jsonl` and `.ndjson` are JSONL, `.csv` is CSV, `.parquet` is
    /// Parquet); a folder is Parquet.
    pub format: Option<String>,
    /// Of a folder of Parquet shards, the split to read: the shards whose
    /// file name starts with `SPLIT-` or is `SPLIT.parquet`, or that lie in
    /// a folder named `SPLIT`. Default: the folder's only split, else
    /// `train`. Only for a folder.
    pub split: Option<String>,
    /// The field that holds each item's id. Without it an item's id is a hash
    /// of its content, which is stable across shuffles, samples and resumes.
    /// Default: none (the hash).
    pub id_field: Option<String>,
    pub sample: Option<RawSample>,
    /// Only the first N rows of the file are items (`--limit N` sets it),
    /// for a quick look at a task before the whole run. Not with `sample`.
    /// Default: none (every row).
    pub limit: Option<u64>,
    /// Record a malformed row as a failed item and go on, instead of refusing
    /// the dataset. Default `false`.
    pub skip_invalid: Option<bool>,
    pub sheet: Option<super::sheets::RawSheet>,
}

/// A deterministic sample of the items: the same `n` and `seed` pick the same
/// items. `--n-sample` and `--seed` override it. Default: none (every item).
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct RawSample {
    /// How many items to take (all of them when the dataset has fewer).
    /// Required in a sample.
    pub n: Option<u64>,
    /// Seed of the choice. Default 0.
    pub seed: Option<u64>,
}

/// How an item becomes requests and a result. Required.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct RawTask {
    /// What the task does with an item: `chat` (one call, and re-asks of
    /// answers that cannot be used), `code` (the answer is a program, judged
    /// against the item's tests: `task.code`), `refine` (ask, then ask for a
    /// better answer: `task.refine`) or `conversation` (a simulated
    /// conversation: `task.conversation`). Default `code` with `task.code`,
    /// `refine` with `task.refine`, `conversation` with
    /// `task.conversation`, else `chat`.
    pub kind: Option<String>,
    /// The chat messages sent for an item (the default prompt, named
    /// `default`, when `prompts` are given). Required, except for a
    /// conversation, or when a rule of `prompts` has no condition.
    pub messages: Option<Vec<RawMessage>>,
    /// Rules that give some items (by their fields) or some models other
    /// messages than `messages`: the first rule that takes an item gives
    /// its messages, and each result records the rule's name. Not for a
    /// conversation. Default: none (`messages` for every item).
    #[schemars(with = "Option<Vec<super::prompts::RawPrompt>>")]
    pub prompts: Option<Vec<Value>>,
    /// How image values in messages (image parts, `images:`) become the
    /// bytes sent. Default: every key's default.
    pub images: Option<super::images::RawImages>,
    /// Generation parameters sent with every request as they are
    /// (`max_tokens`, `temperature`, ...); `model`, `messages`, `stream` and
    /// `stream_options` are evalfleet's own. Default: none.
    pub params: Option<Map<String, Value>>,
    /// Stream responses (SSE, with usage), which measures the time to the
    /// first token and between tokens. Default `false`.
    pub stream: Option<bool>,
    /// Samples per dataset row, 1 to 10000. With K above 1 each row becomes K
    /// items, `ID#0` to `ID#K-1`, distinct requests (and cache keys) for
    /// pass@k and majority votes; use a temperature above 0. Default 1.
    pub n: Option<u32>,
    /// How the answer is read before it is checked and scored: `whole` (the
    /// text), `json`, `choice` (a letter among `ABCD`), `{regex: PATTERN,
    /// group: N, match: first|last}` or `{choice: LETTERS}`. Default
    /// `whole`, or `json` with a `schema`.
    #[schemars(with = "Option<schema::Parse>")]
    pub parse: Option<Value>,
    /// A JSON Schema that the answer, parsed as JSON, must meet; an answer
    /// that does not is re-asked with what was wrong. Default: none.
    #[schemars(with = "Option<schema::AnyJson>")]
    pub schema: Option<Value>,
    /// A file holding `schema` (relative to the config file), instead of
    /// `schema` itself. Default: none.
    pub schema_file: Option<String>,
    /// How many times an answer that cannot be used (not parsed, not valid
    /// against the schema) is asked again, with what was wrong. Default 2
    /// when answers are parsed (`parse` other than `whole`, or a schema),
    /// else 0.
    pub max_reasks: Option<u32>,
    /// Also send `schema` as the request's `response_format` (structured
    /// output); needs `schema`, and `params` may not set `response_format`.
    /// Default `false`.
    pub structured_output: Option<bool>,
    /// How answers are scored: metric names (`exact_match`) or mappings
    /// with `name` and the metric's parameters (`docs/metrics.md` defines
    /// each). A code task always has `code_accepted`, a conversation its
    /// `episode_*` scores. Default: none.
    #[schemars(with = "Option<Vec<schema::Metric>>")]
    pub metrics: Option<Vec<Value>>,
    /// Outside programs that score answers, each giving metrics named
    /// `NAME@BACKEND` in `metrics` (`docs/metrics.md`, "Metric backends",
    /// gives the protocol). Default: none.
    #[schemars(with = "Option<Vec<RawMetricBackend>>")]
    pub metric_backends: Option<Value>,
    #[schemars(with = "Option<RawCode>")]
    pub code: Option<Value>,
    #[schemars(with = "Option<RawRefine>")]
    pub refine: Option<Value>,
    #[schemars(with = "Option<super::conversation::RawConversation>")]
    pub conversation: Option<Value>,
    /// `kind: exec`: the program run once per item (an agent), as a command
    /// line or a list of words, run in a folder of its own in the sandbox;
    /// an argument that names a file of the config's folder is given as
    /// that file's path. Its standard output is the answer. Required with
    /// `kind: exec`.
    #[schemars(with = "Option<schema::Command>")]
    pub command: Option<Value>,
    /// `kind: exec`: how the item reaches the program: `stdin` (one JSON
    /// object), `file` (`item.json`, its path the last argument and
    /// `$EVALFLEET_ITEM_FILE`) or `args` (the JSON text, the last
    /// argument); or `{via: stdin|file|args, fields: [NAME, ...]}`, the
    /// item's fields the program gets. Without `fields` it gets every field
    /// but those the metrics' references read (`task.metrics[].reference`),
    /// so that no agent is handed its answer key.
    /// Default `stdin`.
    #[schemars(with = "Option<schema::AgentInput>")]
    pub input: Option<Value>,
    /// `kind: exec`: how long one run of the program may take before it,
    /// with every process it started, is killed (a failed attempt, retried
    /// as `retry` says). Default `10m`.
    #[schemars(with = "Option<schema::Duration>")]
    pub timeout: Option<String>,
    /// `kind: exec`: programs running at once, 1 to 4096. Default 16.
    pub concurrency: Option<u32>,
    /// `kind: exec`: the memory, in MiB, that one run of the program may
    /// use, its processes (children, daemons) all together where evalfleet
    /// can make a memory cgroup per slot (as root; else each process
    /// alone); past it the kernel kills one and the attempt fails. At least
    /// 64. Default 16384.
    pub memory_mb: Option<u64>,
    /// `kind: exec`: the space, in MiB, that one run of the program may
    /// fill in its folder (its working directory, `HOME` and `TMPDIR`), all
    /// its files together: the folder is a file system in memory of that
    /// size, made for the run and gone with it (its bytes count towards
    /// `memory_mb` too); past it a write fails with "No space left on
    /// device". Enforced where the sandbox has a mount namespace (as root).
    /// 1 to 1048576. Default 2048.
    pub disk_mb: Option<u64>,
    /// `kind: exec`: how the program runs: `item` (once per item, the item
    /// on its input, its answer on its output) or `server` (started once,
    /// `task.servers` of it, each serving many items at once over
    /// evalfleet's agent protocol: JSON lines on its standard input and
    /// output, each item with its own address at the gateway; for Python,
    /// `python3 -m evalfleet_agent agent.py solve` serves a function
    /// `solve(item, client)`; see docs/agents.md). In `server` mode the
    /// limits (`memory_mb`, `disk_mb`) hold per process. Default `item`.
    pub mode: Option<String>,
    /// `kind: exec` with `task.mode: server`: how many agent processes
    /// serve the items, 1 to 256 (items go to the least busy). Default 1.
    pub servers: Option<u32>,
    /// `kind: exec`: what the program may reach: `gateway` (the run's
    /// gateway and nothing else: a network namespace of the sandbox whose
    /// loopback only the gateway listens on; the file system read-only but
    /// for its folder) or `open` (this machine's network, for agents whose
    /// tools need it; the gateway on this machine's 127.0.0.1; the file
    /// system as its own user finds it). Default `gateway`.
    pub network: Option<String>,
    /// `kind: exec`: more environment variables for the program (strings;
    /// `${VAR}` reads ours). `OPENAI_BASE_URL`, `OPENAI_API_KEY` and
    /// `EVALFLEET_*` are evalfleet's. Default: none.
    pub env: Option<Map<String, Value>>,
    /// `kind: exec`: what one run of an item's agent may use through the
    /// gateway (`calls`, `tokens`, `time`); past it, its calls are answered
    /// 429 `budget_exhausted`. Default: no limit.
    #[schemars(with = "Option<super::exec::RawBudget>")]
    pub budget: Option<Value>,
    /// `kind: exec`: the model names the agent may ask the gateway for,
    /// each mapped to an endpoint's name or model (`gpt-4o-mini: qwen3-4b`);
    /// `"*"` maps any other name. Default: every name goes to the endpoints
    /// that answer items.
    pub models: Option<Map<String, Value>>,
}

/// An outside metric backend: a program that reads answers as JSON lines
/// on its stdin and writes their scores as JSON lines on its stdout.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawMetricBackend {
    /// What `metrics` calls it: `anls@NAME`. Letters, digits, `_` and
    /// `-`; not `native` (the built-in metrics). Required.
    pub name: Option<String>,
    /// The backend's version, part of its metrics' keys
    /// (`anls@NAME@VERSION`); give a new one when what the program computes
    /// changes. Default 1.
    pub version: Option<u32>,
    /// The program and its arguments, run in the config file's folder; an
    /// argument's `{setup_dir}` is the folder `setup` made (also in
    /// `$EVALFLEET_BACKEND_DIR`). Required.
    pub command: Option<Vec<String>>,
    /// A command run once, in a new folder of the cache
    /// (`$XDG_CACHE_HOME/evalfleet/metric-backends/HASH`), before the
    /// backend first starts: e.g. `[sh, -c, "python3 -m venv venv &&
    /// venv/bin/pip install evalscope"]`. The folder is kept and reused by
    /// every run whose setup is the same command from the same config
    /// folder; a changed command makes a new one. Default: none.
    pub setup: Option<Vec<String>>,
    /// How long `setup` may run before it (with every process it started)
    /// is killed and the run stops with exit code 2. Default `30m`.
    #[schemars(with = "Option<schema::Duration>")]
    pub setup_timeout: Option<String>,
    /// How long the program may take to score one answer before it is
    /// stopped (and started again for the answers after) and the answers it
    /// holds are left unscored. Default `60s`.
    #[schemars(with = "Option<schema::Duration>")]
    pub timeout: Option<String>,
    /// How many answers are sent ahead of their scores, 1 to 10000; when
    /// that many wait, finished items wait for the backend. Default 64.
    pub queue: Option<u32>,
    /// The metrics it gives: names, or mappings with `name`,
    /// `higher_is_better` (default `true`) and `summary`. Required.
    #[schemars(with = "Option<Vec<BackendMetric>>")]
    pub metrics: Option<Vec<Value>>,
}

/// A metric a backend gives, as a mapping.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawBackendMetric {
    /// Its name, as `metrics` gives it before `@`. Required.
    pub name: Option<String>,
    /// Whether a higher score is better. Default `true`.
    pub higher_is_better: Option<bool>,
    /// What it measures, in one line (`evalfleet metrics`). Default: none.
    pub summary: Option<String>,
}

/// `task.metric_backends[].metrics[]`: a metric's name, or a mapping with
/// its name.
pub(super) struct BackendMetric;

impl JsonSchema for BackendMetric {
    fn schema_name() -> Cow<'static, str> {
        "BackendMetric".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(generator: &mut SchemaGenerator) -> Schema {
        json_schema!({"anyOf": [
            {"type": "string"},
            generator.subschema_for::<RawBackendMetric>(),
        ]})
    }
}

/// `kind: refine`: ask, then ask the model `rounds` times to improve its
/// answer; the last answer is checked and scored. Default: every key's
/// default.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct RawRefine {
    /// The user message that asks for a better answer: a template over the
    /// item's fields and `answer` (the answer so far). Default: `Review your
    /// answer and improve it. Reply with the improved answer only, in the
    /// same format.`
    pub prompt: Option<String>,
    /// How many times to ask (each a call of its own), 1 to 20. Default 1.
    pub rounds: Option<u32>,
}

/// `kind: code`: answers are programs, judged against each item's tests in a
/// sandbox (`docs/metrics.md`, "Code tasks"). Required with `kind: code`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct RawCode {
    /// How an item gives its tests: `humaneval`, `mbpp` (both Python) or
    /// `stdio` (inputs and expected outputs). Required.
    pub format: Option<String>,
    /// `python`, `cpp` or `rust`; C++ and Rust are judged on `stdio` tests
    /// only. Default `python`.
    pub language: Option<String>,
    /// CPU time a program may take on one test, in whole seconds (on
    /// SandboxFusion too: the program sets it itself). Default `10s`.
    #[schemars(with = "Option<schema::Duration>")]
    pub timeout: Option<String>,
    /// Wall-clock time a program may take on one test (SandboxFusion's
    /// `run_timeout`). Default: three times `timeout`.
    #[schemars(with = "Option<schema::Duration>")]
    pub wall_timeout: Option<String>,
    /// Memory (address space) a program may use, in MB (on SandboxFusion
    /// too: the program sets it itself). Default 1024.
    pub memory_mb: Option<u64>,
    /// Bytes of output (stdout and stderr) a program may write; past them it
    /// is killed. Default 1048576 (1 MiB).
    pub output_bytes: Option<usize>,
    /// Stop a problem's remaining tests at its first failure. Default
    /// `false`.
    pub early_exit: Option<bool>,
    /// Programs run (or sent to the sandbox server) at once over the whole
    /// run. Default: the machine's cores, or 20 (seed 003's) with
    /// `backend: sandboxfusion`.
    pub judge_concurrency: Option<usize>,
    /// `stdio`: numbers in the output may differ from the expected ones by
    /// this much (absolute or relative). Default: none (the text must be
    /// equal).
    pub float_tolerance: Option<f64>,
    /// The Python interpreter (a name on the sandbox's PATH, or a path);
    /// only with `language: python`. Default `python3`.
    pub python: Option<String>,
    /// The compiler (a name on the sandbox's PATH, or a path); only with
    /// `language: cpp` or `rust`. Default `g++` for C++, `rustc` for Rust.
    pub compiler: Option<String>,
    /// CPU time a compilation may take (twice that on the wall clock); a
    /// program is compiled once per answer. Default `30s`.
    #[schemars(with = "Option<schema::Duration>")]
    pub compile_timeout: Option<String>,
    /// `stdio`: the item's field, or fields in order, that hold its tests
    /// (e.g. `[public_tests, private_tests]`). Default `tests`.
    pub tests_field: Option<OneOrMany>,
    /// Where programs run: `local` (a sandbox on this machine) or
    /// `sandboxfusion` (a SandboxFusion server at `sandbox_url`). Default
    /// `local`.
    pub backend: Option<String>,
    /// The SandboxFusion server's address, like `http://host:8080`. Required
    /// with `backend: sandboxfusion`.
    pub sandbox_url: Option<String>,
    /// `backend: sandboxfusion`: at most how many times a failed call to
    /// the server (the network, its own errors, overload) is tried again.
    /// Default: as many as `sandbox_retry_for` allows.
    pub sandbox_retries: Option<u32>,
    /// `backend: sandboxfusion`: how long a failed call to the server is
    /// tried again for, waiting 1, 2, 4, 8, then 16 s (with jitter, never
    /// less than its `Retry-After`), so that a server that restarts is
    /// ridden out. Default `2m`.
    pub sandbox_retry_for: Option<String>,
}

/// A text, or a list of texts.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

/// How failed calls are retried. Default: every key's default.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct RawRetry {
    /// Tries per call, the first included: an item's answer, a re-ask, a
    /// judge's call, a refine round are each a call of their own; tries
    /// before a resume count (a resume always gives one more). 429s of an
    /// item's call do not count: its deadline (`timeouts.item`) bounds
    /// them. Default 10.
    pub max_attempts: Option<u32>,
    /// The first backoff's ceiling; it doubles with each retry, with full
    /// jitter (not for a fault of the call alone, such as a 500, a reset
    /// connection or a broken stream, where its endpoint answers most
    /// calls: the call is sent again at once when no `Retry-After` says
    /// otherwise, within the retry budget, unless its last try failed so
    /// too: a second such fault in a row waits as a first retry would).
    /// Default `100ms`.
    #[schemars(with = "Option<schema::Duration>")]
    pub backoff_base: Option<String>,
    /// The longest backoff; at least `backoff_base`. Default `30s`.
    #[schemars(with = "Option<schema::Duration>")]
    pub backoff_max: Option<String>,
    /// Retries allowed per first try over the last 10 seconds, so that an
    /// outage does not multiply the load: a retry past it waits (up to its
    /// item's deadline). Default 0.5.
    pub budget: Option<f64>,
    /// Retries a second allowed whatever the budget. Default 10.
    pub budget_floor: Option<f64>,
    /// How long a judge's call (a call addressed to a named endpoint, as an
    /// LLM judge's are) is tried again, however many tries that takes, when
    /// it fails in a way a retry may fix or its endpoint is down (unhealthy,
    /// restarting): a judge that restarts is ridden out instead of leaving
    /// answers unjudged. An endpoint left out of the run fails its calls
    /// after `max_attempts` tries. Default `2m`.
    #[schemars(with = "Option<schema::Duration>")]
    pub judge_for: Option<String>,
}

/// How long calls, items and the run may take. Default: every key's
/// default.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct RawTimeouts {
    /// One call, from send to the last byte; `endpoints[].timeout` overrides
    /// it for one endpoint. Default `300s`.
    #[schemars(with = "Option<schema::Duration>")]
    pub attempt: Option<String>,
    /// An item from its first attempt to its result, retries included; when
    /// passed, the item fails. Default `1h`.
    #[schemars(with = "Option<schema::Duration>")]
    pub item: Option<String>,
    /// How long the run waits with no endpoint able to take items (all
    /// unhealthy, or none taking part) before it stops, interrupted and
    /// resumable. Default `10m`.
    #[schemars(with = "Option<schema::Duration>")]
    pub no_endpoint: Option<String>,
    /// How long the run waits for a first answer when no endpoint that
    /// takes items has ever answered since it started (every try refused,
    /// or no such host): then it stops, interrupted and resumable, naming
    /// each address and its error. A server started beside the run (vLLM
    /// loading a large model) may need longer. Default `30s`.
    #[schemars(with = "Option<schema::Duration>")]
    pub first_answer: Option<String>,
    /// How long a worker's claim on items lasts unless renewed (it renews
    /// every third of it while it lives), at least `300ms`. When a worker
    /// dies on another host, its items go to the run's other workers after
    /// this; one on this host that dies frees them at once. Default `30s`.
    #[schemars(with = "Option<schema::Duration>")]
    pub lease: Option<String>,
    /// How long a streamed call may wait for the first byte of its answer
    /// (its headers and its first event, both within this from the send)
    /// before it is given up and retried. A non-streamed answer comes
    /// whole: only `attempt` bounds it. Default `120s`.
    #[schemars(with = "Option<schema::Duration>")]
    pub first_byte: Option<String>,
    /// The longest a stream may send nothing before it is given up as
    /// stalled and retried; a stream quiet far longer than its endpoint's
    /// recent streams ever were is given up sooner. Default `30s`.
    #[schemars(with = "Option<schema::Duration>")]
    pub stream_idle: Option<String>,
}

/// What makes a run's scores unusable. Default: every key's default.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct RawReport {
    /// The share (0 to 1) of the answers it could judge that a metric may
    /// fail to score (no usable reference, a failed judge) before `run` and
    /// `report` exit non-zero; 1 fails only a metric that could score none
    /// of them. Default 1.
    pub max_unscored: Option<f64>,
    /// The item fields (one, or a list) that `evalfleet report`, the
    /// report page and its API group results by when not told otherwise
    /// (`--by`); `@prompt` is the rule of `task.prompts` that made an
    /// item's messages, and `[]` groups nothing. Default: `doc_type` when
    /// the run's items have that field, else none.
    pub by: Option<OneOrMany>,
}

/// How results are committed to the store. Default: every key's default.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct RawWriter {
    /// Results per transaction, at most (1 to 100000). Default 512.
    pub batch_size: Option<usize>,
    /// The longest wait before a partial batch is committed. Default
    /// `200ms`.
    #[schemars(with = "Option<schema::Duration>")]
    pub flush_interval: Option<String>,
}

/// Answers kept by request (the model, the parameters and the messages), so
/// that the same request is answered from the cache. Without `cache:` there
/// is no cache. Default: none (off).
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct RawCache {
    /// `read_write` (use and fill the cache), `read`, `write` or `off`.
    /// Default `read_write` (when `cache:` is given).
    pub mode: Option<String>,
    /// A file of its own for the cache, shared by runs of several stores;
    /// relative to the current directory, like `store`. Default: the run's
    /// store.
    pub path: Option<String>,
    /// Entries older than this are not used (and are evicted first).
    /// Default: none (entries do not expire).
    #[schemars(with = "Option<schema::Duration>")]
    pub ttl: Option<String>,
    /// The most entries kept; the oldest go first. Default: none (no
    /// limit).
    pub max_entries: Option<u64>,
}
