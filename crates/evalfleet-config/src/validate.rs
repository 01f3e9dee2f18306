//! Raw sections to a validated [`Config`], collecting every problem.

mod dataset;
mod task;

use std::collections::HashSet;
use std::path::Path;

use serde_json::{Map, Value, json};

use self::dataset::dataset;
use self::task::task;
use super::env::{self, Vars};
use super::problems::{Problems, RawProblem};
use super::raw::{self, RawConfig, RawDataset, RawRetry, RawTask, RawTimeouts, RawWriter};
use super::read;
use super::{
    Admission, BudgetSettings, Config, ConfigError, DatasetConfig, DatasetFormat, Document,
    LoadedConfig, MASK, Overrides, Problem, RetryPolicy, Timeouts, WriterSettings, endpoint,
};

pub(super) fn load(
    mut document: Document,
    dir: &Path,
    overrides: Overrides,
    origin: String,
    admission: Option<&Admission>,
) -> Result<LoadedConfig, ConfigError> {
    let mut problems: Vec<RawProblem> = Vec::new();
    if document.value.is_null() {
        document.value = Value::Object(Map::new());
    }
    if !document.value.is_object() {
        return Err(invalid(
            origin,
            &document,
            vec![(
                String::new(),
                "the config must be a mapping of keys to values".to_owned(),
            )],
        ));
    }
    if let Some(admission) = admission {
        let refusals = admission.refusals(&document.value, dir);
        if !refusals.is_empty() {
            return Err(ConfigError::Refused {
                origin,
                problems: located(&document, refusals),
            });
        }
    }
    apply_overrides(&mut document.value, overrides, &mut problems);
    let snapshot = masked(&document.value);

    let mut value = document.value.clone();
    let vars = Vars::load(dir).map(|vars| match admission {
        Some(admission) => vars.only(admission.env.clone()),
        None => vars,
    });
    match vars {
        Ok(vars) => {
            let mut unresolved = Vec::new();
            env::interpolate(&mut value, "", &vars, &mut unresolved);
            problems.extend(unresolved.into_iter().map(|u| {
                let message = format!("{}: {}", u.path, u.message);
                (u.path, message)
            }));
        }
        Err(message) => problems.push((String::new(), message)),
    }

    let mut config = read::section::<RawConfig>(&value, "", &mut problems)
        .and_then(|raw| validate(raw, dir, &mut problems));
    // Images are named by the dataset's rows: they are confined when read.
    // The dataset's files are opened beneath the roots, as they were
    // checked: no link swapped in since leads out.
    if let (Some(config), Some(admission)) = (&mut config, admission) {
        config.task.images.roots = Some(admission.roots.clone());
        config.dataset.roots = Some(admission.roots.clone());
    }
    match config {
        Some(config) if problems.is_empty() => Ok(LoadedConfig {
            config,
            snapshot,
            dir: dir.to_owned(),
            origin,
            lines: std::sync::Arc::new(document.lines),
            notes: Vec::new(),
        }),
        _ => Err(invalid(origin, &document, problems)),
    }
}

pub(super) fn invalid(
    origin: String,
    document: &Document,
    problems: Vec<RawProblem>,
) -> ConfigError {
    ConfigError::Invalid {
        origin,
        problems: located(document, problems),
    }
}

/// `problems` once each, with their lines, in the order of the file.
fn located(document: &Document, problems: Vec<RawProblem>) -> Vec<Problem> {
    let mut seen = HashSet::new();
    let mut out: Vec<Problem> = problems
        .into_iter()
        .filter(|(_, message)| seen.insert(message.clone()))
        .map(|(at, message)| Problem {
            line: document.line_of(&at),
            message,
        })
        .collect();
    out.sort_by_key(|p| p.line.unwrap_or(0));
    out
}

/// The mapping at `path` in `value`, made (empty) where it is missing;
/// `None` where something else than a mapping stands in the way (the
/// validator reports that).
fn section<'v>(value: &'v mut Value, path: &[&str]) -> Option<&'v mut Map<String, Value>> {
    let mut here = value.as_object_mut()?;
    for key in path {
        here = here
            .entry(*key)
            .or_insert_with(|| json!({}))
            .as_object_mut()?;
    }
    Some(here)
}

fn apply_overrides(value: &mut Value, overrides: Overrides, problems: &mut Vec<RawProblem>) {
    for set in &overrides.sets {
        if let Err(message) = set_key(value, set) {
            problems.push((String::new(), format!("--set {set}: {message}")));
        }
    }
    if let Some(limit) = overrides.limit
        && let Some(dataset) = section(value, &["dataset"])
    {
        dataset.insert("limit".to_owned(), json!(limit));
    }
    let conversation = [
        ("sessions", overrides.sessions.map(|n| json!(n))),
        ("max_steps", overrides.max_steps.map(|n| json!(n))),
        ("batch_size", overrides.batch_size.map(|n| json!(n))),
    ];
    for (key, given) in conversation {
        if let Some(given) = given
            && let Some(section) = section(value, &["task", "conversation"])
        {
            section.insert(key.to_owned(), given);
        }
    }
    // A trainer decides; the policy's messages stay, since they make the
    // prompt its observations carry.
    if overrides.external_policy
        && let Some(policy) = section(value, &["task", "conversation", "policy"])
    {
        policy.insert("kind".to_owned(), json!("external"));
        policy.remove("strategy");
    }
    if overrides.sample_n.is_none() && overrides.sample_seed.is_none() {
        return;
    }
    let Some(sample) = section(value, &["dataset", "sample"]) else {
        return;
    };
    if let Some(n) = overrides.sample_n {
        sample.insert("n".to_owned(), json!(n));
    }
    if let Some(seed) = overrides.sample_seed {
        sample.insert("seed".to_owned(), json!(seed));
    }
    if !sample.contains_key("n") {
        problems.push((
            "dataset.sample".to_owned(),
            "--seed picks a sample, so it needs --n-sample (or dataset.sample.n)".to_owned(),
        ));
    }
}

/// Sets the key of `KEY=VALUE` in the document: a dotted path, a list's
/// item named by its index or by its `name`; mappings on the way are made
/// when absent. The value is JSON when it reads as JSON, else text.
fn set_key(value: &mut Value, set: &str) -> Result<(), String> {
    let Some((key, text)) = set.split_once('=') else {
        return Err("give KEY=VALUE".to_owned());
    };
    let parts: Vec<&str> = key.trim().split('.').collect();
    if parts.iter().any(|p| p.is_empty()) {
        return Err(format!("'{key}' is not a dotted path of keys"));
    }
    let given = serde_json::from_str::<Value>(text.trim())
        .unwrap_or_else(|_| Value::String(text.to_owned()));
    let mut at = value;
    for (i, part) in parts.iter().enumerate() {
        let last = i + 1 == parts.len();
        let done = &parts[..i];
        at = match at {
            Value::Object(map) => {
                if last {
                    map.insert((*part).to_owned(), given);
                    return Ok(());
                }
                map.entry((*part).to_owned())
                    .or_insert_with(|| Value::Object(serde_json::Map::new()))
            }
            Value::Array(items) => {
                let index = match part.parse::<usize>() {
                    Ok(index) if index < items.len() => index,
                    _ => items
                        .iter()
                        .position(|item| item.get("name").and_then(Value::as_str) == Some(part))
                        .ok_or_else(|| {
                            format!(
                                "{} has no item '{part}' (give its index, 0 to {}, or its name)",
                                done.join("."),
                                items.len().saturating_sub(1)
                            )
                        })?,
                };
                if last {
                    items[index] = given;
                    return Ok(());
                }
                &mut items[index]
            }
            _ => {
                return Err(format!(
                    "{} is not a mapping or a list, so it has no key '{part}'",
                    done.join(".")
                ));
            }
        };
    }
    Ok(())
}

/// The document with every literal secret replaced by [`MASK`]; references to
/// variables (`${KEY}`) are kept, since they hold no secret.
fn masked(value: &Value) -> Value {
    let mut out = value.clone();
    let mask = |v: &mut Value| {
        if let Value::String(s) = v
            && !env::has_reference(s)
        {
            *s = MASK.to_owned();
        }
    };
    if let Some(endpoints) = out.get_mut("endpoints").and_then(Value::as_array_mut) {
        for endpoint in endpoints {
            if let Some(key) = endpoint.get_mut("api_key") {
                mask(key);
            }
            for secrets in ["headers", "env"] {
                if let Some(values) = endpoint.get_mut(secrets).and_then(Value::as_object_mut) {
                    values.values_mut().for_each(mask);
                }
            }
        }
    }
    out
}

fn validate(raw: RawConfig, dir: &Path, problems: &mut Vec<RawProblem>) -> Option<Config> {
    let mut p = Problems(problems);
    let name = match raw.name {
        Some(name) if !name.trim().is_empty() => Some(name),
        Some(_) => p.push("name", "must not be empty"),
        None => p.push("name", "is required (a name for the run)"),
    };
    let dataset = match &raw.dataset {
        Some(value) => {
            read::section::<RawDataset>(value, "dataset", p.0).and_then(|d| dataset(d, dir, &mut p))
        }
        // A conversation's episodes may be made up (`sessions`).
        None if raw.task.as_ref().is_some_and(|t| {
            t.get("kind").and_then(Value::as_str) == Some("conversation")
                || t.get("conversation").is_some()
        }) =>
        {
            Some(DatasetConfig {
                path: std::path::PathBuf::new(),
                format: DatasetFormat::Jsonl,
                split: None,
                id_field: Some("episode".to_owned()),
                sample: None,
                limit: None,
                skip_invalid: false,
                episodes: Some(0),
                sheet: None,
                roots: None,
            })
        }
        None => p.push(
            "dataset",
            "is required (dataset.path names the items' file)",
        ),
    };
    let endpoints = match &raw.endpoints {
        Some(Value::Array(items)) if !items.is_empty() => endpoint::endpoints(items, dir, &mut p),
        Some(Value::Array(_)) => p.push("endpoints", "must list at least one endpoint"),
        Some(_) => p.push("endpoints", "must be a list of endpoints"),
        None => p.push("endpoints", "is required (at least one endpoint)"),
    };
    let task = match &raw.task {
        Some(value) => read::section::<RawTask>(value, "task", p.0)
            .and_then(|t| task(t, dir, endpoints.as_deref(), &mut p)),
        None => p.push("task", "is required (task.messages says what to send)"),
    };
    let retry = match &raw.retry {
        Some(value) => {
            read::section::<RawRetry>(value, "retry", p.0).and_then(|r| retry(r, &mut p))
        }
        None => retry(RawRetry::default(), &mut p),
    };
    let timeouts = match &raw.timeouts {
        Some(value) => {
            read::section::<RawTimeouts>(value, "timeouts", p.0).and_then(|t| timeouts(t, &mut p))
        }
        None => timeouts(RawTimeouts::default(), &mut p),
    };
    let writer = match &raw.writer {
        Some(value) => {
            read::section::<RawWriter>(value, "writer", p.0).and_then(|w| writer(w, &mut p))
        }
        None => writer(RawWriter::default(), &mut p),
    };
    let cache = match &raw.cache {
        Some(value) => {
            read::section::<raw::RawCache>(value, "cache", p.0).and_then(|c| cache(c, &mut p))
        }
        None => Some(crate::cache::CacheSettings::default()),
    };
    let report = match &raw.report {
        Some(value) => read::section::<raw::RawReport>(value, "report", p.0).and_then(|r| {
            let by = match r.by {
                None => Some(None),
                Some(raw::OneOrMany::One(field)) => Some(Some(vec![field])),
                Some(raw::OneOrMany::Many(fields)) => Some(Some(fields)),
            };
            let by = match by {
                Some(Some(fields)) if fields.iter().any(|f| f.trim().is_empty()) => {
                    p.push("report.by", "must name item fields (none may be empty)")
                }
                other => other,
            };
            let max_unscored = match r.max_unscored {
                None => Some(1.0),
                Some(share) if (0.0..=1.0).contains(&share) => Some(share),
                Some(share) => p.push(
                    "report.max_unscored",
                    format!("must be a share between 0 and 1, got {share}"),
                ),
            };
            Some(super::ReportSettings {
                max_unscored: max_unscored?,
                by: by?,
            })
        }),
        None => Some(super::ReportSettings::default()),
    };
    let telemetry = match &raw.telemetry {
        Some(value) => read::section::<super::telemetry::RawTelemetry>(value, "telemetry", p.0)
            .and_then(|t| super::telemetry::telemetry(t, &mut p)),
        None => Some(super::TelemetrySettings::default()),
    };
    let shutdown_grace = p.duration("shutdown_grace", raw.shutdown_grace.as_deref(), "30s");
    let store = match raw.store {
        Some(s) if s.trim().is_empty() => p.push("store", "must not be empty"),
        other => Some(other.map(Into::into)),
    };
    if let Some(endpoints) = &endpoints {
        if endpoints.iter().all(|e| !e.takes_items()) {
            return p.push(
                "endpoints",
                "must hold at least one endpoint that answers items (not role: judge)",
            );
        }
        if let Some(task) = &task {
            for (i, m) in task.eval.metrics.iter().enumerate() {
                if let evalfleet_eval::metrics::Kind::LlmJudge { endpoint, .. } = &m.metric.kind {
                    match endpoints.iter().find(|e| &e.name == endpoint) {
                        Some(e) if !e.takes_items() => {}
                        Some(_) => {
                            return p.push(
                                &format!("task.metrics[{i}].endpoint"),
                                format!("endpoint '{endpoint}' answers items; give it role: judge to use it as a judge"),
                            );
                        }
                        None => {
                            return p.push(
                                &format!("task.metrics[{i}].endpoint"),
                                format!("no endpoint is named '{endpoint}'"),
                            );
                        }
                    }
                }
            }
        }
    }
    if let (Some(endpoints), Some(cache)) = (&endpoints, &cache)
        && cache.mode != crate::cache::CacheMode::Off
        && let Some(first) = endpoints.iter().find(|e| e.takes_items())
        && let Some(other) = endpoints
            .iter()
            .filter(|e| e.takes_items())
            .find(|e| e.model != first.model || e.params != first.params)
    {
        return p.push(
            "cache",
            format!(
                "endpoints {} and {} send different requests (model or params), so a cached answer would stand for either; give them the same model and params, or set cache.mode: off",
                first.name, other.name
            ),
        );
    }
    let mut dataset = dataset;
    if let (Some(task), Some(dataset)) = (&task, &mut dataset)
        && let Some(settings) = task.kind.conversation()
    {
        if dataset.episodes.is_some() {
            dataset.episodes = Some(settings.sessions);
            dataset.path = super::conversation::episodes_path(settings.sessions);
        }
        if let Some(endpoints) = &endpoints {
            for (at, name) in settings.named_endpoints() {
                let at = format!("task.conversation.{at}");
                match endpoints.iter().find(|e| e.name == name) {
                    Some(e) if !e.takes_items() => {}
                    Some(_) => {
                        return p.push(
                            &at,
                            format!("endpoint '{name}' answers items; give it role: judge to have it answer only the calls addressed to it"),
                        );
                    }
                    None => return p.push(&at, format!("no endpoint is named '{name}'")),
                }
            }
        }
    }
    Some(Config {
        name: name?,
        dataset: dataset?,
        endpoints: endpoints?,
        task: task?,
        retry: retry?.0,
        retry_budget: retry?.1,
        judge_retry_for: retry?.2,
        timeouts: timeouts?,
        writer: writer?,
        cache: cache?,
        report: report?,
        shutdown_grace: shutdown_grace?,
        store: store?,
        telemetry: telemetry?,
    })
}

fn cache(raw: raw::RawCache, p: &mut Problems<'_>) -> Option<crate::cache::CacheSettings> {
    use crate::cache::{CacheMode, CacheSettings};
    let mode = match raw.mode.as_deref() {
        None => Some(CacheMode::ReadWrite),
        Some(text) => CacheMode::parse(text).or_else(|| {
            p.push(
                "cache.mode",
                format!("must be read_write, read, write or off, got '{text}'"),
            )
        }),
    };
    let ttl = match raw.ttl {
        None => Some(None),
        Some(text) => p.duration("cache.ttl", Some(&text), "0s").map(Some),
    };
    let max_entries = match raw.max_entries {
        Some(0) => p.push("cache.max_entries", "must be at least 1, got 0"),
        other => Some(other),
    };
    let path = match raw.path {
        Some(p2) if p2.trim().is_empty() => p.push("cache.path", "must not be empty"),
        other => Some(other.map(Into::into)),
    };
    Some(CacheSettings {
        path: path?,
        mode: mode?,
        ttl: ttl?,
        max_entries: max_entries?,
    })
}

fn retry(
    raw: RawRetry,
    p: &mut Problems<'_>,
) -> Option<(RetryPolicy, BudgetSettings, std::time::Duration)> {
    let defaults = BudgetSettings::default();
    let share = match raw.budget {
        Some(share) if !share.is_finite() || share < 0.0 => p.push(
            "retry.budget",
            format!("must be a share of first tries, 0 or more (0.5 lets half as many retries), got {share}"),
        ),
        other => Some(other.unwrap_or(defaults.share)),
    };
    let floor = match raw.budget_floor {
        Some(floor) if !floor.is_finite() || floor < 0.0 => p.push(
            "retry.budget_floor",
            format!("must be retries per second, 0 or more, got {floor}"),
        ),
        other => Some(other.unwrap_or(defaults.floor)),
    };
    let max_attempts = match raw.max_attempts {
        Some(0) => p.push("retry.max_attempts", "must be at least 1, got 0"),
        other => Some(other.unwrap_or(10)),
    };
    let backoff_base = p.duration("retry.backoff_base", raw.backoff_base.as_deref(), "100ms");
    let backoff_max = p.duration("retry.backoff_max", raw.backoff_max.as_deref(), "30s");
    let judge_for = p.duration("retry.judge_for", raw.judge_for.as_deref(), "2m");
    if let (Some(base), Some(max)) = (backoff_base, backoff_max)
        && max < base
    {
        return p.push(
            "retry.backoff_max",
            format!(
                "must not be shorter than retry.backoff_base ({} < {})",
                humantime::format_duration(max),
                humantime::format_duration(base)
            ),
        );
    }
    Some((
        RetryPolicy {
            max_attempts: max_attempts?,
            backoff_base: backoff_base?,
            backoff_max: backoff_max?,
        },
        BudgetSettings {
            share: share?,
            floor: floor?,
        },
        judge_for?,
    ))
}

fn timeouts(raw: RawTimeouts, p: &mut Problems<'_>) -> Option<Timeouts> {
    let attempt = p.duration("timeouts.attempt", raw.attempt.as_deref(), "300s");
    let item = p.duration("timeouts.item", raw.item.as_deref(), "1h");
    let no_endpoint = p.duration("timeouts.no_endpoint", raw.no_endpoint.as_deref(), "10m");
    let first_answer = p.duration("timeouts.first_answer", raw.first_answer.as_deref(), "30s");
    let lease = match p.duration("timeouts.lease", raw.lease.as_deref(), "30s") {
        Some(lease) if lease < std::time::Duration::from_millis(300) => {
            return p.push(
                "timeouts.lease",
                format!(
                    "must be at least 300ms (a worker renews it a third of the way), got {}",
                    humantime::format_duration(lease)
                ),
            );
        }
        other => other,
    };
    let first_byte = p.duration("timeouts.first_byte", raw.first_byte.as_deref(), "120s");
    let stream_idle = p.duration("timeouts.stream_idle", raw.stream_idle.as_deref(), "30s");
    let mut zero = |name: &str, value: Option<std::time::Duration>| match value {
        Some(d) if d.is_zero() => p.push(name, "must be more than 0"),
        other => other,
    };
    let first_byte = zero("timeouts.first_byte", first_byte);
    let stream_idle = zero("timeouts.stream_idle", stream_idle);
    Some(Timeouts {
        attempt: attempt?,
        item: item?,
        no_endpoint: no_endpoint?,
        first_answer: first_answer?,
        lease: lease?,
        first_byte: first_byte?,
        stream_idle: stream_idle?,
    })
}

fn writer(raw: RawWriter, p: &mut Problems<'_>) -> Option<WriterSettings> {
    let batch_size = match raw.batch_size {
        Some(0) => p.push("writer.batch_size", "must be at least 1, got 0"),
        Some(n) if n > 100_000 => p.push(
            "writer.batch_size",
            format!("must be at most 100000, got {n}"),
        ),
        other => Some(other.unwrap_or(512)),
    };
    let flush_interval = p.duration(
        "writer.flush_interval",
        raw.flush_interval.as_deref(),
        "200ms",
    );
    Some(WriterSettings {
        batch_size: batch_size?,
        flush_interval: flush_interval?,
    })
}
