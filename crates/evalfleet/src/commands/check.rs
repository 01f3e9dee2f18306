//! `evalfleet check`: is this config ready for a long run?

use std::time::{Duration, Instant};

use evalfleet_core::client::ChatClient;
use evalfleet_core::config::{self, Overrides};
use evalfleet_core::dataset::Scanner;
use evalfleet_core::template::Templates;

use crate::fleet::base_url;
use crate::{EXIT_FAILED, EXIT_OK};

const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

pub async fn check(args: crate::cli::CheckArgs) -> anyhow::Result<u8> {
    let loaded = config::load_file(&args.config, Overrides::default())?;
    let config = &loaded.config;
    let templates = Templates::compile(&config.task)?;
    println!("config       {} is valid", args.config.display());

    let mut ready = true;
    let (rows, invalid) = tokio::task::block_in_place(|| -> anyhow::Result<(u64, u64)> {
        let mut scanner = Scanner::open(&config.dataset)?;
        if let Some(columns) = scanner.columns() {
            templates.check_fields(
                &columns.iter().cloned().collect(),
                "the CSV header does not have",
            )?;
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
            templates.check_fields(&summary.fields, "no row of the dataset has")?;
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

    let mut mocks = Vec::new();
    for endpoint in &config.endpoints {
        let url = base_url(endpoint, &mut mocks).await?;
        let client = ChatClient::new(endpoint, &url, &config.task.params, config.task.stream)
            .map_err(|err| anyhow::anyhow!("endpoint '{}': {err}", endpoint.name))?;
        let started = Instant::now();
        let probe = tokio::time::timeout(PROBE_TIMEOUT, client.models()).await;
        let latency = started.elapsed().as_secs_f64() * 1000.0;
        let line = match probe {
            Ok(Ok(models)) => {
                let serves = models.contains(&endpoint.model);
                if !serves {
                    ready = false;
                }
                format!(
                    "reachable in {latency:.0} ms; serves {}{}",
                    if models.is_empty() {
                        "no models".to_owned()
                    } else {
                        models.join(", ")
                    },
                    if serves {
                        String::new()
                    } else {
                        format!(" (NOT the configured model '{}')", endpoint.model)
                    }
                )
            }
            Ok(Err(err)) => {
                ready = false;
                format!("unreachable: {err}")
            }
            Err(_) => {
                ready = false;
                format!(
                    "unreachable: no answer within {}",
                    humantime::format_duration(PROBE_TIMEOUT)
                )
            }
        };
        println!(
            "endpoint     {} ({}, {}, concurrency {}): {line}",
            endpoint.name,
            endpoint.kind.name(),
            url,
            endpoint.concurrency
        );
    }
    for mock in mocks {
        let _ = mock.shutdown().await;
    }
    Ok(if ready { EXIT_OK } else { EXIT_FAILED })
}
