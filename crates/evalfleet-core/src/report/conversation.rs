//! A conversation run read back from its stored episodes: the totals
//! `evalfleet simulate` prints, the lines of the logs trainers' tools read
//! (`conversation_summary.jsonl`: every step; `batch_summary.jsonl`: every
//! `batch_size` episodes), and policy-collapse alarms. Read from committed
//! results only, in dataset order, so an episode cut short by a crash and
//! played again after a resume is counted once.

use std::collections::{BTreeMap, VecDeque};

use evalfleet_types::ItemStatus;
use serde::Serialize;
use serde_json::{Value, json};

use super::stats::{self, Estimate};
use crate::config::{AlarmSettings, ConversationSettings};
use crate::eval::balance::entropy_bits;
use crate::store::{Store, StoreError};

/// Names of the strategies in reports, `invalid` last.
pub const CHOICES: [&str; 5] = ["validate", "bridge", "plan", "no_intervention", "invalid"];

/// A conversation run's totals.
#[derive(Debug, Clone, Serialize)]
pub struct ConversationReport {
    pub episodes: u64,
    pub failed: u64,
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
/// decisions, one condition began to hold.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Alarm {
    /// Decisions of the run so far (in dataset order).
    pub decisions: u64,
    pub episode: String,
    pub step: u64,
    pub message: String,
}

/// The decisions of the last `window`, and which alarms hold.
struct Watch {
    settings: AlarmSettings,
    recent: VecDeque<usize>,
    counts: [u64; 5],
    /// Strategies seen in the run (so that one can vanish).
    seen: [bool; 5],
    holding: BTreeMap<&'static str, bool>,
    decisions: u64,
}

impl Watch {
    fn new(settings: AlarmSettings) -> Self {
        Self {
            settings,
            recent: VecDeque::new(),
            counts: [0; 5],
            seen: [false; 5],
            holding: BTreeMap::new(),
            decisions: 0,
        }
    }

    /// One decision (`choice`: an index of [`CHOICES`]); the alarms that
    /// begin to hold with it.
    fn decide(&mut self, choice: usize) -> Vec<String> {
        self.decisions += 1;
        self.recent.push_back(choice);
        self.counts[choice] += 1;
        self.seen[choice] = true;
        if self.recent.len() > self.settings.window as usize
            && let Some(old) = self.recent.pop_front()
        {
            self.counts[old] -= 1;
        }
        if self.recent.len() < self.settings.window as usize {
            return Vec::new();
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
        let vanished: Vec<&str> = (0..4)
            .filter(|&i| self.seen[i] && valid[i] == 0)
            .map(|i| CHOICES[i])
            .collect();
        now.push((
            "vanished",
            (!vanished.is_empty()).then(|| {
                format!(
                    "policy collapse: {} no longer chosen in the last {} decisions",
                    vanished.join(", "),
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
        let mut began = Vec::new();
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

/// Reads the run's episodes: each step goes to `step_line` (with its
/// episode's id), each batch of `batch_size` episodes to `batch_line`.
pub fn scan(
    store: &mut dyn Store,
    run_id: &str,
    settings: &ConversationSettings,
    step_line: &mut dyn FnMut(&Value),
    batch_line: &mut dyn FnMut(&Value),
) -> Result<ConversationReport, StoreError> {
    let mut watch = Watch::new(settings.alarms);
    let mut alarms = Vec::new();
    let mut rewards = Vec::new();
    let mut failed = 0u64;
    let mut strategies = [0u64; 5];
    let mut steps_total = 0u64;
    let mut stabilised = 0u64;
    let mut matched = 0u64;
    let mut interventions = 0u64;
    let mut batch = Batch::default();
    let mut batches = 0u64;
    let batch_size = u64::from(settings.batch_size.max(1));
    store.scan_results(run_id, &mut |result| {
        if result.status != ItemStatus::Done {
            if result.status == ItemStatus::Failed {
                failed += 1;
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
        let steps = summary
            .get("steps")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let mut episode_reward = 0.0;
        for step in &steps {
            let choice = choice_of(step);
            strategies[choice] += 1;
            batch.strategies[choice] += 1;
            let reward = &step["reward"];
            let total = reward["total"].as_f64().unwrap_or(0.0);
            episode_reward += total;
            batch.reward += total;
            if reward["stable_bonus"].as_f64().unwrap_or(0.0) > 0.0 {
                stabilised += 1;
            }
            if reward["preference_match_bonus"].as_f64().unwrap_or(0.0) > 0.0 {
                matched += 1;
            }
            if choice < 3 {
                interventions += 1;
                batch.interventions += 1;
            }
            steps_total += 1;
            for message in watch.decide(choice) {
                alarms.push(Alarm {
                    decisions: watch.decisions,
                    episode: result.item_id.clone(),
                    step: step["step"].as_u64().unwrap_or(0),
                    message,
                });
            }
            let mut line = json!({"episode": result.item_id});
            if let (Some(line), Some(step)) = (line.as_object_mut(), step.as_object()) {
                line.extend(step.clone());
            }
            step_line(&line);
        }
        rewards.push(episode_reward);
        batch.episodes += 1;
        batch.steps += steps.len() as u64;
        if batch.episodes == batch_size {
            batch_line(&batch.line(batches));
            batches += 1;
            batch = Batch::default();
        }
    })?;
    if batch.episodes > 0 {
        batch_line(&batch.line(batches));
    }
    let steps = steps_total.max(1) as f64;
    Ok(ConversationReport {
        episodes: rewards.len() as u64,
        failed,
        steps: steps_total,
        total_reward: rewards.iter().sum(),
        reward_per_episode: stats::estimate(&stats::Moments::of(&rewards)),
        interventions,
        strategies: CHOICES
            .iter()
            .zip(strategies)
            .map(|(c, n)| ((*c).to_owned(), n))
            .collect(),
        entropy_bits: entropy_bits(&strategies[..4]),
        stabilisation_rate: stabilised as f64 / steps,
        preference_match_rate: matched as f64 / steps,
        alarms,
    })
}

#[derive(Default)]
struct Batch {
    episodes: u64,
    steps: u64,
    strategies: [u64; 5],
    reward: f64,
    interventions: u64,
}

impl Batch {
    fn line(&self, index: u64) -> Value {
        let distribution: serde_json::Map<String, Value> = CHOICES
            .iter()
            .zip(self.strategies)
            .map(|(c, n)| ((*c).to_owned(), json!(n)))
            .collect();
        json!({
            "batch": index,
            "episodes": self.episodes,
            "steps": self.steps,
            "strategy_distribution": distribution,
            "entropy_bits": entropy_bits(&self.strategies[..4]),
            "total_reward": self.reward,
            "interventions": self.interventions,
        })
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
        // 1,2,3,1 -> validate vanished.
        let began = w.decide(1);
        assert_eq!(began.len(), 1, "{began:?}");
        assert!(began[0].contains("validate no longer chosen"), "{began:?}");
        // Still vanished: not again.
        assert!(w.decide(1).iter().all(|m| !m.contains("vanished")));
        // 3,1,1,1 then 1,1,1,1: entropy falls, then one strategy is all.
        let mut all = Vec::new();
        for _ in 0..3 {
            all.extend(w.decide(1));
        }
        assert!(all.iter().any(|m| m.contains("entropy")), "{all:?}");
        assert!(all.iter().any(|m| m.contains("bridge is 100%")), "{all:?}");
    }
}
