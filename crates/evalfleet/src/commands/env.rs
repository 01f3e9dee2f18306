//! `evalfleet env`: a conversation run whose decisions a trainer takes
//! over HTTP (`reset`, `step`, `close`), while the episodes' personas and
//! scorer run on the fleet. The run is stored like any other (a new run,
//! or with `--resume` the rest of a stopped one), and its journal writes
//! the logs a trainer watches as its episodes end: a line per batch of
//! `--batch-size` episodes (`batch_summary.jsonl`, `metrics.jsonl`), their
//! steps, their start and end, and policy-collapse alarms at once.

use std::fs::File;
use std::io::{BufRead, BufWriter, Write};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use evalfleet_config::{self as config, ConversationSettings, Overrides, PolicyKind};
use evalfleet_pipeline::task::conversation::gym::{Gym, Happening};
use evalfleet_reports::conversation::{Line, Logbook, json_line};
use evalfleet_server::env::{EnvServer, serve_env};
use evalfleet_store::prelude::*;
use evalfleet_store::{Location, OpenOptions};
use evalfleet_types::{Event, EventKind, now_ms};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_util::task::TaskTracker;

use super::run::{Attendance, Resumable, Session, new_session, resumable_with};
use super::simulate::{require_conversation, run_dir};
use super::store_location;
use crate::cli::EnvArgs;
use crate::{EXIT_FAILED, EXIT_OK, UsageError, ui};

pub async fn env(args: EnvArgs) -> anyhow::Result<u8> {
    let started = Instant::now();
    let overrides = Overrides {
        sessions: args.sessions,
        max_steps: args.max_steps,
        batch_size: args.batch_size,
        external_policy: true,
        ..Overrides::default()
    };
    let listener = TcpListener::bind(args.bind)
        .await
        .map_err(|err| UsageError(format!("cannot listen on {}: {err}", args.bind)))?;
    let addr = listener.local_addr()?;
    let mut session = match &args.resume {
        None => {
            let Some(file) = &args.config else {
                return Err(UsageError("env needs a config, or --resume RUN_ID".to_owned()).into());
            };
            let loaded = super::convert::load(file, overrides)?;
            require_conversation(loaded.config.task.kind.conversation(), file)?;
            new_session(
                loaded,
                &args.endpoints,
                args.yes,
                args.store.clone(),
                args.run_id.clone(),
                started,
            )
            .await?
        }
        Some(run_id) => match resumed(&args, run_id, overrides).await? {
            Ok(session) => session,
            Err(code) => return Ok(code),
        },
    };
    let Some(settings) = session.config().task.kind.conversation().cloned() else {
        return Err(UsageError(format!(
            "run {} is no conversation: env serves conversations",
            session.run_id
        ))
        .into());
    };
    let episodes = settings.sessions;
    let gym = Arc::new(Gym::new(args.action_timeout, args.envs.saturating_mul(2)));
    session.gym = Some(gym.clone());
    let run_id = session.run_id.clone();
    let tracker = TaskTracker::new();
    let journal = Journal::open(
        &session.location,
        &run_id,
        &settings,
        args.batch_size.unwrap_or(settings.batch_size),
    )?;
    let journaling = tracker.spawn(journal.follow(gym.journal()));
    session.journal = Some(Box::pin(async move { journaling.await? }));
    // The first line of stdout is the server's address, for scripts.
    println!("http://{addr}");
    std::io::stdout().flush()?;
    tracing::info!(
        "Environment server for run {run_id} ({episodes} episodes) on http://{addr}: POST /v1/reset, /v1/step, /v1/close."
    );
    let shutdown = super::stopped_by_signals()?;
    let server = EnvServer {
        gym: gym.clone(),
        run_id: run_id.clone(),
        episodes,
        reset_wait: args.reset_wait,
        step_wait: args.step_wait,
    };
    // It outlives the session: trainers are told 410 until a signal.
    let serving = tracker.spawn(serve_env(listener, Arc::new(server), shutdown.clone()));
    tracker.close();
    let code = super::run::execute(
        session,
        Attendance::Server {
            stop: shutdown.clone(),
        },
    )
    .await;
    // Whatever stopped the session, no episode comes any more (and the
    // journal ends, had the session no time to start).
    gym.finish();
    if args.exit_when_done || shutdown.is_cancelled() || code.is_err() {
        shutdown.cancel();
    } else {
        ui::note(&format!(
            "Every episode of run {run_id} has ended; serving on (resets answer 410) until Ctrl-C."
        ));
    }
    serving.await??;
    tracker.wait().await;
    code
}

/// The session that serves the rest of the stored run `run_id`, or the
/// exit code when every episode has ended (said).
async fn resumed(
    args: &EnvArgs,
    run_id: &str,
    overrides: Overrides,
) -> anyhow::Result<Result<Session, u8>> {
    let location = store_location(args.store.clone(), None)?;
    let store = evalfleet_store::open(&location, &OpenOptions::default())?;
    let record = {
        let mut store = evalfleet_store::open(&location, &OpenOptions::read_only())?;
        store.run(run_id)?
    };
    let loaded = match &args.config {
        Some(file) => super::convert::load(file, overrides)?,
        None => config::load_snapshot(&record.config, Path::new(&record.config_dir))?,
    };
    let external = loaded
        .config
        .task
        .kind
        .conversation()
        .is_some_and(|s| s.policy.kind == PolicyKind::External);
    if !external {
        return Err(UsageError(format!(
            "run {run_id} is not an environment's run (its policy is not a trainer's): resume it with evalfleet resume"
        ))
        .into());
    }
    let resumable = resumable_with(
        location,
        store,
        &record,
        loaded,
        args.retry_failed,
        &args.endpoints,
        args.yes,
    )
    .await?;
    match resumable {
        Resumable::Session(session) => Ok(Ok(*session)),
        Resumable::Nothing { counts } => {
            ui::note(&format!(
                "Run {run_id} has no episode left to serve ({} done, {} failed){}.",
                counts.done,
                counts.failed,
                if counts.failed > 0 {
                    "; --retry-failed serves the failed ones again"
                } else {
                    ""
                }
            ));
            Ok(Err(if counts.failed > 0 {
                EXIT_FAILED
            } else {
                EXIT_OK
            }))
        }
    }
}

/// The environment's log, written as its episodes end.
struct Journal {
    location: Location,
    run_id: String,
    book: Logbook,
    events: BufWriter<File>,
    steps: BufWriter<File>,
    batches: BufWriter<File>,
    metrics: BufWriter<File>,
    started_ms: i64,
}

impl Journal {
    /// Opens the logs of `run_id` to add to them (a resumed run's go on,
    /// its batches numbered after the last).
    fn open(
        location: &Location,
        run_id: &str,
        settings: &ConversationSettings,
        batch_size: u32,
    ) -> anyhow::Result<Self> {
        let dir = run_dir(location, run_id);
        std::fs::create_dir_all(&dir)?;
        let append = |name: &str| -> std::io::Result<BufWriter<File>> {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(dir.join(name))?;
            Ok(BufWriter::new(file))
        };
        let written = match File::open(dir.join("batch_summary.jsonl")) {
            Ok(file) => std::io::BufReader::new(file).lines().count() as u64,
            Err(_) => 0,
        };
        let settings = ConversationSettings {
            batch_size,
            ..settings.clone()
        };
        Ok(Self {
            location: location.clone(),
            run_id: run_id.to_owned(),
            book: Logbook::new(&settings, written),
            events: append("run_events.jsonl")?,
            steps: append("conversation_summary.jsonl")?,
            batches: append("batch_summary.jsonl")?,
            metrics: append("metrics.jsonl")?,
            started_ms: now_ms(),
        })
    }

    /// Writes what `happenings` tell until the gym finishes, then the
    /// batch begun and the session's other events.
    async fn follow(
        mut self,
        mut happenings: mpsc::UnboundedReceiver<Happening>,
    ) -> anyhow::Result<()> {
        let mut store = evalfleet_store::open(&self.location, &OpenOptions::default())?;
        while let Some(happening) = happenings.recv().await {
            let lines = self.lines(happening);
            tokio::task::block_in_place(|| self.write(&mut *store, lines))?;
        }
        let mut book = Vec::new();
        self.book.flush(&mut |line| book.push(line));
        let mut rest = lines_of(book);
        tokio::task::block_in_place(|| -> anyhow::Result<()> {
            // The session's other events (its start and end, endpoints').
            for event in store.events(&self.run_id)? {
                if event.at_ms >= self.started_ms && event.kind != EventKind::Alarm {
                    rest.push(Written::Event(serde_json::to_value(&event)?));
                }
            }
            self.write(&mut *store, rest)
        })?;
        Ok(())
    }

    /// The lines `happening` makes.
    fn lines(&mut self, happening: Happening) -> Vec<Written> {
        let at_ms = now_ms();
        match happening {
            Happening::Started { episode } => vec![Written::Event(
                json!({"at_ms": at_ms, "kind": "episode_started", "episode": episode}),
            )],
            Happening::Ended { episode, outcome } => {
                let mut ended =
                    json!({"at_ms": at_ms, "kind": "episode_ended", "episode": episode});
                let mut book = Vec::new();
                match &outcome {
                    Ok(summary) => {
                        ended["status"] = json!("done");
                        ended["ending"] = summary["ending"].clone();
                        ended["steps"] = json!(summary["steps"].as_array().map_or(0, Vec::len));
                        ended["total_reward"] = summary["total_reward"].clone();
                        self.book
                            .episode(&episode, summary, &mut |line| book.push(line));
                    }
                    Err(why) => {
                        ended["status"] = json!("failed");
                        ended["error"] = json!(why);
                    }
                }
                let mut lines = vec![Written::Event(ended)];
                lines.extend(lines_of(book));
                lines
            }
        }
    }

    fn write(&mut self, store: &mut dyn Store, lines: Vec<Written>) -> anyhow::Result<()> {
        let alarms: Vec<Event> = lines
            .iter()
            .filter_map(|line| match line {
                Written::Alarm(event) => Some(event.clone()),
                _ => None,
            })
            .collect();
        if !alarms.is_empty() {
            store.add_events(&self.run_id, &alarms)?;
        }
        for line in &lines {
            let (file, text) = match line {
                Written::Event(v) => (&mut self.events, json_line(v)),
                Written::Alarm(event) => (&mut self.events, json_line(event)),
                Written::Step(v) => (&mut self.steps, json_line(v)),
                Written::Batch(v) => (&mut self.batches, json_line(v)),
                Written::Metrics(v) => (&mut self.metrics, json_line(v)),
            };
            writeln!(file, "{text}")?;
        }
        for file in [
            &mut self.events,
            &mut self.steps,
            &mut self.batches,
            &mut self.metrics,
        ] {
            file.flush()?;
        }
        Ok(())
    }
}

/// A line of the journal, by the file it goes to.
enum Written {
    /// `run_events.jsonl`.
    Event(Value),
    /// `run_events.jsonl`, and stored as an event.
    Alarm(Event),
    Step(Value),
    Batch(Value),
    Metrics(Value),
}

fn lines_of(lines: Vec<Line>) -> Vec<Written> {
    lines
        .into_iter()
        .map(|line| match line {
            Line::Step(v) => Written::Step(v),
            Line::Batch(v) => Written::Batch(v),
            Line::Metrics(v) => Written::Metrics(v),
            Line::Alarm(alarm) => Written::Alarm(Event {
                at_ms: now_ms(),
                kind: EventKind::Alarm,
                endpoint: None,
                message: alarm.line(),
            }),
        })
        .collect()
}
