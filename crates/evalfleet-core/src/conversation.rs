//! A conversation run's logs, as the original system's tools read them:
//! written as an environment's episodes end ([`Journal`]), and again from
//! the stored episodes after each session.

use std::fs::File;
use std::io::{BufRead, BufWriter, Write};
use std::path::Path;

use evalfleet_config::ConversationSettings;
use evalfleet_pipeline::task::conversation::gym::Happening;
use evalfleet_reports::conversation::original::File as OriginalFile;
use evalfleet_reports::conversation::{self, ConversationReport, Line, Logbook, json_line};
use evalfleet_store::prelude::*;
use evalfleet_store::{Location, OpenOptions};
use evalfleet_types::{Event, EventKind, now_ms};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::error::SessionError;
use crate::frontend::run_dir;

/// Writes `line` to `file` (a line of JSON as Python writes it), keeping
/// the first error.
fn write_line(file: &mut impl Write, line: &Value, failed: &mut Option<std::io::Error>) {
    if failed.is_none()
        && let Err(err) = writeln!(file, "{}", conversation::json_line(line))
    {
        *failed = Some(err);
    }
}

/// After a session of a conversation run: the logs written again from the
/// stored episodes into `dir`, new alarms stored as events; the episodes'
/// totals.
/// `live`: an environment's session, whose journal wrote the batches,
/// metrics, events and alarms as its episodes ended (they are left as they
/// are; its stored alarms are reported).
pub fn write_logs(
    location: &Location,
    run_id: &str,
    settings: &ConversationSettings,
    dir: &Path,
    live: bool,
) -> Result<ConversationReport, SessionError> {
    let mut store = evalfleet_store::open(location, &OpenOptions::default())?;
    std::fs::create_dir_all(dir)?;
    let file = |name: &str| -> std::io::Result<std::io::BufWriter<std::fs::File>> {
        Ok(std::io::BufWriter::new(std::fs::File::create(
            dir.join(name),
        )?))
    };
    let mut steps = file("conversation_summary.jsonl")?;
    let mut batches = if live {
        None
    } else {
        Some((file("batch_summary.jsonl")?, file("metrics.jsonl")?))
    };
    let mut failed = None;
    let mut report = conversation::scan(&mut *store, run_id, settings, &mut |line| match line {
        Line::Step(v) => write_line(&mut steps, &v, &mut failed),
        Line::Batch(v) => {
            if let Some((batch, _)) = &mut batches {
                write_line(batch, &v, &mut failed);
            }
        }
        Line::Metrics(v) => {
            if let Some((_, metrics)) = &mut batches {
                write_line(metrics, &v, &mut failed);
            }
        }
        Line::Original(which, text) => {
            let file = match which {
                OriginalFile::ConversationSummary => Some(&mut steps),
                OriginalFile::BatchSummary => batches.as_mut().map(|(batch, _)| batch),
            };
            if let Some(file) = file
                && failed.is_none()
                && let Err(err) = file.write_all(text.as_bytes())
            {
                failed = Some(err);
            }
        }
        Line::Alarm(_) => {}
    })?;
    if let Some(err) = failed {
        return Err(err.into());
    }
    steps.flush()?;
    if let Some((mut batch, mut metrics)) = batches {
        batch.flush()?;
        metrics.flush()?;
    }
    let stored = store.events(run_id)?;
    if live {
        // The journal raised them as the episodes ended, in that order.
        report.alarms = stored
            .iter()
            .filter(|e| e.kind == EventKind::Alarm)
            .map(|e| conversation::Alarm {
                decisions: 0,
                episode: String::new(),
                step: 0,
                message: e.message.clone(),
            })
            .collect();
    } else {
        // Alarms not stored yet become events.
        let new: Vec<Event> = report
            .alarms
            .iter()
            .map(conversation::Alarm::line)
            .filter(|message| {
                !stored
                    .iter()
                    .any(|e| e.kind == EventKind::Alarm && e.message == *message)
            })
            .map(|message| Event {
                at_ms: now_ms(),
                kind: EventKind::Alarm,
                endpoint: None,
                message,
            })
            .collect();
        if !new.is_empty() {
            store.add_events(run_id, &new)?;
        }
        let mut events = file("run_events.jsonl")?;
        for event in stored.iter().chain(&new) {
            writeln!(events, "{}", conversation::json_line(event))?;
        }
        events.flush()?;
    }
    let run = store.run(run_id)?;
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&run.config)?,
    )?;
    Ok(report)
}

/// The environment's log, written as its episodes end.
pub struct Journal {
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
    pub fn open(
        location: &Location,
        run_id: &str,
        settings: &ConversationSettings,
        batch_size: u32,
    ) -> Result<Self, SessionError> {
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
    pub async fn follow(
        mut self,
        mut happenings: mpsc::UnboundedReceiver<Happening>,
    ) -> Result<(), SessionError> {
        let mut store = evalfleet_store::open(&self.location, &OpenOptions::default())?;
        while let Some(happening) = happenings.recv().await {
            let lines = self.lines(happening);
            tokio::task::block_in_place(|| self.write(&mut *store, lines))?;
        }
        let mut book = Vec::new();
        self.book.flush(&mut |line| book.push(line));
        let mut rest = lines_of(book);
        tokio::task::block_in_place(|| -> Result<(), SessionError> {
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
            Happening::Withdrawn { episode } => vec![Written::Event(
                json!({"at_ms": at_ms, "kind": "episode_withdrawn", "episode": episode}),
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

    fn write(&mut self, store: &mut dyn Store, lines: Vec<Written>) -> Result<(), SessionError> {
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
                Written::Original(which, text) => {
                    let file = match which {
                        OriginalFile::ConversationSummary => &mut self.steps,
                        OriginalFile::BatchSummary => &mut self.batches,
                    };
                    file.write_all(text.as_bytes())?;
                    continue;
                }
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
    /// A record in the original trainer's shape, as written.
    Original(OriginalFile, String),
}

fn lines_of(lines: Vec<Line>) -> Vec<Written> {
    lines
        .into_iter()
        .map(|line| match line {
            Line::Step(v) => Written::Step(v),
            Line::Batch(v) => Written::Batch(v),
            Line::Metrics(v) => Written::Metrics(v),
            Line::Original(file, text) => Written::Original(file, text),
            Line::Alarm(alarm) => Written::Alarm(Event {
                at_ms: now_ms(),
                kind: EventKind::Alarm,
                endpoint: None,
                message: alarm.line(),
            }),
        })
        .collect()
}
