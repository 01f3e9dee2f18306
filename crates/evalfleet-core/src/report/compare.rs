//! Runs side by side: each against the first on the items both answered,
//! per metric and category: their means, the paired difference with its
//! bootstrap interval and p-value, and McNemar's exact test for 0/1 scores.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use super::stats::{self, Estimate, Paired};
use super::{Judged, ReportError, judged_value, scan};
use crate::store::Store;

/// The values of the items two runs share: the first run's, this run's.
type Pairs = (Vec<f64>, Vec<f64>);

/// One metric and category of one run against the first.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Comparison {
    pub metric: String,
    pub group: String,
    /// The first run, and this one.
    pub a: String,
    pub b: String,
    /// Items both answered.
    pub n: u64,
    pub mean_a: f64,
    pub mean_b: f64,
    /// Each run's mean on these items, with its 95% interval.
    pub estimate_a: Estimate,
    pub estimate_b: Estimate,
    pub paired: Paired,
}

/// An item two runs scored differently.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Disagreement {
    pub item_id: String,
    pub group: String,
    pub a: f64,
    pub b: f64,
    /// Each run's answer (the first [`PREVIEW`] characters).
    pub output_a: Option<String>,
    pub output_b: Option<String>,
}

/// The items where two runs disagree on a metric.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Disagreements {
    pub metric: String,
    pub a: String,
    pub b: String,
    /// Items both answered and the metric scored.
    pub compared: u64,
    /// Of those, the items scored differently.
    pub total: u64,
    /// The first of them in the first run's order (at most the limit
    /// asked for).
    pub items: Vec<Disagreement>,
}

/// Characters of an answer a disagreement shows.
pub const PREVIEW: usize = 300;

fn preview(text: Option<&str>) -> Option<String> {
    text.map(|t| t.chars().take(PREVIEW).collect())
}

/// Compares `runs[1..]` each with `runs[0]` on the metrics every run has,
/// by the first run's categories for `by`.
pub fn compare(
    store: &mut dyn Store,
    runs: &[String],
    by: &[String],
) -> Result<Vec<Comparison>, ReportError> {
    if runs.len() < 2 {
        return Err(ReportError::Compare(
            "compare needs at least two runs".to_owned(),
        ));
    }
    let judged: Vec<Judged> = runs
        .iter()
        .map(|id| Judged::load(store, id))
        .collect::<Result<_, _>>()?;
    let base = &judged[0];
    let metrics: Vec<_> = base
        .metrics
        .iter()
        .filter(|m| {
            judged[1..]
                .iter()
                .all(|r| r.metrics.iter().any(|o| o.key == m.key))
        })
        .cloned()
        .collect();
    if metrics.is_empty() {
        return Err(ReportError::Compare(
            "the runs share no metric (compare uses the metrics every run has)".to_owned(),
        ));
    }
    // The first run's items, in its order: their category and each
    // metric's value (see `judged_value`).
    let mut first: Vec<(String, Vec<Option<f64>>)> = Vec::new();
    let mut place: HashMap<String, usize> = HashMap::new();
    scan(store, &base.run.run_id, by, &mut |result, group| {
        let values = metrics.iter().map(|m| judged_value(result, m)).collect();
        place.insert(result.item_id.clone(), first.len());
        first.push((group.to_owned(), values));
    })?;
    let mut out = Vec::new();
    for other in &judged[1..] {
        // This run's values of the first run's items, by their place.
        let mut theirs: Vec<Option<Vec<Option<f64>>>> = vec![None; first.len()];
        scan(store, &other.run.run_id, &[], &mut |result, _| {
            if let Some(&at) = place.get(&result.item_id) {
                theirs[at] = Some(metrics.iter().map(|m| judged_value(result, m)).collect());
            }
        })?;
        // Per metric: category → the pairs (first run, this run), in the
        // first run's order.
        let mut pairs: Vec<BTreeMap<String, Pairs>> = vec![BTreeMap::new(); metrics.len()];
        for ((group, ours), theirs) in first.iter().zip(&theirs) {
            let Some(theirs) = theirs else {
                continue;
            };
            for (i, groups) in pairs.iter_mut().enumerate() {
                // A pair either side of which could not be scored is no
                // comparison.
                let (Some(a), Some(b)) = (ours[i], theirs[i]) else {
                    continue;
                };
                let mut push = |group: &str| {
                    // A group's name is copied once, when it is first seen.
                    match groups.get_mut(group) {
                        Some((xs, ys)) => {
                            xs.push(a);
                            ys.push(b);
                        }
                        None => {
                            groups.insert(group.to_owned(), (vec![a], vec![b]));
                        }
                    }
                };
                push(super::metrics::ALL);
                if group != super::metrics::ALL {
                    push(group);
                }
            }
        }
        for (m, groups) in metrics.iter().zip(pairs) {
            for (group, (a, b)) in groups {
                let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
                out.push(Comparison {
                    metric: m.key.clone(),
                    group,
                    a: base.run.run_id.clone(),
                    b: other.run.run_id.clone(),
                    n: a.len() as u64,
                    mean_a: mean(&a),
                    mean_b: mean(&b),
                    estimate_a: stats::estimate(&a, 17),
                    estimate_b: stats::estimate(&b, 19),
                    paired: stats::paired(&a, &b, 17),
                });
            }
        }
    }
    Ok(out)
}

/// The items runs `a` and `b` score differently on `metric` (a value more
/// than `1e-9` apart; an item either run could not score is left out), by
/// `a`'s categories for `by`, the first `limit` of them in `a`'s order.
pub fn disagreements(
    store: &mut dyn Store,
    a: &str,
    b: &str,
    metric: &str,
    by: &[String],
    limit: usize,
) -> Result<Disagreements, ReportError> {
    let first = Judged::load(store, a)?;
    let second = Judged::load(store, b)?;
    let find = |judged: &Judged| {
        judged
            .metrics
            .iter()
            .find(|m| m.key == metric)
            .cloned()
            .ok_or_else(|| {
                ReportError::Compare(format!(
                    "run {} has no metric '{metric}' (it has {})",
                    judged.run.run_id,
                    judged
                        .metrics
                        .iter()
                        .map(|m| m.key.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })
    };
    let (metric_a, metric_b) = (find(&first)?, find(&second)?);
    // The second run's values and answers by item.
    let mut theirs: HashMap<String, (f64, Option<String>)> = HashMap::new();
    scan(store, b, &[], &mut |result, _| {
        if let Some(value) = judged_value(result, &metric_b) {
            theirs.insert(
                result.item_id.clone(),
                (value, preview(result.output.as_deref())),
            );
        }
    })?;
    let mut out = Disagreements {
        metric: metric.to_owned(),
        a: a.to_owned(),
        b: b.to_owned(),
        compared: 0,
        total: 0,
        items: Vec::new(),
    };
    scan(store, a, by, &mut |result, group| {
        let Some(value) = judged_value(result, &metric_a) else {
            return;
        };
        let Some((other, output)) = theirs.remove(&result.item_id) else {
            return;
        };
        out.compared += 1;
        if (value - other).abs() <= 1e-9 {
            return;
        }
        out.total += 1;
        if out.items.len() < limit {
            out.items.push(Disagreement {
                item_id: result.item_id.clone(),
                group: group.to_owned(),
                a: value,
                b: other,
                output_a: preview(result.output.as_deref()),
                output_b: output,
            });
        }
    })?;
    Ok(out)
}
