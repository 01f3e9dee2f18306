//! `evalfleet bench`'s config: models × datasets (× a concurrency sweep).
//!
//! Each cell of the matrix is a run config of its own, made from the
//! bench file (the model's endpoint, the dataset's `dataset` and `task`,
//! the model's `params` and `messages` over the task's) and validated by
//! the run config's own rules: every problem is reported once, with the
//! bench file's path and line (`models[1].endpoint.concurrency`), however
//! many cells share it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Map, Value};

use super::problems::RawProblem;
use super::read;
use super::yaml::Document;
use super::{ConfigError, EndpointConfig, LoadedConfig, Overrides, Problem, path, validate};

/// A benchmark matrix (`evalfleet bench CONFIG`): every model of `models`
/// answers every dataset of `datasets` (at every point of `sweep`), one
/// model's engine at a time. Each cell is an ordinary run in the store,
/// with the id `NAME-MODEL-DATASET` (`-cN` added with a sweep). Two cells
/// whose ids would be the same (models `qwen2-vl` and `qwen2` on datasets
/// `docs` and `vl-docs`) are an error naming both; a stored run that holds
/// a cell's id but was made from another config is refused, not reused.
/// Paths are relative to the file; `${VAR}` reads the environment, as in a
/// run's config.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct RawBench {
    /// The matrix's name: letters, digits, `-`, `_` and `.`; each cell's
    /// run id starts with it. Required.
    pub name: Option<String>,
    /// The models compared, in the order their engines are loaded.
    /// Required.
    #[schemars(with = "Option<Vec<RawBenchModel>>")]
    pub models: Option<Value>,
    /// The datasets each model answers, each with its task. Required.
    #[schemars(with = "Option<Vec<RawBenchDataset>>")]
    pub datasets: Option<Value>,
    #[schemars(with = "Option<RawSweep>")]
    pub sweep: Option<Value>,
    /// Item fields the report compares the models by, besides overall
    /// (e.g. `[doc_type]`). Default: none.
    pub group_by: Option<Vec<String>>,
    /// The store every cell's run goes to: a path or `sqlite://PATH`,
    /// relative to the current directory. `--store` comes before it.
    /// Default: `$EVALFLEET_STORE`, else `runs/evalfleet.db`.
    pub store: Option<String>,
    /// `retry` of every cell's run (see the run config). Default: every
    /// key's default.
    #[schemars(with = "Option<super::raw::RawRetry>")]
    pub retry: Option<Value>,
    /// `timeouts` of every cell's run (see the run config). Default: every
    /// key's default.
    #[schemars(with = "Option<super::raw::RawTimeouts>")]
    pub timeouts: Option<Value>,
    /// `writer` of every cell's run (see the run config). Default: every
    /// key's default.
    #[schemars(with = "Option<super::raw::RawWriter>")]
    pub writer: Option<Value>,
    /// `report` of every cell's run (see the run config). Default: every
    /// key's default.
    #[schemars(with = "Option<super::raw::RawReport>")]
    pub report: Option<Value>,
    /// `telemetry` of every cell's run (see the run config); with `gpus:
    /// auto`, a cell samples the GPUs its model's engine was given. Default:
    /// every key's default.
    #[schemars(with = "Option<super::telemetry::RawTelemetry>")]
    pub telemetry: Option<Value>,
    /// `shutdown_grace` of every cell's run (see the run config). Default
    /// `30s`.
    #[schemars(with = "Option<super::schema::Duration>")]
    pub shutdown_grace: Option<String>,
}

/// One model of the matrix: its engine and what it changes of each
/// dataset's task.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct RawBenchModel {
    /// The model's name in the matrix: letters, digits, `-`, `_` and `.`.
    /// Required.
    pub name: Option<String>,
    /// Its endpoint, written as in a run config's `endpoints[]` (`name`
    /// defaults to the model's): `kind: local` or `remote` (an engine
    /// loaded for the model's turn and stopped after it), `external` or
    /// `mock`. Required.
    #[schemars(with = "Option<super::endpoint::RawEndpoint>")]
    pub endpoint: Option<Value>,
    /// Generation parameters for this model, over each task's `params`.
    /// Default: none.
    pub params: Option<Map<String, Value>>,
    /// The messages sent to this model, instead of each task's `messages`.
    /// Default: the task's.
    #[schemars(with = "Option<Vec<super::request::RawMessage>>")]
    pub messages: Option<Value>,
}

/// One dataset of the matrix, with its task.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct RawBenchDataset {
    /// The dataset's name in the matrix: letters, digits, `-`, `_` and
    /// `.`. Required.
    pub name: Option<String>,
    /// Where its items come from, as a run config's `dataset`. Required.
    #[schemars(with = "Option<super::raw::RawDataset>")]
    pub dataset: Option<Value>,
    /// How an item becomes requests and a result, as a run config's
    /// `task`; its first metric is the report's headline. Required.
    #[schemars(with = "Option<super::raw::RawTask>")]
    pub task: Option<Value>,
}

/// Points each model × dataset is run at. Default: none (one run per
/// model and dataset, at the endpoint's own concurrency).
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct RawSweep {
    /// Fixed concurrency limits (1 to 100000), each a cell of its own
    /// (`-cN` in its run id). Required in a sweep.
    pub concurrency: Option<Vec<u64>>,
}

/// A validated matrix.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    pub name: String,
    /// In the order their engines are loaded.
    pub models: Vec<BenchModel>,
    pub datasets: Vec<String>,
    /// The sweep's concurrency limits (empty: no sweep).
    pub sweep: Vec<usize>,
    pub group_by: Vec<String>,
    pub store: Option<PathBuf>,
    /// The bench file's path, for messages.
    pub origin: String,
}

/// A model and its cells.
#[derive(Debug, Clone)]
pub struct BenchModel {
    pub name: String,
    /// The endpoint as written (an engine is loaded from it).
    pub endpoint: EndpointConfig,
    pub cells: Vec<BenchCell>,
}

/// One cell: a model on a dataset at a sweep point, an ordinary run.
#[derive(Debug, Clone)]
pub struct BenchCell {
    pub run_id: String,
    /// Where it comes from in the bench file (`models[0] x datasets[1]`).
    pub place: String,
    pub model: String,
    pub dataset: String,
    /// The sweep's concurrency limit, if any.
    pub concurrency: Option<usize>,
    /// The cell's run config (its snapshot is what the run stores).
    pub loaded: LoadedConfig,
}

impl BenchConfig {
    /// Every cell, model by model.
    pub fn cells(&self) -> impl Iterator<Item = &BenchCell> {
        self.models.iter().flat_map(|m| m.cells.iter())
    }
}

/// Letters, digits, `-`, `_` and `.`, not starting with `-` or `.`: the
/// alphabet of run ids.
fn is_id_part(text: &str) -> bool {
    !text.is_empty()
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        && !text.starts_with(['.', '-'])
}

/// The longest run id the CLI accepts.
const MAX_RUN_ID: usize = 120;

/// Reads and validates a bench file.
pub fn load_bench(file: &Path) -> Result<BenchConfig, ConfigError> {
    let (document, dir) = super::read_document(file)?;
    bench(&document, &dir, file.display().to_string())
}

/// A named entry of `models` or `datasets`: its index and raw mapping.
struct Entry<T> {
    index: usize,
    name: String,
    raw: T,
    value: Map<String, Value>,
}

/// The entries of the list at `key`, each read as `T` with a unique,
/// id-safe `name`.
fn entries<T: serde::de::DeserializeOwned + JsonSchema>(
    root: &Value,
    key: &str,
    name_of: fn(&T) -> Option<&String>,
    problems: &mut Vec<RawProblem>,
) -> Vec<Entry<T>> {
    let mut out: Vec<Entry<T>> = Vec::new();
    let items = match root.get(key) {
        None | Some(Value::Null) => {
            problems.push((key.to_owned(), format!("{key}: required (at least one)")));
            return out;
        }
        Some(Value::Array(items)) if !items.is_empty() => items,
        Some(_) => {
            problems.push((key.to_owned(), format!("{key}: expected a non-empty list")));
            return out;
        }
    };
    for (index, value) in items.iter().enumerate() {
        let at = path::index(key, index);
        let Some(map) = value.as_object() else {
            problems.push((at.clone(), format!("{at}: expected a mapping")));
            continue;
        };
        let Some(raw) = read::section::<T>(value, &at, problems) else {
            continue;
        };
        let name_at = path::key(&at, "name");
        let name = match name_of(&raw) {
            None => {
                problems.push((name_at.clone(), format!("{name_at}: required")));
                continue;
            }
            Some(name) if !is_id_part(name) => {
                problems.push((
                    name_at.clone(),
                    format!(
                        "{name_at}: '{name}' must be letters, digits, '-', '_' or '.' (it names runs)"
                    ),
                ));
                continue;
            }
            Some(name) => name.clone(),
        };
        if let Some(first) = out.iter().find(|e| e.name == name) {
            problems.push((
                name_at.clone(),
                format!(
                    "{name_at}: '{name}' is already the name of {}",
                    path::index(key, first.index)
                ),
            ));
            continue;
        }
        out.push(Entry {
            index,
            name,
            raw,
            value: map.clone(),
        });
    }
    out
}

/// `lines` of `from` (and below it) under `to` instead.
fn graft(lines: &mut HashMap<String, usize>, source: &Document, from: &str, to: &str) {
    for (at, line) in &source.lines {
        let rest = if at == from {
            Some("")
        } else {
            at.strip_prefix(from)
                .filter(|rest| rest.starts_with(['.', '[']))
        };
        if let Some(rest) = rest {
            lines.insert(format!("{to}{rest}"), *line);
        }
    }
}

/// Where a cell's path came from in the bench file: `(cell's, bench's)`,
/// most specific first.
type Origins = Vec<(String, String)>;

/// A problem of a cell's config, said with the bench file's path.
fn rewrite(message: &str, origins: &Origins) -> String {
    for (cell, bench) in origins {
        if let Some(rest) = message.strip_prefix(cell.as_str())
            && (rest.is_empty() || rest.starts_with(['.', '[', ':', ' ']))
        {
            return format!("{bench}{rest}");
        }
    }
    message.to_owned()
}

/// Keys of a run config that the bench passes to every cell as written.
const PASSED: [&str; 6] = [
    "retry",
    "timeouts",
    "writer",
    "report",
    "telemetry",
    "shutdown_grace",
];

fn bench(document: &Document, dir: &Path, origin: String) -> Result<BenchConfig, ConfigError> {
    let mut problems: Vec<RawProblem> = Vec::new();
    let root = if document.value.is_null() {
        Value::Object(Map::new())
    } else {
        document.value.clone()
    };
    if !root.is_object() {
        return Err(validate::invalid(
            origin,
            document,
            vec![(
                String::new(),
                "the bench config must be a mapping of keys to values".to_owned(),
            )],
        ));
    }
    let raw = read::section::<RawBench>(&root, "", &mut problems).unwrap_or_default();
    let name = match &raw.name {
        None => {
            problems.push(("name".to_owned(), "name: required".to_owned()));
            None
        }
        Some(name) if !is_id_part(name) => {
            problems.push((
                "name".to_owned(),
                format!("name: '{name}' must be letters, digits, '-', '_' or '.' (it names runs)"),
            ));
            None
        }
        Some(name) => Some(name.clone()),
    };
    let models = entries::<RawBenchModel>(&root, "models", |m| m.name.as_ref(), &mut problems);
    let datasets =
        entries::<RawBenchDataset>(&root, "datasets", |d| d.name.as_ref(), &mut problems);
    for model in &models {
        let at = path::index("models", model.index);
        match &model.raw.endpoint {
            Some(Value::Object(_)) => {}
            Some(_) => problems.push((
                path::key(&at, "endpoint"),
                format!("{at}.endpoint: expected a mapping"),
            )),
            None => problems.push((
                path::key(&at, "endpoint"),
                format!("{at}.endpoint: required"),
            )),
        }
    }
    for dataset in &datasets {
        let at = path::index("datasets", dataset.index);
        for key in ["dataset", "task"] {
            let missing = match key {
                "dataset" => dataset.raw.dataset.is_none(),
                _ => dataset.raw.task.is_none(),
            };
            if missing {
                problems.push((path::key(&at, key), format!("{at}.{key}: required")));
            }
        }
    }
    let mut sweep: Vec<usize> = Vec::new();
    if let Some(value) = &raw.sweep
        && let Some(parsed) = read::section::<RawSweep>(value, "sweep", &mut problems)
    {
        match parsed.concurrency {
            None => problems.push((
                "sweep.concurrency".to_owned(),
                "sweep.concurrency: required in a sweep".to_owned(),
            )),
            Some(points) if points.is_empty() => problems.push((
                "sweep.concurrency".to_owned(),
                "sweep.concurrency: expected at least one limit".to_owned(),
            )),
            Some(points) => {
                for (i, n) in points.iter().enumerate() {
                    let at = path::index("sweep.concurrency", i);
                    if !(1..=100_000).contains(n) {
                        problems.push((at.clone(), format!("{at}: must be 1 to 100000, got {n}")));
                    } else if sweep.contains(&(*n as usize)) {
                        problems.push((at.clone(), format!("{at}: {n} is given twice")));
                    } else {
                        sweep.push(*n as usize);
                    }
                }
            }
        }
    }
    if let Some(fields) = &raw.group_by {
        for (i, field) in fields.iter().enumerate() {
            if field.trim().is_empty() {
                let at = path::index("group_by", i);
                problems.push((at.clone(), format!("{at}: empty field name")));
            }
        }
    }
    let Some(name) = name.filter(|_| problems.is_empty()) else {
        return Err(validate::invalid(origin, document, problems));
    };

    // Each cell's config, validated by the run config's rules; problems
    // are gathered in the bench's words, once each.
    let points: Vec<Option<usize>> = if sweep.is_empty() {
        vec![None]
    } else {
        sweep.iter().copied().map(Some).collect()
    };
    let mut located: Vec<Problem> = Vec::new();
    let mut out_models = Vec::new();
    // Each cell's run id, and where its cell is: two cells may not share one.
    let mut ids: HashMap<String, String> = HashMap::new();
    for model in &models {
        let model_at = path::index("models", model.index);
        let mut cells = Vec::new();
        let mut endpoint = None;
        for dataset in &datasets {
            let dataset_at = path::index("datasets", dataset.index);
            for (k, point) in points.iter().enumerate() {
                let mut run_id = format!("{name}-{}-{}", model.name, dataset.name);
                let mut place = format!("{model_at} x {dataset_at}");
                if let Some(n) = point {
                    run_id.push_str(&format!("-c{n}"));
                    place.push_str(&format!(" x sweep.concurrency[{k}]"));
                }
                if let Some(first) = ids.get(&run_id) {
                    located.push(Problem {
                        line: document.line_of(&path::key(&model_at, "name")),
                        message: format!(
                            "{model_at}.name: the cells {first} and {place} would both be run {run_id}; rename a model or a dataset"
                        ),
                    });
                    continue;
                }
                ids.insert(run_id.clone(), place.clone());
                let (cell, origins) = cell_document(
                    document,
                    &root,
                    &run_id,
                    (model, &model_at),
                    (dataset, &dataset_at),
                    point.map(|n| (n, k)),
                );
                if run_id.len() > MAX_RUN_ID {
                    located.push(Problem {
                        line: document.line_of(&path::key(&model_at, "name")),
                        message: format!(
                            "{model_at}.name: the run id {run_id} is longer than {MAX_RUN_ID} characters; use shorter names"
                        ),
                    });
                    continue;
                }
                match validate::load(cell, dir, Overrides::default(), origin.clone(), None) {
                    Ok(mut loaded) => {
                        loaded.origin = format!("{origin} (cell {run_id})");
                        endpoint.get_or_insert_with(|| loaded.config.endpoints[0].clone());
                        cells.push(BenchCell {
                            run_id,
                            place,
                            model: model.name.clone(),
                            dataset: dataset.name.clone(),
                            concurrency: *point,
                            loaded,
                        });
                    }
                    Err(err) => {
                        for problem in err.problems() {
                            located.push(Problem {
                                line: problem.line,
                                message: rewrite(&problem.message, &origins),
                            });
                        }
                    }
                }
            }
        }
        if let Some(endpoint) = endpoint {
            out_models.push(BenchModel {
                name: model.name.clone(),
                endpoint,
                cells,
            });
        }
    }
    if !located.is_empty() {
        let mut seen = std::collections::HashSet::new();
        located.retain(|p| seen.insert((p.line, p.message.clone())));
        located.sort_by_key(|p| p.line.unwrap_or(0));
        return Err(ConfigError::Invalid {
            origin,
            problems: located,
        });
    }
    Ok(BenchConfig {
        name,
        models: out_models,
        datasets: datasets.into_iter().map(|d| d.name).collect(),
        sweep,
        group_by: raw.group_by.unwrap_or_default(),
        store: raw.store.map(PathBuf::from),
        origin,
    })
}

/// A cell's run config as a document of its own, with the bench file's
/// lines, and where each of its parts came from.
fn cell_document(
    document: &Document,
    root: &Value,
    run_id: &str,
    (model, model_at): (&Entry<RawBenchModel>, &str),
    (dataset, dataset_at): (&Entry<RawBenchDataset>, &str),
    point: Option<(usize, usize)>,
) -> (Document, Origins) {
    let mut value = Map::new();
    let mut lines = HashMap::new();
    let mut origins: Origins = Vec::new();
    value.insert("name".to_owned(), Value::String(run_id.to_owned()));
    graft(&mut lines, document, "name", "name");
    for key in PASSED {
        if let Some(passed) = root.get(key) {
            value.insert(key.to_owned(), passed.clone());
            graft(&mut lines, document, key, key);
        }
    }
    // The endpoint, named after the model unless it says otherwise, at
    // the sweep point's concurrency.
    let endpoint_at = path::key(model_at, "endpoint");
    let mut endpoint = model.value.get("endpoint").cloned().unwrap_or(Value::Null);
    graft(&mut lines, document, &endpoint_at, "endpoints[0]");
    if let Some(map) = endpoint.as_object_mut() {
        map.entry("name")
            .or_insert_with(|| Value::String(model.name.clone()));
        if let Some((n, k)) = point {
            map.insert("concurrency".to_owned(), Value::from(n));
            let sweep_at = path::index("sweep.concurrency", k);
            if let Some(line) = document.line_of(&sweep_at) {
                lines.insert("endpoints[0].concurrency".to_owned(), line);
            }
            origins.push(("endpoints[0].concurrency".to_owned(), sweep_at));
        }
    }
    value.insert("endpoints".to_owned(), Value::Array(vec![endpoint]));
    origins.push(("endpoints[0]".to_owned(), endpoint_at));
    // The dataset and the task, with the model's overrides.
    let data_at = path::key(dataset_at, "dataset");
    value.insert(
        "dataset".to_owned(),
        dataset.value.get("dataset").cloned().unwrap_or(Value::Null),
    );
    graft(&mut lines, document, &data_at, "dataset");
    let task_at = path::key(dataset_at, "task");
    let mut task = dataset.value.get("task").cloned().unwrap_or(Value::Null);
    graft(&mut lines, document, &task_at, "task");
    if let Some(task) = task.as_object_mut() {
        if let Some(messages) = model.value.get("messages") {
            let messages_at = path::key(model_at, "messages");
            lines.retain(|at, _| !at.starts_with("task.messages"));
            graft(&mut lines, document, &messages_at, "task.messages");
            task.insert("messages".to_owned(), messages.clone());
            origins.push(("task.messages".to_owned(), messages_at));
        }
        if let Some(params) = &model.raw.params {
            let params_at = path::key(model_at, "params");
            let merged = task
                .entry("params")
                .or_insert_with(|| Value::Object(Map::new()));
            if let Some(merged) = merged.as_object_mut() {
                for (key, param) in params {
                    merged.insert(key.clone(), param.clone());
                    let at = path::key(&params_at, key);
                    graft(&mut lines, document, &at, &format!("task.params.{key}"));
                    origins.push((format!("task.params.{key}"), at));
                }
            }
        }
    }
    value.insert("task".to_owned(), task);
    origins.push(("task".to_owned(), task_at));
    origins.push(("dataset".to_owned(), data_at));
    (
        Document {
            value: Value::Object(value),
            lines,
        },
        origins,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> Result<BenchConfig, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("q.jsonl"),
            "{\"id\": \"1\", \"q\": \"a\", \"a\": \"b\"}\n",
        )
        .unwrap();
        let file = dir.path().join("bench.yaml");
        std::fs::write(&file, text).unwrap();
        load_bench(&file)
    }

    const GOOD: &str = "\
name: m
models:
  - name: small
    endpoint: {kind: local, model: s, command: 'serve --port {port}'}
    params: {temperature: 0.5}
  - name: big
    endpoint: {kind: external, base_url: 'http://127.0.0.1:9/v1', model: b}
    messages: [{role: user, content: 'Big: {{ q }}'}]
datasets:
  - name: qa
    dataset: {path: q.jsonl, id_field: id}
    task:
      messages: [{role: user, content: '{{ q }}'}]
      params: {max_tokens: 8, temperature: 0}
      metrics: [{name: exact_match, reference: '{{ a }}'}]
sweep: {concurrency: [1, 4]}
";

    #[test]
    fn a_bench_plans_a_run_per_model_dataset_and_sweep_point() {
        let bench = load(GOOD).unwrap();
        let ids: Vec<&str> = bench.cells().map(|c| c.run_id.as_str()).collect();
        assert_eq!(
            ids,
            [
                "m-small-qa-c1",
                "m-small-qa-c4",
                "m-big-qa-c1",
                "m-big-qa-c4"
            ]
        );
        let small = &bench.models[0].cells[1];
        assert_eq!(small.loaded.config.endpoints[0].name, "small");
        assert_eq!(small.loaded.config.endpoints[0].max_concurrency(), 4);
        assert_eq!(small.loaded.config.task.params["temperature"], 0.5);
        assert_eq!(small.loaded.config.task.params["max_tokens"], 8);
        let big = &bench.models[1].cells[0];
        assert_eq!(big.loaded.config.task.messages[0].content, "Big: {{ q }}");
        assert_eq!(big.loaded.config.task.params["temperature"], 0);
        assert_eq!(big.loaded.snapshot["name"], "m-big-qa-c1");
    }

    #[test]
    fn a_cell_s_problem_is_reported_once_with_the_bench_file_s_path_and_line() {
        let text = GOOD
            .replace(
                "command: 'serve --port {port}'",
                "command: 'serve', colour: red",
            )
            .replace("name: exact_match", "name: no_such_metric")
            .replace("[1, 4]", "[1, 0]");
        let err = load(&text).unwrap_err();
        let problems = err.problems();
        let shown: Vec<String> = problems
            .iter()
            .map(|p| format!("{}: {}", p.line.unwrap_or(0), p.message))
            .collect();
        assert!(
            shown
                .iter()
                .any(|s| s.starts_with("16: sweep.concurrency[1]: must be 1 to")),
            "{shown:#?}"
        );
        // Sweep problems stop before cells are checked; fix it and look again.
        let err = load(&text.replace("[1, 0]", "[1, 4]")).unwrap_err();
        let shown: Vec<String> = err
            .problems()
            .iter()
            .map(|p| format!("{}: {}", p.line.unwrap_or(0), p.message))
            .collect();
        assert!(
            shown
                .iter()
                .any(|s| s.starts_with("4: models[0].endpoint: unknown key 'colour'")),
            "{shown:#?}"
        );
        assert!(
            shown
                .iter()
                .any(|s| s.starts_with("15: datasets[0].task.metrics")),
            "{shown:#?}"
        );
        let colour = shown.iter().filter(|s| s.contains("'colour'")).count();
        assert_eq!(colour, 1, "once, not once per cell: {shown:#?}");
    }

    #[test]
    fn unknown_keys_and_bad_names_are_errors() {
        let err = load(&GOOD.replace("name: m\n", "name: 'm x'\ncolour: 1\n")).unwrap_err();
        let text = err.to_string();
        assert!(text.contains(":1: name: 'm x' must be letters"), "{text}");
        assert!(text.contains(":2: config: unknown key 'colour'"), "{text}");
        let err = load(&GOOD.replace("name: big", "name: small")).unwrap_err();
        assert!(
            err.to_string()
                .contains("models[1].name: 'small' is already the name of models[0]"),
            "{err}"
        );
    }

    #[test]
    fn two_cells_that_would_share_a_run_id_are_refused_naming_both() {
        // small x qa-x and small-qa x x are both m-small-qa-x.
        let text = GOOD
            .replace("name: big", "name: small-qa")
            .replace("  - name: qa\n", "  - name: qa-x\n")
            + "  - name: x\n    dataset: {path: q.jsonl, id_field: id}\n    task:\n      messages: [{role: user, content: '{{ q }}'}]\n";
        let text = text.replace("sweep: {concurrency: [1, 4]}\n", "");
        let err = load(&text).unwrap_err();
        assert!(
            err.to_string().contains(
                "models[1].name: the cells models[0] x datasets[0] and models[1] x datasets[1] would both be run m-small-qa-x"
            ),
            "{err}"
        );
        let err = load(&GOOD.replace("name: big", "name: small")).unwrap_err();
        assert!(
            err.to_string()
                .contains("models[1].name: 'small' is already the name of models[0]"),
            "{err}"
        );
    }
}
