//! `endpoints[]`: what each endpoint is, how it is reached, started, limited
//! and watched. The raw structs' doc comments are the user documentation of
//! these keys (`docs/config.md`).

mod concurrency;
mod engine;
mod health;
mod load;

use std::collections::BTreeMap;
use std::time::Duration;

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Map, Value};

pub use self::concurrency::{AimdSettings, LimitMode};
use self::concurrency::{Concurrency, concurrency};
use self::engine::engine;
pub use self::engine::{Engine, Preset, Remote};
pub use self::health::HealthSettings;
use self::health::{RawHealth, health};
pub use self::load::{LoadEngine, LoadSettings};
use self::load::{RawLoad, load};
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
    /// The process of the engine serving an `external` endpoint that
    /// evalfleet started outside the run (a bench's loaded model): its
    /// process tree is sampled (`telemetry:`) as a local engine's is. Not
    /// a key of the config.
    pub engine_pid: Option<u32>,
    /// Whether the endpoint's error answers are told by their status and
    /// reason phrase only, never their body: set for the runs `evalfleet
    /// serve` answers, whose config came from whoever could reach it (an
    /// endpoint at an internal address would otherwise have its replies
    /// read back through the items' errors). Not a key of the config.
    pub quiet_errors: bool,
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
        engine_pid: None,
        quiet_errors: false,
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
