//! What the user watches: the progress bar on a terminal, plain periodic
//! lines elsewhere, and log lines that do not tear the bar.

use std::io::{self, IsTerminal, Write};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use evalfleet_fleet::{Endpoint, Phase};
use evalfleet_pipeline::Progress;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokio_util::sync::CancellationToken;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::prelude::*;

/// The bar being drawn, if any, so that log lines can suspend it.
static BAR: Mutex<Option<ProgressBar>> = Mutex::new(None);

fn with_bar<R>(f: impl FnOnce(Option<&ProgressBar>) -> R) -> R {
    let guard = BAR.lock().unwrap_or_else(PoisonError::into_inner);
    f(guard.as_ref())
}

/// Writes log lines to stderr, around the progress bar.
#[derive(Clone, Copy)]
struct LogWriter;

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        with_bar(|bar| match bar {
            Some(bar) => bar.suspend(|| io::stderr().write_all(buf)),
            None => io::stderr().write_all(buf),
        })?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        io::stderr().flush()
    }
}

impl<'a> MakeWriter<'a> for LogWriter {
    type Writer = LogWriter;
    fn make_writer(&'a self) -> Self::Writer {
        *self
    }
}

/// Logging to stderr: warnings and up by default, more with `-v`; the
/// `EVALFLEET_LOG` variable (`info,evalfleet_fleet=debug`) overrides both.
pub fn init_logging(verbose: u8) {
    let level = match verbose {
        0 => LevelFilter::INFO,
        1 => LevelFilter::DEBUG,
        _ => LevelFilter::TRACE,
    };
    let default = Targets::new()
        .with_target("evalfleet", level)
        .with_target("evalfleet_core", level)
        .with_target("evalfleet_store", level)
        .with_target("evalfleet_mock", level)
        .with_default(LevelFilter::WARN);
    let filter = std::env::var("EVALFLEET_LOG")
        .ok()
        .and_then(|spec| spec.parse::<Targets>().ok())
        .unwrap_or(default);
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(LogWriter)
        .with_target(false)
        .with_ansi(io::stderr().is_terminal());
    tracing_subscriber::registry()
        .with(layer.with_filter(filter))
        .init();
}

/// Prints a line on stderr without tearing the bar.
pub fn note(message: &str) {
    with_bar(|bar| match bar {
        Some(bar) => bar.suspend(|| eprintln!("{message}")),
        None => eprintln!("{message}"),
    });
}

/// How progress is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Bar,
    Lines,
    Quiet,
}

impl Mode {
    pub fn pick(quiet: bool) -> Self {
        if quiet {
            Self::Quiet
        } else if io::stderr().is_terminal() {
            Self::Bar
        } else {
            Self::Lines
        }
    }
}

/// The program as the user invoked it, for hints to copy: `evalfleet`
/// when the shell found it on the PATH, else the path it was run by
/// (`./target/release/evalfleet`; `cargo run` runs it by a relative path).
pub fn program() -> String {
    let invoked = std::env::args_os()
        .next()
        .map(|a| a.to_string_lossy().into_owned())
        .unwrap_or_default();
    program_from(&invoked)
}

fn program_from(invoked: &str) -> String {
    if invoked.is_empty() || !invoked.contains('/') {
        "evalfleet".to_owned()
    } else if invoked.starts_with('/') || invoked.starts_with('.') {
        invoked.to_owned()
    } else {
        format!("./{invoked}")
    }
}

/// `text` with every hint that names the program (`` `evalfleet ``, as
/// the libraries write their hints) naming it as the user invoked it.
pub fn with_program(text: &str) -> String {
    let program = program();
    if program == "evalfleet" {
        return text.to_owned();
    }
    text.replace("`evalfleet ", &format!("`{program} "))
}

/// A running progress display; [`Display::finish`] stops it.
pub struct Display {
    stop: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

struct Snapshot {
    ended: u64,
    failed: u64,
    calls: String,
    in_flight: String,
}

/// What the session's calls went through, each count apart: calls made
/// again after a failure (transport errors, refusals, timeouts, cut
/// streams), re-asks after an answer that could not be used, and items
/// left with an unparsed (or invalid) answer once their re-asks ran out.
pub fn calls_line(progress: &Progress) -> String {
    let load = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
    let mut line = format!(
        "{} retries, {} re-asks, {} unparsed",
        load(&progress.retries),
        load(&progress.reasks),
        load(&progress.unparsed)
    );
    let invalid = load(&progress.invalid);
    if invalid > 0 {
        line.push_str(&format!(", {invalid} invalid"));
    }
    line
}

fn snapshot(progress: &Progress, endpoints: &[Arc<Endpoint>]) -> Snapshot {
    let done = progress.done.load(Ordering::Relaxed);
    let failed = progress.failed.load(Ordering::Relaxed);
    let in_flight = endpoints
        .iter()
        .filter(|e| e.phase() != Phase::Idle)
        .map(|e| {
            let mut text = format!(
                "{} {}/{}",
                e.name,
                e.counters.in_flight.load(Ordering::Relaxed),
                e.limit.current()
            );
            if !e.accepting() {
                text.push_str(&format!(" ({})", e.state()));
            }
            text
        })
        .collect::<Vec<_>>()
        .join(", ");
    Snapshot {
        ended: progress.done_before + progress.failed_before + done + failed,
        failed: progress.failed_before + failed,
        calls: calls_line(progress),
        in_flight,
    }
}

impl Display {
    /// Starts showing `progress` and the endpoints' limits as they move.
    pub fn start(progress: Arc<Progress>, endpoints: Vec<Arc<Endpoint>>, mode: Mode) -> Self {
        let stop = CancellationToken::new();
        // Outside the run's tasks: `finish` stops and awaits it.
        #[allow(clippy::disallowed_methods)]
        let task = match mode {
            Mode::Quiet => None,
            Mode::Bar => Some(tokio::spawn(bar(progress, endpoints, stop.clone()))),
            Mode::Lines => Some(tokio::spawn(lines(progress, endpoints, stop.clone()))),
        };
        Self { stop, task }
    }

    /// Draws the final state and stops.
    pub async fn finish(mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

async fn bar(progress: Arc<Progress>, endpoints: Vec<Arc<Endpoint>>, stop: CancellationToken) {
    let start = progress.done_before + progress.failed_before;
    let bar =
        ProgressBar::with_draw_target(Some(progress.total), ProgressDrawTarget::stderr_with_hz(10))
            .with_position(start);
    let style = ProgressStyle::with_template(
        "{elapsed_precise} {wide_bar:.cyan/blue} {pos}/{len} {per_sec:.green} ETA {eta} {msg}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style.progress_chars("█▉▊▋▌▍▎▏  "));
    *BAR.lock().unwrap_or_else(PoisonError::into_inner) = Some(bar.clone());
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        let stopping = tokio::select! {
            _ = tick.tick() => false,
            () = stop.cancelled() => true,
        };
        let s = snapshot(&progress, &endpoints);
        bar.set_position(s.ended);
        bar.set_message(format!(
            "| {} failed, {} | in flight {}",
            s.failed, s.calls, s.in_flight
        ));
        if stopping {
            break;
        }
    }
    bar.abandon();
    *BAR.lock().unwrap_or_else(PoisonError::into_inner) = None;
}

async fn lines(progress: Arc<Progress>, endpoints: Vec<Arc<Endpoint>>, stop: CancellationToken) {
    let started = Instant::now();
    let first = progress.done_before + progress.failed_before;
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    tick.tick().await;
    loop {
        let stopping = tokio::select! {
            _ = tick.tick() => false,
            () = stop.cancelled() => true,
        };
        let s = snapshot(&progress, &endpoints);
        let rate = (s.ended - first) as f64 / started.elapsed().as_secs_f64().max(1e-9);
        let left = progress.total.saturating_sub(s.ended);
        let eta = if rate > 0.0 {
            humantime::format_duration(Duration::from_secs((left as f64 / rate) as u64)).to_string()
        } else {
            "unknown".to_owned()
        };
        let percent = if progress.total > 0 {
            100.0 * s.ended as f64 / progress.total as f64
        } else {
            100.0
        };
        note(&format!(
            "progress: {}/{} ({percent:.1}%), {} failed, {}, {rate:.1} items/s, ETA {eta}, in flight {}",
            s.ended, progress.total, s.failed, s.calls, s.in_flight
        ));
        if stopping {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_name_the_program_as_it_was_invoked() {
        assert_eq!(program_from("evalfleet"), "evalfleet");
        assert_eq!(
            program_from("target/release/evalfleet"),
            "./target/release/evalfleet"
        );
        assert_eq!(
            program_from("./target/release/evalfleet"),
            "./target/release/evalfleet"
        );
        assert_eq!(program_from("/usr/bin/evalfleet"), "/usr/bin/evalfleet");
    }
}
