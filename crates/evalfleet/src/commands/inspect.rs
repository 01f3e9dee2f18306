//! `evalfleet runs`, `status` and `export`: reading a store, also while a run
//! is writing to it.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;

use anyhow::Context;
use evalfleet_reports::view::{self, RunState};
use evalfleet_reports::{self as report, EndpointSummary, Percentiles};
use evalfleet_store::worker;
use evalfleet_store::{EndpointStates, ExportRow, RunRecord, Store};
use evalfleet_types::{ErrorClass, FleetAction, FleetChange, StateCounts};
use serde_json::{Value, json};

use super::{open_existing, open_to_read, timestamp};
use crate::cli::{ExportArgs, ExportFormat, FleetArgs, StatusArgs, StoreArgs, TrajectoryAttempts};
use crate::{EXIT_OK, UsageError};

/// What a stored status means now: a `running` run whose process is gone
/// crashed or was killed.
fn status_text(store: &mut dyn Store, run: &RunRecord) -> anyhow::Result<(String, bool)> {
    let workers = worker::live_workers(store, &run.run_id)?.len();
    let text = match view::state(run, workers) {
        RunState::Stopped => "stopped (its process ended without finishing: resume it)".to_owned(),
        _ => run.status.to_string(),
    };
    Ok((text, workers > 0))
}

pub fn runs(args: StoreArgs) -> anyhow::Result<u8> {
    let (location, mut store) = open_to_read(args.store)?;
    let runs = store.runs()?;
    if runs.is_empty() {
        eprintln!("No runs in {location}.");
        return Ok(EXIT_OK);
    }
    let mut rows = vec![[
        "RUN".to_owned(),
        "NAME".to_owned(),
        "STATUS".to_owned(),
        "DONE".to_owned(),
        "FAILED".to_owned(),
        "PENDING".to_owned(),
        "CREATED".to_owned(),
    ]];
    for run in &runs {
        let counts = store.counts(&run.run_id)?;
        let (status, _) = status_text(&mut *store, run)?;
        let status = status.split(' ').next().unwrap_or_default().to_owned();
        rows.push([
            run.run_id.clone(),
            run.name.clone(),
            status,
            counts.done.to_string(),
            counts.failed.to_string(),
            counts.pending.to_string(),
            timestamp(run.created_at_ms),
        ]);
    }
    print_table(&rows);
    Ok(EXIT_OK)
}

pub(crate) fn print_table<R: AsRef<[String]>>(rows: &[R]) {
    let mut widths: Vec<usize> = Vec::new();
    for row in rows {
        for (i, cell) in row.as_ref().iter().enumerate() {
            if widths.len() <= i {
                widths.push(0);
            }
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let mut out = io::stdout().lock();
    for row in rows {
        let line: Vec<String> = row
            .as_ref()
            .iter()
            .enumerate()
            .map(|(i, cell)| format!("{cell:<width$}", width = widths[i]))
            .collect();
        let _ = writeln!(out, "{}", line.join("  ").trim_end());
    }
}

pub(crate) fn percentiles(p: &Option<Percentiles>) -> String {
    match p {
        Some(p) => format!("{:.0}/{:.0}/{:.0}", p.p50, p.p90, p.p99),
        None => "-".to_owned(),
    }
}

pub fn status(mut args: StatusArgs) -> anyhow::Result<u8> {
    let (_, mut store) = open_to_read(args.store.store)?;
    args.run_id = evalfleet_store::resolve_run_id(&mut *store, &args.run_id)?;
    let run = store.run(&args.run_id)?;
    let counts = store.counts(&args.run_id)?;
    let (status, active) = status_text(&mut *store, &run)?;
    let endpoints = report::endpoints(&mut *store, &args.run_id)?;
    let states = store.endpoint_states(&args.run_id)?;
    let events = store.events(&args.run_id)?;
    let live: Vec<String> = worker::live_workers(&mut *store, &args.run_id)?
        .into_iter()
        .map(|w| w.worker)
        .collect();
    let by_worker = store.worker_work(&args.run_id)?;
    // What the run came to so far, and why; a report that cannot be made
    // (a stored config this evalfleet cannot read) is said, not fatal.
    let outcome = report::report_with(&mut *store, &args.run_id, &[], None, &mut |_, _, _| {})
        .map(|r| r.outcome)
        .map_err(|err| format!("{:#}", anyhow::Error::from(err)));
    if args.json {
        let value = json!({
            "run_id": run.run_id,
            "name": run.name,
            "status": run.status,
            "active": active,
            "message": run.message,
            "created_at": timestamp(run.created_at_ms),
            "updated_at": timestamp(run.updated_at_ms),
            "sessions": run.sessions,
            "total": run.total,
            "counts": counts,
            "outcome": outcome.as_ref().ok(),
            "outcome_error": outcome.as_ref().err(),
            "dataset": {"path": run.dataset.path, "sha256": run.dataset.sha256},
            "fingerprint": run.fingerprint.digest(),
            "endpoints": endpoints,
            "endpoint_states": states.as_ref().map(|s| json!({
                "updated_at": timestamp(s.updated_at_ms),
                "live": active,
                "endpoints": s.endpoints,
            })),
            "workers": by_worker.iter().map(|w| json!({
                "worker": w.worker,
                "done": w.done,
                "failed": w.failed,
                "live": live.contains(&w.worker),
            })).collect::<Vec<_>>(),
            "events": events,
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(EXIT_OK);
    }
    print_status(
        &run,
        &status,
        counts,
        &outcome,
        &endpoints,
        states.as_ref(),
        active,
    );
    let mut out = io::stdout().lock();
    // Which worker did what, once more than one did.
    if by_worker.len() > 1 {
        let _ = writeln!(out, "\nworkers");
        let mut rows = vec![[
            "WORKER".to_owned(),
            "DONE".to_owned(),
            "FAILED".to_owned(),
            "NOW".to_owned(),
        ]];
        for w in &by_worker {
            rows.push([
                w.worker.clone(),
                w.done.to_string(),
                w.failed.to_string(),
                if live.contains(&w.worker) {
                    "working".to_owned()
                } else {
                    "gone".to_owned()
                },
            ]);
        }
        print_table(&rows);
    }
    if !events.is_empty() {
        let _ = writeln!(out, "\nevents (last 10 of {}):", events.len());
        for event in events.iter().rev().take(10).rev() {
            let _ = writeln!(out, "  {}  {}", timestamp(event.at_ms), event.message);
        }
    }
    Ok(EXIT_OK)
}

fn print_status(
    run: &RunRecord,
    status: &str,
    counts: StateCounts,
    outcome: &Result<report::Outcome, String>,
    endpoints: &[EndpointSummary],
    states: Option<&EndpointStates>,
    active: bool,
) {
    let mut out = io::stdout().lock();
    let _ = writeln!(out, "run          {} ({})", run.run_id, run.name);
    let _ = writeln!(out, "status       {status}");
    if let Some(message) = &run.message {
        let _ = writeln!(out, "             {message}");
    }
    let _ = writeln!(
        out,
        "items        {} total: {} done, {} failed, {} pending",
        run.total, counts.done, counts.failed, counts.pending
    );
    match outcome {
        Ok(outcome) => {
            let _ = writeln!(out, "outcome      {}", outcome.line());
            for line in outcome.cause_lines() {
                let _ = writeln!(out, "             {line}");
            }
        }
        Err(err) => {
            let _ = writeln!(out, "outcome      unknown: {err}");
        }
    }
    let _ = writeln!(
        out,
        "dataset      {} (sha256 {})",
        run.dataset.path.display(),
        &run.dataset.sha256[..12.min(run.dataset.sha256.len())]
    );
    let _ = writeln!(out, "fingerprint  {}", run.fingerprint.digest());
    let _ = writeln!(
        out,
        "created      {}   updated {}   sessions {}",
        timestamp(run.created_at_ms),
        timestamp(run.updated_at_ms),
        run.sessions
    );
    drop(out);
    let mut names: Vec<&str> = endpoints.iter().map(|e| e.endpoint.as_str()).collect();
    if let Some(states) = states {
        for state in &states.endpoints {
            if !names.contains(&state.endpoint.as_str()) {
                names.push(&state.endpoint);
            }
        }
    }
    if names.is_empty() {
        return;
    }
    println!();
    if let Some(states) = states {
        println!(
            "endpoints ({} {})",
            if active {
                "live, as of"
            } else {
                "as last seen at"
            },
            timestamp(states.updated_at_ms)
        );
    }
    let mut rows = vec![[
        "ENDPOINT".to_owned(),
        "STATE".to_owned(),
        "LIMIT".to_owned(),
        "IN_FLIGHT".to_owned(),
        "REQ/MIN".to_owned(),
        "ATTEMPTS".to_owned(),
        "OK".to_owned(),
        "RETRYABLE".to_owned(),
        "BACKPRESSURE".to_owned(),
        "NO_FIRST_BYTE".to_owned(),
        "STALLED".to_owned(),
        "BAD_RESPONSE".to_owned(),
        "FATAL".to_owned(),
        "MOVED".to_owned(),
        "LATENCY_MS p50/p90/p99".to_owned(),
        "TTFT_MS p50/p90/p99".to_owned(),
        "TPOT_MS p50/p90/p99".to_owned(),
    ]];
    for name in names {
        let summary = endpoints.iter().find(|e| e.endpoint == name);
        let state = states.and_then(|s| s.endpoints.iter().find(|e| e.endpoint == name));
        let count = |key: &str| {
            summary
                .and_then(|e| e.errors.get(key).copied())
                .unwrap_or(0)
                .to_string()
        };
        let errors = |class: ErrorClass| count(class.as_str());
        let [
            retryable,
            back_pressure,
            first_byte,
            stalled,
            bad_response,
            fatal,
        ] = ErrorClass::FAILURES.map(errors);
        let dash = || "-".to_owned();
        rows.push([
            name.to_owned(),
            state.map_or_else(dash, |s| s.state.to_string()),
            state.map_or_else(dash, |s| {
                format!("{}{}", s.limit, if s.adaptive { " (adaptive)" } else { "" })
            }),
            state.map_or_else(dash, |s| s.in_flight.to_string()),
            state.map_or_else(dash, |s| s.requests_per_minute.to_string()),
            summary.map_or_else(|| "0".to_owned(), |e| e.attempts.to_string()),
            summary.map_or_else(|| "0".to_owned(), |e| e.successes.to_string()),
            retryable,
            back_pressure,
            first_byte,
            stalled,
            bad_response,
            fatal,
            count(report::endpoints::MOVED),
            percentiles(&summary.and_then(|e| e.latency_ms)),
            percentiles(&summary.and_then(|e| e.ttft_ms)),
            percentiles(&summary.and_then(|e| e.tpot_ms)),
        ]);
    }
    print_table(&rows);
}

/// `evalfleet fleet add|remove`: asks the running process to change its
/// fleet.
pub fn fleet(args: FleetArgs) -> anyhow::Result<u8> {
    let (action, mut target) = match args.action {
        crate::cli::FleetAction::Add(target) => (FleetAction::Add, target),
        crate::cli::FleetAction::Remove(target) => (FleetAction::Remove, target),
    };
    let (_, mut store) = open_existing(target.store.store)?;
    target.run_id = evalfleet_store::resolve_run_id(&mut *store, &target.run_id)?;
    let run = store.run(&target.run_id)?;
    let configured: Vec<String> = run
        .config
        .get("endpoints")
        .and_then(Value::as_array)
        .map(|list| {
            list.iter()
                .filter_map(|e| e.get("name").and_then(Value::as_str).map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    if !configured.contains(&target.endpoint) {
        return Err(UsageError(format!(
            "run {} has no endpoint '{}' in its config (it has: {})",
            target.run_id,
            target.endpoint,
            configured.join(", ")
        ))
        .into());
    }
    if worker::live_workers(&mut *store, &target.run_id)?.is_empty() {
        return Err(UsageError(format!(
            "run {} is not running; choose its endpoints when you resume it: evalfleet resume {} --endpoints ...",
            target.run_id, target.run_id
        ))
        .into());
    }
    store.request_fleet_change(
        &target.run_id,
        &FleetChange {
            id: 0,
            action,
            endpoint: target.endpoint.clone(),
            at_ms: evalfleet_types::now_ms(),
        },
    )?;
    println!(
        "Asked run {} to {action} endpoint {}; it applies it within a second (see `evalfleet status {}`).",
        target.run_id, target.endpoint, target.run_id
    );
    Ok(EXIT_OK)
}

/// The fixed columns of an export row, in the contract's order.
const COLUMNS: [&str; 19] = [
    "item_id",
    "status",
    "output",
    "error",
    "endpoint",
    "model",
    "attempts",
    "latency_ms",
    "ttft_ms",
    "tpot_ms",
    "prompt_tokens",
    "completion_tokens",
    "tokens_estimated",
    "parsed",
    "valid",
    "scores",
    "judge",
    "check_error",
    "prompt",
];

pub fn export(mut args: ExportArgs) -> anyhow::Result<u8> {
    let format = args.format()?;
    let attempts = match (args.attempts, format) {
        (None | Some(TrajectoryAttempts::Final), _) => report::trajectories::Attempts::Final,
        (Some(TrajectoryAttempts::All), ExportFormat::Trajectories) => {
            report::trajectories::Attempts::All
        }
        (Some(TrajectoryAttempts::All), _) => {
            return Err(crate::UsageError(
                "export: --attempts is for --format trajectories (the other formats give each item's result)".to_owned(),
            )
            .into());
        }
    };
    let (_, mut store) = open_to_read(args.store.store.clone())?;
    args.run_id = evalfleet_store::resolve_run_id(&mut *store, &args.run_id)?;
    match &args.output {
        Some(file) => {
            let tmp = temp_path(file);
            let result = File::create(&tmp)
                .with_context(|| format!("cannot create {}", tmp.display()))
                .and_then(|f| {
                    let mut writer = BufWriter::new(f);
                    write_export(&mut *store, &args.run_id, format, attempts, &mut writer)?;
                    writer.flush()?;
                    writer.get_ref().sync_all()?;
                    Ok(())
                })
                .and_then(|()| {
                    std::fs::rename(&tmp, file)
                        .with_context(|| format!("cannot write {}", file.display()))
                });
            if result.is_err() {
                let _ = std::fs::remove_file(&tmp);
            }
            result?;
        }
        None => {
            let mut writer = BufWriter::new(io::stdout());
            write_export(&mut *store, &args.run_id, format, attempts, &mut writer)?;
            writer.flush()?;
        }
    }
    Ok(EXIT_OK)
}

fn temp_path(file: &Path) -> std::path::PathBuf {
    let mut name = file.as_os_str().to_owned();
    name.push(".partial");
    name.into()
}

fn write_export(
    store: &mut dyn Store,
    run_id: &str,
    format: ExportFormat,
    attempts: report::trajectories::Attempts,
    out: &mut (dyn Write + Send),
) -> anyhow::Result<()> {
    match format {
        ExportFormat::Parquet => write_parquet(store, run_id, out)?,
        ExportFormat::Jsonl => {
            store.export(run_id, &mut |row| {
                serde_json::to_writer(&mut *out, &row).map_err(io::Error::other)?;
                out.write_all(b"\n")
            })?;
        }
        ExportFormat::Trajectories => {
            let written =
                report::trajectories::export_trajectories(store, run_id, attempts, &mut |line| {
                    serde_json::to_writer(&mut *out, line).map_err(io::Error::other)?;
                    out.write_all(b"\n")
                })?;
            if written.no_chat > 0 {
                eprintln!(
                    "note: {} conversation(s) of {} item(s) written; {} item(s) left out: their last attempt made no chat completion",
                    written.lines, written.items, written.no_chat
                );
            }
            if written.unreadable > 0 {
                eprintln!(
                    "note: {} chat completion(s) left out of their conversations: their request cannot be read (cut when stored by an older evalfleet, or not JSON)",
                    written.unreadable
                );
            }
        }
        ExportFormat::Csv => {
            // A first pass finds every item field, so that each becomes a column.
            let mut fields = BTreeSet::new();
            store.export(run_id, &mut |row| {
                if let Value::Object(item) = &row.item {
                    fields.extend(item.keys().cloned());
                }
                Ok(())
            })?;
            let mut csv = csv::Writer::from_writer(out);
            let header: Vec<String> = COLUMNS
                .iter()
                .map(|c| (*c).to_owned())
                .chain(fields.iter().map(|f| format!("item.{f}")))
                .chain(std::iter::once(IMAGES.to_owned()))
                .collect();
            csv.write_record(&header)?;
            store.export(run_id, &mut |row| {
                csv.write_record(csv_record(&row, &fields))
                    .map_err(io::Error::other)
            })?;
            csv.flush()?;
        }
    }
    Ok(())
}

/// Rows in each row group of a Parquet export: memory holds one group.
const PARQUET_GROUP: usize = 4096;

/// A Parquet export: the contract's columns typed (text, integers, floats,
/// booleans), one float column `score.NAME` per metric, and the JSON values
/// (`parsed`, `scores`, `judge`, the input row `item`, `images`) as JSON
/// text. A first pass finds the metrics' names.
fn write_parquet(
    store: &mut dyn Store,
    run_id: &str,
    out: impl Write + Send,
) -> anyhow::Result<()> {
    use evalfleet_io::dataset::{ColumnKind as K, ColumnValues as V, TableWriter};

    let mut metrics = BTreeSet::new();
    store.export(run_id, &mut |row| {
        metrics.extend(row.scores.iter().flat_map(|s| s.keys().cloned()));
        Ok(())
    })?;
    let fixed = [
        ("item_id", K::Text),
        ("status", K::Text),
        ("output", K::Text),
        ("error", K::Text),
        ("endpoint", K::Text),
        ("model", K::Text),
        ("attempts", K::Int),
        ("latency_ms", K::Float),
        ("ttft_ms", K::Float),
        ("tpot_ms", K::Float),
        ("prompt_tokens", K::Int),
        ("completion_tokens", K::Int),
        ("tokens_estimated", K::Bool),
        ("parsed", K::Text),
        ("valid", K::Bool),
        ("scores", K::Text),
        ("judge", K::Text),
        ("check_error", K::Text),
        ("prompt", K::Text),
        ("item", K::Text),
        (IMAGES, K::Text),
    ];
    let columns: Vec<(String, K)> = fixed
        .iter()
        .map(|(name, kind)| ((*name).to_owned(), *kind))
        .chain(metrics.iter().map(|m| (format!("score.{m}"), K::Float)))
        .collect();
    let mut values: Vec<V> = columns.iter().map(|(_, kind)| V::new(*kind)).collect();
    let mut table = TableWriter::new(out, &columns)?;
    let json = |v: &Option<Value>| v.as_ref().map(Value::to_string);
    let int = |v: Option<u64>| v.and_then(|n| i64::try_from(n).ok());
    store.export(run_id, &mut |row| {
        let texts = [
            Some(row.item_id.clone()),
            Some(row.status.to_string()),
            row.output.clone(),
            row.error.clone(),
            row.endpoint.clone(),
            row.model.clone(),
        ];
        let mut at = 0;
        // The cells below follow the columns above, kind for kind.
        let mut push = |value: Cell| -> io::Result<()> {
            match (&mut values[at], value) {
                (V::Text(v), Cell::Text(x)) => v.push(x),
                (V::Float(v), Cell::Float(x)) => v.push(x),
                (V::Int(v), Cell::Int(x)) => v.push(x),
                (V::Bool(v), Cell::Bool(x)) => v.push(x),
                _ => {
                    return Err(io::Error::other(format!(
                        "column {} of the export got a value of another kind",
                        columns[at].0
                    )));
                }
            }
            at += 1;
            Ok(())
        };
        for text in texts {
            push(Cell::Text(text))?;
        }
        push(Cell::Int(Some(i64::from(row.attempts))))?;
        push(Cell::Float(row.latency_ms))?;
        push(Cell::Float(row.ttft_ms))?;
        push(Cell::Float(row.tpot_ms))?;
        push(Cell::Int(int(row.prompt_tokens)))?;
        push(Cell::Int(int(row.completion_tokens)))?;
        push(Cell::Bool(Some(row.tokens_estimated)))?;
        push(Cell::Text(json(&row.parsed)))?;
        push(Cell::Bool(row.valid))?;
        push(Cell::Text(
            row.scores
                .as_ref()
                .map(|s| serde_json::to_string(s).unwrap_or_default()),
        ))?;
        push(Cell::Text(json(&row.judge)))?;
        push(Cell::Text(row.check_error.clone()))?;
        push(Cell::Text(row.prompt.clone()))?;
        push(Cell::Text(Some(row.item.to_string())))?;
        push(Cell::Text((!row.images.is_empty()).then(|| {
            serde_json::to_string(&row.images).unwrap_or_default()
        })))?;
        for metric in &metrics {
            push(Cell::Float(
                row.scores
                    .as_ref()
                    .and_then(|s| s.get(metric))
                    .and_then(|s| s.value),
            ))?;
        }
        if values[0].len() >= PARQUET_GROUP {
            table.write_group(&mut values).map_err(io::Error::other)?;
        }
        Ok(())
    })?;
    if !values[0].is_empty() {
        table.write_group(&mut values)?;
    }
    table.finish()?;
    Ok(())
}

/// One value of a Parquet export's row.
enum Cell {
    Text(Option<String>),
    Float(Option<f64>),
    Int(Option<i64>),
    Bool(Option<bool>),
}

/// The last CSV column, after the item's: the request's images as JSON
/// text (the list JSONL has), empty when there were none.
const IMAGES: &str = "images";

/// A JSON value in a CSV cell: strings as they are, the rest as JSON.
fn json_cell(value: Option<&Value>) -> String {
    match value {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

fn csv_record(row: &ExportRow, fields: &BTreeSet<String>) -> Vec<String> {
    let opt = |v: &Option<String>| v.clone().unwrap_or_default();
    let num = |v: Option<f64>| v.map(|x| format!("{x:.3}")).unwrap_or_default();
    let int = |v: Option<u64>| v.map(|x| x.to_string()).unwrap_or_default();
    let mut record = vec![
        row.item_id.clone(),
        row.status.to_string(),
        opt(&row.output),
        opt(&row.error),
        opt(&row.endpoint),
        opt(&row.model),
        row.attempts.to_string(),
        num(row.latency_ms),
        num(row.ttft_ms),
        num(row.tpot_ms),
        int(row.prompt_tokens),
        int(row.completion_tokens),
        if row.tokens_estimated { "true" } else { "" }.to_owned(),
        json_cell(row.parsed.as_ref()),
        row.valid.map(|v| v.to_string()).unwrap_or_default(),
        row.scores
            .as_ref()
            .map(|s| serde_json::to_string(s).unwrap_or_default())
            .unwrap_or_default(),
        json_cell(row.judge.as_ref()),
        opt(&row.check_error),
        opt(&row.prompt),
    ];
    for field in fields {
        record.push(match row.item.get(field) {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(other) => other.to_string(),
        });
    }
    record.push(if row.images.is_empty() {
        String::new()
    } else {
        serde_json::to_string(&row.images).unwrap_or_default()
    });
    record
}
