//! The engines evalfleet starts, on this machine (`kind: local`) or on
//! another host over SSH (`kind: remote`): their launch presets, and their
//! commands with the placeholders filled in.

use std::time::Duration;

use serde_json::Value;

use super::concurrency::MAX_CONCURRENCY;
use super::load::LoadEngine;
use super::{RawEndpoint, secrets};
use crate::problems::Problems;
use crate::{Secret, path};

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

/// The engine part of `local` and `remote` endpoints.
pub(super) fn engine(
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
