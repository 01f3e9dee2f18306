//! A conversation run read back from its stored episodes, or followed as
//! its episodes end: the totals `evalfleet simulate` prints, the lines of
//! the logs trainers' tools read (`conversation_summary.jsonl`: every step;
//! `batch_summary.jsonl` and `metrics.jsonl`: every `batch_size`
//! episodes), and policy-collapse alarms. A stored run is read from its
//! committed results only, in dataset order, so an episode cut short by a
//! crash and played again after a resume is counted once; only episodes
//! played to their end (done) count.

pub mod original;

use std::collections::{BTreeMap, VecDeque};

use evalfleet_types::ItemStatus;
use serde::Serialize;
use serde_json::{Value, json};

use super::stats::{self, Estimate};
use evalfleet_config::{AlarmSettings, ConversationSettings};
use evalfleet_eval::balance::entropy_bits;
use evalfleet_pipeline::task::conversation::gym::CLOSED;
use evalfleet_store::{Store, StoreError};

/// Names of the strategies in reports, `invalid` last.
pub const CHOICES: [&str; 5] = ["validate", "bridge", "plan", "no_intervention", "invalid"];

/// A conversation run's totals.
#[derive(Debug, Clone, Serialize)]
pub struct ConversationReport {
    /// Episodes played to their end.
    pub episodes: u64,
    /// Episodes that failed (those closed by the trainer included).
    pub failed: u64,
    /// Of the failed, those the trainer closed (`evalfleet env`).
    pub closed: u64,
    pub steps: u64,
    pub total_reward: f64,
    /// Reward per episode, with its 95% interval.
    pub reward_per_episode: Estimate,
    pub interventions: u64,
    /// Decisions by strategy (`invalid`: no usable reply).
    pub strategies: BTreeMap<String, u64>,
    pub entropy_bits: f64,
    /// Steps that earned the stable bonus, of all steps.
    pub stabilisation_rate: f64,
    /// Steps whose strategy matched the target's need.
    pub preference_match_rate: f64,
    pub alarms: Vec<Alarm>,
}

/// A policy-collapse alarm: when, over the last `alarms.window`
/// decisions (or the last `alarms.max_run`), one condition began to hold.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Alarm {
    /// Decisions followed so far.
    pub decisions: u64,
    pub episode: String,
    pub step: u64,
    pub message: String,
}

impl Alarm {
    /// How it is stored as an event, and printed.
    pub fn line(&self) -> String {
        format!(
            "episode {} step {}: {}",
            self.episode, self.step, self.message
        )
    }
}

/// The decisions of the last `window`, and which alarms hold.
struct Watch {
    settings: AlarmSettings,
    recent: VecDeque<usize>,
    counts: [u64; 5],
    holding: BTreeMap<&'static str, bool>,
    decisions: u64,
    /// The choice of the last decisions, and how many in a row.
    run: Option<(usize, u32)>,
}

impl Watch {
    fn new(settings: AlarmSettings) -> Self {
        Self {
            settings,
            recent: VecDeque::new(),
            counts: [0; 5],
            holding: BTreeMap::new(),
            decisions: 0,
            run: None,
        }
    }

    /// One decision (`choice`: an index of [`CHOICES`]); the alarms that
    /// begin to hold with it.
    fn decide(&mut self, choice: usize) -> Vec<String> {
        self.decisions += 1;
        let mut began = Vec::new();
        let run = match self.run {
            Some((last, n)) if last == choice => n + 1,
            _ => 1,
        };
        self.run = Some((choice, run));
        if run == self.settings.max_run {
            began.push(format!(
                "policy collapse: {} chosen {run} decisions in a row",
                CHOICES[choice]
            ));
        }
        self.recent.push_back(choice);
        self.counts[choice] += 1;
        if self.recent.len() > self.settings.window as usize
            && let Some(old) = self.recent.pop_front()
        {
            self.counts[old] -= 1;
        }
        if self.recent.len() < self.settings.window as usize {
            return began;
        }
        let n = self.recent.len() as f64;
        let valid = &self.counts[..4];
        let mut now: Vec<(&'static str, Option<String>)> = Vec::new();
        let top = (0..4).max_by_key(|&i| valid[i]).unwrap_or(0);
        let share = valid[top] as f64 / n;
        now.push((
            "dominant",
            (share > self.settings.max_share).then(|| {
                format!(
                    "policy collapse: {} is {:.0}% of the last {} decisions (above {:.0}%)",
                    CHOICES[top],
                    share * 100.0,
                    self.recent.len(),
                    self.settings.max_share * 100.0
                )
            }),
        ));
        let never: Vec<&str> = (0..4)
            .filter(|&i| valid[i] == 0)
            .map(|i| CHOICES[i])
            .collect();
        now.push((
            "never",
            (!never.is_empty()).then(|| {
                format!(
                    "policy collapse: {} never chosen in the last {} decisions",
                    never.join(", "),
                    self.recent.len()
                )
            }),
        ));
        let entropy = entropy_bits(valid);
        now.push((
            "entropy",
            (entropy < self.settings.min_entropy).then(|| {
                format!(
                    "policy collapse: strategy entropy {entropy:.2} bits over the last {} decisions (floor {:.2})",
                    self.recent.len(),
                    self.settings.min_entropy
                )
            }),
        ));
        for (key, message) in now {
            let was = self.holding.insert(key, message.is_some()).unwrap_or(false);
            if let (false, Some(message)) = (was, message) {
                began.push(message);
            }
        }
        began
    }
}

fn choice_of(step: &Value) -> usize {
    step.get("strategy")
        .and_then(Value::as_str)
        .and_then(|s| CHOICES.iter().position(|c| *c == s))
        .unwrap_or(4)
}

/// A line of the logs, as episodes are followed.
#[derive(Debug, Clone, PartialEq)]
pub enum Line {
    /// A step of `conversation_summary.jsonl`: the episode's id and the
    /// step's record.
    Step(Value),
    /// A line of `batch_summary.jsonl`.
    Batch(Value),
    /// A line of `metrics.jsonl`.
    Metrics(Value),
    Alarm(Alarm),
    /// `rules: original`: a record of `conversation_summary.jsonl` or
    /// `batch_summary.jsonl` in the original trainer's shape (its text,
    /// separator included), in place of the lines above of those files.
    Original(original::File, String),
}

/// Follows a run's episodes played to their end, one at a time, into the
/// lines of its logs and its totals.
pub struct Logbook {
    watch: Watch,
    /// `rules: original`: the original's records.
    original: Option<original::OriginalLog>,
    batch: Batch,
    batch_size: u64,
    /// Batches written so far (those of earlier sessions included).
    batches: u64,
    rewards: stats::Moments,
    total_reward: f64,
    strategies: [u64; 5],
    steps: u64,
    stabilised: u64,
    matched: u64,
    interventions: u64,
    alarms: Vec<Alarm>,
}

impl Logbook {
    /// `batches`: the batches already written (a resumed log goes on
    /// numbering them).
    pub fn new(settings: &ConversationSettings, batches: u64) -> Self {
        Self {
            original: (settings.rules == evalfleet_config::Rules::Original)
                .then(|| original::OriginalLog::new(u64::from(settings.batch_size.max(1)))),
            watch: Watch::new(settings.alarms),
            batch: Batch::default(),
            batch_size: u64::from(settings.batch_size.max(1)),
            batches,
            rewards: stats::Moments::default(),
            total_reward: 0.0,
            strategies: [0; 5],
            steps: 0,
            stabilised: 0,
            matched: 0,
            interventions: 0,
            alarms: Vec::new(),
        }
    }

    /// Episode `episode`, played to its end with the record `summary`.
    pub fn episode(&mut self, episode: &str, summary: &Value, out: &mut dyn FnMut(Line)) {
        let steps = summary
            .get("steps")
            .and_then(Value::as_array)
            .map_or(&[][..], Vec::as_slice);
        let mut episode_reward = 0.0;
        for step in steps {
            let choice = choice_of(step);
            self.strategies[choice] += 1;
            self.batch.strategies[choice] += 1;
            let reward = &step["reward"];
            let total = reward["total"].as_f64().unwrap_or(0.0);
            episode_reward += total;
            self.batch.reward += total;
            if reward["stable_bonus"].as_f64().unwrap_or(0.0) > 0.0 {
                self.stabilised += 1;
                self.batch.stabilised += 1;
            }
            if reward["preference_match_bonus"].as_f64().unwrap_or(0.0) > 0.0 {
                self.matched += 1;
            }
            if choice < 3 {
                self.interventions += 1;
                self.batch.interventions += 1;
            }
            self.steps += 1;
            for message in self.watch.decide(choice) {
                let alarm = Alarm {
                    decisions: self.watch.decisions,
                    episode: episode.to_owned(),
                    step: step["step"].as_u64().unwrap_or(0),
                    message,
                };
                self.alarms.push(alarm.clone());
                out(Line::Alarm(alarm));
            }
            // Under `rules: original` the steps are the original's records.
            if self.original.is_none() {
                let mut line = json!({"episode": episode});
                if let (Some(line), Some(step)) = (line.as_object_mut(), step.as_object()) {
                    line.extend(step.clone());
                }
                out(Line::Step(line));
            }
        }
        if let Some(log) = &mut self.original {
            let now = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
            log.episode(summary, &now, &mut |file, text| {
                out(Line::Original(file, text))
            });
        }
        self.rewards.add(episode_reward);
        self.total_reward += episode_reward;
        self.batch.episodes += 1;
        self.batch.steps += steps.len() as u64;
        if self.batch.episodes == self.batch_size {
            self.flush(out);
        }
    }

    /// The batch begun, written short (at the end of the episodes).
    pub fn flush(&mut self, out: &mut dyn FnMut(Line)) {
        if self.batch.episodes == 0 {
            return;
        }
        self.batches += 1;
        let batch = std::mem::take(&mut self.batch);
        if self.original.is_none() {
            out(Line::Batch(batch.line(self.batches)));
        }
        out(Line::Metrics(batch.metrics(self.batches)));
    }

    /// The totals so far; `failed` and `closed`: the episodes that ended
    /// otherwise.
    pub fn report(&self, failed: u64, closed: u64) -> ConversationReport {
        let steps = self.steps.max(1) as f64;
        ConversationReport {
            episodes: self.rewards.n,
            failed,
            closed,
            steps: self.steps,
            total_reward: self.total_reward,
            reward_per_episode: stats::estimate(&self.rewards),
            interventions: self.interventions,
            strategies: CHOICES
                .iter()
                .zip(self.strategies)
                .map(|(c, n)| ((*c).to_owned(), n))
                .collect(),
            entropy_bits: entropy_bits(&self.strategies[..4]),
            stabilisation_rate: self.stabilised as f64 / steps,
            preference_match_rate: self.matched as f64 / steps,
            alarms: self.alarms.clone(),
        }
    }
}

/// Reads the run's stored episodes, in dataset order, into the lines of
/// its logs (`out`) and its totals.
pub fn scan(
    store: &mut dyn Store,
    run_id: &str,
    settings: &ConversationSettings,
    out: &mut dyn FnMut(Line),
) -> Result<ConversationReport, StoreError> {
    let mut book = Logbook::new(settings, 0);
    let (mut failed, mut closed) = (0u64, 0u64);
    store.scan_results(run_id, &mut |result| {
        if result.status != ItemStatus::Done {
            if result.status == ItemStatus::Failed {
                failed += 1;
                if closed_output(result.output.as_deref()) {
                    closed += 1;
                }
            }
            return;
        }
        let Some(summary) = result
            .output
            .as_deref()
            .and_then(|o| serde_json::from_str::<Value>(o).ok())
        else {
            return;
        };
        book.episode(&result.item_id, &summary, out);
    })?;
    book.flush(out);
    Ok(book.report(failed, closed))
}

/// Whether a failed episode's output says the trainer closed it.
fn closed_output(output: Option<&str>) -> bool {
    output
        .and_then(|o| serde_json::from_str::<Value>(o).ok())
        .is_some_and(|v| v.get("closed").and_then(Value::as_str) == Some(CLOSED))
}

#[derive(Default)]
struct Batch {
    episodes: u64,
    steps: u64,
    strategies: [u64; 5],
    reward: f64,
    interventions: u64,
    stabilised: u64,
}

impl Batch {
    /// A line of `batch_summary.jsonl`, in the shape the original
    /// trainer's logs have.
    fn line(&self, id: u64) -> Value {
        let distribution: serde_json::Map<String, Value> = CHOICES[..4]
            .iter()
            .zip(self.strategies)
            .map(|(c, n)| ((*c).to_owned(), json!(n)))
            .collect();
        json!({
            "batch_id": id,
            "batch_size": self.episodes,
            "steps": self.steps,
            "total_reward": self.reward,
            "total_interventions": self.interventions,
            "invalid": self.strategies[4],
            "choice_entropy": {"strategy": entropy_bits(&self.strategies[..4])},
            "choice_distributions": {"strategy": distribution},
        })
    }

    /// A line of `metrics.jsonl`.
    fn metrics(&self, id: u64) -> Value {
        let steps = self.steps.max(1) as f64;
        let mut line = json!({
            "batch_id": id,
            "episodes": self.episodes,
            "steps": self.steps,
            "reward_mean": self.reward / self.episodes.max(1) as f64,
            "interventions": self.interventions,
            "stabilised_share": self.stabilised as f64 / steps,
            "invalid": self.strategies[4],
            "strategy_entropy": entropy_bits(&self.strategies[..4]),
        });
        if let Some(o) = line.as_object_mut() {
            for (choice, n) in CHOICES.iter().zip(self.strategies) {
                o.insert(format!("strategy/{choice}_ratio"), json!(n as f64 / steps));
            }
        }
        line
    }
}

/// `value` as one line of JSON the way Python's `json.dumps` writes it by
/// default (`", "` and `": "` between items; floats as Python prints
/// them), with text other than ASCII kept as is: every log line trainers'
/// tools read is written so, so that the original's `grep` recipes work.
pub fn json_line(value: &impl Serialize) -> String {
    let mut out = Vec::new();
    let mut writer = serde_json::Serializer::with_formatter(&mut out, PythonStyle);
    match value.serialize(&mut writer) {
        Ok(()) => String::from_utf8(out).unwrap_or_default(),
        Err(err) => json!({"error": err.to_string()}).to_string(),
    }
}

/// The separators and floats of Python's `json.dumps`.
struct PythonStyle;

impl serde_json::ser::Formatter for PythonStyle {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        between_items(writer, first)
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        between_items(writer, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }

    fn write_f64<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        value: f64,
    ) -> std::io::Result<()> {
        writer.write_all(python_float(value).as_bytes())
    }
}

fn between_items<W: ?Sized + std::io::Write>(writer: &mut W, first: bool) -> std::io::Result<()> {
    if first {
        Ok(())
    } else {
        writer.write_all(b", ")
    }
}

/// A finite float as Python's `repr` writes it: the shortest digits that
/// read back the same, positional from 1e-4 up to 1e16, else with an
/// exponent of at least two digits (`1e-05`, `1.5e+16`).
pub(crate) fn python_float(value: f64) -> String {
    if !value.is_finite() {
        return "null".to_owned();
    }
    let scientific = format!("{value:e}");
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    if (-4..16).contains(&exponent) {
        let positional = format!("{value}");
        if positional.contains('.') {
            positional
        } else {
            format!("{positional}.0")
        }
    } else {
        let sign = if exponent < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exponent.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch(window: u32) -> Watch {
        Watch::new(AlarmSettings {
            window,
            max_share: 0.8,
            min_entropy: 1.0,
            max_run: 20,
        })
    }

    #[test]
    fn alarms_begin_once_when_their_condition_starts_to_hold() {
        let mut w = watch(4);
        // Not before the window is full.
        assert!(w.decide(0).is_empty());
        assert!(w.decide(1).is_empty());
        assert!(w.decide(2).is_empty());
        // 0,1,2,3: 2 bits, no share above 0.8, nothing vanished.
        assert!(w.decide(3).is_empty());
        // 1,2,3,1 -> validate never chosen in the window.
        let began = w.decide(1);
        assert_eq!(began.len(), 1, "{began:?}");
        assert!(
            began[0].contains("validate never chosen in the last 4"),
            "{began:?}"
        );
        // Still so: not again.
        assert!(w.decide(1).iter().all(|m| !m.contains("never")));
        // 3,1,1,1 then 1,1,1,1: entropy falls, then one strategy is all.
        let mut all = Vec::new();
        for _ in 0..3 {
            all.extend(w.decide(1));
        }
        assert!(all.iter().any(|m| m.contains("entropy")), "{all:?}");
        assert!(all.iter().any(|m| m.contains("bridge is 100%")), "{all:?}");
    }

    #[test]
    fn a_long_run_of_one_choice_raises_an_alarm_once_before_the_window_is_full() {
        let mut w = Watch::new(AlarmSettings {
            window: 100,
            max_share: 0.8,
            min_entropy: 1.0,
            max_run: 3,
        });
        assert!(w.decide(2).is_empty());
        assert!(w.decide(2).is_empty());
        assert_eq!(
            w.decide(2),
            ["policy collapse: plan chosen 3 decisions in a row"]
        );
        assert!(w.decide(2).is_empty());
        // Broken, then begun again.
        assert!(w.decide(4).is_empty());
        assert!(w.decide(4).is_empty());
        assert_eq!(
            w.decide(4),
            ["policy collapse: invalid chosen 3 decisions in a row"]
        );
    }

    #[test]
    fn log_lines_are_written_as_python_writes_them() {
        let value = json!({"strategy": "bridge", "text": "こんにちは、\"元気\"?",
            "values": [1, 2.5, 0.00001, 1e16, 2.0, -0.0001], "nested": {}});
        assert_eq!(
            json_line(&value),
            r#"{"nested": {}, "strategy": "bridge", "text": "こんにちは、\"元気\"?", "values": [1, 2.5, 1e-05, 1e+16, 2.0, -0.0001]}"#
        );
    }
}
