//! A benchmark matrix above runs: its plan (which cell is which run), each
//! cell's state, and the report that compares every model on every
//! dataset. The cells are ordinary runs; this module only reads them.
//!
//! The plan is kept as a manifest beside the store (`bench/NAME.json`), so
//! that `bench status NAME`, `bench report NAME` and the dashboard find the
//! cells without the bench file.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use evalfleet_config::bench::{BenchCell, BenchConfig};
use evalfleet_config::{EndpointConfig, MASK, Secret};
use evalfleet_reports::{self as report, Outcome, ReportError, metrics::ALL};
use evalfleet_store::worker;
use evalfleet_store::{ItemQuery, Location, SortKey, Store, StoreError};
use evalfleet_types::{Event, EventKind, ResourceMetric, ResourcePoint, ResourceSource, RunStatus};

/// The most GPU memory in use at once during a cell (see
/// [`CellReport::peak_gpu_memory_mb`]): model `model`'s engine's own where
/// its processes were attributed (an endpoint series), else the peak over
/// sample times of the memory summed over every sampled GPU. A point the
/// store merged counts at its peak over its whole span.
fn cell_gpu_memory_peak(points: &[ResourcePoint], model: &str) -> Option<f64> {
    let memory = |p: &&ResourcePoint| p.series.metric == ResourceMetric::GpuMemoryMb;
    let own = points
        .iter()
        .filter(memory)
        .filter(|p| p.series.source == ResourceSource::Endpoint && p.series.name == model)
        .map(|p| p.peak)
        .reduce(f64::max);
    if own.is_some() {
        return own;
    }
    let gpus: Vec<&ResourcePoint> = points
        .iter()
        .filter(memory)
        .filter(|p| p.series.source == ResourceSource::Gpu)
        .collect();
    gpus.iter()
        .map(|at| {
            let mut by_gpu: std::collections::BTreeMap<&str, f64> = Default::default();
            for p in gpus
                .iter()
                .filter(|p| p.at_ms <= at.at_ms && at.at_ms <= p.until_ms)
            {
                let peak = by_gpu.entry(p.series.name.as_str()).or_insert(p.peak);
                *peak = peak.max(p.peak);
            }
            by_gpu.values().sum::<f64>()
        })
        .reduce(f64::max)
}

/// Whether `record`, the stored run that holds `cell`'s run id, is that
/// cell's run: made from the same cell of a bench (the same run name and
/// endpoint as written) and giving the same results (the same dataset
/// content and task, as a resume checks). A run id is only a name: another
/// bench, a run given the id by hand, or this bench's file edited since
/// may hold it, and its results are then not this cell's. `Err` says which
/// run holds the id, how it differs, and what to do.
pub fn check_cell_run(record: &RecordOf, cell: &BenchCell) -> Result<(), String> {
    let snapshot = &cell.loaded.snapshot;
    let mut differs: Vec<String> = Vec::new();
    if record.config.get("name") != snapshot.get("name") {
        differs.push(format!(
            "it was made from a config named {} (not this bench's cell)",
            record
                .config
                .get("name")
                .unwrap_or(&serde_json::Value::Null)
        ));
    } else if record.config.get("endpoints") != snapshot.get("endpoints") {
        differs.push(format!(
            "its endpoint differs from model {}'s in the bench file",
            cell.model
        ));
    }
    if differs.is_empty()
        && let Err(err) = crate::run::check_resume(record, &cell.loaded.config)
    {
        differs.push(match err {
            crate::run::ResumeError::Changed { changes, .. } => changes.join("; "),
            other => other.to_string(),
        });
    }
    if differs.is_empty() {
        return Ok(());
    }
    Err(format!(
        "run {} in the store holds the run id of cell {} of {}, but {}. Its results are not reused and it is left as it is: give the bench another name (its cells get other run ids) or another store (--store), or put back the bench file the run was made from",
        record.run_id,
        cell.place,
        cell.loaded.origin,
        differs.join("; ")
    ))
}

type RecordOf = evalfleet_store::RunRecord;

/// Secrets shorter than this are not looked for in a message (an engine's
/// `env` holds settings like `1` too; masking every `1` would say nothing).
const SHORTEST_SECRET: usize = 4;

/// Whether a command-line flag (`--api-key`, `--hf_token`) takes a secret.
fn is_secret_flag(flag: &str) -> bool {
    let name = flag.trim_start_matches('-').to_ascii_lowercase();
    ["key", "token", "secret", "password"]
        .iter()
        .any(|word| name.ends_with(word))
}

/// `text` with the value of every secret flag masked: `--api-key VALUE`,
/// `--hf-token=VALUE`. A cell's message may carry its engine's last lines,
/// where an engine may print its own command line.
pub fn redact_flags(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut mask_next = false;
    for piece in text.split_inclusive(char::is_whitespace) {
        let word = piece.trim_end_matches(char::is_whitespace);
        let space = &piece[word.len()..];
        if word.is_empty() {
            out.push_str(piece);
            continue;
        }
        if std::mem::take(&mut mask_next) {
            out.push_str(MASK);
            out.push_str(space);
            continue;
        }
        if word.starts_with("--") {
            if let Some((flag, _)) = word.split_once('=')
                && is_secret_flag(flag)
            {
                out.push_str(flag);
                out.push('=');
                out.push_str(MASK);
                out.push_str(space);
                continue;
            }
            mask_next = is_secret_flag(word);
        }
        out.push_str(piece);
    }
    out
}

/// `text` (a message about `endpoint`'s engine) with every secret the
/// engine was given masked wherever it appears (its `api_key`, `headers`,
/// `env`, and the value of each secret flag in its command and `args`),
/// and the value of any secret flag.
pub fn redact_engine(text: &str, endpoint: &EndpointConfig) -> String {
    let mut secrets: Vec<&str> = Vec::new();
    secrets.extend(endpoint.api_key.as_ref().map(Secret::expose));
    secrets.extend(endpoint.headers.iter().map(|(_, v)| v.expose()));
    let mut flagged: Vec<String> = Vec::new();
    if let Some(engine) = endpoint.kind.engine() {
        secrets.extend(engine.env.iter().map(|(_, v)| v.expose()));
        for line in [&engine.command, &engine.args] {
            let words: Vec<&str> = line.split_whitespace().collect();
            for (i, word) in words.iter().enumerate() {
                if !word.starts_with("--") {
                    continue;
                }
                match word.split_once('=') {
                    Some((flag, value)) if is_secret_flag(flag) => flagged.push(value.to_owned()),
                    None if is_secret_flag(word) => {
                        flagged.extend(words.get(i + 1).map(|v| (*v).to_owned()));
                    }
                    _ => {}
                }
            }
        }
    }
    let mut out = text.to_owned();
    let quotes: &[char] = &['\'', '"'];
    for secret in secrets
        .into_iter()
        .chain(flagged.iter().map(|v| v.trim_matches(quotes)))
    {
        if secret.len() >= SHORTEST_SECRET {
            out = out.replace(secret, MASK);
        }
    }
    redact_flags(&out)
}

/// Which run each cell is: what `bench status` and `bench report` read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Manifest {
    pub name: String,
    /// The bench file it was made from.
    pub config: String,
    /// In the order their engines are loaded.
    pub models: Vec<String>,
    pub datasets: Vec<String>,
    pub sweep: Vec<usize>,
    pub group_by: Vec<String>,
    pub cells: Vec<CellPlan>,
    /// The store its runs are in ([`Manifest::store_key`]); none in a plan
    /// made before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<String>,
}

/// One cell of the plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CellPlan {
    pub run_id: String,
    pub model: String,
    pub dataset: String,
    pub concurrency: Option<usize>,
}

/// A manifest's file name is the bench's name, which is id-safe.
pub fn is_bench_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 120
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        && !name.starts_with(['.', '-'])
}

impl Manifest {
    pub fn of(bench: &BenchConfig) -> Self {
        Self {
            name: bench.name.clone(),
            config: bench.origin.clone(),
            models: bench.models.iter().map(|m| m.name.clone()).collect(),
            datasets: bench.datasets.clone(),
            sweep: bench.sweep.clone(),
            group_by: bench.group_by.clone(),
            cells: bench
                .cells()
                .map(|c| CellPlan {
                    run_id: c.run_id.clone(),
                    model: c.model.clone(),
                    dataset: c.dataset.clone(),
                    concurrency: c.concurrency,
                })
                .collect(),
            store: None,
        }
    }

    /// Whether its runs are in the store at `location` (a plan that does
    /// not say is taken to be).
    pub fn is_over(&self, location: &Location) -> bool {
        self.store
            .as_deref()
            .is_none_or(|store| store == Self::store_key(location))
    }

    /// What a plan keeps of its store: a SQLite file's name (the plan lies
    /// in its folder, however the folder is named), else the location.
    pub fn store_key(location: &Location) -> String {
        match location {
            Location::Sqlite(path) => path.file_name().map_or_else(
                || location.to_string(),
                |n| n.to_string_lossy().into_owned(),
            ),
            _ => location.to_string(),
        }
    }

    /// Where the manifest of `name` is kept, beside the store in `dir`.
    pub fn path(store_dir: &Path, name: &str) -> PathBuf {
        store_dir.join("bench").join(format!("{name}.json"))
    }

    /// Writes it (atomically: a reader never sees half of it).
    pub fn write(&self, store_dir: &Path) -> std::io::Result<()> {
        let path = Self::path(store_dir, &self.name);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let temporary = path.with_extension("json.tmp");
        std::fs::write(&temporary, serde_json::to_vec_pretty(self)?)?;
        std::fs::rename(temporary, path)
    }

    /// The manifest of bench `name` in the store at `store_dir`.
    pub fn read(store_dir: &Path, name: &str) -> Result<Self, String> {
        if !is_bench_name(name) {
            return Err(format!("'{name}' is not a bench's name"));
        }
        let path = Self::path(store_dir, name);
        let text = std::fs::read_to_string(&path).map_err(|err| {
            format!(
                "no bench '{name}' beside this store ({}: {err}); run `evalfleet bench CONFIG` first",
                path.display()
            )
        })?;
        serde_json::from_str(&text).map_err(|err| format!("{}: {err}", path.display()))
    }

    /// The benches kept beside the store at `store_dir`, by name.
    /// The benches over the store at `location`, by name (two stores in
    /// one folder keep their plans side by side: each lists its own).
    pub fn list(location: &Location) -> Vec<String> {
        let store_dir = location.dir();
        let mut names: Vec<String> = std::fs::read_dir(store_dir.join("bench"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                e.file_name()
                    .to_str()
                    .and_then(|n| n.strip_suffix(".json"))
                    .map(str::to_owned)
            })
            .filter(|n| is_bench_name(n))
            .filter(|n| Self::read(&store_dir, n).is_ok_and(|m| m.is_over(location)))
            .collect();
        names.sort();
        names
    }
}

/// Where a cell stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum CellState {
    /// Not started: no run yet, or a run with no answer and no failure.
    Pending,
    /// A live process is answering it.
    Running,
    /// Every item ended.
    Done,
    /// It could not run (its engine did not start, its run was refused):
    /// the reason is its message. Running the bench again tries it again.
    Failed,
    /// Stopped part way (Ctrl-C, a crash); running the bench again
    /// finishes it.
    Interrupted,
}

impl CellState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Running => "running",
            Self::Done => "done",
            Self::Failed => "failed",
            Self::Interrupted => "interrupted",
        }
    }
}

/// The message of a cell's run that says it could not run: how the bench
/// marks a cell failed.
pub const CELL_FAILED: &str = "bench: this cell could not run: ";

/// One cell's state.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct CellStatus {
    #[serde(flatten)]
    pub plan: CellPlan,
    pub state: CellState,
    /// Items ended (done and failed) and in all; 0 of 0 before the run
    /// exists.
    pub done: u64,
    pub failed: u64,
    pub total: u64,
    /// Why it failed or was interrupted.
    pub message: Option<String>,
}

/// The state of every cell of `manifest`.
pub fn status(store: &mut dyn Store, manifest: &Manifest) -> Result<Vec<CellStatus>, StoreError> {
    manifest
        .cells
        .iter()
        .map(|plan| cell_status(store, plan))
        .collect()
}

impl CellStatus {
    /// A cell whose run does not exist yet.
    fn unstarted(plan: &CellPlan) -> Self {
        Self {
            plan: plan.clone(),
            state: CellState::Pending,
            done: 0,
            failed: 0,
            total: 0,
            message: None,
        }
    }
}

/// Every cell pending: a bench whose store does not exist yet.
pub fn status_without_store(manifest: &Manifest) -> Vec<CellStatus> {
    manifest.cells.iter().map(CellStatus::unstarted).collect()
}

fn cell_status(store: &mut dyn Store, plan: &CellPlan) -> Result<CellStatus, StoreError> {
    let record = match store.run(&plan.run_id) {
        Ok(record) => record,
        Err(StoreError::NoSuchRun(_)) => return Ok(CellStatus::unstarted(plan)),
        Err(err) => return Err(err),
    };
    let counts = store.counts(&plan.run_id)?;
    let failed_to_run = record
        .message
        .as_deref()
        .and_then(|m| m.strip_prefix(CELL_FAILED));
    let state = match record.status {
        RunStatus::Finished => CellState::Done,
        _ if failed_to_run.is_some() => CellState::Failed,
        RunStatus::Running if !worker::live_workers(store, &plan.run_id)?.is_empty() => {
            CellState::Running
        }
        _ if record.sessions == 0 => CellState::Pending,
        _ => CellState::Interrupted,
    };
    Ok(CellStatus {
        plan: plan.clone(),
        state,
        done: counts.done,
        failed: counts.failed,
        total: counts.total(),
        message: match state {
            CellState::Failed => failed_to_run.map(redact_flags),
            CellState::Interrupted => record.message.as_deref().map(redact_flags),
            _ => None,
        },
    })
}

/// A score with its 95% interval.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Score {
    pub mean: f64,
    pub ci_low: f64,
    pub ci_high: f64,
    /// Items it is the mean of.
    pub n: u64,
}

/// The headline metric in one category.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct GroupScore {
    /// `field=value`.
    pub group: String,
    #[serde(flatten)]
    pub score: Score,
}

/// One cell, compared.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct CellReport {
    #[serde(flatten)]
    pub status: CellStatus,
    /// The dataset's first metric, over every item (`None` before any
    /// answer is scored, or without metrics).
    pub metric: Option<String>,
    pub headline: Option<Score>,
    /// The headline metric by each `group_by` category (`field=value`).
    pub groups: Vec<GroupScore>,
    /// Whole-call latency, time to first token and time per output token
    /// (ms, median), and output tokens per second of a call (mean).
    pub latency_p50_ms: Option<f64>,
    pub ttft_p50_ms: Option<f64>,
    pub tpot_p50_ms: Option<f64>,
    pub tokens_per_second: Option<f64>,
    /// The most GPU memory in use at once during the cell, in MiB: its
    /// engine's own processes' where the run attributed them, else, at each
    /// sample, the memory in use summed over the GPUs the cell's run sampled
    /// (the engine's `gpu:`, every GPU without one: whole GPUs, whoever
    /// used them), and the peak of that sum. `None` without GPU telemetry
    /// (no `nvidia-smi`, or an engine on another host).
    pub peak_gpu_memory_mb: Option<u64>,
    /// How long the model's engine took to load for this cell's last
    /// turn, from its process's start to its first health answer (ms).
    pub engine_start_ms: Option<i64>,
    /// What its run came to, with its counts and causes (`None` before
    /// its run exists).
    pub outcome: Option<Outcome>,
}

impl CellReport {
    /// Where it stands in a word: its state, or once its run has
    /// finished, its outcome (`complete`, `incomplete`, `failed`).
    pub fn standing(&self) -> &'static str {
        match (&self.status.state, &self.outcome) {
            (CellState::Done, Some(outcome)) => outcome.outcome.as_str(),
            (state, _) => state.as_str(),
        }
    }

    /// Whether its numbers are over every item: its run finished
    /// complete. Every surface marks a cell that is not.
    pub fn is_complete(&self) -> bool {
        self.status.state == CellState::Done
            && self.outcome.as_ref().is_some_and(Outcome::is_complete)
    }

    /// Items with a usable, scored answer, and items that failed.
    pub fn scored_and_failed(&self) -> (u64, u64) {
        self.outcome
            .as_ref()
            .map_or((0, self.status.failed), |o| (o.scored, o.failed))
    }
}

/// From one model's last answer to the next model's first call.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Handover {
    pub from: String,
    pub to: String,
    pub gap_ms: i64,
    /// The next engine's own start (process start to health answer).
    pub engine_start_ms: i64,
    /// What the gap holds besides the engine's start: unloading the first
    /// engine, waiting for its GPU, registering and starting runs.
    pub overhead_ms: i64,
}

/// Every model on every dataset.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct BenchReport {
    pub name: String,
    pub models: Vec<String>,
    pub datasets: Vec<String>,
    pub group_by: Vec<String>,
    pub cells: Vec<CellReport>,
    /// Between consecutive models whose turns followed each other in one
    /// bench process (none after a resume in between).
    pub handovers: Vec<Handover>,
}

/// The engine's last turn as the bench recorded it on the cell's run:
/// (spawned, ready) in ms since the epoch.
fn last_turn(events: &[Event], model: &str) -> Option<(i64, i64)> {
    let started = events
        .iter()
        .rposition(|e| e.kind == EventKind::Started && e.endpoint.as_deref() == Some(model))?;
    let ready = events[started..]
        .iter()
        .find(|e| e.kind == EventKind::Ready && e.endpoint.as_deref() == Some(model))?;
    Some((events[started].at_ms, ready.at_ms))
}

/// When a cell's first call was sent and its last answer came:
/// (first sent, last finished) in ms since the epoch.
fn answer_span(store: &mut dyn Store, run_id: &str) -> Result<Option<(i64, i64)>, StoreError> {
    let page = |store: &mut dyn Store, descending| {
        store.items(
            run_id,
            &ItemQuery {
                sort: SortKey::Finished,
                descending,
                limit: 1,
                ..ItemQuery::default()
            },
        )
    };
    let first = page(store, false)?.rows.into_iter().next();
    let last = page(store, true)?.rows.into_iter().next();
    let (Some(first), Some(last)) = (first, last) else {
        return Ok(None);
    };
    let sent = store
        .item(run_id, &first.item_id)?
        .and_then(|item| item.attempt_records.first().map(|a| a.sent_at_ms));
    Ok(match (sent, last.finished_at_ms) {
        (Some(sent), Some(finished)) => Some((sent, finished)),
        _ => None,
    })
}

/// One model's cells in time: its engine's first turn (spawned, ready),
/// its first call and its last answer (ms since the epoch).
#[derive(Default)]
struct ModelSpan {
    model: String,
    turn: Option<(i64, i64)>,
    first_call: Option<i64>,
    last_answer: Option<i64>,
}

/// The report of every cell of `manifest`.
pub fn report(store: &mut dyn Store, manifest: &Manifest) -> Result<BenchReport, ReportError> {
    let mut cells = Vec::new();
    let mut spans: Vec<ModelSpan> = manifest
        .models
        .iter()
        .map(|m| ModelSpan {
            model: m.clone(),
            ..ModelSpan::default()
        })
        .collect();
    for status in status(store, manifest)? {
        let run_id = status.plan.run_id.clone();
        let mut cell = CellReport {
            status,
            metric: None,
            headline: None,
            groups: Vec::new(),
            latency_p50_ms: None,
            ttft_p50_ms: None,
            tpot_p50_ms: None,
            tokens_per_second: None,
            peak_gpu_memory_mb: None,
            engine_start_ms: None,
            outcome: None,
        };
        if cell.status.total == 0 {
            cells.push(cell);
            continue;
        }
        let run = report::report(store, &run_id, &manifest.group_by, None)?;
        cell.outcome = Some(run.outcome.clone());
        if let Some(first) = run.metrics.first() {
            let metric = first.metric.clone();
            for summary in run.metrics.iter().filter(|s| s.metric == metric) {
                if !summary.has_value() {
                    continue;
                }
                let score = Score {
                    mean: summary.estimate.mean,
                    ci_low: summary.estimate.ci_low,
                    ci_high: summary.estimate.ci_high,
                    n: summary.scored,
                };
                if summary.group == ALL {
                    cell.headline = Some(score);
                } else {
                    cell.groups.push(GroupScore {
                        group: summary.group.clone(),
                        score,
                    });
                }
            }
            cell.metric = Some(metric);
        }
        let points = store.resource_points(&run_id, i64::MIN)?;
        cell.peak_gpu_memory_mb = cell_gpu_memory_peak(&points, &cell.status.plan.model)
            .map(|mb| mb.round().max(0.0) as u64);
        if let Some(endpoint) = run.endpoints.iter().find(|e| e.successes > 0) {
            cell.latency_p50_ms = endpoint.latency_ms.map(|p| p.p50);
            cell.ttft_p50_ms = endpoint.ttft_ms.map(|p| p.p50);
            cell.tpot_p50_ms = endpoint.tpot_ms.map(|p| p.p50);
            cell.tokens_per_second = Some(endpoint.tokens_per_second_per_call);
        }
        let events = store.events(&run_id)?;
        let turn = last_turn(&events, &cell.status.plan.model);
        cell.engine_start_ms = turn.map(|(spawned, ready)| ready - spawned);
        let span = answer_span(store, &run_id)?;
        if let Some(entry) = spans.iter_mut().find(|s| s.model == cell.status.plan.model) {
            if let Some(turn) = turn {
                entry.turn = Some(entry.turn.map_or(turn, |t| t.min(turn)));
            }
            if let Some((sent, finished)) = span {
                entry.first_call = Some(entry.first_call.map_or(sent, |s| s.min(sent)));
                entry.last_answer = Some(entry.last_answer.map_or(finished, |f| f.max(finished)));
            }
        }
        cells.push(cell);
    }
    let mut handovers = Vec::new();
    for pair in spans.windows(2) {
        let (Some(last_answer), Some((spawned, ready)), Some(first_call)) =
            (pair[0].last_answer, pair[1].turn, pair[1].first_call)
        else {
            continue;
        };
        // Only a handover within one process: the next engine was started
        // after the last answer, and called once it was ready.
        if spawned < last_answer || first_call < ready {
            continue;
        }
        let gap_ms = first_call - last_answer;
        let engine_start_ms = ready - spawned;
        handovers.push(Handover {
            from: pair[0].model.clone(),
            to: pair[1].model.clone(),
            gap_ms,
            engine_start_ms,
            overhead_ms: gap_ms - engine_start_ms,
        });
    }
    Ok(BenchReport {
        name: manifest.name.clone(),
        models: manifest.models.clone(),
        datasets: manifest.datasets.clone(),
        group_by: manifest.group_by.clone(),
        cells,
        handovers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_shows_no_secret_of_the_engine_nor_any_secret_flag_s_value() {
        assert_eq!(
            redact_flags("serve m --api-key sk-1 --port 80 --hf-token=hf_2\n--max-tokens 5"),
            "serve m --api-key *** --port 80 --hf-token=***\n--max-tokens 5"
        );
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("q.jsonl"),
            "{\"id\": \"1\", \"q\": \"a\"}\n",
        )
        .unwrap();
        let file = dir.path().join("bench.yaml");
        std::fs::write(
            &file,
            "name: s\nmodels:\n  - name: a\n    endpoint: {kind: local, model: a, \
             command: \"serve --port {port} --api-key 'sk-cmd-0001'\", api_key: sk-key-0002}\n\
             datasets:\n  - name: d\n    dataset: {path: q.jsonl, id_field: id}\n    \
             task: {messages: [{role: user, content: '{{ q }}'}]}\n",
        )
        .unwrap();
        let bench = evalfleet_config::bench::load_bench(&file).unwrap();
        let endpoint = &bench.models[0].endpoint;
        let shown = redact_engine(
            "args: Namespace(api_key='sk-cmd-0001') key=sk-key-0002 on port 1",
            endpoint,
        );
        assert_eq!(shown, "args: Namespace(api_key='***') key=*** on port 1");
    }

    fn event(at_ms: i64, kind: EventKind, endpoint: &str) -> Event {
        Event {
            at_ms,
            kind,
            endpoint: Some(endpoint.to_owned()),
            message: String::new(),
        }
    }

    #[test]
    fn an_engine_s_last_turn_is_its_last_start_and_the_ready_after_it() {
        let events = [
            event(10, EventKind::Started, "a"),
            event(30, EventKind::Ready, "a"),
            event(40, EventKind::Started, "b"),
            event(100, EventKind::Started, "a"),
            event(150, EventKind::Ready, "b"),
            event(170, EventKind::Ready, "a"),
        ];
        assert_eq!(last_turn(&events, "a"), Some((100, 170)));
        assert_eq!(last_turn(&events, "b"), Some((40, 150)));
        assert_eq!(last_turn(&events, "c"), None);
        assert_eq!(last_turn(&events[..4], "a"), None, "no ready after it");
    }

    #[test]
    fn a_cell_s_gpu_memory_is_summed_over_its_gpus_at_each_sample() {
        let gpu = |name: &str, at_ms: i64, mb: f64| {
            ResourcePoint::sample(
                evalfleet_types::ResourceSeries {
                    source: ResourceSource::Gpu,
                    name: name.to_owned(),
                    metric: ResourceMetric::GpuMemoryMb,
                },
                at_ms,
                mb,
            )
        };
        // A tensor-parallel engine on GPUs 0 and 1, 40 GB each at once.
        let points = [
            gpu("0", 10, 1_000.0),
            gpu("1", 10, 1_000.0),
            gpu("0", 20, 40_000.0),
            gpu("1", 20, 40_000.0),
            gpu("0", 30, 40_000.0),
            gpu("1", 30, 2_000.0),
        ];
        assert_eq!(cell_gpu_memory_peak(&points, "a"), Some(80_000.0));
        assert_eq!(cell_gpu_memory_peak(&[], "a"), None);
        // The engine's own processes' memory, where the run attributed it.
        let mut own = gpu("a", 20, 30_000.0);
        own.series.source = ResourceSource::Endpoint;
        let mut with_own = points.to_vec();
        with_own.push(own);
        assert_eq!(cell_gpu_memory_peak(&with_own, "a"), Some(30_000.0));
    }

    #[test]
    fn bench_names_are_file_names_of_their_own() {
        assert!(is_bench_name("vlm-docs_1.2"));
        assert!(!is_bench_name("../x"));
        assert!(!is_bench_name(".hidden"));
        assert!(!is_bench_name(""));
    }
}
