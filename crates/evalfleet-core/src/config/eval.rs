//! `task.parse`, `task.schema`, `task.max_reasks`, `task.structured_output`
//! and `task.metrics`.

use std::path::Path;

use crate::eval::text::Pattern;
use serde_json::{Map, Value};

use super::path;
use super::raw::RawTask;
use super::validate::Problems;
use crate::eval::metrics::REGISTRY;
use crate::eval::{EvalSpec, Metric, MetricSpec, Parser};

const PARSERS: &str =
    "whole, json, choice, {regex: PATTERN, group: N, match: first|last} or {choice: LETTERS}";

/// Takes the task's checking and scoring keys out of `raw`.
pub(super) fn eval(raw: &mut RawTask, dir: &Path, p: &mut Problems<'_>) -> Option<EvalSpec> {
    let parser = match raw.parse.take() {
        None => Some(Parser::Whole),
        Some(value) => parser(&value, p),
    };
    let schema = match (raw.schema.take(), raw.schema_file.take()) {
        (Some(_), Some(_)) => p.push(
            "task.schema_file",
            "cannot be given with task.schema (choose one)",
        ),
        (Some(schema), None) => check_schema("task.schema", schema, p),
        (None, Some(file)) => {
            let resolved = dir.join(&file);
            match std::fs::read_to_string(&resolved) {
                Err(err) => p.push(
                    "task.schema_file",
                    format!("cannot read {}: {err}", resolved.display()),
                ),
                Ok(text) => match serde_json::from_str::<Value>(&text) {
                    Err(err) => p.push(
                        "task.schema_file",
                        format!("{} is not JSON: {err}", resolved.display()),
                    ),
                    Ok(schema) => check_schema("task.schema_file", schema, p),
                },
            }
        }
        (None, None) => Some(Value::Null),
    };
    let metrics = metrics(raw.metrics.take().unwrap_or_default(), p);
    let (parser, schema, metrics) = (parser?, schema?, metrics?);
    let schema = (!schema.is_null()).then_some(schema);
    let parser = match (&parser, &schema) {
        // A schema checks JSON: the answer is parsed as JSON.
        (Parser::Whole, Some(_)) => Parser::Json,
        (Parser::Json, _) | (_, None) => parser,
        (_, Some(_)) => return p.push("task.schema", "needs task.parse to be json (or left out)"),
    };
    let checks = !matches!(parser, Parser::Whole);
    let structured_output = raw.structured_output.unwrap_or(false);
    if structured_output && schema.is_none() {
        return p.push(
            "task.structured_output",
            "needs task.schema (the schema to send)",
        );
    }
    Some(EvalSpec {
        parser,
        schema,
        max_reasks: raw.max_reasks.unwrap_or(if checks { 2 } else { 0 }),
        structured_output,
        metrics,
    })
}

fn check_schema(at: &str, schema: Value, p: &mut Problems<'_>) -> Option<Value> {
    match jsonschema::validator_for(&schema) {
        Ok(_) => Some(schema),
        Err(err) => p.push(at, format!("is not a valid JSON Schema: {err}")),
    }
}

fn parser(value: &Value, p: &mut Problems<'_>) -> Option<Parser> {
    let default_choices = || "ABCD".chars().collect::<Vec<_>>();
    match value {
        Value::String(s) => match s.as_str() {
            "whole" => Some(Parser::Whole),
            "json" => Some(Parser::Json),
            "choice" => Some(Parser::Choice {
                choices: default_choices(),
            }),
            other => p.push(
                "task.parse",
                format!("must be one of {PARSERS}, got '{other}'"),
            ),
        },
        Value::Object(map) => {
            if let Some(pattern) = map.get("regex") {
                const REGEX_KEYS: [&str; 3] = ["group", "match", "regex"];
                if let Some(unknown) = map.keys().find(|k| !REGEX_KEYS.contains(&k.as_str())) {
                    let known = REGEX_KEYS.map(str::to_owned);
                    return p.unknown_key("task.parse", unknown, &known);
                }
                let Some(pattern) = pattern.as_str() else {
                    return p.push("task.parse.regex", "must be a string");
                };
                let pattern = match Pattern::new(pattern) {
                    Ok(re) => re,
                    Err(err) => {
                        return p.push("task.parse.regex", format!("is not a valid regex: {err}"));
                    }
                };
                let groups = pattern.captures_len() - 1;
                let group = match map.get("group") {
                    None => usize::from(groups > 0),
                    Some(g) => match g.as_u64() {
                        Some(g) if g as usize <= groups => g as usize,
                        _ => {
                            return p.push(
                                "task.parse.group",
                                format!("must be a group of the pattern (0 to {groups}), got {g}"),
                            );
                        }
                    },
                };
                let first = match map.get("match").and_then(Value::as_str) {
                    None if map.get("match").is_none() => true,
                    Some("first") => true,
                    Some("last") => false,
                    _ => return p.push("task.parse.match", "must be first or last"),
                };
                Some(Parser::Regex {
                    pattern,
                    group,
                    first,
                })
            } else if let Some(letters) = map.get("choice") {
                if map.len() > 1 {
                    return p.push("task.parse", "choice takes no other key");
                }
                match letters.as_str() {
                    Some(l) if !l.is_empty() && l.chars().all(|c| c.is_ascii_uppercase()) => {
                        Some(Parser::Choice {
                            choices: l.chars().collect(),
                        })
                    }
                    _ => p.push(
                        "task.parse.choice",
                        "must be upper-case letters, e.g. ABCDE",
                    ),
                }
            } else {
                p.push("task.parse", format!("must be one of {PARSERS}"))
            }
        }
        other => p.push(
            "task.parse",
            format!("must be one of {PARSERS}, got {other}"),
        ),
    }
}

fn metrics(list: Vec<Value>, p: &mut Problems<'_>) -> Option<Vec<MetricSpec>> {
    let mut out = Vec::with_capacity(list.len());
    let mut ok = true;
    let mut keys = std::collections::HashSet::new();
    let checker = crate::jinja::environment();
    for (i, value) in list.into_iter().enumerate() {
        let at = path::index("task.metrics", i);
        let (name, reference, key, params) = match value {
            Value::String(name) => (name, None, None, Map::new()),
            Value::Object(mut map) => {
                let name = match map.remove("name") {
                    Some(Value::String(name)) => name,
                    _ => {
                        ok = false;
                        p.push::<()>(
                            &path::key(&at, "name"),
                            "is required (a metric, e.g. exact_match)",
                        );
                        continue;
                    }
                };
                let mut text = |key: &str, what: &str| match map.remove(key) {
                    None => Ok(None),
                    Some(Value::String(s)) => Ok(Some(s)),
                    Some(Value::Number(n)) if key == "reference" => Ok(Some(n.to_string())),
                    Some(_) => Err(p.push::<()>(&path::key(&at, key), what)),
                };
                let Ok(reference) = text(
                    "reference",
                    "must be a template string, e.g. \"{{ answer }}\"",
                ) else {
                    ok = false;
                    continue;
                };
                let Ok(key) = text("as", "must be a string") else {
                    ok = false;
                    continue;
                };
                // What is left are the metric's parameters.
                let base = name.split('@').next().unwrap_or_default();
                if let Some(info) = REGISTRY.iter().find(|m| m.name == base) {
                    let mut known: Vec<String> = ["as", "name", "reference"]
                        .into_iter()
                        .chain(info.params.iter().copied())
                        .map(str::to_owned)
                        .collect();
                    known.sort();
                    let unknown: Vec<&String> = map.keys().filter(|k| !known.contains(k)).collect();
                    if !unknown.is_empty() {
                        for key in unknown {
                            p.unknown_key::<()>(&at, key, &known);
                        }
                        ok = false;
                        continue;
                    }
                }
                (name, reference, key, map)
            }
            other => {
                ok = false;
                p.push::<()>(
                    &at,
                    format!("must be a metric name or a mapping with name, got {other}"),
                );
                continue;
            }
        };
        if let Some(reference) = &reference
            && let Err(err) = crate::jinja::check(&checker, reference)
        {
            ok = false;
            p.push::<()>(&path::key(&at, "reference"), err);
            continue;
        }
        match Metric::build(&name, &params, key) {
            Err(err) => {
                ok = false;
                p.push::<()>(&at, err);
            }
            Ok(metric) => {
                if !keys.insert(metric.key.clone()) {
                    ok = false;
                    p.push::<()>(
                        &at,
                        format!(
                            "'{}' is listed twice (give one of them another key with as:)",
                            metric.key
                        ),
                    );
                    continue;
                }
                if let crate::eval::metrics::Kind::LlmJudge { rubric, .. } = &metric.kind
                    && let Err(err) = crate::jinja::check(&checker, rubric)
                {
                    ok = false;
                    p.push::<()>(&path::key(&at, "rubric"), err);
                    continue;
                }
                if metric.needs_reference() && reference.is_none() {
                    ok = false;
                    p.push::<()>(
                        &path::key(&at, "reference"),
                        format!(
                            "is required for {} (e.g. \"{{{{ answer }}}}\")",
                            metric.name
                        ),
                    );
                    continue;
                }
                out.push(MetricSpec { metric, reference });
            }
        }
    }
    ok.then_some(out)
}
