//! `evalfleet serve`: the HTTP API and dashboard over a store, and the runs
//! started from them, answered in this process.

use std::collections::HashMap;
use std::io::Write;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use evalfleet_config::{Admission, ConfigError};
use evalfleet_core::rescore::{Plan, RescoreError};
use evalfleet_pipeline::OpenStore;
use evalfleet_server::control::{Pending, Rescored};
use evalfleet_server::{ApiError, AppState, HostPolicy, RunControl, ServerOptions, StartRun};
use evalfleet_store::CreateRunError;
use evalfleet_store::{Location, OpenOptions};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use evalfleet_core::Frontend;
use evalfleet_core::session::{self, Resumable, Resume, Session};

use super::store_location;
use crate::attend::{self, Attendance, session_error};
use crate::cli::ServeArgs;
use crate::{EXIT_OK, UsageError};

/// The largest request body taken (a config sent as text).
const BODY_LIMIT: usize = 4 << 20;

pub async fn serve(args: ServeArgs) -> anyhow::Result<u8> {
    let key = std::env::var("EVALFLEET_API_KEY")
        .ok()
        .filter(|k| !k.trim().is_empty());
    if let Some(refusal) = evalfleet_server::open_bind_refusal(args.bind, key.as_deref()) {
        return Err(UsageError(refusal).into());
    }
    let location = store_location(args.store, None)?;
    evalfleet_store::open(
        &location,
        &OpenOptions {
            create: true,
            ..OpenOptions::default()
        },
    )?;
    let roots = if args.allow_roots.is_empty() {
        vec![std::env::current_dir()?]
    } else {
        let mut roots = Vec::new();
        for root in args.allow_roots {
            roots
                .push(std::fs::canonicalize(&root).map_err(|err| {
                    UsageError(format!("--allow-root {}: {err}", root.display()))
                })?);
        }
        roots
    };
    let control = Arc::new(Control {
        roots: roots.clone(),
        location: location.clone(),
        frontend: attend::frontend()?,
        allow_commands: args.allow_commands,
        runs: Mutex::new(HashMap::new()),
        tracker: TaskTracker::new(),
    });
    let open: Arc<OpenStore> = {
        let location = location.clone();
        Arc::new(move || evalfleet_store::open(&location, &OpenOptions::default()))
    };
    let destinations = allowed_env(&args.allow_env).map_err(UsageError)?;
    let state = AppState::new(ServerOptions {
        open,
        api_key: key,
        hosts: HostPolicy::new(args.bind, &args.allow_hosts),
        admission: Admission {
            roots,
            env: destinations.keys().cloned().collect(),
            destinations,
            commands: args.allow_commands,
        },
        control: (!args.read_only).then(|| Arc::new(ControlHandle(control.clone())) as _),
        read_only: args.read_only,
        body_limit: BODY_LIMIT,
        benches: Some(location.clone()),
    });
    let listener = TcpListener::bind(args.bind)
        .await
        .map_err(|err| UsageError(format!("cannot listen on {}: {err}", args.bind)))?;
    let addr = listener.local_addr()?;
    // The first line of stdout is the address, for scripts.
    println!("http://{addr}");
    std::io::stdout().flush()?;
    tracing::info!("Serving {location} on http://{addr}.");

    let shutdown = super::stopped_by_signals()?;
    evalfleet_server::serve(listener, state, shutdown).await?;
    // Runs still answered here stop as a Ctrl-C stops them: resumable.
    control.stop_all();
    control.tracker.close();
    control.tracker.wait().await;
    Ok(EXIT_OK)
}

/// What `--allow-env NAME=HOST[,HOST]` allows: each variable, and the
/// hosts it may be sent to. A variable without hosts is refused: a config
/// sent to the server chooses its endpoint's `base_url`, so a secret
/// allowed everywhere would be sent wherever the requester likes.
fn allowed_env(
    given: &[String],
) -> Result<std::collections::BTreeMap<String, std::collections::BTreeSet<String>>, String> {
    let mut out = std::collections::BTreeMap::new();
    for arg in given {
        let Some((name, hosts)) = arg.split_once('=') else {
            return Err(format!(
                "--allow-env {arg}: name the hosts the secret may be sent to, as --allow-env {arg}=HOST[,HOST] (e.g. {arg}=api.openai.com): an endpoint of a config sent to the server may use ${{{arg}}} only when its base_url is on one of them"
            ));
        };
        let name = name.trim();
        if !evalfleet_config::is_variable_name(name) {
            return Err(format!(
                "--allow-env {arg}: '{name}' is not a variable's name (letters, digits and '_')"
            ));
        }
        let entry: &mut std::collections::BTreeSet<String> =
            out.entry(name.to_owned()).or_default();
        for host in hosts.split(',') {
            let host = Admission::host(host);
            if host.is_empty() || host.contains(['/', ' ', '@']) || host.contains("://") {
                return Err(format!(
                    "--allow-env {arg}: hosts are names or IP addresses, without scheme, port or path, separated by ','"
                ));
            }
            entry.insert(host);
        }
    }
    Ok(out)
}

/// The runs this process answers for the server.
struct Control {
    location: Location,
    /// What the runs answered here are lent.
    frontend: Frontend,
    /// `--allow-commands`: a rescore may start metric backends.
    allow_commands: bool,
    /// `--allow-root`: what a run resumed here may read, as a config sent
    /// here may.
    roots: Vec<std::path::PathBuf>,
    runs: Mutex<HashMap<String, CancellationToken>>,
    tracker: TaskTracker,
}

impl Control {
    fn runs(&self) -> std::sync::MutexGuard<'_, HashMap<String, CancellationToken>> {
        self.runs.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Answers `session` in the background until it ends or is stopped.
    /// Every run this server answers was started or resumed by a request:
    /// its endpoints' error answers are told by status and reason only.
    fn launch(self: &Arc<Self>, mut session: Session) {
        session.quiet_endpoint_errors();
        let run_id = session.run_id.clone();
        let stop = CancellationToken::new();
        self.runs().insert(run_id.clone(), stop.clone());
        let this = self.clone();
        self.tracker.spawn(async move {
            match attend::execute(session, Attendance::Server { stop }, None, &this.frontend).await
            {
                Ok(code) => tracing::info!("Run {run_id} ended (exit code {code})."),
                Err(err) => tracing::warn!("Run {run_id} stopped: {err:#}."),
            }
            this.runs().remove(&run_id);
        });
    }

    fn stop_all(&self) {
        for stop in self.runs().values() {
            stop.cancel();
        }
    }
}

/// What the server holds of [`Control`].
struct ControlHandle(Arc<Control>);

/// An error of the run machinery as the API says it.
fn api_error(err: anyhow::Error) -> ApiError {
    if let Some(config) = err.downcast_ref::<ConfigError>() {
        return ApiError::Invalid(config.to_string());
    }
    if let Some(created) = err.downcast_ref::<CreateRunError>() {
        return match created {
            CreateRunError::RunExists(_) => ApiError::Conflict(created.to_string()),
            CreateRunError::Store(_) => ApiError::Internal(created.to_string()),
            _ => ApiError::Invalid(created.to_string()),
        };
    }
    if let Some(usage) = err.downcast_ref::<UsageError>() {
        return ApiError::BadRequest(usage.to_string());
    }
    match crate::fault_of(&err) {
        evalfleet_types::Fault::BadInput => ApiError::Invalid(format!("{err:#}")),
        _ => ApiError::Internal(format!("{err:#}")),
    }
}

impl RunControl for ControlHandle {
    fn start(&self, request: StartRun) -> Pending<String> {
        let control = self.0.clone();
        Box::pin(async move {
            let loaded = *request.config;
            let frontend = &control.frontend;
            let templates =
                session::checked_templates(&loaded).map_err(|err| api_error(session_error(err)))?;
            let gpu_policy = session::check_gpus(&loaded.config, None, false, frontend)
                .await
                .map_err(|err| api_error(session_error(err)))?;
            let session = session::register(
                loaded,
                templates,
                control.location.clone(),
                request.run_id,
                None,
                gpu_policy,
                Instant::now(),
            )
            .map_err(|err| api_error(session_error(err)))?;
            let run_id = session.run_id.clone();
            control.launch(session);
            Ok(run_id)
        })
    }

    fn resume(&self, run_id: String, retry_failed: bool) -> Pending<()> {
        let control = self.0.clone();
        Box::pin(async move {
            if control.runs().contains_key(&run_id) {
                return Err(ApiError::Conflict(format!(
                    "run {run_id} is running in this server already"
                )));
            }
            let resumed = session::resumable(
                control.location.clone(),
                &run_id,
                None,
                Resume {
                    retry_failed,
                    endpoints: &[],
                    yes: false,
                    // Resumed at a request: its files are read as a
                    // config sent here reads them.
                    roots: Some(&control.roots),
                },
                &control.frontend,
            )
            .await
            .map_err(session_error)
            .map_err(|err| match err.downcast::<evalfleet_store::StoreError>() {
                Ok(store) => ApiError::Store(store),
                Err(err) => api_error(err),
            })?;
            match resumed {
                Resumable::Nothing { counts } => Err(ApiError::Conflict(format!(
                    "run {run_id} has nothing to resume ({} done, {} failed{})",
                    counts.done,
                    counts.failed,
                    if counts.failed > 0 {
                        "; retry_failed answers the failed ones again"
                    } else {
                        ""
                    }
                ))),
                Resumable::Session(session) => {
                    control.launch(*session);
                    Ok(())
                }
            }
        })
    }

    fn cancel(&self, run_id: &str) -> bool {
        match self.0.runs().get(run_id) {
            Some(stop) => {
                stop.cancel();
                true
            }
            None => false,
        }
    }

    fn rescore(&self, run_id: String, metrics: Vec<String>) -> Pending<Rescored> {
        let control = self.0.clone();
        Box::pin(async move {
            if control.runs().contains_key(&run_id) {
                return Err(ApiError::Conflict(format!(
                    "run {run_id} is running; score it when it has stopped"
                )));
            }
            let rescore_error = |err: RescoreError| match err {
                RescoreError::Store(store) => ApiError::Store(store),
                RescoreError::Unfit(why) if why.contains("is running") => ApiError::Conflict(why),
                other => match other.fault() {
                    evalfleet_types::Fault::BadInput => ApiError::Invalid(other.to_string()),
                    _ => ApiError::Internal(other.to_string()),
                },
            };
            let mut store = evalfleet_store::open(&control.location, &OpenOptions::default())?;
            let plan = tokio::task::block_in_place(|| {
                Plan::new(&mut *store, &run_id, None, &metrics, false)
            })
            .map_err(rescore_error)?;
            let backends = plan.backends();
            if !control.allow_commands && !backends.is_empty() {
                return Err(ApiError::Forbidden(format!(
                    "scoring run {run_id} again starts its metric backends ({}), which run commands on the server; the server allows it only when started with --allow-commands",
                    backends.join(", ")
                )));
            }
            if let Some(file) = plan.cache_file() {
                store = evalfleet_store::open(
                    &control.location,
                    &OpenOptions {
                        create: false,
                        cache_file: Some(file.clone()),
                        ..OpenOptions::default()
                    },
                )?;
            }
            let sandbox = super::sandbox_dir(&control.location, &format!("{run_id}-score"));
            let done = plan
                .apply(&mut *store, &sandbox)
                .await
                .map_err(rescore_error)?;
            Ok(Rescored {
                run_id,
                answers: done.answers,
                usable: done.usable,
                metrics: done.metrics,
            })
        })
    }

    fn running(&self) -> Vec<String> {
        let mut runs: Vec<String> = self.0.runs().keys().cloned().collect();
        runs.sort();
        runs
    }
}
