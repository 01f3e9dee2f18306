//! Runs side by side: each against the first on the items both answered,
//! per metric and category: their means, the paired difference with its
//! bootstrap interval and p-value, and McNemar's exact test for 0/1 scores.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use super::stats::{self, Paired};
use super::{Judged, ReportError, judged_value, scan};
use crate::store::Store;

/// The values of the items two runs share: the first run's, this run's.
type Pairs = (Vec<f64>, Vec<f64>);

/// One metric and category of one run against the first.
#[derive(Debug, Clone, Serialize)]
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
    pub paired: Paired,
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
                    paired: stats::paired(&a, &b, 17),
                });
            }
        }
    }
    Ok(out)
}
