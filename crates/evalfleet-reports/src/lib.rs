//! What a run's stored answers are worth, as typed reports the CLI, the
//! HTTP API and the dashboard all render: each metric overall and by
//! category with its uncertainty, how many answers could be used, pass@k
//! and majority votes over samples, the code judge's verdicts, and each
//! endpoint's latency and errors; and comparisons of runs on the items they
//! share. Results are read as a stream into running sums, so a report's
//! memory grows with its metrics and categories, not with the run (pass@k
//! holds one row's samples at a time). A finished run's reports are
//! computed once and kept in the store (`kept`).

pub mod agents;
pub mod compare;
pub mod conversation;
pub mod endpoints;
pub mod groups;
pub mod kept;
pub mod metrics;
pub mod outcome;
pub mod resources;
pub mod samples;
pub mod stats;
pub mod trajectories;
pub mod view;

use std::collections::BTreeMap;
use std::path::Path;

use evalfleet_types::{ItemStatus, Verdict};
use serde::Serialize;
use serde_json::Value;

pub use agents::{AgentFigures, agents};
pub use compare::{Compared, Comparison, Coverage, Disagreement, Disagreements, compare};
pub use endpoints::{EndpointSummary, Percentiles, endpoints};
pub use groups::{GroupFigures, GroupMetric};
pub use kept::{Keeping, KeptBody, KeptInMemory, kept_compare, kept_report};
pub use metrics::Summary;
pub use outcome::{Cause, CauseKind, Outcome, OutcomeKind};
pub use resources::{ResourcesReport, SeriesSummary, resources};
pub use samples::SamplesSummary;

use evalfleet_config::{self as config, ConfigError, LoadedConfig};
use evalfleet_eval::{Assessor, Metric};
use evalfleet_store::{RunRecord, Store, StoreError, StoredResult};

/// Why a report cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the stored config of run {run_id} cannot be used")]
    Config {
        run_id: String,
        #[source]
        source: ConfigError,
    },
    #[error("{0}")]
    Metrics(String),
    /// What was asked of a comparison cannot be done.
    #[error("{0}")]
    Compare(String),
    /// A grouping by a field no item has.
    #[error("{0}")]
    Group(String),
}

impl ReportError {
    pub fn fault(&self) -> evalfleet_types::Fault {
        match self {
            Self::Store(err) => err.fault(),
            Self::Config { .. } | Self::Metrics(_) | Self::Compare(_) | Self::Group(_) => {
                evalfleet_types::Fault::BadInput
            }
        }
    }
}

/// How a run's answers turned out: usable on the first try, after re-asks,
/// or not at all.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Fidelity {
    pub valid_first_try: u64,
    pub valid_after_reasks: u64,
    pub unparsed: u64,
    pub invalid: u64,
    /// Answers of a task that checks nothing.
    pub not_checked: u64,
    /// Items with no answer.
    pub failed: u64,
}

impl Fidelity {
    /// Every item counted.
    pub fn total(&self) -> u64 {
        self.valid_first_try
            + self.valid_after_reasks
            + self.unparsed
            + self.invalid
            + self.not_checked
            + self.failed
    }

    fn add(&mut self, result: &StoredResult) {
        let a = &result.assessment;
        let count = match (result.status, a.verdict) {
            (ItemStatus::Failed, _) => &mut self.failed,
            (_, Some(Verdict::Ok)) if a.reasks == 0 => &mut self.valid_first_try,
            (_, Some(Verdict::Ok)) => &mut self.valid_after_reasks,
            (_, Some(Verdict::Unparsed)) => &mut self.unparsed,
            (_, Some(Verdict::Invalid)) => &mut self.invalid,
            (_, None) => &mut self.not_checked,
        };
        *count += 1;
    }
}

/// Everything a report says about one run.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Report {
    pub run_id: String,
    pub name: String,
    /// Items in the run.
    pub items: u64,
    /// What the run came to (complete, incomplete, failed) and why.
    pub outcome: Outcome,
    /// Results by the model that answered them.
    pub models: BTreeMap<String, u64>,
    /// Results by the rule of `task.prompts` that made their messages
    /// (empty when the task has no rules).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub prompts: BTreeMap<String, u64>,
    /// The item fields categories are made of (`--by`, else
    /// `report.by`, else `doc_type` when the items have it; `@prompt`:
    /// the prompt rule).
    pub group_by: Vec<String>,
    pub fidelity: Fidelity,
    /// Each metric overall, then by category.
    pub metrics: Vec<Summary>,
    /// Overall, then each category: every metric's mean with its interval,
    /// and how the answers turned out (structural fidelity).
    pub groups: Vec<GroupFigures>,
    /// pass@k and majority votes, with `task.n` > 1.
    pub samples: Option<SamplesSummary>,
    /// The code judge's problem verdicts, overall (`all`) and by category.
    pub code_verdicts: BTreeMap<String, BTreeMap<String, u64>>,
    /// Each endpoint's attempts, errors, latency and tokens per second.
    pub endpoints: Vec<EndpointSummary>,
    /// The share of answers a metric may fail to score (`report.max_unscored`).
    pub max_unscored: f64,
    /// Metrics that could not score more than that, each in a sentence:
    /// the run's scores cannot be used as they are.
    pub problems: Vec<String>,
    /// Peak and mean of each resource series (`telemetry:`): per GPU, per
    /// endpoint, and evalfleet's own.
    pub resources: ResourcesReport,
    /// Calls, tokens and call time per item of the agents of a `kind:
    /// exec` task (left out when its items' agents made no call).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agents: Option<AgentFigures>,
}

impl Report {
    /// The metrics (overall) that failed to score at least `max_unscored`
    /// of the answers they could judge, each in a sentence.
    fn problems(metrics: &[Summary], max_unscored: f64) -> Vec<String> {
        metrics
            .iter()
            .filter(|s| s.group == metrics::ALL && s.errors > 0)
            .filter(|s| s.unscored_share() >= max_unscored)
            .map(|s| {
                let what = if s.scored == 0 {
                    format!("could not score any of the {} answers it was given", s.errors)
                } else {
                    format!(
                        "could not score {} of the {} answers it was given ({:.1}%, at or above report.max_unscored: {:.1}%)",
                        s.errors,
                        s.errors + s.scored,
                        100.0 * s.unscored_share(),
                        100.0 * max_unscored
                    )
                };
                format!("metric {} {what}: {}", s.metric, s.reasons_line())
            })
            .collect()
    }
}

/// A run, with the task its results are judged by.
pub struct Judged {
    pub run: RunRecord,
    pub config: LoadedConfig,
    pub metrics: Vec<Metric>,
}

impl Judged {
    /// The run `run_id` and its stored task.
    pub fn load(store: &mut dyn Store, run_id: &str) -> Result<Self, ReportError> {
        let run = store.run(run_id)?;
        let config = config::load_snapshot_to_report(&run.config, Path::new(&run.config_dir))
            .map_err(|source| ReportError::Config {
                run_id: run_id.to_owned(),
                source,
            })?;
        let metrics = Assessor::new(&config.config.task.eval)
            .map_err(ReportError::Metrics)?
            .metrics()
            .cloned()
            .collect();
        Ok(Self {
            run,
            config,
            metrics,
        })
    }
}

/// The category of an item for `by`: its fields' values joined by ` / `
/// (`all` without `by`).
pub fn group_of(item: Option<&str>, by: &[String]) -> String {
    group_with_prompt(item, None, by)
}

/// [`group_of`], where `@prompt` in `by` stands for `prompt`, the rule of
/// `task.prompts` that made the item's messages.
pub fn group_with_prompt(item: Option<&str>, prompt: Option<&str>, by: &[String]) -> String {
    if by.is_empty() {
        return metrics::ALL.to_owned();
    }
    let values = item.map(|text| fields_of(text, by)).unwrap_or_default();
    by.iter()
        .enumerate()
        .map(|(i, field)| match values.get(i).and_then(Option::as_ref) {
            _ if field == groups::PROMPT => prompt.unwrap_or("(none)").to_owned(),
            None | Some(Value::Null) => "(none)".to_owned(),
            Some(Value::String(s)) => s.clone(),
            Some(other) => other.to_string(),
        })
        .collect::<Vec<_>>()
        .join(" / ")
}

/// The values of the fields `by` of the JSON object `text` (none for a
/// field it lacks, or when it is no object): only those are built, the
/// rest of the row is skipped.
fn fields_of(text: &str, by: &[String]) -> Vec<Option<Value>> {
    use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};

    struct Fields<'a>(&'a [String]);

    impl<'de> Visitor<'de> for Fields<'_> {
        type Value = Vec<Option<Value>>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an item's row")
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut out = vec![None; self.0.len()];
            while let Some(key) = map.next_key::<std::borrow::Cow<'_, str>>()? {
                match self.0.iter().position(|f| *f == key) {
                    Some(i) => out[i] = Some(map.next_value::<Value>()?),
                    None => {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
            }
            Ok(out)
        }
    }

    impl<'de> DeserializeSeed<'de> for Fields<'_> {
        type Value = Vec<Option<Value>>;

        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_map(self)
        }
    }

    let mut de = serde_json::Deserializer::from_str(text);
    Fields(by).deserialize(&mut de).unwrap_or_default()
}

/// What a result gives `metric` in a comparison or pass@k: its value, the
/// worst value when it has no usable answer (the model's doing), or
/// nothing when the metric could not score it (not the model's doing: it
/// is left out).
pub fn judged_value(result: &StoredResult, metric: &Metric) -> Option<f64> {
    if lost(result.status, result.failure) {
        return None;
    }
    if !answered(result.status, result.assessment.verdict) {
        return Some(metric.missing());
    }
    result
        .assessment
        .scores
        .get(&metric.key)
        .and_then(|s| s.value)
}

/// Whether an item failed for the server's sake (its last call was
/// refused, cut, timed out, or answered with the server's own error): it
/// says nothing of the model, so it is counted as failed and in no mean.
pub(crate) fn lost(status: ItemStatus, failure: Option<evalfleet_types::ErrorClass>) -> bool {
    status == ItemStatus::Failed
        && failure.is_some_and(evalfleet_types::ErrorClass::is_the_server_s)
}

/// Whether a result has an answer its metrics score: it did not fail, and
/// its answer passed checking (or was not checked). Otherwise each metric
/// counts it at its worst value ([`judged_value`]), unless it was [`lost`].
pub(crate) fn answered(status: ItemStatus, verdict: Option<evalfleet_types::Verdict>) -> bool {
    status != ItemStatus::Failed && verdict.is_none_or(evalfleet_types::Verdict::is_ok)
}

/// The fields a report of `run_id` groups by: `by` when given, else the
/// run's `report.by`, else `doc_type` when its first result's item has
/// that field (document datasets), else none.
pub fn grouping(
    store: &mut dyn Store,
    run_id: &str,
    by: &[String],
    config: &config::Config,
) -> Result<Vec<String>, StoreError> {
    if !by.is_empty() {
        return Ok(by.to_vec());
    }
    if let Some(by) = &config.report.by {
        return Ok(by.clone());
    }
    let has = first_item(store, run_id)?
        .and_then(|item| item.get(groups::DOC_TYPE).cloned())
        .is_some_and(|v| !v.is_null());
    Ok(if has {
        vec![groups::DOC_TYPE.to_owned()]
    } else {
        Vec::new()
    })
}

/// The input row of the run's first result (in dataset order), when it
/// has one that is a JSON object.
fn first_item(
    store: &mut dyn Store,
    run_id: &str,
) -> Result<Option<serde_json::Map<String, Value>>, StoreError> {
    let mut first = None;
    store.results_page(
        run_id,
        evalfleet_store::ResultOrder::Seq,
        None,
        1,
        true,
        &mut |result| {
            if let Some(Ok(Value::Object(row))) = result.item.map(serde_json::from_str::<Value>) {
                first = Some(row);
            }
            Ok(())
        },
    )?;
    Ok(first)
}

/// Refuses a grouping by a field no item has (every group says `(none)`
/// for it), naming the fields the items have.
fn check_grouping<'a>(
    store: &mut dyn Store,
    run_id: &str,
    by: &[String],
    groups: impl Iterator<Item = &'a String> + Clone,
) -> Result<(), ReportError> {
    let absent = by.iter().enumerate().find(|(i, field)| {
        *field != groups::PROMPT
            && groups
                .clone()
                .all(|g| g.split(" / ").nth(*i) == Some("(none)"))
    });
    let Some((_, field)) = absent else {
        return Ok(());
    };
    let fields: Vec<String> = first_item(store, run_id)?
        .map(|row| row.keys().cloned().collect())
        .unwrap_or_default();
    Err(ReportError::Group(format!(
        "--by {field}: no item has the field '{field}' (the items have: {}{})",
        fields.join(", "),
        if by.iter().any(|f| f == groups::PROMPT) {
            String::new()
        } else {
            "; @prompt groups by the rule of task.prompts".to_owned()
        }
    )))
}

/// Reads every result of `run_id` in dataset order, each with its category
/// for `by`.
pub fn scan(
    store: &mut dyn Store,
    run_id: &str,
    by: &[String],
    each: &mut dyn FnMut(&StoredResult, &str),
) -> Result<(), StoreError> {
    store.scan_results(run_id, &mut |result| {
        let group = group_with_prompt(result.item.as_deref(), result.prompt.as_deref(), by);
        each(&result, &group);
    })
}

/// The report of run `run_id`, by the categories of `by`; `max_unscored`
/// replaces the run's `report.max_unscored`.
pub fn report(
    store: &mut dyn Store,
    run_id: &str,
    by: &[String],
    max_unscored: Option<f64>,
) -> Result<Report, ReportError> {
    let mut report = report_with(store, run_id, by, max_unscored, &mut |_, _, _| {})?;
    report.endpoints = endpoints(store, run_id)?;
    report.resources = resources(store, run_id)?;
    report.agents = agents(store, run_id)?;
    Ok(report)
}

/// [`report`] without the endpoints' summary and the agents' figures (left
/// empty: they read every attempt and every call), handing each result, with the task's metrics and its group,
/// to `each` on the way: one read of the results serves the report and
/// whatever else the caller writes of them.
pub fn report_with(
    store: &mut dyn Store,
    run_id: &str,
    by: &[String],
    max_unscored: Option<f64>,
    each: &mut dyn FnMut(&[Metric], &StoredResult, &str),
) -> Result<Report, ReportError> {
    let judged = Judged::load(store, run_id)?;
    let by = &grouping(store, run_id, by, &judged.config.config)?;
    let max_unscored = max_unscored.unwrap_or(judged.config.config.report.max_unscored);
    let samples_per_row = judged.config.config.task.samples;
    let mut summaries = metrics::Summaries::new(&judged.metrics);
    let mut samples =
        (samples_per_row > 1).then(|| samples::Samples::new(samples_per_row, &judged.metrics));
    let mut fidelity = Fidelity::default();
    let mut fidelity_by: BTreeMap<String, Fidelity> = BTreeMap::new();
    let mut prompts: BTreeMap<String, u64> = BTreeMap::new();
    let mut models: BTreeMap<String, u64> = BTreeMap::new();
    let mut verdicts: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    let keys: Vec<&str> = judged.metrics.iter().map(|m| m.key.as_str()).collect();
    let mut outcome = Outcome::counting(judged.run.total);
    scan(store, run_id, by, &mut |result, group| {
        each(&judged.metrics, result, group);
        outcome.add(result, &keys);
        summaries.add(
            metrics::Row {
                failed: result.status == ItemStatus::Failed,
                lost: lost(result.status, result.failure),
                verdict: result.assessment.verdict,
                scores: &result.assessment.scores,
            },
            group,
        );
        fidelity.add(result);
        if group != metrics::ALL {
            match fidelity_by.get_mut(group) {
                Some(f) => f.add(result),
                None => {
                    let mut f = Fidelity::default();
                    f.add(result);
                    fidelity_by.insert(group.to_owned(), f);
                }
            }
        }
        if let Some(prompt) = &result.prompt {
            match prompts.get_mut(prompt) {
                Some(count) => *count += 1,
                None => {
                    prompts.insert(prompt.clone(), 1);
                }
            }
        }
        *models
            .entry(result.model.clone().unwrap_or_else(|| "-".to_owned()))
            .or_insert(0) += 1;
        if let Some(verdict) = result
            .assessment
            .code
            .as_ref()
            .and_then(|j| j.get("verdict"))
            .and_then(Value::as_str)
        {
            let mut count = |group: &str| {
                *verdicts
                    .entry(group.to_owned())
                    .or_default()
                    .entry(verdict.to_owned())
                    .or_default() += 1;
            };
            count(metrics::ALL);
            if group != metrics::ALL {
                count(group);
            }
        }
        if let Some(samples) = &mut samples {
            let row = evalfleet_io::dataset::split_sample_id(&result.item_id)
                .map_or(result.item_id.as_str(), |(row, _)| row);
            let values = judged
                .metrics
                .iter()
                .map(|m| judged_value(result, m))
                .collect();
            // A sample with no usable answer votes for nothing.
            let usable = answered(result.status, result.assessment.verdict);
            let vote = usable
                .then(|| {
                    result
                        .assessment
                        .parsed
                        .as_ref()
                        .map(ToString::to_string)
                        .or_else(|| result.output.clone())
                })
                .flatten();
            samples.add(row, values, vote);
        }
    })?;
    if !by.is_empty() && fidelity.total() > 0 {
        check_grouping(store, run_id, by, fidelity_by.keys())?;
    }
    let metrics = summaries.finish();
    fidelity_by.insert(metrics::ALL.to_owned(), fidelity);
    let groups = groups::groups(&metrics, &fidelity_by);
    Ok(Report {
        run_id: judged.run.run_id.clone(),
        name: judged.run.name.clone(),
        items: judged.run.total,
        outcome: outcome.finish(),
        models,
        prompts,
        group_by: by.to_vec(),
        fidelity,
        problems: Report::problems(&metrics, max_unscored),
        max_unscored,
        metrics,
        groups,
        samples: samples.map(samples::Samples::finish),
        code_verdicts: verdicts,
        endpoints: Vec::new(),
        resources: ResourcesReport::default(),
        agents: None,
    })
}
