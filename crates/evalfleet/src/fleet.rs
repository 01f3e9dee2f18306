//! The binary's part of the fleet: the in-process mock server, the
//! supervisor program, the GPU check before engines start, and `--dry-run`.

use std::future::Future;
use std::io::{IsTerminal, Write};
use std::pin::Pin;
use std::sync::Arc;

use evalfleet_config::{Config, EndpointKind, MockSettings};
use evalfleet_fleet::engine::{Launcher, Owner, REMOTE_STATE, RemoteCommands, shell_join};
use evalfleet_fleet::gpu::{self, GpuReport};
use evalfleet_fleet::runtime::{FleetOptions, GpuPolicy, MockGuard, MockStarter};
use evalfleet_mock::MockServer;

use crate::UsageError;

/// Starts `kind: mock` endpoints inside this process.
pub struct InProcessMocks;

impl MockStarter for InProcessMocks {
    fn start(
        &self,
        settings: MockSettings,
    ) -> Pin<Box<dyn Future<Output = std::io::Result<(String, MockGuard)>> + Send>> {
        Box::pin(async move {
            let server = MockServer::start_local(settings).await?;
            let url = server.base_url();
            Ok((url, Box::new(server) as MockGuard))
        })
    }
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

pub fn options(
    config: &Config,
    store: &evalfleet_store::Location,
    run_id: &str,
    active: Option<Vec<String>>,
    gpu_policy: GpuPolicy,
) -> anyhow::Result<FleetOptions> {
    let log_dir = store.dir().join(run_id);
    Ok(FleetOptions {
        launcher: Launcher {
            program: std::env::current_exe()?,
            log_dir,
            claims: std::path::absolute(store.dir().join(".engines"))?,
        },
        mocks: Arc::new(InProcessMocks),
        active,
        gpu_policy,
        no_endpoint_timeout: config.timeouts.no_endpoint,
        first_answer_timeout: config.timeouts.first_answer,
    })
}

/// Before engines start: GPUs that someone else is using are refused, or
/// asked about on a terminal, unless `-y`.
pub async fn check_gpus(
    config: &Config,
    active: Option<&[String]>,
    yes: bool,
) -> anyhow::Result<GpuPolicy> {
    let wanted: Vec<(&str, &str, u64)> = config
        .endpoints
        .iter()
        .filter(|e| active.is_none_or(|names| names.contains(&e.name)))
        .filter_map(|e| match &e.kind {
            EndpointKind::Local(engine) => engine
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
    if std::io::stdin().is_terminal() && std::io::stderr().is_terminal() {
        eprint!(
            "Someone else is using a GPU an engine would start on:\n  {list}\nStart anyway? [y/N] "
        );
        std::io::stderr().flush()?;
        let mut answer = String::new();
        std::io::stdin().read_line(&mut answer)?;
        if matches!(answer.trim(), "y" | "Y" | "yes") {
            return Ok(GpuPolicy::Allow);
        }
    }
    Err(UsageError(format!(
        "refusing to start engines on GPUs someone else is using:\n  {list}\n(-y starts them anyway)"
    ))
    .into())
}

/// `--dry-run`: what each endpoint would run, without running anything.
pub fn dry_run(config: &Config) {
    for endpoint in &config.endpoints {
        println!("endpoint {} ({}):", endpoint.name, endpoint.kind.name());
        match &endpoint.kind {
            EndpointKind::Mock(_) => println!("  a mock endpoint inside the run"),
            EndpointKind::External {
                base_url,
                start_cmd,
                stop_cmd,
            } => {
                println!("  base_url: {base_url}");
                if let Some(command) = start_cmd {
                    println!("  at start: sh -c {}", shell_join(&[command]));
                }
                if let Some(command) = stop_cmd {
                    println!("  at end:   sh -c {}", shell_join(&[command]));
                }
            }
            EndpointKind::Local(engine) => {
                let port = engine
                    .port
                    .map_or_else(|| "PORT".to_owned(), |p| p.to_string());
                println!("  start:    {}", engine.render(&endpoint.model, &port));
                if engine.port.is_none() {
                    println!("  port:     PORT is a free port, chosen at start");
                }
                if let Some(gpu) = &engine.gpu {
                    println!("  env:      CUDA_VISIBLE_DEVICES={gpu}");
                }
                for (key, _) in &engine.env {
                    println!("  env:      {key}=***");
                }
                println!(
                    "  ready:    GET http://127.0.0.1:PORT{}",
                    engine.health_path()
                );
                println!(
                    "  stop:     SIGTERM to its process group, SIGKILL after {}",
                    humantime::format_duration(engine.stop_grace)
                );
            }
            EndpointKind::Remote(remote) => {
                let remote_port = remote.engine.port.unwrap_or(8000);
                let local_port = remote
                    .local_port
                    .map_or_else(|| "PORT".to_owned(), |p| p.to_string());
                // Each start has an owner of its own, written beside the
                // session: placeholders here.
                let owner = Owner {
                    store: "STORE".to_owned(),
                    start: "START".to_owned(),
                };
                let commands =
                    RemoteCommands::new(remote, &endpoint.model, remote_port, &local_port, &owner);
                let mask = |line: String| {
                    let mut line = line;
                    for (_, value) in &remote.engine.env {
                        line = line.replace(value.expose(), "***");
                    }
                    line
                };
                println!(
                    "  engine:   {} (on {}, in tmux session {}; its output in ~/{REMOTE_STATE}/{}.log there and in RUN_ID/{}.log here)",
                    mask(remote.engine.render(&endpoint.model, remote_port)),
                    remote.host,
                    remote.session,
                    remote.session,
                    endpoint.name
                );
                if let Some(gpu) = &remote.engine.gpu {
                    println!("  env:      CUDA_VISIBLE_DEVICES={gpu}");
                }
                for (key, _) in &remote.engine.env {
                    println!("  env:      {key}=***");
                }
                println!("  start:    {}", mask(shell_join(&commands.start)));
                println!("  tunnel:   {}", mask(shell_join(&commands.tunnel)));
                println!(
                    "  ready:    GET http://127.0.0.1:{local_port}{}",
                    remote.engine.health_path()
                );
                println!("  stop:     {}", mask(shell_join(&commands.stop)));
            }
        }
    }
}
