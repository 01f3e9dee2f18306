//! `endpoints[]`: what each endpoint is, how it is reached, started, limited
//! and watched. The raw structs' doc comments are the user documentation of
//! these keys (`docs/config.md`).

use std::collections::BTreeMap;
use std::time::Duration;

use std::borrow::Cow;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::Deserialize;
use serde_json::{Map, Value};

use super::problems::Problems;
use super::read;
use super::request::params;
use super::{MASK, MockSettings, Secret, path};

/// `endpoints[]`: one OpenAI-compatible server.
#[derive(Debug, Clone)]
pub struct EndpointConfig {
    /// A unique name (letters, digits, `-`, `_`, `.`).
    pub name: String,
    /// The model name sent in each request (and, for engines evalfleet
    /// starts, the model it serves).
    pub model: String,
    pub kind: EndpointKind,
    /// `adaptive` (the default: evalfleet finds the limit itself), a number of
    /// calls in flight (fixed), or `{min, max, initial, decrease_ratio, gain}`
    /// (adaptive within bounds; defaults 1, 1024, 8, 0.7 and 0.2: the share
    /// of a step's proportional gain in throughput it must bring).
    pub concurrency: LimitMode,
    /// Requests per minute allowed (a token bucket); unset: no limit.
    pub rpm: Option<u32>,
    /// Tokens (prompt + completion) per minute allowed; the cost of a call is
    /// estimated before it and corrected from its `usage` after.
    pub tpm: Option<u64>,
    /// Per-attempt timeout for this endpoint; default `timeouts.attempt`.
    pub timeout: Option<Duration>,
    /// `Authorization: Bearer` key. A secret: never stored or shown.
    pub api_key: Option<Secret>,
    /// Extra HTTP headers sent as they are; values are treated as secrets.
    pub headers: Vec<(String, Secret)>,
    /// Extra body fields merged over `task.params` and passed through untouched
    /// (e.g. vLLM's `top_k`, `chat_template_kwargs`).
    pub params: Map<String, Value>,
    pub health: HealthSettings,
    /// Reading the engine's own account of its load.
    pub load: LoadSettings,
    /// `role`: what the endpoint is for.
    pub role: EndpointRole,
}

/// `role:` what an endpoint is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointRole {
    /// `items` (the default): it answers the run's items.
    Items,
    /// `judge`: it answers `llm_judge` metrics' calls and takes no items.
    Judge,
}

impl EndpointConfig {
    /// Whether the endpoint answers the run's items (a judge endpoint does
    /// not).
    pub fn takes_items(&self) -> bool {
        self.role == EndpointRole::Items
    }

    /// The most calls this endpoint may ever have in flight.
    pub fn max_concurrency(&self) -> usize {
        match self.concurrency {
            LimitMode::Fixed(n) => n,
            LimitMode::Adaptive(settings) => settings.max,
        }
    }
}

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
        }
    }
}

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

/// `kind:` and what it needs.
#[derive(Debug, Clone, PartialEq)]
pub enum EndpointKind {
    /// The built-in mock, started inside the run; behaviour under `mock:`.
    Mock(Box<MockSettings>),
    /// A server someone else runs, at `base_url` (e.g. `http://host:8000/v1`);
    /// `start_cmd` and `stop_cmd` (shell commands, e.g. `ssh host ...`) run at
    /// the start and the end of the run when given.
    External {
        base_url: String,
        start_cmd: Option<String>,
        stop_cmd: Option<String>,
    },
    /// An engine evalfleet starts on this machine and stops at the end.
    Local(Box<Engine>),
    /// An engine evalfleet starts on another host over SSH, in a tmux
    /// session, reached through a forwarded port.
    Remote(Box<Remote>),
}

impl EndpointKind {
    pub fn name(&self) -> &'static str {
        match self {
            Self::Mock(_) => "mock",
            Self::External { .. } => "external",
            Self::Local(_) => "local",
            Self::Remote(_) => "remote",
        }
    }

    /// The engine evalfleet manages, if any.
    pub fn engine(&self) -> Option<&Engine> {
        match self {
            Self::Local(engine) => Some(engine),
            Self::Remote(remote) => Some(&remote.engine),
            _ => None,
        }
    }
}

/// Launch presets: the command, where its API lives, and how readiness shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    Vllm,
    Sglang,
    LlamaCpp,
    Ollama,
}

impl Preset {
    const ALL: [(&'static str, Preset); 4] = [
        ("vllm", Preset::Vllm),
        ("sglang", Preset::Sglang),
        ("llama.cpp", Preset::LlamaCpp),
        ("ollama", Preset::Ollama),
    ];

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.iter().find(|(n, _)| *n == name).map(|(_, p)| *p)
    }

    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(_, p)| *p == self)
            .map_or("?", |(n, _)| n)
    }

    /// The command template.
    pub fn command(self) -> &'static str {
        match self {
            Self::Vllm => "vllm serve {model} --host 127.0.0.1 --port {port} {args}",
            Self::Sglang => {
                "python3 -m sglang.launch_server --model-path {model} --host 127.0.0.1 --port {port} --enable-metrics {args}"
            }
            Self::LlamaCpp => {
                "llama-server --model {model} --host 127.0.0.1 --port {port} --metrics {args}"
            }
            Self::Ollama => "OLLAMA_HOST=127.0.0.1:{port} ollama serve {args}",
        }
    }

    /// The path that answers once the engine can serve, and costs it
    /// nothing to ask: llama.cpp's, vLLM's and SGLang's own `/health`
    /// (503 while llama.cpp or SGLang load; SGLang's makes one token only
    /// when nothing else runs), Ollama's version (it has no health path,
    /// and loads a model only when a call asks for it).
    pub fn health_path(self) -> &'static str {
        match self {
            Self::LlamaCpp | Self::Vllm | Self::Sglang => "/health",
            Self::Ollama => "/api/version",
        }
    }

    /// Whose format its load is read in (Ollama tells none: `/api/ps` lists
    /// the models loaded, not the requests running or waiting).
    pub fn load_engine(self) -> Option<LoadEngine> {
        match self {
            Self::Vllm => Some(LoadEngine::Vllm),
            Self::Sglang => Some(LoadEngine::Sglang),
            Self::LlamaCpp => Some(LoadEngine::LlamaCpp),
            Self::Ollama => None,
        }
    }

    /// Engines load models for minutes.
    pub fn startup_timeout(self) -> Duration {
        match self {
            Self::Vllm | Self::Sglang => Duration::from_secs(20 * 60),
            Self::LlamaCpp | Self::Ollama => Duration::from_secs(10 * 60),
        }
    }
}

/// An engine evalfleet starts (`kind: local`, and the remote part of
/// `kind: remote`).
#[derive(Debug, Clone, PartialEq)]
pub struct Engine {
    /// `vllm`, `sglang`, `llama.cpp` or `ollama`: the command, the health path
    /// and the start-up timeout come from it.
    pub preset: Option<Preset>,
    /// The command, run by `sh -c` after `{model}`, `{port}`, `{args}` and
    /// `{gpu}` are filled in; default: the preset's.
    pub command: String,
    /// Extra arguments for the preset's command (`{args}`).
    pub args: String,
    /// The port it listens on; default: a free one (local) or 8000 (remote).
    pub port: Option<u16>,
    /// `CUDA_VISIBLE_DEVICES` for it (`0`, or `0,1`).
    pub gpu: Option<String>,
    /// Environment variables for it; values are treated as secrets.
    pub env: Vec<(String, Secret)>,
    /// How long it may take to become ready. Default: the preset's, or `10m`.
    pub startup_timeout: Duration,
    /// Between SIGTERM and SIGKILL when it is stopped. Default `30s`.
    pub stop_grace: Duration,
    /// How many times it is restarted when it dies or stays unhealthy, before
    /// it is left out of the run. Default 3.
    pub restarts: u32,
    /// The wait before a restart. Default `30s`.
    pub restart_delay: Duration,
    /// Refuse to start on a GPU that already has more than this many MB in
    /// use (someone else's work); `-y` starts anyway. Default 1024.
    pub gpu_memory_threshold_mb: u64,
}

impl Engine {
    /// The command with its placeholders filled in (`port` may be a
    /// placeholder of its own, for showing the command).
    pub fn render(&self, model: &str, port: impl std::fmt::Display) -> String {
        fill(
            &self.command,
            model,
            &port.to_string(),
            &self.args,
            self.gpu.as_deref(),
        )
    }

    /// The health path on the engine's server.
    pub fn health_path(&self) -> &str {
        self.preset.map_or("/v1/models", Preset::health_path)
    }

    /// How many requests `engine`'s command says it runs at once
    /// (`--max-num-seqs 64`, `-np 4`, `--parallel=4`), when the command
    /// says so.
    pub fn capacity_in_command(&self, engine: LoadEngine) -> Option<usize> {
        let command = fill(&self.command, "", "", &self.args, self.gpu.as_deref());
        let words: Vec<&str> = command.split_whitespace().collect();
        let options = engine.capacity_options();
        // The last one given wins, as with the engines' own parsers.
        words
            .iter()
            .enumerate()
            .filter_map(|(i, word)| {
                options.iter().find_map(|option| {
                    let value = match word.strip_prefix(option)? {
                        "" => words.get(i + 1).copied()?,
                        rest => rest.strip_prefix('=')?,
                    };
                    value.parse::<usize>().ok()
                })
            })
            .next_back()
            .filter(|n| (1..=MAX_CONCURRENCY as usize).contains(n))
    }
}

/// `kind: remote`: an engine on another host, started in a tmux session over
/// SSH and reached through `ssh -L`.
#[derive(Debug, Clone, PartialEq)]
pub struct Remote {
    /// The SSH destination (`user@gpu-box`).
    pub host: String,
    /// The SSH program. Default `ssh`.
    pub ssh: String,
    /// Options before the destination (`["-p", "2222"]`).
    pub ssh_options: Vec<String>,
    /// The tmux session's name. Default `evalfleet-NAME`.
    pub session: String,
    /// The port on this machine that forwards to the engine. Default: a free
    /// one.
    pub local_port: Option<u16>,
    pub engine: Engine,
}

const PLACEHOLDERS: [&str; 4] = ["model", "port", "args", "gpu"];

fn fill(template: &str, model: &str, port: &str, args: &str, gpu: Option<&str>) -> String {
    template
        .replace("{model}", model)
        .replace("{port}", port)
        .replace("{args}", args)
        .replace("{gpu}", gpu.unwrap_or(""))
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// `{word}` placeholders that are not ours (a typo), ignoring JSON braces.
fn unknown_placeholders(template: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        let after = &rest[open + 1..];
        let Some(close) = after.find('}') else { break };
        let word = &after[..close];
        if !word.is_empty()
            && word.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            && !PLACEHOLDERS.contains(&word)
        {
            out.push(format!("{{{word}}}"));
        }
        rest = &after[close..];
    }
    out
}

/// One OpenAI-compatible server, by `kind`: `mock` (the built-in mock,
/// started inside the run), `external` (a server someone else runs, at
/// `base_url`), `local` (an engine evalfleet starts on this machine and
/// stops at the end) or `remote` (an engine evalfleet starts on another
/// host over SSH, in a tmux session, reached through a forwarded port).
/// Some keys are for some kinds only, as each says.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub(super) struct RawEndpoint {
    /// A unique name: letters, digits, `-`, `_` and `.`. Required.
    name: Option<String>,
    /// `mock`, `external`, `local` or `remote`. Required.
    kind: Option<String>,
    /// The model name sent in each request (and, for engines evalfleet
    /// starts, the model it serves). Required, except for `kind: mock`
    /// (default the mock's `model`, else `mock`; a mock serves the
    /// endpoint's model when its own is not given).
    model: Option<String>,
    /// `external`: the server's OpenAI API, e.g. `http://host:8000/v1`.
    /// Required for `kind: external`.
    base_url: Option<String>,
    /// The key sent as `Authorization: Bearer`. A secret: never stored or
    /// shown; write it as `${VAR}`. Default: none.
    api_key: Option<String>,
    /// Calls in flight at once: `adaptive` (evalfleet finds the limit
    /// itself, backing off when round trips grow or the server pushes
    /// back), a fixed number (1 to 100000), or the adaptive limit's
    /// bounds as a mapping. Default `adaptive`.
    #[schemars(with = "Option<Concurrency>")]
    concurrency: Option<Value>,
    /// Requests per minute allowed (a token bucket). Default: none (no
    /// limit).
    rpm: Option<u32>,
    /// Tokens (prompt and completion) per minute allowed; a call's cost is
    /// estimated before it and corrected from its `usage` after. Default:
    /// none (no limit).
    tpm: Option<u64>,
    /// The time one call to this endpoint may take. Default
    /// `timeouts.attempt`.
    #[schemars(with = "Option<super::schema::Duration>")]
    timeout: Option<String>,
    /// Extra HTTP headers sent as they are; their values are secrets, like
    /// `api_key`. Default: none.
    headers: Option<BTreeMap<String, String>>,
    /// Extra body fields merged over `task.params` and passed through
    /// untouched (e.g. vLLM's `top_k`, `chat_template_kwargs`). Default:
    /// none.
    params: Option<Map<String, Value>>,
    /// `mock`: how the mock behaves; the same settings as `evalfleet mock`'s
    /// options. Default: every key's default.
    #[schemars(with = "Option<MockSettings>")]
    mock: Option<Value>,
    #[schemars(with = "Option<RawHealth>")]
    health: Option<Value>,
    #[schemars(with = "Option<RawLoad>")]
    load: Option<Value>,
    /// `external`: a shell command run at the start of the run (e.g. `ssh
    /// host systemctl --user start vllm`). Default: none.
    start_cmd: Option<String>,
    /// `external`: a shell command run at the end of the run. Default:
    /// none.
    stop_cmd: Option<String>,
    /// `local`, `remote`: `vllm`, `sglang`, `llama.cpp` or `ollama`: the
    /// command, the health path and the start-up timeout come from it.
    /// Required for `local` and `remote`, unless `command` is given.
    preset: Option<String>,
    /// `local`, `remote`: the command that starts the engine, run by `sh -c`
    /// after `{model}`, `{port}`, `{args}` and `{gpu}` are filled in.
    /// Default: the preset's.
    command: Option<String>,
    /// `local`, `remote`: extra arguments for the command (`{args}`).
    /// Default: none.
    args: Option<String>,
    /// `local`, `remote`: the port the engine listens on. Default: a free
    /// one (`local`), or 8000 (`remote`).
    port: Option<u16>,
    /// `local`, `remote`: `CUDA_VISIBLE_DEVICES` for the engine (`0`, or
    /// `"0,1"`). Default: none (not set).
    #[schemars(with = "Option<super::schema::Gpu>")]
    gpu: Option<Value>,
    /// `local`, `remote`: environment variables for the engine; their values
    /// are secrets, like `api_key`. Default: none.
    env: Option<BTreeMap<String, String>>,
    /// `local`, `remote`: how long the engine may take to become ready.
    /// Default: the preset's (`20m` for vLLM and SGLang, `10m` for
    /// llama.cpp and Ollama), or `10m`.
    #[schemars(with = "Option<super::schema::Duration>")]
    startup_timeout: Option<String>,
    /// `local`, `remote`: the wait between SIGTERM and SIGKILL when the
    /// engine is stopped. Default `30s`.
    #[schemars(with = "Option<super::schema::Duration>")]
    stop_grace: Option<String>,
    /// `local`, `remote`: how many times the engine is restarted when it
    /// dies or stays unhealthy, before it is left out of the run. Default 3.
    restarts: Option<u32>,
    /// `local`, `remote`: the wait before a restart. Default `30s`.
    #[schemars(with = "Option<super::schema::Duration>")]
    restart_delay: Option<String>,
    /// `local`: refuse to start on a GPU that already has more than this
    /// many MB in use (someone else's work); `-y` starts anyway. Default
    /// 1024.
    gpu_memory_threshold_mb: Option<u64>,
    /// `remote`: the SSH destination (`user@gpu-box`). Required for `kind:
    /// remote`.
    host: Option<String>,
    /// `remote`: the SSH program. Default `ssh`.
    ssh: Option<String>,
    /// `remote`: options before the destination (`["-p", "2222"]`).
    /// Default: none.
    ssh_options: Option<Vec<String>>,
    /// `remote`: the tmux session's name (letters, digits, `-` and `_`).
    /// Default `evalfleet-NAME` (a `.` in the name becomes `_`).
    session: Option<String>,
    /// `remote`: the port on this machine that forwards to the engine.
    /// Default: a free one.
    local_port: Option<u16>,
    /// `items` (the endpoint answers the run's items) or `judge` (it
    /// answers only the calls addressed to it by name: `llm_judge`
    /// metrics, a conversation's calls). Default `items`.
    role: Option<String>,
}

/// How an endpoint is watched. While its calls go well they are the
/// signal, and it is not probed: a monitor probes it once it has shown no
/// sign of life (an answer, a streamed token) for `interval`, which is when
/// it is idle or its calls fail or hang. Failed calls count too. After
/// `max_failures` failures in a row it is unhealthy and gets no new items
/// (its calls in flight go to other endpoints); after `recover_after`
/// successes it is healthy again. Default: every key's default.
#[derive(Debug, Default, Deserialize, JsonSchema)]
struct RawHealth {
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
    #[schemars(with = "Option<super::schema::Duration>")]
    interval: Option<String>,
    /// The time a probe may take. Default `10s`.
    #[schemars(with = "Option<super::schema::Duration>")]
    timeout: Option<String>,
    /// Failures in a row after which the endpoint is unhealthy. Default 3.
    max_failures: Option<u32>,
    /// Successes in a row after which it is healthy again. Default 2.
    recover_after: Option<u32>,
    /// How long an endpoint whose calls fail far more often than its
    /// peers' (or all fail while it answers probes) is taken out the first
    /// time; each ejection soon after another lasts one more of these (up
    /// to ten). Default `30s`.
    #[schemars(with = "Option<super::schema::Duration>")]
    ejection: Option<String>,
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
struct RawLoad {
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
    #[schemars(with = "Option<super::schema::Duration>")]
    interval: Option<String>,
}

/// The adaptive limit's bounds and settings: once a round trip, the limit
/// grows while round trips stay near their unloaded level, and is cut when
/// they rise clearly above it or the server pushes back (429, 503, 408, a
/// timeout).
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub(super) struct RawAdaptive {
    /// The lowest limit, at least 1. Default 1.
    min: Option<usize>,
    /// The highest limit, at most 100000. Default 1024 (or `min`, when
    /// that is higher).
    max: Option<usize>,
    /// The limit to start from, between `min` and `max`. Default 8 (kept
    /// between `min` and `max`).
    initial: Option<usize>,
    /// The factor a cut multiplies the limit by, between 0 and 1. Default
    /// 0.7.
    decrease_ratio: Option<f64>,
    /// How much a step up of the limit must add to throughput, as a share
    /// of what it would add if every added call were served as fast as the
    /// others (0.2: a fifth); where it adds less, more calls would only
    /// wait, and the limit goes back to the fewest calls that served as
    /// well. Between 0 and 1. Default 0.2.
    gain: Option<f64>,
    /// Ignored: the limit no longer follows round trips but throughput
    /// (see `gain`); kept so that configurations that set it still load.
    /// Default: none.
    rtt_tolerance: Option<f64>,
}

/// `endpoints[].concurrency`: `adaptive`, a number of calls, or bounds.
pub(super) struct Concurrency;

impl JsonSchema for Concurrency {
    fn schema_name() -> Cow<'static, str> {
        "Concurrency".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(generator: &mut SchemaGenerator) -> Schema {
        json_schema!({"anyOf": [
            {"const": "adaptive"},
            {"type": "integer", "minimum": 1},
            generator.subschema_for::<RawAdaptive>(),
        ]})
    }
}

const MAX_CONCURRENCY: u64 = 100_000;

pub(super) fn endpoints(
    items: &[Value],
    dir: &std::path::Path,
    p: &mut Problems<'_>,
) -> Option<Vec<EndpointConfig>> {
    let mut out = Vec::with_capacity(items.len());
    let mut names: Vec<(String, usize)> = Vec::new();
    let mut complete = true;
    for (i, value) in items.iter().enumerate() {
        let at = path::index("endpoints", i);
        let parsed = read::section::<RawEndpoint>(value, &at, p.0)
            .and_then(|raw| endpoint(raw, &at, dir, p));
        match parsed {
            Some(endpoint) => {
                if let Some((_, first)) = names.iter().find(|(n, _)| *n == endpoint.name) {
                    p.push::<()>(
                        &path::key(&at, "name"),
                        format!(
                            "'{}' is already the name of endpoints[{first}]",
                            endpoint.name
                        ),
                    );
                    complete = false;
                }
                names.push((endpoint.name.clone(), i));
                out.push(endpoint);
            }
            None => complete = false,
        }
    }
    complete.then_some(out)
}

/// Keys that only some kinds use.
const KIND_KEYS: [(&str, &[&str]); 16] = [
    ("base_url", &["external"]),
    ("start_cmd", &["external"]),
    ("stop_cmd", &["external"]),
    ("mock", &["mock"]),
    ("preset", &["local", "remote"]),
    ("command", &["local", "remote"]),
    ("args", &["local", "remote"]),
    ("port", &["local", "remote"]),
    ("gpu", &["local", "remote"]),
    ("env", &["local", "remote"]),
    ("startup_timeout", &["local", "remote"]),
    ("stop_grace", &["local", "remote"]),
    ("restarts", &["local", "remote"]),
    ("restart_delay", &["local", "remote"]),
    ("gpu_memory_threshold_mb", &["local"]),
    ("host", &["remote"]),
];

const REMOTE_KEYS: [&str; 4] = ["ssh", "ssh_options", "session", "local_port"];

fn present(raw: &RawEndpoint, key: &str) -> bool {
    match key {
        "base_url" => raw.base_url.is_some(),
        "start_cmd" => raw.start_cmd.is_some(),
        "stop_cmd" => raw.stop_cmd.is_some(),
        "mock" => raw.mock.is_some(),
        "preset" => raw.preset.is_some(),
        "command" => raw.command.is_some(),
        "args" => raw.args.is_some(),
        "port" => raw.port.is_some(),
        "gpu" => raw.gpu.is_some(),
        "env" => raw.env.is_some(),
        "startup_timeout" => raw.startup_timeout.is_some(),
        "stop_grace" => raw.stop_grace.is_some(),
        "restarts" => raw.restarts.is_some(),
        "restart_delay" => raw.restart_delay.is_some(),
        "gpu_memory_threshold_mb" => raw.gpu_memory_threshold_mb.is_some(),
        "host" => raw.host.is_some(),
        "ssh" => raw.ssh.is_some(),
        "ssh_options" => raw.ssh_options.is_some(),
        "session" => raw.session.is_some(),
        "local_port" => raw.local_port.is_some(),
        _ => false,
    }
}

fn endpoint(
    raw: RawEndpoint,
    at: &str,
    dir: &std::path::Path,
    p: &mut Problems<'_>,
) -> Option<EndpointConfig> {
    let field = |name: &str| path::key(at, name);
    let name = match raw.name.clone() {
        None => p.push(&field("name"), "is required"),
        Some(n) if n.is_empty() => p.push(&field("name"), "must not be empty"),
        Some(n)
            if !n
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) =>
        {
            p.push(
                &field("name"),
                format!("'{n}' may hold only letters, digits, '-', '_' and '.'"),
            )
        }
        Some(n) => Some(n),
    };
    let kind_name = raw.kind.clone();
    // A mock serves one model name: the endpoint's, else its own.
    let mock_model = raw
        .mock
        .as_ref()
        .and_then(|m| m.get("model"))
        .and_then(serde_json::Value::as_str)
        .map(str::to_owned);
    let model = match raw.model.clone() {
        None if kind_name.as_deref() == Some("mock") => {
            Some(mock_model.clone().unwrap_or_else(|| "mock".to_owned()))
        }
        None => p.push(
            &field("model"),
            "is required (the model name sent in requests)",
        ),
        Some(m) if m.is_empty() => p.push(&field("model"), "must not be empty"),
        Some(m) => Some(m),
    };

    // Keys that do not belong to this kind.
    if let Some(kind) = kind_name.as_deref() {
        for (key, kinds) in KIND_KEYS {
            if present(&raw, key) && !kinds.contains(&kind) {
                p.push::<()>(
                    &field(key),
                    format!("is only for endpoints of kind {}", kinds.join(" or ")),
                );
            }
        }
        for key in REMOTE_KEYS {
            if present(&raw, key) && kind != "remote" {
                p.push::<()>(&field(key), "is only for endpoints of kind remote");
            }
        }
    }

    let kind = match kind_name.as_deref() {
        None => p.push(
            &field("kind"),
            "is required: mock, external, local or remote",
        ),
        Some("mock") => {
            let settings = match &raw.mock {
                Some(value) => read::section::<MockSettings>(value, &field("mock"), p.0),
                None => Some(MockSettings::default()),
            };
            settings.and_then(|mut settings| {
                if let (None, Some(model)) = (&mock_model, &raw.model) {
                    settings.model.clone_from(model);
                }
                // Like every path of the config: relative to its file.
                settings.answers = settings.answers.map(|answers| dir.join(answers));
                let before = p.0.len();
                for (name, message) in settings.problems() {
                    p.push::<()>(&path::key(&field("mock"), name), message);
                }
                (p.0.len() == before).then(|| EndpointKind::Mock(Box::new(settings)))
            })
        }
        Some("external") => match &raw.base_url {
            None => p.push(
                &field("base_url"),
                "is required for an external endpoint (e.g. http://host:8000/v1)",
            ),
            Some(url) => {
                base_url(url, &field("base_url"), p).map(|base_url| EndpointKind::External {
                    base_url,
                    start_cmd: raw.start_cmd.clone(),
                    stop_cmd: raw.stop_cmd.clone(),
                })
            }
        },
        Some("local") => {
            engine(&raw, at, p, 1024).map(|engine| EndpointKind::Local(Box::new(engine)))
        }
        Some("remote") => {
            let host = match raw.host.as_deref() {
                None => p.push(
                    &field("host"),
                    "is required for a remote endpoint (user@host)",
                ),
                Some(h) if h.trim().is_empty() || h.starts_with('-') => p.push(
                    &field("host"),
                    format!("must be an SSH destination like user@host, got '{h}'"),
                ),
                Some(h) => Some(h.to_owned()),
            };
            let engine = engine(&raw, at, p, 0);
            // tmux would change '.' and ':' in a session's name, and the
            // name is part of file names on the host.
            let session = match raw.session.clone() {
                Some(s)
                    if s.is_empty()
                        || !s
                            .chars()
                            .all(|c| c.is_ascii_alphanumeric() || "-_".contains(c)) =>
                {
                    p.push(
                        &field("session"),
                        format!("'{s}' may hold only letters, digits, '-' and '_'"),
                    )
                }
                Some(s) => Some(s),
                None => Some(format!(
                    "evalfleet-{}",
                    raw.name.as_deref().unwrap_or("engine").replace('.', "_")
                )),
            };
            match (host, engine, session) {
                (Some(host), Some(engine), Some(session)) => {
                    Some(EndpointKind::Remote(Box::new(Remote {
                        host,
                        ssh: raw.ssh.clone().unwrap_or_else(|| "ssh".to_owned()),
                        ssh_options: raw.ssh_options.clone().unwrap_or_default(),
                        session,
                        local_port: raw.local_port,
                        engine,
                    })))
                }
                _ => None,
            }
        }
        Some(other) => p.push(
            &field("kind"),
            format!("must be mock, external, local or remote, got '{other}'"),
        ),
    };

    let concurrency = concurrency(raw.concurrency.as_ref(), &field("concurrency"), p);
    let rpm = match raw.rpm {
        Some(0) => p.push(&field("rpm"), "must be at least 1, got 0"),
        other => Some(other),
    };
    let tpm = match raw.tpm {
        Some(0) => p.push(&field("tpm"), "must be at least 1, got 0"),
        other => Some(other),
    };
    let timeout = match raw.timeout.as_deref() {
        Some(text) => p.duration(&field("timeout"), Some(text), "").map(Some),
        None => Some(None),
    };
    let api_key = match raw.api_key {
        Some(key) if key == MASK => p.push(
            &field("api_key"),
            "was written literally in the config, so it was not stored; write it as ${VAR}, or resume with --config FILE",
        ),
        Some(key) if key.is_empty() => p.push(&field("api_key"), "is empty (is its variable set to nothing?)"),
        other => Some(other.map(Secret::new)),
    };
    let headers = secrets(raw.headers.clone(), &field("headers"), p, |name| {
        reqwest::header::HeaderName::from_bytes(name.as_bytes()).is_ok()
    })
    .and_then(|headers| {
        let mut ok = true;
        for (name, value) in &headers {
            if reqwest::header::HeaderValue::from_str(value.expose()).is_err() {
                ok = p
                    .push::<()>(
                        &path::key(&field("headers"), name),
                        "is not a valid HTTP header value",
                    )
                    .is_some();
            }
        }
        ok.then_some(headers)
    });
    let params = params(raw.params.clone(), &field("params"), p);
    let health = match &raw.health {
        Some(value) => read::section::<RawHealth>(value, &field("health"), p.0)
            .and_then(|h| health(h, &field("health"), p)),
        None => Some(HealthSettings::default()),
    };
    let default_engine = match &kind {
        Some(EndpointKind::Local(engine)) => engine.preset.and_then(Preset::load_engine),
        Some(EndpointKind::Remote(remote)) => remote.engine.preset.and_then(Preset::load_engine),
        _ => None,
    };
    let load = match &raw.load {
        Some(value) => read::section::<RawLoad>(value, &field("load"), p.0)
            .and_then(|l| load(l, default_engine, &field("load"), p)),
        None => Some(LoadSettings {
            engine: default_engine,
            ..LoadSettings::default()
        }),
    };
    let role = match raw.role.as_deref() {
        None | Some("items") => Some(EndpointRole::Items),
        Some("judge") => Some(EndpointRole::Judge),
        Some(other) => p.push(
            &field("role"),
            format!("must be items or judge, got '{other}'"),
        ),
    };
    Some(EndpointConfig {
        role: role?,
        name: name?,
        model: model?,
        kind: kind?,
        concurrency: concurrency?,
        rpm: rpm?,
        tpm: tpm?,
        timeout: timeout?,
        api_key: api_key?,
        headers: headers?,
        params: params?,
        health: health?,
        load: load?,
    })
}

fn base_url(url: &str, at: &str, p: &mut Problems<'_>) -> Option<String> {
    match reqwest::Url::parse(url) {
        Ok(parsed) if matches!(parsed.scheme(), "http" | "https") && parsed.has_host() => {
            Some(url.trim_end_matches('/').to_owned())
        }
        Ok(_) => p.push(at, format!("must be an http(s) URL, got '{url}'")),
        Err(err) => p.push(at, format!("is not a URL ({err}): '{url}'")),
    }
}

/// Named values treated as secrets (headers, environment variables).
fn secrets(
    raw: Option<BTreeMap<String, String>>,
    at: &str,
    p: &mut Problems<'_>,
    valid_name: impl Fn(&str) -> bool,
) -> Option<Vec<(String, Secret)>> {
    let mut out = Vec::new();
    let mut ok = true;
    for (name, value) in raw.unwrap_or_default() {
        let item = path::key(at, &name);
        if !valid_name(&name) {
            ok = p.push::<()>(&item, "is not a valid name").is_some();
        } else if value == MASK {
            ok = p
                .push::<()>(
                    &item,
                    "was written literally in the config, so it was not stored; write it as ${VAR}, or resume with --config FILE",
                )
                .is_some();
        } else {
            out.push((name, Secret::new(value)));
        }
    }
    ok.then_some(out)
}

fn concurrency(raw: Option<&Value>, at: &str, p: &mut Problems<'_>) -> Option<LimitMode> {
    let adaptive = AimdSettings::default();
    match raw {
        None => Some(LimitMode::Adaptive(adaptive)),
        Some(Value::String(s)) if s == "adaptive" => Some(LimitMode::Adaptive(adaptive)),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(0) => p.push(at, "must be at least 1, got 0"),
            Some(c) if c > MAX_CONCURRENCY => {
                p.push(at, format!("must be at most {MAX_CONCURRENCY}, got {c}"))
            }
            Some(c) => Some(LimitMode::Fixed(c as usize)),
            None => p.push(at, format!("must be a whole number of at least 1, got {n}")),
        },
        Some(value @ Value::Object(_)) => {
            let raw = read::section::<RawAdaptive>(value, at, p.0)?;
            let min = raw.min.unwrap_or(adaptive.min);
            let max = raw.max.unwrap_or(adaptive.max.max(min));
            // Not `clamp`: min and max are not checked yet.
            let initial = raw
                .initial
                .unwrap_or(adaptive.initial.max(min).min(max.max(min)));
            let ratio = raw.decrease_ratio.unwrap_or(adaptive.decrease_ratio);
            let gain = raw.gain.unwrap_or(adaptive.gain);
            let _ignored = raw.rtt_tolerance;
            let before = p.0.len();
            if min == 0 {
                p.push::<()>(&path::key(at, "min"), "must be at least 1, got 0");
            }
            if max < min || max as u64 > MAX_CONCURRENCY {
                p.push::<()>(
                    &path::key(at, "max"),
                    format!("must be between min ({min}) and {MAX_CONCURRENCY}, got {max}"),
                );
            }
            if !(min..=max).contains(&initial) {
                p.push::<()>(
                    &path::key(at, "initial"),
                    format!("must be between min ({min}) and max ({max}), got {initial}"),
                );
            }
            if !(ratio > 0.0 && ratio < 1.0) {
                p.push::<()>(
                    &path::key(at, "decrease_ratio"),
                    format!("must be between 0 and 1, got {ratio}"),
                );
            }
            if !(gain > 0.0 && gain < 1.0) {
                p.push::<()>(
                    &path::key(at, "gain"),
                    format!("must be between 0 and 1 (0.2: a fifth), got {gain}"),
                );
            }
            (p.0.len() == before).then_some(LimitMode::Adaptive(AimdSettings {
                initial,
                min,
                max,
                decrease_ratio: ratio,
                gain,
            }))
        }
        Some(other) => p.push(
            at,
            format!("must be 'adaptive', a whole number, or {{min, max, initial}}, got {other}"),
        ),
    }
}

fn health(raw: RawHealth, at: &str, p: &mut Problems<'_>) -> Option<HealthSettings> {
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
    })
}

/// The least time between two readings of an engine's load.
const LOAD_INTERVAL_FLOOR: Duration = Duration::from_millis(100);

fn load(
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

/// The engine part of `local` and `remote` endpoints.
fn engine(
    raw: &RawEndpoint,
    at: &str,
    p: &mut Problems<'_>,
    default_threshold: u64,
) -> Option<Engine> {
    let field = |name: &str| path::key(at, name);
    let preset = match raw.preset.as_deref() {
        None => Some(None),
        Some(name) => match Preset::parse(name) {
            Some(preset) => Some(Some(preset)),
            None => p.push(
                &field("preset"),
                format!("must be vllm, sglang, llama.cpp or ollama, got '{name}'"),
            ),
        },
    };
    let command = match (&raw.command, preset) {
        (Some(command), _) if command.trim().is_empty() => {
            p.push(&field("command"), "must not be empty")
        }
        (Some(command), _) => {
            let unknown = unknown_placeholders(command);
            if unknown.is_empty() {
                Some(command.clone())
            } else {
                p.push(
                    &field("command"),
                    format!(
                        "has unknown placeholder {} (known: {{model}}, {{port}}, {{args}}, {{gpu}})",
                        unknown.join(", ")
                    ),
                )
            }
        }
        (None, Some(Some(preset))) => Some(preset.command().to_owned()),
        (None, Some(None)) => p.push(
            &field("preset"),
            "is required without a command: vllm, sglang, llama.cpp or ollama (or give command)",
        ),
        (None, None) => None,
    };
    let gpu = match &raw.gpu {
        None => Some(None),
        Some(Value::Number(n)) if n.is_u64() => Some(Some(n.to_string())),
        Some(Value::String(s))
            if !s.is_empty() && s.split(',').all(|g| g.trim().parse::<u32>().is_ok()) =>
        {
            Some(Some(s.replace(' ', "")))
        }
        Some(other) => p.push(
            &field("gpu"),
            format!("must be a GPU index or a list like \"0,1\", got {other}"),
        ),
    };
    let env = secrets(raw.env.clone(), &field("env"), p, |name| {
        !name.is_empty()
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    });
    let preset_timeout = preset
        .flatten()
        .map_or(Duration::from_secs(600), Preset::startup_timeout);
    let startup_timeout = match raw.startup_timeout.as_deref() {
        Some(text) => p.duration(&field("startup_timeout"), Some(text), ""),
        None => Some(preset_timeout),
    };
    let stop_grace = p.duration(&field("stop_grace"), raw.stop_grace.as_deref(), "30s");
    let restart_delay = p.duration(&field("restart_delay"), raw.restart_delay.as_deref(), "30s");
    if raw.port == Some(0) {
        p.push::<()>(
            &field("port"),
            "must be a port number, got 0 (leave it out for a free port)",
        );
    }
    Some(Engine {
        preset: preset?,
        command: command?,
        args: raw.args.clone().unwrap_or_default(),
        port: raw.port.filter(|port| *port > 0),
        gpu: gpu?,
        env: env?,
        startup_timeout: startup_timeout?,
        stop_grace: stop_grace?,
        restarts: raw.restarts.unwrap_or(3),
        restart_delay: restart_delay?,
        gpu_memory_threshold_mb: raw
            .gpu_memory_threshold_mb
            .unwrap_or(default_threshold.max(1024)),
    })
}

/// The concurrency controller's settings (`concurrency: {min, max, initial,
/// decrease_ratio, gain}`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AimdSettings {
    /// The limit to start from.
    pub initial: usize,
    pub min: usize,
    pub max: usize,
    /// The factor a decrease multiplies by (0 < ratio < 1).
    pub decrease_ratio: f64,
    /// The share of a step's proportional gain in throughput that it must
    /// bring for the limit to grow on (0 < gain < 1).
    pub gain: f64,
}

impl Default for AimdSettings {
    fn default() -> Self {
        Self {
            initial: 8,
            min: 1,
            max: 1024,
            decrease_ratio: 0.7,
            gain: 0.2,
        }
    }
}

/// `concurrency:` a fixed number of calls in flight, or adaptive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LimitMode {
    Fixed(usize),
    Adaptive(AimdSettings),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_fill_placeholders_and_unknown_ones_are_found() {
        assert_eq!(
            fill(
                "vllm serve {model} --port {port} {args}",
                "m",
                "8001",
                "",
                None
            ),
            "vllm serve m --port 8001"
        );
        assert_eq!(
            unknown_placeholders("run {modle} --x '{\"a\": 1}' {port}"),
            vec!["{modle}"]
        );
    }
}
