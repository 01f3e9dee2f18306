//! The logs of `rules: original` in the original trainer's own shape
//! (`ppo_train.py` `TrainingRunLogger`, `batch_summary.py`
//! `BatchSummaryCollector`), so that its analysis scripts
//! (`analyze_four_strategies.py` and the like) read them:
//! `conversation_summary.jsonl` holds a record per decision and per
//! episode a stable step ended, `batch_summary.jsonl` a record per
//! `batch_size` decisions; each record is JSON indented by two spaces,
//! its floats rounded as the original rounds them, followed by a line of
//! 80 `=`. The records come from the episodes' `original_log` (what the
//! environment saw); the interaction ids, episode numbers and timestamps
//! are given here, in the order the episodes are followed.

use serde_json::Value;

use super::python_float;

/// What ends each record.
pub const SEPARATOR: &str =
    "================================================================================";

/// Follows episodes into the original's records.
pub struct OriginalLog {
    batch_size: u64,
    interactions: u64,
    episodes: u64,
    batches: u64,
    collector: Collector,
}

/// `BatchSummaryCollector`'s counts of the batch under way.
#[derive(Default)]
struct Collector {
    decisions: u64,
    total_reward: f64,
    interventions: u64,
    no_intervention: u64,
    output_errors: u64,
    /// In the order each was first seen.
    counts: Vec<(String, u64)>,
}

/// Which of the two files a record goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum File {
    ConversationSummary,
    BatchSummary,
}

impl OriginalLog {
    /// `batch_size`: decisions per batch record (the original's
    /// per_device_train_batch_size × grad_accum_steps × 2).
    pub fn new(batch_size: u64) -> Self {
        Self {
            batch_size: batch_size.max(1),
            interactions: 0,
            episodes: 0,
            batches: 0,
            collector: Collector::default(),
        }
    }

    /// The records of an episode's `original_log`, at `timestamp`.
    pub fn episode(&mut self, summary: &Value, timestamp: &str, out: &mut dyn FnMut(File, String)) {
        let Some(records) = summary.get("original_log").and_then(Value::as_array) else {
            return;
        };
        self.episodes += 1;
        for record in records {
            self.interactions += 1;
            let skipped = record.get("skipped").is_some();
            if !skipped {
                self.collector.decide(record);
                if self.collector.decisions >= self.batch_size {
                    self.batches += 1;
                    let batch =
                        std::mem::take(&mut self.collector).summary(self.batches, self.batch_size);
                    let line = Node::Obj(vec![
                        ("batch_summary".to_owned(), batch),
                        ("episode".to_owned(), Node::Leaf(Value::from(self.episodes))),
                        (
                            "step".to_owned(),
                            Node::Leaf(Value::from(self.interactions)),
                        ),
                        ("timestamp".to_owned(), Node::Leaf(Value::from(timestamp))),
                    ]);
                    out(File::BatchSummary, line.record());
                }
            }
            let mut entries = vec![
                (
                    "interaction_id".to_owned(),
                    Node::Leaf(Value::from(self.interactions)),
                ),
                ("episode".to_owned(), Node::Leaf(Value::from(self.episodes))),
            ];
            if let Value::Object(map) = record {
                let order = if skipped { STABLE_END } else { DECISION };
                entries.extend(ordered(map, order).into_iter().map(|(k, v)| {
                    let node = Node::of(v, k);
                    (k.to_owned(), node)
                }));
            }
            entries.push(("timestamp".to_owned(), Node::Leaf(Value::from(timestamp))));
            out(File::ConversationSummary, Node::Obj(entries).record());
        }
    }
}

impl Collector {
    /// `add_decision` and `add_reward` of one decision's record.
    fn decide(&mut self, record: &Value) {
        self.decisions += 1;
        self.total_reward += record["reward"]["total"].as_f64().unwrap_or(0.0);
        let choice = record
            .get("decision")
            .and_then(Value::as_str)
            .unwrap_or("output_error");
        match choice {
            "output_error" => self.output_errors += 1,
            "no_intervention" => self.no_intervention += 1,
            _ => self.interventions += 1,
        }
        match self.counts.iter_mut().find(|(c, _)| c == choice) {
            Some((_, n)) => *n += 1,
            None => self.counts.push((choice.to_owned(), 1)),
        }
    }

    /// `get_summary`: its entropy counts every choice, output errors too.
    fn summary(self, id: u64, size: u64) -> Node {
        let total: u64 = self.counts.iter().map(|(_, n)| n).sum();
        let entropy = if total == 0 {
            0.0
        } else {
            self.counts
                .iter()
                .filter(|(_, n)| *n > 0)
                .map(|(_, n)| {
                    let p = *n as f64 / total as f64;
                    -p * p.log2()
                })
                .sum::<f64>()
        };
        let leaf = |v: Value| Node::Leaf(v);
        Node::Obj(vec![
            ("batch_id".to_owned(), leaf(Value::from(id))),
            ("batch_size".to_owned(), leaf(Value::from(size))),
            (
                "total_reward".to_owned(),
                leaf(Value::from(self.total_reward)),
            ),
            (
                "total_interventions".to_owned(),
                leaf(Value::from(self.interventions)),
            ),
            (
                "no_intervention_count".to_owned(),
                leaf(Value::from(self.no_intervention)),
            ),
            (
                "output_error_count".to_owned(),
                leaf(Value::from(self.output_errors)),
            ),
            (
                "choice_entropy".to_owned(),
                Node::Obj(vec![("strategy".to_owned(), leaf(Value::from(entropy)))]),
            ),
            (
                "strategy_counts".to_owned(),
                Node::Obj(
                    self.counts
                        .into_iter()
                        .map(|(c, n)| (c, leaf(Value::from(n))))
                        .collect(),
                ),
            ),
        ])
    }
}

/// The order of a decision's record (reward_fn builds it so).
const DECISION: &[&str] = &[
    "turn",
    "done",
    "episode_info",
    "emotional_needs",
    "initial_conversation",
    "human_utterances",
    "relation",
    "intervention",
    "relations_after_horizon",
    "reward",
    "target_speaker",
    "chosen_strategy",
    "preferred_strategy",
    "preference_match",
    "edge_to_change",
    "target_edge_score_after",
    "target_edge_positive_after",
    "episode_summary",
];

/// The order of the record of an episode a stable step ended.
const STABLE_END: &[&str] = &[
    "turn",
    "skipped",
    "reason",
    "done",
    "human_utterances",
    "relation",
];

/// The order of the objects inside a record, by their key.
fn order_of(key: &str) -> &'static [&'static str] {
    match key {
        "episode_info" => &[
            "topic",
            "selected_trigger",
            "personas_with_trigger",
            "speaker_aggressiveness",
        ],
        "relation" | "relations_after_horizon" => &["is_stable", "edges", "debug_note"],
        "intervention" => &[
            "intervened",
            "robot_utterance",
            "intervene_now",
            "strategy",
            "edge_to_change",
            "target_speaker",
            "llm_raw_output",
            "utterances_after_intervention",
            "human_utterances",
        ],
        "reward" => &["total", "breakdown"],
        "initial_conversation" | "human_utterances" | "utterances_after_intervention" => {
            &["speaker", "utterance"]
        }
        "episode_summary" => &[
            "total_reward",
            "total_interventions",
            "unstable_no_intervention",
            "plan_errors",
        ],
        _ => &[],
    }
}

/// The entries of `map` in `order`, then the others by name; `decision`
/// (the writer's own mark) left out.
fn ordered<'a>(
    map: &'a serde_json::Map<String, Value>,
    order: &[&str],
) -> Vec<(&'a str, &'a Value)> {
    let mut out: Vec<(&str, &Value)> = order
        .iter()
        .filter_map(|k| map.get_key_value(*k).map(|(k, v)| (k.as_str(), v)))
        .collect();
    for (k, v) in map {
        if !order.contains(&k.as_str()) && k != "decision" {
            out.push((k.as_str(), v));
        }
    }
    out
}

/// A record's value with its keys in the original's order.
enum Node {
    Obj(Vec<(String, Node)>),
    Arr(Vec<Node>),
    Leaf(Value),
}

impl Node {
    /// `value`, the value of `key`.
    fn of(value: &Value, key: &str) -> Node {
        match value {
            Value::Object(map) => Node::Obj(
                ordered(map, order_of(key))
                    .into_iter()
                    .map(|(k, v)| (k.to_owned(), Node::of(v, k)))
                    .collect(),
            ),
            Value::Array(items) => Node::Arr(items.iter().map(|v| Node::of(v, key)).collect()),
            other => Node::Leaf(other.clone()),
        }
    }

    /// The record as `TrainingRunLogger._write_jsonl` writes it:
    /// `json.dumps(..., ensure_ascii=False, indent=2)`, then the
    /// separator line.
    fn record(&self) -> String {
        let mut out = String::new();
        self.write(&mut out, 0);
        out.push('\n');
        out.push_str(SEPARATOR);
        out.push('\n');
        out
    }

    fn write(&self, out: &mut String, level: usize) {
        // An object's entries and an array's items, each on its line.
        let container =
            |out: &mut String, (open, close): (char, char), items: Vec<(Option<&str>, &Node)>| {
                if items.is_empty() {
                    out.push(open);
                    out.push(close);
                    return;
                }
                out.push(open);
                out.push('\n');
                let last = items.len() - 1;
                for (i, (key, node)) in items.into_iter().enumerate() {
                    out.push_str(&"  ".repeat(level + 1));
                    if let Some(key) = key {
                        out.push_str(&Value::from(key).to_string());
                        out.push_str(": ");
                    }
                    node.write(out, level + 1);
                    if i < last {
                        out.push(',');
                    }
                    out.push('\n');
                }
                out.push_str(&"  ".repeat(level));
                out.push(close);
            };
        match self {
            Node::Obj(entries) => container(
                out,
                ('{', '}'),
                entries.iter().map(|(k, v)| (Some(k.as_str()), v)).collect(),
            ),
            Node::Arr(items) => {
                container(out, ('[', ']'), items.iter().map(|v| (None, v)).collect())
            }
            Node::Leaf(Value::Number(n)) if n.is_f64() => {
                out.push_str(&python_float(round_float(n.as_f64().unwrap_or(0.0))));
            }
            Node::Leaf(v) => out.push_str(&v.to_string()),
        }
    }
}

/// `TrainingRunLogger._round_float`: digits by magnitude (0 from 1000, 1
/// from 100, 2 from 10, 3 from 1, else 4), -0.0 as 0.0.
pub fn round_float(value: f64) -> f64 {
    if !value.is_finite() {
        return value;
    }
    let magnitude = value.abs();
    if magnitude == 0.0 {
        return 0.0;
    }
    let digits = match magnitude {
        m if m >= 1000.0 => 0,
        m if m >= 100.0 => 1,
        m if m >= 10.0 => 2,
        m if m >= 1.0 => 3,
        _ => 4,
    };
    let rounded: f64 = format!("{value:.digits$}").parse().unwrap_or(value);
    if rounded == 0.0 { 0.0 } else { rounded }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn floats_round_as_the_original_logger_rounds_them() {
        // Python: [round(x, d) for ...] as _round_float picks d.
        assert_eq!(round_float(0.123_456_78), 0.1235);
        assert_eq!(round_float(2.345_67), 2.346);
        assert_eq!(round_float(-12.3456), -12.35);
        assert_eq!(round_float(123.456), 123.5);
        assert_eq!(round_float(1234.5), 1234.0);
        assert_eq!(round_float(-0.000_01), 0.0);
        assert_eq!(round_float(0.000_05), 0.0001);
    }

    #[test]
    fn records_are_indented_and_separated_as_the_originals() {
        let mut log = OriginalLog::new(2);
        let summary = json!({"original_log": [
            {"turn": 1, "done": false, "decision": "bridge",
             "relation": {"edges": {"A,B": -0.4}, "is_stable": false},
             "reward": {"breakdown": {}, "total": 0.5}},
            {"turn": 2, "done": true, "decision": "output_error",
             "relation": {"edges": {}, "is_stable": true},
             "reward": {"breakdown": {"output_errorペナルティ": -1.0}, "total": -1.0}},
        ]});
        let mut written: Vec<(File, String)> = Vec::new();
        log.episode(&summary, "2026-12-06T04:00:00Z", &mut |f, t| {
            written.push((f, t))
        });
        assert_eq!(written.len(), 3);
        assert_eq!(written[0].0, File::ConversationSummary);
        assert_eq!(
            written[0].1,
            "{\n  \"interaction_id\": 1,\n  \"episode\": 1,\n  \"turn\": 1,\n  \"done\": false,\n  \"relation\": {\n    \"is_stable\": false,\n    \"edges\": {\n      \"A,B\": -0.4\n    }\n  },\n  \"reward\": {\n    \"total\": 0.5,\n    \"breakdown\": {}\n  },\n  \"timestamp\": \"2026-12-06T04:00:00Z\"\n}\n".to_owned()
                + SEPARATOR
                + "\n"
        );
        // The batch is written before the decision that fills it.
        assert_eq!(written[1].0, File::BatchSummary);
        let batch: Value =
            serde_json::from_str(written[1].1.trim_end().trim_end_matches('=')).unwrap();
        assert_eq!(
            batch,
            json!({"batch_summary": {"batch_id": 1, "batch_size": 2, "total_reward": -0.5,
                   "total_interventions": 1, "no_intervention_count": 0, "output_error_count": 1,
                   "choice_entropy": {"strategy": 1.0},
                   "strategy_counts": {"bridge": 1, "output_error": 1}},
                   "episode": 1, "step": 2, "timestamp": "2026-12-06T04:00:00Z"})
        );
        assert!(written[1].1.contains(
            "\"strategy_counts\": {\n      \"bridge\": 1,\n      \"output_error\": 1\n    }"
        ));
        assert_eq!(written[2].0, File::ConversationSummary);
        assert!(
            written[2].1.contains("\"output_errorペナルティ\": -1.0"),
            "{}",
            written[2].1
        );
    }
}
