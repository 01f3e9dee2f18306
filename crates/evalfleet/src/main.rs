//! The `evalfleet` binary: the CLI and its wiring. Each error says what kind
//! of failure it is; `exit_code` turns that into the exit code: 2 for what
//! the user must fix, 130 for an interruption, 1 for the rest.

mod attend;
mod cli;
mod commands;
mod fleet;
mod ui;

use std::process::ExitCode;

use clap::Parser;
use evalfleet_types::Fault;

use crate::cli::{Cli, Command};

pub const EXIT_OK: u8 = 0;
pub const EXIT_FAILED: u8 = 1;
pub const EXIT_BAD_INPUT: u8 = 2;
pub const EXIT_UNREACHABLE: u8 = 3;
pub const EXIT_INTERRUPTED: u8 = 130;

/// Bad usage: exit code 2.
pub use evalfleet_core::UsageError;

/// What kind of failure an error is: the first error of its chain that
/// says (each error type says its own kind, `UsageError` among them), else
/// a failure.
fn fault_of(err: &anyhow::Error) -> Fault {
    err.chain()
        .find_map(evalfleet_core::fault_of)
        .unwrap_or(Fault::Failure)
}

/// The exit code of each kind of failure: the one place they are decided.
fn exit_code(fault: Fault) -> u8 {
    match fault {
        Fault::BadInput => EXIT_BAD_INPUT,
        Fault::Interrupted => EXIT_INTERRUPTED,
        Fault::Unreachable => EXIT_UNREACHABLE,
        Fault::Failure => EXIT_FAILED,
    }
}

/// Output piped into a reader that stopped (`| head`) is not an error.
fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// The error as the user reads it: each cause once, a missing run with
/// the store it was looked for in and how to list its runs, and hints that
/// name the program as it was invoked.
fn explain(err: &anyhow::Error) -> String {
    let mut text = evalfleet_types::error_text(err.as_ref());
    let missing_run = err.chain().any(|cause| {
        matches!(
            cause.downcast_ref::<evalfleet_store::StoreError>(),
            Some(evalfleet_store::StoreError::NoSuchRun(_))
        )
    });
    if missing_run && let Some(location) = evalfleet_core::frontend::store_chosen() {
        text.push_str(&format!(
            " ({location}); `evalfleet runs{}` lists its runs",
            attend::store_flag(&location)
        ));
    }
    ui::with_program(&text)
}

/// Output that goes to a reader that stops early (`| head`) ends the
/// process quietly, as other command-line tools do, instead of a panic of
/// `println!`. Only for commands that read and print: the ones that serve,
/// run or spawn keep SIGPIPE ignored, so that a peer that hangs up is an
/// error to handle, not the end of the process.
#[allow(unsafe_code)]
fn end_quietly_when_the_reader_stops() {
    // SAFETY: called at the start of main, before any thread is started;
    // restoring a signal's default action has no other effect.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Large buffers (a decoded image: 26 MB for an A4 page scanned at 300
/// dpi) are mapped for themselves and given back to the system when
/// freed. glibc's allocator otherwise raises its threshold for mapping to
/// the size of the first such buffer freed and serves the next ones from
/// its heaps, which keep what was freed: 64 such scans read 4 at a time
/// peaked at 389 to 500 MB, against 239 to 255 MB so, and 8 items of one
/// 8,000 x 8,000 PNG at 356 to 378 MB against 279 to 285 (V3 in
/// docs/benchmarks.md), at 0.5 s more for the 64 scans (pages mapped
/// afresh). A threshold of 16 MiB left the larger image's smaller buffers
/// on the heaps (380 to 397 MB). Once the threshold is set, glibc gives
/// back the top of a heap beyond 128 KiB free, which made V1's items of
/// 300 KB images 30% slower: 8 MiB are kept.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn keep_large_buffers_off_the_heap() {
    // SAFETY: called at the start of main, before any thread is started;
    // mallopt only sets two of the allocator's parameters.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 4 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 8 << 20);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn keep_large_buffers_off_the_heap() {}

fn main() -> ExitCode {
    keep_large_buffers_off_the_heap();
    let cli = Cli::parse();
    ui::init_logging(cli.verbose);
    // A call in flight is an open file: the soft limit (1,024 on most
    // systems) would stop an adaptive limit short of its 1,024 calls.
    evalfleet_fleet::open_files::raise();
    if cli.command.only_prints() {
        end_quietly_when_the_reader_stops();
    }
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
            Command::Simulate(args) => commands::simulate::simulate(args).await,
            Command::Env(args) => commands::env::env(args).await,
            Command::Resume(args) => commands::run::resume(args).await,
            Command::Worker(args) => commands::worker::worker(args).await,
            Command::Runs(args) => commands::inspect::runs(args),
            Command::Status(args) => commands::inspect::status(args),
            Command::Export(args) => commands::inspect::export(args),
            Command::Sync(args) => commands::sheets::sync(args).await,
            Command::Check(args) => commands::check::check(args).await,
            Command::Convert(args) => commands::convert::convert(args),
            Command::Metrics(args) => commands::metrics::metrics(args),
            Command::Mock(args) => commands::mock::mock(args).await,
            Command::Serve(args) => commands::serve::serve(args).await,
            Command::Fleet(args) => commands::inspect::fleet(args),
            Command::Score(args) => commands::report::score(args).await,
            Command::Report(args) => commands::report::report(args),
            Command::Compare(args) => commands::report::compare(args),
            Command::Cache(args) => commands::report::cache(args),
            Command::Bench(args) => commands::bench::bench(args).await,
            Command::Init(args) => commands::init::init(args),
            Command::Completions(args) => commands::shell::completions(args),
            Command::Man(args) => commands::shell::man(args),
            Command::Supervise(args) => commands::supervise::supervise(args).await,
        }
    });
    // Calls abandoned at shutdown must not hold the process open.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(code) => ExitCode::from(code),
        Err(err) if is_broken_pipe(&err) => ExitCode::from(EXIT_OK),
        Err(err) => {
            eprintln!("error: {}", explain(&err));
            ExitCode::from(exit_code(fault_of(&err)))
        }
    }
}
