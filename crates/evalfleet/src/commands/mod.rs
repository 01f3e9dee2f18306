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
use std::time::{Duration, UNIX_EPOCH};

use evalfleet_store::prelude::*;
use evalfleet_store::{Location, OpenOptions};

pub use evalfleet_core::frontend::sandbox_dir;

/// `--store`, else the config's `store`, else `$EVALFLEET_STORE`, else the
/// default (see `evalfleet_core::frontend::store_location`).
pub fn store_location(flag: Option<PathBuf>, config: Option<&Path>) -> anyhow::Result<Location> {
    Ok(evalfleet_core::frontend::store_location(flag, config)?)
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
