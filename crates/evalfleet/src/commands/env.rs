//! `evalfleet env`: a conversation run whose decisions a trainer takes
//! over HTTP (`reset`, `step`), while the episodes' personas and scorer run
//! on the fleet. The run is stored like any other (a new run each time),
//! and its logs are written when its episodes are done.

use std::io::Write;
use std::sync::Arc;

use evalfleet_core::config::Overrides;
use evalfleet_core::task::conversation::gym::Gym;
use evalfleet_server::env::{EnvServer, serve_env};
use tokio::net::TcpListener;

use super::run::{Attendance, new_session};
use crate::UsageError;
use crate::cli::EnvArgs;

pub async fn env(args: EnvArgs) -> anyhow::Result<u8> {
    let started = std::time::Instant::now();
    let overrides = Overrides {
        sessions: args.sessions,
        max_steps: args.max_steps,
        external_policy: true,
        ..Overrides::default()
    };
    let loaded = super::convert::load(&args.config, overrides)?;
    super::simulate::require_conversation(loaded.config.task.kind.conversation(), &args.config)?;
    let episodes = loaded
        .config
        .task
        .kind
        .conversation()
        .map_or(0, |settings| settings.sessions);
    let listener = TcpListener::bind(args.bind)
        .await
        .map_err(|err| UsageError(format!("cannot listen on {}: {err}", args.bind)))?;
    let addr = listener.local_addr()?;
    let mut session = new_session(
        loaded,
        &args.endpoints,
        args.yes,
        args.store,
        args.run_id,
        started,
    )
    .await?;
    let gym = Arc::new(Gym::new(args.action_timeout, args.envs.saturating_mul(2)));
    session.gym = Some(gym.clone());
    let run_id = session.run_id.clone();
    // The first line of stdout is the server's address, for scripts.
    println!("http://{addr}");
    std::io::stdout().flush()?;
    tracing::info!(
        "Environment server for run {run_id} ({episodes} episodes) on http://{addr}: POST /v1/reset, POST /v1/step."
    );
    let shutdown = super::stopped_by_signals()?;
    let server = EnvServer {
        gym: gym.clone(),
        run_id,
        episodes,
        reset_wait: args.reset_wait,
        step_wait: args.step_wait,
    };
    // Outside the run's tasks: it outlives the session, until a signal.
    #[allow(clippy::disallowed_methods)]
    let serving = tokio::spawn(serve_env(listener, Arc::new(server), shutdown.clone()));
    let code = super::run::execute(
        session,
        Attendance::Server {
            stop: shutdown.clone(),
        },
    )
    .await;
    // Every episode has ended: resets say so until the server is stopped.
    gym.finish();
    if !args.stay {
        shutdown.cancel();
    }
    serving.await??;
    code
}
