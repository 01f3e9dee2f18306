//! The conversation's parts that come from the original's `env`, `scorer`,
//! `topic_manager` and `ppo`: the personas, the windows, the scorer, the
//! topic generator's prompt and the rewards.

use serde_json::Value;

use super::Reader;
use super::node::{Entry, Node, entry, scalar, text};
use super::servers::{Azure, Ollama, Target};
use crate::path;

/// The original's persona window (`env.max_history_human`) by default.
const PERSONA_WINDOW: u64 = 12;
/// The original's scorer window (`env.max_history_relation`) by default.
const SCORER_WINDOW: u64 = 3;

pub(super) struct OriginalPersona {
    pub(super) name: String,
    pub(super) landmines: Vec<String>,
    /// Its path in the original.
    pub(super) from: String,
    /// `env.personas` or `personas`.
    pub(super) section: String,
}

impl Reader<'_> {
    /// `env.personas` (or the legacy top-level `personas`): a list of names
    /// or a mapping of names to `{triggers: [...]}`.
    pub(super) fn personas(&mut self) -> Vec<OriginalPersona> {
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

    /// `history`: the original's windows.
    pub(super) fn history(&mut self) -> Entry {
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
    pub(super) fn scorer(
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

    /// `topic.messages` from `topic_manager.generation_prompt`: the system
    /// message, its `{trigger_examples}` the trigger drawn for the topic
    /// (one of the personas' landmines not used yet, as the original
    /// draws it); the user message lists the topics proposed so far, as the
    /// original does.
    pub(super) fn topic_messages(&mut self) -> Option<Entry> {
        let prompt = self.text("topic_manager.generation_prompt")?;
        let placeholder = "{trigger_examples}";
        let mut template = String::new();
        for (i, part) in prompt.split(placeholder).enumerate() {
            if i > 0 {
                template.push_str("{{ trigger if trigger else \"様々なテーマ\" }}");
            }
            template.push_str(&literal(part));
        }
        Some(
            entry(
                "messages",
                Node::Seq(vec![
                    Node::Map(vec![
                        entry("role", scalar("system")),
                        entry("content", text(&template)).from("topic_manager.generation_prompt"),
                    ]),
                    Node::Map(vec![
                        entry("role", scalar("user")),
                        entry("content", text(crate::conversation::TOPIC_USED_JA)),
                    ]),
                ]),
            )
            .said("topic_manager.generation_prompt ({trigger_examples}: the trigger drawn for the topic)"),
        )
    }

    /// `rewards` from `env` and `ppo`.
    pub(super) fn rewards(&mut self) -> Entry {
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
        if let Some(on) = self.boolean("ppo.filter_zero_rewards") {
            fields.push(
                entry("filter_zero_rewards", scalar(on))
                    .from("ppo.filter_zero_rewards")
                    .said("ppo.filter_zero_rewards"),
            );
        }
        entry("rewards", Node::Map(fields))
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
