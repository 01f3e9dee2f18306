//! `evalfleet mock`: the mock endpoint as a server of its own.

use std::io::Write;
use std::sync::Arc;

use evalfleet_mock::Stats;
use tokio::net::TcpListener;

use crate::cli::MockArgs;
use crate::{EXIT_OK, UsageError};

pub async fn mock(args: MockArgs) -> anyhow::Result<u8> {
    let problems = args.settings.problems();
    if !problems.is_empty() {
        let text: Vec<String> = problems
            .into_iter()
            .map(|(f, m)| format!("--{}: {m}", f.replace('_', "-")))
            .collect();
        return Err(UsageError(text.join("\n")).into());
    }
    let listener = TcpListener::bind(args.bind)
        .await
        .map_err(|err| UsageError(format!("cannot listen on {}: {err}", args.bind)))?;
    let addr = listener.local_addr()?;
    // The first line of stdout is the base URL, for scripts.
    println!("http://{addr}/v1");
    std::io::stdout().flush()?;
    tracing::info!(
        "Mock endpoint serving model '{}' on http://{addr}/v1.",
        args.settings.model
    );

    let life = |what: &str| -> std::io::Result<()> {
        if let Some(file) = &args.life_log {
            let mut out = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(file)?;
            writeln!(
                out,
                "{what} {} {}",
                evalfleet_types::now_ms(),
                std::process::id()
            )?;
        }
        Ok(())
    };
    life("listening")?;
    let shutdown = super::stopped_by_signals()?;
    let served = evalfleet_mock::serve(
        listener,
        args.settings,
        Arc::new(Stats::default()),
        shutdown,
    )
    .await;
    life("exited")?;
    served?;
    Ok(EXIT_OK)
}
