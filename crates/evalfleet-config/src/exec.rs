//! `kind: exec`: the user's own program (an agent) runs once per item, in
//! the sandbox, and calls models through the run's gateway at an address
//! that names the item (`docs/tasks.md`, "Agents").

use std::path::{Path, PathBuf};
use std::time::Duration;

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::Value;

use super::problems::Problems;
use super::read;

/// How an item reaches the program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExecInput {
    /// The item as one JSON object on its standard input.
    Stdin,
    /// The item in `item.json` in its folder, whose path is its last
    /// argument (and `$EVALFLEET_ITEM_FILE`).
    File,
    /// The item as JSON text, its last argument.
    Args,
}

/// What an agent may reach (`task.network`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentNetwork {
    /// The gateway and nothing else.
    Gateway,
    /// This machine's network.
    Open,
}

/// How the agent's program runs (`task.mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentMode {
    /// Once per item (an attempt), the item on its input.
    PerItem,
    /// `processes` programs each serve many items over evalfleet's agent
    /// protocol (JSON lines), started once.
    Server { processes: usize },
}

/// What an item's agent may use through the gateway, per attempt; past any
/// of them its calls are answered 429 (`budget_exhausted`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Budget {
    pub calls: Option<u32>,
    pub tokens: Option<u64>,
    pub time: Option<Duration>,
}

/// `kind: exec`'s settings (`task.command`, `task.input`, ...).
#[derive(Debug, Clone, PartialEq)]
pub struct ExecSettings {
    /// The program and its arguments. An argument that names a file of the
    /// config's folder (`agent.py`) is given as that file's path.
    pub command: Vec<String>,
    pub input: ExecInput,
    /// `task.mode` (and `task.servers`).
    pub mode: AgentMode,
    /// `task.input.fields`: the item's fields the program gets. `None`:
    /// every field but those the task's references read.
    pub fields: Option<Vec<String>>,
    /// How long one run of the program may take before it (with every
    /// process it started) is killed: a failed attempt.
    pub timeout: Duration,
    /// Programs running at once.
    pub concurrency: usize,
    /// `task.memory_mb`: what one run may use, all its processes together
    /// where the sandbox has memory cgroups.
    pub memory_mb: u64,
    /// `task.disk_mb`: what one run may write in its folder, all its files
    /// together, where the sandbox has a mount namespace.
    pub disk_mb: u64,
    pub network: AgentNetwork,
    /// More environment variables for the program.
    pub env: Vec<(String, String)>,
    pub budget: Budget,
    /// Model names the agent may ask for, each mapped to an endpoint's
    /// name or model; `*` maps every other name. Empty: every name goes to
    /// the endpoints that answer items.
    pub models: Vec<(String, String)>,
    /// The config's folder: where relative paths of `command` are read.
    pub dir: PathBuf,
}

impl ExecSettings {
    /// Environment variables that belong to evalfleet, which `env` may not
    /// set.
    pub const OWN_ENV: [&'static str; 5] = [
        "OPENAI_BASE_URL",
        "OPENAI_API_KEY",
        "EVALFLEET_ITEM_ID",
        "EVALFLEET_ITEM_FILE",
        "EVALFLEET_ATTEMPT",
    ];
}

/// `task.budget`: what one attempt of an item's agent may use.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawBudget {
    /// Calls through the gateway. Default: no limit.
    pub calls: Option<u32>,
    /// Prompt and completion tokens, counted as calls end. Default: no
    /// limit.
    pub tokens: Option<u64>,
    /// Time from the agent's start after which its calls are refused.
    /// Default: no limit (the `timeout` ends it).
    #[schemars(with = "Option<super::schema::Duration>")]
    pub time: Option<String>,
}

/// The keys of `task` that belong to `kind: exec`, read by [`exec`].
#[derive(Debug, Default)]
pub struct RawExec {
    pub command: Option<Value>,
    pub input: Option<Value>,
    pub timeout: Option<String>,
    pub concurrency: Option<u32>,
    pub memory_mb: Option<u64>,
    pub disk_mb: Option<u64>,
    pub mode: Option<String>,
    pub servers: Option<u32>,
    pub network: Option<String>,
    pub env: Option<serde_json::Map<String, Value>>,
    pub budget: Option<Value>,
    pub models: Option<serde_json::Map<String, Value>>,
}

impl RawExec {
    /// The keys given, as `task.KEY` (to refuse them for other kinds).
    pub fn given(&self) -> Vec<&'static str> {
        let mut given = Vec::new();
        for (key, set) in [
            ("command", self.command.is_some()),
            ("input", self.input.is_some()),
            ("timeout", self.timeout.is_some()),
            ("concurrency", self.concurrency.is_some()),
            ("memory_mb", self.memory_mb.is_some()),
            ("disk_mb", self.disk_mb.is_some()),
            ("mode", self.mode.is_some()),
            ("servers", self.servers.is_some()),
            ("network", self.network.is_some()),
            ("env", self.env.is_some()),
            ("budget", self.budget.is_some()),
            ("models", self.models.is_some()),
        ] {
            if set {
                given.push(key);
            }
        }
        given
    }
}

/// Checks `kind: exec`'s keys.
pub(super) fn exec(raw: RawExec, dir: &Path, p: &mut Problems<'_>) -> Option<ExecSettings> {
    let command = match raw.command {
        None => p.push(
            "task.command",
            "is required with kind: exec (the program to run per item)",
        ),
        Some(Value::String(text)) => match split_words(&text) {
            Ok(words) if !words.is_empty() => Some(words),
            Ok(_) => p.push("task.command", "is empty"),
            Err(err) => p.push("task.command", err),
        },
        Some(Value::Array(list)) => {
            let words: Option<Vec<String>> =
                list.iter().map(|v| v.as_str().map(str::to_owned)).collect();
            match words {
                Some(words) if !words.is_empty() => Some(words),
                Some(_) => p.push("task.command", "is empty"),
                None => p.push("task.command", "must be a list of strings"),
            }
        }
        Some(other) => p.push(
            "task.command",
            format!("must be a command line or a list of strings, got {other}"),
        ),
    };
    let how = |text: Option<&str>, at: &str, p: &mut Problems<'_>| match text {
        None | Some("stdin") => Some(ExecInput::Stdin),
        Some("file") => Some(ExecInput::File),
        Some("args") => Some(ExecInput::Args),
        Some(other) => p.push(at, format!("must be stdin, file or args, got '{other}'")),
    };
    let (input, fields) = match &raw.input {
        None => (Some(ExecInput::Stdin), Some(None)),
        Some(Value::String(text)) => (how(Some(text), "task.input", p), Some(None)),
        Some(Value::Object(map)) => {
            let mut fields = Some(None);
            for key in map.keys() {
                if key != "via" && key != "fields" {
                    fields = p.push(
                        &format!("task.input.{key}"),
                        "is not a key of task.input (via, fields)",
                    );
                }
            }
            let via = match map.get("via") {
                None => how(None, "task.input.via", p),
                Some(Value::String(text)) => how(Some(text), "task.input.via", p),
                Some(other) => p.push(
                    "task.input.via",
                    format!("must be stdin, file or args, got {other}"),
                ),
            };
            if fields.is_some() {
                fields = match map.get("fields") {
                    None => Some(None),
                    Some(Value::Array(list)) => {
                        let names: Option<Vec<String>> =
                            list.iter().map(|v| v.as_str().map(str::to_owned)).collect();
                        match names {
                            Some(names) => Some(Some(names)),
                            None => p.push("task.input.fields", "must be a list of field names"),
                        }
                    }
                    Some(other) => p.push(
                        "task.input.fields",
                        format!("must be a list of field names, got {other}"),
                    ),
                };
            }
            (via, fields)
        }
        Some(other) => (
            p.push(
                "task.input",
                format!("must be stdin, file or args, or {{via, fields}}, got {other}"),
            ),
            Some(None),
        ),
    };
    let timeout = p.duration("task.timeout", raw.timeout.as_deref(), "10m");
    let concurrency = match raw.concurrency {
        None => Some(16),
        Some(n) if (1..=4096).contains(&n) => Some(n as usize),
        Some(n) => p.push(
            "task.concurrency",
            format!("must be between 1 and 4096, got {n}"),
        ),
    };
    let memory_mb = match raw.memory_mb {
        None => Some(16 * 1024),
        Some(n) if n >= 64 => Some(n),
        Some(n) => p.push(
            "task.memory_mb",
            format!("must be at least 64 (MiB), got {n}"),
        ),
    };
    let disk_mb = match raw.disk_mb {
        None => Some(2048),
        Some(n) if (1..=1 << 20).contains(&n) => Some(n),
        Some(n) => p.push(
            "task.disk_mb",
            format!("must be between 1 and 1048576 (MiB), got {n}"),
        ),
    };
    let servers = match raw.servers {
        None => Some(1),
        Some(n) if (1..=256).contains(&n) => Some(n as usize),
        Some(n) => p.push(
            "task.servers",
            format!("must be between 1 and 256, got {n}"),
        ),
    };
    let mode = match (raw.mode.as_deref(), servers) {
        (None | Some("item"), _) => {
            if raw.servers.is_some() {
                p.push::<()>("task.servers", "is for task.mode: server");
            }
            Some(AgentMode::PerItem)
        }
        (Some("server"), Some(processes)) => {
            if matches!(input, Some(ExecInput::File | ExecInput::Args)) {
                p.push::<()>(
                    "task.input",
                    "a server (task.mode: server) gets its items in the agent protocol's lines: only task.input.fields applies",
                );
            }
            Some(AgentMode::Server { processes })
        }
        (Some("server"), None) => None,
        (Some(other), _) => p.push(
            "task.mode",
            format!("must be item or server, got '{other}'"),
        ),
    };
    let network = match raw.network.as_deref() {
        None | Some("gateway") => Some(AgentNetwork::Gateway),
        Some("open") => Some(AgentNetwork::Open),
        Some(other) => p.push(
            "task.network",
            format!("must be gateway or open, got '{other}'"),
        ),
    };
    let mut env = Vec::new();
    let mut env_ok = true;
    for (key, value) in raw.env.unwrap_or_default() {
        let at = format!("task.env.{key}");
        if ExecSettings::OWN_ENV.contains(&key.as_str()) {
            env_ok = p.push::<()>(&at, "is set by evalfleet").is_some();
            continue;
        }
        if key.is_empty() || key.contains('=') || key.contains('\0') {
            env_ok = p.push::<()>(&at, "is not a variable name").is_some();
            continue;
        }
        match value {
            Value::String(text) => env.push((key, text)),
            Value::Number(n) => env.push((key, n.to_string())),
            Value::Bool(b) => env.push((key, b.to_string())),
            other => {
                env_ok = p
                    .push::<()>(&at, format!("must be a string, got {other}"))
                    .is_some();
            }
        }
    }
    let budget = match &raw.budget {
        None => Some(Budget::default()),
        Some(value) => {
            let raw_budget = read::section::<RawBudget>(value, "task.budget", p.0)?;
            let time = match raw_budget.time.as_deref() {
                None => Some(None),
                Some(text) => p.duration("task.budget.time", Some(text), "1s").map(Some),
            };
            time.map(|time| Budget {
                calls: raw_budget.calls,
                tokens: raw_budget.tokens,
                time,
            })
        }
    };
    let mut models = Vec::new();
    let mut models_ok = true;
    for (name, value) in raw.models.unwrap_or_default() {
        match value {
            Value::String(to) if !to.is_empty() => models.push((name, to)),
            other => {
                models_ok = p
                    .push::<()>(
                        &format!("task.models.{name}"),
                        format!("must name an endpoint or its model, got {other}"),
                    )
                    .is_some();
            }
        }
    }
    if !env_ok || !models_ok {
        return None;
    }
    Some(ExecSettings {
        command: command?,
        input: input?,
        mode: mode?,
        fields: fields?,
        timeout: timeout?,
        concurrency: concurrency?,
        memory_mb: memory_mb?,
        disk_mb: disk_mb?,
        network: network?,
        env,
        budget: budget?,
        models,
        dir: dir.to_path_buf(),
    })
}

/// Splits a command line into words as a shell would for plain words,
/// single and double quotes and backslashes; nothing is expanded.
pub fn split_words(text: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut started = false;
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                started = true;
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(c) => word.push(c),
                        None => return Err("has an unclosed single quote".to_owned()),
                    }
                }
            }
            '"' => {
                started = true;
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(c @ ('"' | '\\' | '$' | '`')) => word.push(c),
                            Some(c) => {
                                word.push('\\');
                                word.push(c);
                            }
                            None => return Err("has an unclosed double quote".to_owned()),
                        },
                        Some(c) => word.push(c),
                        None => return Err("has an unclosed double quote".to_owned()),
                    }
                }
            }
            '\\' => {
                started = true;
                match chars.next() {
                    Some(c) => word.push(c),
                    None => return Err("ends with a backslash".to_owned()),
                }
            }
            c if c.is_whitespace() => {
                if started {
                    words.push(std::mem::take(&mut word));
                    started = false;
                }
            }
            c => {
                started = true;
                word.push(c);
            }
        }
    }
    if started {
        words.push(word);
    }
    Ok(words)
}

#[cfg(test)]
mod tests {
    use super::split_words;

    #[test]
    fn command_lines_split_as_a_shell_splits_plain_words() {
        assert_eq!(
            split_words(r#"python3 agent.py --name "a b" 'c d' e\ f"#).unwrap(),
            ["python3", "agent.py", "--name", "a b", "c d", "e f"]
        );
        assert_eq!(split_words("  ").unwrap(), Vec::<String>::new());
        assert!(split_words("python3 'x").is_err());
        assert_eq!(split_words(r#""""#).unwrap(), [""]);
    }
}
