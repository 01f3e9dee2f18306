//! `evalfleet worker`: this machine works on runs of a shared store. A
//! worker joins a run as `resume` does (a session of its own, claiming
//! items under leases), with the run's stored config or with endpoints of
//! its own; without `--run` it joins each running run in turn and waits
//! for the next.

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use evalfleet_config as config;
use evalfleet_store::{Location, OpenOptions};
use evalfleet_store::{RunRecord, StoreError};
use evalfleet_types::RunStatus;

use evalfleet_core::session::{Resumable, Resume, resumable_with};

use super::{stopped_by_signals, store_location};
use crate::attend::{self, Attendance, Lift};
use crate::cli::WorkerArgs;
use crate::{EXIT_FAILED, EXIT_OK, ui};

pub async fn worker(args: WorkerArgs) -> anyhow::Result<u8> {
    let location = store_location(args.store.clone(), None)?;
    if let Location::Sqlite(path) = &location {
        // Allowed (processes of one machine share a SQLite store), but a
        // worker on another machine needs a database server.
        tracing::info!(
            "Working on runs of the SQLite store {}: workers of this machine only; workers on other machines need a shared store (--store postgres://...).",
            path.display()
        );
    }
    match &args.run {
        Some(run_id) => join(&location, run_id, &args).await,
        None => wait_for_runs(&location, &args).await,
    }
}

/// Joins the run `run_id` until it ends or this worker is stopped; its exit
/// code is the session's.
async fn join(location: &Location, run_id: &str, args: &WorkerArgs) -> anyhow::Result<u8> {
    let mut store = evalfleet_store::open(location, &OpenOptions::default())?;
    let record = store.run(run_id)?;
    let dir = Path::new(&record.config_dir);
    let loaded = match &args.endpoints {
        Some(file) => config::load_snapshot_with_endpoints(&record.config, dir, file)?,
        None => config::load_snapshot(&record.config, dir)?,
    };
    let frontend = attend::frontend()?;
    match resumable_with(
        location.clone(),
        store,
        &record,
        loaded,
        Resume {
            retry_failed: false,
            endpoints: &[],
            yes: args.yes,
            roots: None,
        },
        &frontend,
    )
    .await
    .lift()?
    {
        Resumable::Nothing { counts } => {
            ui::note(&format!(
                "Run {run_id} has no pending items ({} done, {} failed).",
                counts.done, counts.failed
            ));
            Ok(if counts.failed > 0 {
                EXIT_FAILED
            } else {
                EXIT_OK
            })
        }
        Resumable::Session(session) => {
            attend::execute(
                *session,
                Attendance::Terminal {
                    quiet: args.output.quiet,
                },
                None,
                &frontend,
            )
            .await
        }
    }
}

/// The newest running run of the store with items left to claim, of
/// those not in `skip`.
fn next_run(location: &Location, skip: &HashSet<String>) -> Result<Option<RunRecord>, StoreError> {
    let mut store = evalfleet_store::open(location, &OpenOptions::default())?;
    for run in store.runs()? {
        if run.status != RunStatus::Running || skip.contains(&run.run_id) {
            continue;
        }
        if store.counts(&run.run_id)?.pending > 0 {
            return Ok(Some(run));
        }
    }
    Ok(None)
}

/// The longest pause between two looks for work after trouble.
const PAUSE_MAX: Duration = Duration::from_secs(60);

/// Whether `err` is the store's (it could not be reached, or failed), not
/// the run's: worth trying again once the store is back.
fn is_the_stores(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| {
        cause
            .downcast_ref::<StoreError>()
            .is_some_and(|err| matches!(err, StoreError::Backend { .. }))
    })
}

/// Joins each running run with items left, newest first, one at a time,
/// and waits for the next, until stopped (then exits 0: a worker stopped
/// by its service manager did nothing wrong). A store that cannot be
/// reached is waited for; a run this host cannot work on (its dataset is
/// not here, its config needs a variable this host lacks) is said once and
/// left to others.
async fn wait_for_runs(location: &Location, args: &WorkerArgs) -> anyhow::Result<u8> {
    let stop = stopped_by_signals()?;
    let mut waiting = false;
    let mut skip = HashSet::new();
    // After trouble (the store unreachable, a session that ended with the
    // run still going), the next look waits longer, up to PAUSE_MAX.
    let mut pause = args.poll;
    let mut troubled = false;
    while !stop.is_cancelled() {
        if troubled {
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                () = stop.cancelled() => break,
            }
            pause = (pause * 2).min(PAUSE_MAX.max(args.poll));
        }
        troubled = false;
        let found = match next_run(location, &skip) {
            Ok(found) => found,
            Err(err) => {
                tracing::warn!(
                    "Cannot look for runs in {location}: {}; trying again in {}.",
                    evalfleet_types::error_text(&err),
                    humantime::format_duration(pause)
                );
                troubled = true;
                continue;
            }
        };
        let Some(run) = found else {
            pause = args.poll;
            if !waiting {
                ui::note(&format!("Waiting for runs in {location} (Ctrl-C to stop)."));
                waiting = true;
            }
            tokio::select! {
                () = tokio::time::sleep(args.poll) => {}
                () = stop.cancelled() => {}
            }
            continue;
        };
        waiting = false;
        ui::note(&format!("Joining run {} ({}).", run.run_id, run.name));
        match join(location, &run.run_id, args).await {
            Ok(code @ (EXIT_OK | EXIT_FAILED)) => {
                // The run ended.
                tracing::info!("Left run {} (exit code {code}).", run.run_id);
                pause = args.poll;
            }
            Ok(code) => {
                // It goes on without this worker (its endpoints gave out,
                // say): not joined again at once.
                tracing::info!(
                    "Left run {} (exit code {code}); it goes on without this worker.",
                    run.run_id
                );
                troubled = true;
            }
            Err(err) if is_the_stores(&err) => {
                tracing::warn!(
                    "Stopped working on run {}: {err:#}; trying again.",
                    run.run_id
                );
                troubled = true;
            }
            Err(err) => {
                tracing::warn!(
                    "Could not work on run {} (not tried again): {err:#}",
                    run.run_id
                );
                skip.insert(run.run_id);
            }
        }
    }
    Ok(EXIT_OK)
}
