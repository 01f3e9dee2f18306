//! Raw sections to a validated [`Config`], collecting every problem.

use std::collections::HashSet;
use std::path::Path;

use serde_json::{Map, Value, json};

use super::env::{self, Vars};
use super::problems::{Problems, RawProblem};
use super::raw::{self, RawConfig, RawDataset, RawRetry, RawTask, RawTimeouts, RawWriter};
use super::read;
use super::request::{message_list, params};
use super::{
    Admission, BudgetSettings, Config, ConfigError, DatasetConfig, DatasetFormat, Document,
    LoadedConfig, MASK, Overrides, Problem, RetryPolicy, Sample, TaskConfig, TaskKind, Timeouts,
    WriterSettings, endpoint,
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
    if let (Some(config), Some(admission)) = (&mut config, admission) {
        config.task.images.roots = Some(admission.roots.clone());
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
                skip_invalid: false,
                episodes: Some(0),
                sheet: None,
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
        timeouts: timeouts?,
        writer: writer?,
        cache: cache?,
        report: report?,
        shutdown_grace: shutdown_grace?,
        store: store?,
        telemetry: telemetry?,
    })
}

fn code(value: &Value, p: &mut Problems<'_>) -> Option<evalfleet_sandbox::CodeSettings> {
    use evalfleet_sandbox::sandbox::Limits;
    use evalfleet_sandbox::{Backend, CodeSettings, Format, Language};
    let raw = read::section::<raw::RawCode>(value, "task.code", p.0)?;
    let format = match raw.format.as_deref() {
        None => p.push("task.code.format", "is required: humaneval, mbpp or stdio"),
        Some(f) => Format::parse(f).or_else(|| {
            p.push(
                "task.code.format",
                format!("must be humaneval, mbpp or stdio, got '{f}'"),
            )
        }),
    };
    let language = match raw.language.as_deref() {
        None => Some(Language::Python),
        Some(text) => Language::parse(text).or_else(|| {
            p.push(
                "task.code.language",
                format!("must be python, cpp or rust, got '{text}'"),
            )
        }),
    };
    if let (Some(language), Some(format)) = (language, format)
        && language != Language::Python
        && format != Format::Stdio
    {
        p.push::<()>(
            "task.code.language",
            format!(
                "{} programs are judged on stdin/stdout tests (format: stdio); humaneval and mbpp tests are Python",
                language.as_str()
            ),
        );
    }
    let tool = match (language, raw.python, raw.compiler) {
        (_, Some(_), Some(_)) => p.push("task.code", "give python or compiler, not both"),
        (Some(Language::Python), None, Some(_)) => p.push(
            "task.code.compiler",
            "python is interpreted: give the interpreter as python",
        ),
        (Some(l), Some(_), None) if l != Language::Python => p.push(
            "task.code.python",
            format!("{} is compiled: give the compiler as compiler", l.as_str()),
        ),
        (_, python, compiler) => Some(python.or(compiler)),
    };
    let cpu = p.duration("task.code.timeout", raw.timeout.as_deref(), "10s");
    let wall = match (&raw.wall_timeout, cpu) {
        (Some(text), _) => p.duration("task.code.wall_timeout", Some(text), "30s"),
        (None, Some(cpu)) => Some(cpu * 3),
        (None, None) => None,
    };
    let compile_timeout = p.duration(
        "task.code.compile_timeout",
        raw.compile_timeout.as_deref(),
        "30s",
    );
    let backend = match (raw.backend.as_deref(), raw.sandbox_url) {
        (None | Some("local"), None) => Some(Backend::Local),
        (None | Some("local"), Some(_)) => p.push(
            "task.code.sandbox_url",
            "is for backend: sandboxfusion (the backend is local)",
        ),
        (Some("sandboxfusion"), Some(url)) => match reqwest::Url::parse(&url) {
            Ok(u) if matches!(u.scheme(), "http" | "https") => Some(Backend::SandboxFusion {
                url,
                retries: raw.sandbox_retries.unwrap_or(3),
            }),
            _ => p.push(
                "task.code.sandbox_url",
                format!("must be an http(s) URL like http://host:8080, got '{url}'"),
            ),
        },
        (Some("sandboxfusion"), None) => p.push(
            "task.code.sandbox_url",
            "is required with backend: sandboxfusion (the server's address, like http://host:8080)",
        ),
        (Some(other), _) => p.push(
            "task.code.backend",
            format!("must be local or sandboxfusion, got '{other}'"),
        ),
    };
    let cores = std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get);
    let concurrency = match (raw.judge_concurrency, &backend) {
        (Some(0), _) => p.push("task.code.judge_concurrency", "must be at least 1, got 0"),
        (Some(n), _) => Some(n),
        // A remote sandbox has cores of its own.
        (None, Some(Backend::SandboxFusion { .. })) => Some(32),
        (None, _) => Some(cores),
    };
    let float_tolerance = match raw.float_tolerance {
        Some(t) if t.is_nan() || t < 0.0 => p.push(
            "task.code.float_tolerance",
            format!("must be 0 or more, got {t}"),
        ),
        other => Some(other),
    };
    let stdio_fields = match raw.tests_field {
        None => Some(vec!["tests".to_owned()]),
        Some(raw::OneOrMany::One(field)) => Some(vec![field]),
        Some(raw::OneOrMany::Many(fields)) if fields.is_empty() => {
            p.push("task.code.tests_field", "must name at least one field")
        }
        Some(raw::OneOrMany::Many(fields)) => Some(fields),
    };
    let defaults = Limits::default();
    Some(CodeSettings {
        format: format?,
        language: language?,
        tool: tool?,
        limits: Limits {
            wall: wall?,
            cpu: cpu?,
            memory_mb: raw.memory_mb.unwrap_or(defaults.memory_mb),
            output_bytes: raw.output_bytes.unwrap_or(defaults.output_bytes),
            ..defaults
        },
        compile_timeout: compile_timeout?,
        early_exit: raw.early_exit.unwrap_or(false),
        concurrency: concurrency?,
        float_tolerance: float_tolerance?,
        stdio_fields: stdio_fields?,
        backend: backend?,
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

fn dataset(mut raw: RawDataset, dir: &Path, p: &mut Problems<'_>) -> Option<DatasetConfig> {
    if let Some(sheet) = raw.sheet.take() {
        return sheet_dataset(sheet, raw, p);
    }
    let path = match raw.path.as_deref() {
        None => p.push("dataset.path", "is required"),
        Some(s) if s.trim().is_empty() => p.push("dataset.path", "must not be empty"),
        Some(s) => {
            let resolved = dir.join(s);
            if resolved.is_file() {
                Some(resolved)
            } else if resolved.is_dir() && matches!(raw.format.as_deref(), None | Some("parquet")) {
                // A folder of Parquet shards; which ones is the dataset
                // reader's business.
                Some(resolved)
            } else if resolved.is_dir() {
                p.push(
                    "dataset.path",
                    format!(
                        "{} is a folder: only a Parquet dataset may be a folder of shards",
                        resolved.display()
                    ),
                )
            } else {
                p.push(
                    "dataset.path",
                    format!("no such file: {}", resolved.display()),
                )
            }
        }
    };
    let format = match raw.format.as_deref() {
        Some("jsonl") => Some(DatasetFormat::Jsonl),
        Some("csv") => Some(DatasetFormat::Csv),
        Some("parquet") => Some(DatasetFormat::Parquet),
        Some(other) => p.push(
            "dataset.format",
            format!("must be 'jsonl', 'csv' or 'parquet', got '{other}'"),
        ),
        None => match raw
            .path
            .as_deref()
            .and_then(|s| Path::new(s).extension())
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase)
            .as_deref()
        {
            Some("jsonl" | "ndjson") => Some(DatasetFormat::Jsonl),
            Some("csv") => Some(DatasetFormat::Csv),
            Some("parquet") => Some(DatasetFormat::Parquet),
            _ if raw.path.is_none() => None,
            _ if path.as_ref().is_some_and(|p| p.is_dir()) => Some(DatasetFormat::Parquet),
            _ => p.push(
                "dataset.format",
                "cannot tell the format from the file's extension; set format: jsonl, csv or parquet",
            ),
        },
    };
    let id_field = match raw.id_field {
        Some(f) if f.is_empty() => p.push("dataset.id_field", "must not be empty"),
        other => Some(other),
    };
    let sample = sample(raw.sample, p);
    let split = match raw.split {
        Some(s) if s.trim().is_empty() => p.push("dataset.split", "must not be empty"),
        Some(s) if path.as_ref().is_some_and(|p| p.is_file()) => p.push(
            "dataset.split",
            format!(
                "only a folder of Parquet shards has splits; dataset.path is a file, so leave out split: {s}"
            ),
        ),
        other => Some(other),
    };
    Some(DatasetConfig {
        path: path?,
        format: format?,
        split: split?,
        id_field: id_field?,
        sample: sample?,
        skip_invalid: raw.skip_invalid.unwrap_or(false),
        episodes: None,
        sheet: None,
    })
}

/// `dataset.sample`, validated.
fn sample(raw: Option<super::raw::RawSample>, p: &mut Problems<'_>) -> Option<Option<Sample>> {
    match raw {
        Some(s) => match s.n {
            Some(0) => p.push("dataset.sample.n", "must be at least 1, got 0"),
            Some(n) => Some(Some(Sample {
                n,
                seed: s.seed.unwrap_or(0),
            })),
            None => p.push("dataset.sample.n", "is required in a sample"),
        },
        None => Some(None),
    }
}

/// A dataset read from a Google Sheet: its rows are kept in a JSONL file
/// of their own, named after what is read, with each item's id (its row,
/// and block) in `_id`.
fn sheet_dataset(
    sheet: super::sheets::RawSheet,
    raw: RawDataset,
    p: &mut Problems<'_>,
) -> Option<DatasetConfig> {
    let mut clash = false;
    for (key, set) in [
        ("path", raw.path.is_some()),
        ("format", raw.format.is_some()),
        ("split", raw.split.is_some()),
        ("id_field", raw.id_field.is_some()),
    ] {
        if set {
            clash = true;
            p.push::<()>(
                &format!("dataset.{key}"),
                "a dataset read from a sheet (dataset.sheet) has no file of its own: leave it out",
            );
        }
    }
    let sample = sample(raw.sample, p);
    let sheet = super::sheets::sheet(sheet, p)?;
    if clash {
        return None;
    }
    Some(DatasetConfig {
        path: super::sheets::unread_path(),
        format: DatasetFormat::Jsonl,
        split: None,
        id_field: Some(super::sheets::ID_FIELD.to_owned()),
        sample: sample?,
        skip_invalid: raw.skip_invalid.unwrap_or(false),
        episodes: None,
        sheet: Some(sheet),
    })
}

fn task(
    mut raw: RawTask,
    dir: &Path,
    endpoints: Option<&[endpoint::EndpointConfig]>,
    p: &mut Problems<'_>,
) -> Option<TaskConfig> {
    let conversation = raw.kind.as_deref() == Some("conversation") || raw.conversation.is_some();
    let exec_raw = super::exec::RawExec {
        command: raw.command.take(),
        input: raw.input.take(),
        timeout: raw.timeout.take(),
        concurrency: raw.concurrency.take(),
        network: raw.network.take(),
        env: raw.env.take(),
        budget: raw.budget.take(),
        models: raw.models.take(),
    };
    let exec = raw.kind.as_deref() == Some("exec") || exec_raw.command.is_some();
    let has_messages = raw.messages.is_some();
    let has_prompts = raw.prompts.is_some();
    let prompts = match raw.prompts.take() {
        None => Some(Vec::new()),
        Some(_) if conversation => p.push(
            "task.prompts",
            "is not for a conversation (its calls have messages of their own)",
        ),
        Some(rules) => super::prompts::prompts(rules, endpoints, has_messages, p),
    };
    let messages = match raw.messages.take() {
        // Without a rule that takes every item, `prompts` says so.
        None if conversation || exec || has_prompts => Some(Vec::new()),
        Some(_) if exec => p.push(
            "task.messages",
            "is not for kind: exec (the program makes its own calls)",
        ),
        None => p.push("task.messages", "is required (the chat messages to send)"),
        Some(list) => message_list(list, "task.messages", p),
    };
    let images = super::images::settings(raw.images.take(), p);
    let params = params(raw.params.take(), "task.params", p);
    let eval = super::eval::eval(&mut raw, dir, p);
    let mut params = params?;
    let mut eval = eval?;
    // A code task is scored by its judge: `code_accepted` is always there.
    if (raw.code.is_some() || raw.kind.as_deref() == Some("code"))
        && !eval
            .metrics
            .iter()
            .any(|m| matches!(m.metric.kind, evalfleet_eval::metrics::Kind::CodeAccepted))
        && let Ok(metric) = evalfleet_eval::Metric::build("code_accepted", &Map::new(), None)
    {
        eval.metrics.push(evalfleet_eval::MetricSpec {
            metric,
            reference: None,
        });
    }
    // A conversation's episodes are scored by their rewards and decisions.
    if raw.kind.as_deref() == Some("conversation") || raw.conversation.is_some() {
        for (key, name) in evalfleet_eval::balance::EPISODE_SCORES {
            if !eval.metrics.iter().any(|m| m.metric.key == key)
                && let Ok(metric) =
                    evalfleet_eval::Metric::build(name, &Map::new(), Some(key.to_owned()))
            {
                eval.metrics.push(evalfleet_eval::MetricSpec {
                    metric,
                    reference: None,
                });
            }
        }
    }
    if eval.structured_output
        && let Some(schema) = &eval.schema
    {
        if params.contains_key("response_format") {
            return p.push(
                "task.structured_output",
                "cannot be used with task.params.response_format (it sets that itself)",
            );
        }
        params.insert(
            "response_format".to_owned(),
            json!({"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": true}}),
        );
    }
    let samples = match raw.n {
        None => 1,
        Some(n) if (1..=10_000).contains(&n) => n,
        Some(n) => return p.push("task.n", format!("must be between 1 and 10000, got {n}")),
    };
    let mut reasks_ok = true;
    if exec && eval.max_reasks > 0 {
        if raw.max_reasks.is_some_and(|n| n > 0) {
            reasks_ok = p
                .push::<()>(
                    "task.max_reasks",
                    "is not for kind: exec (its program's answer cannot be asked for again; a failed run is retried as `retry` says)",
                )
                .is_some();
        }
        eval.max_reasks = 0;
    }
    let kind = task_kind(
        raw.kind.as_deref(),
        Kinds {
            code: raw.code,
            refine: raw.refine,
            conversation: raw.conversation,
            exec: exec_raw,
        },
        dir,
        p,
    )?;
    if !reasks_ok {
        return None;
    }
    Some(TaskConfig {
        kind,
        messages: messages?,
        prompts: prompts?,
        images: images?,
        params,
        stream: raw.stream.unwrap_or(false),
        samples,
        eval,
    })
}

/// The settings of each kind of task, as given.
struct Kinds {
    code: Option<Value>,
    refine: Option<Value>,
    conversation: Option<Value>,
    exec: super::exec::RawExec,
}

/// `task.kind` with the settings of its kind (`task.code`, `task.refine`).
fn task_kind(
    kind: Option<&str>,
    kinds: Kinds,
    dir: &Path,
    p: &mut Problems<'_>,
) -> Option<TaskKind> {
    const KINDS: &str = "chat, code, refine, conversation or exec";
    let Kinds {
        code,
        refine,
        conversation,
        exec,
    } = kinds;
    let kind = match kind {
        Some(kind) => kind,
        None if code.is_some() => "code",
        None if refine.is_some() => "refine",
        None if conversation.is_some() => "conversation",
        None if exec.command.is_some() => "exec",
        None => "chat",
    };
    if kind != "exec" {
        for key in exec.given() {
            p.push::<()>(
                &format!("task.{key}"),
                format!("belongs to kind: exec, not kind: {kind}"),
            );
        }
    }
    let misplaced = |key: &str, p: &mut Problems<'_>| {
        p.push::<()>(
            &format!("task.{key}"),
            format!("belongs to kind: {key}, not kind: {kind}"),
        )
    };
    if kind != "code" && code.is_some() {
        misplaced("code", p);
    }
    if kind != "refine" && refine.is_some() {
        misplaced("refine", p);
    }
    if kind != "conversation" && conversation.is_some() {
        misplaced("conversation", p);
    }
    match kind {
        "chat" => Some(TaskKind::Chat),
        "code" => match code {
            Some(value) => Some(TaskKind::Code(self::code(&value, p)?)),
            None => p.push(
                "task.code",
                "is required with kind: code (how answers are judged as programs)",
            ),
        },
        "refine" => {
            let raw = match &refine {
                Some(value) => read::section::<raw::RawRefine>(value, "task.refine", p.0)?,
                None => raw::RawRefine::default(),
            };
            let prompt = raw
                .prompt
                .unwrap_or_else(|| super::REFINE_PROMPT.to_owned());
            if let Err(err) = evalfleet_jinja::check(&evalfleet_jinja::environment(), &prompt) {
                return p.push("task.refine.prompt", err);
            }
            let rounds = match raw.rounds {
                None => 1,
                Some(n) if (1..=20).contains(&n) => n,
                Some(n) => {
                    return p.push(
                        "task.refine.rounds",
                        format!("must be between 1 and 20, got {n}"),
                    );
                }
            };
            Some(TaskKind::Refine(super::RefineSettings { prompt, rounds }))
        }
        "conversation" => super::conversation::conversation(conversation.as_ref(), p)
            .map(|settings| TaskKind::Conversation(Box::new(settings))),
        "exec" => {
            super::exec::exec(exec, dir, p).map(|settings| TaskKind::Exec(Box::new(settings)))
        }
        other => p.push("task.kind", format!("must be {KINDS}, got '{other}'")),
    }
}

fn retry(raw: RawRetry, p: &mut Problems<'_>) -> Option<(RetryPolicy, BudgetSettings)> {
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
