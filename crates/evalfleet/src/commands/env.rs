//! `evalfleet env`: a conversation run whose decisions a trainer takes
//! over HTTP (`reset`, `step`, `close`), while the episodes' personas and
//! scorer run on the fleet. The run is stored like any other (a new run,
//! or with `--resume` the rest of a stopped one), and its journal writes
//! the logs a trainer watches as its episodes end: a line per batch of
//! `--batch-size` episodes (`batch_summary.jsonl`, `metrics.jsonl`), their
//! steps, their start and end, and policy-collapse alarms at once.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use evalfleet_config::{self as config, Overrides, PolicyKind};
use evalfleet_pipeline::task::conversation::gym::Gym;
use evalfleet_server::env::{EnvServer, serve_env};
use evalfleet_store::OpenOptions;
use tokio::net::TcpListener;
use tokio_util::task::TaskTracker;

use evalfleet_core::Frontend;
use evalfleet_core::conversation::Journal;
use evalfleet_core::session::{
    NewSession, Resumable, Resume, Session, new_session, require_conversation, resumable_with,
};

use super::store_location;
use crate::attend::{self, Attendance, Lift};
use crate::cli::EnvArgs;
use crate::{EXIT_FAILED, EXIT_OK, UsageError, ui};

pub async fn env(args: EnvArgs) -> anyhow::Result<u8> {
    let started = Instant::now();
    let overrides = Overrides {
        sessions: args.sessions,
        max_steps: args.max_steps,
        batch_size: args.batch_size,
        external_policy: true,
        ..Overrides::default()
    };
    let key = std::env::var("EVALFLEET_API_KEY")
        .ok()
        .filter(|k| !k.trim().is_empty());
    if let Some(refusal) = evalfleet_server::open_bind_refusal(args.bind, key.as_deref()) {
        return Err(UsageError(refusal).into());
    }
    let listener = TcpListener::bind(args.bind)
        .await
        .map_err(|err| UsageError(format!("cannot listen on {}: {err}", args.bind)))?;
    let addr = listener.local_addr()?;
    let frontend = attend::frontend()?;
    let mut session = match &args.resume {
        None => {
            let Some(file) = &args.config else {
                return Err(UsageError("env needs a config, or --resume RUN_ID".to_owned()).into());
            };
            let loaded = attend::load(file, overrides)?;
            require_conversation(loaded.config.task.kind.conversation(), file)?;
            new_session(
                loaded,
                NewSession {
                    endpoints: &args.endpoints,
                    yes: args.yes,
                    store: args.store.clone(),
                    run_id: args.run_id.clone(),
                    started,
                },
                &frontend,
            )
            .await
            .lift()?
        }
        Some(run_id) => match resumed(&args, run_id, overrides, &frontend).await? {
            Ok(session) => session,
            Err(code) => return Ok(code),
        },
    };
    let Some(settings) = session.config().task.kind.conversation().cloned() else {
        return Err(UsageError(format!(
            "run {} is no conversation: env serves conversations",
            session.run_id
        ))
        .into());
    };
    let episodes = settings.sessions;
    let gym = Arc::new(Gym::new(args.action_timeout, args.envs.saturating_mul(2)));
    session.gym = Some(gym.clone());
    let run_id = session.run_id.clone();
    let tracker = TaskTracker::new();
    let journal = Journal::open(
        &session.location,
        &run_id,
        &settings,
        args.batch_size.unwrap_or(settings.batch_size),
    )
    .lift()?;
    let journaling = tracker.spawn(journal.follow(gym.journal()));
    let journal: attend::Journal = Box::pin(async move { journaling.await?.lift() });
    // The first line of stdout is the server's address, for scripts.
    println!("http://{addr}");
    std::io::stdout().flush()?;
    tracing::info!(
        "Environment server for run {run_id} ({episodes} episodes) on http://{addr}: POST /v1/reset, /v1/step, /v1/close."
    );
    let shutdown = super::stopped_by_signals()?;
    let server = EnvServer {
        gym: gym.clone(),
        run_id: run_id.clone(),
        episodes,
        reset_wait: args.reset_wait,
        step_wait: args.step_wait,
        api_key: key,
    };
    // It outlives the session: trainers are told 410 until a signal.
    let serving = tracker.spawn(serve_env(listener, Arc::new(server), shutdown.clone()));
    tracker.close();
    let code = attend::execute(
        session,
        Attendance::Server {
            stop: shutdown.clone(),
        },
        Some(journal),
        &frontend,
    )
    .await;
    // Whatever stopped the session, no episode comes any more (and the
    // journal ends, had the session no time to start).
    gym.finish();
    if args.exit_when_done || shutdown.is_cancelled() || code.is_err() {
        shutdown.cancel();
    } else {
        ui::note(&format!(
            "Every episode of run {run_id} has ended; serving on (resets answer 410) until Ctrl-C."
        ));
    }
    serving.await??;
    tracker.wait().await;
    code
}

/// The session that serves the rest of the stored run `run_id`, or the
/// exit code when every episode has ended (said).
async fn resumed(
    args: &EnvArgs,
    run_id: &str,
    overrides: Overrides,
    frontend: &Frontend,
) -> anyhow::Result<Result<Session, u8>> {
    let location = store_location(args.store.clone(), None)?;
    let store = evalfleet_store::open(&location, &OpenOptions::default())?;
    let record = {
        let mut store = evalfleet_store::open(&location, &OpenOptions::read_only())?;
        store.run(run_id)?
    };
    let loaded = match &args.config {
        Some(file) => attend::load(file, overrides)?,
        None => config::load_snapshot(&record.config, Path::new(&record.config_dir))?,
    };
    let external = loaded
        .config
        .task
        .kind
        .conversation()
        .is_some_and(|s| s.policy.kind == PolicyKind::External);
    if !external {
        return Err(UsageError(format!(
            "run {run_id} is not an environment's run (its policy is not a trainer's): resume it with evalfleet resume"
        ))
        .into());
    }
    let resumable = resumable_with(
        location,
        store,
        &record,
        loaded,
        Resume {
            retry_failed: args.retry_failed,
            endpoints: &args.endpoints,
            yes: args.yes,
            roots: None,
        },
        frontend,
    )
    .await
    .lift()?;
    match resumable {
        Resumable::Session(session) => Ok(Ok(*session)),
        Resumable::Nothing { counts } => {
            ui::note(&format!(
                "Run {run_id} has no episode left to serve ({} done, {} failed){}.",
                counts.done,
                counts.failed,
                if counts.failed > 0 {
                    "; --retry-failed serves the failed ones again"
                } else {
                    ""
                }
            ));
            Ok(Err(if counts.failed > 0 {
                EXIT_FAILED
            } else {
                EXIT_OK
            }))
        }
    }
}
