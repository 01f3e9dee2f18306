//! Runs side by side: each against the first on the items both answered,
//! per metric and category: each run's own mean with its interval (the
//! figure its report shows), their means on the shared items, the paired
//! difference with its interval and p-value, and McNemar's exact test for
//! 0/1 scores; how many items each run has and how many were paired; and
//! the items they disagree on.
//!
//! Two runs are read side by side a page at a time and paired by item id:
//! memory holds a page of each and the running sums, never either run.
//! They are read first in dataset order, which pairs them item by item as
//! long as both have the same id at each place (runs of one dataset: a
//! sequential read of each); at the first place where their ids differ,
//! the pass starts again in item-id order from the items' id index, and
//! merges them by id (a read of each in id order, slower: a lookup per
//! result).

use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};

use serde::Serialize;

use super::metrics;
use super::stats::{self, Estimate, Moments, Paired, Pairs};
use super::{Judged, ReportError, group_of};
use evalfleet_eval::Metric;
use evalfleet_store::{ResultOrder, ResultView, Store, StoreError};
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};

/// One metric and category of one run against the first.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Comparison {
    pub metric: String,
    pub group: String,
    /// The first run, and this one.
    pub a: String,
    pub b: String,
    /// Items both answered and the metric could score in both.
    pub n: u64,
    /// Each run's mean on these `n` items (their difference is `paired.diff`).
    pub mean_a: f64,
    pub mean_b: f64,
    /// Each run's own mean over all its items in the category, with its
    /// 95% interval: the same figure as the run's report.
    pub estimate_a: Estimate,
    pub estimate_b: Estimate,
    pub paired: Paired,
}

/// How much of two runs a comparison could pair.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Coverage {
    /// The first run, and this one.
    pub a: String,
    pub b: String,
    /// Items with a result in each run.
    pub items_a: u64,
    pub items_b: u64,
    /// Items with a result in both (paired by item id).
    pub paired: u64,
    /// Both runs read the same dataset file (the same SHA-256).
    pub same_dataset: bool,
}

impl Coverage {
    /// The runs differ in their items: a comparison holds for the paired
    /// ones only.
    pub fn differs(&self) -> bool {
        !self.same_dataset || self.paired != self.items_a || self.paired != self.items_b
    }

    /// What a reader must know first, when the runs differ.
    pub fn warning(&self) -> Option<String> {
        self.differs().then(|| {
            format!(
                "runs {} and {} {}: {} has {} items, {} has {}, and {} were paired by id",
                self.a,
                self.b,
                if self.same_dataset {
                    "have different items"
                } else {
                    "read different datasets"
                },
                self.a,
                self.items_a,
                self.b,
                self.items_b,
                self.paired
            )
        })
    }
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

/// Runs compared: for each run after the first, how much could be paired;
/// per metric and category, each against the first; and the items each
/// disagrees with the first on.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Compared {
    /// What each run came to, in the order given: a run not complete is
    /// compared over fewer items than it has, and is marked.
    pub outcomes: Vec<RunOutcome>,
    pub coverage: Vec<Coverage>,
    pub comparisons: Vec<Comparison>,
    pub disagreements: Vec<Disagreements>,
}

/// A run's outcome, in a comparison.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct RunOutcome {
    pub run_id: String,
    pub outcome: super::Outcome,
}

/// Results read a page at a time.
const PAGE: usize = 1000;

/// A result as a comparison keeps it: its place, its id, each shared
/// metric's value as a report takes it ([`judged_value`]), its category.
struct Lean {
    seq: u64,
    item_id: String,
    values: Vec<Option<f64>>,
    group: String,
}

/// Each metric's value of a result (see [`judged_value`]), read from its
/// stored scores without building them: only the metrics' values.
fn values_of(view: &ResultView<'_>, metrics: &[Metric]) -> Result<Vec<Option<f64>>, StoreError> {
    if super::lost(view.status, view.failure) {
        return Ok(vec![None; metrics.len()]);
    }
    if !super::answered(view.status, view.verdict) {
        return Ok(metrics.iter().map(|m| Some(m.missing())).collect());
    }
    let mut values = vec![None; metrics.len()];
    if let Some(text) = view.scores {
        let mut de = serde_json::Deserializer::from_str(text);
        ScoreValues {
            metrics,
            values: &mut values,
        }
        .deserialize(&mut de)
        .map_err(|err| StoreError::backend("stored scores cannot be read", err))?;
    }
    Ok(values)
}

/// Reads the `value` of the scores of `metrics` from a stored map of
/// scores, skipping everything else.
struct ScoreValues<'a> {
    metrics: &'a [Metric],
    values: &'a mut [Option<f64>],
}

impl<'de> DeserializeSeed<'de> for ScoreValues<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ScoreValues<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("scores by metric")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(at) = map.next_key_seed(KeyIn(self.metrics))? {
            match at {
                Some(i) => self.values[i] = map.next_value_seed(ValueOf)?,
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
}

/// A key's place among the metrics' keys, read without copying it.
struct KeyIn<'a>(&'a [Metric]);

impl<'de> DeserializeSeed<'de> for KeyIn<'_> {
    type Value = Option<usize>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<usize>, D::Error> {
        d.deserialize_str(self)
    }
}

impl Visitor<'_> for KeyIn<'_> {
    type Value = Option<usize>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a metric's key")
    }

    fn visit_str<E: serde::de::Error>(self, key: &str) -> Result<Option<usize>, E> {
        Ok(self.0.iter().position(|m| m.key == key))
    }
}

/// A score's `value` (what [`Score`](evalfleet_types::Score) reads as its
/// value), the rest skipped.
struct ValueOf;

impl<'de> DeserializeSeed<'de> for ValueOf {
    type Value = Option<f64>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<f64>, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ValueOf {
    type Value = Option<f64>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a score")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Option<f64>, A::Error> {
        let mut value = None;
        while let Some(is_value) = map.next_key_seed(IsValue)? {
            if is_value {
                value = map.next_value::<Option<f64>>()?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(value)
    }
}

/// Whether a score's key is `value`.
struct IsValue;

impl<'de> DeserializeSeed<'de> for IsValue {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_str(self)
    }
}

impl Visitor<'_> for IsValue {
    type Value = bool;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a score's key")
    }

    fn visit_str<E: serde::de::Error>(self, key: &str) -> Result<bool, E> {
        Ok(key == "value")
    }
}

/// A run's results in `order`, a page at a time.
struct Cursor<'a> {
    run_id: &'a str,
    order: ResultOrder,
    metrics: &'a [Metric],
    by: &'a [String],
    page: VecDeque<Lean>,
    /// The last result read: its id and seq.
    after: Option<(String, u64)>,
    ended: bool,
}

impl<'a> Cursor<'a> {
    fn new(run_id: &'a str, order: ResultOrder, metrics: &'a [Metric], by: &'a [String]) -> Self {
        Self {
            run_id,
            order,
            metrics,
            by,
            page: VecDeque::new(),
            after: None,
            ended: false,
        }
    }

    /// The next result's id, reading a page when the last is used up.
    fn peek(&mut self, store: &mut dyn Store) -> Result<Option<&str>, StoreError> {
        if self.page.is_empty() && !self.ended {
            let after = self.after.as_ref().map(|(id, seq)| (id.as_str(), *seq));
            let (metrics, by, page) = (self.metrics, self.by, &mut self.page);
            let read = store.results_page(
                self.run_id,
                self.order,
                after,
                PAGE,
                !by.is_empty(),
                &mut |view| {
                    page.push_back(Lean {
                        seq: view.seq,
                        item_id: view.item_id.to_owned(),
                        values: values_of(&view, metrics)?,
                        group: group_of(view.item, by),
                    });
                    Ok(())
                },
            )?;
            self.ended = read < PAGE;
            self.after = self.page.back().map(|r| (r.item_id.clone(), r.seq));
        }
        Ok(self.page.front().map(|r| r.item_id.as_str()))
    }

    fn take(&mut self) -> Option<Lean> {
        self.page.pop_front()
    }
}

/// A disagreement and its place in the first run (the heap keeps the
/// first `limit` by place).
struct Placed(u64, Disagreement);

impl PartialEq for Placed {
    fn eq(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}
impl Eq for Placed {}
impl PartialOrd for Placed {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Placed {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.cmp(&other.0)
    }
}

/// A run's own sums per metric and category over all its items, as its
/// report takes them (an item without a usable answer at the worst value,
/// one the metric could not score in none: [`judged_value`]), so that
/// [`stats::estimate`] gives the figures its report shows.
struct Means {
    /// Per metric: category → sums (`all` among them).
    groups: Vec<BTreeMap<String, Moments>>,
}

impl Means {
    fn new(metrics: &[Metric]) -> Self {
        Self {
            groups: vec![BTreeMap::new(); metrics.len()],
        }
    }

    fn add(&mut self, values: &[Option<f64>], group: &str) {
        for (value, groups) in values.iter().zip(&mut self.groups) {
            let Some(v) = *value else {
                continue;
            };
            let mut add = |group: &str| match groups.get_mut(group) {
                Some(sums) => sums.add(v),
                None => {
                    let mut sums = Moments::default();
                    sums.add(v);
                    groups.insert(group.to_owned(), sums);
                }
            };
            add(metrics::ALL);
            if group != metrics::ALL {
                add(group);
            }
        }
    }

    /// Each metric and category's mean and interval.
    fn estimates(self, metrics: &[Metric]) -> HashMap<(String, String), Estimate> {
        metrics
            .iter()
            .zip(self.groups)
            .flat_map(|(m, groups)| {
                groups
                    .into_iter()
                    .map(|(group, sums)| ((m.key.clone(), group), stats::estimate(&sums)))
            })
            .collect()
    }
}

/// Compares `runs[1..]` each with `runs[0]` on the metrics every run has,
/// by the first run's categories for `by`; lists the first `limit` items
/// each disagrees with the first on `metric` (default: the first metric
/// they share) in the first run's order.
pub fn compare(
    store: &mut dyn Store,
    runs: &[String],
    by: &[String],
    metric: Option<&str>,
    limit: usize,
) -> Result<Compared, ReportError> {
    if runs.len() < 2 {
        return Err(ReportError::Compare(
            "compare needs at least two runs".to_owned(),
        ));
    }
    if by.iter().any(|f| f == super::groups::PROMPT) {
        return Err(ReportError::Compare(format!(
            "--by {}: a comparison groups by item fields only (an item may have had another prompt in each run); `evalfleet report RUN_ID --by {}` groups one run by its prompts",
            super::groups::PROMPT,
            super::groups::PROMPT
        )));
    }
    let judged: Vec<Judged> = runs
        .iter()
        .map(|id| Judged::load(store, id))
        .collect::<Result<_, _>>()?;
    let base = &judged[0];
    let shared: Vec<Metric> = base
        .metrics
        .iter()
        .filter(|m| {
            judged[1..]
                .iter()
                .all(|r| r.metrics.iter().any(|o| o.key == m.key))
        })
        .cloned()
        .collect();
    if shared.is_empty() {
        return Err(ReportError::Compare(
            "the runs share no metric (compare uses the metrics every run has)".to_owned(),
        ));
    }
    let listed = match metric {
        None => 0,
        Some(key) => shared.iter().position(|m| m.key == key).ok_or_else(|| {
            ReportError::Compare(format!(
                "the runs share no metric '{key}' (they share {})",
                shared
                    .iter()
                    .map(|m| m.key.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })?,
    };
    let mut outcomes = Vec::with_capacity(runs.len());
    for run_id in runs {
        let report = super::report_with(store, run_id, &[], None, &mut |_, _, _| {})?;
        outcomes.push(RunOutcome {
            run_id: run_id.clone(),
            outcome: report.outcome,
        });
    }
    let mut out = Compared {
        outcomes,
        coverage: Vec::new(),
        comparisons: Vec::new(),
        disagreements: Vec::new(),
    };
    let question = Question {
        shared: &shared,
        by,
        listed,
        limit,
    };
    let mut base_estimates = None;
    for other in &judged[1..] {
        let mut pass = None;
        for order in [ResultOrder::Seq, ResultOrder::Key] {
            let summarise = base_estimates.is_none();
            pass = merge(store, base, other, order, &question, summarise)?;
            if pass.is_some() {
                break;
            }
        }
        let Some(pass) = pass else {
            return Err(ReportError::Compare(
                "the runs could not be read side by side".to_owned(),
            ));
        };
        if let Some(own) = pass.base_means {
            base_estimates = Some(own.estimates(&shared));
        }
        let ours = base_estimates.as_ref();
        let theirs = pass.other_means.estimates(&shared);
        let unknown = stats::estimate(&Moments::default());
        for (m, groups) in shared.iter().zip(pass.pairs) {
            for (group, pairs) in groups {
                let key = (m.key.clone(), group.clone());
                out.comparisons.push(Comparison {
                    metric: m.key.clone(),
                    a: base.run.run_id.clone(),
                    b: other.run.run_id.clone(),
                    n: pairs.n(),
                    mean_a: pairs.a.mean(),
                    mean_b: pairs.b.mean(),
                    estimate_a: ours.and_then(|e| e.get(&key)).copied().unwrap_or(unknown),
                    estimate_b: theirs.get(&key).copied().unwrap_or(unknown),
                    paired: pairs.paired(),
                    group,
                });
            }
        }
        out.coverage.push(pass.coverage);
        out.disagreements.push(pass.disagreements);
    }
    Ok(out)
}

/// What one pass over two runs found.
struct Pass {
    coverage: Coverage,
    /// Per metric: category → the pairs.
    pairs: Vec<BTreeMap<String, Pairs>>,
    base_means: Option<Means>,
    other_means: Means,
    disagreements: Disagreements,
}

/// What every pass of a comparison asks, whichever runs it reads.
struct Question<'a> {
    /// The metrics the runs share.
    shared: &'a [Metric],
    /// The fields categories are made of.
    by: &'a [String],
    /// The metric (its place in `shared`) whose disagreements are listed.
    listed: usize,
    /// Disagreements listed at most.
    limit: usize,
}

/// Reads `base` and `other` side by side in `order`; in dataset order,
/// `None` at the first place where their ids differ.
fn merge(
    store: &mut dyn Store,
    base: &Judged,
    other: &Judged,
    order: ResultOrder,
    question: &Question<'_>,
    summarise_base: bool,
) -> Result<Option<Pass>, ReportError> {
    let Question {
        shared,
        by,
        listed,
        limit,
    } = *question;
    let (a_id, b_id) = (base.run.run_id.as_str(), other.run.run_id.as_str());
    let same_dataset = base.run.dataset.sha256 == other.run.dataset.sha256;
    // Runs of one dataset read in dataset order pair each place with the
    // same item (its id, unique in the file), so the second run's
    // categories are the first's and its items' rows are not read; a place
    // of it left unpaired starts the comparison again in id order.
    let borrow = order == ResultOrder::Seq && same_dataset && !by.is_empty();
    // Answers are read only for the disagreements listed, at the end.
    let mut a = Cursor::new(a_id, order, shared, by);
    let mut b = Cursor::new(b_id, order, shared, if borrow { &[] } else { by });
    let mut base_means = summarise_base.then(|| Means::new(shared));
    let mut other_means = Means::new(shared);
    let mut pairs: Vec<BTreeMap<String, Pairs>> = vec![BTreeMap::new(); shared.len()];
    let mut coverage = Coverage {
        a: a_id.to_owned(),
        b: b_id.to_owned(),
        items_a: 0,
        items_b: 0,
        paired: 0,
        same_dataset,
    };
    let mut disagreements = Disagreements {
        metric: shared[listed].key.clone(),
        a: a_id.to_owned(),
        b: b_id.to_owned(),
        compared: 0,
        total: 0,
        items: Vec::new(),
    };
    let mut first: BinaryHeap<Placed> = BinaryHeap::new();
    loop {
        // Once one run has ended, the other's rest is unpaired in either
        // order: in dataset order, every id before was paired with itself.
        let next = match (a.peek(store)?, b.peek(store)?) {
            (None, None) => break,
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (Some(x), Some(y)) if order == ResultOrder::Key => x.cmp(y),
            (Some(x), Some(y)) if x == y => Ordering::Equal,
            (Some(_), Some(_)) => return Ok(None),
        };
        let left = (next != Ordering::Greater).then(|| a.take()).flatten();
        let right = (next != Ordering::Less).then(|| b.take()).flatten();
        if borrow && left.is_none() && right.is_some() {
            return Ok(None);
        }
        if let Some(r) = &left {
            coverage.items_a += 1;
            if let Some(means) = &mut base_means {
                means.add(&r.values, &r.group);
            }
        }
        if let Some(r) = &right {
            coverage.items_b += 1;
            let group = match &left {
                Some(x) if borrow => &x.group,
                _ => &r.group,
            };
            other_means.add(&r.values, group);
        }
        let (Some(x), Some(y)) = (&left, &right) else {
            continue;
        };
        let group = &x.group;
        coverage.paired += 1;
        for (i, groups) in pairs.iter_mut().enumerate() {
            // A pair either side of which could not be scored is no
            // comparison.
            let (Some(va), Some(vb)) = (x.values[i], y.values[i]) else {
                continue;
            };
            let mut add = |group: &str| {
                // A group's name is copied once, when it is first seen.
                match groups.get_mut(group) {
                    Some(p) => p.add(va, vb),
                    None => {
                        let mut p = Pairs::default();
                        p.add(va, vb);
                        groups.insert(group.to_owned(), p);
                    }
                }
            };
            add(metrics::ALL);
            if group != metrics::ALL {
                add(group);
            }
            if i != listed {
                continue;
            }
            disagreements.compared += 1;
            if (va - vb).abs() <= 1e-9 {
                continue;
            }
            disagreements.total += 1;
            if limit == 0 || first.len() == limit && first.peek().is_some_and(|top| top.0 < x.seq) {
                continue;
            }
            first.push(Placed(
                x.seq,
                Disagreement {
                    item_id: x.item_id.clone(),
                    group: group.clone(),
                    a: va,
                    b: vb,
                    output_a: None,
                    output_b: None,
                },
            ));
            if first.len() > limit {
                first.pop();
            }
        }
    }
    disagreements.items = first.into_sorted_vec().into_iter().map(|p| p.1).collect();
    let ids: Vec<&str> = disagreements
        .items
        .iter()
        .map(|d| d.item_id.as_str())
        .collect();
    let answers_a = store.answers(a_id, &ids, PREVIEW)?;
    let answers_b = store.answers(b_id, &ids, PREVIEW)?;
    for (d, (a, b)) in disagreements
        .items
        .iter_mut()
        .zip(answers_a.into_iter().zip(answers_b))
    {
        d.output_a = a;
        d.output_b = b;
    }
    Ok(Some(Pass {
        coverage,
        pairs,
        base_means,
        other_means,
        disagreements,
    }))
}

#[cfg(test)]
mod tests {
    use serde_json::Map;

    use super::*;
    use evalfleet_types::{ErrorClass, ItemStatus, Verdict};

    #[test]
    fn a_results_values_are_read_from_its_stored_scores_as_a_report_takes_them() {
        let m = Metric::build("exact_match", &Map::new(), None).unwrap();
        let metrics = [m.clone()];
        let view = |status, verdict, scores| ResultView {
            seq: 1,
            item_id: "x",
            status,
            verdict,
            scores,
            item: None,
            failure: None,
        };
        let stored = r#"{"other@1": {"value": 0.5, "detail": [1, {"value": 9}]},
                         "exact_match@1": {"edits": 3, "value": 1.0}}"#;
        let done = view(ItemStatus::Done, Some(Verdict::Ok), Some(stored));
        assert_eq!(values_of(&done, &metrics).unwrap(), [Some(1.0)]);
        // Not scored: in no mean.
        let error = r#"{"exact_match@1": {"error": "no reference"}}"#;
        let unscored = view(ItemStatus::Done, None, Some(error));
        assert_eq!(values_of(&unscored, &metrics).unwrap(), [None]);
        // No usable answer: the worst value, whatever was stored.
        let failed = view(ItemStatus::Failed, None, None);
        assert_eq!(values_of(&failed, &metrics).unwrap(), [Some(m.missing())]);
        // A request the server found wrong: the item's and the model's.
        let refused = ResultView {
            failure: Some(ErrorClass::Fatal),
            ..failed
        };
        assert_eq!(values_of(&refused, &metrics).unwrap(), [Some(m.missing())]);
        // Failed for the server's sake: in no mean.
        for class in [
            ErrorClass::Retryable,
            ErrorClass::BadResponse,
            ErrorClass::Stalled,
        ] {
            let lost = ResultView {
                failure: Some(class),
                ..failed
            };
            assert_eq!(values_of(&lost, &metrics).unwrap(), [None], "{class:?}");
        }
        let unparsed = view(ItemStatus::Done, Some(Verdict::Unparsed), Some(stored));
        assert_eq!(values_of(&unparsed, &metrics).unwrap(), [Some(m.missing())]);
        let broken = view(
            ItemStatus::Done,
            None,
            Some(r#"{"exact_match@1": {"value": "a"}}"#),
        );
        assert!(values_of(&broken, &metrics).is_err());
    }

    #[test]
    fn a_category_is_made_of_the_fields_asked_for() {
        let by = ["kind".to_owned(), "level".to_owned()];
        let item = r#"{"question": {"deep": [1, 2]}, "level": 3, "kind": "easy"}"#;
        assert_eq!(group_of(Some(item), &by), "easy / 3");
        assert_eq!(group_of(Some(r#"{"kind": null}"#), &by), "(none) / (none)");
        assert_eq!(group_of(Some("[1, 2]"), &by), "(none) / (none)");
        assert_eq!(group_of(None, &[]), "all");
    }
}
