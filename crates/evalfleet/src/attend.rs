//! A session as this program attends it: what it lends the orchestration
//! (`evalfleet_core::Frontend`), the progress display and the signals while
//! a session runs, and its last lines and exit code. The sessions
//! themselves are made, run and stopped by `evalfleet_core::session`.

use std::future::Future;
use std::io::{IsTerminal, Write};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use evalfleet_config::{ConversationSettings, Overrides};
use evalfleet_core::Frontend;
use evalfleet_core::frontend::{DEFAULT_STORE, run_dir};
use evalfleet_core::run::SessionReport;
use evalfleet_core::session::{self, Ended, NewSession, Session, SessionError};
use evalfleet_pipeline::Progress;
use evalfleet_reports::conversation::{CHOICES, ConversationReport};
use evalfleet_store::{Location, OpenOptions};
use evalfleet_types::RunStatus;
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

use crate::cli::RunArgs;
use crate::{EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, fleet, ui};

/// A session's error as this program reports it: the error the session
/// met, with its causes, as if the command had met it itself.
pub fn session_error(err: SessionError) -> anyhow::Error {
    match err {
        SessionError::Usage(e) => e.into(),
        SessionError::Config(e) => e.into(),
        SessionError::Template(e) => e.into(),
        SessionError::Store(e) => e.into(),
        SessionError::CreateRun(e) => e.into(),
        SessionError::Resume(e) => e.into(),
        SessionError::Sheets(e) => e.into(),
        SessionError::Io(e) => e.into(),
        SessionError::Json(e) => e.into(),
        other => other.into(),
    }
}

/// `.lift()`: a session's result as this program's.
pub trait Lift<T> {
    fn lift(self) -> anyhow::Result<T>;
}

impl<T> Lift<T> for Result<T, SessionError> {
    fn lift(self) -> anyhow::Result<T> {
        self.map_err(session_error)
    }
}

/// What this program lends the sessions it runs: itself as the engines'
/// supervisor, mock endpoints inside the process, the gateway's listener,
/// the terminal's question about busy GPUs, and notes on stderr.
pub fn frontend() -> std::io::Result<Frontend> {
    Ok(Frontend {
        supervisor: std::env::current_exe()?,
        mocks: Arc::new(fleet::InProcessMocks),
        gateway: Some(Arc::new(evalfleet_server::gateway::Host)),
        ask_gpus: Arc::new(ask_gpus),
        say: Arc::new(ui::note),
    })
}

/// Asks on the terminal, when there is one, whether engines may start on
/// the GPUs in `list` that someone else is using.
fn ask_gpus(list: &str) -> std::io::Result<bool> {
    if !(std::io::stdin().is_terminal() && std::io::stderr().is_terminal()) {
        return Ok(false);
    }
    eprint!(
        "Someone else is using a GPU an engine would start on:\n  {list}\nStart anyway? [y/N] "
    );
    std::io::stderr().flush()?;
    let mut answer = String::new();
    std::io::stdin().read_line(&mut answer)?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes"))
}

/// The config in `file`, with `overrides`; a config of the original
/// system is converted on the way, and its keys that had no place are
/// named on stderr.
pub fn load(
    file: &std::path::Path,
    overrides: Overrides,
) -> anyhow::Result<evalfleet_config::LoadedConfig> {
    Ok(session::load_config(file, overrides, &frontend()?)?)
}

/// What a command must be told to find this store again: nothing for the
/// default one.
pub fn store_flag(store: &Location) -> String {
    if store.is(std::path::Path::new(DEFAULT_STORE)) {
        String::new()
    } else {
        format!(" --store {store}")
    }
}

/// A new run of `args.config` with `overrides` over it (`--n-sample` and
/// `--seed` added), attended at the terminal; `conversation`: it must be a
/// conversation (`simulate`).
pub async fn start(args: RunArgs, overrides: Overrides, conversation: bool) -> anyhow::Result<u8> {
    let started = Instant::now();
    let overrides = Overrides {
        sample_n: args.n_sample,
        sample_seed: args.seed,
        limit: args.limit,
        sets: args.set.clone(),
        ..overrides
    };
    let frontend = frontend()?;
    let loaded = session::load_config(&args.config, overrides, &frontend)?;
    if conversation {
        session::require_conversation(loaded.config.task.kind.conversation(), &args.config)?;
    }
    if args.dry_run {
        fleet::dry_run(&loaded.config);
        dry_requests(&loaded)?;
        return Ok(EXIT_OK);
    }
    let session = session::new_session(
        loaded,
        NewSession {
            endpoints: &args.endpoints,
            yes: args.yes,
            store: args.store,
            run_id: args.run_id,
            started,
        },
        &frontend,
    )
    .await
    .lift()?;
    println!("{}", session.run_id);
    execute(
        session,
        Attendance::Terminal {
            quiet: args.output.quiet,
        },
        None,
        &frontend,
    )
    .await
}

/// `run --dry-run`: the requests the first rows would send, each with its
/// row's line (a conversation's and an agent's are made as they go).
fn dry_requests(loaded: &evalfleet_config::LoadedConfig) -> anyhow::Result<()> {
    use evalfleet_config::TaskKind;
    if !matches!(
        loaded.config.task.kind,
        TaskKind::Chat | TaskKind::Refine(_) | TaskKind::Code(_)
    ) {
        return Ok(());
    }
    if loaded.config.dataset.sheet.is_some() {
        println!("(the first requests are shown once the sheet is read: run it)");
        return Ok(());
    }
    let templates = session::checked_templates(loaded).lift()?;
    const SHOWN: usize = 3;
    let requests = match tokio::task::block_in_place(|| {
        evalfleet_core::preflight::first_requests(loaded, &templates, SHOWN)
    }) {
        Ok(requests) => requests,
        Err(err) => {
            println!("(the first requests cannot be shown: {err})");
            return Ok(());
        }
    };
    let file = loaded.config.dataset.path.display();
    for (line, request) in requests {
        match request {
            Ok(shown) => {
                let rule = shown
                    .get("prompt")
                    .and_then(serde_json::Value::as_str)
                    .map_or_else(String::new, |p| format!(", prompt rule {p}"));
                println!(
                    "request for line {line} of {file}{rule}:\n{}",
                    serde_json::to_string_pretty(&shown["request"])?
                );
            }
            Err(why) => println!("line {line} of {file}: cannot be rendered: {why}"),
        }
    }
    Ok(())
}

/// Who is watching a session.
pub enum Attendance {
    /// A person at a terminal: a progress display (unless quiet), and
    /// Ctrl-C stops the run.
    Terminal { quiet: bool },
    /// A server: no display; the run stops when `stop` is cancelled.
    Server { stop: CancellationToken },
}

/// What writes an environment's episodes to its logs as they end: done
/// once its gym has finished and it has written the last.
pub type Journal = Pin<Box<dyn Future<Output = anyhow::Result<()>> + Send>>;

/// Runs `session` to its end as `attendance` watches it, with what
/// `frontend` lends it; its last lines and exit code.
pub async fn execute(
    session: Session,
    attendance: Attendance,
    journal: Option<Journal>,
    frontend: &Frontend,
) -> anyhow::Result<u8> {
    let stop = match &attendance {
        Attendance::Terminal { .. } => CancellationToken::new(),
        Attendance::Server { stop } => stop.clone(),
    };
    let launched = session.launch(frontend, stop.clone()).await.lift()?;
    let (mode, signals) = match attendance {
        Attendance::Terminal { quiet } => {
            let ending = launched.ending();
            // Outside the run's tasks: aborted once the session has ended.
            #[allow(clippy::disallowed_methods)]
            let signals = tokio::spawn(watch_signals(stop, ending.grace, ending.run_id.clone()));
            (ui::Mode::pick(quiet), Some(signals))
        }
        Attendance::Server { .. } => (ui::Mode::Quiet, None),
    };
    let display = ui::Display::start(
        launched.progress().clone(),
        launched.endpoints().to_vec(),
        mode,
    );
    let ran = launched.run().await;
    if let Some(journal) = journal
        && let Err(err) = journal.await
    {
        tracing::warn!("The environment's log could not be written to its end: {err:#}.");
    }
    display.finish().await;
    if let Some(signals) = signals {
        signals.abort();
    }
    let Ended {
        result,
        elapsed,
        progress,
        sheet_written,
        ending,
    } = ran.stop().await;
    // The session stored how it stopped.
    let report = result.map_err(session_error)?;
    let resume = if ending.trainer.is_some() {
        "env --resume"
    } else {
        "resume"
    };
    let mut code = conclude(
        &ending.run_id,
        &ending.location,
        &report,
        elapsed,
        ending.pending_at_start,
        &progress,
        resume,
    )?;
    if let Some(settings) = &ending.conversation {
        let totals = conversation_totals(
            &ending.location,
            &ending.run_id,
            settings,
            ending.trainer.is_some(),
        )?;
        // Episodes a trainer gave up are not failures of the run.
        if code == EXIT_FAILED && totals.failed == totals.closed {
            code = EXIT_OK;
        }
    }
    if !sheet_written {
        code = code.max(EXIT_FAILED);
    }
    Ok(code)
}

/// The finished run's report: its outcome and metrics (no endpoint
/// summary: it reads every attempt).
fn finished_report(location: &Location, run_id: &str) -> anyhow::Result<evalfleet_reports::Report> {
    tokio::task::block_in_place(|| {
        let mut store = evalfleet_store::open(location, &OpenOptions::default())?;
        anyhow::Ok(evalfleet_reports::report_with(
            &mut *store,
            run_id,
            &[],
            None,
            &mut |_, _, _| {},
        )?)
    })
}

/// The finished run's scores in a line per metric: its mean, or why it
/// has none.
fn print_scores(report: &evalfleet_reports::Report) {
    for s in report
        .metrics
        .iter()
        .filter(|s| s.group == evalfleet_reports::metrics::ALL)
    {
        let value = s.value_text(4);
        if !s.has_value() {
            ui::note(&format!("  {}: {value}", s.metric));
            continue;
        }
        let unscored = if s.errors > 0 {
            format!("; {} not scored: {}", s.errors, s.reasons_line())
        } else {
            String::new()
        };
        let lost = if s.lost > 0 {
            format!(
                "; {} failed for the server's sake, in no mean (resume --retry-failed answers them)",
                s.lost
            )
        } else {
            String::new()
        };
        ui::note(&format!(
            "  {}: {value} over {} items{unscored}{lost}",
            s.metric,
            s.n - s.errors - s.lost
        ));
    }
}

/// The causes of an outcome that is not complete, a line each.
pub fn print_causes(outcome: &evalfleet_reports::Outcome) {
    for line in outcome.cause_lines() {
        ui::note(&format!("  {line}"));
    }
}

/// The exit code of a command that ran or scored a run whose report is
/// `report`: 0 when its outcome is complete and its metrics could score
/// their answers, else 1 (each problem said).
pub fn outcome_code(report: &evalfleet_reports::Report) -> u8 {
    let code = if report.outcome.is_complete() {
        EXIT_OK
    } else {
        EXIT_FAILED
    };
    code.max(unusable_scores(report))
}

/// Says each problem of `report`'s scores; exit 1 when there is one.
pub fn unusable_scores(report: &evalfleet_reports::Report) -> u8 {
    for problem in &report.problems {
        eprintln!("error: {problem}");
    }
    if report.problems.is_empty() {
        EXIT_OK
    } else {
        EXIT_FAILED
    }
}

/// The session's last lines; its exit code: 0 when the run finished
/// complete, 1 when it finished incomplete or failed (or a metric could
/// not score enough of its answers), 130 when it stopped before its end.
fn conclude(
    run_id: &str,
    location: &Location,
    report: &SessionReport,
    elapsed: Duration,
    pending_at_start: u64,
    progress: &Progress,
    resume: &str,
) -> anyhow::Result<u8> {
    let counts = report.counts;
    let answered = pending_at_start.saturating_sub(counts.pending);
    let rate = answered as f64 / elapsed.as_secs_f64().max(1e-9);
    let store_flag = store_flag(location);
    let program = ui::program();
    match report.status {
        RunStatus::Finished => {
            let finished = finished_report(location, run_id)?;
            let outcome = &finished.outcome;
            ui::note(&format!(
                "Run {run_id} finished, {}; {answered} items in {:.1}s ({rate:.1} items/s; {}).",
                outcome.line(),
                elapsed.as_secs_f64(),
                ui::calls_line(progress),
            ));
            print_causes(outcome);
            print_scores(&finished);
            let unusable = progress.unparsed.load(Ordering::Relaxed)
                + progress.invalid.load(Ordering::Relaxed);
            let ended = progress.done.load(Ordering::Relaxed);
            if unusable > 0 && 2 * unusable >= ended {
                ui::note(&format!(
                    "warning: {unusable} of {ended} answers could not be used (task.parse or task.schema did not accept them, re-asks included): \
                     compare an answer with the parse rule ({program} export {run_id}{store_flag} --format jsonl | head -1); see docs/troubleshooting.md"
                ));
            }
            ui::note(&format!(
                "Results: {program} export {run_id}{store_flag} --format jsonl"
            ));
            if outcome.failed > 0 {
                ui::note(&format!(
                    "Answer the failed items again: {program} resume {run_id}{store_flag} --retry-failed"
                ));
            }
            // The code judge's metric could not score some answers, or an
            // LLM judge's call failed.
            let unjudged = outcome.causes.iter().any(|c| {
                c.metric
                    .as_deref()
                    .is_some_and(|key| key.split('@').next() == Some("code_accepted"))
                    || c.reason.contains("the judge failed")
            });
            if unjudged {
                ui::note(&format!(
                    "Judge the answers the judge could not judge, and only those: {program} score {run_id}{store_flag} --unjudged"
                ));
            }
            Ok(outcome_code(&finished))
        }
        RunStatus::Interrupted | RunStatus::Running => {
            ui::note(&format!(
                "Run {run_id} interrupted{}: {} done, {} failed, {} pending. Resume: {program} {resume} {run_id}{store_flag}",
                report
                    .message
                    .as_deref()
                    .map_or_else(String::new, |m| format!(" ({m})")),
                counts.done,
                counts.failed,
                counts.pending
            ));
            Ok(EXIT_INTERRUPTED)
        }
    }
}

/// After a session of a conversation run: its logs written again from the
/// stored episodes (see `evalfleet_core::conversation`), and the totals
/// printed (and returned).
/// `live`: an environment's session, whose journal wrote its logs as its
/// episodes ended.
fn conversation_totals(
    location: &Location,
    run_id: &str,
    settings: &ConversationSettings,
    live: bool,
) -> anyhow::Result<ConversationReport> {
    let dir = run_dir(location, run_id);
    let report = tokio::task::block_in_place(|| {
        evalfleet_core::conversation::write_logs(location, run_id, settings, &dir, live)
    })
    .lift()?;
    print_conversation(&report, &dir);
    Ok(report)
}

fn print_conversation(report: &ConversationReport, dir: &std::path::Path) {
    let r = &report.reward_per_episode;
    let decisions: u64 = report.strategies.values().sum();
    let share = |n: u64| 100.0 * n as f64 / decisions.max(1) as f64;
    let strategies: Vec<String> = CHOICES
        .iter()
        .map(|c| {
            let n = report.strategies.get(*c).copied().unwrap_or(0);
            format!("{c} {n} ({:.0}%)", share(n))
        })
        .collect();
    ui::note(&format!(
        "Conversation: {} episodes ({} failed{}), {} steps; reward {:.2} in all, {:.3} per episode (95% CI {:.3} to {:.3}); {} interventions.\n\
         Strategies: {}; entropy {:.2} bits.\n\
         Stabilised {:.1}% of steps; the strategy matched the target's need in {:.1}%.",
        report.episodes,
        report.failed,
        if report.closed > 0 {
            format!(", {} of them closed by the trainer", report.closed)
        } else {
            String::new()
        },
        report.steps,
        report.total_reward,
        r.mean,
        r.ci_low,
        r.ci_high,
        report.interventions,
        strategies.join(", "),
        report.entropy_bits,
        report.stabilisation_rate * 100.0,
        report.preference_match_rate * 100.0,
    ));
    for alarm in &report.alarms {
        let line = if alarm.episode.is_empty() {
            alarm.message.clone()
        } else {
            alarm.line()
        };
        ui::note(&format!("Alarm: {line}"));
    }
    ui::note(&format!(
        "Logs: {}/ (conversation_summary.jsonl, batch_summary.jsonl, metrics.jsonl, run_events.jsonl, config.json)",
        dir.display()
    ));
}

/// First SIGINT or SIGTERM: stop taking items and let calls in flight finish.
/// Second: exit at once (committed results are safe; the run is resumable).
async fn watch_signals(stop: CancellationToken, grace: Duration, run_id: String) {
    let (Ok(mut interrupt), Ok(mut terminate)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        tracing::warn!("Cannot listen for Ctrl-C; stop the run with SIGKILL and resume it.");
        return;
    };
    tokio::select! {
        _ = interrupt.recv() => {}
        _ = terminate.recv() => {}
    }
    ui::note(&format!(
        "Stopping: no new items; calls in flight may finish for up to {}. Press Ctrl-C again to abort at once.",
        humantime::format_duration(grace)
    ));
    stop.cancel();
    tokio::select! {
        _ = interrupt.recv() => {}
        _ = terminate.recv() => {}
    }
    ui::note(&format!(
        "Aborted. Committed results are safe; finish with: {} resume {run_id}",
        ui::program()
    ));
    std::process::exit(i32::from(EXIT_INTERRUPTED));
}
