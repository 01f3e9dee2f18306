//! The model servers of the original: its Ollama servers (`ollama`) and
//! its Azure OpenAI resource (`llm`), environment variables over the file,
//! and which server and model answers each call.

use std::collections::{BTreeMap, BTreeSet};

use super::node::{Entry, entry, scalar, text};
use super::{MODEL_KEYS, Reader};

/// The original's Azure deployment when none is named (its README's
/// default for `AZURE_MODEL`).
const AZURE_DEFAULT_MODEL: &str = "gpt-5-chat";

/// A server the converted config's endpoints call.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Server {
    /// An Ollama server's base (`http://host:11434`).
    Ollama(String),
    /// An Azure OpenAI resource's endpoint.
    Azure(String),
}

/// What a call is answered by.
pub(super) struct Target {
    pub(super) server: Server,
    pub(super) model: String,
    pub(super) model_from: Option<String>,
    /// What the comment says of where the model came from.
    pub(super) how: String,
}

impl Reader<'_> {
    /// The Ollama servers: the personas' (one per GPU), the scorer's, the
    /// others'; environment variables over the file.
    pub(super) fn ollama(&mut self) -> Ollama {
        let split = |s: &str| -> Vec<String> {
            s.split([',', ' '])
                .map(|b| b.trim().trim_end_matches('/').to_owned())
                .filter(|b| !b.is_empty())
                .collect()
        };
        let file_bases = self.texts("ollama.bases").unwrap_or_default();
        let file_base = self.text("ollama.base_url");
        let env_bases = self.var("OLLAMA_BASES").map(|s| split(&s));
        let env_base = self
            .var("OLLAMA_BASE")
            .map(|s| s.trim().trim_end_matches('/').to_owned());
        let personas: Vec<(String, String)> =
            if let Some(bases) = env_bases.filter(|b| !b.is_empty()) {
                bases
                    .into_iter()
                    .map(|b| (b, "OLLAMA_BASES".to_owned()))
                    .collect()
            } else if let Some(base) = &env_base {
                vec![(base.clone(), "OLLAMA_BASE".to_owned())]
            } else if !file_bases.is_empty() {
                file_bases
                    .iter()
                    .enumerate()
                    .map(|(i, b)| {
                        (
                            b.trim_end_matches('/').to_owned(),
                            format!("ollama.bases[{i}]"),
                        )
                    })
                    .collect()
            } else if let Some(base) = &file_base {
                vec![(
                    base.trim_end_matches('/').to_owned(),
                    "ollama.base_url".to_owned(),
                )]
            } else {
                Vec::new()
            };
        let base = env_base
            .or_else(|| file_base.map(|b| b.trim_end_matches('/').to_owned()))
            .or_else(|| personas.first().map(|(b, _)| b.clone()));
        let scorer_base = self
            .var("OLLAMA_SCORER_BASE")
            .map(|b| {
                (
                    b.trim().trim_end_matches('/').to_owned(),
                    "OLLAMA_SCORER_BASE",
                )
            })
            .or_else(|| {
                self.text("ollama.scorer_base")
                    .map(|b| (b.trim_end_matches('/').to_owned(), "ollama.scorer_base"))
            })
            .or_else(|| base.clone().map(|b| (b, "the Ollama base")));
        let model = self.text("ollama.model");
        let model_rl = self.text("ollama.model_rl");
        let mut params = Vec::new();
        for key in ["temperature", "top_p"] {
            let at = format!("ollama.gen_options.{key}");
            if let Some(v) = self.number(&at) {
                params.push(entry(key, scalar(v)).from(&at));
            }
        }
        Ollama {
            personas,
            base,
            scorer_base,
            model,
            model_rl,
            params,
            used: Default::default(),
            servers: Default::default(),
        }
    }

    /// The Azure OpenAI resource: environment variables over `llm`.
    pub(super) fn azure(&mut self) -> Azure {
        if let Some(provider) = self.text("llm.provider")
            && provider != "azure"
        {
            self.problem(
                "llm.provider",
                format!("must be azure (Azure OpenAI), got '{provider}'"),
            );
        }
        let endpoint = match self.var("AZURE_ENDPOINT") {
            Some(url) => Some(url.trim().trim_end_matches('/').to_owned()),
            None => self
                .text("llm.azure_endpoint")
                .map(|u| u.trim_end_matches('/').to_owned()),
        };
        if let Some(url) = &endpoint
            && !(url.starts_with("https://") || url.starts_with("http://"))
        {
            self.problem(
                "llm.azure_endpoint",
                format!("must be an http(s) URL, got '{url}'"),
            );
        }
        let mut models = BTreeMap::new();
        let keys = if endpoint.is_some() {
            MODEL_KEYS.as_slice()
        } else {
            &[]
        };
        for &(key, var) in keys {
            let at = format!("llm.{key}");
            let file = self.text(&at);
            if let Some(model) = self.var(var) {
                models.insert(key, (model, format!("from {var} (environment)"), None));
            } else if let Some(model) = file {
                models.insert(key, (model, format!("from {at}"), Some(at)));
            }
        }
        let mut params = Vec::new();
        let effort = match endpoint {
            Some(_) => self.text("llm.reasoning_effort"),
            None => None,
        };
        let enabled = self.boolean("llm.enable_reasoning_param").unwrap_or(false);
        if let Some(effort) = effort {
            if enabled {
                params.push(entry("reasoning_effort", text(&effort)).from("llm.reasoning_effort"));
            } else {
                self.note(
                    "llm.reasoning_effort",
                    "not sent: llm.enable_reasoning_param is not true",
                );
            }
        }
        let mut retry = Vec::new();
        if let Some(n) = self.whole("llm.max_attempts") {
            retry.push(entry("max_attempts", scalar(n)).from("llm.max_attempts"));
        }
        if let Some(seconds) = self.number("llm.base_backoff") {
            if seconds >= 0.0 {
                let ms = (seconds * 1000.0).round() as u64;
                retry.push(
                    entry("backoff_base", scalar(format!("{ms}ms"))).from("llm.base_backoff"),
                );
            } else {
                self.problem(
                    "llm.base_backoff",
                    format!("must be at least 0 seconds, got {seconds}"),
                );
            }
        }
        Azure {
            endpoint,
            models,
            params,
            retry,
            used: Default::default(),
        }
    }
}

pub(super) struct Ollama {
    /// The personas' servers (persona i: the i-th modulo their number),
    /// each with where it came from.
    pub(super) personas: Vec<(String, String)>,
    /// The server of the other calls.
    pub(super) base: Option<String>,
    pub(super) scorer_base: Option<(String, &'static str)>,
    pub(super) model: Option<String>,
    pub(super) model_rl: Option<String>,
    /// `gen_options` sent with each call.
    pub(super) params: Vec<Entry>,
    /// The model keys a call was given.
    pub(super) used: std::cell::RefCell<BTreeSet<&'static str>>,
    /// The servers a call was given.
    pub(super) servers: std::cell::RefCell<BTreeSet<String>>,
}

impl Ollama {
    pub(super) fn target(&self, base: String, policy: bool) -> Target {
        let (model, from) = match (&self.model_rl, &self.model) {
            (Some(rl), _) if policy => (rl.clone(), "ollama.model_rl"),
            (_, Some(model)) => (model.clone(), "ollama.model"),
            (Some(rl), None) => (rl.clone(), "ollama.model_rl"),
            // A problem of the file (`ollama.model` is required).
            (None, None) => (String::new(), "ollama.model"),
        };
        self.used.borrow_mut().insert(from);
        self.servers.borrow_mut().insert(base.clone());
        Target {
            server: Server::Ollama(base),
            model,
            how: format!("from {from}"),
            model_from: Some(from.to_owned()),
        }
    }
}

pub(super) struct Azure {
    pub(super) endpoint: Option<String>,
    /// Deployments by key (`human_model`), each with what the comment says
    /// of it and its path in the file.
    models: BTreeMap<&'static str, (String, String, Option<String>)>,
    pub(super) params: Vec<Entry>,
    pub(super) retry: Vec<Entry>,
    /// The model keys a call was given.
    pub(super) used: std::cell::RefCell<BTreeSet<String>>,
}

impl Azure {
    /// The deployment for `key` (its variable `var`), else `azure_model`,
    /// else the original's default.
    pub(super) fn target(&self, url: &str, key: &str, var: &str) -> Target {
        let found = match self.models.get(key) {
            Some(found) => Some((key, found)),
            None => self
                .models
                .get("azure_model")
                .map(|found| ("azure_model", found)),
        };
        let (model, how, from) = match found {
            Some((used, (model, how, from))) => {
                self.used.borrow_mut().insert(used.to_owned());
                (model.clone(), how.clone(), from.clone())
            }
            None => (
                AZURE_DEFAULT_MODEL.to_owned(),
                format!(
                    "is the original's default (llm.{key}, {var} and llm.azure_model are not set)"
                ),
                None,
            ),
        };
        Target {
            server: Server::Azure(url.to_owned()),
            model,
            how,
            model_from: from,
        }
    }
}

/// Azure OpenAI's v1 API under a resource's endpoint.
pub(super) fn azure_v1(url: &str) -> String {
    let url = url.trim_end_matches('/');
    if url.ends_with("/openai/v1") {
        url.to_owned()
    } else if url.ends_with("/openai") {
        format!("{url}/v1")
    } else {
        format!("{url}/openai/v1")
    }
}
