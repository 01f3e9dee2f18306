//! What can be known about a task before its first call: every template
//! (messages, metric references, LLM-judge rubrics, the refine prompt) is
//! rendered for the first rows of the dataset (and their images read), and
//! each metric checks that
//! it can use the references it gets. A problem is reported as the
//! config's own problems are, with its line, before anything is stored.
//!
//! The static checks (syntax, unknown filters, tests and functions) are
//! the config's: `config::validate`.

use serde_json::Value;

use evalfleet_config::{LoadedConfig, TaskKind};
use evalfleet_eval::{Assessor, Checked};
use evalfleet_io::dataset::{Row, RowReader, Scanner};
use evalfleet_io::template::{RenderedPart, Templates};

/// The longest the renders of the first rows may take together: the rows
/// not reached by then are not checked beforehand.
const CHECK_TIME: std::time::Duration = std::time::Duration::from_secs(2);

/// Rows of the dataset every template is rendered for.
pub const ROWS: usize = 10;

/// Renders every template of `loaded`'s task for the first [`ROWS`] rows of
/// its dataset, and checks that each metric can use its references. A
/// dataset that cannot be read is left to the run's registration, which
/// says why.
pub fn check(
    loaded: &LoadedConfig,
    templates: &Templates,
) -> Result<(), evalfleet_config::ConfigError> {
    let config = &loaded.config;
    let Ok(rows) = first_rows(config) else {
        return Ok(());
    };
    let assessor = Assessor::new(&config.task.eval).ok();
    // A prompt that does not compile is reported with the config's problems.
    let refine = match &config.task.kind {
        TaskKind::Refine(settings) => {
            evalfleet_jinja::AnswerTemplate::new("task.refine.prompt", &settings.prompt).ok()
        }
        _ => None,
    };
    let file = config.dataset.path.file_name().map_or_else(
        || config.dataset.path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let mut problems: Vec<(String, String)> = Vec::new();
    let mut report = |path: &str, index: usize, line: u64, what: &str| {
        if problems.iter().any(|(p, _)| p == path) {
            return;
        }
        problems.push((
            path.to_owned(),
            format!(
                "{path}: for row {} (line {line} of {file}): {what}",
                index + 1
            ),
        ));
    };
    let base = config
        .dataset
        .path
        .parent()
        .unwrap_or(std::path::Path::new(""));
    let started = std::time::Instant::now();
    for (index, (line, row)) in rows.iter().enumerate() {
        // Each render is bounded (evalfleet_jinja::FUEL); all of them
        // together too, so that a config sent to a server is answered
        // soon whatever its templates do: the rows left are checked as
        // they are answered.
        if index > 0 && started.elapsed() > CHECK_TIME {
            break;
        }
        match templates.render_parts(row) {
            Err(err) => {
                // The messages of the rule of task.prompts chosen, or task.messages.
                let prefix = if err.starts_with("task.prompts") {
                    "task.prompts"
                } else {
                    "task.messages"
                };
                let (path, what) = split(&err, prefix);
                report(path, index, *line, what);
            }
            // Each image is read as it would be sent (URLs are not fetched).
            Ok(messages) => {
                for part in messages.iter().flat_map(|m| &m.parts) {
                    let RenderedPart::Images { at, values } = part else {
                        continue;
                    };
                    for value in values {
                        if let Err(err) =
                            evalfleet_io::images::load(value, None, base, &config.task.images)
                        {
                            report(at, index, *line, &err.to_string());
                        }
                    }
                }
            }
        }
        let Some(assessor) = &assessor else {
            continue;
        };
        for (i, spec) in config.task.eval.metrics.iter().enumerate() {
            let path = format!("task.metrics[{i}].reference");
            match assessor.references(i, row) {
                Err(err) => report(&path, index, *line, split(&err, &path).1),
                Ok(references) if spec.reference.is_some() && spec.metric.needs_reference() => {
                    let reasons: Vec<String> = references
                        .iter()
                        .filter_map(|r| spec.metric.unusable(r))
                        .collect();
                    if reasons.len() == references.len()
                        && let Some(reason) = reasons.first()
                    {
                        report(
                            &path,
                            index,
                            *line,
                            &format!("{} cannot use it: {reason}", spec.metric.name),
                        );
                    }
                }
                Ok(_) => {}
            }
        }
        let answer = Checked {
            parsed: Some(Value::String(String::new())),
            valid: true,
            error: None,
        };
        for call in assessor.llm_judge_calls(&answer, row) {
            if let Err(err) = call.messages {
                let (path, what) = split(&err, "task.metrics");
                report(path, index, *line, what);
            }
        }
        if let Some(prompt) = &refine
            && let Err(err) = prompt.render(row, "")
        {
            report("task.refine.prompt", index, *line, &err);
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(loaded.problems(problems))
    }
}

/// A row's line, and the request it would send (or why it cannot).
pub type DryRequest = (u64, Result<Value, String>);

/// The requests the first `n` usable rows of `loaded`'s dataset would
/// send (`run --dry-run`), as JSON in OpenAI's form: the model of the first
/// endpoint that takes items, the messages (an image as the value the row
/// gives, not read), the task's parameters, and the rule of `task.prompts`
/// chosen, with the row's line. A row whose templates cannot be rendered
/// gives its reason instead.
pub fn first_requests(
    loaded: &LoadedConfig,
    templates: &Templates,
    n: usize,
) -> Result<Vec<DryRequest>, evalfleet_io::dataset::DatasetError> {
    let config = &loaded.config;
    let model = config
        .endpoints
        .iter()
        .find(|e| e.takes_items())
        .map(|e| e.model.clone())
        .unwrap_or_default();
    let rows = first_rows(config)?;
    let n = config
        .dataset
        .limit
        .map_or(n, |limit| n.min(usize::try_from(limit).unwrap_or(n)));
    Ok(rows
        .iter()
        .take(n)
        .map(|(line, row)| {
            let request = templates.render_parts_prompt(row).map(|(prompt, messages)| {
                let messages: Vec<Value> = messages
                    .iter()
                    .map(|m| {
                        let parts: Vec<Value> = m
                            .parts
                            .iter()
                            .flat_map(|part| match part {
                                RenderedPart::Text(text) => {
                                    vec![serde_json::json!({"type": "text", "text": text})]
                                }
                                RenderedPart::Images { values, .. } => values
                                    .iter()
                                    .map(|v| {
                                        serde_json::json!({"type": "image_url", "image_url": {"url": v}})
                                    })
                                    .collect(),
                            })
                            .collect();
                        let content = match (m.as_parts, parts.as_slice()) {
                            (false, [one]) => one["text"].clone(),
                            _ => Value::Array(parts),
                        };
                        serde_json::json!({"role": m.role, "content": content})
                    })
                    .collect();
                let mut body = serde_json::Map::new();
                body.insert("model".to_owned(), Value::String(model.clone()));
                body.insert("messages".to_owned(), Value::Array(messages));
                for (key, value) in &config.task.params {
                    body.insert(key.clone(), value.clone());
                }
                let mut shown = serde_json::json!({"request": body});
                if let Some(prompt) = prompt {
                    shown["prompt"] = Value::String(prompt.to_string());
                }
                shown
            });
            (*line, request)
        })
        .collect())
}

/// The first [`ROWS`] usable rows, each with its line.
fn first_rows(
    config: &evalfleet_config::Config,
) -> Result<Vec<(u64, Row)>, evalfleet_io::dataset::DatasetError> {
    let mut scanner = Scanner::open(&config.dataset)?;
    let mut reader = RowReader::open(&config.dataset)?;
    let mut rows = Vec::with_capacity(ROWS);
    while rows.len() < ROWS {
        let Some(scanned) = scanner.next_row()? else {
            break;
        };
        if scanned.invalid.is_some() {
            continue;
        }
        rows.push((
            scanned.line,
            reader.read(scanned.offset, scanned.line, &scanned.id)?,
        ));
    }
    Ok(rows)
}

/// A rendering error `path: what` split at its path (which starts with
/// `prefix`); the whole of it as `what` when it names none.
fn split<'a>(err: &'a str, prefix: &'a str) -> (&'a str, &'a str) {
    match err.split_once(": ") {
        Some((path, what)) if path.starts_with(prefix) => (path, what),
        _ => (prefix, err),
    }
}
