//! The config's JSON Schema, made from the raw structs and their doc
//! comments: which keys each place of a config holds (to suggest the one an
//! unknown key was meant to be) and what each does (`docs/config.md`).
//!
//! A few keys take more than one shape (`concurrency: adaptive`, `8` or a
//! mapping); the raw structs read them as JSON values, and the types here
//! describe their shapes to the schema only. A shape that names a section's
//! raw struct lives beside that struct (`Concurrency`, `BackendMetric`), so
//! that this module stays below the sections.

use std::borrow::Cow;

use schemars::generate::SchemaSettings;
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde_json::Value;

use super::path;

/// One step of a path into a config document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    Key(String),
    Index(usize),
}

/// `T`'s schema, every subschema in place.
pub(super) fn of<T: JsonSchema>() -> Value {
    SchemaSettings::draft2020_12()
        .with(|settings| settings.inline_subschemas = true)
        .into_generator()
        .into_root_schema_for::<T>()
        .to_value()
}

/// The schema itself and the schemas it is one of (`anyOf`, `oneOf`), for
/// a key that takes several shapes.
pub(super) fn alternatives(schema: &Value) -> Vec<&Value> {
    let mut out = vec![schema];
    for keyword in ["anyOf", "oneOf", "allOf"] {
        if let Some(list) = schema.get(keyword).and_then(Value::as_array) {
            out.extend(list.iter().flat_map(alternatives));
        }
    }
    out
}

/// The keys a mapping described by `schema` may hold, sorted.
fn keys(schema: &Value) -> Vec<String> {
    let mut out: Vec<String> = alternatives(schema)
        .into_iter()
        .filter_map(|s| s.get("properties").and_then(Value::as_object))
        .flat_map(|properties| properties.keys().cloned())
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The schema of what is at `at` (from the schema's root), if it is known.
fn find<'s>(schema: &'s Value, at: &[Segment]) -> Option<&'s Value> {
    let Some((first, rest)) = at.split_first() else {
        return Some(schema);
    };
    let next = alternatives(schema).into_iter().find_map(|s| match first {
        Segment::Key(key) => s.get("properties").and_then(|p| p.get(key)),
        Segment::Index(_) => s.get("items"),
    })?;
    find(next, rest)
}

/// The keys known at `at`, sorted (none where the schema does not say).
pub(super) fn keys_at(schema: &Value, at: &[Segment]) -> Vec<String> {
    find(schema, at).map(keys).unwrap_or_default()
}

/// Takes out of `value` the keys that its schema's closed mappings
/// (`deny_unknown_fields`) do not know, and returns where each was.
pub(super) fn take_unknown(value: &mut Value, schema: &Value) -> Vec<Vec<Segment>> {
    let mut out = Vec::new();
    take_unknown_at(value, schema, &mut Vec::new(), &mut out);
    out
}

fn take_unknown_at(
    value: &mut Value,
    schema: &Value,
    at: &mut Vec<Segment>,
    out: &mut Vec<Vec<Segment>>,
) {
    match value {
        Value::Object(map) => {
            // Where a key takes several mappings, which one a value is
            // meant to be is its reader's to say.
            let mappings: Vec<&Value> = alternatives(schema)
                .into_iter()
                .filter(|s| s.get("properties").is_some())
                .collect();
            let [mapping] = mappings[..] else {
                return;
            };
            let properties = mapping.get("properties").and_then(Value::as_object);
            let known = |key: &str| properties.is_some_and(|p| p.contains_key(key));
            if mapping.get("additionalProperties") == Some(&Value::Bool(false)) {
                let unknown: Vec<String> = map.keys().filter(|k| !known(k)).cloned().collect();
                for key in unknown {
                    map.remove(&key);
                    let mut place = at.clone();
                    place.push(Segment::Key(key));
                    out.push(place);
                }
            }
            for (key, child) in map.iter_mut() {
                if let Some(child_schema) = properties.and_then(|p| p.get(key)) {
                    at.push(Segment::Key(key.clone()));
                    take_unknown_at(child, child_schema, at, out);
                    at.pop();
                }
            }
        }
        Value::Array(items) => {
            let Some(item_schema) = alternatives(schema)
                .into_iter()
                .find_map(|s| s.get("items"))
            else {
                return;
            };
            for (index, item) in items.iter_mut().enumerate() {
                at.push(Segment::Index(index));
                take_unknown_at(item, item_schema, at, out);
                at.pop();
            }
        }
        _ => {}
    }
}

/// `at` as users read it (`endpoints[1].mock`), below `root`.
pub(super) fn render(root: &str, at: &[Segment]) -> String {
    at.iter()
        .fold(root.to_owned(), |out, segment| match segment {
            Segment::Key(key) => path::key(&out, key),
            Segment::Index(index) => path::index(&out, *index),
        })
}

/// Past this many known keys the message names the reference instead.
const LISTED_KEYS: usize = 16;

pub use evalfleet_eval::text::nearest;

/// The message for `key`, unknown at `place` where `known` are the keys:
/// the nearest known one, or the known ones (or where they are listed).
pub fn unknown_key(place: &str, key: &str, known: &[String]) -> String {
    let hint = match nearest(key, known) {
        Some(meant) => format!(" (did you mean '{meant}'?)"),
        None if known.is_empty() => String::new(),
        None if known.len() <= LISTED_KEYS => format!(" (known: {})", known.join(", ")),
        None => {
            let generic: String = place
                .split('[')
                .map(|part| part.split_once(']').map_or(part, |(_, rest)| rest))
                .collect::<Vec<_>>()
                .join("[]");
            format!(
                " (docs/config.md lists the {} keys of {generic})",
                known.len()
            )
        }
    };
    format!("{place}: unknown key '{key}'{hint}")
}

/// A duration written as text: `500ms`, `30s`, `5m`, `1h`, `7d`.
pub(super) struct Duration;

impl JsonSchema for Duration {
    fn schema_name() -> Cow<'static, str> {
        "Duration".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({"type": "string", "format": "humantime"})
    }
}

/// A command: one line of words, or a list of them.
pub(super) struct Command;

impl JsonSchema for Command {
    fn schema_name() -> Cow<'static, str> {
        "Command".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]})
    }
}

/// An agent's input: how it comes, or how and with which fields.
pub(super) struct AgentInput;

impl JsonSchema for AgentInput {
    fn schema_name() -> Cow<'static, str> {
        "AgentInput".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({"oneOf": [
            {"type": "string", "enum": ["stdin", "file", "args"]},
            {"type": "object", "properties": {
                "via": {"type": "string", "enum": ["stdin", "file", "args"],
                        "description": "How the item reaches the program, as `task.input` alone says. Default `stdin`."},
                "fields": {"type": "array", "items": {"type": "string"},
                           "description": "The item's fields the program gets, exactly those (a field the references read included, when named). Default: every field but those the metrics' references read."}
            }, "additionalProperties": false}
        ]})
    }
}

/// Any JSON value.
pub(super) struct AnyJson;

impl JsonSchema for AnyJson {
    fn schema_name() -> Cow<'static, str> {
        "AnyJson".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({})
    }
}

/// `endpoints[].gpu`: an index, or indexes separated by commas.
pub(super) struct Gpu;

impl JsonSchema for Gpu {
    fn schema_name() -> Cow<'static, str> {
        "Gpu".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string"}]})
    }
}

/// `task.parse`: a parser's name, or a mapping for a regex or letters.
pub(super) struct Parse;

impl JsonSchema for Parse {
    fn schema_name() -> Cow<'static, str> {
        "Parse".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(generator: &mut SchemaGenerator) -> Schema {
        json_schema!({"anyOf": [
            {"enum": ["whole", "json", "choice"]},
            generator.subschema_for::<ParseRegex>(),
            generator.subschema_for::<ParseChoice>(),
        ]})
    }
}

/// `parse: {regex: PATTERN, group: N, match: first|last}`: the answer is
/// what a regular expression finds.
#[derive(JsonSchema)]
#[allow(
    dead_code,
    reason = "a shape for the schema; the value is read as JSON"
)]
pub(super) struct ParseRegex {
    /// The regular expression. Required in this form.
    regex: String,
    /// The group that is the answer. Default 1 when the pattern has a
    /// group, else 0 (the whole match).
    group: Option<u32>,
    /// `first` or `last`: which match is the answer. Default `first`.
    #[schemars(rename = "match")]
    which: Option<String>,
}

/// `parse: {choice: LETTERS}`: the answer is one of these letters.
#[derive(JsonSchema)]
#[allow(
    dead_code,
    reason = "a shape for the schema; the value is read as JSON"
)]
pub(super) struct ParseChoice {
    /// The letters that may be chosen, upper case (`ABCDE`). Required in
    /// this form; `parse: choice` is `ABCD`.
    choice: String,
}

/// `task.metrics[]`: a metric's name, or a mapping with its name.
pub(super) struct Metric;

impl JsonSchema for Metric {
    fn schema_name() -> Cow<'static, str> {
        "Metric".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(generator: &mut SchemaGenerator) -> Schema {
        json_schema!({"anyOf": [
            {"type": "string"},
            generator.subschema_for::<MetricEntry>(),
        ]})
    }
}

/// A metric with its settings: `name`, `reference` and `as` for every
/// metric, and the parameters of its own (`docs/metrics.md` defines each
/// metric; a parameter another metric takes is refused).
#[derive(JsonSchema)]
#[allow(
    dead_code,
    reason = "a shape for the schema; the value is read as JSON"
)]
pub(super) struct MetricEntry {
    /// The metric: `exact_match`, or `exact_match@1` for a version
    /// (`exact_match@native` and `exact_match@native@1` name the same
    /// built-in metric); `NAME@BACKEND` or `NAME@BACKEND@VERSION` for a
    /// metric of `task.metric_backends`, whose other keys are given to its
    /// program as they are. Required.
    name: Option<String>,
    /// What the answer is compared with: a template over the item's fields
    /// (`"{{ answer }}"`); one expression that is a list gives a list of
    /// references, the best counting. Required for metrics that compare,
    /// optional for `llm_judge`, unused by the others.
    reference: Option<String>,
    /// The key its scores are stored and reported under, so that one metric
    /// may be listed twice with other parameters. Default `name@version`
    /// (`name@backend@version` for a backend's metric).
    #[schemars(rename = "as")]
    key: Option<String>,
    /// `exact_match`, `contains`: `strip` (surrounding whitespace), `none`
    /// or `squad` (SQuAD's: lower case, no punctuation, articles or extra
    /// spaces). Default `strip`.
    normalize: Option<String>,
    /// `exact_match`, `contains`, `classification`: compare without case.
    /// Default `false`, and `true` for `classification`.
    ignore_case: Option<bool>,
    /// `regex_match`: the regular expression the answer must match.
    /// Required for `regex_match`.
    pattern: Option<String>,
    /// `numeric_match`: how far the answer's number may be from the
    /// reference's. Default 0.000001.
    tolerance: Option<f64>,
    /// `numeric_match`: how far it may be as a share of the reference's.
    /// Default 0.
    relative_tolerance: Option<f64>,
    /// `anls`: the normalised distance (0 to 1) from which an answer scores
    /// 0. Default 0.5.
    threshold: Option<f64>,
    /// `json_field_match`: the paths of the fields to compare (`a.b`,
    /// `list[0].c`). Default: every leaf of the reference.
    fields: Option<Vec<String>>,
    /// `classification`: the labels; an answer outside them counts as
    /// `(other)`. Default: none (every answer is a label).
    labels: Option<Vec<String>>,
    /// `llm_judge`: the endpoint (by name, with `role: judge`) that judges.
    /// Required for `llm_judge`.
    endpoint: Option<String>,
    /// `llm_judge`: the message sent to the judge, a template over the
    /// item's fields, `answer` and `reference`. Required for `llm_judge`.
    rubric: Option<String>,
    /// `llm_judge`: the regular expression whose first group is the score,
    /// its last match in the judge's reply counting. Default
    /// `(?i)score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)`.
    score_regex: Option<String>,
    /// `llm_judge`: `[lowest, highest]` of the judge's scores, which are
    /// scaled to 0..1. Default `[0, 10]`.
    scale: Option<[f64; 2]>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::raw::config;

    fn keys(list: &[&str]) -> Vec<String> {
        list.iter().map(|k| (*k).to_owned()).collect()
    }

    #[test]
    fn a_near_key_is_suggested_and_a_far_one_is_not() {
        let task = keys(&["kind", "messages", "metrics", "params", "parse", "stream"]);
        assert_eq!(nearest("metric", &task), Some("metrics"));
        assert_eq!(nearest("mesages", &task), Some("messages"));
        assert_eq!(nearest("Stream", &task), Some("stream"));
        assert_eq!(nearest("temperature", &task), None);
        let dataset = keys(&["format", "id_field", "path", "sample", "skip_invalid"]);
        assert_eq!(nearest("idField", &dataset), Some("id_field"));
        assert_eq!(nearest("id-field", &dataset), Some("id_field"));
        assert_eq!(nearest("colour", &dataset), None);
    }

    #[test]
    fn the_keys_of_a_place_come_from_the_schema() {
        let schema = config();
        let at = |path: &[Segment]| keys_at(&schema, path);
        let key = |k: &str| Segment::Key(k.to_owned());
        assert!(at(&[]).contains(&"endpoints".to_owned()));
        let endpoint = at(&[key("endpoints"), Segment::Index(3)]);
        assert!(endpoint.contains(&"concurrency".to_owned()), "{endpoint:?}");
        let bounds = at(&[key("endpoints"), Segment::Index(0), key("concurrency")]);
        assert_eq!(
            bounds,
            keys(&[
                "decrease_ratio",
                "gain",
                "initial",
                "max",
                "min",
                "rtt_tolerance"
            ])
        );
        let outage = at(&[
            key("endpoints"),
            Segment::Index(0),
            key("mock"),
            key("outage"),
        ]);
        assert_eq!(outage, keys(&["after", "for", "status"]));
        assert!(at(&[key("nowhere")]).is_empty());
    }
}
