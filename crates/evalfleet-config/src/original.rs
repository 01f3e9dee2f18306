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

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Map, Value};

use super::env::Vars;
use super::problems::RawProblem;
use super::{Document, path};

/// The original's Azure deployment when none is named (its README's
/// default for `AZURE_MODEL`).
const AZURE_DEFAULT_MODEL: &str = "gpt-5-chat";
/// The original's persona window (`env.max_history_human`) by default.
const PERSONA_WINDOW: u64 = 12;
/// The original's scorer window (`env.max_history_relation`) by default.
const SCORER_WINDOW: u64 = 3;
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

/// A value of the converted config, with where it came from.
#[derive(Debug, Clone)]
enum Node {
    Scalar(Value),
    Map(Vec<Entry>),
    Seq(Vec<Node>),
}

#[derive(Debug, Clone)]
struct Entry {
    key: String,
    node: Node,
    /// The original's path it came from (for its line).
    from: Option<String>,
    /// Said above it in the YAML.
    comment: Option<String>,
}

fn entry(key: &str, node: Node) -> Entry {
    Entry {
        key: key.to_owned(),
        node,
        from: None,
        comment: None,
    }
}

impl Entry {
    fn from(mut self, path: &str) -> Self {
        self.from = Some(path.to_owned());
        self
    }

    fn said(mut self, comment: impl Into<String>) -> Self {
        self.comment = Some(comment.into());
        self
    }
}

fn scalar(value: impl Into<Value>) -> Node {
    Node::Scalar(value.into())
}

/// A string copied from the original: a `${` in it stays literal.
fn text(value: &str) -> Node {
    Node::Scalar(Value::String(value.replace("${", "$${")))
}

impl Node {
    fn value(&self) -> Value {
        match self {
            Self::Scalar(v) => v.clone(),
            Self::Map(entries) => Value::Object(
                entries
                    .iter()
                    .map(|e| (e.key.clone(), e.node.value()))
                    .collect::<Map<_, _>>(),
            ),
            Self::Seq(items) => Value::Array(items.iter().map(Node::value).collect()),
        }
    }

    fn lines(&self, at: &str, doc: &Document, out: &mut std::collections::HashMap<String, usize>) {
        match self {
            Self::Scalar(_) => {}
            Self::Map(entries) => {
                for e in entries {
                    let here = path::key(at, &e.key);
                    if let Some(line) = e.from.as_deref().and_then(|from| doc.line_of(from)) {
                        out.insert(here.clone(), line);
                    }
                    e.node.lines(&here, doc, out);
                }
            }
            Self::Seq(items) => {
                for (i, item) in items.iter().enumerate() {
                    item.lines(&path::index(at, i), doc, out);
                }
            }
        }
    }

    /// Block YAML at `indent` (a mapping's entries, or a sequence's
    /// items), each entry's comment above it.
    fn emit(&self, indent: usize, out: &mut String) {
        let pad = " ".repeat(indent);
        match self {
            Self::Scalar(v) => {
                out.push_str(&pad);
                out.push_str(&yaml_scalar(v, indent));
                out.push('\n');
            }
            Self::Map(entries) => {
                for e in entries {
                    if let Some(comment) = &e.comment {
                        out.push_str(&comment_lines(comment, indent));
                    }
                    out.push_str(&pad);
                    out.push_str(&yaml_key(&e.key));
                    out.push(':');
                    match &e.node {
                        Self::Scalar(v) => {
                            out.push(' ');
                            out.push_str(&yaml_scalar(v, indent + 2));
                            out.push('\n');
                        }
                        Self::Map(m) if m.is_empty() => out.push_str(" {}\n"),
                        Self::Seq(items) if items.iter().all(|i| matches!(i, Self::Scalar(_))) => {
                            // A list of words on one line (JSON is YAML).
                            out.push(' ');
                            out.push_str(&e.node.value().to_string());
                            out.push('\n');
                        }
                        node => {
                            out.push('\n');
                            node.emit(indent + 2, out);
                        }
                    }
                }
            }
            Self::Seq(items) => {
                for item in items {
                    let mut block = String::new();
                    item.emit(indent + 2, &mut block);
                    // The first line that is not a comment carries the dash.
                    let mut dashed = false;
                    for line in block.lines() {
                        if !dashed && line.trim_start().starts_with('#') {
                            out.push_str(&pad);
                            out.push_str(line.trim_start());
                        } else if !dashed {
                            out.push_str(&pad);
                            out.push_str("- ");
                            out.push_str(line.get(indent + 2..).unwrap_or(line.trim_start()));
                            dashed = true;
                        } else {
                            out.push_str(line);
                        }
                        out.push('\n');
                    }
                }
            }
        }
    }
}

fn comment_lines(comment: &str, indent: usize) -> String {
    let pad = " ".repeat(indent);
    comment
        .lines()
        .map(|line| format!("{pad}# {line}\n"))
        .collect()
}

fn yaml_key(key: &str) -> String {
    let plain = key
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if plain {
        key.to_owned()
    } else {
        Value::String(key.to_owned()).to_string()
    }
}

/// A scalar as YAML: a text of several lines as a literal block, any other
/// as JSON (which YAML reads as it is).
fn yaml_scalar(value: &Value, indent: usize) -> String {
    if let Value::String(s) = value {
        let block = s.contains('\n')
            && !s.contains('\r')
            && !s.starts_with([' ', '\t', '\n'])
            && !s.ends_with("\n\n")
            && s.lines().all(|l| !l.ends_with([' ', '\t']));
        if block {
            let pad = " ".repeat(indent);
            let mut out = String::from(if s.ends_with('\n') { "|" } else { "|-" });
            for line in s.lines() {
                out.push('\n');
                if !line.is_empty() {
                    out.push_str(&pad);
                    out.push_str(line);
                }
            }
            return out;
        }
        if plain(s) {
            return s.clone();
        }
    }
    value.to_string()
}

/// Whether YAML reads `s` unquoted as this very text: words, names,
/// URLs, model names (`qwen3:8b`), Japanese; nothing that could be read
/// as a number, a boolean or null, or that holds YAML's signs.
fn plain(s: &str) -> bool {
    let Some(first) = s.chars().next() else {
        return false;
    };
    let reserved = [
        "true", "false", "null", "yes", "no", "on", "off", "y", "n", "~",
    ];
    first.is_alphabetic()
        && !reserved.contains(&s.to_ascii_lowercase().as_str())
        && !s.ends_with(':')
        && !s.contains(": ")
        && s.chars()
            .all(|c| c.is_alphanumeric() || matches!(c, '_' | '-' | '.' | '/' | ':' | '@'))
}

/// A server the converted config's endpoints call.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Server {
    /// An Ollama server's base (`http://host:11434`).
    Ollama(String),
    /// An Azure OpenAI resource's endpoint.
    Azure(String),
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

/// What a call is answered by.
struct Target {
    server: Server,
    model: String,
    model_from: Option<String>,
    /// What the comment says of where the model came from.
    how: String,
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
        if self.lookup(at).is_some() && !self.notes.iter().any(|n| n.key == at) {
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

        // The episode.
        for key in ["max_steps", "max_rounds"] {
            let at = format!("env.{key}");
            if let Some(n) = self.whole(&at) {
                conversation.push(entry(key, scalar(n)).from(&at).said(format!("env.{key}")));
            }
        }
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
        if let Some(messages) = self.topic_messages(&personas) {
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
        if let Some(n) = self.whole("ppo.batch_size") {
            conversation.push(
                entry("batch_size", scalar(n))
                    .from("ppo.batch_size")
                    .said("ppo.batch_size: episodes per line of batch_summary.jsonl"),
            );
        }

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

    /// `env.personas` (or the legacy top-level `personas`): a list of names
    /// or a mapping of names to `{triggers: [...]}`.
    fn personas(&mut self) -> Vec<OriginalPersona> {
        let section = if self.present("env.personas") {
            if self.present("personas") {
                self.note(
                    "personas",
                    "legacy top-level personas: env.personas is read instead",
                );
            }
            "env.personas"
        } else if self.present("personas") {
            "personas"
        } else {
            return Vec::new();
        };
        let Some(value) = self.lookup(section).cloned() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        match value {
            Value::Array(items) => {
                self.used.insert(section.to_owned());
                for (i, item) in items.iter().enumerate() {
                    match item.as_str() {
                        Some(name) => out.push(OriginalPersona {
                            name: name.to_owned(),
                            landmines: Vec::new(),
                            from: path::index(section, i),
                            section: section.to_owned(),
                        }),
                        None => self.problem(
                            &path::index(section, i),
                            format!("must be a persona's name, got {item}"),
                        ),
                    }
                }
            }
            Value::Object(map) => {
                // In the file's order (a mapping read is sorted by key).
                let mut entries: Vec<(&String, &Value)> = map.iter().collect();
                entries.sort_by_key(|(name, _)| {
                    self.doc.lines.get(&path::key(section, name)).copied()
                });
                for (name, spec) in entries {
                    let at = path::key(section, name);
                    let landmines = match spec {
                        Value::Null => {
                            self.used.insert(at.clone());
                            Vec::new()
                        }
                        Value::Object(fields) => {
                            if fields.is_empty() {
                                self.used.insert(at.clone());
                            }
                            // Other keys of a persona are named as unknown.
                            self.texts(&path::key(&at, "triggers")).unwrap_or_default()
                        }
                        other => {
                            self.used.insert(at.clone());
                            self.problem(
                                &at,
                                format!(
                                    "must be a mapping such as {{triggers: [...]}}, got {other}"
                                ),
                            );
                            Vec::new()
                        }
                    };
                    out.push(OriginalPersona {
                        name: name.clone(),
                        landmines,
                        from: at,
                        section: section.to_owned(),
                    });
                }
            }
            other => {
                self.used.insert(section.to_owned());
                self.problem(
                    section,
                    format!("must be a list of names or a mapping of names to {{triggers: [...]}}, got {other}"),
                );
            }
        }
        if !out.is_empty() && out.len() != 3 {
            self.problem(
                section,
                format!(
                    "must name three personas (A, B and C, in that order), got {}",
                    out.len()
                ),
            );
        }
        out
    }

    /// The Ollama servers: the personas' (one per GPU), the scorer's, the
    /// others'; environment variables over the file.
    fn ollama(&mut self) -> Ollama {
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
    fn azure(&mut self) -> Azure {
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

    /// `history`: the original's windows.
    fn history(&mut self) -> Entry {
        let fallback = self.whole("env.max_history");
        let mut fields = Vec::new();
        let mut said = Vec::new();
        for (key, at, default) in [
            ("persona", "env.max_history_human", PERSONA_WINDOW),
            ("scorer", "env.max_history_relation", SCORER_WINDOW),
        ] {
            match self.whole(at) {
                Some(n) => {
                    fields.push(entry(key, scalar(n)).from(at));
                    said.push(format!("{key}: {at}"));
                }
                None => {
                    fields.push(entry(key, scalar(default)));
                    said.push(format!("{key}: {at} (the original's default, {default})"));
                }
            }
        }
        let mut fallback_used = false;
        for (key, at) in [
            ("policy", "env.intervention_max_history"),
            ("robot", "env.robot_max_history"),
        ] {
            match (self.whole(at), fallback) {
                (Some(n), _) => {
                    fields.push(entry(key, scalar(n)).from(at));
                    said.push(format!("{key}: {at}"));
                }
                (None, Some(n)) => {
                    fallback_used = true;
                    fields.push(entry(key, scalar(n)).from("env.max_history"));
                    said.push(format!(
                        "{key}: env.max_history (deprecated; {at} is not set)"
                    ));
                }
                (None, None) => {
                    said.push(format!("{key}: evalfleet's default, 6 ({at} is not set)"))
                }
            }
        }
        if fallback.is_some() && !fallback_used {
            self.note(
                "env.max_history",
                "deprecated fallback, and both env.intervention_max_history and env.robot_max_history are set",
            );
        }
        entry("history", Node::Map(fields)).said(format!(
            "Windows, in human utterances:\n{}",
            said.join("\n")
        ))
    }

    /// `scorer`: `backend` rule, ollama, azure or openai.
    fn scorer(
        &mut self,
        ollama: &Ollama,
        azure: &Azure,
        judge: &mut dyn FnMut(Target, &str) -> String,
    ) -> Entry {
        let mut fields = Vec::new();
        let backend = self.text("scorer.backend");
        let mut comment = "scorer.backend".to_owned();
        match backend.as_deref() {
            Some("rule") => {
                fields.push(entry("kind", scalar("rules")).from("scorer.backend"));
                comment = "scorer.backend rule: words and landmines counted, no call".to_owned();
            }
            Some("ollama") => {
                fields.push(entry("kind", scalar("llm")).from("scorer.backend"));
                match &ollama.scorer_base {
                    Some((base, from)) => {
                        let mut target = ollama.target(base.clone(), false);
                        target.how = format!("{} (server {from})", target.how);
                        let name = judge(target, "The relation scorer");
                        fields.push(entry("endpoint", text(&name)));
                    }
                    None => self.problem(
                        "scorer.backend",
                        "is ollama, but the config names no Ollama server (ollama.scorer_base, ollama.base_url, ollama.bases, OLLAMA_SCORER_BASE or OLLAMA_BASE)",
                    ),
                }
            }
            None | Some("azure" | "openai") => {
                fields.push(entry("kind", scalar("llm")).from("scorer.backend"));
                if backend.is_none() {
                    comment = "scorer.backend is not set: azure, the original's".to_owned();
                }
                match &azure.endpoint {
                    Some(url) => {
                        let name = judge(
                            azure.target(url, "relation_model", "RELATION_MODEL"),
                            "The relation scorer",
                        );
                        fields.push(entry("endpoint", text(&name)));
                    }
                    None => self.problem(
                        "scorer.backend",
                        format!(
                            "is {}, but the config names no Azure OpenAI endpoint (llm.azure_endpoint or AZURE_ENDPOINT)",
                            backend.as_deref().unwrap_or("azure (by default)")
                        ),
                    ),
                }
            }
            Some(other) => self.problem(
                "scorer.backend",
                format!("must be rule, ollama, azure or openai, got '{other}'"),
            ),
        }
        if backend.as_deref() != Some("ollama") {
            self.note(
                "ollama.scorer_base",
                "not used: the scorer is not on Ollama (scorer.backend)",
            );
        }
        if let Some(on) = self.boolean("scorer.use_ema") {
            fields.push(entry("use_ema", scalar(on)).from("scorer.use_ema"));
        }
        let decay = self.number("scorer.decay_factor");
        if let Some(decay) = decay
            && decay <= 0.0
        {
            self.problem(
                "scorer.decay_factor",
                format!("must be above 0, got {decay}"),
            );
        }
        if decay.is_some() || self.present("scorer.use_ema") {
            let from = if decay.is_some() {
                "scorer.decay_factor"
            } else {
                "scorer.use_ema"
            };
            fields.push(entry("ema_formula", scalar("adaptive")).from(from).said(
                "The original's smoothing: alpha = clamp(decay_factor x s / (s + past), 0.01, 1)",
            ));
        }
        if let Some(decay) = decay {
            fields.push(entry("decay_factor", scalar(decay)).from("scorer.decay_factor"));
        }
        if let Some(n) = self.whole("env.start_relation_check_after_utterances") {
            fields.push(
                entry("start_relation_check_after_utterances", scalar(n))
                    .from("env.start_relation_check_after_utterances")
                    .said("env.start_relation_check_after_utterances"),
            );
        }
        entry("scorer", Node::Map(fields)).said(comment)
    }

    /// `topic.messages` from `topic_manager.generation_prompt`: its
    /// `{trigger_examples}` lists the personas' landmines.
    fn topic_messages(&mut self, personas: &[OriginalPersona]) -> Option<Entry> {
        let prompt = self.text("topic_manager.generation_prompt")?;
        let placeholder = "{trigger_examples}";
        let mut template = String::new();
        if prompt.contains(placeholder) {
            let words: Vec<Value> = personas
                .iter()
                .flat_map(|p| p.landmines.iter().map(|w| Value::String(w.clone())))
                .collect();
            template.push_str(&format!(
                "{{% set trigger_examples = {} %}}",
                Value::Array(words)
            ));
        }
        let japanese = prompt
            .chars()
            .any(|c| ('\u{3040}'..='\u{9FFF}').contains(&c));
        let parts: Vec<&str> = prompt.split(placeholder).collect();
        for (i, part) in parts.iter().enumerate() {
            if i > 0 {
                template.push_str(if japanese {
                    "{{ trigger_examples | join('、') }}"
                } else {
                    "{{ trigger_examples | join(', ') }}"
                });
            }
            template.push_str(&literal(part));
        }
        // The original tells the generator the topics used so far too.
        template.push_str(if japanese {
            "{% if used_topics %}\n（既に使った話題: {{ used_topics | join('、') }}）{% endif %}"
        } else {
            "{% if used_topics %}\n(Topics used already: {{ used_topics | join('; ') }}){% endif %}"
        });
        Some(
            entry(
                "messages",
                Node::Seq(vec![Node::Map(vec![
                    entry("role", scalar("user")),
                    entry("content", text(&template)).from("topic_manager.generation_prompt"),
                ])]),
            )
            .said("topic_manager.generation_prompt ({trigger_examples}: the personas' landmines)"),
        )
    }

    /// `rewards` from `env` and `ppo`.
    fn rewards(&mut self) -> Entry {
        let mut fields = Vec::new();
        for (key, at, whole) in [
            ("stable_bonus", "env.stable_bonus", false),
            (
                "preference_match_bonus",
                "env.preference_match_bonus",
                false,
            ),
            ("evaluation_horizon", "env.evaluation_horizon", true),
            (
                "terminal_bonus_duration",
                "env.terminal_bonus_duration",
                true,
            ),
            ("invalid_penalty", "env.output_error_penalty", false),
            ("max_auto_skip", "env.max_auto_skip", true),
        ] {
            let value = if whole {
                self.whole(at).map(Value::from)
            } else {
                self.number(at).map(Value::from)
            };
            if let Some(v) = value {
                fields.push(entry(key, Node::Scalar(v)).from(at).said(at));
            }
        }
        // The original's rules, evalfleet's defaults too: written so that
        // the run keeps them whatever the defaults become.
        fields.push(
            entry("target_edge", scalar("closest_to_zero"))
                .said("The original's rules: the target is the negative edge closest to 0,"),
        );
        fields.push(
            entry("end_step_when_lost", scalar(true))
                .said("a step ends at the check that loses the stable bonus,"),
        );
        fields.push(
            entry("topic_restarts", scalar(1u64))
                .said("and an opening that stays stable starts again once on a new topic."),
        );
        if let Some(on) = self.boolean("ppo.filter_zero_rewards") {
            fields.push(
                entry("filter_zero_rewards", scalar(on))
                    .from("ppo.filter_zero_rewards")
                    .said("ppo.filter_zero_rewards"),
            );
        }
        entry("rewards", Node::Map(fields))
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

struct OriginalPersona {
    name: String,
    landmines: Vec<String>,
    /// Its path in the original.
    from: String,
    /// `env.personas` or `personas`.
    section: String,
}

struct Ollama {
    /// The personas' servers (persona i: the i-th modulo their number),
    /// each with where it came from.
    personas: Vec<(String, String)>,
    /// The server of the other calls.
    base: Option<String>,
    scorer_base: Option<(String, &'static str)>,
    model: Option<String>,
    model_rl: Option<String>,
    /// `gen_options` sent with each call.
    params: Vec<Entry>,
    /// The model keys a call was given.
    used: std::cell::RefCell<BTreeSet<&'static str>>,
    /// The servers a call was given.
    servers: std::cell::RefCell<BTreeSet<String>>,
}

impl Ollama {
    fn target(&self, base: String, policy: bool) -> Target {
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

struct Azure {
    endpoint: Option<String>,
    /// Deployments by key (`human_model`), each with what the comment says
    /// of it and its path in the file.
    models: BTreeMap<&'static str, (String, String, Option<String>)>,
    params: Vec<Entry>,
    retry: Vec<Entry>,
    /// The model keys a call was given.
    used: std::cell::RefCell<BTreeSet<String>>,
}

impl Azure {
    /// The deployment for `key` (its variable `var`), else `azure_model`,
    /// else the original's default.
    fn target(&self, url: &str, key: &str, var: &str) -> Target {
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
fn azure_v1(url: &str) -> String {
    let url = url.trim_end_matches('/');
    if url.ends_with("/openai/v1") {
        url.to_owned()
    } else if url.ends_with("/openai") {
        format!("{url}/v1")
    } else {
        format!("{url}/openai/v1")
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

/// `text` as literal template text (minijinja): as it is, unless it holds
/// what minijinja would read as a tag.
fn literal(text: &str) -> String {
    if text.contains("{{") || text.contains("{%") || text.contains("{#") {
        format!("{{% raw %}}{text}{{% endraw %}}")
    } else {
        text.to_owned()
    }
}

#[cfg(test)]
mod tests;
