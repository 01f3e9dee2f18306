//! One session of a run: the reader feeds pending items to a bounded queue;
//! each endpoint's free slot takes the next item (pull-based, so a fast
//! endpoint takes more and a slow one fewer); an attempt calls the endpoint,
//! retries with backoff on retryable errors (possibly on another endpoint),
//! and hands attempts and results to the one writer.
//!
//! Stopping: `stop` ends reading and dispatching; in-flight calls get
//! `shutdown_grace` to finish; then the writer commits what it has and the
//! store comes back. Items not finished stay pending for a resume.

mod queue;
mod reader;
mod writer;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use evalfleet_types::{
    Assessment, AttemptRecord, CacheEntry, ErrorClass, ItemStatus, ResultRecord, Score, Scores,
    Telemetry, ms, now_ms, unix_ms,
};

use crate::client::{CallError, CallOutcome, ChatClient, Completion, Timing};
use crate::config::{Config, RetryPolicy};
use crate::dataset::{DatasetError, RowReader};
use crate::eval::{Checked, Evaluator, JudgeRequest};
use crate::fleet::runtime::FleetHandle;
use crate::fleet::{Endpoint, EndpointCounters, Permit, Signal};
use crate::store::{Store, StoreError};
use crate::template::Templates;
use queue::{WorkItem, WorkQueue};
use reader::{Reader, ReaderError};
use std::collections::HashMap;
use writer::{Message, Outcome};

/// Live counters of a session, read by progress displays.
pub struct Progress {
    /// Items in the run.
    pub total: u64,
    /// Items already done or failed when the session began.
    pub done_before: u64,
    pub failed_before: u64,
    /// Items that ended in this session.
    pub done: AtomicU64,
    pub failed: AtomicU64,
    /// Results committed to the store in this session.
    pub committed: AtomicU64,
    /// Attempts retried in this session.
    pub retries: AtomicU64,
    /// Each endpoint's name and counters.
    pub endpoints: Vec<(String, Arc<EndpointCounters>)>,
}

impl Progress {
    pub fn new(
        total: u64,
        done_before: u64,
        failed_before: u64,
        endpoints: &[Arc<Endpoint>],
    ) -> Self {
        Self {
            total,
            done_before,
            failed_before,
            done: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            committed: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            endpoints: endpoints
                .iter()
                .map(|e| (e.name.clone(), e.counters.clone()))
                .collect(),
        }
    }

    fn ended(&self, status: ItemStatus) {
        match status {
            ItemStatus::Done => self.done.fetch_add(1, Ordering::Relaxed),
            ItemStatus::Failed => self.failed.fetch_add(1, Ordering::Relaxed),
        };
    }
}

/// What a session works on.
pub struct Session {
    pub run_id: String,
    pub session: u32,
    pub config: Arc<Config>,
    pub templates: Arc<Templates>,
    pub endpoints: Vec<Arc<Endpoint>>,
    /// The fleet, to report health changes and learn when it is exhausted.
    pub fleet: FleetHandle,
    /// This worker's id in the store.
    pub worker: Arc<str>,
    /// Where the code judge makes its sandbox directories (not under /tmp,
    /// which the sandbox replaces).
    pub sandbox_dir: std::path::PathBuf,
}

/// The code judge of a run, with the bound on answers judged at once
/// (enough to keep the judge's slots busy; more only holds rows in memory).
pub struct CodeJudge {
    pub judge: evalfleet_judge::Judge,
    backlog: Arc<tokio::sync::Semaphore>,
}

impl CodeJudge {
    /// Starts the judge of `settings` with its sandbox under `dir` (an HTTP
    /// client only for a remote sandbox), and says what it enforces.
    pub async fn start(
        settings: &evalfleet_judge::CodeSettings,
        dir: &std::path::Path,
    ) -> Result<Self, evalfleet_judge::JudgeError> {
        let http = match settings.backend {
            evalfleet_judge::Backend::SandboxFusion { .. } => Some(
                crate::client::http_client(settings.concurrency).map_err(|e| {
                    evalfleet_judge::JudgeError::Setup(format!("cannot make an HTTP client: {e}"))
                })?,
            ),
            evalfleet_judge::Backend::Local => None,
        };
        let judge = evalfleet_judge::Judge::new(settings.clone(), dir, http).await?;
        if judge.degraded() {
            tracing::warn!("Code judge: {}.", judge.describe());
        } else {
            tracing::info!("Code judge: {}.", judge.describe());
        }
        let backlog = Arc::new(tokio::sync::Semaphore::new(backlog(settings)));
        Ok(Self { judge, backlog })
    }

    /// Judges stored answers again (`evalfleet score --rejudge`): each
    /// `(seq, item, answer)` becomes `(seq, judgement, code_accepted score)`.
    pub async fn judge_again(
        &self,
        answers: Vec<(u64, serde_json::Value, String)>,
    ) -> Vec<(u64, Option<serde_json::Value>, Score)> {
        use futures_util::StreamExt;
        futures_util::stream::iter(answers)
            .map(|(seq, item, answer)| async move {
                let (json, score) = code_outcome(self.judge.judge(&item, &answer).await);
                (seq, json, score)
            })
            .buffer_unordered(backlog(self.judge.settings()))
            .collect()
            .await
    }

    /// What is stored of a valid answer judged as the program for `row`:
    /// its scores with `code_accepted`, and the judgement as JSON.
    pub async fn judged(
        &self,
        eval: &Evaluator,
        checked: &Checked,
        row: &serde_json::Value,
        answer: &str,
        mut scores: Scores,
        reasks: u32,
    ) -> Assessment {
        let (json, score) = code_outcome(self.judge.judge(row, answer).await);
        if let Some(m) = eval
            .metrics()
            .find(|m| matches!(m.kind, crate::eval::metrics::Kind::CodeAccepted))
        {
            scores.insert(m.key.clone(), score);
        }
        let mut stored = checked.assessment(scores, reasks);
        stored.code = json;
        stored
    }
}

/// How many answers are judged at once: enough to keep the judge's slots
/// busy.
fn backlog(settings: &evalfleet_judge::CodeSettings) -> usize {
    settings.concurrency.saturating_mul(2).max(1)
}

/// What is stored of a judgement: the judgement as JSON, and the
/// `code_accepted` score (its value, verdict and tests passed, or the
/// judge's error).
pub fn code_outcome(
    judged: Result<evalfleet_judge::Judgement, evalfleet_judge::JudgeError>,
) -> (Option<serde_json::Value>, Score) {
    match judged {
        Ok(j) => (
            serde_json::to_value(&j).ok(),
            Score::from_json(
                serde_json::json!({"value": f64::from(u8::from(j.accepted)), "verdict": j.verdict.as_str(), "passed": j.passed, "total": j.total}),
            ),
        ),
        Err(error) => (
            None,
            Score::error(format!("the code judge failed: {error}")),
        ),
    }
}

/// How a session ended.
pub struct SessionEnd {
    /// The store, back from the writer with everything committed.
    pub store: Box<dyn Store>,
}

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    #[error("the code judge cannot start")]
    Judge(#[source] evalfleet_judge::JudgeError),
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<ReaderError> for PipelineError {
    fn from(err: ReaderError) -> Self {
        match err {
            ReaderError::Store(err) => Self::Store(err),
            ReaderError::Dataset(err) => Self::Dataset(err),
        }
    }
}

struct Shared {
    session: u32,
    retry: RetryPolicy,
    item_timeout: Duration,
    /// Completion tokens a call may use, for estimating its token cost.
    max_tokens: u64,
    queue: WorkQueue,
    writer: mpsc::Sender<Message>,
    /// Stop taking items: everything is done, the user asked, the fleet is
    /// exhausted, or a part failed.
    halt: CancellationToken,
    /// Abandon calls in flight (the grace period is over, or a part failed).
    abort: CancellationToken,
    tracker: TaskTracker,
    outstanding: AtomicU64,
    progress: Arc<Progress>,
    fleet: FleetHandle,
    /// Parsing, checking and scoring of answers; `None` when the task has
    /// none (the answer is stored as it is).
    eval: Option<Arc<Evaluator>>,
    /// The request identity answers are cached under, when the run writes
    /// the cache.
    cache_writes: Option<String>,
    /// Judge endpoints by name, with the identity their replies are cached
    /// under.
    judges: HashMap<String, (Arc<Endpoint>, String)>,
    code: Option<Arc<CodeJudge>>,
}

impl Shared {
    fn ended(&self, status: ItemStatus) {
        self.progress.ended(status);
        self.release_one();
    }

    /// One item (or the reader's hold) is no longer outstanding; when none
    /// is, the session is over.
    fn release_one(&self) {
        if self.outstanding.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.halt.cancel();
        }
    }

    /// Hands an outcome to the writer; if the writer is gone (it failed), the
    /// session stops.
    async fn send(&self, outcome: Outcome) -> bool {
        if self.writer.send(Message::One(outcome)).await.is_err() {
            self.halt.cancel();
            self.abort.cancel();
            return false;
        }
        true
    }
}

/// The completion tokens a call may use: `max_tokens` (or
/// `max_completion_tokens`) from the task, else a guess.
fn max_tokens(config: &Config) -> u64 {
    ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|key| {
            config
                .task
                .params
                .get(*key)
                .and_then(serde_json::Value::as_u64)
        })
        .unwrap_or(256)
}

/// Runs one session until every pending item has ended, `stop` is cancelled
/// (and in-flight calls have finished or the grace period is over), or the
/// fleet has no endpoint left.
pub async fn execute(
    session: Session,
    writer_store: Box<dyn Store>,
    reader_store: Box<dyn Store>,
    rows: RowReader,
    progress: Arc<Progress>,
    stop: CancellationToken,
) -> Result<SessionEnd, PipelineError> {
    let run_id: Arc<str> = Arc::from(session.run_id.as_str());
    let config = session.config.clone();
    let total_slots: usize = session
        .endpoints
        .iter()
        .map(|e| e.config.max_concurrency())
        .sum();
    // Whatever can fail at the start fails before anything runs.
    let eval = if config.task.eval.checks() || !config.task.eval.metrics.is_empty() {
        Some(Arc::new(
            Evaluator::new(&config.task.eval).map_err(PipelineError::Internal)?,
        ))
    } else {
        None
    };
    let code = match &config.task.code {
        Some(settings) => Some(Arc::new(
            CodeJudge::start(settings, &session.sandbox_dir)
                .await
                .map_err(PipelineError::Judge)?,
        )),
        None => None,
    };
    let (fresh_tx, fresh_rx) = mpsc::channel(total_slots.clamp(64, 16_384));
    let (writer_tx, writer_rx) = mpsc::channel(config.writer.batch_size.clamp(1024, 65_536) * 2);
    let halt = stop.child_token();
    let abort = CancellationToken::new();

    let writer_task = {
        let (halt, abort) = (halt.clone(), abort.clone());
        let task = writer::run(
            writer_rx,
            writer_store,
            writer::Worker {
                run_id: run_id.clone(),
                worker: session.worker.clone(),
                lease: config.timeouts.lease,
            },
            config.writer,
            progress.clone(),
        );
        tokio::spawn(async move {
            let result = task.await;
            if result.is_err() {
                halt.cancel();
                abort.cancel();
            }
            result
        })
    };

    let judges: HashMap<String, (Arc<Endpoint>, String)> = session
        .endpoints
        .iter()
        .filter(|e| e.config.judge)
        .map(|e| {
            let identity =
                crate::cache::identity(&e.config.model, &config.task.params, &e.config.params);
            (e.name.clone(), (e.clone(), identity))
        })
        .collect();
    let identity =
        session.endpoints.iter().find(|e| !e.config.judge).map(|e| {
            crate::cache::identity(&e.config.model, &config.task.params, &e.config.params)
        });
    let cache_reads = match (&identity, config.cache.mode.reads()) {
        (Some(identity), true) => Some(Arc::new(reader::CacheReads {
            identity: identity.clone(),
            since_ms: config.cache.ttl.map_or(0, |ttl| {
                now_ms() - i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX)
            }),
            eval: eval.clone(),
            code: code.clone(),
            judges: judges
                .iter()
                .map(|(name, (_, identity))| (name.clone(), identity.clone()))
                .collect(),
        })),
        _ => None,
    };
    let shared = Arc::new(Shared {
        code: code.clone(),
        judges,
        cache_writes: identity.filter(|_| config.cache.mode.writes()),
        eval,
        session: session.session,
        retry: config.retry,
        item_timeout: config.timeouts.item,
        max_tokens: max_tokens(&config),
        queue: WorkQueue::new(fresh_rx),
        writer: writer_tx,
        halt: halt.clone(),
        abort: abort.clone(),
        tracker: TaskTracker::new(),
        // The reader holds one until it has claimed its last item.
        outstanding: AtomicU64::new(1),
        progress: progress.clone(),
        fleet: session.fleet.clone(),
    });

    let reader_task = {
        let ended = shared.clone();
        let claimed = shared.clone();
        let reader = Reader {
            store: reader_store,
            worker: session.worker.clone(),
            lease: config.timeouts.lease,
            on_claimed: Arc::new(move |n| {
                claimed.outstanding.fetch_add(n, Ordering::AcqRel);
            }),
            rows,
            run_id: run_id.clone(),
            templates: session.templates.clone(),
            queue: fresh_tx,
            writer: shared.writer.clone(),
            halt: halt.clone(),
            on_terminal: Arc::new(move |status| ended.ended(status)),
            cache: cache_reads.clone(),
            session: session.session,
            samples: config.task.samples,
            hits: Vec::new(),
            ended: 0,
            tracker: shared.tracker.clone(),
            abort: abort.clone(),
        };
        let runtime = tokio::runtime::Handle::current();
        let (halt, done) = (halt.clone(), shared.clone());
        tokio::task::spawn_blocking(move || {
            let result = reader.run(runtime);
            if result.is_err() {
                halt.cancel();
            }
            // Nothing more to claim: the session ends with its last item.
            done.release_one();
            result
        })
    };

    // Judge endpoints take no items: attempts call them for judge metrics.
    for endpoint in session.endpoints.iter().filter(|e| !e.config.judge) {
        let span = tracing::info_span!("endpoint", name = %endpoint.name);
        shared
            .tracker
            .spawn(dispatch(shared.clone(), endpoint.clone()).instrument(span));
    }
    {
        // No endpoint left: stop like a Ctrl-C (calls in flight may finish).
        let (exhausted, halt) = (session.fleet.exhausted(), halt.clone());
        shared.tracker.spawn(async move {
            tokio::select! {
                () = exhausted.cancelled() => halt.cancel(),
                () = halt.cancelled() => {}
            }
        });
    }

    halt.cancelled().await;
    shared.tracker.close();
    let interrupted = stop.is_cancelled() || session.fleet.exhausted().is_cancelled();
    if interrupted && shared.outstanding.load(Ordering::Acquire) > 0 {
        tokio::select! {
            () = shared.tracker.wait() => {}
            () = tokio::time::sleep(config.shutdown_grace) => {
                tracing::warn!("Grace period over: abandoning calls still in flight; their items stay pending.");
                abort.cancel();
                shared.tracker.wait().await;
            }
        }
    } else {
        shared.tracker.wait().await;
    }

    let reader_result = reader_task
        .await
        .map_err(|err| PipelineError::Internal(format!("the reader failed: {err}")))?;
    drop(shared);
    let store = writer_task
        .await
        .map_err(|err| PipelineError::Internal(format!("the writer failed: {err}")))??;
    reader_result?;
    Ok(SessionEnd { store })
}

/// One endpoint's dispatcher: while the endpoint takes items, each free slot
/// takes the next item once the endpoint's rate limits allow a call.
async fn dispatch(shared: Arc<Shared>, endpoint: Arc<Endpoint>) {
    loop {
        if !endpoint.wait_accepting(&shared.halt).await {
            return;
        }
        let permit = tokio::select! {
            biased;
            () = shared.halt.cancelled() => return,
            permit = endpoint.limit.acquire() => permit,
        };
        if !endpoint.accepting() {
            continue;
        }
        let Some(item) = shared.queue.next(&shared.halt).await else {
            return;
        };
        let cost = item.messages.get().len() as u64 / 4 + shared.max_tokens;
        tokio::select! {
            biased;
            // The item stays pending for a resume.
            () = shared.halt.cancelled() => return,
            () = endpoint.rate.acquire(cost) => {}
        }
        let client = match endpoint.client() {
            Some(client) if endpoint.accepting() => client,
            _ => {
                // It stopped taking items while this one waited: another
                // endpoint takes it.
                shared.queue.retry(item);
                continue;
            }
        };
        // A debug span costs nothing unless debug logging is on.
        let span = tracing::debug_span!("item", id = %item.item_id, attempt = item.number());
        let call = Call {
            endpoint: endpoint.clone(),
            client,
            permit,
            cost,
        };
        shared
            .tracker
            .spawn(attempt(shared.clone(), call, item).instrument(span));
    }
}

/// What an attempt holds of its endpoint.
struct Call {
    endpoint: Arc<Endpoint>,
    client: Arc<ChatClient>,
    permit: Permit,
    /// The token cost taken from the endpoint's rate limits.
    cost: u64,
}

/// What a call's outcome says to the concurrency controller: only round
/// trips of successful calls, and back pressure (including refused
/// connections).
fn signal(result: &Result<Completion, CallError>, timing: &Timing) -> Signal {
    match result {
        Ok(_) => Signal::Success(timing.ttft.unwrap_or(timing.latency)),
        Err(CallError::Connect(_)) => Signal::BackPressure,
        Err(err) if err.class() == ErrorClass::BackPressure => Signal::BackPressure,
        Err(_) => Signal::Neutral,
    }
}

/// What a call's outcome says about the endpoint's health: `None` when it
/// says nothing (the endpoint is up but said no: 4xx, 429, 503).
fn health(result: &Result<Completion, CallError>) -> Option<bool> {
    match result {
        Ok(_) => Some(true),
        Err(
            CallError::Connect(_)
            | CallError::Transport(_)
            | CallError::Timeout(_)
            | CallError::Truncated
            | CallError::BadResponse(_),
        ) => Some(false),
        Err(CallError::Status { status, .. }) => {
            (*status >= 500 && *status != 503).then_some(false)
        }
    }
}

/// One call for one item, and what follows from its outcome.
async fn attempt(shared: Arc<Shared>, call: Call, mut item: WorkItem) {
    let Call {
        endpoint,
        client,
        permit,
        cost,
    } = call;
    let claim = item.claim;
    let counters = endpoint.counters.clone();
    counters.in_flight.fetch_add(1, Ordering::Relaxed);
    counters.attempts.fetch_add(1, Ordering::Relaxed);
    endpoint.started();
    let number = item.number();
    item.attempts += 1;
    let now = Instant::now();
    let first = *item.first_sent.get_or_insert(now);
    let limit = endpoint
        .timeout
        .min(shared.item_timeout.saturating_sub(now - first))
        .max(Duration::from_millis(1));
    let sent_at = SystemTime::now();
    let evicted = endpoint.eviction();
    enum Ended {
        Abandoned,
        Evicted,
        Answered(Box<Result<CallOutcome, tokio::time::error::Elapsed>>),
    }
    let ended = tokio::select! {
        biased;
        () = shared.abort.cancelled() => Ended::Abandoned,
        () = evicted.cancelled() => Ended::Evicted,
        timed = tokio::time::timeout(limit, client.complete(&item.messages)) => Ended::Answered(Box::new(timed)),
    };
    counters.in_flight.fetch_sub(1, Ordering::Relaxed);
    let timed = match ended {
        // Abandoned at shutdown: nothing is recorded and the item stays pending.
        Ended::Abandoned => return,
        Ended::Evicted => {
            // Not the item's fault: the attempt is recorded but does not
            // count against its budget, and another endpoint takes it now.
            drop(permit);
            item.attempts -= 1;
            item.excused += 1;
            let record = AttemptRecord {
                seq: item.seq,
                attempt: number,
                session: shared.session,
                sent_at_ms: unix_ms(sent_at),
                telemetry: Telemetry {
                    endpoint: endpoint.name.clone(),
                    model: endpoint.model.clone(),
                    latency_ms: ms(sent_at.elapsed().unwrap_or_default()),
                    ..Telemetry::default()
                },
                http_status: None,
                error_class: None,
                error: Some(format!(
                    "moved to another endpoint: {} stopped taking items",
                    endpoint.name
                )),
                cached: false,
            };
            if shared
                .send(Outcome {
                    claim,
                    attempt: Some(record),
                    result: None,
                    cache: None,
                })
                .await
                && !shared.halt.is_cancelled()
            {
                shared.queue.retry(item);
            }
            return;
        }
        Ended::Answered(timed) => timed,
    };
    let (result, timing, quota) = match *timed {
        Ok(outcome) => (outcome.result, outcome.timing, outcome.quota),
        Err(_) => (
            Err(CallError::Timeout(limit)),
            Timing {
                sent_at,
                ttft: None,
                latency: limit,
            },
            None,
        ),
    };

    // What the outcome teaches the fleet. Once calls are paced, a 429 means
    // the pace is a little high, not that too many calls are in flight.
    let rate_limited = result.as_ref().err().is_some_and(|err| {
        err.http_status() == Some(429)
            || (err.http_status() == Some(503) && err.retry_after().is_some())
    });
    let signal = if rate_limited && endpoint.rate.paces() {
        Signal::Neutral
    } else {
        signal(&result, &timing)
    };
    if let Some(decision) = permit.finish(signal) {
        tracing::debug!(
            "Concurrency limit {} -> {} ({}).",
            decision.from,
            decision.to,
            decision.reason.as_str()
        );
    }
    observe_health(&shared, &endpoint, &result);
    let now = Instant::now();
    match &result {
        Ok(completion) => {
            endpoint.rate.on_success(now);
            if let (Some(prompt), Some(completion)) =
                (completion.prompt_tokens, completion.completion_tokens)
            {
                endpoint.rate.correct(cost, prompt + completion);
            }
        }
        Err(err) if rate_limited => {
            for event in endpoint.rate.on_rate_limited(now, err.retry_after()) {
                shared.fleet.rate_event(&endpoint, event);
            }
        }
        Err(_) => {}
    }
    if let Some(quota) = &quota
        && let Some(event) = endpoint.rate.observe(now, quota)
    {
        shared.fleet.rate_event(&endpoint, event);
    }

    let attempts = item.prior_attempts + item.attempts;
    let record = call_record(&shared, &endpoint, item.seq, number, &result, &timing);
    let telemetry = record.telemetry.clone();
    // The item ends here: its id and input row move into the result.
    let result_record = |item: WorkItem,
                         status: ItemStatus,
                         output: Option<String>,
                         error: Option<String>| ResultRecord {
        seq: item.seq,
        item_id: item.item_id,
        status,
        output,
        error,
        telemetry: Some(telemetry.clone()),
        attempts: item.prior_attempts + item.attempts + item.excused,
        item: Some(item.item_json),
        finished_at_ms: now_ms(),
        assessment: Assessment {
            reasks: item.reasks,
            ..Assessment::default()
        },
    };

    let err = match result {
        Ok(Completion { content, .. }) => {
            counters.successes.fetch_add(1, Ordering::Relaxed);
            let cache = shared.cache_writes.as_ref().map(|identity| {
                let key = crate::cache::key(identity, item.sample, &item.messages);
                cache_entry(key, &content, &record)
            });
            let mut judged = None;
            if let Some(eval) = &shared.eval {
                let checked = eval.check(&content);
                if !checked.valid && item.reasks < eval.spec().max_reasks {
                    reask(&shared, eval, item, record, content, &checked, cache).await;
                    return;
                }
                let row: serde_json::Value =
                    serde_json::from_str(&item.item_json).unwrap_or_default();
                let mut scores = eval.score(&checked, &row);
                for request in eval.judge_requests(&checked, &row) {
                    let key = request.key.clone();
                    let Some(score) = judge(&shared, &mut item, request, eval).await else {
                        // Abandoned at shutdown: the item stays pending.
                        return;
                    };
                    scores.insert(key, score);
                }
                judged = Some(match shared.code.as_ref().filter(|_| checked.valid) {
                    Some(code) => {
                        code.judged(eval, &checked, &row, &content, scores, item.reasks)
                            .await
                    }
                    None => checked.assessment(scores, item.reasks),
                });
            }
            let mut done = result_record(item, ItemStatus::Done, Some(content), None);
            if let Some(judged) = judged {
                done.assessment = judged;
            }
            if shared
                .send(Outcome {
                    claim,
                    attempt: Some(record),
                    result: Some(done),
                    cache,
                })
                .await
            {
                shared.ended(ItemStatus::Done);
            }
            return;
        }
        Err(err) => err,
    };

    let class = err.class();
    counters.error(class);
    if rate_limited {
        // The endpoint paces the run; the item did nothing wrong. Its
        // deadline bounds how long it may wait.
        item.attempts -= 1;
        item.excused += 1;
    }
    let reason = if !class.is_retryable() {
        err.to_string()
    } else if item.attempts >= shared.retry.max_attempts {
        format!("gave up after {attempts} attempts: {err}")
    } else {
        let wait = shared.retry.backoff(item.attempts, err.retry_after());
        if first.elapsed() + wait >= shared.item_timeout {
            format!(
                "the item's deadline ({}) would pass before the next attempt: {err}",
                humantime::format_duration(shared.item_timeout)
            )
        } else {
            tracing::debug!(error = %err, "Retrying in {wait:?}.");
            let sent = shared
                .send(Outcome {
                    claim,
                    attempt: Some(record),
                    result: None,
                    cache: None,
                })
                .await;
            if !sent || shared.halt.is_cancelled() {
                // Stopping: the item stays pending for a resume.
                return;
            }
            shared.progress.retries.fetch_add(1, Ordering::Relaxed);
            let retrier = shared.clone();
            shared.tracker.spawn(async move {
                tokio::select! {
                    () = tokio::time::sleep(wait) => retrier.queue.retry(item),
                    () = retrier.halt.cancelled() => {}
                }
            });
            return;
        }
    };
    let failed = result_record(item, ItemStatus::Failed, None, Some(reason));
    if shared
        .send(Outcome {
            claim,
            attempt: Some(record),
            result: Some(failed),
            cache: None,
        })
        .await
    {
        shared.ended(ItemStatus::Failed);
    }
}

/// The cache entry of a successful call's answer.
fn cache_entry(key: String, content: &str, record: &AttemptRecord) -> CacheEntry {
    let t = &record.telemetry;
    CacheEntry {
        key,
        content: content.to_owned(),
        endpoint: t.endpoint.clone(),
        model: t.model.clone(),
        prompt_tokens: t.prompt_tokens,
        completion_tokens: t.completion_tokens,
        finish_reason: t.finish_reason.clone(),
        latency_ms: t.latency_ms,
        created_at_ms: now_ms(),
    }
}

/// What a call's outcome says of its endpoint's health; a change of state
/// is reported to the fleet.
fn observe_health(
    shared: &Shared,
    endpoint: &Arc<Endpoint>,
    result: &Result<Completion, CallError>,
) {
    let transition = endpoint.on_call(health(result));
    if transition.is_some() {
        let why = result
            .as_ref()
            .err()
            .map_or_else(String::new, ToString::to_string);
        shared.fleet.call_transition(endpoint, transition, &why);
    }
}

/// The attempt record of one call.
fn call_record(
    shared: &Shared,
    endpoint: &Endpoint,
    seq: u64,
    number: u32,
    result: &Result<Completion, CallError>,
    timing: &Timing,
) -> AttemptRecord {
    let (completion_tokens, prompt_tokens, finish_reason, status) = match result {
        Ok(c) => (
            c.completion_tokens,
            c.prompt_tokens,
            c.finish_reason.clone(),
            Some(c.http_status),
        ),
        Err(err) => (None, None, None, err.http_status()),
    };
    AttemptRecord {
        seq,
        attempt: number,
        session: shared.session,
        sent_at_ms: unix_ms(timing.sent_at),
        telemetry: Telemetry {
            endpoint: endpoint.name.clone(),
            model: endpoint.model.clone(),
            latency_ms: ms(timing.latency),
            ttft_ms: timing.ttft.map(ms),
            tpot_ms: timing.tpot(completion_tokens).map(ms),
            prompt_tokens,
            completion_tokens,
            finish_reason,
        },
        http_status: status,
        error_class: result.as_ref().err().map(CallError::class),
        error: result.as_ref().err().map(ToString::to_string),
        cached: false,
    }
}

/// One judge metric's call for an item: the judge endpoint's limits and rate
/// apply, each call is an attempt of the item (not counted against its
/// budget), a reply is cached like any answer, and failures are retried up
/// to `retry.max_attempts`. `None`: abandoned at shutdown.
async fn judge(
    shared: &Arc<Shared>,
    item: &mut WorkItem,
    request: JudgeRequest,
    eval: &Evaluator,
) -> Option<Score> {
    let claim = item.claim;
    let messages = match request.messages {
        Ok(messages) => messages,
        Err(error) => return Some(Score::error(error)),
    };
    let Some((endpoint, identity)) = shared.judges.get(&request.endpoint) else {
        return Some(Score::error(format!(
            "no judge endpoint '{}' in this run",
            request.endpoint
        )));
    };
    let mut last_error = String::from("it never answered");
    for tries in 1..=shared.retry.max_attempts {
        let permit = tokio::select! {
            biased;
            () = shared.abort.cancelled() => return None,
            permit = endpoint.limit.acquire() => permit,
        };
        let cost = messages.get().len() as u64 / 4 + shared.max_tokens;
        tokio::select! {
            biased;
            () = shared.abort.cancelled() => return None,
            () = endpoint.rate.acquire(cost) => {}
        }
        let Some(client) = endpoint.client() else {
            last_error = format!("judge endpoint {} is not running", endpoint.name);
            tokio::select! {
                () = shared.abort.cancelled() => return None,
                () = tokio::time::sleep(shared.retry.backoff(tries, None)) => {}
            }
            continue;
        };
        let sent_at = SystemTime::now();
        let timed = tokio::select! {
            biased;
            () = shared.abort.cancelled() => return None,
            timed = tokio::time::timeout(endpoint.timeout, client.complete(&messages)) => timed,
        };
        let (result, timing) = match timed {
            Ok(outcome) => (outcome.result, outcome.timing),
            Err(_) => (
                Err(CallError::Timeout(endpoint.timeout)),
                Timing {
                    sent_at,
                    ttft: None,
                    latency: endpoint.timeout,
                },
            ),
        };
        permit.finish(signal(&result, &timing));
        observe_health(shared, endpoint, &result);
        let record = call_record(shared, endpoint, item.seq, item.number(), &result, &timing);
        item.excused += 1;
        match result {
            Ok(completion) => {
                let cache = shared.cache_writes.as_ref().map(|_| {
                    cache_entry(
                        crate::cache::key(identity, 0, &messages),
                        &completion.content,
                        &record,
                    )
                });
                if !shared
                    .send(Outcome {
                        claim,
                        attempt: Some(record),
                        result: None,
                        cache,
                    })
                    .await
                {
                    return None;
                }
                return Some(eval.judge_score(&request.key, &completion.content));
            }
            Err(err) => {
                if !shared
                    .send(Outcome {
                        claim,
                        attempt: Some(record),
                        result: None,
                        cache: None,
                    })
                    .await
                {
                    return None;
                }
                last_error = err.to_string();
                if !err.class().is_retryable() {
                    break;
                }
                let wait = shared.retry.backoff(tries, err.retry_after());
                tokio::select! {
                    () = shared.abort.cancelled() => return None,
                    () = tokio::time::sleep(wait) => {}
                }
            }
        }
    }
    Some(Score::error(format!("the judge failed: {last_error}")))
}

/// Asks again after an answer that could not be parsed or failed its
/// schema: the answer and what was wrong with it join the conversation, and
/// the item goes back to the queue at once. The call succeeded, so this does
/// not count against the item's attempts.
async fn reask(
    shared: &Arc<Shared>,
    eval: &Evaluator,
    mut item: WorkItem,
    mut record: AttemptRecord,
    answer: String,
    checked: &Checked,
    cache: Option<CacheEntry>,
) {
    let claim = item.claim;
    record.error_class = Some(ErrorClass::InvalidAnswer);
    record.error = Some(checked.reask_note());
    let Some(raw) = eval.reask_messages(&item.messages, &answer, checked) else {
        return;
    };
    item.messages = raw;
    item.reasks += 1;
    item.attempts -= 1;
    item.excused += 1;
    let sent = shared
        .send(Outcome {
            claim,
            attempt: Some(record),
            result: None,
            cache,
        })
        .await;
    if sent && !shared.halt.is_cancelled() {
        shared.progress.retries.fetch_add(1, Ordering::Relaxed);
        shared.queue.retry(item);
    }
}
