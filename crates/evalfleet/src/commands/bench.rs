//! `evalfleet bench`: a benchmark matrix run model by model, each model's
//! engine loaded for its turn; `bench status` and `bench report`.
//!
//! The planner stands above runs: each cell is an ordinary run (created,
//! or resumed, then executed as `run` and `resume` do), pointed at the
//! engine the planner loaded; engines are loaded and unloaded through the
//! fleet's [`EngineTurn`]. Nothing here reaches into the pipeline.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use evalfleet_config::bench::{BenchCell, BenchConfig, BenchModel, load_bench};
use evalfleet_config::{Config, EndpointConfig, EndpointKind, GpuSelection};
use evalfleet_core::bench::{self, BenchReport, CELL_FAILED, CellState, CellStatus, Manifest};
use evalfleet_core::run;
use evalfleet_fleet::engine::Launcher;
use evalfleet_fleet::runtime::GpuPolicy;
use evalfleet_fleet::turn::EngineTurn;
use evalfleet_store::prelude::*;
use evalfleet_store::{Location, OpenOptions};
use evalfleet_store::{RunRecord, StoreError};
use evalfleet_types::{Event, EventKind, RunStatus, now_ms};
use tokio_util::sync::CancellationToken;

use super::run::{Attendance, Resumable, checked_templates, execute, register, resumable_with};
use super::store_location;
use crate::cli::{BenchAction, BenchArgs, BenchFormat, BenchReportArgs, BenchStatusArgs};
use crate::ui;
use crate::{EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, UsageError};

/// How long an unloaded engine's GPU memory may take to come back.
const RELEASE_DEADLINE: Duration = Duration::from_secs(120);

pub async fn bench(args: BenchArgs) -> anyhow::Result<u8> {
    match args.action {
        Some(BenchAction::Status(args)) => status(args),
        Some(BenchAction::Report(args)) => report(args),
        None => {
            let Some(config) = args.config else {
                return Err(UsageError("bench: give a bench file".to_owned()).into());
            };
            run_bench(&config, args.store, args.yes).await
        }
    }
}

/// How the matrix went, for the exit code.
#[derive(Default)]
struct Tally {
    failed: usize,
    interrupted: bool,
}

async fn run_bench(file: &Path, store: Option<PathBuf>, yes: bool) -> anyhow::Result<u8> {
    let bench = load_bench(file)?;
    let location = store_location(store, bench.store.as_deref())?;
    let dir = location.dir();
    std::fs::create_dir_all(&dir)
        .with_context(|| format!("cannot make the store's folder {}", dir.display()))?;
    check_cells_runs(&location, &bench)?;
    Manifest::of(&bench)
        .write(&dir)
        .with_context(|| format!("cannot write the bench's plan beside {location}"))?;
    let launcher = Launcher {
        program: std::env::current_exe()?,
        log_dir: dir.join("bench").join(&bench.name),
        claims: std::path::absolute(dir.join(".engines"))?,
    };
    let stop = CancellationToken::new();
    // Outside the runs' tasks: it ends with the process.
    #[allow(clippy::disallowed_methods)]
    let signals = tokio::spawn(watch_signals(stop.clone(), bench.name.clone()));
    let mut tally = Tally::default();
    for model in &bench.models {
        if stop.is_cancelled() {
            tally.interrupted = true;
            break;
        }
        model_turn(model, &location, &launcher, yes, &stop, &mut tally).await?;
    }
    signals.abort();
    if stop.is_cancelled() {
        tally.interrupted = true;
    }
    let statuses = read_status(&location, &Manifest::of(&bench))?;
    print_status(&statuses);
    let unfinished = statuses
        .iter()
        .filter(|s| s.state != CellState::Done)
        .count();
    let program = ui::program();
    let again = format!(
        "{program} bench {}{}",
        file.display(),
        super::store_flag(&location)
    );
    let (code, message) = if tally.interrupted {
        (
            EXIT_INTERRUPTED,
            format!("interrupted with {unfinished} cell(s) unfinished. Finish it: {again}"),
        )
    } else if unfinished > 0 || tally.failed > 0 {
        (
            EXIT_FAILED,
            format!("{unfinished} cell(s) not done. Running it again tries them again: {again}"),
        )
    } else {
        (
            EXIT_OK,
            format!(
                "done. Compare the models: {program} bench report {}{}",
                bench.name,
                super::store_flag(&location)
            ),
        )
    };
    ui::note(&format!("Bench {} {message}", bench.name));
    Ok(code)
}

/// One model's turn: its engine loaded (when it has one), its unfinished
/// cells run, its engine unloaded and its GPU memory waited for.
async fn model_turn(
    model: &BenchModel,
    location: &Location,
    launcher: &Launcher,
    yes: bool,
    stop: &CancellationToken,
    tally: &mut Tally,
) -> anyhow::Result<()> {
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
        ui::note(&format!(
            "Model {}: every cell is done; its engine is not loaded.",
            model.name
        ));
        return Ok(());
    }
    let mut turn = None;
    if model.endpoint.kind.engine().is_some() {
        ui::note(&format!(
            "Model {}: loading its engine for {} cell(s).",
            model.name,
            todo.len()
        ));
        let loaded = match crate::fleet::check_gpus(&todo[0].loaded.config, None, yes).await {
            Err(err) => Err(format!("{err:#}")),
            Ok(_) => EngineTurn::load(&model.endpoint, launcher, stop).await,
        };
        match loaded {
            Ok(engine) => {
                ui::note(&format!(
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
                ui::note(&format!("{why}; its cells are marked failed."));
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
        let running = run_cell(location, cell, loaded.as_ref(), &cell_stop);
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
            ui::note(&format!("{why}; its unfinished cells are marked failed."));
            for left in todo.iter().skip(ran.len() - 1) {
                if fail_cell(location, left, &why)? {
                    tally.failed += 1;
                }
            }
            break;
        }
        match code {
            Ok(EXIT_INTERRUPTED) => {
                tally.interrupted = true;
                break;
            }
            Ok(_) => {}
            Err(err) => {
                ui::note(&format!("Cell {} stopped: {err:#}", cell.run_id));
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
        ui::note(&message);
        if !released.clean {
            ui::note(&format!(
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
fn check_cells_runs(location: &Location, bench: &BenchConfig) -> anyhow::Result<()> {
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
/// `base_url` (the stored config keeps the endpoint as written).
fn served_by_turn(endpoint: &mut EndpointConfig, base_url: &str) {
    let health = endpoint.kind.engine().map(|e| e.health_path().to_owned());
    endpoint.health.path = endpoint.health.path.take().or(health);
    endpoint.kind = EndpointKind::External {
        base_url: base_url.to_owned(),
        start_cmd: None,
        stop_cmd: None,
    };
}

/// Runs one cell: its run created (first time) or resumed (its unfinished
/// items only), against the model's loaded engine.
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
) -> anyhow::Result<u8> {
    let started = Instant::now();
    let mut loaded = cell.loaded.clone();
    if let Some(turn) = turn {
        sample_the_engine_s_gpus(&mut loaded.config);
        served_by_turn(&mut loaded.config.endpoints[0], &turn.base_url);
    }
    let mut store = open_or_create(location)?;
    let session = match stored_run(&mut *store, &cell.run_id)? {
        None => {
            drop(store);
            ui::note(&format!("Cell {}: starting.", cell.run_id));
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
            ui::note(&format!(
                "Cell {}: resuming its unfinished items.",
                cell.run_id
            ));
            match resumable_with(location.clone(), store, &record, loaded, false, &[], true).await?
            {
                Resumable::Nothing { .. } => return Ok(EXIT_OK),
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
    execute(
        session,
        Attendance::Server {
            stop: stop.child_token(),
        },
    )
    .await
}

/// Marks a cell failed with `why`: its run is created when it has none
/// (its items registered, none answered), and left interrupted with the
/// reason, so that running the bench again tries it again. A cell whose
/// run has finished (its last item ended as its engine exited) is left
/// finished; false then.
fn fail_cell(location: &Location, cell: &BenchCell, why: &str) -> anyhow::Result<bool> {
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

/// First SIGINT or SIGTERM: the running cell stops taking items and the
/// bench stops after it (its engine unloaded). Second: exit at once (the
/// engine's supervisor ends it; committed results are safe).
async fn watch_signals(stop: CancellationToken, name: String) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut interrupt), Ok(mut terminate)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        tracing::warn!("Cannot listen for Ctrl-C; stop the bench with SIGKILL and run it again.");
        return;
    };
    tokio::select! {
        _ = interrupt.recv() => {}
        _ = terminate.recv() => {}
    }
    ui::note(
        "Stopping the bench: the running cell finishes its calls in flight, then its engine is unloaded. Press Ctrl-C again to abort at once.",
    );
    stop.cancel();
    tokio::select! {
        _ = interrupt.recv() => {}
        _ = terminate.recv() => {}
    }
    ui::note(&format!(
        "Aborted bench {name}. Committed results are safe; run the same command again to finish it."
    ));
    std::process::exit(i32::from(EXIT_INTERRUPTED));
}

/// The bench's plan from a bench file, or by its name beside the store.
fn manifest(bench: &str, store: Option<PathBuf>) -> anyhow::Result<(Location, Manifest)> {
    let file = Path::new(bench);
    if file.is_file() {
        let config = load_bench(file)?;
        let location = store_location(store, config.store.as_deref())?;
        return Ok((location, Manifest::of(&config)));
    }
    let location = store_location(store, None)?;
    let manifest = Manifest::read(&location.dir(), bench).map_err(UsageError)?;
    Ok((location, manifest))
}

fn read_status(location: &Location, manifest: &Manifest) -> anyhow::Result<Vec<CellStatus>> {
    if !location.exists() {
        return Ok(bench::status_without_store(manifest));
    }
    let mut store = evalfleet_store::open(location, &OpenOptions::read_only())?;
    Ok(bench::status(&mut *store, manifest)?)
}

fn status(args: BenchStatusArgs) -> anyhow::Result<u8> {
    let (location, manifest) = manifest(&args.bench, args.store.store)?;
    let statuses = read_status(&location, &manifest)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&statuses)?);
    } else {
        print_status(&statuses);
    }
    Ok(EXIT_OK)
}

fn print_status(statuses: &[CellStatus]) {
    println!(
        "{:<12} {:<12} {:<12} {:>5} {:>15}  run",
        "state", "model", "dataset", "conc", "items ended"
    );
    for s in statuses {
        println!(
            "{:<12} {:<12} {:<12} {:>5} {:>15}  {}{}",
            s.state.as_str(),
            s.plan.model,
            s.plan.dataset,
            s.plan
                .concurrency
                .map_or_else(|| "-".to_owned(), |n| n.to_string()),
            format!("{}/{}", s.done + s.failed, s.total),
            s.plan.run_id,
            s.message
                .as_deref()
                .map_or_else(String::new, |m| format!("  ({m})"))
        );
    }
}

fn report(args: BenchReportArgs) -> anyhow::Result<u8> {
    let (location, manifest) = manifest(&args.bench, args.store.store)?;
    let mut store = evalfleet_store::open(&location, &OpenOptions::read_only())?;
    let report = tokio::task::block_in_place(|| bench::report(&mut *store, &manifest))?;
    match args.format {
        BenchFormat::Json => println!("{}", serde_json::to_string_pretty(&report)?),
        BenchFormat::Csv => print!("{}", csv(&report)),
        BenchFormat::Table => print_report(&report),
    }
    if let Some(html) = &args.html {
        std::fs::write(html, evalfleet_server::pages::bench_html(&report, false))
            .with_context(|| format!("cannot write {}", html.display()))?;
        eprintln!("Wrote the bench report as a page: {}", html.display());
    }
    Ok(EXIT_OK)
}

fn number(value: Option<f64>, digits: usize) -> String {
    value.map_or_else(String::new, |v| format!("{v:.digits$}"))
}

/// The report's columns, one row per cell (overall), then one per cell
/// and category.
fn csv(report: &BenchReport) -> String {
    let mut out = String::from(
        "model,dataset,concurrency,group,state,items_ended,items,metric,mean,ci_low,ci_high,n,latency_p50_ms,ttft_p50_ms,tpot_p50_ms,tokens_per_second,peak_gpu_memory_mb,engine_start_ms,run_id\n",
    );
    let field = |text: &str| {
        if text.contains([',', '"', '\n']) {
            format!("\"{}\"", text.replace('"', "\"\""))
        } else {
            text.to_owned()
        }
    };
    for cell in &report.cells {
        let s = &cell.status;
        let rows = std::iter::once(("all".to_owned(), cell.headline.clone())).chain(
            cell.groups
                .iter()
                .map(|g| (g.group.clone(), Some(g.score.clone()))),
        );
        for (group, score) in rows {
            let line = [
                field(&s.plan.model),
                field(&s.plan.dataset),
                s.plan
                    .concurrency
                    .map_or_else(String::new, |n| n.to_string()),
                field(&group),
                s.state.as_str().to_owned(),
                (s.done + s.failed).to_string(),
                s.total.to_string(),
                field(cell.metric.as_deref().unwrap_or("")),
                number(score.as_ref().map(|x| x.mean), 6),
                number(score.as_ref().map(|x| x.ci_low), 6),
                number(score.as_ref().map(|x| x.ci_high), 6),
                score.as_ref().map_or_else(String::new, |x| x.n.to_string()),
                number(cell.latency_p50_ms, 1),
                number(cell.ttft_p50_ms, 1),
                number(cell.tpot_p50_ms, 2),
                number(cell.tokens_per_second, 1),
                cell.peak_gpu_memory_mb
                    .map_or_else(String::new, |m| m.to_string()),
                cell.engine_start_ms
                    .map_or_else(String::new, |m| m.to_string()),
                field(&s.plan.run_id),
            ];
            out.push_str(&line.join(","));
            out.push('\n');
        }
    }
    out
}

fn print_report(report: &BenchReport) {
    println!("Bench {}", report.name);
    println!(
        "{:<12} {:<12} {:>5} {:<12} {:>24} {:>9} {:>9} {:>9} {:>8} {:>8} {:>9}",
        "model",
        "dataset",
        "conc",
        "state",
        "headline (95% CI)",
        "p50 ms",
        "TTFT ms",
        "TPOT ms",
        "tok/s",
        "GPU MB",
        "start s"
    );
    for cell in &report.cells {
        let s = &cell.status;
        let headline = cell.headline.as_ref().map_or_else(
            || "-".to_owned(),
            |h| format!("{:.3} [{:.3}, {:.3}]", h.mean, h.ci_low, h.ci_high),
        );
        let or_dash = |text: String| {
            if text.is_empty() {
                "-".to_owned()
            } else {
                text
            }
        };
        println!(
            "{:<12} {:<12} {:>5} {:<12} {:>24} {:>9} {:>9} {:>9} {:>8} {:>8} {:>9}",
            s.plan.model,
            s.plan.dataset,
            s.plan
                .concurrency
                .map_or_else(|| "-".to_owned(), |n| n.to_string()),
            s.state.as_str(),
            headline,
            or_dash(number(cell.latency_p50_ms, 1)),
            or_dash(number(cell.ttft_p50_ms, 1)),
            or_dash(number(cell.tpot_p50_ms, 2)),
            or_dash(number(cell.tokens_per_second, 1)),
            cell.peak_gpu_memory_mb
                .map_or_else(|| "-".to_owned(), |m| m.to_string()),
            cell.engine_start_ms
                .map_or_else(|| "-".to_owned(), |m| format!("{:.2}", m as f64 / 1000.0)),
        );
        for group in &cell.groups {
            println!(
                "{:<12} {:<12} {:>5} {:<12} {:>24}  {} (n={})",
                "",
                "",
                "",
                "",
                format!(
                    "{:.3} [{:.3}, {:.3}]",
                    group.score.mean, group.score.ci_low, group.score.ci_high
                ),
                group.group,
                group.score.n
            );
        }
    }
    if let Some(metric) = report.cells.iter().find_map(|c| c.metric.as_deref()) {
        println!(
            "headline: each dataset's first metric (here {metric}); GPU MB: the peak of the GPU memory in use summed over the cell's sampled GPUs (its engine's own where attributed; telemetry)"
        );
    }
    for h in &report.handovers {
        println!(
            "handover {} -> {}: {:.3}s from the last answer to the first call, {:.3}s of it the engine's start, {:.3}s ours",
            h.from,
            h.to,
            h.gap_ms as f64 / 1000.0,
            h.engine_start_ms as f64 / 1000.0,
            h.overhead_ms as f64 / 1000.0
        );
    }
}
