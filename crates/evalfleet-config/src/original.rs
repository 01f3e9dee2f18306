//! Configs written for the original Python system that `kind:
//! conversation` replaces (its `config.local.yaml`: sections `env`,
//! `scorer`, `ollama`, `llm`, `ppo`, `topic_manager`, `wandb`), read as
//! evalfleet configs. A file of that shape (a top-level `env:` and no
//! `task:`) loads directly, converted on the way, and `evalfleet convert`
//! writes the conversion out as YAML with comments saying where each part
//! came from. Every key of the original that has no place here is named
//! with its line and why ([`Note`]), never dropped silently; a key of the
//! wrong type, or an unknown scorer backend, is a problem of the file.
//!
//! The original's environment variables override its file as they do
//! there (`OLLAMA_BASES`, `AZURE_ENDPOINT`, `HUMAN_MODEL`, ...): they are
//! read when the file is converted. The Azure key is never copied: the
//! converted config reads `${AZURE_API_KEY}`.

mod conversation;
mod node;
mod servers;

use std::collections::BTreeSet;

use serde_json::Value;

use self::conversation::OriginalPersona;
use self::node::{Entry, Node, comment_lines, entry, scalar, text};
use self::servers::{Azure, Ollama, Server, Target, azure_v1};
use super::env::Vars;
use super::problems::RawProblem;
use super::{Document, path};

/// The sections of the original's config.
const SECTIONS: [&str; 10] = [
    "env",
    "scorer",
    "ollama",
    "llm",
    "ppo",
    "topic_manager",
    "wandb",
    "personas",
    "openai",
    "azure_planner",
];
/// The Azure deployments of the original's calls, each with the variable
/// that overrides it.
const MODEL_KEYS: [(&str, &str); 6] = [
    ("azure_model", "AZURE_MODEL"),
    ("human_model", "HUMAN_MODEL"),
    ("relation_model", "RELATION_MODEL"),
    ("robot_model", "ROBOT_MODEL"),
    ("topic_model", "TOPIC_MODEL"),
    ("intervention_model", "INTERVENTION_MODEL"),
];
const WANDB: &str = "wandb is not used; the logs are in RUN_ID/ beside the store (conversation_summary.jsonl, batch_summary.jsonl, run_events.jsonl)";
const TRAINING: &str =
    "training setting, not the environment's (a trainer takes decisions through `evalfleet env`)";

/// Whether `value` is a config of the original: a mapping with an `env:`
/// mapping and no `task:`.
pub fn is_original(value: &Value) -> bool {
    value.as_object().is_some_and(|map| {
        map.get("env").is_some_and(Value::is_object) && !map.contains_key("task")
    })
}

/// A key of the original with no place in the converted config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    /// Its path in the original (`ppo.lr`).
    pub key: String,
    /// Its line in the original.
    pub line: Option<usize>,
    /// Why it has no place.
    pub why: String,
}

impl Note {
    /// `FILE:LINE: KEY: not converted: WHY`.
    pub fn render(&self, origin: &str) -> String {
        match self.line {
            Some(line) => format!("{origin}:{line}: {}: not converted: {}", self.key, self.why),
            None => format!("{origin}: {}: not converted: {}", self.key, self.why),
        }
    }
}

/// An original config as an evalfleet config.
#[derive(Debug, Clone)]
pub struct Conversion {
    /// The evalfleet config; the line of each of its paths is the line of
    /// the original key it came from.
    pub document: Document,
    /// The same as YAML, with comments saying where each part came from.
    pub yaml: String,
    /// The original's keys that have no place in it, in the file's order.
    pub notes: Vec<Note>,
}

/// Converts the original config `document` (from the file `origin`, read
/// with `vars`); `name` is the run's name. Its problems are `(path,
/// message)` in the original.
pub fn convert(
    document: &Document,
    origin: &str,
    name: &str,
    vars: &Vars,
) -> Result<Conversion, Vec<RawProblem>> {
    let mut reader = Reader {
        doc: document,
        vars,
        used: BTreeSet::new(),
        notes: Vec::new(),
        problems: Vec::new(),
    };
    let root = reader.build(name, origin);
    reader.unknown_keys(&document.value, "");
    if !reader.problems.is_empty() {
        return Err(reader.problems);
    }
    let mut notes = reader.notes;
    notes.sort_by_key(|n| n.line.unwrap_or(usize::MAX));
    let mut lines = std::collections::HashMap::new();
    root.lines("", document, &mut lines);
    let mut yaml = String::new();
    root.emit(0, &mut yaml);
    if !notes.is_empty() {
        yaml.push_str("\n# Not converted (the original's keys with no place here):\n");
        for note in &notes {
            yaml.push_str(&comment_lines(&note.render(origin), 0));
        }
    }
    Ok(Conversion {
        document: Document {
            value: root.value(),
            lines,
        },
        yaml,
        notes,
    })
}

/// One endpoint of the converted config.
#[derive(Debug)]
struct Endpoint {
    name: String,
    server: Server,
    model: String,
    /// Answers the items (the policy): not `role: judge`.
    items: bool,
    /// What it serves and where its parts came from.
    comment: Vec<String>,
    model_from: Option<String>,
}

struct Reader<'a> {
    doc: &'a Document,
    vars: &'a Vars,
    /// Paths read (each with all below it).
    used: BTreeSet<String>,
    notes: Vec<Note>,
    problems: Vec<RawProblem>,
}

/// What a value of the original is expected to be.
#[derive(Clone, Copy)]
enum Want {
    Whole,
    Number,
    Bool,
    Text,
}

impl Reader<'_> {
    fn lookup(&self, at: &str) -> Option<&Value> {
        let mut value = &self.doc.value;
        for part in at.split('.') {
            value = value.as_object()?.get(part)?;
        }
        (!value.is_null()).then_some(value)
    }

    fn present(&self, at: &str) -> bool {
        self.lookup(at).is_some()
    }

    /// Whether the file has the key `at`, null included (a key set to null
    /// reads as unset, and is named all the same).
    fn in_file(&self, at: &str) -> bool {
        let mut value = &self.doc.value;
        for part in at.split('.') {
            match value.as_object().and_then(|m| m.get(part)) {
                Some(v) => value = v,
                None => return false,
            }
        }
        true
    }

    fn problem(&mut self, at: &str, message: impl std::fmt::Display) {
        self.problems
            .push((at.to_owned(), format!("{at}: {message}")));
    }

    /// The value at `at` as `want` says, marked read; a value of another
    /// type is a problem.
    fn get(&mut self, at: &str, want: Want) -> Option<Value> {
        let value = self.lookup(at)?.clone();
        self.used.insert(at.to_owned());
        let ok = match want {
            Want::Whole => value.as_u64().is_some(),
            Want::Number => value.is_number(),
            Want::Bool => value.is_boolean(),
            Want::Text => value.is_string(),
        };
        if ok {
            return Some(value);
        }
        let expected = match want {
            Want::Whole => "a whole number at least 0",
            Want::Number => "a number",
            Want::Bool => "true or false",
            Want::Text => "a text",
        };
        self.problem(at, format!("must be {expected}, got {value}"));
        None
    }

    fn whole(&mut self, at: &str) -> Option<u64> {
        self.get(at, Want::Whole).and_then(|v| v.as_u64())
    }

    fn number(&mut self, at: &str) -> Option<f64> {
        self.get(at, Want::Number).and_then(|v| v.as_f64())
    }

    fn boolean(&mut self, at: &str) -> Option<bool> {
        self.get(at, Want::Bool).and_then(|v| v.as_bool())
    }

    fn text(&mut self, at: &str) -> Option<String> {
        self.get(at, Want::Text)
            .and_then(|v| v.as_str().map(str::to_owned))
            .filter(|s| !s.trim().is_empty())
    }

    /// A list of texts (a single text is a list of one).
    fn texts(&mut self, at: &str) -> Option<Vec<String>> {
        let value = self.lookup(at)?.clone();
        self.used.insert(at.to_owned());
        match value {
            Value::String(s) => Some(vec![s]),
            Value::Array(items) if items.iter().all(Value::is_string) => Some(
                items
                    .iter()
                    .filter_map(Value::as_str)
                    .filter(|s| !s.trim().is_empty())
                    .map(str::to_owned)
                    .collect(),
            ),
            other => {
                self.problem(at, format!("must be a list of texts, got {other}"));
                None
            }
        }
    }

    /// `at` has no place here, for `why` (when it is in the file).
    fn note(&mut self, at: &str, why: &str) {
        if self.in_file(at) && !self.notes.iter().any(|n| n.key == at) {
            self.used.insert(at.to_owned());
            self.notes.push(Note {
                key: at.to_owned(),
                line: self.doc.line_of(at),
                why: why.to_owned(),
            });
        }
    }

    /// Each key of the section `at` not read yet has no place, for `why`.
    fn note_rest(&mut self, at: &str, why: &str) {
        let keys: Vec<String> = match self.lookup(at).and_then(Value::as_object) {
            Some(map) => map.keys().map(|k| path::key(at, k)).collect(),
            None => {
                self.note(at, why);
                return;
            }
        };
        for key in keys {
            if !self.touched(&key) {
                self.note(&key, why);
            }
        }
        self.used.insert(at.to_owned());
    }

    /// Whether `at` or anything below it was read.
    fn touched(&self, at: &str) -> bool {
        self.used.contains(at)
            || self.used.iter().any(|u| {
                u.strip_prefix(at)
                    .is_some_and(|rest| rest.starts_with('.') || rest.starts_with('['))
            })
    }

    /// An environment variable that overrides the file, when set.
    fn var(&self, name: &str) -> Option<String> {
        self.vars.get(name).filter(|v| !v.trim().is_empty())
    }

    /// The keys nobody read: each named, as a key the original does not
    /// have (as far as this conversion knows).
    fn unknown_keys(&mut self, value: &Value, at: &str) {
        let Some(map) = value.as_object() else {
            return;
        };
        for (key, child) in map {
            let here = path::key(at, key);
            if self.used.contains(&here) {
                continue;
            }
            if self.touched(&here) {
                self.unknown_keys(child, &here);
                continue;
            }
            let why = if at.is_empty() {
                format!(
                    "not a section of the original's config ({})",
                    SECTIONS.join(", ")
                )
            } else {
                "not a key of the original's config that this conversion knows".to_owned()
            };
            self.note(&here, &why);
        }
    }

    fn build(&mut self, name: &str, origin: &str) -> Node {
        let mut conversation: Vec<Entry> = Vec::new();
        let mut header = vec![
            format!("Converted by `evalfleet convert` from {origin}, a config of the original"),
            "Python system; docs/conversation.md (\"Configs from the original system\")".to_owned(),
            "says how each key maps.".to_owned(),
        ];

        // The episode: the original's rules, step for step.
        conversation.push(entry("rules", scalar("original")).said(
            "The original's rules, step for step (docs/conversation.md, \"rules: original\")",
        ));
        if let Some(n) = self.whole("env.max_steps") {
            conversation.push(
                entry("max_steps", scalar(n))
                    .from("env.max_steps")
                    .said("env.max_steps"),
            );
        }
        self.note(
            "env.max_rounds",
            "unused by the original (its environment ends at env.max_steps only), and so by rules: original",
        );
        match self.boolean("env.include_robot") {
            Some(false) => {
                self.note(
                    "env.include_robot",
                    "a conversation without the robot has no equivalent: the robot always takes part here (for a baseline, policy: {kind: fixed, strategy: 4})",
                );
            }
            Some(true) => header
                .push("env.include_robot: true: the robot takes part (always, here).".to_owned()),
            None => {}
        }

        let mut personas = self.personas();
        if personas.is_empty() && !self.present("env.personas") && !self.present("personas") {
            // The original's three, so that each has its voice's endpoint.
            personas = ["A", "B", "C"]
                .into_iter()
                .map(|name| OriginalPersona {
                    name: name.to_owned(),
                    landmines: Vec::new(),
                    from: "env.personas".to_owned(),
                    section: "env.personas (not set: A, B and C)".to_owned(),
                })
                .collect();
        }
        let ollama = self.ollama();
        let azure = self.azure();
        if ollama.personas.is_empty() && azure.endpoint.is_none() {
            self.problems.push((
                String::new(),
                "the config names no model server: give llm.azure_endpoint (or AZURE_ENDPOINT) or ollama.bases / ollama.base_url (or OLLAMA_BASES / OLLAMA_BASE)".to_owned(),
            ));
        }
        let mut endpoints: Vec<Endpoint> = Vec::new();

        // The policy: the model under evaluation answers the items.
        let policy_target = match &azure.endpoint {
            Some(url) => Some(azure.target(url, "intervention_model", "INTERVENTION_MODEL")),
            None => ollama.base.clone().map(|base| ollama.target(base, true)),
        };
        if let Some(target) = policy_target {
            endpoints.push(Endpoint {
                name: "policy".to_owned(),
                server: target.server,
                model: target.model,
                items: true,
                comment: vec![
                    "The policy: the model under evaluation answers the episodes (items);"
                        .to_owned(),
                    format!("its model {}.", target.how),
                ],
                model_from: target.model_from,
            });
        }

        // Each call's endpoint, shared by calls to the same server and model.
        let judge = |endpoints: &mut Vec<Endpoint>, target: Target, what: &str| -> String {
            if let Some(e) = endpoints
                .iter_mut()
                .find(|e| !e.items && e.server == target.server && e.model == target.model)
            {
                e.comment.push(format!("{what}; its model {}.", target.how));
                return e.name.clone();
            }
            let base = match &target.server {
                Server::Ollama(url) => {
                    let host = reqwest::Url::parse(url)
                        .ok()
                        .and_then(|u| u.host_str().map(str::to_owned))
                        .unwrap_or_default();
                    format!("ollama-{}", sanitize(&host, "server"))
                }
                Server::Azure(_) => format!("azure-{}", sanitize(&target.model, "model")),
            };
            let mut name = base.clone();
            let mut n = 2;
            while endpoints.iter().any(|e| e.name == name) {
                name = format!("{base}-{n}");
                n += 1;
            }
            endpoints.push(Endpoint {
                name: name.clone(),
                server: target.server,
                model: target.model,
                items: false,
                comment: vec![format!("{what}; its model {}.", target.how)],
                model_from: target.model_from,
            });
            name
        };

        // The personas.
        let mut persona_entries = Vec::new();
        for (i, persona) in personas.iter().enumerate() {
            let target = if ollama.personas.is_empty() {
                azure
                    .endpoint
                    .as_ref()
                    .map(|url| azure.target(url, "human_model", "HUMAN_MODEL"))
            } else {
                let (base, from) = &ollama.personas[i % ollama.personas.len()];
                let mut target = ollama.target(base.clone(), false);
                target.how = format!("{} (server {from})", target.how);
                Some(target)
            };
            let mut fields = vec![entry("name", text(&persona.name)).from(&persona.from)];
            if !persona.landmines.is_empty() {
                fields.push(
                    entry(
                        "landmines",
                        Node::Seq(persona.landmines.iter().map(|w| text(w)).collect()),
                    )
                    .from(&format!("{}.triggers", persona.from)),
                );
            }
            if let Some(target) = target {
                let name = judge(
                    &mut endpoints,
                    target,
                    &format!("The voice of {}", persona.name),
                );
                fields.push(entry("endpoint", text(&name)));
            }
            persona_entries.push(Node::Map(fields));
        }
        if !persona_entries.is_empty() {
            let from = personas
                .first()
                .map(|p| p.section.clone())
                .unwrap_or_default();
            conversation.push(
                entry("personas", Node::Seq(persona_entries))
                    .from(&from)
                    .said(format!("{from}: names; triggers are landmines")),
            );
        }

        // The windows.
        conversation.push(self.history());

        // The scorer.
        let scorer = self.scorer(&ollama, &azure, &mut |endpoints_target, what| {
            judge(&mut endpoints, endpoints_target, what)
        });
        conversation.push(scorer);

        // The topic generator and the robot.
        let topic_target = match &azure.endpoint {
            Some(url) => Some(azure.target(url, "topic_model", "TOPIC_MODEL")),
            None => ollama.base.clone().map(|base| ollama.target(base, false)),
        };
        let mut topic = Vec::new();
        if let Some(target) = topic_target {
            topic.push(entry(
                "endpoint",
                text(&judge(&mut endpoints, target, "The topic generator")),
            ));
        }
        if let Some(messages) = self.topic_messages() {
            topic.push(messages);
        }
        if self.boolean("topic_manager.enable") == Some(false) {
            self.note(
                "topic_manager.enable",
                "without a topic generator, give the topics yourself (task.conversation.topics: [...]); without them each episode's topic is asked of the topic call",
            );
        }
        self.note_rest(
            "topic_manager",
            "not a key of the original's topic_manager that this conversation knows",
        );
        conversation.push(entry("topic", Node::Map(topic)).said("topic_manager"));
        let robot_target = match &azure.endpoint {
            Some(url) => Some(azure.target(url, "robot_model", "ROBOT_MODEL")),
            None => ollama.base.clone().map(|base| ollama.target(base, false)),
        };
        if let Some(target) = robot_target {
            let name = judge(&mut endpoints, target, "The robot's utterances");
            conversation.push(entry(
                "robot",
                Node::Map(vec![entry("endpoint", text(&name))]),
            ));
        }

        // Rewards.
        conversation.push(self.rewards());
        // The original's trainer writes a batch summary per effective batch
        // of decisions: per_device_train_batch_size x grad_accum_steps x 2
        // (each 1 when not set).
        let per_device = self.whole("ppo.per_device_train_batch_size");
        let accumulation = self.whole("ppo.grad_accum_steps");
        let n = per_device.unwrap_or(1).max(1) * accumulation.unwrap_or(1).max(1) * 2;
        let mut batch = entry("batch_size", scalar(n)).said(
            "decisions per record of batch_summary.jsonl: ppo.per_device_train_batch_size x ppo.grad_accum_steps x 2, the original's effective batch",
        );
        if per_device.is_some() {
            batch = batch.from("ppo.per_device_train_batch_size");
        } else if accumulation.is_some() {
            batch = batch.from("ppo.grad_accum_steps");
        }
        conversation.push(batch);
        self.note(
            "ppo.batch_size",
            "not read by the original's trainer (its batch is per_device_train_batch_size x grad_accum_steps x 2, the converted batch_size)",
        );

        if endpoints
            .iter()
            .any(|e| matches!(e.server, Server::Ollama(_)))
            && ollama.model.is_none()
            && ollama.model_rl.is_none()
        {
            self.problem(
                "ollama",
                "ollama.model is required: calls go to Ollama, and it names no model",
            );
        }
        // What has no place here.
        self.leftovers(&ollama, &azure);

        let mut root = vec![entry("name", text(name)).said(header.join("\n"))];
        let mut list = Vec::new();
        for e in &endpoints {
            let mut fields = vec![
                entry("name", text(&e.name)),
                entry("kind", scalar("external")),
            ];
            match &e.server {
                Server::Ollama(base) => {
                    fields.push(entry("base_url", text(&format!("{base}/v1"))));
                    if !ollama.params.is_empty() {
                        fields.push(
                            entry("params", Node::Map(ollama.params.clone()))
                                .said("ollama.gen_options"),
                        );
                    }
                }
                Server::Azure(url) => {
                    fields.push(entry("base_url", text(&azure_v1(url))));
                    fields.push(entry("api_key", scalar("${AZURE_API_KEY}")).said(
                        "From the environment or the .env beside this file, never written here.",
                    ));
                    if !azure.params.is_empty() {
                        fields.push(
                            entry("params", Node::Map(azure.params.clone()))
                                .said("llm.reasoning_effort"),
                        );
                    }
                }
            }
            let mut model = entry("model", text(&e.model));
            if let Some(from) = &e.model_from {
                model = model.from(from);
            }
            fields.push(model);
            if !e.items {
                fields.push(entry("role", scalar("judge")));
            }
            let mut fields = Node::Map(fields);
            if let Node::Map(entries) = &mut fields
                && let Some(first) = entries.first_mut()
            {
                first.comment = Some(e.comment.join("\n"));
            }
            list.push(fields);
        }
        root.push(entry("endpoints", Node::Seq(list)));
        let mut task = vec![entry("kind", scalar("conversation"))];
        task.push(entry("conversation", Node::Map(conversation)));
        root.push(entry("task", Node::Map(task)));
        if !azure.retry.is_empty() {
            root.push(
                entry("retry", Node::Map(azure.retry.clone()))
                    .said("llm.max_attempts, llm.base_backoff"),
            );
        }
        Node::Map(root)
    }

    /// The keys with no place here, each with why.
    fn leftovers(&mut self, ollama: &Ollama, azure: &Azure) {
        for key in ["time_penalty", "terminal_bonus", "intervention_cost"] {
            self.note(
                &format!("env.{key}"),
                &format!(
                    "obsolete reward ({key}): the reward is stable_bonus + preference_match_bonus"
                ),
            );
        }
        self.note(
            "env.reward_backend",
            "obsolete reward (reward_backend): no model takes part in the reward, which is counted from the relations",
        );
        self.note(
            "ollama.reward_base",
            "obsolete reward (reward_base): no model takes part in the reward",
        );
        self.note(
            "env.min_robot_intervention_lookback",
            "not used: a decision is taken whenever the relations are unbalanced and no step is under way",
        );
        self.note(
            "env.debug",
            "evalfleet's logging is set with -v or EVALFLEET_LOG; every call is stored with its run",
        );
        self.note(
            "ollama.gen_options.num_ctx",
            "Ollama's OpenAI-compatible API takes no num_ctx: set the context length on the server (OLLAMA_CONTEXT_LENGTH) or in a Modelfile",
        );
        let ollama_used = ollama.used.borrow().clone();
        for key in ["model", "model_rl"] {
            let at = format!("ollama.{key}");
            if !ollama_used.contains(at.as_str()) && self.present(&at) {
                let why = match (key, &ollama.model_rl) {
                    ("model_rl", Some(model)) => format!(
                        "the policy being trained: here the policy is on Azure (llm.intervention_model); to evaluate {model}, point the `policy` endpoint at its Ollama server (model: {model})"
                    ),
                    _ => "no call of this config goes to Ollama".to_owned(),
                };
                self.note(&at, &why);
            }
        }
        if ollama_used.is_empty() {
            for key in ["temperature", "top_p"] {
                let at = format!("ollama.gen_options.{key}");
                self.note(&at, "no call of this config goes to Ollama");
            }
        }
        let azure_used = azure.used.borrow().clone();
        for (key, _) in MODEL_KEYS {
            let at = format!("llm.{key}");
            if azure.endpoint.is_some() && !azure_used.contains(key) && self.present(&at) {
                self.note(
                    &at,
                    if key == "azure_model" {
                        "every call has a deployment of its own"
                    } else {
                        "no call of this config goes to this deployment (the call is answered by Ollama, or scored by rules)"
                    },
                );
            }
        }
        self.note(
            "llm.azure_api_key",
            "a key written in the file is not copied: the converted config reads ${AZURE_API_KEY} (from the environment or the .env beside the config)",
        );
        self.note(
            "llm.azure_api_version",
            "the OpenAI v1 API of Azure (ENDPOINT/openai/v1) that evalfleet calls takes no api-version",
        );
        for key in ["azure_embedding_deployment", "azure_embedding_api_version"] {
            self.note(
                &format!("llm.{key}"),
                "embeddings: no call of the simulation uses them",
            );
        }
        if azure.endpoint.is_none() {
            self.note_rest(
                "llm",
                "no call goes to Azure OpenAI (no llm.azure_endpoint nor AZURE_ENDPOINT)",
            );
        }
        let servers = ollama.servers.borrow().clone();
        if servers.is_empty() {
            self.note("ollama.bases", "no call of this config goes to Ollama");
        }
        for (key, var) in [
            ("base_url", "OLLAMA_BASE"),
            ("scorer_base", "OLLAMA_SCORER_BASE"),
        ] {
            let at = format!("ollama.{key}");
            if let Some(url) = self.lookup(&at).and_then(Value::as_str)
                && !servers.contains(url.trim().trim_end_matches('/'))
            {
                self.note(
                    &at,
                    &format!("not used: no call of this config goes to this server ({var} in the environment comes before it)"),
                );
            }
        }
        self.note_rest("ppo", TRAINING);
        self.note_rest("wandb", WANDB);
        self.note_rest(
            "openai",
            "legacy section: the original reads Azure OpenAI from llm",
        );
        self.note_rest(
            "azure_planner",
            "legacy section: the conversation has no planner",
        );
    }
}

/// The run's name for a config read from `file`: its name without the
/// extension, made a name.
pub(super) fn run_name(file: &std::path::Path) -> String {
    let stem = file
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    sanitize(&stem, "conversation")
}

/// `text` made a name of letters, digits, `-`, `_` and `.` (the others
/// become `-`), or `or` when none of them is left.
fn sanitize(text: &str, or: &str) -> String {
    let name: String = text
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '-'
            }
        })
        .collect();
    if name.trim_matches(['-', '.']).is_empty() {
        or.to_owned()
    } else {
        name
    }
}

#[cfg(test)]
mod tests;
