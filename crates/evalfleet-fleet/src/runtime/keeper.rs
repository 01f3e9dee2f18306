//! The keeper of each endpoint that takes part: it starts the endpoint (a
//! mock, a start command, a local or remote engine and its readiness),
//! serves it while it is watched, restarts an engine that dies or stays
//! unhealthy, and leaves the endpoint out after its last restart.

use std::sync::{Arc, PoisonError};
use std::time::Duration;

use evalfleet_config::{EndpointKind, Engine};
use evalfleet_types::EventKind;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::watch::{Ended, health_url, probe, watch};
use super::{GpuPolicy, Shared};
use crate::client::{ChatClient, http_client};
use crate::engine::{
    Claim, Job, Launcher, RemoteCommands, Supervised, free_port, remote_claim, run_shell,
    shell_join,
};
use crate::gpu;
use crate::{Endpoint, Phase};

/// Makes the endpoint's client for `base_url` and marks it ready.
fn serve(
    shared: &Shared,
    endpoint: &Endpoint,
    base_url: &str,
    pid: Option<u32>,
) -> Result<(), String> {
    let client = ChatClient::new(
        &endpoint.config,
        base_url,
        &shared.task_params,
        shared.stream,
    )?
    .with_stalls(shared.stalls);
    // A server that serves one stream at a time and cuts the running one
    // for the next is found with two calls, not eight.
    if shared.stream {
        endpoint.limit.open_streamed();
    }
    endpoint.set_client(client, base_url.to_owned(), pid);
    endpoint.set_phase(Phase::Ready);
    // Its engine's load is read off the call path while it serves.
    if let Some(poller) = endpoint.load_poller(base_url) {
        shared
            .tracker
            .spawn(tracing::Instrument::in_current_span(poller.run()));
    }
    Ok(())
}

pub(super) async fn keep(shared: Arc<Shared>, endpoint: Arc<Endpoint>, stop: CancellationToken) {
    let config = endpoint.config.clone();
    match &config.kind {
        EndpointKind::Mock(settings) => {
            let started = shared.options.mocks.start((**settings).clone()).await;
            match started {
                Ok((url, guard)) => {
                    if let Err(err) = serve(&shared, &endpoint, &url, None) {
                        exclude(&shared, &endpoint, format!("cannot reach its mock: {err}"));
                        return;
                    }
                    watch(&shared, &endpoint, &url, &stop, None, None).await;
                    drop(guard);
                }
                Err(err) => {
                    exclude(&shared, &endpoint, format!("its mock did not start: {err}"));
                    return;
                }
            }
        }
        EndpointKind::External {
            base_url,
            start_cmd,
            stop_cmd,
        } => {
            if let Some(command) = start_cmd {
                match run_shell(command, Duration::from_secs(600)).await {
                    Ok(()) => shared.event(
                        &endpoint,
                        EventKind::Started,
                        format!("Ran start_cmd of {}.", endpoint.name),
                    ),
                    Err(err) => {
                        exclude(&shared, &endpoint, format!("its start_cmd failed: {err}"));
                        return;
                    }
                }
                // What it started may take a while to serve (a server
                // loading its model): its calls wait until it answers.
                if let Err(err) = answering(&endpoint, base_url, START_CMD_READY, &stop).await {
                    exclude(&shared, &endpoint, err);
                    return;
                }
            }
            if let Err(err) = serve(&shared, &endpoint, base_url, None) {
                exclude(&shared, &endpoint, err);
                return;
            }
            watch(&shared, &endpoint, base_url, &stop, None, None).await;
            if let Some(command) = stop_cmd {
                match run_shell(command, Duration::from_secs(120)).await {
                    Ok(()) => shared.event(
                        &endpoint,
                        EventKind::Stopped,
                        format!("Ran stop_cmd of {}.", endpoint.name),
                    ),
                    Err(err) => shared.event(
                        &endpoint,
                        EventKind::StopFailed,
                        format!("stop_cmd of {} failed: {err}", endpoint.name),
                    ),
                }
            }
        }
        EndpointKind::Local(_) | EndpointKind::Remote(_) => {
            keep_engine(&shared, &endpoint, &stop).await;
        }
    }
    if endpoint.phase() != Phase::Excluded {
        endpoint.set_phase(Phase::Idle);
    }
}

fn exclude(shared: &Shared, endpoint: &Endpoint, why: String) {
    endpoint.set_phase(Phase::Excluded);
    shared
        .excluded
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(endpoint.name.clone(), why.clone());
    shared.event(
        endpoint,
        EventKind::Excluded,
        format!("Endpoint {} is left out of the run: {why}.", endpoint.name),
    );
}

/// An engine that is up: its process (for remote ones, the tunnel) and URL.
pub(crate) struct Running {
    pub(crate) process: Supervised,
    pub(crate) base_url: String,
}

pub(crate) async fn launch(
    launcher: &Launcher,
    endpoint: &Endpoint,
    local_port: u16,
) -> Result<Running, String> {
    let base_url = format!("http://127.0.0.1:{local_port}/v1");
    match &endpoint.config.kind {
        EndpointKind::Local(engine) => {
            let command = engine.render(&endpoint.model, local_port);
            let mut env: Vec<(String, String)> = engine
                .env
                .iter()
                .map(|(k, v)| (k.clone(), v.expose().to_owned()))
                .collect();
            if let Some(gpu) = &engine.gpu {
                env.push(("CUDA_VISIBLE_DEVICES".to_owned(), gpu.clone()));
            }
            let process = launcher
                .spawn(&Job {
                    name: &endpoint.name,
                    command: &command,
                    label: None,
                    env: &env,
                    on_exit: None,
                    stop_grace: engine.stop_grace,
                    claim: Claim::Own {
                        endpoint: endpoint.name.clone(),
                    },
                })
                .await
                .map_err(|err| format!("cannot start `{command}`: {err}"))?;
            Ok(Running { process, base_url })
        }
        EndpointKind::Remote(remote) => {
            let remote_port = remote.engine.port.unwrap_or(8000);
            let owner = launcher.owner();
            let commands =
                RemoteCommands::new(remote, &endpoint.model, remote_port, local_port, &owner);
            // The start runs under the supervisor too: a run killed while
            // the session is being made still has it ended.
            let label = format!(
                "{}: tmux session {} (engine on port {remote_port}), tunnel from port {local_port}, following its output",
                remote.host, remote.session
            );
            let grace = remote.engine.stop_grace;
            let process = launcher
                .spawn(&Job {
                    name: &endpoint.name,
                    command: &commands.supervised(),
                    label: Some(&label),
                    env: &[],
                    on_exit: Some(&shell_join(&commands.stop)),
                    stop_grace: grace,
                    claim: Claim::Shared {
                        key: remote_claim(remote),
                        // A run that is stopping it lets go within its
                        // grace, twice (tunnel, then engine), and an SSH
                        // login.
                        wait: grace * 2 + Duration::from_secs(30),
                    },
                })
                .await
                .map_err(|err| format!("cannot start `{}`: {err}", remote.ssh))?;
            Ok(Running { process, base_url })
        }
        _ => Err("not an engine".to_owned()),
    }
}

/// How long what an external endpoint's `start_cmd` started may take to
/// answer its health path.
const START_CMD_READY: Duration = Duration::from_secs(600);

/// Waits until the external endpoint at `base_url` answers its health
/// path (after its `start_cmd`), the run stops, or `timeout` passes.
async fn answering(
    endpoint: &Endpoint,
    base_url: &str,
    timeout: Duration,
    stop: &CancellationToken,
) -> Result<(), String> {
    let url = health_url(&endpoint.config, base_url);
    let http = http_client(1).map_err(|err| err.to_string())?;
    let deadline = Instant::now() + timeout;
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tokio::select! {
            () = stop.cancelled() => return Err("the run is stopping".to_owned()),
            _ = tick.tick() => {}
        }
        match probe(endpoint, &http, &url, Duration::from_secs(5)).await {
            Ok(()) => return Ok(()),
            Err(err) if Instant::now() >= deadline => {
                return Err(format!(
                    "what its start_cmd started did not answer {url} within {} (last: {err})",
                    humantime::format_duration(timeout)
                ));
            }
            Err(_) => {}
        }
    }
}

/// Waits until the engine answers its health path, it exits, the start-up
/// timeout passes, or the run stops. A failure says what the engine said
/// last.
pub(crate) async fn ready(
    endpoint: &Endpoint,
    running: &mut Running,
    timeout: Duration,
    every: Duration,
    stop: &CancellationToken,
) -> Result<(), String> {
    let url = health_url(&endpoint.config, &running.base_url);
    let http = http_client(1).map_err(|err| err.to_string())?;
    let deadline = Instant::now() + timeout;
    let mut last = "not started".to_owned();
    let mut tick = tokio::time::interval(every);
    loop {
        tokio::select! {
            () = stop.cancelled() => return Err("the run is stopping".to_owned()),
            status = running.process.wait() => {
                return Err(running.process.with_last_lines(format!(
                    "it exited before it was ready ({}; log {})",
                    status.map_or_else(|e| e.to_string(), |s| s.to_string()),
                    running.process.log.display()
                )));
            }
            () = tokio::time::sleep_until(deadline) => {
                return Err(running.process.with_last_lines(format!(
                    "not ready within {} (last probe: {last}; log {})",
                    humantime::format_duration(timeout),
                    running.process.log.display()
                )));
            }
            _ = tick.tick() => {}
        }
        match probe(endpoint, &http, &url, Duration::from_secs(5)).await {
            Ok(()) => return Ok(()),
            Err(err) => last = err,
        }
    }
}

async fn keep_engine(shared: &Shared, endpoint: &Endpoint, stop: &CancellationToken) {
    let Some(engine) = endpoint.config.kind.engine().cloned() else {
        return;
    };
    let requested_port = match &endpoint.config.kind {
        EndpointKind::Remote(remote) => remote.local_port,
        _ => engine.port,
    };
    let local_port = match requested_port.map_or_else(free_port, Ok) {
        Ok(port) => port,
        Err(err) => {
            exclude(shared, endpoint, format!("no free port: {err}"));
            return;
        }
    };
    if let (EndpointKind::Local(_), Some(devices)) = (&endpoint.config.kind, &engine.gpu)
        && let Some(why) = gpu_refusal(shared, &engine, devices).await
    {
        exclude(shared, endpoint, why);
        return;
    }
    // What went wrong last, for the reason it is left out.
    let mut last_failure = String::new();
    loop {
        let phase = if endpoint.restarts() == 0 {
            Phase::Starting
        } else {
            Phase::Restarting
        };
        endpoint.set_phase(phase);
        let started = Instant::now();
        let ended = match launch(&shared.options.launcher, endpoint, local_port).await {
            Err(err) => Err(err),
            Ok(mut running) => {
                shared.event(
                    endpoint,
                    EventKind::Started,
                    format!(
                        "Started {} (pid {}, log {}).",
                        endpoint.name,
                        running
                            .process
                            .pid
                            .map_or_else(|| "?".to_owned(), |p| p.to_string()),
                        running.process.log.display()
                    ),
                );
                match ready(
                    endpoint,
                    &mut running,
                    engine.startup_timeout,
                    Duration::from_millis(250),
                    stop,
                )
                .await
                {
                    Err(err) => {
                        running.process.stop(engine.stop_grace).await;
                        Err(err)
                    }
                    Ok(()) => match serve(shared, endpoint, &running.base_url, running.process.pid)
                    {
                        Err(err) => {
                            running.process.stop(engine.stop_grace).await;
                            Err(err)
                        }
                        Ok(()) => {
                            shared.event(
                                endpoint,
                                EventKind::Ready,
                                format!(
                                    "Endpoint {} is ready at {} ({:.1}s).",
                                    endpoint.name,
                                    running.base_url,
                                    started.elapsed().as_secs_f64()
                                ),
                            );
                            let url = running.base_url.clone();
                            let ended = watch(
                                shared,
                                endpoint,
                                &url,
                                stop,
                                Some(&mut running.process),
                                Some(engine.restart_delay),
                            )
                            .await;
                            if let Ended::Died(how) = &ended {
                                endpoint.trip();
                                last_failure =
                                    running.process.with_last_lines(format!("its engine {how}"));
                                shared.event(
                                    endpoint,
                                    EventKind::Died,
                                    format!("Engine of {} {how}.", endpoint.name),
                                );
                            } else if let Ended::Hung(silent) = ended {
                                last_failure = format!(
                                    "its calls hung ({} without a sign of life while it answered probes)",
                                    humantime::format_duration(Duration::from_secs(
                                        silent.as_secs()
                                    ))
                                );
                                shared.event(
                                    endpoint,
                                    EventKind::Unhealthy,
                                    format!(
                                        "Endpoint {} is hung: its calls in flight have shown no sign of life for {} while it answers probes; restarting it (its calls go again).",
                                        endpoint.name,
                                        humantime::format_duration(Duration::from_secs(silent.as_secs()))
                                    ),
                                );
                            } else if let Ended::StayedUnhealthy = ended {
                                last_failure = format!(
                                    "it stayed unhealthy for {}",
                                    humantime::format_duration(engine.restart_delay)
                                );
                                shared.event(
                                    endpoint,
                                    EventKind::Unhealthy,
                                    format!(
                                        "Endpoint {} stayed unhealthy for {}; restarting it.",
                                        endpoint.name,
                                        humantime::format_duration(engine.restart_delay)
                                    ),
                                );
                            }
                            endpoint.set_phase(Phase::Restarting);
                            running.process.stop(engine.stop_grace).await;
                            Ok(ended)
                        }
                    },
                }
            }
        };
        match ended {
            Ok(Ended::Stopped) => {
                shared.event(
                    endpoint,
                    EventKind::Stopped,
                    format!("Stopped {}.", endpoint.name),
                );
                return;
            }
            Err(_) if stop.is_cancelled() => return,
            Err(err) => {
                shared.event(
                    endpoint,
                    EventKind::StartFailed,
                    format!("{} did not start: {err}", endpoint.name),
                );
                last_failure = err;
            }
            Ok(_) => {}
        }
        let restarts = endpoint.count_restart();
        if restarts > engine.restarts {
            exclude(
                shared,
                endpoint,
                format!(
                    "it failed again after {} restarts: {last_failure}",
                    engine.restarts
                ),
            );
            return;
        }
        shared.event(
            endpoint,
            EventKind::Restarting,
            format!(
                "Restarting {} in {} (restart {restarts} of {}).",
                endpoint.name,
                humantime::format_duration(engine.restart_delay),
                engine.restarts
            ),
        );
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(engine.restart_delay) => {}
        }
    }
}

async fn gpu_refusal(shared: &Shared, engine: &Engine, devices: &str) -> Option<String> {
    let report = shared.gpus.get_or_init(gpu::report).await;
    let busy = gpu::busy(report, devices, engine.gpu_memory_threshold_mb);
    if busy.is_empty() {
        return None;
    }
    match shared.options.gpu_policy {
        GpuPolicy::Allow => {
            tracing::warn!("Starting on a busy GPU as asked: {}.", busy.join("; "));
            None
        }
        GpuPolicy::Refuse => Some(format!("{} (run with -y to start anyway)", busy.join("; "))),
    }
}
