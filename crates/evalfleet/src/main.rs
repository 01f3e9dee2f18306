//! The `evalfleet` binary: the CLI and its wiring. Errors are classified here
//! into exit codes: 2 for what the user must fix, 1 for the rest.

mod cli;
mod commands;
mod fleet;
mod ui;

use std::process::ExitCode;

use clap::Parser;
use evalfleet_core::config::ConfigError;
use evalfleet_core::dataset::DatasetError;
use evalfleet_core::run::ResumeError;
use evalfleet_core::store::{CreateRunError, StoreError};
use evalfleet_core::template::TemplateError;

use crate::cli::{Cli, Command};

pub const EXIT_OK: u8 = 0;
pub const EXIT_FAILED: u8 = 1;
pub const EXIT_BAD_INPUT: u8 = 2;
pub const EXIT_INTERRUPTED: u8 = 130;

/// Bad usage: exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// Whether an error is the user's to fix (a config, a dataset, an argument).
fn is_bad_input(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| {
        cause.is::<ConfigError>()
            || cause.is::<UsageError>()
            || cause.is::<DatasetError>()
            || cause.is::<TemplateError>()
            || cause.is::<ResumeError>()
            || matches!(
                cause.downcast_ref::<evalfleet_core::judge::JudgeError>(),
                Some(evalfleet_core::judge::JudgeError::Setup(_))
            )
            || matches!(
                cause.downcast_ref::<CreateRunError>(),
                Some(
                    CreateRunError::Dataset(_)
                        | CreateRunError::DuplicateId { .. }
                        | CreateRunError::Template(_)
                        | CreateRunError::RunExists(_)
                )
            )
            || matches!(
                cause.downcast_ref::<StoreError>(),
                Some(
                    StoreError::NoSuchRun(_) | StoreError::NoStore(_) | StoreError::BadLocation(_)
                )
            )
    })
}

/// Output piped into a reader that stopped (`| head`) is not an error.
fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    ui::init_logging(cli.verbose);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: cannot start the async runtime: {err}");
            return ExitCode::from(EXIT_FAILED);
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Run(args) => commands::run::run(args).await,
            Command::Resume(args) => commands::run::resume(args).await,
            Command::Runs(args) => commands::inspect::runs(args),
            Command::Status(args) => commands::inspect::status(args),
            Command::Export(args) => commands::inspect::export(args),
            Command::Check(args) => commands::check::check(args).await,
            Command::Mock(args) => commands::mock::mock(args).await,
            Command::Fleet(args) => commands::inspect::fleet(args),
            Command::Score(args) => commands::report::score(args).await,
            Command::Report(args) => commands::report::report(args),
            Command::Compare(args) => commands::report::compare(args),
            Command::Cache(args) => commands::report::cache(args),
            Command::Supervise(args) => commands::supervise::supervise(args).await,
        }
    });
    // Calls abandoned at shutdown must not hold the process open.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(code) => ExitCode::from(code),
        Err(err) if is_broken_pipe(&err) => ExitCode::from(EXIT_OK),
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::from(if is_bad_input(&err) {
                EXIT_BAD_INPUT
            } else {
                EXIT_FAILED
            })
        }
    }
}
