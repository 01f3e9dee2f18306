//! `evalfleet run` and `evalfleet resume`.

use std::hash::BuildHasher;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime};

use evalfleet_config::{self as config, Config, LoadedConfig, Overrides};
use evalfleet_core::preflight;
use evalfleet_core::run::{self, SessionPlan, SessionReport};
use evalfleet_fleet::runtime::{Fleet, GpuPolicy};
use evalfleet_io::template::Templates;
use evalfleet_pipeline::{OpenStore, PipelineError, Progress};
use evalfleet_store::RunRecord;
use evalfleet_store::prelude::*;
use evalfleet_store::{Location, OpenOptions};
use evalfleet_types::RunStatus;
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{store_flag, store_location, validate_run_id};
use crate::cli::{ResumeArgs, RunArgs};
use crate::fleet;
use crate::ui;
use crate::{EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK};

pub async fn run(args: RunArgs) -> anyhow::Result<u8> {
    start(args, Overrides::default(), false).await
}

/// A new run of `args.config` with `overrides` over it (`--n-sample` and
/// `--seed` added); `conversation`: it must be a conversation
/// (`simulate`).
pub(crate) async fn start(
    args: RunArgs,
    overrides: Overrides,
    conversation: bool,
) -> anyhow::Result<u8> {
    let started = Instant::now();
    let overrides = Overrides {
        sample_n: args.n_sample,
        sample_seed: args.seed,
        ..overrides
    };
    let loaded = super::convert::load(&args.config, overrides)?;
    if conversation {
        super::simulate::require_conversation(
            loaded.config.task.kind.conversation(),
            &args.config,
        )?;
    }
    if args.dry_run {
        fleet::dry_run(&loaded.config);
        return Ok(EXIT_OK);
    }
    let session = new_session(
        loaded,
        &args.endpoints,
        args.yes,
        args.store,
        args.run_id,
        started,
    )
    .await?;
    println!("{}", session.run_id);
    execute(
        session,
        Attendance::Terminal {
            quiet: args.output.quiet,
        },
    )
    .await
}

/// A new run of `loaded`, checked and registered: its templates, the
/// endpoints taking part (`endpoints`, else all), the GPUs (`yes`: start on
/// one in use), its store (`store`, else the config's ...).
pub(crate) async fn new_session(
    mut loaded: LoadedConfig,
    endpoints: &[String],
    yes: bool,
    store: Option<std::path::PathBuf>,
    run_id: Option<String>,
    started: Instant,
) -> anyhow::Result<Session> {
    super::sheets::read(&mut loaded.config).await?;
    let templates = checked_templates(&loaded)?;
    let active = fleet::active(&loaded.config, endpoints)?;
    let gpu_policy = fleet::check_gpus(&loaded.config, active.as_deref(), yes).await?;
    let location = store_location(store, loaded.config.store.as_deref())?;
    register(
        loaded, templates, location, run_id, active, gpu_policy, started,
    )
}

/// The task's templates, compiled and rendered for the first rows (every
/// problem named with its line) before anything is stored.
pub(crate) fn checked_templates(loaded: &LoadedConfig) -> anyhow::Result<Templates> {
    let templates = Templates::compile(&loaded.config.task)?;
    tokio::task::block_in_place(|| preflight::check(loaded, &templates))?;
    Ok(templates)
}

/// Registers a new run of `loaded` in the store at `location` (created if
/// need be; a store made for a run that could not be registered is
/// removed again): its items, in one transaction.
pub(crate) fn register(
    loaded: LoadedConfig,
    templates: Templates,
    location: Location,
    run_id: Option<String>,
    active: Option<Vec<String>>,
    gpu_policy: GpuPolicy,
    started: Instant,
) -> anyhow::Result<Session> {
    let run_id = match run_id {
        Some(id) => validate_run_id(id)?,
        None => new_run_id(&loaded.config.name),
    };
    let existed = location.exists();
    let mut store = evalfleet_store::open(
        &location,
        &OpenOptions {
            create: true,
            ..OpenOptions::default()
        },
    )?;
    let created =
        tokio::task::block_in_place(|| run::create(&mut *store, &loaded, &templates, &run_id));
    let record = match created {
        Ok(record) => record,
        Err(err) => {
            drop(store);
            if !existed {
                evalfleet_store::remove(&location);
            }
            return Err(err.into());
        }
    };
    tracing::info!(
        "Run {run_id}: {} items registered in {location} ({:.1}s).",
        record.total,
        started.elapsed().as_secs_f64()
    );
    let LoadedConfig { config, .. } = loaded;
    Ok(Session {
        location,
        store,
        run_id,
        config,
        templates,
        retry_failed: false,
        active,
        gpu_policy,
        gym: None,
        journal: None,
    })
}

pub async fn resume(args: ResumeArgs) -> anyhow::Result<u8> {
    let location = store_location(args.store, None)?;
    let resumed = resumable(
        location,
        &args.run_id,
        args.config.as_deref(),
        args.retry_failed,
        &args.endpoints,
        args.yes,
    )
    .await?;
    match resumed {
        Resumable::Nothing { counts } => {
            ui::note(&format!(
                "Run {} has no pending items ({} done, {} failed); nothing to resume{}.",
                args.run_id,
                counts.done,
                counts.failed,
                if counts.failed > 0 {
                    " (--retry-failed answers the failed ones again)"
                } else {
                    ""
                }
            ));
            Ok(if counts.failed > 0 {
                EXIT_FAILED
            } else {
                EXIT_OK
            })
        }
        Resumable::Session(session) => {
            execute(
                *session,
                Attendance::Terminal {
                    quiet: args.output.quiet,
                },
            )
            .await
        }
    }
}

/// What a stored run has left to answer.
pub(crate) enum Resumable {
    /// Nothing: every item ended (the run is marked finished).
    Nothing {
        counts: evalfleet_types::StateCounts,
    },
    Session(Box<Session>),
}

/// A new session of the stored run `run_id`, with its stored config (or
/// `config`), when it has items left to answer.
pub(crate) async fn resumable(
    location: Location,
    run_id: &str,
    config: Option<&Path>,
    retry_failed: bool,
    endpoints: &[String],
    yes: bool,
) -> anyhow::Result<Resumable> {
    let mut store = evalfleet_store::open(&location, &OpenOptions::default())?;
    let record = store.run(run_id)?;
    let loaded = match config {
        Some(file) => super::convert::load(file, Overrides::default())?,
        None => config::load_snapshot(&record.config, Path::new(&record.config_dir))?,
    };
    resumable_with(
        location,
        store,
        &record,
        loaded,
        retry_failed,
        endpoints,
        yes,
    )
    .await
}

/// [`resumable`], of the stored run `record` with `loaded` as its config.
pub(crate) async fn resumable_with(
    location: Location,
    mut store: Box<dyn Store>,
    record: &RunRecord,
    mut loaded: LoadedConfig,
    retry_failed: bool,
    endpoints: &[String],
    yes: bool,
) -> anyhow::Result<Resumable> {
    let run_id = record.run_id.as_str();
    super::sheets::read(&mut loaded.config).await?;
    run::check_resume(record, &loaded.config).map_err(|err| {
        let sheet = loaded.config.dataset.sheet.is_some();
        let err = anyhow::Error::new(err);
        if sheet {
            err.context(format!(
                "the rows read from the sheet are not those run {run_id} read (a cell of an item edited, rows inserted or removed, or a column named in the header added): its results cannot go back to their rows"
            ))
        } else {
            err
        }
    })?;
    let counts = store.counts(run_id)?;
    if counts.pending == 0 && !(retry_failed && counts.failed > 0) {
        if record.status != RunStatus::Finished {
            store.set_status(run_id, RunStatus::Finished, None)?;
        }
        return Ok(Resumable::Nothing { counts });
    }
    let templates = checked_templates(&loaded)?;
    let active = fleet::active(&loaded.config, endpoints)?;
    let gpu_policy = fleet::check_gpus(&loaded.config, active.as_deref(), yes).await?;
    Ok(Resumable::Session(Box::new(Session {
        location,
        store,
        run_id: run_id.to_owned(),
        config: loaded.config,
        templates,
        retry_failed,
        active,
        gpu_policy,
        gym: None,
        journal: None,
    })))
}

/// Everything a session of `run` or `resume` needs.
pub(crate) struct Session {
    pub location: Location,
    store: Box<dyn Store>,
    pub run_id: String,
    config: Config,
    templates: Templates,
    retry_failed: bool,
    active: Option<Vec<String>>,
    gpu_policy: GpuPolicy,
    /// Where a trainer takes the conversation's decisions (`env`).
    pub gym: Option<Arc<evalfleet_pipeline::task::conversation::gym::Gym>>,
    /// What writes the gym's episodes to the logs as they end (`env`):
    /// done once the gym has finished and it has written the last.
    pub journal: Option<std::pin::Pin<Box<dyn Future<Output = anyhow::Result<()>> + Send>>>,
}

impl Session {
    pub fn config(&self) -> &Config {
        &self.config
    }
}

/// Who is watching a session.
pub(crate) enum Attendance {
    /// A person at a terminal: a progress display (unless quiet), and
    /// Ctrl-C stops the run.
    Terminal { quiet: bool },
    /// A server: no display; the run stops when `stop` is cancelled.
    Server { stop: CancellationToken },
}

pub(crate) async fn execute(session: Session, attendance: Attendance) -> anyhow::Result<u8> {
    let Session {
        location,
        mut store,
        run_id,
        config,
        templates,
        retry_failed,
        active,
        gpu_policy,
        gym,
        journal,
    } = session;
    let started = Instant::now();
    let grace = config.shutdown_grace;
    let scored = !config.task.eval.metrics.is_empty();
    let conversation = config.task.kind.conversation().cloned();
    let trainer = gym.clone();
    let options = fleet::options(&config, &location, &run_id, active, gpu_policy)?;
    let (sheet, on_result) = match super::sheets::start(&config, &mut *store, &run_id).await? {
        Some((live, tap)) => (Some(live), Some(tap)),
        None => (None, None),
    };
    let mut fleet = Fleet::new(&config, options);
    let plan = SessionPlan {
        run_id: run_id.clone(),
        config: Arc::new(config),
        templates: Arc::new(templates),
        endpoints: fleet.endpoints.clone(),
        fleet: fleet.handle(),
        retry_failed,
        sandbox_dir: super::sandbox_dir(&location, &run_id),
        gym,
        gateway_host: Some(Arc::new(evalfleet_server::gateway::Host)),
        on_result,
    };
    let prepared = run::prepare(&mut *store, &plan)?;
    // The writer's and the reader's connections use the cache.
    let with_cache = OpenOptions {
        create: false,
        cache_file: plan
            .config
            .cache
            .path
            .clone()
            .filter(|_| plan.config.cache.mode != evalfleet_config::cache::CacheMode::Off),
        read_only: false,
    };
    drop(store);
    let open: Arc<OpenStore> = {
        let location = location.clone();
        Arc::new(move || evalfleet_store::open(&location, &with_cache))
    };
    fleet.start(
        &run_id,
        prepared.worker(),
        evalfleet_store::open(&location, &OpenOptions::default())?,
    );
    // Workers sharing a store share their API keys' quotas through it, on
    // a connection of the fleet's own (a store that does not share is
    // dropped at once).
    fleet.share_quotas(evalfleet_store::open(&location, &OpenOptions::default())?);
    let pending_at_start =
        prepared.progress.total - prepared.progress.done_before - prepared.progress.failed_before;
    if let Some(gym) = &trainer {
        gym.expect(pending_at_start);
    }
    let (mode, stop, signals) = match attendance {
        Attendance::Terminal { quiet } => {
            let stop = CancellationToken::new();
            // Outside the run's tasks: aborted once the session has ended.
            #[allow(clippy::disallowed_methods)]
            let signals = tokio::spawn(watch_signals(stop.clone(), grace, run_id.clone()));
            (ui::Mode::pick(quiet), stop, Some(signals))
        }
        Attendance::Server { stop } => (ui::Mode::Quiet, stop, None),
    };
    let progress = prepared.progress.clone();
    let display = ui::Display::start(progress.clone(), fleet.endpoints.clone(), mode);
    let span = tracing::info_span!("run", id = %run_id);
    let result = run::run_session(plan, prepared, open, stop)
        .instrument(span)
        .await;
    // The rate counts the session, not the time engines take to stop.
    let elapsed = started.elapsed();
    // A trainer's resets learn that no episode is left, and the episodes'
    // log is written to its last line.
    if let Some(gym) = &trainer {
        gym.finish();
    }
    if let Some(journal) = journal
        && let Err(err) = journal.await
    {
        tracing::warn!("The environment's log could not be written to its end: {err:#}.");
    }
    display.finish().await;
    if let Some(signals) = signals {
        signals.abort();
    }
    fleet.stop().await;
    // The session's writer, and with it the sheet's tap, is gone: what
    // waits is written.
    let sheet_written = match sheet {
        Some(live) => live.finish().await,
        None => true,
    };

    let report = match result {
        Ok(report) => report,
        Err(err) => {
            // The session stored how it stopped.
            return Err(match err {
                PipelineError::Dataset(err) => anyhow::Error::new(err).context(format!(
                    "run {run_id} stopped; fix the dataset or resume with the original file"
                )),
                other => anyhow::Error::new(other).context(format!("run {run_id} stopped")),
            });
        }
    };
    let resume = if trainer.is_some() {
        "env --resume"
    } else {
        "resume"
    };
    let mut code = conclude(
        &run_id,
        &location,
        &report,
        elapsed,
        pending_at_start,
        &progress,
        resume,
    );
    if let Some(settings) = conversation {
        let totals = super::simulate::conclude(&location, &run_id, &settings, trainer.is_some())?;
        // Episodes a trainer gave up are not failures of the run.
        if code == EXIT_FAILED && totals.failed == totals.closed {
            code = EXIT_OK;
        }
    }
    if !sheet_written {
        code = code.max(EXIT_FAILED);
    }
    if scored && report.status == RunStatus::Finished {
        return Ok(code.max(scores(&location, &run_id)?));
    }
    Ok(code)
}

/// The finished run's scores in a line per metric, and whether they can be
/// used (exit 1 when a metric could not score its answers).
fn scores(location: &Location, run_id: &str) -> anyhow::Result<u8> {
    let report = tokio::task::block_in_place(|| {
        let mut store = evalfleet_store::open(location, &OpenOptions::default())?;
        // The metrics only: no endpoint summary (it reads every attempt).
        anyhow::Ok(evalfleet_reports::report_with(
            &mut *store,
            run_id,
            &[],
            None,
            &mut |_, _, _| {},
        )?)
    })?;
    for s in report
        .metrics
        .iter()
        .filter(|s| s.group == evalfleet_reports::metrics::ALL)
    {
        let mean = if s.status == "not scored" {
            "not scored".to_owned()
        } else {
            format!("{:.4}", s.estimate.mean)
        };
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
            "  {}: {mean} over {} items{unscored}{lost}",
            s.metric,
            s.n - s.errors - s.lost
        ));
    }
    Ok(super::report::unusable_scores(&report))
}

fn conclude(
    run_id: &str,
    location: &Location,
    report: &SessionReport,
    elapsed: Duration,
    pending_at_start: u64,
    progress: &Progress,
    resume: &str,
) -> u8 {
    let counts = report.counts;
    let answered = pending_at_start.saturating_sub(counts.pending);
    let rate = answered as f64 / elapsed.as_secs_f64().max(1e-9);
    let store_flag = store_flag(location);
    let program = ui::program();
    match report.status {
        RunStatus::Finished => {
            ui::note(&format!(
                "Run {run_id} finished: {} done, {} failed; {answered} items in {:.1}s ({rate:.1} items/s; {}).\n\
                 Results: {program} export {run_id}{store_flag} --format jsonl",
                counts.done,
                counts.failed,
                elapsed.as_secs_f64(),
                ui::calls_line(progress),
            ));
            let unusable = progress.unparsed.load(Ordering::Relaxed)
                + progress.invalid.load(Ordering::Relaxed);
            let ended = progress.done.load(Ordering::Relaxed);
            if unusable > 0 && 2 * unusable >= ended {
                ui::note(&format!(
                    "warning: {unusable} of {ended} answers could not be used (task.parse or task.schema did not accept them, re-asks included): \
                     compare an answer with the parse rule ({program} export {run_id}{store_flag} --format jsonl | head -1); see docs/troubleshooting.md"
                ));
            }
            if counts.failed > 0 {
                EXIT_FAILED
            } else {
                EXIT_OK
            }
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
            EXIT_INTERRUPTED
        }
    }
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

/// `NAME-YYYYMMDD-HHMMSS-XXXX`, with the name reduced to letters, digits and `-`.
fn new_run_id(name: &str) -> String {
    let mut slug: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    slug = slug.trim_matches('-').chars().take(40).collect();
    if slug.is_empty() {
        slug.push_str("run");
    }
    let stamp: String = humantime::format_rfc3339_seconds(SystemTime::now())
        .to_string()
        .chars()
        .filter(char::is_ascii_digit)
        .collect();
    let (date, time) = stamp.split_at(8.min(stamp.len()));
    let noise = std::hash::RandomState::new().hash_one(SystemTime::now()) & 0xffff;
    format!("{slug}-{date}-{time}-{noise:04x}")
}
