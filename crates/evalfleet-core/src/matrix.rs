//! A benchmark matrix run model by model: each model's engine loaded for
//! its turn, its unfinished cells run against it (each an ordinary run,
//! created or resumed), the engine unloaded and its GPU memory waited for.
//! Engines are loaded and unloaded through the fleet's [`EngineTurn`];
//! nothing here reaches into the pipeline. How a cell's session is attended
//! (its last lines) is the front end's ([`CellRunner`]).

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use evalfleet_config::bench::{BenchCell, BenchConfig, BenchModel};
use evalfleet_config::{Config, EndpointConfig, EndpointKind, GpuSelection};
use evalfleet_fleet::engine::Launcher;
use evalfleet_fleet::runtime::GpuPolicy;
use evalfleet_fleet::turn::EngineTurn;
use evalfleet_store::prelude::*;
use evalfleet_store::{Location, OpenOptions, RunRecord, StoreError};
use evalfleet_types::{Event, EventKind, RunStatus, now_ms};
use tokio_util::sync::CancellationToken;

use crate::bench::{self, CELL_FAILED, Manifest};
use crate::error::SessionError;
use crate::frontend::{Frontend, UsageError};
use crate::run;
use crate::session::{
    Resumable, Resume, Session, check_gpus, checked_templates, register, resumable_with,
};

/// How long an unloaded engine's GPU memory may take to come back.
const RELEASE_DEADLINE: Duration = Duration::from_secs(120);

/// How a cell's session ended, as the matrix needs to know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CellEnd {
    /// Its items were answered (or failed).
    Ended,
    /// It was stopped before its end: the matrix stops too.
    Interrupted,
}

/// Runs a cell's session to its end, stopping it when `stop` is cancelled;
/// an error says why it stopped.
pub trait CellRunner: Send + Sync {
    fn run(
        &self,
        session: Session,
        stop: CancellationToken,
    ) -> Pin<Box<dyn Future<Output = Result<CellEnd, String>> + Send + '_>>;
}

/// A matrix to run.
#[derive(Clone, Copy)]
pub struct Matrix<'a> {
    /// The store its cells' runs go to.
    pub location: &'a Location,
    /// `-y`: engines may start on GPUs someone else is using.
    pub yes: bool,
    /// Cancelled to stop the matrix (its running cell stops as a run does).
    pub stop: &'a CancellationToken,
    pub frontend: &'a Frontend,
    pub cells: &'a dyn CellRunner,
}

/// Runs `bench`'s models in turn, each its unfinished cells. Refused, before
/// any engine is loaded or any run touched, when a run that holds a cell's
/// run id is not that cell's run.
pub async fn run_matrix(bench: &BenchConfig, matrix: Matrix<'_>) -> Result<Tally, SessionError> {
    let location = matrix.location;
    let dir = location.dir();
    std::fs::create_dir_all(&dir).map_err(|source| SessionError::Write {
        what: format!("cannot make the store's folder {}", dir.display()),
        source,
    })?;
    check_cells_runs(location, bench)?;
    Manifest {
        store: Some(Manifest::store_key(location)),
        ..Manifest::of(bench)
    }
    .write(&dir)
    .map_err(|source| SessionError::Write {
        what: format!("cannot write the bench's plan beside {location}"),
        source,
    })?;
    let launcher = Launcher {
        program: matrix.frontend.supervisor.clone(),
        log_dir: dir.join("bench").join(&bench.name),
        claims: std::path::absolute(dir.join(".engines"))?,
    };
    let mut tally = Tally::default();
    for model in &bench.models {
        if matrix.stop.is_cancelled() {
            tally.interrupted = true;
            break;
        }
        model_turn(model, &matrix, &launcher, &mut tally).await?;
    }
    if matrix.stop.is_cancelled() {
        tally.interrupted = true;
    }
    Ok(tally)
}

/// How the matrix went.
#[derive(Debug, Default)]
pub struct Tally {
    /// Cells that failed (their engine, or their run).
    pub failed: usize,
    /// Whether it was stopped before its end.
    pub interrupted: bool,
}

/// One model's turn: its engine loaded (when it has one), its unfinished
/// cells run, its engine unloaded and its GPU memory waited for.
async fn model_turn(
    model: &BenchModel,
    matrix: &Matrix<'_>,
    launcher: &Launcher,
    tally: &mut Tally,
) -> Result<(), SessionError> {
    let Matrix {
        location,
        yes,
        stop,
        frontend,
        cells: runner,
    } = *matrix;
    let say = &frontend.say;
    let mut todo: Vec<&BenchCell> = Vec::new();
    {
        let mut store = open_or_create(location)?;
        for cell in &model.cells {
            if !finished(&mut *store, &cell.run_id)? {
                todo.push(cell);
            }
        }
    }
    if todo.is_empty() {
        say(&format!(
            "Model {}: every cell is done; its engine is not loaded.",
            model.name
        ));
        return Ok(());
    }
    let mut turn = None;
    if model.endpoint.kind.engine().is_some() {
        say(&format!(
            "Model {}: loading its engine for {} cell(s).",
            model.name,
            todo.len()
        ));
        let loaded = match check_gpus(&todo[0].loaded.config, None, yes, frontend).await {
            Err(err) => Err(evalfleet_types::error_text(&err)),
            Ok(_) => EngineTurn::load(&model.endpoint, launcher, stop).await,
        };
        match loaded {
            Ok(engine) => {
                say(&format!(
                    "Model {}: engine ready at {} in {:.2}s (pid {}).",
                    model.name,
                    engine.base_url,
                    (engine.ready_at_ms - engine.spawned_at_ms) as f64 / 1000.0,
                    engine.pid.map_or_else(|| "?".to_owned(), |p| p.to_string())
                ));
                turn = Some(engine);
            }
            Err(_) if stop.is_cancelled() => return Ok(()),
            Err(why) => {
                let why = bench::redact_engine(
                    &format!("the engine of model {} did not start: {why}", model.name),
                    &model.endpoint,
                );
                say(&format!("{why}; its cells are marked failed."));
                for cell in &todo {
                    if fail_cell(location, cell, &why)? {
                        tally.failed += 1;
                    }
                }
                return Ok(());
            }
        }
    }
    let mut ran: Vec<&str> = Vec::new();
    for cell in &todo {
        if stop.is_cancelled() {
            break;
        }
        // The engine is watched while the cell runs: if it dies, the cell
        // stops at once (its calls would only fail) and is marked failed.
        let loaded = turn.as_ref().map(Loaded::of);
        let cell_stop = stop.child_token();
        let running = run_cell(
            location,
            cell,
            loaded.as_ref(),
            &cell_stop,
            frontend,
            runner,
        );
        tokio::pin!(running);
        let mut died = None;
        let code = loop {
            tokio::select! {
                code = &mut running => break code,
                () = engine_exit(turn.as_mut()), if died.is_none() => {
                    let log = turn.as_ref().map(|t| t.log().display().to_string());
                    died = Some(format!(
                        "the engine of model {} exited during its turn (log {})",
                        model.name,
                        log.unwrap_or_default()
                    ));
                    cell_stop.cancel();
                }
            }
        };
        ran.push(&cell.run_id);
        if let Some(why) = died {
            let why = bench::redact_engine(&why, &model.endpoint);
            say(&format!("{why}; its unfinished cells are marked failed."));
            for left in todo.iter().skip(ran.len() - 1) {
                if fail_cell(location, left, &why)? {
                    tally.failed += 1;
                }
            }
            break;
        }
        match code {
            Ok(CellEnd::Interrupted) => {
                tally.interrupted = true;
                break;
            }
            Ok(CellEnd::Ended) => {}
            Err(err) => {
                say(&format!("Cell {} stopped: {err}", cell.run_id));
                tally.failed += 1;
            }
        }
    }
    if let Some(engine) = turn {
        let released = engine.unload(RELEASE_DEADLINE).await;
        let took = (released.released_at_ms - released.stopping_at_ms) as f64 / 1000.0;
        let message = format!(
            "Unloaded the engine of model {} in {took:.2}s: {}.",
            model.name, released.note
        );
        say(&message);
        if !released.clean {
            say(&format!(
                "warning: {}; the next engine's start checks its GPU again",
                released.note
            ));
        }
        let mut store = evalfleet_store::open(location, &OpenOptions::default())?;
        for run_id in ran {
            store.add_events(
                run_id,
                &[Event {
                    at_ms: released.released_at_ms,
                    kind: EventKind::Stopped,
                    endpoint: Some(model.name.clone()),
                    message: message.clone(),
                }],
            )?;
        }
    }
    Ok(())
}

/// Refuses the bench, before any engine is loaded or any run touched, when
/// a run that holds a cell's run id is not that cell's run (another bench's,
/// one given the id by hand, or made from this file before it was edited).
fn check_cells_runs(location: &Location, bench: &BenchConfig) -> Result<(), SessionError> {
    if !location.exists() {
        return Ok(());
    }
    let mut store = evalfleet_store::open(location, &OpenOptions::default())?;
    let mut refused = Vec::new();
    for cell in bench.cells() {
        if let Some(record) = stored_run(&mut *store, &cell.run_id)?
            && let Err(why) = tokio::task::block_in_place(|| bench::check_cell_run(&record, cell))
        {
            refused.push(why);
        }
    }
    if refused.is_empty() {
        return Ok(());
    }
    Err(UsageError(format!("bench {}: {}", bench.name, refused.join("\n"))).into())
}

/// The store, made when it does not exist yet.
fn open_or_create(location: &Location) -> Result<Box<dyn Store>, StoreError> {
    evalfleet_store::open(
        location,
        &OpenOptions {
            create: true,
            ..OpenOptions::default()
        },
    )
}

/// A cell's run, when it has one.
fn stored_run(store: &mut dyn Store, run_id: &str) -> Result<Option<RunRecord>, StoreError> {
    match store.run(run_id) {
        Ok(record) => Ok(Some(record)),
        Err(StoreError::NoSuchRun(_)) => Ok(None),
        Err(err) => Err(err),
    }
}

/// Whether a cell's run exists and every item of it ended.
fn finished(store: &mut dyn Store, run_id: &str) -> Result<bool, StoreError> {
    Ok(stored_run(store, run_id)?.is_some_and(|r| r.status == RunStatus::Finished))
}

/// With `telemetry.gpus: auto`, the cell's run samples the GPUs its local
/// engine was given (every GPU when it was given none), as a run that
/// started the engine itself would: once served by the bench's engine, the
/// run has no local engine of its own to tell them.
fn sample_the_engine_s_gpus(config: &mut Config) {
    if !matches!(config.telemetry.gpus, GpuSelection::Auto) {
        return;
    }
    if let EndpointKind::Local(engine) = &config.endpoints[0].kind {
        config.telemetry.gpus = match &engine.gpu {
            None => GpuSelection::All,
            Some(devices) => GpuSelection::Listed(
                devices
                    .split(',')
                    .filter_map(|d| d.trim().parse::<u32>().ok())
                    .collect(),
            ),
        };
    }
}

/// The cell's endpoint, served by the engine the bench loaded at
/// `base_url`, its process `pid` sampled as the run's own engine's would
/// be (the stored config keeps the endpoint as written).
fn served_by_turn(endpoint: &mut EndpointConfig, base_url: &str, pid: Option<u32>) {
    endpoint.engine_pid = pid;
    let health = endpoint.kind.engine().map(|e| e.health_path().to_owned());
    endpoint.health.path = endpoint.health.path.take().or(health);
    endpoint.kind = EndpointKind::External {
        base_url: base_url.to_owned(),
        start_cmd: None,
        stop_cmd: None,
    };
}

/// What a cell needs to know of the engine loaded for it.
struct Loaded {
    base_url: String,
    pid: Option<u32>,
    spawned_at_ms: i64,
    ready_at_ms: i64,
}

impl Loaded {
    fn of(turn: &EngineTurn) -> Self {
        Self {
            base_url: turn.base_url.clone(),
            pid: turn.pid,
            spawned_at_ms: turn.spawned_at_ms,
            ready_at_ms: turn.ready_at_ms,
        }
    }
}

/// Ends when the loaded engine has exited on its own; never without one.
async fn engine_exit(turn: Option<&mut EngineTurn>) {
    match turn {
        Some(turn) => turn.exited().await,
        None => std::future::pending().await,
    }
}

async fn run_cell(
    location: &Location,
    cell: &BenchCell,
    turn: Option<&Loaded>,
    stop: &CancellationToken,
    frontend: &Frontend,
    runner: &dyn CellRunner,
) -> Result<CellEnd, String> {
    let session = match cell_session(location, cell, turn, frontend).await {
        Ok(Some(session)) => session,
        Ok(None) => return Ok(CellEnd::Ended),
        Err(err) => return Err(evalfleet_types::error_text(&err)),
    };
    runner.run(session, stop.child_token()).await
}

/// A cell's session: its run created (first time) or resumed (its
/// unfinished items only), against the model's loaded engine; `None` when
/// its run has nothing left to answer.
async fn cell_session(
    location: &Location,
    cell: &BenchCell,
    turn: Option<&Loaded>,
    frontend: &Frontend,
) -> Result<Option<Session>, SessionError> {
    let say = &frontend.say;
    let started = Instant::now();
    let mut loaded = cell.loaded.clone();
    if let Some(turn) = turn {
        sample_the_engine_s_gpus(&mut loaded.config);
        served_by_turn(&mut loaded.config.endpoints[0], &turn.base_url, turn.pid);
    }
    let mut store = open_or_create(location)?;
    let session = match stored_run(&mut *store, &cell.run_id)? {
        None => {
            drop(store);
            say(&format!("Cell {}: starting.", cell.run_id));
            let templates = checked_templates(&loaded)?;
            register(
                loaded,
                templates,
                location.clone(),
                Some(cell.run_id.clone()),
                None,
                GpuPolicy::Allow,
                started,
            )?
        }
        Some(record) => {
            say(&format!(
                "Cell {}: resuming its unfinished items.",
                cell.run_id
            ));
            let asked = Resume {
                retry_failed: false,
                endpoints: &[],
                yes: true,
                roots: None,
            };
            match resumable_with(location.clone(), store, &record, loaded, asked, frontend).await? {
                Resumable::Nothing { .. } => return Ok(None),
                Resumable::Session(session) => *session,
            }
        }
    };
    if let Some(turn) = turn {
        let mut store = evalfleet_store::open(location, &OpenOptions::default())?;
        let model = &cell.model;
        store.add_events(
            &cell.run_id,
            &[
                Event {
                    at_ms: turn.spawned_at_ms,
                    kind: EventKind::Started,
                    endpoint: Some(model.clone()),
                    message: format!(
                        "Bench: started the engine of model {model} (pid {}).",
                        turn.pid.map_or_else(|| "?".to_owned(), |p| p.to_string())
                    ),
                },
                Event {
                    at_ms: turn.ready_at_ms,
                    kind: EventKind::Ready,
                    endpoint: Some(model.clone()),
                    message: format!(
                        "Bench: the engine of model {model} is ready at {} ({:.2}s).",
                        turn.base_url,
                        (turn.ready_at_ms - turn.spawned_at_ms) as f64 / 1000.0
                    ),
                },
            ],
        )?;
    }
    Ok(Some(session))
}

/// Marks a cell failed with `why`: its run is created when it has none
/// (its items registered, none answered), and left interrupted with the
/// reason, so that running the bench again tries it again. A cell whose
/// run has finished (its last item ended as its engine exited) is left
/// finished; false then.
fn fail_cell(location: &Location, cell: &BenchCell, why: &str) -> Result<bool, SessionError> {
    let mut store = open_or_create(location)?;
    match stored_run(&mut *store, &cell.run_id)? {
        Some(record) if record.status == RunStatus::Finished => return Ok(false),
        Some(_) => {}
        None => {
            let templates = checked_templates(&cell.loaded)?;
            tokio::task::block_in_place(|| {
                run::create(&mut *store, &cell.loaded, &templates, &cell.run_id)
            })?;
        }
    }
    let message = format!("{CELL_FAILED}{why}");
    store.set_status(&cell.run_id, RunStatus::Interrupted, Some(&message))?;
    store.add_events(
        &cell.run_id,
        &[Event {
            at_ms: now_ms(),
            kind: EventKind::StartFailed,
            endpoint: Some(cell.model.clone()),
            message,
        }],
    )?;
    Ok(true)
}
