//! `evalfleet simulate`: a run of a conversation config (`kind:
//! conversation`), then its episodes' totals and the logs trainers' tools
//! read, in the run's directory beside the store.

use std::io::Write;
use std::path::{Path, PathBuf};

use evalfleet_config::{ConversationSettings, Overrides};
use evalfleet_reports::conversation::{self, CHOICES, ConversationReport, Line};
use evalfleet_store::{Location, OpenOptions};
use evalfleet_types::{Event, EventKind, now_ms};
use serde_json::Value;

use crate::UsageError;
use crate::cli::SimulateArgs;
use crate::ui;

pub async fn simulate(args: SimulateArgs) -> anyhow::Result<u8> {
    let overrides = Overrides {
        sessions: args.sessions,
        max_steps: args.max_steps,
        ..Overrides::default()
    };
    super::run::start(args.run, overrides, true).await
}

/// Checks that a config to simulate is a conversation.
pub fn require_conversation(
    settings: Option<&ConversationSettings>,
    config: &Path,
) -> anyhow::Result<()> {
    if settings.is_none() {
        return Err(UsageError(format!(
            "{}: simulate runs conversations; give the config task.kind: conversation (see examples/conversation.yaml)",
            config.display()
        ))
        .into());
    }
    Ok(())
}

/// Where a run's logs go: `RUN_ID/` beside the store.
pub fn run_dir(location: &Location, run_id: &str) -> PathBuf {
    location.dir().join(run_id)
}

/// After a session of a conversation run: the logs written again from the
/// stored episodes, new alarms stored as events, and the totals printed
/// (and returned).
/// `live`: an environment's session, whose journal wrote the batches,
/// metrics, events and alarms as its episodes ended (they are left as they
/// are; its stored alarms are printed).
pub fn conclude(
    location: &Location,
    run_id: &str,
    settings: &ConversationSettings,
    live: bool,
) -> anyhow::Result<ConversationReport> {
    let dir = run_dir(location, run_id);
    let report =
        tokio::task::block_in_place(|| write_logs(location, run_id, settings, &dir, live))?;
    print(&report, &dir);
    Ok(report)
}

/// Writes `line` to `file` (a line of JSON as Python writes it), keeping
/// the first error.
fn write_line(file: &mut impl Write, line: &Value, failed: &mut Option<std::io::Error>) {
    if failed.is_none()
        && let Err(err) = writeln!(file, "{}", conversation::json_line(line))
    {
        *failed = Some(err);
    }
}

fn write_logs(
    location: &Location,
    run_id: &str,
    settings: &ConversationSettings,
    dir: &Path,
    live: bool,
) -> anyhow::Result<ConversationReport> {
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

fn print(report: &ConversationReport, dir: &Path) {
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
