//! The binary's part of the fleet: the in-process mock server, and
//! `--dry-run`.

use std::future::Future;
use std::pin::Pin;

use evalfleet_config::{Config, EndpointKind, MockSettings};
use evalfleet_fleet::engine::{Owner, REMOTE_STATE, RemoteCommands, shell_join};
use evalfleet_fleet::runtime::{MockGuard, MockStarter};
use evalfleet_mock::MockServer;

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
