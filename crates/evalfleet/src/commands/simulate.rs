//! `evalfleet simulate`: a run of a conversation config (`kind:
//! conversation`), then its episodes' totals and the logs trainers' tools
//! read, in the run's directory beside the store.

use std::io::Write;
use std::path::{Path, PathBuf};

use evalfleet_core::config::{ConversationSettings, Overrides};
use evalfleet_core::report::conversation::{self, CHOICES, ConversationReport};
use evalfleet_core::types::{Event, EventKind, now_ms};
use evalfleet_store::{Location, OpenOptions};

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
/// stored episodes, new alarms stored as events, and the totals printed.
pub fn conclude(
    location: &Location,
    run_id: &str,
    settings: &ConversationSettings,
) -> anyhow::Result<()> {
    let dir = run_dir(location, run_id);
    let report = tokio::task::block_in_place(|| write_logs(location, run_id, settings, &dir))?;
    print(&report, &dir);
    Ok(())
}

fn write_logs(
    location: &Location,
    run_id: &str,
    settings: &ConversationSettings,
    dir: &Path,
) -> anyhow::Result<ConversationReport> {
    let mut store = evalfleet_store::open(location, &OpenOptions::default())?;
    std::fs::create_dir_all(dir)?;
    let file = |name: &str| -> std::io::Result<std::io::BufWriter<std::fs::File>> {
        Ok(std::io::BufWriter::new(std::fs::File::create(
            dir.join(name),
        )?))
    };
    let mut steps = file("conversation_summary.jsonl")?;
    let mut batches = file("batch_summary.jsonl")?;
    let (mut step_err, mut batch_err) = (None, None);
    let report = conversation::scan(
        &mut *store,
        run_id,
        settings,
        &mut |v| {
            if step_err.is_none()
                && let Err(err) = writeln!(steps, "{v}")
            {
                step_err = Some(err);
            }
        },
        &mut |v| {
            if batch_err.is_none()
                && let Err(err) = writeln!(batches, "{v}")
            {
                batch_err = Some(err);
            }
        },
    )?;
    if let Some(err) = step_err.or(batch_err) {
        return Err(err.into());
    }
    steps.flush()?;
    batches.flush()?;
    // Alarms not stored yet become events.
    let stored = store.events(run_id)?;
    let new: Vec<Event> = report
        .alarms
        .iter()
        .map(|a| format!("episode {} step {}: {}", a.episode, a.step, a.message))
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
        writeln!(events, "{}", serde_json::to_string(event)?)?;
    }
    events.flush()?;
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
        "Conversation: {} episodes ({} failed), {} steps; reward {:.2} in all, {:.3} per episode (95% CI {:.3} to {:.3}); {} interventions.\n\
         Strategies: {}; entropy {:.2} bits.\n\
         Stabilised {:.1}% of steps; the strategy matched the target's need in {:.1}%.",
        report.episodes,
        report.failed,
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
        ui::note(&format!(
            "Alarm (episode {} step {}): {}",
            alarm.episode, alarm.step, alarm.message
        ));
    }
    ui::note(&format!(
        "Logs: {}/ (conversation_summary.jsonl, batch_summary.jsonl, run_events.jsonl, config.json)",
        dir.display()
    ));
}
