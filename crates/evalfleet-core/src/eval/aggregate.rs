//! Aggregates of item scores, overall and by category, with the items that
//! could not be scored counted beside every figure.

use std::collections::BTreeMap;

use evalfleet_types::{Score, Scores, Verdict};
use serde::Serialize;
use serde_json::{Map, Value, json};

use super::metrics::{Kind, Metric};
use super::stats::{self, Estimate};

/// One item as aggregation sees it.
#[derive(Debug, Clone)]
pub struct Row {
    /// The call failed (no answer).
    pub failed: bool,
    /// Done items' verdicts.
    pub verdict: Option<Verdict>,
    pub scores: Scores,
    /// The item's category (`all` for the overall figure).
    pub group: String,
}

/// A metric over a group of items.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub metric: String,
    pub group: String,
    /// Items in the group.
    pub n: u64,
    /// Items with a score.
    pub scored: u64,
    pub failed: u64,
    pub unparsed: u64,
    pub invalid: u64,
    /// Items whose score could not be computed (e.g. no reference).
    pub errors: u64,
    /// Over all `n` items, an item without a score counting as the worst
    /// score (0, or 1 for error rates).
    #[serde(flatten)]
    pub estimate: Estimate,
    /// Over the scored items only.
    pub mean_scored: f64,
    pub higher_is_better: bool,
    /// What the metric adds (pooled error rates, precision and recall,
    /// confusion matrices).
    pub extra: Value,
}

/// Summaries per metric, for the overall group and every category in
/// `rows` (the overall one first).
pub fn summarize(metrics: &[Metric], rows: &[Row]) -> Vec<Summary> {
    let mut groups: BTreeMap<&str, Vec<&Row>> = BTreeMap::new();
    for row in rows {
        groups.entry(row.group.as_str()).or_default().push(row);
    }
    let mut out = Vec::new();
    for metric in metrics {
        let all: Vec<&Row> = rows.iter().collect();
        out.push(one(metric, "all", &all));
        for (group, members) in &groups {
            if *group != "all" {
                out.push(one(metric, group, members));
            }
        }
    }
    out
}

fn one(metric: &Metric, group: &str, rows: &[&Row]) -> Summary {
    let (mut failed, mut unparsed, mut invalid, mut errors) = (0, 0, 0, 0);
    let mut values = Vec::with_capacity(rows.len());
    let mut scored_values = Vec::new();
    let mut scored_items: Vec<&Score> = Vec::new();
    for row in rows {
        let score = if row.failed {
            failed += 1;
            None
        } else {
            match row.verdict {
                Some(Verdict::Unparsed) => {
                    unparsed += 1;
                    None
                }
                Some(Verdict::Invalid) => {
                    invalid += 1;
                    None
                }
                _ => match row.scores.get(&metric.key) {
                    Some(s) if s.value.is_some() => Some(s),
                    _ => {
                        errors += 1;
                        None
                    }
                },
            }
        };
        match score.and_then(|s| s.value.map(|v| (s, v))) {
            Some((s, v)) => {
                values.push(v);
                scored_values.push(v);
                scored_items.push(s);
            }
            None => values.push(metric.missing()),
        }
    }
    let seed = seed_of(&metric.key, group);
    let mean_scored = if scored_values.is_empty() {
        f64::NAN
    } else {
        scored_values.iter().sum::<f64>() / scored_values.len() as f64
    };
    Summary {
        metric: metric.key.clone(),
        group: group.to_owned(),
        n: rows.len() as u64,
        scored: scored_values.len() as u64,
        failed,
        unparsed,
        invalid,
        errors,
        estimate: stats::estimate(&values, seed),
        mean_scored,
        higher_is_better: metric.higher_is_better,
        extra: extra(metric, &scored_items),
    }
}

fn seed_of(metric: &str, group: &str) -> u64 {
    // FNV-1a: a stable seed per figure, the same in every report.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in metric.bytes().chain([0]).chain(group.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
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

fn extra(metric: &Metric, scores: &[&Score]) -> Value {
    match metric.kind {
        Kind::Cer | Kind::Wer => {
            let edits: u64 = scores.iter().map(|s| s.count("edits")).sum();
            let length: u64 = scores.iter().map(|s| s.count("length")).sum();
            json!({ "pooled": ratio(edits, length), "edits": edits, "reference_length": length })
        }
        Kind::JsonFields { .. } => {
            let tp: u64 = scores.iter().map(|s| s.count("tp")).sum();
            let fp: u64 = scores.iter().map(|s| s.count("fp")).sum();
            let fn_: u64 = scores.iter().map(|s| s.count("fn")).sum();
            let (p, r) = (ratio(tp, tp + fp), ratio(tp, tp + fn_));
            json!({ "precision": p, "recall": r, "f1": f1(p, r) })
        }
        Kind::Classification { .. } => classification(scores),
        _ => Value::Null,
    }
}

fn classification(scores: &[&Score]) -> Value {
    let mut matrix: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    let mut labels: std::collections::BTreeSet<String> = Default::default();
    for s in scores {
        let label = |k: &str| s.text(k).to_owned();
        let (reference, predicted) = (label("reference"), label("predicted"));
        labels.insert(reference.clone());
        labels.insert(predicted.clone());
        *matrix
            .entry(reference)
            .or_default()
            .entry(predicted)
            .or_default() += 1;
    }
    let cell = |r: &str, p: &str| {
        matrix
            .get(r)
            .and_then(|row| row.get(p))
            .copied()
            .unwrap_or(0)
    };
    let mut per_class = Map::new();
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
            json!({ "precision": p, "recall": r, "f1": f1(p, r), "support": actual }),
        );
    }
    let k = f64::from(classes.max(1));
    let micro = ratio(tp_all, total);
    json!({
        "per_class": per_class,
        "macro": { "precision": macro_p / k, "recall": macro_r / k, "f1": macro_f / k },
        "micro": { "precision": micro, "recall": micro, "f1": micro },
        "confusion": matrix,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(value: Option<f64>, verdict: &str, group: &str, key: &str) -> Row {
        let mut scores = Scores::new();
        if let Some(v) = value {
            scores.insert(key.to_owned(), Score::value(v));
        }
        Row {
            failed: verdict == "failed",
            verdict: (verdict != "failed").then(|| Verdict::parse(verdict).unwrap()),
            scores,
            group: group.to_owned(),
        }
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
        let s = summarize(&[m], &rows);
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
    fn classification_reports_per_class_and_macro_figures() {
        let params = json!({});
        let m = Metric::build("classification", params.as_object().unwrap(), None).unwrap();
        let pairs = [
            ("pos", "pos"),
            ("pos", "neg"),
            ("neg", "neg"),
            ("neg", "neg"),
        ];
        let rows: Vec<Row> = pairs
            .iter()
            .map(|(p, r)| Row {
                failed: false,
                verdict: Some(Verdict::Ok),
                scores: Scores::from_iter([(
                    m.key.clone(),
                    Score::from_json(m.score(&json!(p), &[json!(r)])),
                )]),
                group: "all".into(),
            })
            .collect();
        let s = &summarize(&[m], &rows)[0];
        let extra = &s.extra;
        // neg: tp 2, predicted 2, actual 3; pos: tp 1, predicted 2, actual 1.
        assert!((extra["per_class"]["neg"]["recall"].as_f64().unwrap() - 2.0 / 3.0).abs() < 1e-12);
        assert!((extra["per_class"]["pos"]["precision"].as_f64().unwrap() - 0.5).abs() < 1e-12);
        assert_eq!(extra["confusion"]["neg"]["pos"], json!(1));
        assert!((extra["micro"]["f1"].as_f64().unwrap() - 0.75).abs() < 1e-12);
        let macro_f1 = (f1(1.0, 2.0 / 3.0) + f1(0.5, 1.0)) / 2.0;
        assert!((extra["macro"]["f1"].as_f64().unwrap() - macro_f1).abs() < 1e-12);
    }
}
