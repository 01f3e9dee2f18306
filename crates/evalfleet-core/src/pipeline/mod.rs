//! One session of a run: the reader feeds pending items to a bounded queue;
//! each endpoint's free slot takes the next item (pull-based, so a fast
//! endpoint takes more and a slow one fewer); an attempt calls the endpoint,
//! retries with backoff on retryable errors (possibly on another endpoint),
//! and hands attempts and results to the one writer.
//!
//! Stopping: `stop` ends reading and dispatching; in-flight calls get
//! `shutdown_grace` to finish; then the writer commits what it has and the
//! store comes back. Items not finished stay pending for a resume.

pub mod backoff;
mod queue;
mod reader;
mod writer;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::client::{CallError, Completion, Timing};
use crate::config::{Config, RetryPolicy};
use crate::dataset::{DatasetError, RowReader};
use crate::fleet::{Endpoint, EndpointCounters, Permit};
use crate::store::{AttemptRecord, ItemStatus, ResultRecord, Store, StoreError};
use crate::template::Templates;
use queue::{WorkItem, WorkQueue};
use reader::{Reader, ReaderError};
use writer::Outcome;

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
    /// Pending items when the session began.
    pub pending: u64,
}

/// How a session ended.
pub struct SessionEnd {
    /// The store, back from the writer with everything committed.
    pub store: Box<dyn Store>,
    /// Items still pending.
    pub remaining: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Dataset(#[from] DatasetError),
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
    queue: WorkQueue,
    writer: mpsc::Sender<Outcome>,
    /// Stop taking items: everything is done, or the user asked, or a part failed.
    halt: CancellationToken,
    /// Abandon calls in flight (the grace period is over, or a part failed).
    abort: CancellationToken,
    tracker: TaskTracker,
    outstanding: AtomicU64,
    progress: Arc<Progress>,
}

impl Shared {
    fn ended(&self, status: ItemStatus) {
        self.progress.ended(status);
        if self.outstanding.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.halt.cancel();
        }
    }

    /// Hands an outcome to the writer; if the writer is gone (it failed), the
    /// session stops.
    async fn send(&self, outcome: Outcome) -> bool {
        if self.writer.send(outcome).await.is_err() {
            self.halt.cancel();
            self.abort.cancel();
            return false;
        }
        true
    }
}

/// Runs one session until every pending item has ended or `stop` is
/// cancelled (and in-flight calls have finished or the grace period is over).
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
    let total_slots: usize = session.endpoints.iter().map(|e| e.limit.current()).sum();
    let (fresh_tx, fresh_rx) = mpsc::channel(total_slots.clamp(64, 16_384));
    let (writer_tx, writer_rx) = mpsc::channel(config.writer.batch_size.clamp(1024, 65_536) * 2);
    let halt = stop.child_token();
    let abort = CancellationToken::new();

    let writer_task = {
        let (halt, abort) = (halt.clone(), abort.clone());
        let task = writer::run(
            writer_rx,
            writer_store,
            run_id.clone(),
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

    let shared = Arc::new(Shared {
        session: session.session,
        retry: config.retry,
        item_timeout: config.timeouts.item,
        queue: WorkQueue::new(fresh_rx),
        writer: writer_tx,
        halt: halt.clone(),
        abort: abort.clone(),
        tracker: TaskTracker::new(),
        outstanding: AtomicU64::new(session.pending),
        progress: progress.clone(),
    });
    if session.pending == 0 {
        halt.cancel();
    }

    let reader_task = {
        let ended = shared.clone();
        let reader = Reader {
            store: reader_store,
            rows,
            run_id: run_id.clone(),
            templates: session.templates.clone(),
            queue: fresh_tx,
            writer: shared.writer.clone(),
            halt: halt.clone(),
            on_terminal: Arc::new(move |status| ended.ended(status)),
        };
        let runtime = tokio::runtime::Handle::current();
        let halt = halt.clone();
        tokio::task::spawn_blocking(move || {
            let result = reader.run(runtime);
            if result.is_err() {
                halt.cancel();
            }
            result
        })
    };

    for endpoint in &session.endpoints {
        let span = tracing::info_span!("endpoint", name = %endpoint.name);
        shared
            .tracker
            .spawn(dispatch(shared.clone(), endpoint.clone()).instrument(span));
    }

    halt.cancelled().await;
    shared.tracker.close();
    if stop.is_cancelled() && shared.outstanding.load(Ordering::Acquire) > 0 {
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
    let remaining = shared.outstanding.load(Ordering::Acquire);
    drop(shared);
    let store = writer_task
        .await
        .map_err(|err| PipelineError::Internal(format!("the writer failed: {err}")))??;
    reader_result?;
    Ok(SessionEnd { store, remaining })
}

/// One endpoint's dispatcher: each free slot takes the next item.
async fn dispatch(shared: Arc<Shared>, endpoint: Arc<Endpoint>) {
    loop {
        let permit = tokio::select! {
            biased;
            () = shared.halt.cancelled() => return,
            permit = endpoint.limit.acquire() => permit,
        };
        let Some(item) = shared.queue.next(&shared.halt).await else {
            return;
        };
        // A debug span costs nothing unless debug logging is on.
        let span = tracing::debug_span!("item", id = %item.item_id, attempt = item.prior_attempts + item.attempts + 1);
        shared
            .tracker
            .spawn(attempt(shared.clone(), endpoint.clone(), item, permit).instrument(span));
    }
}

/// Milliseconds, to the microsecond.
fn ms(duration: Duration) -> f64 {
    duration.as_micros() as f64 / 1000.0
}

fn unix_ms(time: SystemTime) -> i64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// One call for one item, and what follows from its outcome.
async fn attempt(shared: Arc<Shared>, endpoint: Arc<Endpoint>, mut item: WorkItem, permit: Permit) {
    let counters = endpoint.counters.clone();
    counters.in_flight.fetch_add(1, Ordering::Relaxed);
    counters.attempts.fetch_add(1, Ordering::Relaxed);
    item.attempts += 1;
    let now = Instant::now();
    let first = *item.first_sent.get_or_insert(now);
    let limit = endpoint
        .timeout
        .min(shared.item_timeout.saturating_sub(now - first))
        .max(Duration::from_millis(1));
    let sent_at = SystemTime::now();
    let outcome = tokio::select! {
        biased;
        () = shared.abort.cancelled() => None,
        timed = tokio::time::timeout(limit, endpoint.client.complete(&item.messages)) => Some(timed),
    };
    drop(permit);
    counters.in_flight.fetch_sub(1, Ordering::Relaxed);
    // Abandoned at shutdown: nothing is recorded and the item stays pending.
    let Some(timed) = outcome else { return };
    let (result, timing) = match timed {
        Ok(outcome) => (outcome.result, outcome.timing),
        Err(_) => (
            Err(CallError::Timeout(limit)),
            Timing {
                sent_at,
                ttft: None,
                latency: limit,
            },
        ),
    };

    let attempts = item.prior_attempts + item.attempts;
    let (completion_tokens, prompt_tokens, finish_reason, status) = match &result {
        Ok(c) => (
            c.completion_tokens,
            c.prompt_tokens,
            c.finish_reason.clone(),
            Some(c.http_status),
        ),
        Err(err) => (None, None, None, err.http_status()),
    };
    let tpot = timing.tpot(completion_tokens);
    let record = AttemptRecord {
        seq: item.seq,
        attempt: attempts,
        session: shared.session,
        endpoint: endpoint.name.clone(),
        model: endpoint.model.clone(),
        sent_at_ms: unix_ms(timing.sent_at),
        latency_ms: ms(timing.latency),
        ttft_ms: timing.ttft.map(ms),
        tpot_ms: tpot.map(ms),
        prompt_tokens,
        completion_tokens,
        finish_reason: finish_reason.clone(),
        http_status: status,
        error_class: result.as_ref().err().map(CallError::class),
        error: result.as_ref().err().map(ToString::to_string),
    };
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
        endpoint: Some(endpoint.name.clone()),
        model: Some(endpoint.model.clone()),
        attempts,
        latency_ms: Some(ms(timing.latency)),
        ttft_ms: timing.ttft.map(ms),
        tpot_ms: tpot.map(ms),
        prompt_tokens,
        completion_tokens,
        finish_reason: finish_reason.clone(),
        item: Some(item.item_json),
        finished_at_ms: unix_ms(SystemTime::now()),
    };

    let err = match result {
        Ok(Completion { content, .. }) => {
            counters.successes.fetch_add(1, Ordering::Relaxed);
            let done = result_record(item, ItemStatus::Done, Some(content), None);
            if shared
                .send(Outcome {
                    attempt: Some(record),
                    result: Some(done),
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
    let reason = if !class.is_retryable() {
        err.to_string()
    } else if item.attempts >= shared.retry.max_attempts {
        format!("gave up after {attempts} attempts: {err}")
    } else {
        let wait = backoff::delay(
            &shared.retry,
            item.attempts,
            err.retry_after(),
            fastrand::f64(),
        );
        if first.elapsed() + wait >= shared.item_timeout {
            format!(
                "the item's deadline ({}) would pass before the next attempt: {err}",
                humantime::format_duration(shared.item_timeout)
            )
        } else {
            tracing::debug!(error = %err, "Retrying in {wait:?}.");
            let sent = shared
                .send(Outcome {
                    attempt: Some(record),
                    result: None,
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
            attempt: Some(record),
            result: Some(failed),
        })
        .await
    {
        shared.ended(ItemStatus::Failed);
    }
}
