//! Creating and resuming runs: registering a dataset's items, checking that a
//! resumed run still has the same dataset and task, and running a session
//! from start to its stored status.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use evalfleet_config::{Config, LoadedConfig};
use evalfleet_fleet::Endpoint;
use evalfleet_fleet::runtime::FleetHandle;
use evalfleet_io::dataset::{DatasetError, RowReader, Scanner, hash_within, sample_id, sample_key};
use evalfleet_io::fingerprint::Fingerprint;
use evalfleet_io::template::Templates;
use evalfleet_pipeline::task;
use evalfleet_pipeline::{self as pipeline, OpenStore, PipelineError, Progress, Session};
use evalfleet_store::WorkerInfo;
use evalfleet_store::worker;
use evalfleet_store::{
    CreateRunError, ItemSource, NewItem, NewRun, RunIdentity, RunRecord, Store, StoreError,
};
use evalfleet_types::{Event, EventKind, RunStatus, StateCounts, now_ms};

/// The items of a dataset, read once, for [`Store::create_run`].
pub struct DatasetItems<'a> {
    config: &'a Config,
    templates: &'a Templates,
    scanner: Option<Scanner>,
    seq: u64,
    /// With `task.n` > 1: the row whose samples are being registered, and
    /// the next sample's index.
    repeating: Option<(NewItem, u32)>,
    /// Rows whose templates cannot be rendered: the first few (line and
    /// why), and how many in all.
    unrenderable: Vec<(u64, String)>,
    unrenderable_count: u64,
}

/// Rows without their templates' fields named when a run is refused.
const UNRENDERABLE_NAMED: usize = 5;

impl<'a> DatasetItems<'a> {
    /// Opens the dataset; for CSV, checks the templates against its columns
    /// before reading any row.
    pub fn open(config: &'a Config, templates: &'a Templates) -> Result<Self, CreateRunError> {
        let scanner = Scanner::open(&config.dataset)?;
        if let Some(columns) = scanner.columns() {
            let columns = columns.iter().cloned().collect();
            templates.check_fields(&columns, "the CSV header does not have")?;
        }
        Ok(Self {
            config,
            templates,
            scanner: Some(scanner),
            seq: 0,
            repeating: None,
            unrenderable: Vec::new(),
            unrenderable_count: 0,
        })
    }
}

impl ItemSource for DatasetItems<'_> {
    fn next_item(&mut self) -> Result<Option<NewItem>, CreateRunError> {
        let samples = self.config.task.samples;
        if samples == 1 {
            return self.next_row();
        }
        // Each row becomes `samples` items: ID#0, ID#1, ...
        let (row, k) = match self.repeating.take() {
            Some((row, k)) if k < samples => (row, k),
            _ => match self.next_row()? {
                Some(row) => (row, 0),
                None => return Ok(None),
            },
        };
        if k > 0 {
            self.seq += 1;
        }
        let item = NewItem {
            item_id: sample_id(&row.item_id, k),
            seq: if k == 0 { row.seq } else { self.seq },
            ..row.clone()
        };
        self.repeating = Some((row, k + 1));
        Ok(Some(item))
    }

    fn finish(&mut self) -> Result<RunIdentity, CreateRunError> {
        self.finish_rows()
    }

    fn path(&self) -> String {
        self.config.dataset.path.display().to_string()
    }
}

impl DatasetItems<'_> {
    fn next_row(&mut self) -> Result<Option<NewItem>, CreateRunError> {
        if self
            .config
            .dataset
            .limit
            .is_some_and(|limit| self.seq >= limit)
        {
            return Ok(None);
        }
        let Some(scanner) = self.scanner.as_mut() else {
            return Ok(None);
        };
        // A row that lacks a field its templates use is rendered to see
        // whether it matters (a field used under `{% if %}` does not): the
        // templates of most rows are not rendered here, only looked up.
        let templates = self.templates;
        let variables = templates.variables();
        let mut check = |row: &evalfleet_io::dataset::Row| {
            if variables.iter().all(|v| row.contains_key(v)) {
                return None;
            }
            templates.render_parts(row).err()
        };
        let Some(row) = scanner.next_row_checked(&mut check)? else {
            return Ok(None);
        };
        if let Some(problem) = row.problem {
            self.unrenderable_count += 1;
            if self.unrenderable.len() < UNRENDERABLE_NAMED {
                self.unrenderable.push((row.line, problem));
            }
        }
        let dataset = &self.config.dataset;
        if let Some(message) = &row.invalid
            && !dataset.skip_invalid
        {
            return Err(DatasetError::Row {
                path: dataset.path.clone(),
                line: row.line,
                message: format!(
                    "{message} (set dataset.skip_invalid: true to record such rows as failed items)"
                ),
            }
            .into());
        }
        self.seq += 1;
        Ok(Some(NewItem {
            sample_key: sample_key(dataset.sample.map_or(0, |s| s.seed), &row.id),
            item_id: row.id,
            seq: self.seq,
            line: row.line,
            offset: row.offset,
            invalid: row.invalid,
        }))
    }

    fn finish_rows(&mut self) -> Result<RunIdentity, CreateRunError> {
        let Some(scanner) = self.scanner.take() else {
            return Err(CreateRunError::Store(StoreError::Invariant(
                "the dataset was finished twice".to_owned(),
            )));
        };
        if self.seq == 0 {
            return Err(DatasetError::Empty {
                path: self.config.dataset.path.clone(),
            }
            .into());
        }
        let csv = scanner.columns().is_some();
        let summary = scanner.finish();
        if !csv && self.seq > 0 && summary.fields.len() < 4096 {
            self.templates
                .check_fields(&summary.fields, "no row of the dataset has")?;
        }
        if let Some((_, first)) = self.unrenderable.first() {
            let file = self.config.dataset.path.display();
            let lines: Vec<String> = self
                .unrenderable
                .iter()
                .map(|(line, _)| line.to_string())
                .collect();
            let more = self.unrenderable_count - self.unrenderable.len() as u64;
            return Err(evalfleet_io::template::TemplateError {
                path: "task.messages".to_owned(),
                message: format!(
                    "{} row(s) of {file} cannot be rendered, the first at line(s) {}{}: {first}",
                    self.unrenderable_count,
                    lines.join(", "),
                    if more > 0 {
                        format!(" and {more} more")
                    } else {
                        String::new()
                    }
                ),
            }
            .into());
        }
        Ok(RunIdentity {
            fingerprint: Fingerprint::new(self.config, summary.identity.sha256.clone()),
            dataset: summary.identity,
            // A row's samples share its sample key, so a sample of n rows
            // keeps n × K items.
            sample_n: self
                .config
                .dataset
                .sample
                .map(|s| s.n * u64::from(self.config.task.samples)),
        })
    }
}

/// Creates a run: registers every item of the dataset (or the sample) in one
/// transaction, so that a bad dataset leaves nothing behind.
pub fn create(
    store: &mut dyn Store,
    loaded: &LoadedConfig,
    templates: &Templates,
    run_id: &str,
) -> Result<RunRecord, CreateRunError> {
    // A template problem is placed in the config file, with its line.
    let placed = |err: CreateRunError| match err {
        CreateRunError::Template(err) => {
            CreateRunError::Config(loaded.problems(vec![(err.path.clone(), err.to_string())]))
        }
        other => other,
    };
    let mut items = DatasetItems::open(&loaded.config, templates).map_err(placed)?;
    let run = NewRun {
        run_id: run_id.to_owned(),
        name: loaded.config.name.clone(),
        config: loaded.snapshot.clone(),
        config_dir: loaded.dir.display().to_string(),
        created_at_ms: now_ms(),
    };
    store.create_run(&run, &mut items).map_err(placed)
}

/// Why a run cannot be resumed with this config.
#[derive(Debug, thiserror::Error)]
pub enum ResumeError {
    #[error(
        "run '{run_id}' cannot be resumed: what determines its results changed:\n  - {}",
        changes.join("\n  - ")
    )]
    Changed {
        run_id: String,
        changes: Vec<String>,
    },
    #[error("cannot check the dataset {}: {source}", path.display())]
    Dataset {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl ResumeError {
    /// A changed dataset or task, or a dataset that cannot be read: the
    /// user's to fix.
    pub fn fault(&self) -> evalfleet_types::Fault {
        evalfleet_types::Fault::BadInput
    }
}

/// Checks that `config` would give the stored run the same results: the same
/// dataset content and reading options, the same task.
pub fn check_resume(record: &RunRecord, config: &Config) -> Result<(), ResumeError> {
    let path = &config.dataset.path;
    evalfleet_io::dataset::materialize(&config.dataset).map_err(|source| ResumeError::Dataset {
        path: path.clone(),
        source,
    })?;
    // A config from outside reads beneath its roots only.
    let confine = evalfleet_io::confine::Confine::of(config.dataset.roots.as_deref());
    let same_file = if record.dataset.path == *path {
        record.dataset.matches_within(&confine, path)
    } else {
        // Another path (the dataset moved): compare content.
        hash_within(&confine, path).map(|sha| sha == record.dataset.sha256)
    }
    .map_err(|source| ResumeError::Dataset {
        path: path.clone(),
        source,
    })?;
    let dataset_sha = if same_file {
        record.dataset.sha256.clone()
    } else {
        hash_within(&confine, path).map_err(|source| ResumeError::Dataset {
            path: path.clone(),
            source,
        })?
    };
    let current = Fingerprint::new(config, dataset_sha);
    let changes = record.fingerprint.differences(&current);
    if changes.is_empty() {
        Ok(())
    } else {
        Err(ResumeError::Changed {
            run_id: record.run_id.clone(),
            changes,
        })
    }
}

/// How a session ended, as the CLI reports it.
#[derive(Debug, Clone)]
pub struct SessionReport {
    pub status: RunStatus,
    pub counts: StateCounts,
    pub message: Option<String>,
}

/// Everything a session needs besides its stores.
pub struct SessionPlan {
    pub run_id: String,
    pub config: Arc<Config>,
    pub templates: Arc<Templates>,
    pub endpoints: Vec<Arc<Endpoint>>,
    pub fleet: FleetHandle,
    pub retry_failed: bool,
    /// Where the code judge's sandboxes go.
    pub sandbox_dir: std::path::PathBuf,
    /// What the run's agents must not see, wherever it lies: the store
    /// (its file and its folder) and the response cache.
    pub hidden: Vec<std::path::PathBuf>,
    /// Where a conversation's decisions go when a trainer takes them
    /// (`evalfleet env`).
    pub gym: Option<Arc<task::conversation::gym::Gym>>,
    /// What serves an exec task's gateway (the binary's server); `None`
    /// where this process serves none.
    pub gateway_host: Option<Arc<dyn task::exec::GatewayHost>>,
    /// Told of each result once it is committed (a sheet's sink).
    pub on_result: Option<evalfleet_pipeline::ResultTap>,
}

/// The live counters of a session about to run, for a progress display.
pub struct Prepared {
    pub progress: Arc<Progress>,
    session: u32,
    worker: WorkerInfo,
}

impl Prepared {
    /// This process's name as a worker of the run.
    pub fn worker(&self) -> &str {
        &self.worker.worker
    }
}

/// Registers this process as a worker of the run (freeing the items of
/// workers whose process is gone), marks the run running and counts its
/// items, before the session starts.
pub fn prepare(store: &mut dyn Store, plan: &SessionPlan) -> Result<Prepared, StoreError> {
    let dead = worker::release_dead(store, &plan.run_id)?;
    if dead > 0 {
        tracing::info!(
            "Freed the items of {dead} earlier worker(s) of run {} whose process is gone.",
            plan.run_id
        );
    }
    let others = worker::live_workers(store, &plan.run_id)?;
    let mut me = worker::this_process(plan.config.timeouts.lease);
    let start = store.begin_session(&plan.run_id, &mut me, plan.retry_failed)?;
    let counts = start.counts;
    let endpoints: Vec<&str> = plan.endpoints.iter().map(|e| e.name.as_str()).collect();
    let message = if !others.is_empty() {
        format!(
            "Session {} joined {} running worker(s) with endpoints {}; {} items pending.",
            start.session,
            others.len(),
            endpoints.join(", "),
            counts.pending
        )
    } else if start.session == 1 {
        format!(
            "Run started with endpoints {}; {} items.",
            endpoints.join(", "),
            counts.total()
        )
    } else {
        format!(
            "Session {} started with endpoints {}; {} items pending{}.",
            start.session,
            endpoints.join(", "),
            counts.pending,
            if start.reset > 0 {
                format!(" ({} failed items to retry)", start.reset)
            } else {
                String::new()
            }
        )
    };
    if !others.is_empty() {
        tracing::info!("{message}");
    }
    store.add_events(
        &plan.run_id,
        &[Event {
            at_ms: now_ms(),
            kind: EventKind::SessionStarted,
            endpoint: None,
            message,
        }],
    )?;
    Ok(Prepared {
        progress: Arc::new(Progress::new(
            counts.total(),
            counts.done,
            counts.failed,
            &plan.endpoints,
        )),
        session: start.session,
        worker: me,
    })
}

/// Starts the task and drives the session's items.
async fn session(
    plan: SessionPlan,
    prepared: Prepared,
    open: Arc<OpenStore>,
    stop: CancellationToken,
) -> Result<pipeline::SessionEnd, PipelineError> {
    let rows = RowReader::open(&plan.config.dataset)?;
    // Whatever can fail at the start fails before anything runs.
    // A conversation that asks for topics avoids those of the run's stored
    // episodes (read only then: it reads every stored output).
    let asks_topics = plan
        .config
        .task
        .kind
        .conversation()
        .is_some_and(|settings| settings.topics.is_empty());
    let used_topics = if asks_topics {
        let mut outputs = Vec::new();
        open()?.scan_results(&plan.run_id, &mut |r| outputs.extend(r.output))?;
        task::conversation::topics_of(outputs)
    } else {
        Vec::new()
    };
    // A stop while the task starts (a metric backend's setup may take
    // long) ends it: what it started is killed as its future is dropped.
    // An exec task's agents call the fleet through the gateway, whose
    // calls in flight end with the session.
    let gateway_stop = CancellationToken::new();
    let agents = match (plan.config.task.kind.exec(), &plan.gateway_host) {
        (Some(settings), Some(host)) => Some(task::Agents {
            gateway: evalfleet_gateway::Gateway::new(
                &plan.run_id,
                plan.endpoints.clone(),
                plan.fleet.clone(),
                &settings.models,
                plan.config.timeouts.no_endpoint,
                gateway_stop.clone(),
            )
            .map_err(task::TaskError::Invalid)?,
            host: host.clone(),
        }),
        _ => None,
    };
    let gateway = agents.as_ref().map(|a| a.gateway.clone());
    let starting = task::start(
        &plan.config,
        plan.templates.clone(),
        &plan.sandbox_dir,
        &plan.hidden,
        used_topics,
        plan.gym.clone(),
        agents,
    );
    let task = tokio::select! {
        task = starting => task?,
        () = stop.cancelled() => return Err(task::TaskError::Stopped.into()),
    };
    let session = Session {
        run_id: plan.run_id,
        session: prepared.session,
        config: plan.config,
        task,
        endpoints: plan.endpoints,
        fleet: plan.fleet,
        worker: Arc::from(prepared.worker.worker.as_str()),
        gateway: gateway.clone(),
        on_result: plan.on_result,
    };
    let ended = pipeline::execute(session, open, rows, prepared.progress, stop).await;
    // Agents' calls still in flight are abandoned with the session.
    if let Some(gateway) = gateway {
        gateway.shutdown().await;
    }
    ended
}

/// Records that this worker stopped on an error: the run is interrupted,
/// unless other workers go on with it.
fn stopped_by_error(
    store: &mut dyn Store,
    run_id: &str,
    me: &str,
    message: &str,
) -> Result<(), StoreError> {
    let others = worker::live_workers(store, run_id)?
        .into_iter()
        .filter(|w| w.worker != me)
        .count();
    if others > 0 {
        return store.add_events(
            run_id,
            &[Event {
                at_ms: now_ms(),
                kind: EventKind::Interrupted,
                endpoint: None,
                message: format!("this worker {message}; {others} other worker(s) go on"),
            }],
        );
    }
    store
        .set_status(run_id, RunStatus::Interrupted, Some(message))
        .map(|_| ())
}

/// Runs a prepared session and stores how it ended.
pub async fn run_session(
    plan: SessionPlan,
    prepared: Prepared,
    open: Arc<OpenStore>,
    stop: CancellationToken,
) -> Result<SessionReport, PipelineError> {
    let run_id = plan.run_id.clone();
    let worker = prepared.worker.worker.clone();
    let fleet = plan.fleet.clone();
    let cache = plan.config.cache.clone();
    let end = match session(plan, prepared, open.clone(), stop.clone()).await {
        Ok(end) => end,
        Err(err) => {
            let message = format!("stopped by an error: {err}");
            match open() {
                Ok(mut store) => {
                    if let Err(also) = stopped_by_error(&mut *store, &run_id, &worker, &message) {
                        tracing::warn!("Could not record how run {run_id} stopped: {also}");
                    }
                }
                Err(also) => tracing::warn!("Could not record how run {run_id} stopped: {also}"),
            }
            return Err(err);
        }
    };
    let mut store = end.store;
    if cache.mode.writes() && (cache.ttl.is_some() || cache.max_entries.is_some()) {
        let before = cache
            .ttl
            .map(|ttl| now_ms() - i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX));
        let gone = store.cache_evict(before, cache.max_entries)?;
        if gone > 0 {
            tracing::info!("Evicted {gone} cached answers (cache.ttl / cache.max_entries).");
        }
    }
    // Others first: a worker that is gone has committed all it will, so
    // the counts read after are final for it.
    let others = worker::live_workers(&mut *store, &run_id)?;
    let counts = store.counts(&run_id)?;
    let (status, kind, message) = if counts.pending == 0 {
        (RunStatus::Finished, EventKind::Finished, None)
    } else if !others.is_empty() {
        // The run goes on in its other workers; it stays running.
        let message = format!(
            "this worker stopped with {} items pending; {} other worker(s) go on",
            counts.pending,
            others.len()
        );
        store.add_events(
            &run_id,
            &[Event {
                at_ms: now_ms(),
                kind: EventKind::Interrupted,
                endpoint: None,
                message: message.clone(),
            }],
        )?;
        return Ok(SessionReport {
            status: RunStatus::Running,
            counts,
            message: Some(message),
        });
    } else if let Some(reason) = fleet.exhausted_reason() {
        (
            RunStatus::Interrupted,
            EventKind::Interrupted,
            Some(format!("{reason} {} items pending.", counts.pending)),
        )
    } else if stop.is_cancelled() {
        (
            RunStatus::Interrupted,
            EventKind::Interrupted,
            Some(format!(
                "interrupted by the user with {} items pending",
                counts.pending
            )),
        )
    } else {
        (
            RunStatus::Interrupted,
            EventKind::Interrupted,
            Some(format!("stopped with {} items pending", counts.pending)),
        )
    };
    let changed = store.set_status(&run_id, status, message.as_deref())?;
    // The run's end is logged once: by the worker that ended it, not by
    // each worker that finds it over.
    if changed || status != RunStatus::Finished {
        store.add_events(
            &run_id,
            &[Event {
                at_ms: now_ms(),
                kind,
                endpoint: None,
                message: message.clone().unwrap_or_else(|| {
                    format!("Finished: {} done, {} failed.", counts.done, counts.failed)
                }),
            }],
        )?;
    }
    Ok(SessionReport {
        status,
        counts,
        message,
    })
}
