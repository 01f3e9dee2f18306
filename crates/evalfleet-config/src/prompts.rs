//! `task.prompts`: ordered rules that choose an item's messages by its
//! fields and by the model that answers it; the first rule that matches
//! wins, and `task.messages` is the default.
//!
//! An item's messages are rendered before an endpoint is chosen (whichever
//! endpoint that answers items is free takes it), so a rule's `model`
//! condition is decided once per run, against the models of the run's
//! endpoints that answer items: it must match all of them or none. A
//! condition that would split them is refused at load, naming the
//! endpoints on each side (one model per run: `evalfleet bench` makes a
//! run per model).

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Map, Value};

use super::problems::Problems;
use super::read;
use super::request::{RawMessage, message_list};
use super::{EndpointConfig, MessageTemplate, path};

/// A rule of `task.prompts`: the messages for the items (and the model)
/// that its conditions accept. A rule with no condition matches every
/// item; rules after it are refused (they could never be chosen).
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct RawPrompt {
    /// The rule's name, recorded with each result it made (the `prompt`
    /// column of exports) and grouped by in reports (`--by @prompt`).
    /// Names are distinct, and `default` is `task.messages`' own. Default:
    /// from the conditions, like `doc_type=invoice|receipt model=qwen2-vl*`
    /// (`always` for a rule with none).
    pub name: Option<String>,
    /// Item fields and the values each accepts (a value, or a list of
    /// them): `{doc_type: invoice}`, `{doc_type: [invoice, receipt], lang:
    /// en}`. Every field must accept the item's value; values compare as
    /// text, so `2024` matches the CSV value `"2024"`. An item without the
    /// field (or with `null`) is accepted only by a list holding `null`.
    /// A field no row of the dataset has is refused before the run starts.
    /// Default: none (every item).
    #[schemars(with = "Option<Map<String, Value>>")]
    pub when: Option<Value>,
    /// A glob (`*` any text, `?` one character) over the model of the
    /// run's endpoints that answer items: `qwen2-vl*`. It must match all of
    /// them or none, since an item's messages are made before an endpoint
    /// takes it. Default: none (any model).
    pub model: Option<String>,
    /// The messages sent for the items this rule accepts, written as
    /// `task.messages` is. Required.
    pub messages: Option<Vec<RawMessage>>,
}

/// A validated rule of `task.prompts`.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptRule {
    /// Its name, given or made from its conditions.
    pub name: String,
    /// Each field with the values it accepts (`Value::Null`: the item
    /// lacks the field, or holds `null`).
    pub when: Vec<(String, Vec<Value>)>,
    /// The `model` glob as written, when the rule has one.
    pub model: Option<String>,
    /// Whether the run's endpoints' model passes the `model` condition
    /// (true without one): decided at load, for all of them at once.
    pub model_matches: bool,
    pub messages: Vec<MessageTemplate>,
}

impl PromptRule {
    /// Whether the rule holds no condition at all: it takes every item.
    pub fn is_catch_all(&self) -> bool {
        self.when.is_empty() && self.model.is_none()
    }

    /// Whether the rule takes an item whose fields are `row`.
    pub fn accepts(&self, row: &Map<String, Value>) -> bool {
        self.model_matches
            && self.when.iter().all(|(field, accepted)| {
                let value = row.get(field).unwrap_or(&Value::Null);
                accepted.iter().any(|a| same_value(a, value))
            })
    }
}

/// The name of `task.messages` among the prompts.
pub const DEFAULT_PROMPT: &str = "default";

/// Two values alike as a condition sees them: both null, or the same text
/// (a string's own, or a number's or boolean's JSON).
fn same_value(accepted: &Value, value: &Value) -> bool {
    match (accepted, value) {
        (Value::Null, Value::Null) => true,
        (Value::Null, _) | (_, Value::Null) => false,
        _ => as_text(accepted) == as_text(value),
    }
}

fn as_text(value: &Value) -> std::borrow::Cow<'_, str> {
    match value {
        Value::String(s) => s.as_str().into(),
        other => other.to_string().into(),
    }
}

/// Whether `text` matches `glob`: `*` is any run of characters, `?` one.
pub fn glob_matches(glob: &str, text: &str) -> bool {
    let (glob, text): (Vec<char>, Vec<char>) = (glob.chars().collect(), text.chars().collect());
    // Greedy match with one backtrack point, the last `*` seen.
    let (mut g, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        match glob.get(g) {
            Some('*') => {
                star = Some((g, t));
                g += 1;
            }
            Some(&c) if c == '?' || c == text[t] => {
                g += 1;
                t += 1;
            }
            _ => match star {
                Some((sg, st)) => {
                    g = sg + 1;
                    t = st + 1;
                    star = Some((sg, st + 1));
                }
                None => return false,
            },
        }
    }
    glob[g..].iter().all(|&c| c == '*')
}

/// `task.prompts`, validated against the run's `endpoints` (their models
/// decide the `model` conditions); `has_default`: whether `task.messages`
/// is given.
pub(super) fn prompts(
    raw: Vec<Value>,
    endpoints: Option<&[EndpointConfig]>,
    has_default: bool,
    p: &mut Problems<'_>,
) -> Option<Vec<PromptRule>> {
    let mut out: Vec<PromptRule> = Vec::with_capacity(raw.len());
    let mut ok = true;
    for (i, value) in raw.iter().enumerate() {
        let at = path::index("task.prompts", i);
        match read::section::<RawPrompt>(value, &at, p.0).and_then(|r| rule(r, &at, p)) {
            Some(mut rule) => {
                if let Some(model) = &rule.model {
                    // Without valid endpoints the config is refused anyway.
                    match endpoints.map(|e| model_condition(model, e, &at, p)) {
                        Some(Some(matches)) => rule.model_matches = matches,
                        Some(None) => ok = false,
                        None => rule.model_matches = false,
                    }
                }
                out.push(rule);
            }
            None => ok = false,
        }
    }
    if !ok {
        return None;
    }
    let mut problems = false;
    for (i, rule) in out.iter().enumerate() {
        let at = path::index("task.prompts", i);
        if let Some(first) = out[..i].iter().position(|r| r.name == rule.name) {
            problems = true;
            p.push::<()>(
                &path::key(&at, "name"),
                format!(
                    "'{}' is also the name of task.prompts[{first}]; names must be distinct (give each a name)",
                    rule.name
                ),
            );
        } else if rule.name == DEFAULT_PROMPT {
            problems = true;
            p.push::<()>(
                &path::key(&at, "name"),
                "'default' is the name of task.messages; give the rule another",
            );
        }
        if let Some(all) = out[..i].iter().position(PromptRule::is_catch_all) {
            problems = true;
            p.push::<()>(
                &at,
                format!(
                    "can never be chosen: task.prompts[{all}] before it has no condition and takes every item"
                ),
            );
        }
    }
    if !has_default && !out.iter().any(PromptRule::is_catch_all) {
        problems = true;
        p.push::<()>(
            "task.messages",
            "is required unless a rule of task.prompts has no condition (the messages of items no rule takes)",
        );
    }
    (!problems).then_some(out)
}

/// One rule, without its `model` condition decided.
fn rule(raw: RawPrompt, at: &str, p: &mut Problems<'_>) -> Option<PromptRule> {
    let messages = match raw.messages {
        Some(list) => message_list(list, &path::key(at, "messages"), p),
        None => p.push(&path::key(at, "messages"), "is required"),
    };
    let when = match raw.when {
        None => Some(Vec::new()),
        Some(Value::Object(fields)) => conditions(fields, &path::key(at, "when"), p),
        Some(_) => p.push(
            &path::key(at, "when"),
            "must be a mapping of item fields to the values they accept",
        ),
    };
    let model = match raw.model {
        Some(glob) if glob.trim().is_empty() => {
            p.push(&path::key(at, "model"), "must not be empty")
        }
        other => Some(other),
    };
    let name = match raw.name {
        Some(name) if name.trim().is_empty() => p.push(&path::key(at, "name"), "must not be empty"),
        other => Some(other),
    };
    let (when, model, name) = (when?, model?, name?);
    let name = name.unwrap_or_else(|| derived_name(&when, model.as_deref()));
    Some(PromptRule {
        name,
        when,
        model,
        model_matches: true,
        messages: messages?,
    })
}

fn conditions(
    fields: Map<String, Value>,
    at: &str,
    p: &mut Problems<'_>,
) -> Option<Vec<(String, Vec<Value>)>> {
    let mut out = Vec::with_capacity(fields.len());
    let mut ok = true;
    for (field, accepted) in fields {
        let here = path::key(at, &field);
        let values = match accepted {
            Value::Array(values) if values.is_empty() => {
                p.push::<()>(&here, "must accept at least one value");
                None
            }
            Value::Array(values) => Some(values),
            one => Some(vec![one]),
        };
        match values {
            Some(values) if values.iter().all(|v| !v.is_object() && !v.is_array()) => {
                out.push((field, values));
            }
            Some(_) => {
                ok = false;
                p.push::<()>(
                    &here,
                    "accepts a value (text, number, boolean or null) or a list of them",
                );
            }
            None => ok = false,
        }
    }
    ok.then_some(out)
}

/// A rule's name from its conditions: `doc_type=invoice|receipt
/// model=qwen2-vl*`, or `always`.
fn derived_name(when: &[(String, Vec<Value>)], model: Option<&str>) -> String {
    let mut parts: Vec<String> = when
        .iter()
        .map(|(field, values)| {
            let values: Vec<_> = values.iter().map(|v| as_text(v).into_owned()).collect();
            format!("{field}={}", values.join("|"))
        })
        .collect();
    if let Some(model) = model {
        parts.push(format!("model={model}"));
    }
    if parts.is_empty() {
        "always".to_owned()
    } else {
        parts.join(" ")
    }
}

/// Whether `glob` matches the model of every endpoint that answers items
/// (true) or of none (false); a glob that splits them is refused.
fn model_condition(
    glob: &str,
    endpoints: &[EndpointConfig],
    at: &str,
    p: &mut Problems<'_>,
) -> Option<bool> {
    let (matching, other): (Vec<&EndpointConfig>, Vec<&EndpointConfig>) = endpoints
        .iter()
        .filter(|e| e.takes_items())
        .partition(|e| glob_matches(glob, &e.model));
    if matching.is_empty() || other.is_empty() {
        return Some(other.is_empty() && !matching.is_empty());
    }
    let list = |side: &[&EndpointConfig]| {
        side.iter()
            .map(|e| format!("{} ({})", e.name, e.model))
            .collect::<Vec<_>>()
            .join(", ")
    };
    p.push(
        &path::key(at, "model"),
        format!(
            "'{glob}' matches the model of endpoints {} but not of {}: an item's messages are made before an endpoint takes it, so a model condition must hold for every endpoint that answers items or for none; run each model on its own (a run per model, or `evalfleet bench`)",
            list(&matching),
            list(&other)
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_stars_and_single_characters() {
        for (glob, text, expected) in [
            ("qwen2-vl*", "qwen2-vl-7b", true),
            ("qwen2-vl*", "qwen2-vl", true),
            ("qwen2-vl*", "qwen2.5-vl-7b", false),
            ("*vl*", "qwen2.5-vl-7b", true),
            ("*-7b", "qwen2.5-vl-7b", true),
            ("*-7b", "qwen2.5-vl-72b", false),
            ("gpt-?", "gpt-5", true),
            ("gpt-?", "gpt-52", false),
            ("a*b*c", "aXXbYYbZc", true),
            ("a*b*c", "aXXbYY", false),
            ("exact", "exact", true),
            ("", "", true),
            ("*", "", true),
        ] {
            assert_eq!(glob_matches(glob, text), expected, "{glob} ~ {text}");
        }
    }

    #[test]
    fn conditions_compare_as_text_and_null_means_missing() {
        let rule = PromptRule {
            name: "r".to_owned(),
            when: vec![
                (
                    "doc_type".to_owned(),
                    vec![Value::from("invoice"), Value::from("receipt")],
                ),
                ("year".to_owned(), vec![Value::from(2024), Value::Null]),
            ],
            model: None,
            model_matches: true,
            messages: Vec::new(),
        };
        let row = |json: &str| serde_json::from_str::<Map<String, Value>>(json).unwrap();
        assert!(rule.accepts(&row(r#"{"doc_type": "invoice", "year": 2024}"#)));
        assert!(rule.accepts(&row(r#"{"doc_type": "receipt", "year": "2024"}"#)));
        assert!(rule.accepts(&row(r#"{"doc_type": "receipt"}"#)));
        assert!(rule.accepts(&row(r#"{"doc_type": "receipt", "year": null}"#)));
        assert!(!rule.accepts(&row(r#"{"doc_type": "form", "year": 2024}"#)));
        assert!(!rule.accepts(&row(r#"{"year": 2024}"#)));
        assert!(!rule.accepts(&row(r#"{"doc_type": "invoice", "year": 2023}"#)));
        let model_elsewhere = PromptRule {
            model_matches: false,
            ..rule
        };
        assert!(!model_elsewhere.accepts(&row(r#"{"doc_type": "invoice", "year": 2024}"#)));
    }

    #[test]
    fn names_are_made_from_conditions() {
        assert_eq!(
            derived_name(
                &[(
                    "doc_type".to_owned(),
                    vec![Value::from("invoice"), Value::from("receipt")]
                )],
                Some("qwen*")
            ),
            "doc_type=invoice|receipt model=qwen*"
        );
        assert_eq!(derived_name(&[], None), "always");
    }
}
