//! What the program that runs sessions (the command line, a server) lends
//! them, and where a command's store and a run's files are. The
//! orchestration decides; the front end only says things to its person and
//! asks them.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use evalfleet_fleet::runtime::MockStarter;
use evalfleet_pipeline::task::exec::GatewayHost;
use evalfleet_store::Location;
use evalfleet_types::Fault;

/// A mistake in what the user asked for (an argument, a name): exit code 2,
/// 400 from the API.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

impl UsageError {
    pub fn fault(&self) -> Fault {
        Fault::BadInput
    }
}

/// Asks the person whether engines may start on GPUs someone else is
/// using (the busy GPUs, a line each); `Ok(false)`: no, or nobody to ask.
pub type AskGpus = dyn Fn(&str) -> std::io::Result<bool> + Send + Sync;

/// Tells the person a line of what happened (not a log line).
pub type Say = dyn Fn(&str) + Send + Sync;

/// What the program running sessions lends them.
#[derive(Clone)]
pub struct Frontend {
    /// The program that supervises engines (it has a `supervise` command).
    pub supervisor: PathBuf,
    /// How `kind: mock` endpoints start.
    pub mocks: Arc<dyn MockStarter>,
    /// Where agents' gateways are served (`kind: exec`).
    pub gateway: Option<Arc<dyn GatewayHost>>,
    /// Asked when a GPU an engine would start on is in use and `-y` was
    /// not given.
    pub ask_gpus: Arc<AskGpus>,
    /// How the person is told what happened.
    pub say: Arc<Say>,
}

/// Where the store is when nothing says otherwise.
pub const DEFAULT_STORE: &str = "runs/evalfleet.db";

/// `--store`, else the config's `store`, else `$EVALFLEET_STORE`, else
/// [`DEFAULT_STORE`]: a path (relative to the current directory) or a URL.
pub fn store_location(
    flag: Option<PathBuf>,
    config: Option<&Path>,
) -> Result<Location, evalfleet_store::StoreError> {
    let chosen = flag
        .or_else(|| config.map(Path::to_owned))
        .or_else(|| std::env::var_os("EVALFLEET_STORE").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(DEFAULT_STORE));
    let location = Location::parse(&chosen.to_string_lossy())?;
    *CHOSEN.lock().unwrap_or_else(PoisonError::into_inner) = Some(location.clone());
    Ok(location)
}

/// The store this process chose last, for its error messages.
static CHOSEN: Mutex<Option<Location>> = Mutex::new(None);

/// The store this process chose (see [`store_location`]), if it chose one.
pub fn store_chosen() -> Option<Location> {
    CHOSEN
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone()
}

/// Where the code judge of `name` (a run, or a run's rescoring) keeps its
/// sandbox: `sandbox/NAME` beside the store.
pub fn sandbox_dir(store: &Location, name: &str) -> PathBuf {
    store.dir().join("sandbox").join(name)
}

/// Where a run's logs go: `RUN_ID/` beside the store.
pub fn run_dir(location: &Location, run_id: &str) -> PathBuf {
    location.dir().join(run_id)
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
