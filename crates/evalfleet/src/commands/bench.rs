//! `evalfleet bench`: a benchmark matrix run model by model (see
//! `evalfleet_core::matrix`), its cells attended as a server attends runs;
//! `bench status` and `bench report`.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;

use anyhow::Context;
use evalfleet_config::bench::load_bench;
use evalfleet_core::Frontend;
use evalfleet_core::bench::{self, BenchReport, CellState, CellStatus, Manifest};
use evalfleet_core::matrix::{CellEnd, CellRunner, Matrix, run_matrix};
use evalfleet_core::session::Session;
use evalfleet_store::{Location, OpenOptions};
use tokio_util::sync::CancellationToken;

use super::store_location;
use crate::attend::{self, Attendance, Lift};
use crate::cli::{BenchAction, BenchArgs, BenchFormat, BenchReportArgs, BenchStatusArgs};
use crate::ui;
use crate::{EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, UsageError};

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

async fn run_bench(file: &Path, store: Option<PathBuf>, yes: bool) -> anyhow::Result<u8> {
    let bench = load_bench(file)?;
    let location = store_location(store, bench.store.as_deref())?;
    let frontend = attend::frontend()?;
    let stop = CancellationToken::new();
    // Outside the runs' tasks: it ends with the process.
    #[allow(clippy::disallowed_methods)]
    let signals = tokio::spawn(watch_signals(stop.clone(), bench.name.clone()));
    let matrix = Matrix {
        location: &location,
        yes,
        stop: &stop,
        frontend: &frontend,
        cells: &AttendedCells(frontend.clone()),
    };
    let tally = run_matrix(&bench, matrix).await;
    signals.abort();
    let tally = tally.lift()?;
    let manifest = Manifest::of(&bench);
    let statuses = read_status(&location, &manifest)?;
    print_status(&statuses);
    let unfinished = statuses
        .iter()
        .filter(|s| s.state != CellState::Done)
        .count();
    let incomplete = incomplete_cells(&location, &statuses)?;
    let program = ui::program();
    let again = format!(
        "{program} bench {}{}",
        file.display(),
        crate::attend::store_flag(&location)
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
    } else if !incomplete.is_empty() {
        (
            EXIT_FAILED,
            format!(
                "done, but {} cell(s) incomplete (their numbers are over fewer items than they have):\n  {}\nSee: {program} bench report {}{}",
                incomplete.len(),
                incomplete.join("\n  "),
                bench.name,
                crate::attend::store_flag(&location)
            ),
        )
    } else {
        (
            EXIT_OK,
            format!(
                "done. Compare the models: {program} bench report {}{}",
                bench.name,
                crate::attend::store_flag(&location)
            ),
        )
    };
    ui::note(&format!("Bench {} {message}", bench.name));
    Ok(code)
}

/// Each finished cell whose outcome is not complete, in a line: its
/// model, dataset and outcome.
/// (Only the cells' outcomes are read: not their endpoints, resources or
/// events, which the bench's report adds.)
fn incomplete_cells(location: &Location, statuses: &[CellStatus]) -> anyhow::Result<Vec<String>> {
    let mut store = evalfleet_store::open(location, &OpenOptions::read_only())?;
    let mut lines = Vec::new();
    for s in statuses.iter().filter(|s| s.state == CellState::Done) {
        let report = tokio::task::block_in_place(|| {
            evalfleet_reports::report_with(
                &mut *store,
                &s.plan.run_id,
                &[],
                None,
                &mut |_, _, _| {},
            )
        })?;
        let o = &report.outcome;
        if o.is_complete() {
            continue;
        }
        let first = o.cause_lines().into_iter().next().unwrap_or_default();
        lines.push(format!(
            "{} on {}: {}; {first}",
            s.plan.model,
            s.plan.dataset,
            o.line()
        ));
    }
    Ok(lines)
}

/// A cell's session runs as a server's does (no display), with its last
/// lines.
struct AttendedCells(Frontend);

impl CellRunner for AttendedCells {
    fn run(
        &self,
        session: Session,
        stop: CancellationToken,
    ) -> Pin<Box<dyn Future<Output = Result<CellEnd, String>> + Send + '_>> {
        Box::pin(async move {
            match attend::execute(session, Attendance::Server { stop }, None, &self.0).await {
                Ok(EXIT_INTERRUPTED) => Ok(CellEnd::Interrupted),
                Ok(_) => Ok(CellEnd::Ended),
                Err(err) => Err(format!("{err:#}")),
            }
        })
    }
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
    if !manifest.is_over(&location) {
        let theirs = manifest.store.as_deref().unwrap_or_default();
        return Err(UsageError(format!(
            "bench {bench}'s runs are in the store {theirs} beside {location}, not in {location}: pass --store {}",
            location.dir().join(theirs).display()
        ))
        .into());
    }
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
        "{:<12} {:<12} {:<12} {:>5} {:>15} {:>7}  run",
        "state", "model", "dataset", "conc", "items ended", "failed"
    );
    for s in statuses {
        println!(
            "{:<12} {:<12} {:<12} {:>5} {:>15} {:>7}  {}{}",
            s.state.as_str(),
            s.plan.model,
            s.plan.dataset,
            s.plan
                .concurrency
                .map_or_else(|| "-".to_owned(), |n| n.to_string()),
            format!("{}/{}", s.done + s.failed, s.total),
            s.failed,
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
        "model,dataset,concurrency,group,state,items_ended,items,scored,failed,metric,mean,ci_low,ci_high,n,latency_p50_ms,ttft_p50_ms,tpot_p50_ms,tokens_per_second,peak_gpu_memory_mb,engine_start_ms,run_id\n",
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
        let (scored, failed) = cell.scored_and_failed();
        for (group, score) in rows {
            let line = [
                field(&s.plan.model),
                field(&s.plan.dataset),
                s.plan
                    .concurrency
                    .map_or_else(String::new, |n| n.to_string()),
                field(&group),
                cell.standing().to_owned(),
                (s.done + s.failed).to_string(),
                s.total.to_string(),
                scored.to_string(),
                failed.to_string(),
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
        "{:<12} {:<12} {:>5} {:<12} {:>13} {:>25} {:>9} {:>9} {:>9} {:>8} {:>8} {:>9}",
        "model",
        "dataset",
        "conc",
        "state",
        "scored/failed",
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
        // A cell whose numbers are over fewer items than it has is marked.
        let mark = if cell.is_complete() { " " } else { "*" };
        let headline = cell.headline.as_ref().map_or_else(
            || "-".to_owned(),
            |h| format!("{:.3} [{:.3}, {:.3}]{mark}", h.mean, h.ci_low, h.ci_high),
        );
        let (scored, failed) = cell.scored_and_failed();
        let or_dash = |text: String| {
            if text.is_empty() {
                "-".to_owned()
            } else {
                text
            }
        };
        println!(
            "{:<12} {:<12} {:>5} {:<12} {:>13} {:>25} {:>9} {:>9} {:>9} {:>8} {:>8} {:>9}",
            s.plan.model,
            s.plan.dataset,
            s.plan
                .concurrency
                .map_or_else(|| "-".to_owned(), |n| n.to_string()),
            cell.standing(),
            format!("{scored}/{failed}"),
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
                "{:<12} {:<12} {:>5} {:<12} {:>13} {:>25}  {} (n={})",
                "",
                "",
                "",
                "",
                "",
                format!(
                    "{:.3} [{:.3}, {:.3}]{mark}",
                    group.score.mean, group.score.ci_low, group.score.ci_high
                ),
                group.group,
                group.score.n
            );
        }
    }
    let incomplete: Vec<&bench::CellReport> = report
        .cells
        .iter()
        .filter(|c| c.outcome.is_some() && !c.is_complete())
        .collect();
    if !incomplete.is_empty() {
        println!(
            "* incomplete: its numbers are over fewer items than the cell has; compare it with the others with care"
        );
        for cell in incomplete {
            if let Some(outcome) = &cell.outcome {
                println!(
                    "{} on {}: {}",
                    cell.status.plan.model,
                    cell.status.plan.dataset,
                    outcome.line()
                );
                for line in outcome.cause_lines() {
                    println!("  {line}");
                }
            }
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
