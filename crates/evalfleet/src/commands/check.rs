//! `evalfleet check`: is this config and this fleet ready for a long run?

use std::time::{Duration, Instant};

use evalfleet_config::{self as config, EndpointConfig, EndpointKind, Overrides};
use evalfleet_core::preflight;
use evalfleet_eval::metric_backend::Backends;
use evalfleet_fleet::client::ChatClient;
use evalfleet_fleet::gpu::{self, GpuReport};
use evalfleet_fleet::runtime::MockStarter;
use evalfleet_fleet::{LimitMode, runtime::health_url};
use evalfleet_io::dataset::Scanner;
use evalfleet_io::template::Templates;
use evalfleet_pipeline::task::code;

use crate::attend::Lift;
use crate::fleet::InProcessMocks;
use crate::{EXIT_FAILED, EXIT_OK};

const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

fn concurrency(endpoint: &EndpointConfig) -> String {
    match endpoint.concurrency {
        LimitMode::Fixed(n) => format!("concurrency {n}"),
        LimitMode::Adaptive(s) => format!(
            "adaptive concurrency {}..{} from {}",
            s.min, s.max, s.initial
        ),
    }
}

pub async fn check(args: crate::cli::CheckArgs) -> anyhow::Result<u8> {
    let mut loaded = crate::attend::load(&args.config, Overrides::default())?;
    evalfleet_core::sheet::read(&mut loaded.config)
        .await
        .lift()?;
    let config = &loaded.config;
    let templates = Templates::compile(&config.task)?;
    tokio::task::block_in_place(|| preflight::check(&loaded, &templates))?;
    println!("config       {} is valid", args.config.display());
    if !config.task.prompts.is_empty() {
        let rules: Vec<String> = config
            .task
            .prompts
            .iter()
            .map(|rule| {
                if rule.model_matches {
                    rule.name.clone()
                } else {
                    format!("{} (not for this run's model)", rule.name)
                }
            })
            .collect();
        println!(
            "prompts      {}{}",
            rules.join(", "),
            if config.task.messages.is_empty() {
                ""
            } else {
                ", else default"
            }
        );
    }

    let mut ready = true;
    let (rows, invalid) = tokio::task::block_in_place(|| -> anyhow::Result<(u64, u64)> {
        let mut scanner = Scanner::open(&config.dataset)?;
        if let Some(columns) = scanner.columns() {
            templates
                .check_fields(
                    &columns.iter().cloned().collect(),
                    "the CSV header does not have",
                )
                .map_err(|err| loaded.problems(vec![(err.path.clone(), err.to_string())]))?;
        }
        let mut invalid = 0;
        let mut first_invalid = None;
        while let Some(row) = scanner.next_row()? {
            if let Some(reason) = row.invalid {
                invalid += 1;
                first_invalid.get_or_insert((row.line, reason));
            }
        }
        let csv = scanner.columns().is_some();
        let summary = scanner.finish();
        if !csv && summary.rows > 0 {
            templates
                .check_fields(&summary.fields, "no row of the dataset has")
                .map_err(|err| loaded.problems(vec![(err.path.clone(), err.to_string())]))?;
        }
        if let Some((line, reason)) = first_invalid {
            println!(
                "dataset      line {line}: {reason}{}",
                if config.dataset.skip_invalid {
                    " (skip_invalid: recorded as failed)"
                } else {
                    ""
                }
            );
        }
        Ok((summary.rows, invalid))
    })?;
    println!(
        "dataset      {}: {rows} rows, {invalid} invalid",
        config.dataset.path.display()
    );
    if invalid > 0 && !config.dataset.skip_invalid {
        ready = false;
    }

    let gpus = if config
        .endpoints
        .iter()
        .any(|e| matches!(e.kind, EndpointKind::Local(_)))
    {
        let report = gpu::report().await;
        print_gpus(&report);
        Some(report)
    } else {
        None
    };

    let mut guards = Vec::new();
    for endpoint in &config.endpoints {
        let head = format!(
            "endpoint     {} ({}, {})",
            endpoint.name,
            endpoint.kind.name(),
            concurrency(endpoint)
        );
        let url = match &endpoint.kind {
            EndpointKind::Mock(settings) => {
                let (url, guard) = InProcessMocks.start((**settings).clone()).await?;
                guards.push(guard);
                url
            }
            EndpointKind::External { base_url, .. } => base_url.clone(),
            EndpointKind::Local(engine) => {
                let port = engine
                    .port
                    .map_or_else(|| "PORT".to_owned(), |p| p.to_string());
                println!(
                    "{head}: started by the run: {}",
                    engine.render(&endpoint.model, &port)
                );
                if let (Some(devices), Some(report)) = (&engine.gpu, &gpus) {
                    let busy = gpu::busy(report, devices, engine.gpu_memory_threshold_mb);
                    if busy.is_empty() {
                        println!(
                            "             GPU {devices} is free enough (threshold {} MB)",
                            engine.gpu_memory_threshold_mb
                        );
                    } else {
                        ready = false;
                        for why in busy {
                            println!("             BUSY: {why} (the run refuses it without -y)");
                        }
                    }
                }
                continue;
            }
            EndpointKind::Remote(remote) => {
                println!(
                    "{head}: started by the run on {} in tmux session {} (`evalfleet run --dry-run` shows the commands)",
                    remote.host, remote.session
                );
                continue;
            }
        };
        let line = probe(endpoint, &url, config, &mut ready).await;
        println!("{head}, {url}: {line}");
    }
    drop(guards);
    if let Some(settings) = config.task.kind.code() {
        // The judge starts as a run starts it: its sandbox made, and a
        // trivial program of the task's language run in it.
        let dir = std::env::temp_dir().join(format!("evalfleet-check-{}", std::process::id()));
        let line = match code::start(settings, &dir).await {
            Ok(code) => format!(
                "{} programs run; {}",
                settings.language.as_str(),
                code.describe()
            ),
            Err(err) => {
                ready = false;
                format!("NOT ready: {err}")
            }
        };
        let _ = std::fs::remove_dir_all(&dir);
        println!("code judge   {line}");
    }
    // Each metric backend starts as a run starts it: its setup made (once,
    // and kept) and its program started.
    for backend in &config.task.eval.backends {
        // Ctrl-C drops the start, and with it the setup's process group.
        let used = [backend.name.as_str()];
        let started = tokio::select! {
            started = Backends::start(std::slice::from_ref(backend), &used) => started,
            _ = tokio::signal::ctrl_c() => {
                eprintln!("Stopped while metric backend '{}' started.", backend.name);
                return Ok(crate::EXIT_INTERRUPTED);
            }
        };
        let line = match started {
            Ok(_) => format!("{}: started", backend.name),
            Err(err) => {
                ready = false;
                format!("NOT ready: {err}")
            }
        };
        println!("metric backend {line}");
    }
    Ok(if ready { EXIT_OK } else { EXIT_FAILED })
}

async fn probe(
    endpoint: &EndpointConfig,
    url: &str,
    config: &config::Config,
    ready: &mut bool,
) -> String {
    let client = match ChatClient::new(endpoint, url, &config.task.params, config.task.stream) {
        Ok(client) => client,
        Err(err) => {
            *ready = false;
            return format!("cannot make a client: {err}");
        }
    };
    let started = Instant::now();
    let probe = tokio::time::timeout(PROBE_TIMEOUT, client.models()).await;
    let latency = started.elapsed().as_secs_f64() * 1000.0;
    match probe {
        Ok(Ok(models)) => {
            let serves = models.contains(&endpoint.model);
            if !serves {
                *ready = false;
            }
            format!(
                "reachable in {latency:.0} ms; serves {}{}; health probe {}",
                if models.is_empty() {
                    "no models".to_owned()
                } else {
                    models.join(", ")
                },
                if serves {
                    String::new()
                } else {
                    format!(" (NOT the configured model '{}')", endpoint.model)
                },
                health_url(endpoint, url)
            )
        }
        Ok(Err(err)) => {
            *ready = false;
            format!("unreachable: {}", evalfleet_types::error_text(&err))
        }
        Err(_) => {
            *ready = false;
            format!(
                "unreachable: no answer within {}",
                humantime::format_duration(PROBE_TIMEOUT)
            )
        }
    }
}

fn print_gpus(report: &GpuReport) {
    match report {
        GpuReport::Unavailable(why) => println!("gpus         {why}"),
        GpuReport::Gpus { gpus, processes } => {
            if gpus.is_empty() {
                println!("gpus         nvidia-smi lists no GPU");
            }
            for gpu in gpus {
                println!(
                    "gpu          {} {}: {} of {} MB in use",
                    gpu.index, gpu.name, gpu.memory_used_mb, gpu.memory_total_mb
                );
                for p in processes.iter().filter(|p| p.gpu_uuid == gpu.uuid) {
                    println!(
                        "             pid {} {}{}",
                        p.pid,
                        p.name,
                        p.used_memory_mb
                            .map_or_else(String::new, |mb| format!(" ({mb} MB)"))
                    );
                }
            }
        }
    }
}
