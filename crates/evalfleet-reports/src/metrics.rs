//! Each metric's figures over a group of items, accumulated one result at a
//! time: the mean over every item (an item with no score counting as the
//! worst) with its uncertainty, the mean over the scored ones, the items
//! that could not be scored and why, and what the metric adds (pooled error
//! rates, precision and recall of fields, a confusion matrix).

use std::collections::BTreeMap;

use evalfleet_types::{Score, Scores, Verdict};
use serde::Serialize;

use super::stats::{self, Estimate, Moments};
use evalfleet_eval::metrics::{Kind, Metric};

/// One item as aggregation sees it.
#[derive(Debug, Clone, Copy)]
pub struct Row<'a> {
    /// The call failed (no answer).
    pub failed: bool,
    /// It failed for the server's sake ([`super::lost`]): in no mean.
    pub lost: bool,
    /// Done items' verdicts.
    pub verdict: Option<Verdict>,
    pub scores: &'a Scores,
}

/// A metric over a group of items.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Summary {
    pub metric: String,
    pub group: String,
    /// Items in the group.
    pub n: u64,
    /// Items with a score.
    pub scored: u64,
    pub failed: u64,
    /// Of `failed`, the items that failed for the server's sake (refused,
    /// cut, timed out, its own errors): they say nothing of the model, and
    /// are in no mean.
    pub lost: u64,
    pub unparsed: u64,
    pub invalid: u64,
    /// Items with a usable answer that the metric could not score (no
    /// usable reference, a judge that failed): they are in no mean.
    pub errors: u64,
    /// Why, the first distinct reasons with how many items each.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub reasons: Vec<Reason>,
    /// Items not scored for reasons beyond those listed.
    #[serde(skip_serializing_if = "is_zero")]
    pub other_reasons: u64,
    /// `scored`, `partly scored` (some items could not be scored), `not
    /// scored` (none could) or `no answers` (no item was answered: there is
    /// no score, see [`Summary::value_text`]).
    pub status: &'static str,
    /// Over the `n − errors − lost` items the metric could judge, one
    /// without a usable answer (failed for the model's sake, unparsed,
    /// invalid) counting as the worst score (0, or 1 for error rates).
    #[serde(flatten)]
    pub estimate: Estimate,
    /// Over the scored items only.
    pub mean_scored: f64,
    pub higher_is_better: bool,
    /// What the metric adds.
    pub extra: Extra,
}

/// A reason items could not be scored: the first item's words, and how
/// many items had a reason of that shape (the same words but for what is
/// quoted: `the reference '…' has no number`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Reason {
    pub reason: String,
    pub count: u64,
    #[serde(skip)]
    shape: String,
}

/// `reason` with what it quotes left out, so that reasons about different
/// items compare equal. A quote opens after a space (or at the start) and
/// closes before a space, punctuation or the end, so that an apostrophe
/// inside a quoted text (`'it's'`) does not end it.
pub(crate) fn shape_of(reason: &str) -> String {
    let chars: Vec<char> = reason.chars().collect();
    let mut out = String::with_capacity(reason.len());
    let mut quoted = false;
    for (i, &c) in chars.iter().enumerate() {
        let before = i.checked_sub(1).map(|j| chars[j]);
        let after = chars.get(i + 1).copied();
        if c == '\'' && !quoted && before.is_none_or(|b| b.is_whitespace() || b == '(') {
            out.push_str("'…'");
            quoted = true;
        } else if c == '\''
            && quoted
            && after.is_none_or(|a| a.is_whitespace() || ",.;:)".contains(a))
        {
            quoted = false;
        } else if !quoted {
            out.push(c);
        }
    }
    out
}

/// A metric's status when no item of its group was answered: it has no
/// score (not the worst one).
pub const NO_ANSWERS: &str = "no answers";

/// Distinct reasons kept per metric and group.
const REASONS: usize = 3;

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Summary {
    /// The share of the items it could judge that it could not score.
    pub fn unscored_share(&self) -> f64 {
        let judged = self.scored + self.errors;
        if judged == 0 {
            0.0
        } else {
            self.errors as f64 / judged as f64
        }
    }

    /// Whether it has a value to show: some item was scored, or answered
    /// and counted at the worst value.
    pub fn has_value(&self) -> bool {
        self.status != NO_ANSWERS && self.status != "not scored"
    }

    /// Its mean with `decimals`, or why there is none: `no score: 0 of 5
    /// answered`, `not scored`.
    pub fn value_text(&self, decimals: usize) -> String {
        match self.status {
            NO_ANSWERS => format!("no score: 0 of {} answered", self.n),
            "not scored" => "not scored".to_owned(),
            _ => format!("{:.decimals$}", self.estimate.mean),
        }
    }

    /// Why items could not be scored, in one line: `3 × no number; 1 × …`.
    pub fn reasons_line(&self) -> String {
        let mut parts: Vec<String> = self
            .reasons
            .iter()
            .map(|r| format!("{} × {}", r.count, r.reason))
            .collect();
        if self.other_reasons > 0 {
            parts.push(format!("{} × other reasons", self.other_reasons));
        }
        parts.join("; ")
    }
}

/// What a metric adds to its mean.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
#[serde(untagged)]
pub enum Extra {
    /// Nothing.
    None,
    /// CER and WER: edits over reference length, pooled over the items.
    Pooled {
        pooled: f64,
        edits: u64,
        reference_length: u64,
    },
    /// JSON fields: micro precision, recall and F1 over keys.
    Fields {
        precision: f64,
        recall: f64,
        f1: f64,
    },
    /// Classification: per class, macro and micro figures, and the
    /// confusion matrix (reference → predicted → count).
    Classes {
        per_class: BTreeMap<String, ClassFigures>,
        #[serde(rename = "macro")]
        macro_avg: Figures,
        micro: Figures,
        confusion: BTreeMap<String, BTreeMap<String, u64>>,
    },
}

impl Extra {
    pub fn is_none(&self) -> bool {
        *self == Self::None
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Figures {
    pub precision: f64,
    pub recall: f64,
    pub f1: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ClassFigures {
    pub precision: f64,
    pub recall: f64,
    pub f1: f64,
    pub support: u64,
}

/// What a metric adds, as it accumulates.
#[derive(Debug, Clone)]
enum ExtraSums {
    None,
    Pooled { edits: u64, length: u64 },
    Fields { tp: u64, fp: u64, fn_: u64 },
    Classes(BTreeMap<String, BTreeMap<String, u64>>),
}

impl ExtraSums {
    fn new(metric: &Metric) -> Self {
        match metric.kind {
            Kind::Cer | Kind::Wer => Self::Pooled {
                edits: 0,
                length: 0,
            },
            Kind::JsonFields { .. } => Self::Fields {
                tp: 0,
                fp: 0,
                fn_: 0,
            },
            Kind::Classification { .. } => Self::Classes(BTreeMap::new()),
            _ => Self::None,
        }
    }

    fn add(&mut self, score: &Score) {
        match self {
            Self::None => {}
            Self::Pooled { edits, length } => {
                *edits += score.count("edits");
                *length += score.count("length");
            }
            Self::Fields { tp, fp, fn_ } => {
                *tp += score.count("tp");
                *fp += score.count("fp");
                *fn_ += score.count("fn");
            }
            Self::Classes(matrix) => {
                *matrix
                    .entry(score.text("reference").to_owned())
                    .or_default()
                    .entry(score.text("predicted").to_owned())
                    .or_default() += 1;
            }
        }
    }

    fn finish(self) -> Extra {
        match self {
            Self::None => Extra::None,
            Self::Pooled { edits, length } => Extra::Pooled {
                pooled: ratio(edits, length),
                edits,
                reference_length: length,
            },
            Self::Fields { tp, fp, fn_ } => {
                let (p, r) = (ratio(tp, tp + fp), ratio(tp, tp + fn_));
                Extra::Fields {
                    precision: p,
                    recall: r,
                    f1: f1(p, r),
                }
            }
            Self::Classes(matrix) => classification(matrix),
        }
    }
}

/// One metric over one group, as results come.
#[derive(Debug, Clone)]
pub struct Accumulator {
    /// The sums of every item's value, the worst for an item without a
    /// score (for the mean and its interval).
    values: Moments,
    scored: u64,
    scored_sum: f64,
    failed: u64,
    lost: u64,
    unparsed: u64,
    invalid: u64,
    errors: u64,
    reasons: Vec<Reason>,
    other_reasons: u64,
    extra: ExtraSums,
}

impl Accumulator {
    pub fn new(metric: &Metric) -> Self {
        Self {
            values: Moments::default(),
            scored: 0,
            scored_sum: 0.0,
            failed: 0,
            lost: 0,
            unparsed: 0,
            invalid: 0,
            errors: 0,
            reasons: Vec::new(),
            other_reasons: 0,
            extra: ExtraSums::new(metric),
        }
    }

    fn not_scored(&mut self, reason: Option<&str>) {
        self.errors += 1;
        let reason = reason.unwrap_or("no score was stored for it");
        let shape = shape_of(reason);
        if let Some(known) = self.reasons.iter_mut().find(|r| r.shape == shape) {
            known.count += 1;
        } else if self.reasons.len() < REASONS {
            self.reasons.push(Reason {
                reason: reason.to_owned(),
                count: 1,
                shape,
            });
        } else {
            self.other_reasons += 1;
        }
    }

    pub fn add(&mut self, metric: &Metric, row: Row<'_>) {
        if row.lost {
            self.failed += 1;
            self.lost += 1;
            return;
        }
        let score = if row.failed {
            self.failed += 1;
            None
        } else {
            match row.verdict {
                Some(Verdict::Unparsed) => {
                    self.unparsed += 1;
                    None
                }
                Some(Verdict::Invalid) => {
                    self.invalid += 1;
                    None
                }
                _ => match row.scores.get(&metric.key) {
                    Some(s) if s.value.is_some() => Some(s),
                    other => {
                        // Not the answer's fault: in no mean, and said.
                        self.not_scored(other.and_then(|s| s.error.as_deref()));
                        return;
                    }
                },
            }
        };
        match score.and_then(|s| s.value.map(|v| (s, v))) {
            Some((s, v)) => {
                self.values.add(v);
                self.scored += 1;
                self.scored_sum += v;
                self.extra.add(s);
            }
            None => self.values.add(metric.missing()),
        }
    }

    pub fn finish(self, metric: &Metric, group: &str) -> Summary {
        let n = self.values.n + self.errors + self.lost;
        // No item answered at all: there is no score to give, not the worst
        // one. Some answered, all unusable: that is a score, the worst one,
        // and the table says why in UNPARSED/INVALID.
        let status = match (self.errors, self.scored, self.values.n) {
            _ if n > 0 && self.failed == n => NO_ANSWERS,
            (0, _, 1..) => "scored",
            (_, 0, _) => "not scored",
            _ => "partly scored",
        };
        Summary {
            metric: metric.key.clone(),
            group: group.to_owned(),
            n,
            scored: self.scored,
            failed: self.failed,
            lost: self.lost,
            unparsed: self.unparsed,
            invalid: self.invalid,
            errors: self.errors,
            reasons: self.reasons,
            other_reasons: self.other_reasons,
            status,
            estimate: stats::estimate(&self.values),
            mean_scored: if self.scored == 0 {
                f64::NAN
            } else {
                self.scored_sum / self.scored as f64
            },
            higher_is_better: metric.higher_is_better,
            extra: self.extra.finish(),
        }
    }
}

/// Every metric over the overall group and every category of the results
/// added, the overall group first.
pub struct Summaries {
    metrics: Vec<Metric>,
    /// Per metric: group → its accumulator (`all` among them).
    groups: Vec<BTreeMap<String, Accumulator>>,
}

impl Summaries {
    pub fn new(metrics: &[Metric]) -> Self {
        Self {
            metrics: metrics.to_vec(),
            groups: metrics
                .iter()
                .map(|m| BTreeMap::from([(ALL.to_owned(), Accumulator::new(m))]))
                .collect(),
        }
    }

    /// Adds one result, in `group` (and overall).
    pub fn add(&mut self, row: Row<'_>, group: &str) {
        for (metric, groups) in self.metrics.iter().zip(&mut self.groups) {
            if let Some(all) = groups.get_mut(ALL) {
                all.add(metric, row);
            }
            if group != ALL {
                // A group's name is copied once, when it is first seen.
                match groups.get_mut(group) {
                    Some(accumulator) => accumulator.add(metric, row),
                    None => {
                        let mut accumulator = Accumulator::new(metric);
                        accumulator.add(metric, row);
                        groups.insert(group.to_owned(), accumulator);
                    }
                }
            }
        }
    }

    pub fn finish(self) -> Vec<Summary> {
        let mut out = Vec::new();
        for (metric, mut groups) in self.metrics.iter().zip(self.groups) {
            if let Some(all) = groups.remove(ALL) {
                out.push(all.finish(metric, ALL));
            }
            for (group, acc) in groups {
                out.push(acc.finish(metric, &group));
            }
        }
        out
    }
}

/// The overall group's name.
pub const ALL: &str = "all";

/// Summaries of `rows` (each with its group), for tests and small sets.
pub fn summarize<'a>(
    metrics: &[Metric],
    rows: impl IntoIterator<Item = (Row<'a>, &'a str)>,
) -> Vec<Summary> {
    let mut summaries = Summaries::new(metrics);
    for (row, group) in rows {
        summaries.add(row, group);
    }
    summaries.finish()
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

fn f1(p: f64, r: f64) -> f64 {
    if p + r == 0.0 {
        0.0
    } else {
        2.0 * p * r / (p + r)
    }
}

fn classification(matrix: BTreeMap<String, BTreeMap<String, u64>>) -> Extra {
    let mut labels: std::collections::BTreeSet<String> = Default::default();
    for (reference, row) in &matrix {
        labels.insert(reference.clone());
        labels.extend(row.keys().cloned());
    }
    let cell = |r: &str, p: &str| {
        matrix
            .get(r)
            .and_then(|row| row.get(p))
            .copied()
            .unwrap_or(0)
    };
    let mut per_class = BTreeMap::new();
    let (mut macro_p, mut macro_r, mut macro_f, mut classes) = (0.0, 0.0, 0.0, 0u32);
    let (mut tp_all, mut total) = (0u64, 0u64);
    for label in &labels {
        let tp = cell(label, label);
        let predicted: u64 = labels.iter().map(|r| cell(r, label)).sum();
        let actual: u64 = labels.iter().map(|p| cell(label, p)).sum();
        let (p, r) = (ratio(tp, predicted), ratio(tp, actual));
        tp_all += tp;
        total += actual;
        // Only labels that occur as references enter the macro average.
        if actual > 0 {
            macro_p += p;
            macro_r += r;
            macro_f += f1(p, r);
            classes += 1;
        }
        per_class.insert(
            label.clone(),
            ClassFigures {
                precision: p,
                recall: r,
                f1: f1(p, r),
                support: actual,
            },
        );
    }
    let k = f64::from(classes.max(1));
    let micro = ratio(tp_all, total);
    Extra::Classes {
        per_class,
        macro_avg: Figures {
            precision: macro_p / k,
            recall: macro_r / k,
            f1: macro_f / k,
        },
        micro: Figures {
            precision: micro,
            recall: micro,
            f1: micro,
        },
        confusion: matrix,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Map, json};

    use super::*;

    /// A result's failure, verdict and scores, in a group.
    struct Owned {
        failed: bool,
        lost: bool,
        verdict: Option<Verdict>,
        scores: Scores,
        group: String,
    }

    fn row(value: Option<f64>, verdict: &str, group: &str, key: &str) -> Owned {
        let mut scores = Scores::new();
        if let Some(v) = value {
            scores.insert(key.to_owned(), Score::value(v));
        }
        // "lost": failed for the server's sake.
        let failed = verdict == "failed" || verdict == "lost";
        Owned {
            failed,
            lost: verdict == "lost",
            verdict: (!failed).then(|| Verdict::parse(verdict).unwrap()),
            scores,
            group: group.to_owned(),
        }
    }

    fn views(rows: &[Owned]) -> impl Iterator<Item = (Row<'_>, &str)> {
        rows.iter().map(|r| {
            (
                Row {
                    failed: r.failed,
                    lost: r.lost,
                    verdict: r.verdict,
                    scores: &r.scores,
                },
                r.group.as_str(),
            )
        })
    }

    #[test]
    fn unscored_items_are_counted_and_score_the_worst() {
        let m = Metric::build("exact_match", &Map::new(), None).unwrap();
        let k = m.key.clone();
        let rows = vec![
            row(Some(1.0), "ok", "a", &k),
            row(Some(0.0), "ok", "a", &k),
            row(None, "unparsed", "b", &k),
            row(None, "failed", "b", &k),
            row(Some(1.0), "ok", "b", &k),
            row(None, "invalid", "b", &k),
        ];
        let s = summarize(&[m], views(&rows));
        assert_eq!(s.len(), 3);
        let all = &s[0];
        assert_eq!(
            (
                all.group.as_str(),
                all.n,
                all.scored,
                all.failed,
                all.unparsed,
                all.invalid
            ),
            ("all", 6, 3, 1, 1, 1)
        );
        assert!((all.estimate.mean - 2.0 / 6.0).abs() < 1e-12);
        assert!((all.mean_scored - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!((s[1].group.as_str(), s[1].n), ("a", 2));
        assert_eq!((s[2].group.as_str(), s[2].n, s[2].scored), ("b", 4, 1));
    }

    #[test]
    fn items_a_metric_could_not_score_are_in_no_mean_and_say_why() {
        let m = Metric::build("numeric_match", &Map::new(), None).unwrap();
        let k = m.key.clone();
        let scored = |answer: &str, reference: &str| Owned {
            failed: false,
            lost: false,
            verdict: Some(Verdict::Ok),
            scores: Scores::from_iter([(
                k.clone(),
                Score::from_json(m.score(&json!(answer), &[json!(reference)])),
            )]),
            group: "all".into(),
        };
        let rows = vec![
            scored("4", "4"),
            scored("5", "4"),
            scored("4", "n/a"),
            scored("4", "unknown"),
            scored("4", "none"),
            row(None, "failed", "all", &k),
        ];
        let s = &summarize(std::slice::from_ref(&m), views(&rows))[0];
        assert_eq!(
            (s.n, s.scored, s.errors, s.failed, s.status),
            (6, 2, 3, 1, "partly scored")
        );
        // Over the three it could judge: 1, 0 and the failed item's 0.
        assert!(
            (s.estimate.mean - 1.0 / 3.0).abs() < 1e-12,
            "{}",
            s.estimate.mean
        );
        assert_eq!(
            s.reasons,
            vec![Reason {
                reason: "the reference 'n/a' has no number".to_owned(),
                count: 3,
                shape: "the reference '…' has no number".to_owned(),
            }]
        );
        assert!((s.unscored_share() - 0.6).abs() < 1e-12);
        let none = vec![scored("4", "n/a")];
        let s = &summarize(std::slice::from_ref(&m), views(&none))[0];
        assert_eq!((s.status, s.estimate.mean.is_nan()), ("not scored", true));
        let failed = vec![
            row(None, "failed", "all", &k),
            row(None, "unparsed", "all", &k),
        ];
        let s = &summarize(&[m], views(&failed))[0];
        assert_eq!((s.status, s.estimate.mean), ("scored", 0.0));
    }

    #[test]
    fn an_item_failed_for_the_server_s_sake_is_failed_and_in_no_mean() {
        let m = Metric::build("exact_match", &Map::new(), None).unwrap();
        let k = m.key.clone();
        let rows = vec![
            row(Some(1.0), "ok", "all", &k),
            row(Some(1.0), "ok", "all", &k),
            row(Some(0.0), "ok", "all", &k),
            row(None, "lost", "all", &k),
            row(None, "lost", "all", &k),
            row(None, "failed", "all", &k),
        ];
        let s = &summarize(&[m], views(&rows))[0];
        assert_eq!((s.n, s.scored, s.failed, s.lost, s.errors), (6, 3, 3, 2, 0));
        // Over 1, 1, 0 and the item that failed for the model's sake (0).
        assert!((s.estimate.mean - 0.5).abs() < 1e-12, "{}", s.estimate.mean);
        assert!((s.mean_scored - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(s.status, "scored");
    }

    #[test]
    fn classification_reports_per_class_and_macro_figures() {
        let params = json!({});
        let m = Metric::build("classification", params.as_object().unwrap(), None).unwrap();
        let pairs = [
            ("pos", "pos"),
            ("pos", "neg"),
            ("neg", "neg"),
            ("neg", "neg"),
        ];
        let rows: Vec<Owned> = pairs
            .iter()
            .map(|(p, r)| Owned {
                failed: false,
                lost: false,
                verdict: Some(Verdict::Ok),
                scores: Scores::from_iter([(
                    m.key.clone(),
                    Score::from_json(m.score(&json!(p), &[json!(r)])),
                )]),
                group: "all".into(),
            })
            .collect();
        let s = &summarize(&[m], views(&rows))[0];
        let extra = &serde_json::to_value(&s.extra).unwrap();
        // neg: tp 2, predicted 2, actual 3; pos: tp 1, predicted 2, actual 1.
        assert!((extra["per_class"]["neg"]["recall"].as_f64().unwrap() - 2.0 / 3.0).abs() < 1e-12);
        assert!((extra["per_class"]["pos"]["precision"].as_f64().unwrap() - 0.5).abs() < 1e-12);
        assert_eq!(extra["confusion"]["neg"]["pos"], json!(1));
        assert!((extra["micro"]["f1"].as_f64().unwrap() - 0.75).abs() < 1e-12);
        let macro_f1 = (f1(1.0, 2.0 / 3.0) + f1(0.5, 1.0)) / 2.0;
        assert!((extra["macro"]["f1"].as_f64().unwrap() - macro_f1).abs() < 1e-12);
    }
}
