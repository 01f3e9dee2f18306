//! What a run (or a bench cell) came to, counted once: complete, when every
//! item has a usable, scored answer; incomplete, when some item failed, has
//! an answer that could not be used, was not scored, or has not run; failed,
//! when no item was answered at all. With it, why: the causes, each with
//! how many items it took and one example, the most common first. Every
//! surface (the run's last lines, `status`, `report`, `compare`, `bench`,
//! the dashboard and API, Prometheus, the sheet) shows this one value.

use serde::Serialize;

use evalfleet_store::StoredResult;
use evalfleet_types::{ItemStatus, Verdict};

use crate::metrics::shape_of;

/// A run's outcome in a word.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum OutcomeKind {
    /// Every item has a usable, scored answer.
    Complete,
    /// Some item failed, has an unusable answer, was not scored, or has
    /// not run: its numbers are over fewer items than the run has.
    Incomplete,
    /// No item was answered: there are no numbers.
    Failed,
}

impl OutcomeKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Complete => "complete",
            Self::Incomplete => "incomplete",
            Self::Failed => "failed",
        }
    }
}

impl std::fmt::Display for OutcomeKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What kept an item from a usable, scored answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum CauseKind {
    /// No answer: its calls failed (the reason says how).
    Failed,
    /// An answer `task.parse` could not read, re-asks included.
    Unparsed,
    /// An answer not of `task.schema`, re-asks included.
    Invalid,
    /// A usable answer a metric could not score (a judge that could not
    /// be reached, no usable reference).
    NotScored,
    /// Not run yet (the run stopped before it).
    Pending,
}

impl CauseKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Failed => "failed",
            Self::Unparsed => "unparsed",
            Self::Invalid => "invalid",
            Self::NotScored => "not scored",
            Self::Pending => "pending",
        }
    }
}

/// One cause: how many items it took, and one of them.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Cause {
    pub cause: CauseKind,
    /// In words: the server's answer, the metric and its reason, ... (the
    /// first item's words; the others had words of the same shape).
    pub reason: String,
    pub count: u64,
    /// The id of one item it took (empty for pending items).
    pub example: String,
    /// The metric that could not score (a `not_scored` cause's key).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metric: Option<String>,
    #[serde(skip)]
    shape: String,
}

/// A run's outcome, with its counts and causes.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Outcome {
    pub outcome: OutcomeKind,
    /// Items in the run.
    pub items: u64,
    /// Items with an answer (usable or not).
    pub answered: u64,
    /// Items with a usable answer every metric scored.
    pub scored: u64,
    pub failed: u64,
    pub unusable: u64,
    pub not_scored: u64,
    pub pending: u64,
    /// Why items are not scored, the most items first; at most
    /// [`Outcome::CAUSES`] of them, the rest counted in `other_causes`.
    pub causes: Vec<Cause>,
    #[serde(skip_serializing_if = "is_zero")]
    pub other_causes: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The words of a failed item's error worth grouping by: without the
/// retries' preamble (`gave up after 10 attempts: `), which says how long
/// it was tried, not why it failed.
fn failure_reason(error: Option<&str>) -> &str {
    let Some(error) = error else {
        return "it failed without a recorded reason";
    };
    match error.strip_prefix("gave up after ") {
        Some(rest) => rest.split_once(": ").map_or(error, |(_, why)| why),
        None => error,
    }
}

/// A reason cut to a line of at most `MAX` characters.
fn one_line(text: &str) -> String {
    const MAX: usize = 300;
    let line = text.lines().next().unwrap_or_default().trim();
    if line.chars().count() <= MAX {
        line.to_owned()
    } else {
        let cut: String = line.chars().take(MAX).collect();
        format!("{cut}…")
    }
}

impl Outcome {
    /// Distinct causes kept.
    pub const CAUSES: usize = 8;

    /// An outcome of `items` items, before any result is counted.
    pub fn counting(items: u64) -> OutcomeCounter {
        OutcomeCounter {
            outcome: Outcome {
                outcome: OutcomeKind::Complete,
                items,
                answered: 0,
                scored: 0,
                failed: 0,
                unusable: 0,
                not_scored: 0,
                pending: 0,
                causes: Vec::new(),
                other_causes: 0,
            },
            counted: 0,
        }
    }

    pub fn is_complete(&self) -> bool {
        self.outcome == OutcomeKind::Complete
    }

    /// In a line: `complete: 10 of 10 items scored`, `incomplete: 7 of 10
    /// items scored (3 failed)`, `failed: 0 of 5 items answered`.
    pub fn line(&self) -> String {
        match self.outcome {
            OutcomeKind::Failed => {
                format!("failed: 0 of {} items answered{}", self.items, self.parts())
            }
            _ => format!(
                "{}: {} of {} items scored{}",
                self.outcome,
                self.scored,
                self.items,
                self.parts()
            ),
        }
    }

    /// ` (3 failed, 1 unusable, 2 pending)`, or nothing.
    fn parts(&self) -> String {
        let parts: Vec<String> = [
            (self.failed, "failed"),
            (self.unusable, "unusable"),
            (self.not_scored, "not scored"),
            (self.pending, "pending"),
        ]
        .iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, what)| format!("{n} {what}"))
        .collect();
        if parts.is_empty() {
            String::new()
        } else {
            format!(" ({})", parts.join(", "))
        }
    }

    /// The causes, a line each: `5 × failed: HTTP 404: model 'x' does not
    /// exist (e.g. item q-3)`.
    pub fn cause_lines(&self) -> Vec<String> {
        let mut lines: Vec<String> = self
            .causes
            .iter()
            .map(|c| {
                let example = if c.example.is_empty() {
                    String::new()
                } else {
                    format!(" (e.g. item {})", c.example)
                };
                format!("{} × {}: {}{example}", c.count, c.cause.as_str(), c.reason)
            })
            .collect();
        if self.other_causes > 0 {
            lines.push(format!("{} × other causes", self.other_causes));
        }
        lines
    }
}

/// Counts results into an [`Outcome`].
pub struct OutcomeCounter {
    outcome: Outcome,
    counted: u64,
}

impl OutcomeCounter {
    fn cause(&mut self, cause: CauseKind, reason: &str, example: &str, metric: Option<&str>) {
        let reason = one_line(reason);
        let shape = shape_of(&reason);
        let causes = &mut self.outcome.causes;
        if let Some(known) = causes
            .iter_mut()
            .find(|c| c.cause == cause && c.shape == shape)
        {
            known.count += 1;
        } else if causes.len() < Outcome::CAUSES {
            causes.push(Cause {
                cause,
                reason,
                count: 1,
                example: example.to_owned(),
                metric: metric.map(str::to_owned),
                shape,
            });
        } else {
            self.outcome.other_causes += 1;
        }
    }

    /// Counts one item's result; `metrics`: the keys of the task's metrics,
    /// each of which must score a usable answer.
    pub fn add(&mut self, result: &StoredResult, metrics: &[&str]) {
        self.counted += 1;
        let id = result.item_id.as_str();
        if result.status == ItemStatus::Failed {
            self.outcome.failed += 1;
            self.cause(
                CauseKind::Failed,
                failure_reason(result.error.as_deref()),
                id,
                None,
            );
            return;
        }
        self.outcome.answered += 1;
        let a = &result.assessment;
        match a.verdict {
            Some(Verdict::Unparsed) | Some(Verdict::Invalid) => {
                self.outcome.unusable += 1;
                let (kind, default) = if a.verdict == Some(Verdict::Unparsed) {
                    (CauseKind::Unparsed, "the answer could not be parsed")
                } else {
                    (CauseKind::Invalid, "the answer is not of the task's schema")
                };
                self.cause(kind, a.check_error.as_deref().unwrap_or(default), id, None);
                return;
            }
            _ => {}
        }
        let unscored = metrics.iter().find_map(|key| match a.scores.get(*key) {
            Some(score) if score.value.is_some() => None,
            Some(score) => Some((*key, score.error.as_deref())),
            None => Some((*key, None)),
        });
        match unscored {
            Some((key, error)) => {
                self.outcome.not_scored += 1;
                let why = error.unwrap_or("no score was stored for it");
                self.cause(
                    CauseKind::NotScored,
                    &format!("{key}: {why}"),
                    id,
                    Some(key),
                );
            }
            None => self.outcome.scored += 1,
        }
    }

    /// The outcome, items not counted being pending.
    pub fn finish(mut self) -> Outcome {
        let o = &mut self.outcome;
        o.pending = o.items.saturating_sub(self.counted);
        if o.pending > 0 {
            let pending = o.pending;
            let cause = Cause {
                cause: CauseKind::Pending,
                reason: "not run yet (resume the run to run it)".to_owned(),
                count: pending,
                example: String::new(),
                metric: None,
                shape: String::new(),
            };
            o.causes.push(cause);
        }
        // Why items failed or are not scored first, the most items first;
        // items not yet run last.
        o.causes.sort_by(|a, b| {
            (a.cause == CauseKind::Pending)
                .cmp(&(b.cause == CauseKind::Pending))
                .then(b.count.cmp(&a.count))
                .then(a.cause.cmp(&b.cause))
        });
        o.outcome = if o.answered == 0 && o.items > 0 && o.pending < o.items {
            OutcomeKind::Failed
        } else if o.scored == o.items {
            OutcomeKind::Complete
        } else {
            OutcomeKind::Incomplete
        };
        self.outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use evalfleet_types::{Assessment, Score};

    fn result(id: &str, status: ItemStatus, error: Option<&str>) -> StoredResult {
        StoredResult {
            seq: 0,
            item_id: id.to_owned(),
            status,
            output: None,
            endpoint: None,
            model: None,
            item: None,
            assessment: Assessment::default(),
            failure: None,
            prompt: None,
            error: error.map(str::to_owned),
        }
    }

    fn scored(id: &str, value: Option<f64>, error: Option<&str>) -> StoredResult {
        let mut r = result(id, ItemStatus::Done, None);
        r.assessment.verdict = Some(Verdict::Ok);
        r.assessment.scores.insert(
            "exact_match".to_owned(),
            Score {
                value,
                error: error.map(str::to_owned),
                ..Score::default()
            },
        );
        r
    }

    #[test]
    fn every_item_scored_is_complete_and_has_no_causes() {
        let mut counter = Outcome::counting(2);
        counter.add(&scored("a", Some(1.0), None), &["exact_match"]);
        counter.add(&scored("b", Some(0.0), None), &["exact_match"]);
        let outcome = counter.finish();
        assert_eq!(outcome.outcome, OutcomeKind::Complete);
        assert_eq!(outcome.scored, 2);
        assert!(outcome.causes.is_empty());
        assert_eq!(outcome.line(), "complete: 2 of 2 items scored");
    }

    #[test]
    fn no_item_answered_is_failed_with_the_server_s_words_grouped_once() {
        let mut counter = Outcome::counting(5);
        for i in 0..5 {
            counter.add(
                &result(
                    &format!("q{i}"),
                    ItemStatus::Failed,
                    Some("HTTP 404: The model 'gpt-x' does not exist"),
                ),
                &["exact_match"],
            );
        }
        let outcome = counter.finish();
        assert_eq!(outcome.outcome, OutcomeKind::Failed);
        assert_eq!(outcome.line(), "failed: 0 of 5 items answered (5 failed)");
        assert_eq!(
            outcome.cause_lines(),
            ["5 × failed: HTTP 404: The model 'gpt-x' does not exist (e.g. item q0)"]
        );
    }

    #[test]
    fn retries_preamble_is_left_out_and_causes_are_most_first() {
        let mut counter = Outcome::counting(6);
        counter.add(&scored("a", Some(1.0), None), &["exact_match"]);
        counter.add(
            &scored("b", None, Some("the judge server could not be reached")),
            &["exact_match"],
        );
        for id in ["c", "d"] {
            counter.add(
                &result(
                    id,
                    ItemStatus::Failed,
                    Some("gave up after 10 attempts: HTTP 503: busy"),
                ),
                &["exact_match"],
            );
        }
        let outcome = counter.finish();
        assert_eq!(outcome.outcome, OutcomeKind::Incomplete);
        assert_eq!(
            outcome.line(),
            "incomplete: 1 of 6 items scored (2 failed, 1 not scored, 2 pending)"
        );
        let lines = outcome.cause_lines();
        assert_eq!(lines[0], "2 × failed: HTTP 503: busy (e.g. item c)");
        assert_eq!(
            lines[1],
            "1 × not scored: exact_match: the judge server could not be reached (e.g. item b)"
        );
        assert_eq!(
            lines[2],
            "2 × pending: not run yet (resume the run to run it)"
        );
    }

    #[test]
    fn an_unusable_answer_keeps_a_run_incomplete() {
        let mut counter = Outcome::counting(2);
        counter.add(&scored("a", Some(1.0), None), &["exact_match"]);
        let mut bad = result("b", ItemStatus::Done, None);
        bad.assessment.verdict = Some(Verdict::Unparsed);
        bad.assessment.check_error = Some("no JSON object in the answer".to_owned());
        counter.add(&bad, &["exact_match"]);
        let outcome = counter.finish();
        assert_eq!(outcome.outcome, OutcomeKind::Incomplete);
        assert_eq!(outcome.unusable, 1);
        assert_eq!(
            outcome.cause_lines(),
            ["1 × unparsed: no JSON object in the answer (e.g. item b)"]
        );
    }

    #[test]
    fn a_run_not_yet_started_is_incomplete_not_failed() {
        let outcome = Outcome::counting(3).finish();
        assert_eq!(outcome.outcome, OutcomeKind::Incomplete);
        assert_eq!(outcome.pending, 3);
    }
}
