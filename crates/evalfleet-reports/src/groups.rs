//! A report read by group: for each group of items (a document type, a
//! prompt rule, any item field) and overall, every metric's mean with its
//! interval and how the answers turned out (structural fidelity: usable
//! at the first answer, only after re-asks, or not in the end). Made from
//! the summaries a report already holds, so it costs no second read of
//! the results; `evalfleet report`, the HTML page, the dashboard and
//! `evalfleet bench` show it.

use std::collections::BTreeMap;

use serde::Serialize;

use super::Fidelity;
use super::metrics::{ALL, Extra, Summary};
use super::stats::{self, Estimate, Moments};

/// The field that groups a document run by default, when its items have
/// it.
pub const DOC_TYPE: &str = "doc_type";

/// The pseudo-field of `--by` and `report.by` that groups results by the
/// rule of `task.prompts` that made their messages.
pub const PROMPT: &str = "@prompt";

/// One group of a report (`all`: every item).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct GroupFigures {
    pub group: String,
    /// Items in the group with a result.
    pub items: u64,
    /// How its answers turned out.
    pub fidelity: Fidelity,
    /// Of its checked answers (parsed, and checked against the schema:
    /// the items that did not fail), the share usable at the first
    /// answer, with its 95% interval; `None` when none was checked.
    pub valid_first: Option<Estimate>,
    /// Of the same answers, the share usable in the end, re-asks
    /// included.
    pub valid_final: Option<Estimate>,
    /// Each metric over the group, in the task's order.
    pub metrics: Vec<GroupMetric>,
}

/// A metric over one group: the headline of its [`Summary`].
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct GroupMetric {
    pub metric: String,
    pub n: u64,
    pub scored: u64,
    /// `scored`, `partly scored`, `not scored` or `no answers`.
    pub status: &'static str,
    #[serde(flatten)]
    pub estimate: Estimate,
    /// CER and WER: edits over reference length, pooled over the group.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pooled: Option<f64>,
    pub higher_is_better: bool,
}

/// How many checked answers were usable at once, after re-asks, or not.
fn shares(f: &Fidelity) -> (Option<Estimate>, Option<Estimate>) {
    let checked = f.valid_first_try + f.valid_after_reasks + f.unparsed + f.invalid;
    if checked == 0 {
        return (None, None);
    }
    let share = |ones: u64| stats::estimate(&Moments::counts(ones, checked));
    (
        Some(share(f.valid_first_try)),
        Some(share(f.valid_first_try + f.valid_after_reasks)),
    )
}

/// Every group of `metrics` (the report's summaries, overall first) with
/// its fidelity (`fidelity`: by group, `all` among them), overall first,
/// then the groups in order.
pub fn groups(metrics: &[Summary], fidelity: &BTreeMap<String, Fidelity>) -> Vec<GroupFigures> {
    let mut order: Vec<&str> = vec![ALL];
    order.extend(fidelity.keys().map(String::as_str).filter(|g| *g != ALL));
    order
        .into_iter()
        .map(|group| {
            let fidelity = fidelity.get(group).copied().unwrap_or_default();
            let (valid_first, valid_final) = shares(&fidelity);
            GroupFigures {
                group: group.to_owned(),
                items: fidelity.total(),
                fidelity,
                valid_first,
                valid_final,
                metrics: metrics
                    .iter()
                    .filter(|s| s.group == group)
                    .map(|s| GroupMetric {
                        metric: s.metric.clone(),
                        n: s.n,
                        scored: s.scored,
                        status: s.status,
                        estimate: s.estimate,
                        pooled: match s.extra {
                            Extra::Pooled { pooled, .. } => Some(pooled),
                            _ => None,
                        },
                        higher_is_better: s.higher_is_better,
                    })
                    .collect(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fidelity_shares_count_checked_answers_only() {
        let f = Fidelity {
            valid_first_try: 2,
            valid_after_reasks: 1,
            unparsed: 1,
            invalid: 0,
            not_checked: 0,
            failed: 3,
        };
        let (first, last) = shares(&f);
        assert_eq!(first.unwrap().mean, 0.5);
        assert_eq!(last.unwrap().mean, 0.75);
        assert!(first.unwrap().ci_low < 0.5 && first.unwrap().ci_high > 0.5);
        assert_eq!(shares(&Fidelity::default()), (None, None));
    }
}
