//! `task.parse`, `task.schema`, `task.max_reasks`, `task.structured_output`
//! and `task.metrics`.

use std::path::Path;

use evalfleet_eval::text::Pattern;
use serde_json::{Map, Value};

use super::path;
use super::problems::Problems;
use super::raw::{RawBackendMetric, RawMetricBackend, RawTask};
use super::read;
use evalfleet_eval::backend::{BackendMetric, BackendSpec, NATIVE};
use evalfleet_eval::metrics::REGISTRY;
use evalfleet_eval::{EvalSpec, Metric, MetricSpec, Parser};

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
    let backends = match raw.metric_backends.take() {
        None => Some(Vec::new()),
        Some(value) => backends(&value, dir, p),
    };
    let metrics = metrics(
        raw.metrics.take().unwrap_or_default(),
        backends.as_deref(),
        p,
    );
    let (parser, schema, metrics, backends) = (parser?, schema?, metrics?, backends?);
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
        backends,
    })
}

/// Whether a metric's name is a built-in metric's (`anls`, `anls@1`,
/// `anls@native`, ...), not a backend's.
fn names_native(name: &str) -> bool {
    name.split('@')
        .nth(1)
        .is_none_or(|b| b == NATIVE || b.parse::<u32>().is_ok())
}

/// `task.metric_backends`.
fn backends(value: &Value, dir: &Path, p: &mut Problems<'_>) -> Option<Vec<BackendSpec>> {
    const AT: &str = "task.metric_backends";
    let list = read::section::<Vec<RawMetricBackend>>(value, AT, p.0)?;
    let mut out = Vec::with_capacity(list.len());
    let mut ok = true;
    for (i, raw) in list.into_iter().enumerate() {
        let at = path::index(AT, i);
        match backend(raw, &at, &out, dir, p) {
            Some(spec) => out.push(spec),
            None => ok = false,
        }
    }
    ok.then_some(out)
}

fn backend(
    raw: RawMetricBackend,
    at: &str,
    before: &[BackendSpec],
    dir: &Path,
    p: &mut Problems<'_>,
) -> Option<BackendSpec> {
    let name = match raw.name {
        None => return p.push(&path::key(at, "name"), "is required (e.g. evalscope)"),
        Some(name) if name == NATIVE => {
            return p.push(
                &path::key(at, "name"),
                "'native' is the built-in metrics' backend; choose another name",
            );
        }
        Some(name)
            if name.is_empty()
                || name.bytes().all(|b| b.is_ascii_digit())
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') =>
        {
            return p.push(
                &path::key(at, "name"),
                format!("must be letters, digits, _ and - (and not only digits), got '{name}'"),
            );
        }
        Some(name) if before.iter().any(|b| b.name == name) => {
            return p.push(
                &path::key(at, "name"),
                format!("'{name}' is declared twice"),
            );
        }
        Some(name) => name,
    };
    let argv = |key: &str, list: Option<Vec<String>>, p: &mut Problems<'_>| match list {
        Some(list)
            if list
                .first()
                .is_some_and(|program| !program.trim().is_empty()) =>
        {
            Some(list)
        }
        Some(_) => p.push(
            &path::key(at, key),
            "must be a program and its arguments, e.g. [python3, score.py]",
        ),
        None => None,
    };
    let command = match raw.command {
        None => p.push(
            &path::key(at, "command"),
            "is required (the program and its arguments, e.g. [python3, score.py])",
        ),
        some => argv("command", some, p),
    };
    let setup = match raw.setup {
        None => Some(None),
        some => argv("setup", some, p).map(Some),
    };
    let timeout = p.duration(&path::key(at, "timeout"), raw.timeout.as_deref(), "60s");
    let setup_timeout = p.duration(
        &path::key(at, "setup_timeout"),
        raw.setup_timeout.as_deref(),
        "30m",
    );
    let queue = match raw.queue {
        None => Some(64),
        Some(q) if (1..=10_000).contains(&q) => Some(q as usize),
        Some(q) => p.push(
            &path::key(at, "queue"),
            format!("must be between 1 and 10000, got {q}"),
        ),
    };
    let metrics = match raw.metrics {
        Some(list) if !list.is_empty() => backend_metrics(list, &path::key(at, "metrics"), p),
        _ => p.push(
            &path::key(at, "metrics"),
            "is required: the metrics it gives (e.g. [anls])",
        ),
    };
    Some(BackendSpec {
        name,
        version: raw.version.unwrap_or(1),
        command: command?,
        setup: setup?,
        timeout: timeout?,
        setup_timeout: setup_timeout?,
        queue: queue?,
        metrics: metrics?,
        dir: dir.to_owned(),
    })
}

fn backend_metrics(list: Vec<Value>, at: &str, p: &mut Problems<'_>) -> Option<Vec<BackendMetric>> {
    let mut out: Vec<BackendMetric> = Vec::with_capacity(list.len());
    let mut ok = true;
    for (i, value) in list.into_iter().enumerate() {
        let at = path::index(at, i);
        let metric = match value {
            Value::String(name) => Some(BackendMetric {
                name,
                higher_is_better: true,
                summary: String::new(),
            }),
            value @ Value::Object(_) => read::section::<RawBackendMetric>(&value, &at, p.0)
                .and_then(|raw| match raw.name {
                    Some(name) => Some(BackendMetric {
                        name,
                        higher_is_better: raw.higher_is_better.unwrap_or(true),
                        summary: raw.summary.unwrap_or_default(),
                    }),
                    None => p.push(&path::key(&at, "name"), "is required"),
                }),
            other => p.push(
                &at,
                format!("must be a metric name or a mapping with name, got {other}"),
            ),
        };
        match metric {
            Some(m) if m.name.is_empty() || m.name.contains('@') => {
                ok = false;
                p.push::<()>(
                    &at,
                    format!("'{}' is no metric name (no @, not empty)", m.name),
                );
            }
            Some(m) if out.iter().any(|o| o.name == m.name) => {
                ok = false;
                p.push::<()>(&at, format!("'{}' is listed twice", m.name));
            }
            Some(m) => out.push(m),
            None => ok = false,
        }
    }
    ok.then_some(out)
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

/// `task.metrics`, whose `NAME@BACKEND` names one of `backends` (`None`
/// when they have problems of their own: those metrics are not checked).
fn metrics(
    list: Vec<Value>,
    backends: Option<&[BackendSpec]>,
    p: &mut Problems<'_>,
) -> Option<Vec<MetricSpec>> {
    let mut out = Vec::with_capacity(list.len());
    let mut ok = true;
    let mut keys = std::collections::HashSet::new();
    let checker = evalfleet_jinja::environment();
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
                // What is left are the metric's parameters (a backend's
                // metric takes any: they are the program's business).
                let base = name.split('@').next().unwrap_or_default();
                let native = names_native(&name);
                if let Some(info) = REGISTRY.iter().find(|m| native && m.name == base) {
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
            && let Err(err) = evalfleet_jinja::check(&checker, reference)
        {
            ok = false;
            p.push::<()>(&path::key(&at, "reference"), err);
            continue;
        }
        let Some(backends) = backends.or_else(|| names_native(&name).then_some(&[][..])) else {
            continue;
        };
        match Metric::build_with(&name, &params, key, backends) {
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
                if let evalfleet_eval::metrics::Kind::LlmJudge { rubric, .. } = &metric.kind
                    && let Err(err) = evalfleet_jinja::check(&checker, rubric)
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
