//! What every request shares: the store (connections taken from a small
//! pool, used on blocking threads), the API key's digest, the names the
//! server answers to, what a config sent to it may do, and the runs this
//! process executes.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use evalfleet_io::template::Templates;
use evalfleet_pipeline::OpenStore;
use evalfleet_store::{Store, StoreError};
use tokio_util::task::TaskTracker;

use evalfleet_config::Admission;

use crate::control::RunControl;
use crate::error::ApiError;
use crate::hosts::HostPolicy;
use crate::keys::digest;

/// How a server is set up.
pub struct ServerOptions {
    /// Opens a connection to the store.
    pub open: Arc<OpenStore>,
    /// The API key requests must carry (`None`: no key is asked for, which
    /// `evalfleet serve` allows on a loopback address only).
    pub api_key: Option<String>,
    /// The names the server answers to.
    pub hosts: HostPolicy,
    /// What a config sent in a request may do: the directories its files
    /// (and a config given by path) must be under, the variables it may
    /// read, whether it may run commands. Its first root is where a config
    /// sent as text is read from.
    pub admission: Admission,
    /// Starts, resumes and stops runs in this process (`None`: runs are
    /// not started here).
    pub control: Option<Arc<dyn RunControl>>,
    /// Refuse every request that would change something.
    pub read_only: bool,
    /// The largest request body taken.
    pub body_limit: usize,
    /// The store whose benchmark matrices are shown: their plans lie
    /// beside it (`bench/NAME.json`), and only those made over this store
    /// are its; `None`: no matrix is shown.
    pub benches: Option<evalfleet_store::Location>,
}

/// Connections kept for the next request.
const POOL: usize = 8;

/// The server's shared state.
pub struct AppState {
    open: Arc<OpenStore>,
    pool: Mutex<Vec<Box<dyn Store>>>,
    /// SHA-256 of the API key: requests' keys are compared by digest, in
    /// constant time.
    pub(crate) key_digest: Option<[u8; 32]>,
    /// The sessions the dashboard's sign-in opened.
    pub(crate) sessions: crate::sessions::Sessions,
    /// Each client's wrong keys.
    pub(crate) attempts: crate::sessions::Attempts,
    pub(crate) hosts: HostPolicy,
    pub(crate) admission: Admission,
    pub(crate) control: Option<Arc<dyn RunControl>>,
    pub(crate) read_only: bool,
    pub(crate) body_limit: usize,
    pub(crate) benches: Option<evalfleet_store::Location>,
    /// Blocking work of requests.
    tracker: TaskTracker,
    /// Reports a read-only server computed, kept here since it writes
    /// nothing to the store.
    kept: evalfleet_reports::KeptInMemory,
    /// Each run's message templates, compiled once.
    templates: Mutex<HashMap<String, Arc<Templates>>>,
}

impl AppState {
    pub fn new(options: ServerOptions) -> Arc<Self> {
        Arc::new(Self {
            open: options.open,
            pool: Mutex::new(Vec::new()),
            key_digest: options.api_key.as_deref().map(digest),
            sessions: Default::default(),
            attempts: Default::default(),
            hosts: options.hosts,
            admission: options.admission,
            control: options.control,
            read_only: options.read_only,
            body_limit: options.body_limit,
            benches: options.benches,
            tracker: TaskTracker::new(),
            kept: Default::default(),
            templates: Mutex::new(HashMap::new()),
        })
    }

    /// `run_id`'s message templates, from its stored config.
    pub(crate) fn templates(
        &self,
        store: &mut dyn Store,
        run_id: &str,
    ) -> Result<Arc<Templates>, String> {
        if let Some(templates) = self
            .templates
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(run_id)
        {
            return Ok(templates.clone());
        }
        let run = store.run(run_id).map_err(|err| err.to_string())?;
        let loaded =
            evalfleet_config::load_snapshot_to_report(&run.config, Path::new(&run.config_dir))
                .map_err(|err| err.to_string())?;
        let templates =
            Arc::new(Templates::compile(&loaded.config.task).map_err(|err| err.to_string())?);
        self.templates
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(run_id.to_owned(), templates.clone());
        Ok(templates)
    }

    /// Where this server keeps the reports it computes: in the store, or
    /// in its memory when it may write nothing (`--read-only`).
    pub(crate) fn keeping(&self) -> evalfleet_reports::Keeping<'_> {
        if self.read_only {
            evalfleet_reports::Keeping::Memory(&self.kept)
        } else {
            evalfleet_reports::Keeping::Store
        }
    }

    /// Runs `work` on a blocking thread (it reads files or the store).
    pub async fn blocking<T, F>(&self, work: F) -> Result<T, ApiError>
    where
        T: Send + 'static,
        F: FnOnce() -> Result<T, ApiError> + Send + 'static,
    {
        self.tracker
            .spawn_blocking(work)
            .await
            .map_err(|err| ApiError::Internal(format!("a request's work failed: {err}")))?
    }

    /// Runs `work` with a store connection on a blocking thread.
    pub async fn with_store<T, F>(self: &Arc<Self>, work: F) -> Result<T, ApiError>
    where
        T: Send + 'static,
        F: FnOnce(&mut dyn Store) -> Result<T, ApiError> + Send + 'static,
    {
        let state = self.clone();
        self.blocking(move || {
            let pooled = state
                .pool
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop();
            let mut store = match pooled {
                Some(store) => store,
                None => (state.open)().map_err(ApiError::from)?,
            };
            let result = work(&mut *store);
            // A connection whose store failed is not kept.
            if !matches!(result, Err(ApiError::Store(StoreError::Backend { .. }))) {
                let mut pool = state.pool.lock().unwrap_or_else(PoisonError::into_inner);
                if pool.len() < POOL {
                    pool.push(store);
                }
            }
            result
        })
        .await
    }

    /// Opens a connection of its own (for a stream that reads on).
    pub fn open_store(&self) -> Result<Box<dyn Store>, StoreError> {
        (self.open)()
    }
}
