//! A session of a run, from the config to its end: a new run checked and
//! registered, or a stored one resumed (by `resume`, a worker, a server,
//! an environment or a bench cell), then launched on its fleet, run, and
//! stopped. The command line and the server call this; they show the
//! session (a progress display, the last lines) and decide nothing of it.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use evalfleet_config::{self as config, Config, ConfigError, LoadedConfig, Overrides};
use evalfleet_fleet::Endpoint;
use evalfleet_fleet::gpu::{self, GpuReport};
use evalfleet_fleet::runtime::{Fleet, FleetOptions, GpuPolicy};
use evalfleet_io::template::Templates;
use evalfleet_pipeline::task::conversation::gym::Gym;
use evalfleet_pipeline::{OpenStore, PipelineError, Progress};
use evalfleet_store::{Location, OpenOptions, RunRecord, Store};
use evalfleet_types::{RunStatus, StateCounts};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

pub use crate::error::SessionError;
use crate::frontend::{Frontend, UsageError, sandbox_dir, store_location, validate_run_id};

/// What a run's agents must not see: the store's folder (where its runs'
/// logs and sandboxes are too), the store's files (its folder may be the
/// agent's own), and the response cache's.
fn hidden_from_agents(location: &Location, config: &config::Config) -> Vec<std::path::PathBuf> {
    let mut hidden = vec![location.dir()];
    let mut files = Vec::new();
    if let Location::Sqlite(path) = location {
        files.push(path.clone());
    }
    files.extend(config.cache.path.clone());
    for file in files {
        for suffix in ["", "-wal", "-shm", "-journal"] {
            let mut name = file.clone().into_os_string();
            name.push(suffix);
            hidden.push(name.into());
        }
    }
    hidden
}
use crate::run::{self, SessionPlan, SessionReport};
use crate::{preflight, sheet};

/// Loads the config in `file` with `overrides`; a config of the original
/// conversation system is converted, and what of it was not is said.
pub fn load_config(
    file: &Path,
    overrides: Overrides,
    frontend: &Frontend,
) -> Result<LoadedConfig, ConfigError> {
    let loaded = config::load_file(file, overrides)?;
    if !loaded.notes.is_empty() {
        (frontend.say)(&format!(
            "{}: a config of the original system, converted (`evalfleet convert` writes the conversion out); {} of its keys not converted:",
            file.display(),
            loaded.notes.len()
        ));
        for note in &loaded.notes {
            (frontend.say)(&format!("  {note}"));
        }
    }
    Ok(loaded)
}

/// Checks that a config to simulate is a conversation.
pub fn require_conversation(
    settings: Option<&config::ConversationSettings>,
    config: &Path,
) -> Result<(), UsageError> {
    if settings.is_none() {
        return Err(UsageError(format!(
            "{}: simulate runs conversations; give the config task.kind: conversation (see examples/conversation.yaml)",
            config.display()
        )));
    }
    Ok(())
}

/// The endpoints that take part: `--endpoints`, checked against the config.
pub fn active(config: &Config, names: &[String]) -> Result<Option<Vec<String>>, UsageError> {
    if names.is_empty() {
        return Ok(None);
    }
    let known: Vec<&str> = config.endpoints.iter().map(|e| e.name.as_str()).collect();
    for name in names {
        if !known.contains(&name.as_str()) {
            return Err(UsageError(format!(
                "--endpoints: no endpoint '{name}' in the config (it has: {})",
                known.join(", ")
            )));
        }
    }
    Ok(Some(names.to_vec()))
}

/// Before engines start: GPUs that someone else is using are refused, or
/// asked about (`frontend.ask_gpus`), unless `yes` (`-y`).
pub async fn check_gpus(
    config: &Config,
    active: Option<&[String]>,
    yes: bool,
    frontend: &Frontend,
) -> Result<GpuPolicy, SessionError> {
    let wanted: Vec<(&str, &str, u64)> = config
        .endpoints
        .iter()
        .filter(|e| active.is_none_or(|names| names.contains(&e.name)))
        .filter_map(|e| match &e.kind {
            config::EndpointKind::Local(engine) => engine
                .gpu
                .as_deref()
                .map(|gpu| (e.name.as_str(), gpu, engine.gpu_memory_threshold_mb)),
            _ => None,
        })
        .collect();
    if wanted.is_empty() {
        return Ok(GpuPolicy::Refuse);
    }
    let report = gpu::report().await;
    if let GpuReport::Unavailable(why) = &report {
        tracing::warn!("Cannot check the GPUs before starting engines: {why}.");
        return Ok(GpuPolicy::Refuse);
    }
    let mut busy = Vec::new();
    for (name, devices, threshold) in wanted {
        for why in gpu::busy(&report, devices, threshold) {
            busy.push(format!("{name}: {why}"));
        }
    }
    if busy.is_empty() || yes {
        return Ok(if yes {
            GpuPolicy::Allow
        } else {
            GpuPolicy::Refuse
        });
    }
    let list = busy.join("\n  ");
    if (frontend.ask_gpus)(&list)? {
        return Ok(GpuPolicy::Allow);
    }
    Err(UsageError(format!(
        "refusing to start engines on GPUs someone else is using:\n  {list}\n(-y starts them anyway)"
    ))
    .into())
}

/// The fleet's options for a session of `run_id` in the store at `store`.
fn fleet_options(
    config: &Config,
    store: &Location,
    run_id: &str,
    active: Option<Vec<String>>,
    gpu_policy: GpuPolicy,
    frontend: &Frontend,
) -> Result<FleetOptions, SessionError> {
    let log_dir = store.dir().join(run_id);
    Ok(FleetOptions {
        launcher: evalfleet_fleet::engine::Launcher {
            program: frontend.supervisor.clone(),
            log_dir,
            claims: std::path::absolute(store.dir().join(".engines"))?,
        },
        mocks: frontend.mocks.clone(),
        active,
        gpu_policy,
        no_endpoint_timeout: config.timeouts.no_endpoint,
        first_answer_timeout: config.timeouts.first_answer,
    })
}

/// What a new session is asked to be.
pub struct NewSession<'a> {
    /// `--endpoints`: those that take part (empty: all).
    pub endpoints: &'a [String],
    /// `-y`: start engines on GPUs in use without asking.
    pub yes: bool,
    /// `--store`.
    pub store: Option<std::path::PathBuf>,
    /// `--run-id`.
    pub run_id: Option<String>,
    /// When the command started (registration says how long it took).
    pub started: Instant,
}

/// A new run of `loaded`, checked and registered: its templates, the
/// endpoints taking part, the GPUs, its store (`--store`, else the
/// config's ...).
pub async fn new_session(
    mut loaded: LoadedConfig,
    asked: NewSession<'_>,
    frontend: &Frontend,
) -> Result<Session, SessionError> {
    sheet::read(&mut loaded.config).await?;
    let templates = checked_templates(&loaded)?;
    let active = active(&loaded.config, asked.endpoints)?;
    let gpu_policy = check_gpus(&loaded.config, active.as_deref(), asked.yes, frontend).await?;
    let location = store_location(asked.store, loaded.config.store.as_deref())?;
    register(
        loaded,
        templates,
        location,
        asked.run_id,
        active,
        gpu_policy,
        asked.started,
    )
}

/// The task's templates, compiled and rendered for the first rows (every
/// problem named with its line) before anything is stored.
pub fn checked_templates(loaded: &LoadedConfig) -> Result<Templates, SessionError> {
    let templates = Templates::compile(&loaded.config.task)?;
    tokio::task::block_in_place(|| preflight::check(loaded, &templates))?;
    Ok(templates)
}

/// Registers a new run of `loaded` in the store at `location` (created if
/// need be; a store made for a run that could not be registered is
/// removed again): its items, in one transaction.
pub fn register(
    loaded: LoadedConfig,
    templates: Templates,
    location: Location,
    run_id: Option<String>,
    active: Option<Vec<String>>,
    gpu_policy: GpuPolicy,
    started: Instant,
) -> Result<Session, SessionError> {
    let run_id = match run_id {
        Some(id) => validate_run_id(id)?,
        None => new_run_id(&loaded.config.name),
    };
    let existed = location.exists();
    let mut store = evalfleet_store::open(
        &location,
        &OpenOptions {
            create: true,
            ..OpenOptions::default()
        },
    )?;
    let created =
        tokio::task::block_in_place(|| run::create(&mut *store, &loaded, &templates, &run_id));
    let record = match created {
        Ok(record) => record,
        Err(err) => {
            drop(store);
            if !existed {
                evalfleet_store::remove(&location);
            }
            return Err(err.into());
        }
    };
    tracing::info!(
        "Run {run_id}: {} items registered in {location} ({:.1}s).",
        record.total,
        started.elapsed().as_secs_f64()
    );
    let LoadedConfig { config, .. } = loaded;
    Ok(Session {
        location,
        store,
        run_id,
        config,
        templates,
        retry_failed: false,
        active,
        gpu_policy,
        gym: None,
    })
}

/// What a stored run has left to answer.
pub enum Resumable {
    /// Nothing: every item ended (the run is marked finished).
    Nothing {
        counts: StateCounts,
    },
    Session(Box<Session>),
}

/// What a resumed session is asked to be.
pub struct Resume<'a> {
    /// `--retry-failed`: failed items are answered again.
    pub retry_failed: bool,
    /// `--endpoints`: those that take part (empty: all).
    pub endpoints: &'a [String],
    /// `-y`: start engines on GPUs in use without asking.
    pub yes: bool,
    /// A resume asked for from outside (`evalfleet serve`): the roots the
    /// run's files (its dataset, its rows' images) are opened beneath, as
    /// a config from outside's are. `None`: a resume of the user's own.
    pub roots: Option<&'a [std::path::PathBuf]>,
}

/// A new session of the stored run `run_id`, with its stored config (or
/// the one in `config`), when it has items left to answer.
pub async fn resumable(
    location: Location,
    run_id: &str,
    config: Option<&Path>,
    asked: Resume<'_>,
    frontend: &Frontend,
) -> Result<Resumable, SessionError> {
    let mut store = evalfleet_store::open(&location, &OpenOptions::default())?;
    // `latest`, or the beginning of one run's id.
    let run_id = evalfleet_store::resolve_run_id(&mut *store, run_id)?;
    let record = store.run(&run_id)?;
    let loaded = match config {
        Some(file) => load_config(file, Overrides::default(), frontend)?,
        None => config::load_snapshot(&record.config, Path::new(&record.config_dir))?,
    };
    let mut loaded = loaded;
    if let Some(roots) = asked.roots {
        loaded.config.dataset.roots = Some(roots.to_vec());
        loaded.config.task.images.roots = Some(roots.to_vec());
    }
    resumable_with(location, store, &record, loaded, asked, frontend).await
}

/// [`resumable`], of the stored run `record` with `loaded` as its config.
pub async fn resumable_with(
    location: Location,
    mut store: Box<dyn Store>,
    record: &RunRecord,
    mut loaded: LoadedConfig,
    asked: Resume<'_>,
    frontend: &Frontend,
) -> Result<Resumable, SessionError> {
    let run_id = record.run_id.as_str();
    sheet::read(&mut loaded.config).await?;
    run::check_resume(record, &loaded.config).map_err(|source| {
        if loaded.config.dataset.sheet.is_some() {
            SessionError::SheetChanged {
                run_id: run_id.to_owned(),
                source,
            }
        } else {
            SessionError::Resume(source)
        }
    })?;
    let counts = store.counts(run_id)?;
    if counts.pending == 0 && !(asked.retry_failed && counts.failed > 0) {
        if record.status != RunStatus::Finished {
            store.set_status(run_id, RunStatus::Finished, None)?;
        }
        return Ok(Resumable::Nothing { counts });
    }
    let templates = checked_templates(&loaded)?;
    let active = active(&loaded.config, asked.endpoints)?;
    let gpu_policy = check_gpus(&loaded.config, active.as_deref(), asked.yes, frontend).await?;
    Ok(Resumable::Session(Box::new(Session {
        location,
        store,
        run_id: run_id.to_owned(),
        config: loaded.config,
        templates,
        retry_failed: asked.retry_failed,
        active,
        gpu_policy,
        gym: None,
    })))
}

/// Everything a session of a run needs.
pub struct Session {
    pub location: Location,
    store: Box<dyn Store>,
    pub run_id: String,
    config: Config,
    templates: Templates,
    retry_failed: bool,
    active: Option<Vec<String>>,
    gpu_policy: GpuPolicy,
    /// Where a trainer takes the conversation's decisions (`env`).
    pub gym: Option<Arc<Gym>>,
}

impl Session {
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Tells the endpoints' errors without what they wrote (their status
    /// and reason only): for a run whose config came from a request, so
    /// that an endpoint at an address the requester cannot reach is not
    /// read through the items' errors.
    pub fn quiet_endpoint_errors(&mut self) {
        for endpoint in &mut self.config.endpoints {
            endpoint.quiet_errors = true;
        }
    }

    /// Starts the session's fleet and readies its pipeline; it runs when
    /// [`Launched::run`] is awaited, and stops when `stop` is cancelled.
    pub async fn launch(
        self,
        frontend: &Frontend,
        stop: CancellationToken,
    ) -> Result<Launched, SessionError> {
        let Session {
            location,
            mut store,
            run_id,
            config,
            templates,
            retry_failed,
            active,
            gpu_policy,
            gym,
        } = self;
        let started = Instant::now();
        let scored = !config.task.eval.metrics.is_empty();
        let conversation = config.task.kind.conversation().cloned();
        let grace = config.shutdown_grace;
        let options = fleet_options(&config, &location, &run_id, active, gpu_policy, frontend)?;
        let (sheet, on_result) = match sheet::start(
            &config,
            &mut *store,
            &location,
            &run_id,
            frontend.say.clone(),
        )
        .await?
        {
            Some((live, tap)) => (Some(live), Some(tap)),
            None => (None, None),
        };
        let mut fleet = Fleet::new(&config, options);
        let hidden = hidden_from_agents(&location, &config);
        let plan = SessionPlan {
            run_id: run_id.clone(),
            config: Arc::new(config),
            templates: Arc::new(templates),
            endpoints: fleet.endpoints.clone(),
            fleet: fleet.handle(),
            retry_failed,
            sandbox_dir: sandbox_dir(&location, &run_id),
            hidden,
            gym: gym.clone(),
            gateway_host: frontend.gateway.clone(),
            on_result,
        };
        let prepared = run::prepare(&mut *store, &plan)?;
        // The writer's and the reader's connections use the cache.
        let with_cache = OpenOptions {
            create: false,
            cache_file: plan
                .config
                .cache
                .path
                .clone()
                .filter(|_| plan.config.cache.mode != config::cache::CacheMode::Off),
            read_only: false,
            // A worker rides out a database outage of any length.
            ride_out_outages: true,
        };
        drop(store);
        let open: Arc<OpenStore> = {
            let location = location.clone();
            Arc::new(move || evalfleet_store::open(&location, &with_cache))
        };
        fleet.start(
            &run_id,
            prepared.worker(),
            evalfleet_store::open(&location, &OpenOptions::default())?,
        );
        // Workers sharing a store share their API keys' quotas through it,
        // on a connection of the fleet's own (a store that does not share
        // is dropped at once).
        fleet.share_quotas(evalfleet_store::open(&location, &OpenOptions::default())?);
        let pending_at_start = prepared.progress.total
            - prepared.progress.done_before
            - prepared.progress.failed_before;
        if let Some(gym) = &gym {
            gym.expect(pending_at_start);
        }
        Ok(Launched {
            progress: prepared.progress.clone(),
            run: Box::pin(run::run_session(plan, prepared, open, stop)),
            fleet,
            sheet,
            ended: Ending {
                location,
                run_id,
                pending_at_start,
                grace,
                scored,
                conversation,
                trainer: gym,
                started,
            },
        })
    }
}

type Running = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<SessionReport, PipelineError>> + Send>,
>;

/// A session whose fleet has started.
pub struct Launched {
    progress: Arc<Progress>,
    run: Running,
    fleet: Fleet,
    sheet: Option<sheet::Live>,
    ended: Ending,
}

/// What is known of a session from its launch to its end.
pub struct Ending {
    pub location: Location,
    pub run_id: String,
    /// Items neither done nor failed when the session began.
    pub pending_at_start: u64,
    /// How long calls in flight may finish once the session is stopped.
    pub grace: Duration,
    /// Whether the run has metrics.
    pub scored: bool,
    /// The conversation's settings, when the run is one.
    pub conversation: Option<config::ConversationSettings>,
    /// Where a trainer took the decisions (`env`).
    pub trainer: Option<Arc<Gym>>,
    started: Instant,
}

impl Launched {
    /// The session's counts as they change.
    pub fn progress(&self) -> &Arc<Progress> {
        &self.progress
    }

    /// The session's endpoints.
    pub fn endpoints(&self) -> &[Arc<Endpoint>] {
        &self.fleet.endpoints
    }

    pub fn ending(&self) -> &Ending {
        &self.ended
    }

    /// Answers the session's items until they end or it is stopped; a
    /// trainer's resets then learn that no episode is left.
    pub async fn run(self) -> Ran {
        let span = tracing::info_span!("run", id = %self.ended.run_id);
        let result = self.run.instrument(span).await;
        // The rate counts the session, not the time engines take to stop.
        let elapsed = self.ended.started.elapsed();
        if let Some(gym) = &self.ended.trainer {
            gym.finish();
        }
        Ran {
            result,
            elapsed,
            progress: self.progress,
            fleet: self.fleet,
            sheet: self.sheet,
            ended: self.ended,
        }
    }
}

/// A session that has answered what it could; its fleet still runs.
pub struct Ran {
    result: Result<SessionReport, PipelineError>,
    elapsed: Duration,
    progress: Arc<Progress>,
    fleet: Fleet,
    sheet: Option<sheet::Live>,
    ended: Ending,
}

impl Ran {
    /// Stops the fleet, then writes to the sheet what waits.
    pub async fn stop(self) -> Ended {
        let Ran {
            result,
            elapsed,
            progress,
            fleet,
            sheet,
            ended,
        } = self;
        fleet.stop().await;
        // The session's writer, and with it the sheet's tap, is gone: what
        // waits is written.
        let sheet_written = match sheet {
            Some(live) => live.finish().await,
            None => true,
        };
        let result = result.map_err(|err| {
            let run_id = ended.run_id.clone();
            match err {
                PipelineError::Dataset(source) => SessionError::Dataset { run_id, source },
                source @ PipelineError::Store(evalfleet_store::StoreError::Unwritable {
                    ..
                }) => SessionError::StoreUnwritable {
                    run_id,
                    source: Box::new(source),
                },
                source => SessionError::Stopped {
                    run_id,
                    source: Box::new(source),
                },
            }
        });
        Ended {
            result,
            elapsed,
            progress,
            sheet_written,
            ending: ended,
        }
    }
}

/// A session that has ended.
pub struct Ended {
    /// How it ended (an error: it stopped, as the store says).
    pub result: Result<SessionReport, SessionError>,
    /// How long it answered items.
    pub elapsed: Duration,
    pub progress: Arc<Progress>,
    /// Whether every result went to the sheet (or there is none).
    pub sheet_written: bool,
    pub ending: Ending,
}

/// `NAME-YYYYMMDD-HHMMSS-XXXX`, with the name reduced to letters, digits and `-`.
fn new_run_id(name: &str) -> String {
    use std::hash::BuildHasher;
    let mut slug: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    slug = slug.trim_matches('-').chars().take(40).collect();
    if slug.is_empty() {
        slug.push_str("run");
    }
    let stamp: String = humantime::format_rfc3339_seconds(SystemTime::now())
        .to_string()
        .chars()
        .filter(char::is_ascii_digit)
        .collect();
    let (date, time) = stamp.split_at(8.min(stamp.len()));
    let noise = std::hash::RandomState::new().hash_one(SystemTime::now()) & 0xffff;
    format!("{slug}-{date}-{time}-{noise:04x}")
}
