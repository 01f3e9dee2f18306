//! `evalfleet score`: a run's stored answers parsed, checked and scored
//! again, with no call to any model: after a metric is added to the task,
//! or its definition changed. LLM-judge metrics read their judge's replies
//! from the cache (without one a stored score is kept); a code task keeps
//! its judgements unless asked to run the programs again (or its
//! `task.code` changed). With `--unjudged`, the judges are asked again for
//! the answers they could not judge in the run, and only those: the code
//! judge runs their programs, an LLM judge is called.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use evalfleet_types::{Assessment, ItemStatus, Verdict};
use futures_util::StreamExt;
use serde_json::{Map, Value};

use evalfleet_config::{self as config, ConfigError, LoadedConfig};
use evalfleet_eval::Assessor;
use evalfleet_fleet::runtime::MockStarter;
use evalfleet_io::dataset::Row;
use evalfleet_pipeline::task::code;
use evalfleet_store::{Store, StoreError, StoredResult};

/// The task keys a new config's `task` replaces: its checking and scoring.
const ASSESSMENT_KEYS: [&str; 8] = [
    "parse",
    "schema",
    "schema_file",
    "max_reasks",
    "structured_output",
    "metrics",
    "metric_backends",
    "code",
];

/// Why stored answers cannot be scored again.
#[derive(Debug, thiserror::Error)]
pub enum RescoreError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// What was asked does not fit the run.
    #[error("{0}")]
    Unfit(String),
    #[error("the code judge cannot start")]
    CodeJudge(#[source] evalfleet_sandbox::CodeJudgeError),
    #[error(transparent)]
    MetricBackend(#[from] evalfleet_eval::metric_backend::BackendError),
}

impl RescoreError {
    pub fn fault(&self) -> evalfleet_types::Fault {
        match self {
            Self::Store(err) => err.fault(),
            Self::Config(_) | Self::Unfit(_) => evalfleet_types::Fault::BadInput,
            Self::CodeJudge(err) => err.fault(),
            Self::MetricBackend(err) => err.fault(),
        }
    }
}

/// A run's answers about to be scored again.
pub struct Plan {
    run_id: String,
    /// The run's stored config, with the new task's checking and scoring.
    snapshot: Value,
    loaded: LoadedConfig,
    assessor: Assessor,
    /// Metric keys to score again (the others keep their scores).
    only: Option<Vec<String>>,
    rejudge: bool,
    /// Of the answers, judge again only those the judge could not judge.
    unjudged: bool,
    /// The folder the run's config was in (its relative paths).
    config_dir: PathBuf,
    /// Starts a `kind: mock` judge endpoint to ask again (`--unjudged`).
    mocks: Option<Arc<dyn MockStarter>>,
}

impl Plan {
    /// The code judge runs again over the answers it could not judge (its
    /// server unreachable, its sandbox failing), and only those: the run's
    /// other judgements stand.
    ///
    /// LLM judges are asked again for the answers whose judge call failed
    /// (its endpoint down past `retry.judge_for`, its answers errors): the
    /// judge endpoint must be reachable (`kind: external`) or the built-in
    /// mock (started with `mocks`); the endpoint's secrets are read from the
    /// environment as the run read them.
    pub fn unjudged_only(self, mocks: Arc<dyn MockStarter>) -> Self {
        Self {
            rejudge: self.rejudge || self.loaded.config.task.kind.code().is_some(),
            unjudged: true,
            mocks: Some(mocks),
            ..self
        }
    }

    /// Plans scoring run `run_id` again, with the checking and scoring of
    /// `config` when given, only `metrics` (names or keys; all when empty),
    /// and the code judge run again with `rejudge`.
    pub fn new(
        store: &mut dyn Store,
        run_id: &str,
        config: Option<&LoadedConfig>,
        metrics: &[String],
        rejudge: bool,
    ) -> Result<Self, RescoreError> {
        let run = store.run(run_id)?;
        if !evalfleet_store::worker::live_workers(store, run_id)?.is_empty() {
            return Err(RescoreError::Unfit(format!(
                "run {run_id} is running; score it when it has stopped"
            )));
        }
        let mut snapshot = run.config.clone();
        if let Some(new) = config {
            let task = snapshot
                .get_mut("task")
                .and_then(Value::as_object_mut)
                .ok_or_else(|| RescoreError::Unfit("the stored config has no task".to_owned()))?;
            for key in ASSESSMENT_KEYS {
                task.remove(key);
                if let Some(value) = new.snapshot.get("task").and_then(|t| t.get(key)) {
                    task.insert(key.to_owned(), value.clone());
                }
            }
            // A schema file is read now and stored inline: the stored config
            // must not depend on where the new file was.
            if task.remove("schema_file").is_some()
                && let Some(schema) = &new.config.task.eval.schema
            {
                task.insert("schema".to_owned(), schema.clone());
            }
        }
        let code_changed = snapshot.get("task").and_then(|t| t.get("code"))
            != run.config.get("task").and_then(|t| t.get("code"));
        // Scoring calls no endpoint: their secrets are not needed.
        let loaded = config::load_snapshot_to_read(&snapshot, Path::new(&run.config_dir))?;
        let assessor = Assessor::new(&loaded.config.task.eval).map_err(RescoreError::Unfit)?;
        let rejudge = match loaded.config.task.kind.code() {
            Some(_) => rejudge || code_changed,
            None if rejudge => {
                return Err(RescoreError::Unfit(format!(
                    "--rejudge: run {run_id} has no code task (task.code)"
                )));
            }
            None => false,
        };
        let keys: Vec<String> = assessor.metrics().map(|m| m.key.clone()).collect();
        let only = if metrics.is_empty() {
            None
        } else {
            let mut chosen = Vec::new();
            for name in metrics {
                let found: Vec<&String> = keys.iter().filter(|k| chooses(name, k)).collect();
                if found.is_empty() {
                    return Err(RescoreError::Unfit(format!(
                        "--metrics: '{name}' is not among the task's metrics ({})",
                        keys.join(", ")
                    )));
                }
                chosen.extend(found.into_iter().cloned());
            }
            Some(chosen)
        };
        Ok(Self {
            run_id: run_id.to_owned(),
            snapshot,
            loaded,
            assessor,
            only,
            rejudge,
            unjudged: false,
            config_dir: PathBuf::from(&run.config_dir),
            mocks: None,
        })
    }

    /// The outside metric backends scoring would start (each runs commands:
    /// its `setup` and its program).
    pub fn backends(&self) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for m in self.assessor.metrics() {
            let evalfleet_eval::metrics::Kind::Backend { backend, .. } = &m.kind else {
                continue;
            };
            let chosen = self.only.as_ref().is_none_or(|only| only.contains(&m.key));
            if chosen && !names.contains(backend) {
                names.push(backend.clone());
            }
        }
        names
    }

    /// The cache file the run's judge replies are in, when not the store.
    pub fn cache_file(&self) -> Option<&PathBuf> {
        self.loaded.config.cache.path.as_ref()
    }

    /// Scores every done item again, and stores the new assessments with
    /// the new config in one transaction. The code judge (with
    /// `rejudge`) makes its sandbox under `sandbox_dir`.
    pub async fn apply(
        self,
        store: &mut dyn Store,
        sandbox_dir: &Path,
    ) -> Result<Rescored, RescoreError> {
        let Self {
            run_id,
            snapshot,
            loaded,
            assessor,
            only,
            rejudge,
            unjudged,
            config_dir,
            mocks,
        } = self;
        // LLM-judge metrics read their judges' replies from the cache.
        let judge_identities: HashMap<String, String> = loaded
            .config
            .endpoints
            .iter()
            .filter(|e| !e.takes_items())
            .map(|e| (e.name.clone(), loaded.config.cache_identity(e)))
            .collect();
        let mut stored: Vec<StoredResult> = Vec::new();
        store.scan_results(&run_id, &mut |r: StoredResult| {
            if r.status == ItemStatus::Done {
                stored.push(r);
            }
        })?;
        // The LLM judges' replies to the answers they could not judge in the
        // run, asked again (`--unjudged`).
        let asked_again = match (&mocks, unjudged) {
            (Some(mocks), true) => {
                let again = JudgeAgain {
                    snapshot: &snapshot,
                    config_dir: &config_dir,
                    loaded: &loaded,
                    assessor: &assessor,
                    only: only.as_deref(),
                };
                again.ask(&stored, mocks.clone()).await?
            }
            _ => AskedAgain::default(),
        };
        let code_key = assessor
            .metrics()
            .find(|m| matches!(m.kind, evalfleet_eval::metrics::Kind::CodeAccepted))
            .map(|m| m.key.clone());
        let mut assessed: Vec<(u64, Assessment)> = Vec::with_capacity(stored.len());
        // The usable answers of a code task to judge again: (place in
        // `assessed`, item, answer).
        let mut programs: Vec<(u64, Value, String)> = Vec::new();
        let mut unreadable = 0u64;
        let mut lookup_error = None;
        for r in &stored {
            let item: Row = r
                .item
                .as_deref()
                .and_then(|t| serde_json::from_str(t).ok())
                .unwrap_or_else(|| {
                    unreadable += 1;
                    Map::new()
                });
            let output = r.output.as_deref().unwrap_or("");
            let new = assessor.rescore(
                output,
                &item,
                r.assessment.reasks,
                only.as_deref(),
                &r.assessment.scores,
                &mut |request| {
                    let messages = request.messages.as_ref().ok()?;
                    if let Some(reply) = asked_again
                        .replies
                        .get(&(request.key.clone(), messages.get().to_owned()))
                    {
                        return Some(reply.clone());
                    }
                    let identity = judge_identities.get(&request.endpoint)?;
                    match store.cache_get(&evalfleet_config::cache::key(identity, 0, messages), 0) {
                        Ok(hit) => hit.map(|h| h.content),
                        Err(err) => {
                            lookup_error.get_or_insert(err);
                            None
                        }
                    }
                },
            );
            // An answer the judge could not judge has no code score.
            let judged = code_key.as_ref().is_some_and(|key| {
                r.assessment
                    .scores
                    .get(key)
                    .is_some_and(|s| s.value.is_some())
            });
            if rejudge && new.verdict == Some(Verdict::Ok) && !(unjudged && judged) {
                programs.push((
                    assessed.len() as u64,
                    Value::Object(item),
                    output.to_owned(),
                ));
            }
            assessed.push((r.seq, new));
        }
        if let Some(err) = lookup_error {
            return Err(err.into());
        }
        let backend_scored =
            score_with_backends(&assessor, &stored, &mut assessed, only.as_deref()).await?;

        let mut rejudged = None;
        if rejudge && let (Some(settings), Some(key)) = (loaded.config.task.kind.code(), code_key) {
            let started = Instant::now();
            let count = programs.len();
            let judge = code::start(settings, sandbox_dir)
                .await
                .map_err(RescoreError::CodeJudge)?;
            for (place, json, score) in code::judge_again(&judge, programs).await {
                let Some((_, a)) = usize::try_from(place)
                    .ok()
                    .and_then(|i| assessed.get_mut(i))
                else {
                    continue;
                };
                a.scores.insert(key.clone(), score);
                a.code = json;
            }
            rejudged = Some((count, started.elapsed()));
        }
        let (backend_errors, backend_error) = backend_errors(&assessor, &assessed);
        store.put_assessments(&run_id, &assessed, &snapshot)?;
        Ok(Rescored {
            judged_again: asked_again.calls,
            judged_again_failed: asked_again.failed,
            answers: assessed.len() as u64,
            usable: assessed.iter().filter(|(_, a)| a.usable()).count() as u64,
            metrics: assessor.metrics().map(|m| m.key.clone()).collect(),
            rejudged,
            unreadable,
            backend_scored,
            backend_errors,
            backend_error,
        })
    }
}

/// What a judge's score says when its call failed in the run.
const JUDGE_FAILED: &str = "the judge failed";

/// The LLM judges' replies asked again, by metric key and messages.
#[derive(Default)]
struct AskedAgain {
    replies: HashMap<(String, String), String>,
    calls: u64,
    failed: u64,
}

/// Asks the LLM judges again for the answers they could not judge in the
/// run (`score --unjudged`).
struct JudgeAgain<'a> {
    snapshot: &'a Value,
    config_dir: &'a Path,
    loaded: &'a LoadedConfig,
    assessor: &'a Assessor,
    only: Option<&'a [String]>,
}

impl JudgeAgain<'_> {
    async fn ask(
        &self,
        stored: &[StoredResult],
        mocks: Arc<dyn MockStarter>,
    ) -> Result<AskedAgain, RescoreError> {
        // The calls to make again: one per metric and distinct messages.
        let mut wanted: Vec<(String, String, Box<serde_json::value::RawValue>)> = Vec::new();
        let mut seen: HashSet<(String, String)> = HashSet::new();
        for r in stored {
            let Some(output) = r.output.as_deref() else {
                continue;
            };
            let item: Row = r
                .item
                .as_deref()
                .and_then(|t| serde_json::from_str(t).ok())
                .unwrap_or_default();
            let checked = self.assessor.check(output);
            for call in self.assessor.llm_judge_calls(&checked, &item) {
                if self.only.is_some_and(|only| !only.contains(&call.key)) {
                    continue;
                }
                let failed = r.assessment.scores.get(&call.key).is_some_and(|score| {
                    score.value.is_none()
                        && score
                            .error
                            .as_deref()
                            .is_some_and(|e| e.starts_with(JUDGE_FAILED))
                });
                let Ok(messages) = call.messages else {
                    continue;
                };
                let key = (call.key.clone(), messages.get().to_owned());
                if failed && seen.insert(key) {
                    wanted.push((call.endpoint, call.key, messages));
                }
            }
        }
        let mut asked = AskedAgain::default();
        if wanted.is_empty() {
            return Ok(asked);
        }
        // The judge's endpoint as the run had it, its secrets read again.
        let config = config::load_snapshot(self.snapshot, self.config_dir)
            .map_err(|err| {
                RescoreError::Unfit(format!(
                    "--unjudged asks the judge again, with the endpoint the run used: {err}"
                ))
            })?
            .config;
        let mut clients = HashMap::new();
        let mut guards = Vec::new();
        for (name, _, _) in &wanted {
            if clients.contains_key(name) {
                continue;
            }
            let endpoint = config
                .endpoints
                .iter()
                .find(|e| &e.name == name)
                .ok_or_else(|| {
                    RescoreError::Unfit(format!(
                        "--unjudged: no endpoint '{name}' in the run's config"
                    ))
                })?;
            let url = match &endpoint.kind {
                config::EndpointKind::External { base_url, .. } => base_url.clone(),
                config::EndpointKind::Mock(settings) => {
                    let (url, guard) = mocks.start((**settings).clone()).await.map_err(|err| {
                        RescoreError::Unfit(format!(
                            "--unjudged: the judge's mock did not start: {err}"
                        ))
                    })?;
                    guards.push(guard);
                    url
                }
                kind => {
                    return Err(RescoreError::Unfit(format!(
                        "--unjudged: judge endpoint '{name}' is an engine evalfleet starts (kind: {}), which score does not start: judge those answers again in a run of its own (resume the run with the engine up)",
                        kind.name()
                    )));
                }
            };
            let client = evalfleet_fleet::client::ChatClient::new(
                endpoint,
                &url,
                &config.task.params,
                false,
            )
            .map_err(|err| RescoreError::Unfit(format!("--unjudged: endpoint '{name}': {err}")))?;
            let slots = Arc::new(tokio::sync::Semaphore::new(
                endpoint.max_concurrency().clamp(1, 64),
            ));
            clients.insert(name.clone(), (Arc::new(client), slots));
        }
        // Tried again for `retry.judge_for`, however few `max_attempts`
        // (as in a run).
        let retry = evalfleet_types::RetryPolicy {
            max_attempts: u32::MAX,
            ..self.loaded.config.retry
        };
        let within = self.loaded.config.judge_retry_for;
        let calls = wanted.into_iter().map(|(name, key, messages)| {
            let (client, slots) = clients[&name].clone();
            async move {
                let _slot = slots.acquire_owned().await.ok();
                let reply = retry
                    .run_within(
                        within,
                        || async { client.complete(&messages).await.result },
                        |err| {
                            if err.class().is_retryable() {
                                evalfleet_types::retry::Retry::After(err.retry_after())
                            } else {
                                evalfleet_types::retry::Retry::Never
                            }
                        },
                    )
                    .await;
                (key, messages.get().to_owned(), reply)
            }
        });
        let mut replies = futures_util::stream::iter(calls).buffer_unordered(64);
        while let Some((key, messages, reply)) = replies.next().await {
            asked.calls += 1;
            match reply {
                Ok(completion) => {
                    asked.replies.insert((key, messages), completion.content);
                }
                Err(err) => {
                    asked.failed += 1;
                    tracing::warn!(
                        "The judge failed again for metric {key}: {}",
                        evalfleet_types::error_text(&err)
                    );
                }
            }
        }
        drop(guards);
        Ok(asked)
    }
}

/// How many scores of the outside backends' metrics in `assessed` are
/// errors, and the first.
fn backend_errors(assessor: &Assessor, assessed: &[(u64, Assessment)]) -> (u64, Option<String>) {
    let keys: Vec<&str> = assessor
        .metrics()
        .filter(|m| m.backend() != evalfleet_eval::backend::NATIVE)
        .map(|m| m.key.as_str())
        .collect();
    let mut count = 0;
    let mut first = None;
    for (_, a) in assessed {
        for error in keys
            .iter()
            .filter_map(|k| a.scores.get(*k).and_then(|s| s.error.as_deref()))
        {
            count += 1;
            first.get_or_insert_with(|| error.to_owned());
        }
    }
    (count, first)
}

/// Scores the usable answers in `assessed` (taken from `stored`, in the
/// same order) by the outside backends' metrics (those in `only`, when
/// given): how many answers were sent.
async fn score_with_backends(
    assessor: &Assessor,
    stored: &[StoredResult],
    assessed: &mut [(u64, Assessment)],
    only: Option<&[String]>,
) -> Result<u64, RescoreError> {
    let wanted = assessor.metrics().any(|m| {
        m.backend() != evalfleet_eval::backend::NATIVE
            && only.is_none_or(|only| only.contains(&m.key))
    });
    if !wanted {
        return Ok(0);
    }
    let mut work = Vec::new();
    for (place, (r, (_, a))) in stored.iter().zip(assessed.iter()).enumerate() {
        if a.verdict != Some(Verdict::Ok) {
            continue;
        }
        let checked = evalfleet_eval::Checked {
            parsed: a.parsed.clone(),
            valid: true,
            error: None,
        };
        let item: Row = r
            .item
            .as_deref()
            .and_then(|t| serde_json::from_str(t).ok())
            .unwrap_or_default();
        let requests = assessor.backend_requests(&checked, &item, only);
        if !requests.is_empty() {
            work.push((place, r.item_id.clone(), requests));
        }
    }
    let mut used: Vec<String> = Vec::new();
    for (_, _, requests) in &work {
        for request in requests {
            if !used.contains(&request.backend) {
                used.push(request.backend.clone());
            }
        }
    }
    let used: Vec<&str> = used.iter().map(String::as_str).collect();
    let Some(backends) =
        evalfleet_eval::metric_backend::Backends::start(&assessor.spec().backends, &used).await?
    else {
        return Ok(0);
    };
    let sent = work.len() as u64;
    let mut scored = futures_util::stream::iter(work)
        .map(|(place, item, requests)| {
            let backends = backends.clone();
            async move { (place, backends.score(&item, requests).await) }
        })
        .buffer_unordered(backends.queue().max(1));
    while let Some((place, scores)) = scored.next().await {
        if let Some((_, a)) = assessed.get_mut(place) {
            a.scores.extend(scores);
        }
    }
    Ok(sent)
}

/// Whether `--metrics NAME` chooses the metric `key`: `anls` is every
/// anls, `anls@evalscope` every version of that backend's, and
/// `anls@native` (or `anls@native@1`) the built-in ones only (`anls`,
/// `anls@1`: keys with no backend).
fn chooses(name: &str, key: &str) -> bool {
    let native =
        name.split_once("@native")
            .and_then(|(metric, rest)| match rest.strip_prefix('@') {
                Some(version) => Some((metric, Some(version))),
                None => rest.is_empty().then_some((metric, None)),
            });
    if let Some((metric, version)) = native {
        let mut parts = key.split('@');
        let (first, second, more) = (parts.next(), parts.next(), parts.next());
        // No backend segment: nothing after the name, or only a version.
        let built_in = more.is_none() && second.is_none_or(|v| v.parse::<u32>().is_ok());
        return built_in && first == Some(metric) && version.is_none_or(|v| second == Some(v));
    }
    key == name || key.split('@').next() == Some(name) || key.starts_with(&format!("{name}@"))
}

/// What scoring again did.
#[derive(Debug, Clone)]
pub struct Rescored {
    /// Judge calls made again (`--unjudged`), and of those, the ones that
    /// failed again (those answers stay not scored).
    pub judged_again: u64,
    pub judged_again_failed: u64,
    /// Done items scored again, and of those, usable answers.
    pub answers: u64,
    pub usable: u64,
    /// The task's metric keys.
    pub metrics: Vec<String>,
    /// Programs judged again, and how long that took.
    pub rejudged: Option<(usize, Duration)>,
    /// Stored items that are not JSON (their references could not be
    /// rendered).
    pub unreadable: u64,
    /// Usable answers sent to the outside metric backends.
    pub backend_scored: u64,
    /// Their scores that are errors, and the first such error.
    pub backend_errors: u64,
    pub backend_error: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::chooses;

    #[test]
    fn native_chooses_the_built_in_metrics_only() {
        let keys = ["anls@1", "anls@evalscope@1", "anls@evalscope@2", "bleu@1"];
        let chosen = |name: &str| -> Vec<&str> {
            keys.iter().copied().filter(|k| chooses(name, k)).collect()
        };
        assert_eq!(chosen("anls@native"), ["anls@1"]);
        assert_eq!(chosen("anls@native@1"), ["anls@1"]);
        assert!(chosen("anls@native@2").is_empty());
        assert_eq!(
            chosen("anls"),
            ["anls@1", "anls@evalscope@1", "anls@evalscope@2"]
        );
        assert_eq!(
            chosen("anls@evalscope"),
            ["anls@evalscope@1", "anls@evalscope@2"]
        );
        assert_eq!(chosen("anls@evalscope@2"), ["anls@evalscope@2"]);
        assert_eq!(chosen("anls@1"), ["anls@1"]);
    }
}
