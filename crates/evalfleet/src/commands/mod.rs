//! The commands, one module each (`runs`, `status` and `export` share
//! `inspect`).

pub mod bench;
pub mod check;
pub mod convert;
pub mod env;
pub mod init;
pub mod inspect;
pub mod metrics;
pub mod mock;
pub mod report;
pub mod run;
pub mod serve;
pub mod sheets;
pub mod shell;
pub mod simulate;
pub mod supervise;
pub mod worker;

use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, UNIX_EPOCH};

use evalfleet_store::prelude::*;
use evalfleet_store::{Location, OpenOptions};

use crate::UsageError;

/// Where the store is when nothing says otherwise.
pub const DEFAULT_STORE: &str = "runs/evalfleet.db";

/// `--store`, else the config's `store`, else `$EVALFLEET_STORE`, else
/// [`DEFAULT_STORE`]: a path (relative to the current directory) or a URL.
pub fn store_location(flag: Option<PathBuf>, config: Option<&Path>) -> anyhow::Result<Location> {
    let chosen = flag
        .or_else(|| config.map(Path::to_owned))
        .or_else(|| std::env::var_os("EVALFLEET_STORE").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(DEFAULT_STORE));
    let location = Location::parse(&chosen.to_string_lossy())?;
    *CHOSEN.lock().unwrap_or_else(PoisonError::into_inner) = Some(location.clone());
    Ok(location)
}

/// The store this command chose last, for its error messages.
static CHOSEN: Mutex<Option<Location>> = Mutex::new(None);

/// The store this command chose (see [`store_location`]), if it chose one.
pub fn store_chosen() -> Option<Location> {
    CHOSEN
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone()
}

/// Opens an existing store (`--store`, ...), for commands that change it.
pub fn open_existing(flag: Option<PathBuf>) -> anyhow::Result<(Location, Box<dyn Store>)> {
    let location = store_location(flag, None)?;
    let store = evalfleet_store::open(&location, &OpenOptions::default())?;
    Ok((location, store))
}

/// Opens an existing store to read it only, for commands that change
/// nothing: they work on a store the user may not write.
pub fn open_to_read(flag: Option<PathBuf>) -> anyhow::Result<(Location, Box<dyn Store>)> {
    let location = store_location(flag, None)?;
    let store = evalfleet_store::open(&location, &OpenOptions::read_only())?;
    Ok((location, store))
}

/// Where the code judge of `name` (a run, or a run's rescoring) keeps its
/// sandbox: `sandbox/NAME` beside the store.
pub fn sandbox_dir(store: &Location, name: &str) -> PathBuf {
    store.dir().join("sandbox").join(name)
}

/// What a command must be told to find this store again: nothing for the
/// default one.
pub fn store_flag(store: &Location) -> String {
    if store.is(Path::new(DEFAULT_STORE)) {
        String::new()
    } else {
        format!(" --store {store}")
    }
}

/// Run ids name files (engine logs, sandboxes, reports), so they are kept to
/// a safe alphabet.
pub fn validate_run_id(id: String) -> Result<String, UsageError> {
    let valid = !id.is_empty()
        && id.len() <= 120
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        && !id.starts_with(['.', '-']);
    if valid {
        Ok(id)
    } else {
        Err(UsageError(format!(
            "--run-id '{id}': use 1 to 120 letters, digits, '-', '_' or '.', not starting with '.' or '-'"
        )))
    }
}

/// Cancelled on the first SIGINT or SIGTERM: how a server of its own
/// (`mock`, `serve`) is stopped.
pub fn stopped_by_signals() -> std::io::Result<tokio_util::sync::CancellationToken> {
    use tokio::signal::unix::{SignalKind, signal};
    let shutdown = tokio_util::sync::CancellationToken::new();
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    let stop = shutdown.clone();
    // Outside any run: the signal watcher of a server command, which ends
    // with the process.
    #[allow(clippy::disallowed_methods)]
    tokio::spawn(async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
        stop.cancel();
    });
    Ok(shutdown)
}

/// A stored timestamp as RFC 3339 (UTC, seconds).
pub fn timestamp(ms: i64) -> String {
    let time = UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_seconds(time).to_string()
}
